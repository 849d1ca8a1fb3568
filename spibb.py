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
summed) and the optimiser/settings are the BRPO paper's shared ones (appendix "Hyperparameters"):
FC(32)-FC(16), Adam lr 1e-3, batch 64, gamma 0.99, soft target update tau = 0.5 every 500 updates
(SPIBB-DQN: RMSprop, hard copies).

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
import torch.nn.functional as F

import common
from common import Evaluations, check_finite, fail, load_checkpoint, load_weights


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


def spibb_policy(q: torch.Tensor, beta: torch.Tensor, threshold: float) -> torch.Tensor:
    """pi_spibb [B, |A|]: beta on the bootstrapped actions (beta < threshold); the rest of the mass,
    1 - sum of the kept beta, on the highest-Q non-bootstrapped action (first index on ties); beta
    itself if every action is bootstrapped."""
    bootstrapped = beta < threshold
    kept = torch.where(bootstrapped, beta, 0.0)
    free_mass = torch.where(bootstrapped.all(1, keepdim=True), 0.0, (1.0 - kept.sum(1, keepdim=True)).clamp(min=0.0))
    best = torch.where(bootstrapped, MASK_VALUE, q).argmax(1, keepdim=True)
    return kept.scatter_add(1, best, free_mass)


def spibb_target(rewards: torch.Tensor, not_done: torch.Tensor, next_q_target: torch.Tensor, free_penalty: torch.Tensor,
                 bootstrapped_beta: torch.Tensor, free_mass: torch.Tensor, gamma: float) -> torch.Tensor:
    """y = r + gamma * (1 - terminal) * sum_a' pi_spibb(a'|s') Q_target(s', a'), from per-transition
    constants of beta(.|s') precomputed once for the whole dataset (see spibb_constants):
        sum_a' pi_spibb Q = free_mass * max_{a' not bootstrapped} Q + sum_{a' bootstrapped} beta Q.
    With every action bootstrapped free_mass = 0 multiplies a finite -1e8 (no NaN); with none,
    free_mass = 1 exactly and bootstrapped_beta = 0, which is the DQN target bit for bit."""
    free_max = (next_q_target + free_penalty).max(1).values
    value = free_mass * free_max + (bootstrapped_beta * next_q_target).sum(1)
    return rewards + gamma * value * not_done


def spibb_constants(beta: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For spibb_target: additive mask (0 free / -1e8 bootstrapped), beta on bootstrapped actions
    (0 elsewhere), and the mass pi_spibb moves to the best free action (as in spibb_policy)."""
    bootstrapped = beta < threshold
    free_penalty = torch.where(bootstrapped, MASK_VALUE, 0.0)
    bootstrapped_beta = torch.where(bootstrapped, beta, 0.0)
    free_mass = torch.where(bootstrapped.all(1), 0.0, (1.0 - bootstrapped_beta.sum(1)).clamp(min=0.0))
    return free_penalty, bootstrapped_beta, free_mass


def make_policy(q_network: QNetwork, behavior: common.BehaviorPolicy, threshold: float, greedy: bool, seed: int):
    """Acting function for evaluate(): pi_spibb at the visited states (beta from the behaviour network,
    Q from q_network), sampled or argmax. The sampling noise of the evaluation after k updates starts from
    seed + k (act.n_updates = k): each evaluation is reproducible on its own (a checkpoint re-evaluates to
    the same returns), and the last 10 evaluations that make the final score average 10 independent draws
    of the policy's randomness, like the behaviour policy's 10 passes in `behavior_return`."""
    generator = torch.Generator()

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            beta = behavior(torch.from_numpy(obs)).float()
            pi = spibb_policy(q_network(torch.from_numpy(obs)), beta, threshold)
            if greedy:
                return pi.argmax(1).numpy()
            return torch.multinomial(pi, 1, generator=generator).squeeze(1).numpy()

    act.n_updates = 0
    act.reset = lambda: generator.manual_seed(seed + act.n_updates)
    return act


def check_args(args: Args) -> None:
    common.check_args(args)
    if not 0.0 <= args.spibb_threshold <= 1.0:
        fail(f"--spibb-threshold must lie in [0, 1], got {args.spibb_threshold}")


def load_policy(path: str, greedy: bool = False, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): its checkpoint, act(obs) for evaluate(), probs(obs, beta) ->
    pi(.|s) and its critic's Q(s, .). beta and the threshold are part of the policy: the ones it was trained with."""
    ckpt = load_checkpoint(path, "spibb", {"q_network": dict, "behavior": dict, "args": dict, "n_updates": int})
    threshold = ckpt["args"].get("spibb_threshold")
    if not isinstance(threshold, float) or not 0.0 <= threshold <= 1.0:
        fail(f"checkpoint {path} has no --spibb-threshold in [0, 1]; save it again with --save-model")
    behavior = common.behavior_from_checkpoint(ckpt, path)
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, q_network, ckpt["q_network"])
    act = make_policy(q_network, behavior, threshold, greedy, eval_seed)
    act.n_updates = ckpt["n_updates"]  # the sampling noise of the run's own evaluation at that point
    return ckpt, act, probs_function(q_network, threshold, greedy), common.q_function(q_network)


def probs_function(q_network: QNetwork, threshold: float, greedy: bool):
    """probs(obs, beta) -> pi_spibb(.|s) (or its argmax), for the improvement certificate."""
    def probs(obs: np.ndarray, beta: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            pi = spibb_policy(q_network(torch.from_numpy(obs)).double(), torch.from_numpy(beta), threshold).numpy()
        return common.one_hot(pi.argmax(1), pi.shape[1]) if greedy else pi
    return probs


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint, args.eval_greedy, args.eval_seed)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed)


def dataset_statistics(q_network: QNetwork, obs: torch.Tensor, actions: torch.Tensor, beta: torch.Tensor,
                       threshold: float) -> dict:
    """Final diagnostics over the whole batch (one forward): how much SPIBB differs from beta."""
    with torch.no_grad():
        pi = spibb_policy(q_network(obs), beta, threshold)
        return {"bootstrapped_actions_mean": float((beta < threshold).sum(1).float().mean()),
                "all_bootstrapped_fraction": float((beta < threshold).all(1).float().mean()),
                "total_variation_to_beta": float(0.5 * (pi - beta).abs().sum(1).mean()),
                "pi_prob_of_batch_action": float(pi.gather(1, actions[:, None]).mean())}


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, behavior_network=True)


def train(args: Args, data: dict, dataset_path: Path, run_dir: Path, writer, obs_dim: int, n_actions: int) -> None:
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    obs = torch.as_tensor(data["observations"])
    next_obs = torch.as_tensor(data["next_observations"])
    actions = torch.as_tensor(data["actions"])
    rewards = torch.as_tensor(data["rewards"])
    # beta(.|s') is fixed by the dataset, so the bootstrapped set of every s' is computed once.
    free_penalty, bootstrapped_beta, free_mass = spibb_constants(torch.as_tensor(data["next_behavior_probs"]),
                                                                 args.spibb_threshold)
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    not_done = torch.as_tensor(1.0 - data["terminals"].astype(np.float32))

    q_network = QNetwork(obs_dim, n_actions)
    target_network = QNetwork(obs_dim, n_actions)
    target_network.load_state_dict(q_network.state_dict())
    # fused: the same Adam update in one kernel instead of a Python loop over the parameter tensors
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)
    eval_envs = common.make_eval_envs(args)
    act = make_policy(q_network, common.behavior_policy(data), args.spibb_threshold, args.eval_greedy, args.eval_seed)

    log = Evaluations(args, writer, data)
    for step in range(1, args.total_steps + 1):
        idx = torch.randint(len(actions), (args.batch_size,), generator=generator)
        with torch.no_grad():
            td_target = spibb_target(rewards[idx], not_done[idx], target_network(next_obs[idx]), free_penalty[idx],
                                     bootstrapped_beta[idx], free_mass[idx], args.gamma)
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
            act.n_updates = step
            log.evaluate(step, act, eval_envs, probs_function(q_network, args.spibb_threshold, args.eval_greedy),
                         common.q_function(q_network))

    log.finish("spibb", data, dataset_path, run_dir, dataset_statistics(q_network, obs, actions, torch.as_tensor(data["behavior_probs"]), args.spibb_threshold), {
        "obs_dim": obs_dim, "n_actions": n_actions, "q_network": q_network.state_dict(), "n_updates": args.total_steps,
        **common.behavior_spec(data)})


if __name__ == "__main__":
    common.cli(Args, main)
