"""KL-regularised Q-learning, "KL-Q" (Jaques et al. 2019, "Way off-policy batch deep RL"): the BRPO
paper's "KL-Q" baseline, with the known behaviour policy beta of the dataset as the prior.

Jaques et al.'s KL-control keeps the learned policy pi = softmax(Q(s, .)) close to a prior p by
adding a KL reward to every transition; here the prior is beta, which the dataset stores exactly:
    r_KL(s, a) = c * (log beta(a|s) - log pi(a|s))                                 (--kl-calc sample)
            or  -c * sum_a'' beta(a''|s) * (log beta(a''|s) - log pi(a''|s))       (--kl-calc integral)
    y = r + r_KL(s, a) + gamma * (1 - terminal) * max_a' Q_target(s', a')
with c = 0.1 (--kl-weight; the BRPO paper's final value) and pi computed from the ONLINE network at s
and treated as a constant (no gradient through the KL reward), as in the source.

Variant: the max backup ("KL-control Q"), not the log-sum-exp "Psi-learning" backup. Reasons: it is
the source's default (psi_learning is off unless asked for), the BRPO paper calls the baseline
"KL-regularized Q-learning", and only with the max backup does the method reduce exactly to the
offline DQN of this repository when the KL weight is 0 (a log-sum-exp backup stays soft at c = 0).
--kl-calc: "sample" (default, the source's default) uses the dataset action a, which is drawn from
beta, so it is a one-sample estimate of -KL(beta || pi); "integral" is that KL computed exactly over
all actions (the same direction as the source's integral form, F.kl_div(log pi, beta)).
Numerics: log pi is log_softmax(Q) (finite for any Q, unlike the source's softmax(Q).log()), and
log beta is log(max(beta, 1e-8)), so the exact zeros of beta at epsilon = 0 give a large finite
penalty, never inf or NaN (in "integral" they are multiplied by beta = 0 and vanish).
Evaluation: greedy with respect to Q (the KL reward is already folded into Q; no sampling).
Departs from the source in: the TD loss is the squared error of this repository's DQN (the source
defaults to smooth L1 with gradient value clipping at 1; `--huber-delta 1` is smooth L1, unclipped),
and the shared settings are the BRPO paper's (appendix "Hyperparameters"): FC(32)-FC(16), Adam lr 1e-3,
batch 64, gamma 0.99, soft target update tau = 0.5 every 500 updates. No Monte-Carlo dropout targets or
model averaging (not used by BRPO).

    python klq.py --env-id CartPole-v1 --epsilon 0.15
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

if __name__ == "__main__":  # an interrupt while the libraries below load has nothing to clean up: one line, exit 130
    signal.signal(signal.SIGINT, lambda *_: (print(f"{Path(sys.argv[0]).name}: interrupted; nothing written",
                                                   file=sys.stderr), os._exit(130)))
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))

import numpy as np
import torch
import torch.nn as nn

import common
from common import fail, load_checkpoint, load_weights


# --sweep may vary these (and --learning-rate, --gamma, --tau, --target-update-frequency) between the members of one process
MEMBER_FLAGS = ("kl_weight",)


@dataclass
class Args(common.TDArgs):
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    kl_weight: float = 0.1
    """weight c of the KL reward (0 gives exactly the offline DQN target)"""
    kl_calc: Literal["sample", "integral"] = "sample"
    """KL reward: 'sample' = log beta(a|s) - log pi(a|s) at the dataset action; 'integral' = -KL(beta || pi)"""


class QNetwork(nn.Module):
    """FC(32)-FC(16), the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# Floor of beta inside the log: beta(a|s) is exactly 0 for every non-greedy action at epsilon = 0.
LOG_BETA_FLOOR = 1e-8


def safe_log(p: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.clamp(p, min=LOG_BETA_FLOOR))


def kl_reward(q: torch.Tensor, actions: torch.Tensor, beta: torch.Tensor, kl_weight, kl_calc: str) -> torch.Tensor:
    """c * (log beta - log pi) at the taken action ("sample") or -c * KL(beta || pi) ("integral"), with
    pi = softmax(q); q [M, B, |A|] (no gradient wanted: pass it detached), beta [M, B, |A|], actions [M, B], c [M, 1]."""
    log_pi, a = torch.log_softmax(q, -1), actions.unsqueeze(-1)
    if kl_calc == "sample":
        return kl_weight * (safe_log(beta.gather(-1, a)) - log_pi.gather(-1, a)).squeeze(-1)
    return -kl_weight * (beta * (safe_log(beta) - log_pi)).sum(-1)


def klq_target(rewards: torch.Tensor, not_done: torch.Tensor, next_q_target: torch.Tensor, q: torch.Tensor,
               actions: torch.Tensor, beta: torch.Tensor, gamma, kl_weight, kl_calc: str) -> torch.Tensor:
    """y = r + r_KL(s, a) + gamma * (1 - terminal) * max_a' Q_target(s', a'). A member's KL reward is 0 when its
    weight is 0, so kl_weight = 0 returns the DQN target bit for bit."""
    y = rewards + gamma * next_q_target.max(-1).values * not_done
    return y + torch.where(torch.as_tensor(kl_weight) != 0.0, kl_reward(q, actions, beta, kl_weight, kl_calc), 0.0)


def greedy_policy(q_network: common.Stack):
    """act(obs [M, E, dim], u) -> the greedy actions [M, E] (u, the sampling noise, is unused)."""
    return lambda obs, u=None: q_network(obs).argmax(-1)


def greedy_probs(q_network: common.Stack):
    return lambda obs, beta: common.one_hot(q_network(torch.as_tensor(obs)).argmax(-1).numpy(), beta.shape[-1])


def check_args(args: Args) -> None:
    common.check_args(args)
    if not (args.kl_weight >= 0.0 and np.isfinite(args.kl_weight)):
        fail(f"--kl-weight must be a finite number >= 0, got {args.kl_weight}")


def load_policy(path: str, greedy: bool = True, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs, u), probs(obs, beta) -> pi(.|s)
    (greedy: one-hot) and its critic's Q(s, .), on observations [1, N, dim]."""
    ckpt = load_checkpoint(path, "klq", {"q_network": dict})
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, q_network, ckpt["q_network"])
    q = common.Stack([q_network.net])
    return ckpt, greedy_policy(q), greedy_probs(q), common.q_function(q)


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed)


def dataset_statistics(q_network: common.Stack, obs: torch.Tensor, actions: torch.Tensor, beta: torch.Tensor) -> dict:
    """Final diagnostics over the member's batch (one forward): how far pi = softmax(Q) is from beta."""
    with torch.no_grad():
        q = q_network(obs[None])[0]
        log_pi = torch.log_softmax(q, 1)
        return {"kl_beta_pi_mean": float((beta * (safe_log(beta) - log_pi)).sum(1).mean()),
                "kl_pi_beta_mean": float((log_pi.exp() * (log_pi - safe_log(beta))).sum(1).mean()),
                "greedy_agrees_with_batch": float((q.argmax(1) == actions).float().mean()),
                "greedy_agrees_with_behavior_greedy": float((q.argmax(1) == beta.argmax(1)).float().mean())}


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, member_flags=MEMBER_FLAGS)


def train(runs: common.Members) -> None:
    obs, next_obs = runs.tensor("observations"), runs.tensor("next_observations")
    actions, rewards = runs.tensor("actions"), runs.tensor("rewards")
    behavior_probs = runs.tensor("behavior_probs")  # beta(.|s), the KL prior
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    not_done = 1.0 - runs.tensor("terminals").float()
    gamma, tau, period = runs.column("gamma"), runs.column("tau"), runs.column("target_update_frequency", torch.long)
    td_loss_of = common.td_loss(runs.column("huber_delta"))  # squared error (the paper) or Huber's, per member
    kl_weight, kl_calc = runs.column("kl_weight"), runs.first.kl_calc

    q_network = common.Stack(*runs.build(lambda: [QNetwork(runs.obs_dim, runs.n_actions).net]))
    target_network = q_network.copy()
    optimizer = common.Adam(q_network, runs.column("learning_rate"))
    act = greedy_policy(q_network)

    for step in range(1, runs.first.total_steps + 1):
        batch = runs.minibatch(step)  # batch(t): t's rows [M, batch, ...]
        batch_actions, batch_beta = batch(actions), batch(behavior_probs)
        q_all = q_network(batch(obs))
        with torch.no_grad():
            # pi = softmax of the online Q at s, a constant of the target (as in the source).
            td_target = klq_target(batch(rewards), batch(not_done), target_network(batch(next_obs)), q_all.detach(),
                                   batch_actions, batch_beta, gamma, kl_weight, kl_calc)
        q = q_all.gather(-1, batch_actions.unsqueeze(-1)).squeeze(-1)
        loss = td_loss_of(q, td_target)  # [M]: each member's own mean TD loss
        loss.sum().backward()
        optimizer.step()
        common.soft_update(step, target_network, q_network, period, tau)

        runs.log(step, lambda: {"losses/td_loss": loss, "losses/q_values": q.mean(1), "losses/kl_reward": kl_reward(
            q_all.detach(), batch_actions, batch_beta, kl_weight, kl_calc).mean(1)})  # inputs detached: no graph
        if runs.due(step):
            runs.evaluate(step, [q_network], act, greedy_probs(q_network), common.q_function(q_network))

    runs.finish("klq", lambda m: dataset_statistics(q_network.select([m]), obs[runs.rows(m)], actions[runs.rows(m)],
                                                    behavior_probs[runs.rows(m)]), lambda m: {
        "obs_dim": runs.obs_dim, "n_actions": runs.n_actions, "q_network": q_network.state_dict(m, "net.")})


if __name__ == "__main__":
    common.cli(Args, main)
