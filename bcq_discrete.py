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
Evaluation is fully greedy, like their non-Atari setting (eval_eps = 0). The loss's gradient is written by hand
(loss_gradient, then Stack.backward): autograd's numbers bit for bit, without building its graph at every update.

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

import torch
import torch.nn as nn

import common
from common import fail, load_checkpoint, load_weights


# --sweep may vary these (and --learning-rate, --gamma, --tau, --target-update-frequency) between the members of one process
MEMBER_FLAGS = ("bcq_threshold",)


@dataclass
class Args(common.TDArgs):
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    bcq_threshold: float = 0.3
    """allowed actions: G(a|s) / max_a G(a|s) >= threshold (0 allows every action, 1 only the most likely)"""
    huber_delta: float = 1.0
    """TD loss: Huber's with this threshold, as the authors' code (0: the squared error)"""


class QNetwork(nn.Module):
    """FC(32)-FC(16), the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def towers(network: common.Stack, x: torch.Tensor, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q-network and the imitation network G: two separate FC(32)-FC(16) networks per member (nothing shared,
    like the authors' FC_Q), stored as networks 2m (Q) and 2m + 1 (G) of one Stack, so one batched matmul runs a
    layer of both. x [M, B, dim] -> (Q-values [M, B, |A|], imitation logits [M, B, |A|]). keep: outside autograd,
    keeping what Stack.backward needs (the training update, whose gradient loss_gradient writes by hand)."""
    out = (network.forward_saved if keep else network)(x.repeat_interleave(2, 0)).unflatten(0, (-1, 2))
    return out[:, 0], out[:, 1]


# Masked-out actions get this value before an argmax: finite, so no inf - inf = NaN anywhere.
MASK_VALUE = -1e8


def log_threshold(threshold: float) -> float:
    return math.log(threshold) if threshold > 0 else -math.inf


def allowed_actions(logits: torch.Tensor, log_tau) -> torch.Tensor:
    """Boolean [..., n_actions]: G(a|s) / max_a' G(a'|s) >= tau, tested in log space
    (logit - max logit = log of the ratio; the softmax normaliser cancels). The most likely
    action is always allowed (0 >= log tau for tau <= 1)."""
    return logits - logits.max(-1, keepdim=True).values >= log_tau


def masked_argmax(q: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """argmax over allowed actions only (first index on ties)."""
    return torch.where(allowed, q, MASK_VALUE).argmax(-1)


def bcq_target(network: common.Stack, target_q_network: common.Stack, next_obs: torch.Tensor, rewards: torch.Tensor,
               not_done: torch.Tensor, gamma, log_tau) -> tuple[torch.Tensor, torch.Tensor]:
    """y = r + gamma * (1 - terminal) * Q_target(s', a'), a' = the online network's best allowed action
    at s' (allowed by the online G). target_q_network: the target's Q towers. Returns y and the allowed-action mask
    at s'."""
    next_q, next_logits = towers(network, next_obs)
    allowed = allowed_actions(next_logits, log_tau)
    next_action = masked_argmax(next_q, allowed)
    target_q = target_q_network(next_obs).gather(-1, next_action.unsqueeze(-1)).squeeze(-1)
    return rewards + gamma * target_q * not_done, allowed


def losses(q_all: torch.Tensor, logits: torch.Tensor, batch_actions: torch.Tensor, td_target: torch.Tensor,
           td_loss_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three terms of each member's loss [M], each a mean over its minibatch: the TD loss (td_loss_of: Huber's
    or the squared error), the imitation NLL and the logit penalty (weighted 0.01 in the sum)."""
    td = td_loss_of(q_all.gather(-1, batch_actions).squeeze(-1), td_target)
    imitation = -torch.log_softmax(logits, -1).gather(-1, batch_actions).mean((1, 2))
    return td, imitation, logits.pow(2).mean((1, 2))


def loss_gradient(huber_delta: torch.Tensor, batch_size: int, n_actions: int):
    """The gradient of the members' summed loss (losses(): td + imitation + 0.01 penalty) with respect to the towers'
    outputs, written by hand so that no autograd graph is built each update: autograd's numbers bit for bit (tested).
    Returns grad(q_all, logits [M, B, |A|], batch_actions, td_target) -> [2M, B, |A|], laid out like the networks
    (Q_1, G_1, Q_2, ...)."""
    squared = huber_delta <= 0 if bool((huber_delta <= 0).any()) else None  # decided once: members on the squared error
    per_logit = float(torch.tensor(0.01) / (batch_size * n_actions))  # the penalty's, rounded in float32 as autograd's

    def grad(q_all: torch.Tensor, logits: torch.Tensor, batch_actions: torch.Tensor, td_target: torch.Tensor):
        e = q_all.gather(-1, batch_actions).squeeze(-1) - td_target
        de = e.clamp(-huber_delta, huber_delta)  # Huber's derivative: e within +-delta, delta sign(e) beyond
        de = (de if squared is None else torch.where(squared, 2 * e, de)) / batch_size  # the squared error's: 2e
        out = torch.zeros(len(q_all), 2, batch_size, n_actions)
        out[:, 0].scatter_(-1, batch_actions, de.unsqueeze(-1))
        # NLL: (softmax - onehot) / B, through log-softmax's own backward; penalty: 0.01 * 2 logits / (B |A|)
        log_g = torch.log_softmax(logits, -1)
        nll = torch.zeros_like(log_g).scatter_(-1, batch_actions, -1.0 / batch_size)
        g_logits = torch._log_softmax_backward_data(nll, log_g, -1, log_g.dtype)
        torch.add(g_logits, per_logit * (2 * logits), out=out[:, 1])
        return out.flatten(0, 1)
    return grad


def greedy_policy(network: common.Stack, log_tau):
    """BCQ's policy: the highest-Q action among the allowed ones; act(obs [M, E, dim], u) -> [M, E]."""
    def act(obs: torch.Tensor, u=None) -> torch.Tensor:
        q, logits = towers(network, obs)
        return masked_argmax(q, allowed_actions(logits, log_tau))
    return act


def check_args(args: Args) -> None:
    common.check_args(args)
    if not 0.0 <= args.bcq_threshold <= 1.0:
        fail(f"--bcq-threshold must lie in [0, 1], got {args.bcq_threshold}")


def load_policy(path: str, greedy: bool = True, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs, u), probs(obs, beta) -> pi(.|s)
    (one-hot) and its critic's Q(s, .), on observations [1, N, dim]."""
    ckpt = load_checkpoint(path, "bcq_discrete", {"q_network": dict, "imitation_network": dict, "args": dict})
    threshold = ckpt["args"].get("bcq_threshold")  # part of the learned policy: the one it was trained with
    if not isinstance(threshold, float) or not 0.0 <= threshold <= 1.0:
        fail(f"checkpoint {path} has no --bcq-threshold in [0, 1] in its args; save it again with --save-model")
    q_network, imitation = QNetwork(ckpt["obs_dim"], ckpt["n_actions"]), QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, q_network, ckpt["q_network"])
    load_weights(path, imitation, ckpt["imitation_network"])
    network = common.Stack([q_network.net, imitation.net])
    act = greedy_policy(network, log_threshold(threshold))
    return ckpt, act, greedy_probs(act), critic(network)


def critic(network: common.Stack):
    """obs [M, N, dim] -> Q(s, .) [M, N, |A|] float64 numpy (the improvement certificate's critic)."""
    return common.q_function(lambda obs: towers(network, obs)[0])


def greedy_probs(act):
    return lambda obs, beta: common.one_hot(act(torch.as_tensor(obs)).numpy(), beta.shape[-1])


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed)


def dataset_statistics(network: common.Stack, obs: torch.Tensor, actions: torch.Tensor, log_tau: float) -> dict:
    """Final diagnostics over the member's batch (one forward): how constrained the policy is."""
    with torch.no_grad():
        q, logits = (x[0] for x in towers(network, obs[None]))
        allowed = allowed_actions(logits, log_tau)
        return {"allowed_actions_mean": float(allowed.sum(1).float().mean()),
                "batch_action_allowed": float(allowed.gather(1, actions[:, None]).float().mean()),
                "imitation_accuracy": float((logits.argmax(1) == actions).float().mean()),
                "policy_agrees_with_batch": float((masked_argmax(q, allowed) == actions).float().mean())}


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, member_flags=MEMBER_FLAGS)


def train(runs: common.Members) -> None:
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    not_done = 1.0 - runs.tensor("terminals").float()
    # one row per transition, [s, s', r, 1 - done, a] (float32 holds action indices exactly), so that an update
    # gathers its minibatch once, not five times
    d, actions = runs.obs_dim, runs.tensor("actions")
    packed = torch.cat([runs.tensor("observations"), runs.tensor("next_observations"), runs.tensor("rewards")[:, None],
                        not_done[:, None], actions[:, None].float()], 1)
    S, NEXT_S, R, NOT_DONE = slice(0, d), slice(d, 2 * d), 2 * d, 2 * d + 1  # packed's columns (the action: last)
    obs = packed[:, S]  # the final statistics' states
    gamma, log_tau = runs.column("gamma"), runs.column("bcq_threshold").log()[..., None]  # log 0 = -inf: all allowed
    pair = lambda x: x.repeat_interleave(2, 0)  # noqa: E731  (a member's value for both of its towers)
    tau, period = pair(runs.column("tau")), pair(runs.column("target_update_frequency", torch.long))
    huber_delta = runs.column("huber_delta")
    td_loss_of = common.td_loss(huber_delta)  # Huber's (delta 1: F.smooth_l1_loss) or the squared error
    gradient = loss_gradient(huber_delta, runs.first.batch_size, runs.n_actions)  # of the loss these terms sum to

    build = lambda: [QNetwork(runs.obs_dim, runs.n_actions).net, QNetwork(runs.obs_dim, runs.n_actions).net]  # noqa
    network = common.Stack([net for nets in zip(*runs.build(build)) for net in nets])  # Q_1, G_1, Q_2, G_2, ...
    target_network = network.copy()
    target_q_network = target_network.part(slice(0, None, 2))  # only the target's Q-values are used
    # one optimizer on the summed loss, as in the authors' code
    optimizer = common.Adam(network, pair(runs.column("learning_rate")))
    act = greedy_policy(network, log_tau)

    for step in range(1, runs.first.total_steps + 1):
        rows = runs.minibatch(step)(packed)  # [M, batch, 2 dim + 3]
        batch_actions = rows[..., -1:].long()
        with torch.no_grad():
            td_target, next_allowed = bcq_target(network, target_q_network, rows[..., NEXT_S], rows[..., R],
                                                 rows[..., NOT_DONE], gamma, log_tau)
        q_all, logits = towers(network, rows[..., S], keep=True)
        optimizer.step(network.backward(gradient(q_all, logits, batch_actions, td_target)))
        common.soft_update(step, target_network, network, period, tau)

        def scalars():  # the losses themselves are computed only on the updates that log them
            td_loss, imitation_loss, logit_penalty = losses(q_all, logits, batch_actions, td_target, td_loss_of)
            return {"losses/td_loss": td_loss, "losses/q_values": q_all.gather(-1, batch_actions).mean((1, 2)),
                    "losses/imitation_loss": imitation_loss, "losses/logit_penalty": logit_penalty,
                    "losses/allowed_fraction": next_allowed.float().mean((1, 2))}
        runs.log(step, scalars)
        if runs.due(step):
            runs.evaluate(step, [network], act, greedy_probs(act), critic(network))

    runs.finish("bcq_discrete", lambda m: dataset_statistics(network.select([2 * m, 2 * m + 1]), obs[runs.rows(m)],
                                                             actions[runs.rows(m)], float(log_tau[m])), lambda m: {
        "obs_dim": runs.obs_dim, "n_actions": runs.n_actions, "q_network": network.state_dict(2 * m, "net."),
        "imitation_network": network.state_dict(2 * m + 1, "net.")})


if __name__ == "__main__":
    common.cli(Args, main)
