"""Behaviour cloning (BRPO paper's "BC" baseline): maximum likelihood of the batch's actions.

Policy network FC(32)-FC(16) with a softmax output (paper appendix, "Hyperparameters"), Adam
lr 1e-3, batch 64. BC estimates the behaviour policy itself, so evaluation *samples* from the
learned distribution by default: the paper's BC column matches the epsilon-greedy behaviour policy
at every epsilon (e.g. CartPole eps=1: 22.6 vs 21.9), which only a sampling policy can do. Use
--eval-greedy to act with the most likely action instead.

    python bc.py --env-id LunarLander-v3 --epsilon 0.05
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
class Args(common.RunArgs):
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    eval_greedy: bool = False
    """act with the most likely action instead of sampling from the cloned policy"""


class PolicyNetwork(nn.Module):
    """FC(32)-FC(16) producing action logits, the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_policy(policy_network: PolicyNetwork, greedy: bool, seed: int):
    """Acting function for evaluate(). The sampling noise of the evaluation after k updates starts from
    seed + k (act.n_updates = k): each evaluation is reproducible on its own (a checkpoint re-evaluates to
    the same returns), and the last 10 evaluations that make the final score average 10 independent draws
    of the policy's randomness, like the behaviour policy's 10 passes in `behavior_return`."""
    generator = torch.Generator()

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits = policy_network(torch.from_numpy(obs))
            if greedy:
                return logits.argmax(1).numpy()
            return torch.multinomial(torch.softmax(logits, 1), 1, generator=generator).squeeze(1).numpy()

    act.n_updates = 0
    act.reset = lambda: generator.manual_seed(seed + act.n_updates)
    return act


def check_args(args: Args) -> None:
    common.check_args(args)


def load_policy(path: str, greedy: bool = False, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs) for evaluate(), probs(obs, beta) ->
    pi(.|s) and its critic's Q(s, .) (BC has none)."""
    ckpt = load_checkpoint(path, "bc", {"policy_network": dict, "n_updates": int})
    policy_network = PolicyNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, policy_network, ckpt["policy_network"])
    act = make_policy(policy_network, greedy, eval_seed)
    act.n_updates = ckpt["n_updates"]  # the sampling noise of the run's own evaluation at that point
    return ckpt, act, probs_function(policy_network, greedy), None


def probs_function(policy_network: PolicyNetwork, greedy: bool):
    """probs(obs, beta) -> pi(.|s): what evaluate() samples (or its argmax), for the improvement certificate."""
    def probs(obs: np.ndarray, beta: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits = policy_network(torch.from_numpy(obs)).double()
        return common.one_hot(logits.argmax(1).numpy(), logits.shape[1]) if greedy else torch.softmax(logits, 1).numpy()
    return probs


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint, args.eval_greedy, args.eval_seed)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed)


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint)


def train(args: Args, data: dict, dataset_path: Path, run_dir: Path, writer, obs_dim: int, n_actions: int) -> None:
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    obs = torch.as_tensor(data["observations"])
    actions = torch.as_tensor(data["actions"])

    policy_network = PolicyNetwork(obs_dim, n_actions)
    # fused: the same Adam update in one kernel instead of a Python loop over the parameter tensors
    optimizer = torch.optim.Adam(policy_network.parameters(), lr=args.learning_rate, fused=True)
    eval_envs = common.make_eval_envs(args)
    act = make_policy(policy_network, args.eval_greedy, args.eval_seed)
    log = Evaluations(args, writer, data)
    for step in range(1, args.total_steps + 1):
        idx = torch.randint(len(actions), (args.batch_size,), generator=generator)
        logits = policy_network(obs[idx])
        loss = F.cross_entropy(logits, actions[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if writer and step % 100 == 0:
            writer.add_scalar("losses/nll", loss.item(), step)

        if log.due(step):
            log.pause()
            check_finite(step, policy_network)
            act.n_updates = step
            log.evaluate(step, act, eval_envs, probs_function(policy_network, args.eval_greedy))

    log.finish("bc", data, dataset_path, run_dir, {}, {
        "obs_dim": obs_dim, "n_actions": n_actions, "policy_network": policy_network.state_dict(),
        "n_updates": args.total_steps})


if __name__ == "__main__":
    common.cli(Args, main)
