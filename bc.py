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

import common
from common import load_checkpoint, load_weights


# --sweep may vary these (and --learning-rate) between the members of one process
MEMBER_FLAGS = ()


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


def make_policy(policy_network: common.Stack, greedy: bool):
    """act(obs [M, E, dim], u) -> actions [M, E]: sampled from the cloned policy with the evaluation's uniforms u
    (each evaluation's noise is seeded with eval_seed + updates so far: reproducible on its own, and the last 10
    evaluations that make the final score average 10 independent draws, the noise `behavior_return` is scored
    with), or its most likely action."""
    def act(obs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        logits = policy_network(obs)
        return logits.argmax(-1) if greedy else common.sample(torch.softmax(logits, -1), u)
    return act


def check_args(args: Args) -> None:
    common.check_args(args)


def load_policy(path: str, greedy: bool = False, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs, u), probs(obs, beta) -> pi(.|s) and
    its critic's Q(s, .) (BC has none), on observations [1, N, dim]."""
    ckpt = load_checkpoint(path, "bc", {"policy_network": dict, "n_updates": int})
    policy_network = PolicyNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, policy_network, ckpt["policy_network"])
    policy = common.Stack([policy_network.net])
    return ckpt, make_policy(policy, greedy), probs_function(policy, greedy), None


def probs_function(policy_network: common.Stack, greedy: bool):
    """probs(obs, beta) -> pi(.|s): what act samples (or its argmax), for the improvement certificate."""
    def probs(obs: torch.Tensor, beta: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits = policy_network(obs).double()
        return common.one_hot(logits.argmax(-1).numpy(), logits.shape[-1]) if greedy else torch.softmax(logits, -1).numpy()
    return probs


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint, args.eval_greedy, args.eval_seed)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed,
                               n_updates=ckpt["n_updates"])


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, member_flags=MEMBER_FLAGS)


def train(runs: common.Members) -> None:
    obs, actions = runs.tensor("observations"), runs.tensor("actions")
    policy_network = common.Stack(*runs.build(lambda: [PolicyNetwork(runs.obs_dim, runs.n_actions).net]))
    optimizer = common.Adam(policy_network, runs.column("learning_rate"))
    act = make_policy(policy_network, runs.first.eval_greedy)
    for step in range(1, runs.first.total_steps + 1):
        batch = runs.minibatch(step)  # batch(t): t's rows [M, batch, ...]
        log_pi = torch.log_softmax(policy_network(batch(obs)), -1)
        loss = -log_pi.gather(-1, batch(actions).unsqueeze(-1)).mean((1, 2))  # [M]: each member's cross-entropy
        loss.sum().backward()
        optimizer.step()

        runs.log(step, {"losses/nll": loss})
        if runs.due(step):
            runs.evaluate(step, [policy_network], act, probs_function(policy_network, runs.first.eval_greedy))

    runs.finish("bc", lambda m: {}, lambda m: {
        "obs_dim": runs.obs_dim, "n_actions": runs.n_actions, "policy_network": policy_network.state_dict(m, "net."),
        "n_updates": runs.first.total_steps})


if __name__ == "__main__":
    common.cli(Args, main)
