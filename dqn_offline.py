"""Offline DQN: Q-learning on a fixed batch, no further interaction (BRPO paper's "DQN" baseline).

The paper runs online algorithms offline by sampling only from the batch (Sec. "Experimental
Results", footnote). The critic and its settings are the paper's shared ones (appendix,
"Hyperparameters"): FC(32)-FC(16), Adam lr 1e-3, batch 64, gamma 0.99, soft target update
tau = 0.5 applied every 500 updates. The TD loss is the squared error of the paper's Algorithm 1 (`--huber-delta`
> 0: Huber's loss, as Nature DQN), so this critic is exactly BRPO's critic with mu = 1.

    python dqn_offline.py --env-id Acrobot-v1 --epsilon 0.15
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # an interrupt while the libraries below load has nothing to clean up: one line, exit 130
    signal.signal(signal.SIGINT, lambda *_: (print(f"{Path(sys.argv[0]).name}: interrupted; nothing written",
                                                   file=sys.stderr), os._exit(130)))
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))

import torch
import torch.nn as nn

import common
from common import load_checkpoint, load_weights


# --sweep may vary these (and --learning-rate, --gamma, --tau, --target-update-frequency) between the members of one process
MEMBER_FLAGS = ()


@dataclass
class Args(common.TDArgs):
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""


class QNetwork(nn.Module):
    """FC(32)-FC(16), the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def greedy_policy(q_network: common.Stack):
    """act(obs [M, E, dim], u) -> the greedy actions [M, E] (u, the sampling noise, is unused)."""
    return lambda obs, u: q_network(obs).argmax(-1)


def check_args(args: Args) -> None:
    common.check_args(args)


def load_policy(path: str, greedy: bool = True, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs, u) for evaluation, probs(obs, beta) ->
    pi(.|s) (greedy: one-hot) and its critic's Q(s, .), on observations [1, N, dim]."""
    ckpt = load_checkpoint(path, "dqn_offline", {"q_network": dict})
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, q_network, ckpt["q_network"])
    q = common.Stack([q_network.net])
    return ckpt, greedy_policy(q), greedy_probs(q), common.q_function(q)


def greedy_probs(q_network: common.Stack):
    return lambda obs, beta: common.one_hot(q_network(torch.as_tensor(obs)).argmax(-1).numpy(), beta.shape[-1])


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed)


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, member_flags=MEMBER_FLAGS)


def train(runs: common.Members) -> None:
    obs, next_obs = runs.tensor("observations"), runs.tensor("next_observations")
    actions, rewards = runs.tensor("actions"), runs.tensor("rewards")
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    not_done = 1.0 - runs.tensor("terminals").float()
    gamma, tau, period = runs.column("gamma"), runs.column("tau"), runs.column("target_update_frequency", torch.long)
    td_loss_of = common.td_loss(runs.column("huber_delta"))  # squared error (the paper) or Huber's, per member

    q_network = common.Stack(*runs.build(lambda: [QNetwork(runs.obs_dim, runs.n_actions).net]))
    target_network = q_network.copy()
    optimizer = common.Adam(q_network, runs.column("learning_rate"))
    act = greedy_policy(q_network)

    for step in range(1, runs.first.total_steps + 1):
        batch = runs.minibatch(step)  # batch(t): t's rows [M, batch, ...]
        with torch.no_grad():
            target_max = target_network(batch(next_obs)).max(-1).values
            td_target = batch(rewards) + gamma * target_max * batch(not_done)
        q = q_network(batch(obs)).gather(-1, batch(actions).unsqueeze(-1)).squeeze(-1)
        loss = td_loss_of(q, td_target)  # [M]: each member's own mean TD loss
        loss.sum().backward()
        optimizer.step()
        common.soft_update(step, target_network, q_network, period, tau)

        runs.log(step, lambda: {"losses/td_loss": loss, "losses/q_values": q.mean(1)})
        if runs.due(step):
            runs.evaluate(step, [q_network], act, greedy_probs(q_network), common.q_function(q_network))

    runs.finish("dqn_offline", lambda m: {}, lambda m: {
        "obs_dim": runs.obs_dim, "n_actions": runs.n_actions, "q_network": q_network.state_dict(m, "net.")})


if __name__ == "__main__":
    common.cli(Args, main)
