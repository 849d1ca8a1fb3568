"""SPIBB in its deep form (Laroche et al. 2019, "Safe policy improvement with baseline bootstrapping";
SPIBB-DQN): the BRPO paper's "SPIBB" baseline, with the known behaviour policy beta of the dataset.

Actions that are too uncertain are "bootstrapped": the learned policy keeps beta's probability for
them, and only the remaining mass is moved greedily. With beta known, the uncertainty test is a
threshold on beta itself (the paper's "bootstrapping set threshold", 0.2, --spibb-threshold):
    B(s) = {a : beta(a|s) < threshold}                                   (bootstrapped actions)
    pi_spibb(a|s) = beta(a|s)                            for a in B(s)
                  + sum_{a' not in B(s)} beta(a'|s)      for a = argmax_{a' not in B(s)} Q(s, a')
                  = 0                                    for the other actions not in B(s)
    (every action bootstrapped: pi_spibb = beta; none: pi_spibb = greedy in Q, i.e. DQN)
    y = r + gamma * (1 - terminal) * sum_a' pi_spibb(a'|s') Q_target(s', a')
where the argmax inside the target is taken on Q_target, as in SPIBB-DQN without double DQN (so
that threshold 0 gives exactly the offline DQN target). beta(.|s') comes from the dataset; at
evaluation beta(.|s) is recomputed at the visited states from the behaviour model stored in the dataset
(common.BehaviorPolicy: collect_data.py's epsilon-greedy rule, or import_data.py's fitted model), and
pi_spibb uses the online Q.
Evaluation samples actions from pi_spibb (default): the SPIBB policy is stochastic, and SPIBB-DQN acts
by sampling it (np.random.choice with test epsilon 0). --eval-greedy acts with argmax pi_spibb instead.
The sampling noise restarts from --eval-seed at every evaluation, so evaluations are reproducible.

Follows SPIBB-DQN (rems75/SPIBB-DQN, ai.py, learning_type "pi_b") in the target and the policy.
Departs from it in: (1) the bootstrapped set is defined by the threshold on beta(a|s) instead of
pseudo-counts of (s, a) compared with N_wedge (--spibb-threshold is the BRPO paper's 0.2; a count
threshold would need state pseudo-counts that the BRPO paper does not describe, and SPIBB-DQN's
kernel counts cost O(N) per state over the N = 100k transitions, at every evaluation step too).
Consequence worth knowing: on epsilon-greedy data, beta takes only two values, eps/|A| for the
non-greedy actions and 1 - eps + eps/|A| >= 1/|A| >= 0.2 for the greedy one (|A| <= 5), so with a
threshold of 0.2 either every non-greedy action is bootstrapped (eps < 0.2 |A|: pi_spibb = beta
exactly, SPIBB *is* the behaviour policy, e.g. CartPole eps <= 0.25, Acrobot and LunarLander
eps <= 0.5) or none is (pi_spibb = greedy in Q, SPIBB *is* offline DQN, e.g. every task at eps = 1,
CartPole at eps = 0.5).
Departs also in: (2) the TD loss is the squared error of this repository's DQN (SPIBB-DQN: Huber,
summed; `--huber-delta 1`: Huber, averaged) and the optimiser/settings are the BRPO paper's shared
ones (appendix "Hyperparameters"): FC(32)-FC(16), Adam lr 1e-3, batch 64, gamma 0.99, soft target update
tau = 0.5 every 500 updates (SPIBB-DQN: RMSprop, hard copies).

    python spibb.py --env-id CartPole-v1 --epsilon 0.15
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
from common import fail, load_checkpoint, load_weights


# --sweep may vary these (and --learning-rate, --gamma, --tau, --target-update-frequency) between the members of one process
MEMBER_FLAGS = ("spibb_threshold",)


@dataclass
class Args(common.TDArgs):
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    spibb_threshold: float = 0.2
    """action a is bootstrapped (keeps beta's probability) when beta(a|s) < threshold; 0 gives DQN"""
    eval_greedy: bool = False
    """act with argmax pi_spibb instead of sampling from pi_spibb"""


class QNetwork(nn.Module):
    """FC(32)-FC(16), the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)



# Masked-out actions get this value before a max: finite, so no inf - inf or 0 * inf = NaN anywhere.
MASK_VALUE = -1e8


def spibb_policy(q: torch.Tensor, beta: torch.Tensor, threshold) -> torch.Tensor:
    """pi_spibb [..., |A|]: beta on the bootstrapped actions (beta < threshold); the rest of the mass,
    1 - sum of the kept beta, on the highest-Q non-bootstrapped action (first index on ties); beta
    itself if every action is bootstrapped."""
    bootstrapped = beta < threshold
    kept = torch.where(bootstrapped, beta, 0.0)
    free_mass = torch.where(bootstrapped.all(-1, keepdim=True), 0.0, (1.0 - kept.sum(-1, keepdim=True)).clamp(min=0.0))
    best = torch.where(bootstrapped, MASK_VALUE, q).argmax(-1, keepdim=True)
    return kept.scatter_add(-1, best, free_mass.to(kept.dtype))


def spibb_target(rewards: torch.Tensor, not_done: torch.Tensor, next_q_target: torch.Tensor, next_beta: torch.Tensor,
                 threshold, gamma) -> torch.Tensor:
    """y = r + gamma * (1 - terminal) * sum_a' pi_spibb(a'|s') Q_target(s', a'), computed as
        sum_a' pi_spibb Q = free_mass * max_{a' not bootstrapped} Q + sum_{a' bootstrapped} beta Q.
    With every action bootstrapped free_mass = 0 multiplies a finite -1e8 (no NaN); with none,
    free_mass = 1 exactly and the bootstrapped beta is 0, which is the DQN target bit for bit."""
    bootstrapped = next_beta < threshold
    bootstrapped_beta = torch.where(bootstrapped, next_beta, 0.0)
    free_mass = torch.where(bootstrapped.all(-1), 0.0, (1.0 - bootstrapped_beta.sum(-1)).clamp(min=0.0))
    free_max = torch.where(bootstrapped, MASK_VALUE, next_q_target).max(-1).values
    value = free_mass * free_max + (bootstrapped_beta * next_q_target).sum(-1)
    return rewards + gamma * value * not_done


def make_policy(q_network: common.Stack, behavior, threshold, greedy: bool):
    """act(obs [M, E, dim], u) -> actions [M, E]: pi_spibb at the visited states (beta from the behaviour network,
    Q from q_network), sampled with the evaluation's uniforms u (seeded with eval_seed + updates so far: each
    evaluation is reproducible on its own, and the last 10 evaluations that make the final score average 10
    independent draws, the noise `behavior_return` is scored with), or its argmax."""
    def act(obs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        pi = spibb_policy(q_network(obs), behavior(obs).float(), threshold)
        return pi.argmax(-1) if greedy else common.sample(pi, u)
    return act


def check_args(args: Args) -> None:
    common.check_args(args)
    if not 0.0 <= args.spibb_threshold <= 1.0:
        fail(f"--spibb-threshold must lie in [0, 1], got {args.spibb_threshold}")


def load_policy(path: str, greedy: bool = False, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs, u), probs(obs, beta) -> pi(.|s) and
    its critic's Q(s, .), on observations [1, N, dim]. beta and the threshold are part of the policy: the ones it was
    trained with."""
    ckpt = load_checkpoint(path, "spibb", {"q_network": dict, "behavior": dict, "args": dict, "n_updates": int})
    threshold = ckpt["args"].get("spibb_threshold")
    if not isinstance(threshold, float) or not 0.0 <= threshold <= 1.0:
        fail(f"checkpoint {path} has no --spibb-threshold in [0, 1]; save it again with --save-model")
    behavior = common.behavior_from_checkpoint(ckpt, path)
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, q_network, ckpt["q_network"])
    q = common.Stack([q_network.net])
    act = make_policy(q, lambda obs: behavior(obs.reshape(-1, obs.shape[-1])).view(*obs.shape[:-1], -1), threshold, greedy)
    return ckpt, act, probs_function(q, threshold, greedy), common.q_function(q)


def probs_function(q_network: common.Stack, threshold, greedy: bool):
    """probs(obs, beta) -> pi_spibb(.|s) (or its argmax), for the improvement certificate."""
    def probs(obs: torch.Tensor, beta: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            pi = spibb_policy(q_network(torch.as_tensor(obs)).double(), torch.from_numpy(beta), threshold).numpy()
        return common.one_hot(pi.argmax(-1), pi.shape[-1]) if greedy else pi
    return probs


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint, args.eval_greedy, args.eval_seed)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed,
                               n_updates=ckpt["n_updates"])


def dataset_statistics(q_network: common.Stack, obs: torch.Tensor, actions: torch.Tensor, beta: torch.Tensor,
                       threshold: float) -> dict:
    """Final diagnostics over the member's batch (one forward): how much SPIBB differs from beta."""
    with torch.no_grad():
        pi = spibb_policy(q_network(obs[None])[0], beta, threshold)
        return {"bootstrapped_actions_mean": float((beta < threshold).sum(1).float().mean()),
                "all_bootstrapped_fraction": float((beta < threshold).all(1).float().mean()),
                "total_variation_to_beta": float(0.5 * (pi - beta).abs().sum(1).mean()),
                "pi_prob_of_batch_action": float(pi.gather(1, actions[:, None]).mean())}


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, behavior_network=True, member_flags=MEMBER_FLAGS)


def train(runs: common.Members) -> None:
    obs, next_obs = runs.tensor("observations"), runs.tensor("next_observations")
    actions, rewards = runs.tensor("actions"), runs.tensor("rewards")
    beta, next_beta = runs.tensor("behavior_probs"), runs.tensor("next_behavior_probs")
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    not_done = 1.0 - runs.tensor("terminals").float()
    gamma, tau, period = runs.column("gamma"), runs.column("tau"), runs.column("target_update_frequency", torch.long)
    td_loss_of = common.td_loss(runs.column("huber_delta"))  # squared error (the paper) or Huber's, per member
    threshold = runs.column("spibb_threshold")[..., None]  # [M, 1, 1]

    q_network = common.Stack(*runs.build(lambda: [QNetwork(runs.obs_dim, runs.n_actions).net]))
    target_network = q_network.copy()
    optimizer = common.Adam(q_network, runs.column("learning_rate"))
    act = make_policy(q_network, runs.behavior(), threshold, runs.first.eval_greedy)

    for step in range(1, runs.first.total_steps + 1):
        batch = runs.minibatch(step)  # batch(t): t's rows [M, batch, ...]
        with torch.no_grad():
            td_target = spibb_target(batch(rewards), batch(not_done), target_network(batch(next_obs)), batch(next_beta),
                                     threshold, gamma)
        q = q_network(batch(obs)).gather(-1, batch(actions).unsqueeze(-1)).squeeze(-1)
        loss = td_loss_of(q, td_target)  # [M]: each member's own mean TD loss
        loss.sum().backward()
        optimizer.step()
        common.soft_update(step, target_network, q_network, period, tau)

        runs.log(step, lambda: {"losses/td_loss": loss, "losses/q_values": q.mean(1)})
        if runs.due(step):
            runs.evaluate(step, [q_network], act, probs_function(q_network, threshold.double(), runs.first.eval_greedy),
                          common.q_function(q_network))

    runs.finish("spibb", lambda m: dataset_statistics(q_network.select([m]), obs[runs.rows(m)], actions[runs.rows(m)],
                                                      beta[runs.rows(m)], runs.args[m].spibb_threshold), lambda m: {
        "obs_dim": runs.obs_dim, "n_actions": runs.n_actions, "q_network": q_network.state_dict(m, "net."),
        "n_updates": runs.first.total_steps, **common.behavior_spec(runs.data[m])})


if __name__ == "__main__":
    common.cli(Args, main)
