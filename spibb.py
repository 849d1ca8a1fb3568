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
evaluation beta(.|s) is recomputed at the visited states from the stored behaviour Q-network and
epsilon, beta(a|s) = (1 - eps) * 1[a = argmax Q_b(s)] + eps / |A| (float64, first index on ties,
exactly the rule of collect_data.py), and pi_spibb uses the online Q.
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

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

REPO = Path(__file__).resolve().parent
FORMAT_VERSION = 1


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    env_id: str = "CartPole-v1"
    """gymnasium environment id (CartPole-v1, Acrobot-v1, LunarLander-v3)"""
    epsilon: float = 0.15
    """exploration level of the behaviour policy that collected the dataset"""
    seed: int = 1
    """seed of network initialisation and minibatch sampling"""
    dataset_path: Optional[str] = None
    """batch dataset (.npz from collect_data.py); default datasets/<env-id>_eps<epsilon>.npz, created if missing"""
    total_steps: int = 100_000
    """gradient updates (the paper does not state its number; 100k is our documented default)"""
    learning_rate: float = 1e-3
    """Adam learning rate of the Q-network"""
    batch_size: int = 64
    """minibatch size"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 0.5
    """soft target update rate: target <- tau * online + (1 - tau) * target"""
    target_update_frequency: int = 500
    """updates between soft target updates"""
    eval_frequency: int = 1_000
    """updates between evaluations in the simulator"""
    eval_episodes: int = 40
    """episodes per evaluation, run side by side"""
    eval_seed: int = 10_000
    """evaluation episode i starts from env.reset(seed=eval_seed + i), the same at every evaluation"""
    runs_dir: str = "runs"
    """directory holding one sub-directory per run"""
    run_name: Optional[str] = None
    """sub-directory name of this run; default <env>__eps<eps>__<exp>__<seed>__<time>"""
    tensorboard: bool = True
    """write TensorBoard curves to runs/<run-name>/"""
    save_model: bool = False
    """save runs/<run-name>/model.pt, which --eval-checkpoint can evaluate on its own"""
    eval_checkpoint: Optional[str] = None
    """evaluate this saved model.pt (no training, no dataset) and exit"""
    threads: int = 1
    """torch intra-op threads (tiny MLPs run fastest on one)"""
    spibb_threshold: float = 0.2
    """action a is bootstrapped (keeps beta's probability) when beta(a|s) < threshold; 0 gives DQN"""
    eval_greedy: bool = False
    """act with argmax pi_spibb instead of sampling from pi_spibb"""


def fail(msg: str) -> None:
    """One line on stderr, exit status 1, no traceback."""
    raise SystemExit(f"{Path(sys.argv[0]).name}: error: {msg}")


def check_args(args: Args) -> None:
    positive = ("total_steps", "batch_size", "target_update_frequency", "eval_frequency", "eval_episodes", "threads")
    for name in positive:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0.0 <= args.epsilon <= 1.0:
        fail(f"--epsilon must lie in [0, 1], got {args.epsilon}")
    if not args.learning_rate > 0:
        fail(f"--learning-rate must be positive, got {args.learning_rate}")
    if not 0.0 <= args.gamma < 1.0:
        fail(f"--gamma must lie in [0, 1), got {args.gamma}")
    if not 0.0 < args.tau <= 1.0:
        fail(f"--tau must lie in (0, 1], got {args.tau}")
    if not 0.0 <= args.spibb_threshold <= 1.0:
        fail(f"--spibb-threshold must lie in [0, 1], got {args.spibb_threshold}")


def make_env(env_id: str) -> gym.Env:
    if env_id == "LunarLander-v2":
        fail("LunarLander-v2 is not registered in gymnasium 1.x; use --env-id LunarLander-v3")
    try:
        env = gym.make(env_id, disable_env_checker=True)
    except gym.error.Error as e:
        fail(f"cannot make environment {env_id!r}: {e}")
    except ModuleNotFoundError as e:
        fail(f"environment {env_id!r} needs a missing package ({e}); pip install 'gymnasium[box2d]'")
    if not isinstance(env.action_space, gym.spaces.Discrete):
        fail(f"{env_id} has a {type(env.action_space).__name__} action space; only discrete actions are supported")
    return env


def load_dataset(args: Args, obs_dim: int, n_actions: int) -> tuple[Path, dict]:
    """Read and validate the batch; a missing *default* dataset is created with collect_data.py."""
    path = Path(args.dataset_path) if args.dataset_path else REPO / "datasets" / f"{args.env_id}_eps{args.epsilon:g}.npz"
    how = f"python collect_data.py --env-id {args.env_id} --epsilon {args.epsilon:g} --overwrite" + (
        f" --dataset-path {path}" if args.dataset_path else "")
    if not path.exists():
        if args.dataset_path:
            fail(f"dataset {path} not found; create it with: {how}")
        print(f"dataset {path} not found: creating it from the committed behaviour policy", flush=True)
        cmd = [sys.executable, str(REPO / "collect_data.py"), "--env-id", args.env_id, "--epsilon", f"{args.epsilon:g}"]
        if subprocess.run(cmd).returncode != 0:
            fail(f"could not create dataset {path} (see the collect_data.py message above)")
    keys = ("observations", "actions", "rewards", "next_observations", "terminals", "timeouts",
            "behavior_probs", "next_behavior_probs", "epsilon", "env_id", "behavior_return", "format_version",
            *BEHAVIOR_KEYS)
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in keys if k not in f.files]
            if missing:
                fail(f"dataset {path} lacks {missing}: it was not written by collect_data.py; recreate it with: {how}")
            d = {k: f[k] for k in keys}
    except SystemExit:
        raise
    except Exception as e:  # truncated or corrupt zip, bad pickle-free array, I/O error
        fail(f"dataset {path} is unreadable ({type(e).__name__}: {e}); it is corrupt or truncated, recreate it with: {how}")
    if int(d["format_version"]) != FORMAT_VERSION:
        fail(f"dataset {path} has format version {int(d['format_version'])}, expected {FORMAT_VERSION}; recreate it with: {how}")
    if str(d["env_id"]) != args.env_id:
        fail(f"dataset {path} was recorded on {d['env_id']}, not {args.env_id}; pass --env-id {d['env_id']} or another dataset")
    if not np.isclose(float(d["epsilon"]), args.epsilon):
        fail(f"dataset {path} was collected with epsilon {float(d['epsilon']):g}, not {args.epsilon:g}; pass --epsilon {float(d['epsilon']):g}")
    n = len(d["actions"])
    shapes = {"observations": (n, obs_dim), "next_observations": (n, obs_dim), "rewards": (n,), "terminals": (n,),
              "timeouts": (n,), "behavior_probs": (n, n_actions), "next_behavior_probs": (n, n_actions)}
    for k, shape in shapes.items():
        if d[k].shape != shape:
            fail(f"dataset {path}: {k} has shape {d[k].shape}, expected {shape} for {args.env_id} "
                 f"(observation size {obs_dim}, {n_actions} actions); was it recorded on another task?")
    if n == 0:
        fail(f"dataset {path} is empty; recreate it with: {how}")
    for k in ("observations", "next_observations", "rewards", "behavior_probs", "next_behavior_probs"):
        if not np.isfinite(d[k]).all():
            fail(f"dataset {path}: {k} contains NaN or inf ({np.count_nonzero(~np.isfinite(d[k]))} values); recreate it with: {how}")
    if d["actions"].min() < 0 or d["actions"].max() >= n_actions:
        fail(f"dataset {path}: actions outside [0, {n_actions}); was it recorded on another task?")
    for k in ("behavior_probs", "next_behavior_probs"):
        if (d[k] < 0).any() or not np.allclose(d[k].sum(1), 1.0, atol=1e-4):
            fail(f"dataset {path}: {k} rows are not probability distributions; recreate it with: {how}")
    # Evaluation recomputes beta from the stored behaviour network: it must be the one that made the data.
    weights = {k.removeprefix("behavior_"): d[k] for k in BEHAVIOR_KEYS}
    expected = {"w0": (32, obs_dim), "b0": (32,), "w1": (16, 32), "b1": (16,), "w2": (n_actions, 16),
                "b2": (n_actions,)}
    if any(weights[k].shape != shape for k, shape in expected.items()):
        fail(f"dataset {path}: behaviour network weights do not have the obs->32->16->{n_actions} layout; "
             f"recreate it with: {how}")
    check = slice(0, min(n, 1000))
    recomputed = behavior_probs(weights, float(d["epsilon"]), d["observations"][check])
    if not np.allclose(recomputed, d["behavior_probs"][check], atol=1e-5):
        fail(f"dataset {path}: behavior_probs disagree with the stored behaviour network and epsilon; "
             f"recreate it with: {how}")
    return path, d


class QNetwork(nn.Module):
    """FC(32)-FC(16), the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


BEHAVIOR_KEYS = ("behavior_w0", "behavior_b0", "behavior_w1", "behavior_b1", "behavior_w2", "behavior_b2")


def behavior_probs(weights: dict, epsilon: float, obs: np.ndarray) -> np.ndarray:
    """beta(.|s) at any states from the behaviour Q-network (float64, nn.Linear layout, first index on
    ties): the rule collect_data.py used to act and to store behavior_probs."""
    h = np.maximum(obs.astype(np.float64) @ weights["w0"].T.astype(np.float64) + weights["b0"], 0.0)
    h = np.maximum(h @ weights["w1"].T.astype(np.float64) + weights["b1"], 0.0)
    q = h @ weights["w2"].T.astype(np.float64) + weights["b2"]
    probs = np.full(q.shape, epsilon / q.shape[1])
    probs[np.arange(len(q)), q.argmax(1)] += 1.0 - epsilon
    return probs


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


def evaluate(act, envs: list, seed: int) -> np.ndarray:
    """Undiscounted return of one episode per env; all episodes advance together so the policy
    runs one batched forward per time step. Episode i always starts from reset(seed=seed + i)."""
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]).astype(np.float32)
    returns, active = np.zeros(len(envs)), np.ones(len(envs), dtype=bool)
    if hasattr(act, "reset"):
        act.reset()
    while active.any():
        idx = np.flatnonzero(active)
        for j, a in zip(idx, act(obs[idx]).tolist()):
            o, r, term, trunc, _ = envs[j].step(a)
            obs[j], returns[j] = o, returns[j] + r
            active[j] = not (term or trunc)
    return returns


def write_json_atomic(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def make_policy(q_network: QNetwork, weights: dict, epsilon: float, threshold: float, greedy: bool, seed: int):
    """Acting function for evaluate(): pi_spibb at the visited states (beta from the behaviour network,
    Q from q_network), sampled or argmax. The sampling noise of the evaluation after k updates starts from
    seed + k (act.n_updates = k): each evaluation is reproducible on its own (a checkpoint re-evaluates to
    the same returns), and the last 10 evaluations that make the final score average 10 independent draws
    of the policy's randomness, like the behaviour policy's 10 passes in `behavior_return`."""
    generator = torch.Generator()

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            beta = torch.from_numpy(behavior_probs(weights, epsilon, obs)).float()
            pi = spibb_policy(q_network(torch.from_numpy(obs)), beta, threshold)
            if greedy:
                return pi.argmax(1).numpy()
            return torch.multinomial(pi, 1, generator=generator).squeeze(1).numpy()

    act.n_updates = 0
    act.reset = lambda: generator.manual_seed(seed + act.n_updates)
    return act


def run_checkpoint(args: Args) -> None:
    try:
        ckpt = torch.load(args.eval_checkpoint, map_location="cpu", weights_only=True)
        env_id = ckpt["env_id"]
    except FileNotFoundError:
        fail(f"checkpoint {args.eval_checkpoint} not found")
    except Exception as e:
        fail(f"checkpoint {args.eval_checkpoint} is unreadable ({type(e).__name__}: {e})")
    if ckpt.get("algorithm") != Path(__file__).stem:
        fail(f"checkpoint {args.eval_checkpoint} was saved by {ckpt.get('algorithm')}.py, not {Path(__file__).name}")
    envs = [make_env(env_id) for _ in range(args.eval_episodes)]
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    q_network.load_state_dict(ckpt["q_network"])
    # beta and the threshold are part of the learned policy: use the ones it was trained with;
    # --eval-greedy of this command chooses how to act.
    weights = {k: v.numpy() for k, v in ckpt["behavior"].items()}
    policy = make_policy(q_network, weights, ckpt["epsilon"], ckpt["args"]["spibb_threshold"], args.eval_greedy,
                         args.eval_seed)
    policy.n_updates = ckpt.get("n_updates", 0)  # the sampling noise of the run's own evaluation at that point
    returns = evaluate(policy, envs, args.eval_seed)
    print(f"{args.eval_checkpoint}: {env_id} return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} episodes")


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
    check_args(args)
    torch.set_num_threads(args.threads)
    if args.eval_checkpoint:
        return run_checkpoint(args)
    env = make_env(args.env_id)
    obs_dim, n_actions = env.observation_space.shape[0], int(env.action_space.n)
    dataset_path, data = load_dataset(args, obs_dim, n_actions)

    # Everything is validated: only now create outputs.
    run_name = args.run_name or f"{args.env_id}__eps{args.epsilon:g}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.runs_dir) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(str(run_dir)) if args.tensorboard else None
    if writer:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    obs = torch.as_tensor(data["observations"])
    next_obs = torch.as_tensor(data["next_observations"])
    actions = torch.as_tensor(data["actions"])
    rewards = torch.as_tensor(data["rewards"])
    # beta(.|s') is fixed by the dataset, so the bootstrapped set of every s' is computed once.
    free_penalty, bootstrapped_beta, free_mass = spibb_constants(torch.as_tensor(data["next_behavior_probs"]),
                                                                 args.spibb_threshold)
    weights = {k.removeprefix("behavior_"): data[k] for k in BEHAVIOR_KEYS}
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    not_done = torch.as_tensor(1.0 - data["terminals"].astype(np.float32))

    q_network = QNetwork(obs_dim, n_actions)
    target_network = QNetwork(obs_dim, n_actions)
    target_network.load_state_dict(q_network.state_dict())
    # fused=True: the same Adam update, done by one kernel for all parameter tensors instead of a
    # Python loop over them (about 4x cheaper per step on CPU; the throughput target relies on it).
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)
    eval_envs = [make_env(args.env_id) for _ in range(args.eval_episodes)]
    act = make_policy(q_network, weights, args.epsilon, args.spibb_threshold, args.eval_greedy, args.eval_seed)

    evaluations, train_time, eval_time, start = [], 0.0, 0.0, time.time()
    block_start = time.perf_counter()
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

        if step % args.eval_frequency == 0 or step == args.total_steps:
            now = time.perf_counter()
            train_time += now - block_start
            act.n_updates = step
            returns = evaluate(act, eval_envs, args.eval_seed)
            block_start = time.perf_counter()
            eval_time += block_start - now
            evaluations.append({"step": step, "return_mean": float(returns.mean()), "return_std": float(returns.std())})
            sps = step / train_time
            print(f"step={step} eval_return={returns.mean():.1f} +- {returns.std():.1f} SPS={sps:.0f}", flush=True)
            if writer:
                writer.add_scalar("eval/episodic_return", returns.mean(), step)
                writer.add_scalar("charts/SPS", sps, step)

    final_score = float(np.mean([e["return_mean"] for e in evaluations[-10:]]))
    result = {
        "algorithm": Path(__file__).stem, "env_id": args.env_id, "epsilon": args.epsilon, "seed": args.seed,
        "args": asdict(args), "evaluations": evaluations, "final_score": final_score,
        "behavior_return": float(data["behavior_return"]), "wall_time": time.time() - start,
        "train_time": train_time, "eval_time": eval_time, "updates_per_second": args.total_steps / train_time,
        "dataset_path": str(dataset_path), "format_version": FORMAT_VERSION,
        "extra": dataset_statistics(q_network, obs, actions, torch.as_tensor(data["behavior_probs"]), args.spibb_threshold),
    }
    if args.save_model:
        torch.save({"algorithm": Path(__file__).stem, "env_id": args.env_id, "obs_dim": obs_dim, "n_actions": n_actions,
                    "args": asdict(args), "q_network": q_network.state_dict(), "epsilon": float(data["epsilon"]),
                    "behavior": {k: torch.from_numpy(v) for k, v in weights.items()}, "n_updates": args.total_steps},
                   run_dir / "model.pt")
    write_json_atomic(run_dir / "result.json", result)
    if writer:
        writer.add_scalar("eval/final_score", final_score, args.total_steps)
        writer.close()
    print(f"final score {final_score:.1f} (behaviour {result['behavior_return']:.1f}); results in {run_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
