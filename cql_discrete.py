"""Discrete Conservative Q-Learning, CQL(H) (Kumar et al. 2020, "Conservative Q-Learning for Offline RL"), on the
offline DQN critic of dqn_offline.py. Not one of the BRPO paper's baselines: an addition of this repository.

CQL adds to the TD loss a regulariser that pushes Q down on every action, weighted by softmax(Q(s, .)), and up on
the batch's action, so that Q is not overestimated on actions the batch does not support (eq. 4, CQL(H)):
    loss = mean_batch huber(Q(s, a) - y) + alpha * mean_batch (logsumexp_a' Q(s, a') - Q(s, a))
    y = r + gamma * (1 - terminal) * max_a' Q_target(s', a'),   huber(e) = e^2 / 2 if |e| < 1, else |e| - 1/2
with alpha = 1 (--cql-alpha; --sweep cql-alpha=0.5,1,2 trains several values side by side). At alpha = 0 this is
dqn_offline.py with --huber-delta 1 exactly. Evaluation: greedy with respect to Q.

Departs from the CQL paper in:
1. The critic and its settings are the BRPO paper's shared ones (appendix "Hyperparameters"): FC(32)-FC(16), Adam
   lr 1e-3, batch 64, gamma 0.99, soft target update tau = 0.5 every 500 updates; the paper's discrete
   experiments build CQL on QR-DQN with its Atari network and settings.
2. The TD loss is Huber's (--huber-delta 1) on one Q-value, where the QR-DQN the paper's discrete experiments build
   on has a quantile Huber loss (kappa = 1); d3rlpy's DiscreteCQL has this one. Its quadratic part has eq. 4's 1/2,
   so alpha here is eq. 4's alpha. `--huber-delta 0` takes dqn_offline.py's squared error (the BRPO paper's
   Algorithm 1) without the 1/2: alpha = 1 is then eq. 4's alpha = 0.5, and CQL falls far short on uniform data
   (docs/experiments/2026-12-06-cql-loss.md).
3. alpha is fixed: the paper's Lagrangian variant, which tunes alpha to a threshold on the gap, is not here.
   The backup is DQN's max over the target network (the greedy policy as pi_k in eq. 4's Bellman operator), not
   d3rlpy's double-Q target.

    python cql_discrete.py --env-id Acrobot-v1 --epsilon 0.15 --cql-alpha 1.0
"""

from __future__ import annotations

import math
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
from common import fail, load_checkpoint, load_weights


# --sweep may vary these (and --learning-rate, --gamma, --tau, --target-update-frequency) between the members of one process
MEMBER_FLAGS = ("cql_alpha",)


@dataclass
class Args(common.TDArgs):
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    cql_alpha: float = 1.0
    """weight alpha of the CQL(H) regulariser logsumexp_a Q(s, a) - Q(s, a_data) (0 gives exactly the offline DQN)"""
    huber_delta: float = 1.0
    """TD loss: Huber's with this delta (departure 2), 0 for the squared error of dqn_offline.py"""


class QNetwork(nn.Module):
    """FC(32)-FC(16), the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def cql_gap(q_all: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """logsumexp_a' Q(s, a') - Q(s, a) per transition, q_all [M, B, |A|], actions [M, B] -> [M, B]; >= 0, since the
    log-sum-exp is at least the largest Q(s, .)."""
    return torch.logsumexp(q_all, -1) - q_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)


def greedy_policy(q_network: common.Stack):
    """act(obs [M, E, dim], u) -> the greedy actions [M, E] (u, the sampling noise, is unused)."""
    return lambda obs, u: q_network(obs).argmax(-1)


def greedy_probs(q_network: common.Stack):
    return lambda obs, beta: common.one_hot(q_network(torch.as_tensor(obs)).argmax(-1).numpy(), beta.shape[-1])


def check_args(args: Args) -> None:
    common.check_args(args)
    if not 0.0 <= args.cql_alpha < math.inf:  # NaN and inf fail too
        fail(f"--cql-alpha must be a finite number >= 0, got {args.cql_alpha}")


def load_policy(path: str, greedy: bool = True, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs, u) for evaluation, probs(obs, beta) ->
    pi(.|s) (greedy: one-hot) and its critic's Q(s, .), on observations [1, N, dim]."""
    ckpt = load_checkpoint(path, "cql_discrete", {"q_network": dict})
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, q_network, ckpt["q_network"])
    q = common.Stack([q_network.net])
    return ckpt, greedy_policy(q), greedy_probs(q), common.q_function(q)


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
    td_loss_of = common.td_loss(runs.column("huber_delta"))  # Huber's (departure 2) or the squared error, per member
    cql_alpha = runs.column("cql_alpha")  # [M, 1]

    q_network = common.Stack(*runs.build(lambda: [QNetwork(runs.obs_dim, runs.n_actions).net]))
    target_network = q_network.copy()
    optimizer = common.Adam(q_network, runs.column("learning_rate"))
    act = greedy_policy(q_network)

    for step in range(1, runs.first.total_steps + 1):
        batch = runs.minibatch(step)  # batch(t): t's rows [M, batch, ...]
        with torch.no_grad():
            target_max = target_network(batch(next_obs)).max(-1).values
            td_target = batch(rewards) + gamma * target_max * batch(not_done)
        q_all = q_network(batch(obs))
        q = q_all.gather(-1, batch(actions).unsqueeze(-1)).squeeze(-1)
        td_loss = td_loss_of(q, td_target)  # [M]: each member's own mean TD loss, as dqn_offline.py
        gap = cql_gap(q_all, batch(actions))  # [M, batch]
        # CQL(H), eq. 4 of Kumar et al.: alpha * E_s[logsumexp_a Q(s, a) - E_{a~beta}[Q(s, a)]] (the batch's action
        # is the sample of a ~ beta), added to the TD loss; its gradient is alpha * (softmax(Q(s, .)) - onehot(a)).
        loss = td_loss + (cql_alpha * gap).mean(1)
        loss.sum().backward()
        optimizer.step()
        common.soft_update(step, target_network, q_network, period, tau)

        runs.log(step, lambda: {"losses/td_loss": td_loss, "losses/cql_loss": gap.mean(1), "losses/q_values": q.mean(1)})
        if runs.due(step):
            runs.evaluate(step, [q_network], act, greedy_probs(q_network), common.q_function(q_network))

    runs.finish("cql_discrete", lambda m: {}, lambda m: {
        "obs_dim": runs.obs_dim, "n_actions": runs.n_actions, "q_network": q_network.state_dict(m, "net.")})


if __name__ == "__main__":
    common.cli(Args, main)
