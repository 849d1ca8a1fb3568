"""Offline DQN: Q-learning on a fixed batch, no further interaction (BRPO paper's "DQN" baseline).

The paper runs online algorithms offline by sampling only from the batch (Sec. "Experimental
Results", footnote). The critic and its settings are the paper's shared ones (appendix,
"Hyperparameters"): FC(32)-FC(16), Adam lr 1e-3, batch 64, gamma 0.99, soft target update
tau = 0.5 applied every 500 updates. The TD loss is the squared error of the paper's Algorithm 1,
so this critic is exactly BRPO's critic with mu = 1.

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

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import Evaluations, check_finite, load_checkpoint, load_weights


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


def greedy_policy(q_network: QNetwork):
    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return q_network(torch.from_numpy(obs)).argmax(1).numpy()
    return act


def check_args(args: Args) -> None:
    common.check_args(args)


def load_policy(path: str, greedy: bool = True, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs) for evaluate(), probs(obs, beta) ->
    pi(.|s) (greedy: one-hot) and its critic's Q(s, .)."""
    ckpt = load_checkpoint(path, "dqn_offline", {"q_network": dict})
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, q_network, ckpt["q_network"])
    act = greedy_policy(q_network)
    return ckpt, act, lambda obs, beta: common.one_hot(act(obs), ckpt["n_actions"]), common.q_function(q_network)


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed)


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint)


def train(args: Args, data: dict, dataset_path: Path, run_dir: Path, writer, obs_dim: int, n_actions: int) -> None:
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    obs = torch.as_tensor(data["observations"])
    next_obs = torch.as_tensor(data["next_observations"])
    actions = torch.as_tensor(data["actions"])
    rewards = torch.as_tensor(data["rewards"])
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    not_done = torch.as_tensor(1.0 - data["terminals"].astype(np.float32))

    q_network = QNetwork(obs_dim, n_actions)
    target_network = QNetwork(obs_dim, n_actions)
    target_network.load_state_dict(q_network.state_dict())
    # fused: the same Adam update in one kernel instead of a Python loop over the parameter tensors
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)
    eval_envs = common.make_eval_envs(args)
    act = greedy_policy(q_network)

    log = Evaluations(args, writer, data)
    for step in range(1, args.total_steps + 1):
        idx = torch.randint(len(actions), (args.batch_size,), generator=generator)
        with torch.no_grad():
            target_max = target_network(next_obs[idx]).max(1).values
            td_target = rewards[idx] + args.gamma * target_max * not_done[idx]
        q = q_network(obs[idx]).gather(1, actions[idx, None]).squeeze(1)
        loss = F.mse_loss(q, td_target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if step % args.target_update_frequency == 0:
            with torch.no_grad():
                for p, tp in zip(q_network.parameters(), target_network.parameters()):
                    tp.lerp_(p, args.tau)

        if writer and step % 100 == 0:
            writer.add_scalar("losses/td_loss", loss.item(), step)
            writer.add_scalar("losses/q_values", q.mean().item(), step)

        if log.due(step):
            log.pause()
            check_finite(step, q_network)
            log.evaluate(step, act, eval_envs, lambda obs, beta: common.one_hot(act(obs), n_actions),
                         common.q_function(q_network))

    log.finish("dqn_offline", data, dataset_path, run_dir, {}, {
        "obs_dim": obs_dim, "n_actions": n_actions, "q_network": q_network.state_dict()})


if __name__ == "__main__":
    common.cli(Args, main)
