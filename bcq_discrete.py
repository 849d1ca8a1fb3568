"""Discrete BCQ (Fujimoto et al. 2019, "Benchmarking batch deep RL algorithms"), the BRPO paper's
"BCQ" baseline.

A Q-network is trained together with an imitation network G(a|s), a softmax model of the batch's
actions. Only actions that G finds likely enough are "allowed":
    A(s) = {a : G(a|s) / max_a' G(a'|s) >= tau},   tau = 0.3 (--bcq-threshold; paper's final value)
and both the bootstrap target and the acting policy use allowed actions only:
    a' = argmax_{a in A(s')} Q(s', a)                     (ONLINE Q-network and ONLINE G)
    y  = r + gamma * (1 - terminal) * Q_target(s', a')    (evaluated by the TARGET network: double DQN)
    loss = Huber(Q(s, a), y) + NLL_G(a | s) + 0.01 * mean(logits_G(s)^2)
    policy(s) = argmax_{a in A(s)} Q(s, a)                (greedy, at evaluation)

Follows the authors' code (sfujim/BCQ, discrete_BCQ/discrete_BCQ.py) in: separate Q and G towers
trained by one optimizer on the summed loss (their low-dimensional FC_Q model shares nothing between
the two towers; here each tower is the paper's FC(32)-FC(16)), the Huber (smooth L1) TD loss, the
imitation negative log-likelihood, the 0.01 weight of the logit penalty, the online-mask /
online-argmax / target-evaluation target, and masking with a large finite negative number (-1e8,
never -inf, so no NaN can appear).
Departs from it in: the threshold test is ">= tau" (the authors' code uses "> tau": the two differ
only on exact ties, and ">=" keeps the most likely action allowed for every tau <= 1, even tau = 1);
the ratio test is done in log space, logit - max logit >= log tau (the same test in real arithmetic,
without exp or a 0/0); and the shared settings are the BRPO paper's (appendix
"Hyperparameters"): Adam lr 1e-3, batch 64, gamma 0.99, soft target update tau = 0.5 every 500
updates (their non-Atari defaults: Adam lr 3e-4, batch 64, polyak 0.005 after every update).
Evaluation is fully greedy, like their non-Atari setting (eval_eps = 0).

    python bcq_discrete.py --env-id CartPole-v1 --epsilon 0.15
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

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import Evaluations, check_finite, fail, load_checkpoint, load_weights


@dataclass
class Args(common.TDArgs):
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    bcq_threshold: float = 0.3
    """allowed actions: G(a|s) / max_a G(a|s) >= threshold (0 allows every action, 1 only the most likely)"""


class QNetwork(nn.Module):
    """FC(32)-FC(16), the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BCQNetwork(nn.Module):
    """The Q-network and the imitation network G: two separate FC(32)-FC(16) networks (nothing shared,
    like the authors' FC_Q), evaluated together. Layer l of both is stored as one stacked weight
    [2, in, out] (tower 0 = Q, tower 1 = G; nn.Linear's weight transposed) and bias [2, 1, out], so one
    batched matmul runs the layer for both networks: half the kernel launches and autograd nodes of
    two nn.Sequential, which is what the throughput target needs. Mathematically identical to two
    independent networks (no weight is shared), and initialised exactly like nn.Linear layers.
    forward(x) returns (Q-values [B, |A|], imitation logits [B, |A|])."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        q_net, g_net = QNetwork(obs_dim, n_actions).net, QNetwork(obs_dim, n_actions).net

        def stacked_weight(i: int) -> nn.Parameter:
            return nn.Parameter(torch.stack((q_net[i].weight.detach().T, g_net[i].weight.detach().T)))

        def stacked_bias(i: int) -> nn.Parameter:
            return nn.Parameter(torch.stack((q_net[i].bias.detach()[None], g_net[i].bias.detach()[None])))

        # Plain attributes, not a ParameterList: indexing one costs more than the layer itself.
        self.w0, self.b0 = stacked_weight(0), stacked_bias(0)
        self.w1, self.b1 = stacked_weight(2), stacked_bias(2)
        self.w2, self.b2 = stacked_weight(4), stacked_bias(4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.baddbmm(self.b0, x.expand(2, *x.shape), self.w0).relu()
        h = torch.baddbmm(self.b1, h, self.w1).relu()
        out = torch.baddbmm(self.b2, h, self.w2)
        return out[0], out[1]


# Masked-out actions get this value before an argmax: finite, so no inf - inf = NaN anywhere.
MASK_VALUE = -1e8


def log_threshold(threshold: float) -> float:
    return math.log(threshold) if threshold > 0 else -math.inf


def allowed_actions(logits: torch.Tensor, log_tau: float) -> torch.Tensor:
    """Boolean [batch, n_actions]: G(a|s) / max_a' G(a'|s) >= tau, tested in log space
    (logit - max logit = log of the ratio; the softmax normaliser cancels). The most likely
    action is always allowed (0 >= log tau for tau <= 1)."""
    return logits - logits.max(1, keepdim=True).values >= log_tau


def masked_argmax(q: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """argmax over allowed actions only (first index on ties)."""
    return torch.where(allowed, q, MASK_VALUE).argmax(1)


def bcq_target(network: BCQNetwork, target_network: BCQNetwork, next_obs: torch.Tensor, rewards: torch.Tensor,
               not_done: torch.Tensor, gamma: float, log_tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = r + gamma * (1 - terminal) * Q_target(s', a'), a' = the online network's best allowed action
    at s' (allowed by the online G). Returns y and the allowed-action mask at s'."""
    next_q, next_logits = network(next_obs)
    allowed = allowed_actions(next_logits, log_tau)
    next_action = masked_argmax(next_q, allowed)
    target_q = target_network(next_obs)[0].gather(1, next_action[:, None]).squeeze(1)
    return rewards + gamma * target_q * not_done, allowed


def greedy_policy(network: BCQNetwork, log_tau: float):
    """BCQ's policy: the highest-Q action among the allowed ones."""
    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            q, logits = network(torch.from_numpy(obs))
            return masked_argmax(q, allowed_actions(logits, log_tau)).numpy()
    return act


def check_args(args: Args) -> None:
    common.check_args(args)
    if not 0.0 <= args.bcq_threshold <= 1.0:
        fail(f"--bcq-threshold must lie in [0, 1], got {args.bcq_threshold}")


def load_policy(path: str, greedy: bool = True, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs) for evaluate(), probs(obs, beta) ->
    pi(.|s) (one-hot) and its critic's Q(s, .)."""
    ckpt = load_checkpoint(path, "bcq_discrete", {"network": dict, "args": dict})
    threshold = ckpt["args"].get("bcq_threshold")  # part of the learned policy: the one it was trained with
    if not isinstance(threshold, float) or not 0.0 <= threshold <= 1.0:
        fail(f"checkpoint {path} has no --bcq-threshold in [0, 1] in its args; save it again with --save-model")
    network = BCQNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, network, ckpt["network"])
    act = greedy_policy(network, log_threshold(threshold))
    return ckpt, act, lambda obs, beta: common.one_hot(act(obs), ckpt["n_actions"]), common.q_function(network)


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed)


def dataset_statistics(network: BCQNetwork, obs: torch.Tensor, actions: torch.Tensor, log_tau: float) -> dict:
    """Final diagnostics over the whole batch (one forward): how constrained the policy is."""
    with torch.no_grad():
        q, logits = network(obs)
        allowed = allowed_actions(logits, log_tau)
        return {"allowed_actions_mean": float(allowed.sum(1).float().mean()),
                "batch_action_allowed": float(allowed.gather(1, actions[:, None]).float().mean()),
                "imitation_accuracy": float((logits.argmax(1) == actions).float().mean()),
                "policy_agrees_with_batch": float((masked_argmax(q, allowed) == actions).float().mean())}


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

    network = BCQNetwork(obs_dim, n_actions)
    target_network = BCQNetwork(obs_dim, n_actions)  # only its Q-values are used
    target_network.load_state_dict(network.state_dict())
    # one optimizer on the summed loss, as in the authors' code; fused: the same Adam update in one kernel
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate, fused=True)
    log_tau = log_threshold(args.bcq_threshold)
    eval_envs = common.make_eval_envs(args)
    act = greedy_policy(network, log_tau)

    log = Evaluations(args, writer, data)
    for step in range(1, args.total_steps + 1):
        idx = torch.randint(len(actions), (args.batch_size,), generator=generator)
        batch_actions = actions[idx]
        with torch.no_grad():
            td_target, next_allowed = bcq_target(network, target_network, next_obs[idx], rewards[idx], not_done[idx],
                                                 args.gamma, log_tau)
        q_all, logits = network(obs[idx])
        q = q_all.gather(1, batch_actions[:, None]).squeeze(1)
        td_loss = F.smooth_l1_loss(q, td_target)
        imitation_loss = F.cross_entropy(logits, batch_actions)  # = NLL of log_softmax(logits)
        logit_penalty = logits.pow(2).mean()
        loss = td_loss + imitation_loss + 0.01 * logit_penalty
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if step % args.target_update_frequency == 0:
            with torch.no_grad():
                for p, tp in zip(network.parameters(), target_network.parameters()):
                    tp.lerp_(p, args.tau)

        if writer and step % 100 == 0:
            writer.add_scalar("losses/td_loss", td_loss.item(), step)
            writer.add_scalar("losses/q_values", q.mean().item(), step)
            writer.add_scalar("losses/imitation_loss", imitation_loss.item(), step)
            writer.add_scalar("losses/logit_penalty", logit_penalty.item(), step)
            writer.add_scalar("losses/allowed_fraction", next_allowed.float().mean().item(), step)

        if log.due(step):
            log.pause()
            check_finite(step, network)
            log.evaluate(step, act, eval_envs, lambda obs, beta: common.one_hot(act(obs), n_actions),
                         common.q_function(network))

    log.finish("bcq_discrete", data, dataset_path, run_dir, dataset_statistics(network, obs, actions, log_tau), {
        "obs_dim": obs_dim, "n_actions": n_actions, "network": network.state_dict()})


if __name__ == "__main__":
    common.cli(Args, main)
