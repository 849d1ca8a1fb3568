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

import contextlib
import fcntl
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # an interrupt while the libraries below load has nothing to clean up: one line, exit 130
    def _interrupted(*_):
        print(f"{Path(sys.argv[0]).name}: interrupted; nothing written", file=sys.stderr)
        os._exit(130)
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)

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
    overwrite: bool = False
    """replace a finished run of the same --run-name (without it, such a run is refused)"""
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
    raise SystemExit(f"{Path(sys.argv[0]).name}: error: {msg}".replace("\n", "\\n"))


def check_args(args: Args) -> None:
    for f in fields(args):  # NaN and inf pass the range checks below, then poison training
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
    for name in ("seed", "eval_seed"):
        if not 0 <= getattr(args, name) < 2**32:
            fail(f"--{name.replace('_', '-')} must lie in [0, 2**32), got {getattr(args, name)}")
    for name in ("run_name", "exp_name"):  # a run directory is <runs-dir>/<one name>, never outside it
        value = getattr(args, name)
        if value is not None and (value in ("", ".", "..") or any(c in value for c in "/\\") or not value.isprintable()
                                  or len(value.encode()) > 200):
            fail(f"--{name.replace('_', '-')} must be a single directory name of at most 200 printable characters (no "
                 f"'/', not '..'), got {value!r}")
    for name in ("dataset_path", "eval_checkpoint", "runs_dir"):
        if getattr(args, name) == "":
            fail(f"--{name.replace('_', '-')} must not be empty")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        fail(f"--threads must lie in [1, {os.cpu_count()}] (the cores of this machine), got {args.threads}")
    positive = ("total_steps", "batch_size", "target_update_frequency", "eval_frequency", "eval_episodes")
    for name in positive:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.eval_episodes > 10_000:  # one simulator each, side by side
        fail(f"--eval-episodes must be at most 10000, got {args.eval_episodes}")
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
        with warnings.catch_warnings():  # e.g. gymnasium's deprecation notice: the error, if any, says enough
            warnings.simplefilter("ignore")
            env = gym.make(env_id, disable_env_checker=True)
    except gym.error.Error as e:
        fail(f"cannot make environment {env_id!r}: {e}")
    except ModuleNotFoundError as e:
        fail(f"environment {env_id!r} needs a missing package ({e}); pip install 'gymnasium[box2d]'")
    if not isinstance(env.action_space, gym.spaces.Discrete):
        fail(f"{env_id} has a {type(env.action_space).__name__} action space; only discrete actions are supported")
    if not isinstance(env.observation_space, gym.spaces.Box) or len(env.observation_space.shape) != 1:
        fail(f"{env_id} has {env.observation_space} observations; only vector observations (a 1-D Box) are supported")
    return env


def load_dataset(args: Args, obs_dim: int, n_actions: int) -> tuple[Path, dict]:
    """Read and validate the batch; a missing *default* dataset is created with collect_data.py."""
    path = Path(args.dataset_path) if args.dataset_path else REPO / "datasets" / f"{args.env_id}_eps{args.epsilon:g}.npz"
    how = f"python collect_data.py --env-id {args.env_id} --epsilon {args.epsilon:g} --overwrite" + (
        f" --dataset-path {path}" if args.dataset_path else "")
    try:
        exists = path.exists()
    except OSError as e:  # e.g. a name longer than the file system allows
        fail(f"dataset path {path} is invalid ({e.strerror}); pass another --dataset-path")
    if not exists:
        if args.dataset_path:
            fail(f"dataset {path} not found; create it with: {how}")
        if not (REPO / "behavior_policies" / f"{args.env_id}.npz").exists():
            fail(f"no dataset for {args.env_id}: the repo has behaviour policies for CartPole-v1, Acrobot-v1 and "
                 f"LunarLander-v3 only; pass --dataset-path with a dataset of {args.env_id}")
        print(f"dataset {path} not found: creating it from the committed behaviour policy", flush=True)
        cmd = [sys.executable, str(REPO / "collect_data.py"), "--env-id", args.env_id, "--epsilon", f"{args.epsilon:g}"]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(1)  # collect_data.py has said why, in one line
    # each array's dtype kind ("real" is stored as float32, "int" as int64, "bool" as bool: conversions that keep
    # the values, never a reinterpretation) and its row shape (None: a single value)
    spec = {"format_version": ("int", None), "env_id": ("str", None), "epsilon": ("real", None),
            "behavior_return": ("real", None), "actions": ("int", ()), "observations": ("real", (obs_dim,)),
            "next_observations": ("real", (obs_dim,)), "rewards": ("real", ()), "terminals": ("bool", ()),
            "timeouts": ("bool", ()), "behavior_probs": ("real", (n_actions,)),
            "next_behavior_probs": ("real", (n_actions,))}
    # the behaviour network obs -> 32 -> 16 -> |A| (torch layout): beta at states outside the batch (evaluation)
    layout = {"w0": (32, obs_dim), "b0": (32,), "w1": (16, 32), "b1": (16,), "w2": (n_actions, 16), "b2": (n_actions,)}
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in (*spec, *(f"behavior_{k}" for k in layout)) if k not in f.files]
            if missing:
                fail(f"dataset {path} lacks {missing}: it was not written by collect_data.py; recreate it with: {how}")
            d = {k: f[k] for k in (*spec, *(f"behavior_{k}" for k in layout))}
    except SystemExit:
        raise
    except Exception as e:  # truncated or corrupt zip, an object array (pickle), I/O error
        fail(f"dataset {path} is unreadable ({type(e).__name__}: {e}); it is corrupt or truncated, recreate it with: {how}")
    for k, (kind, row) in spec.items():  # in this order: the single values say what the arrays should be
        x = d[k]
        if x.dtype.kind not in {"real": "iuf", "int": "iu", "bool": "b", "str": "U"}[kind] and not (
                kind == "bool" and x.dtype.kind in "iu" and np.isin(x, (0, 1)).all()):
            fail(f"dataset {path}: {k} has dtype {x.dtype}, expected "
                 f"{dict(real='numbers', int='integers', bool='booleans', str='a string')[kind]}; recreate it with: {how}")
        if row is None and x.ndim != 0:
            fail(f"dataset {path}: {k} has shape {x.shape}, expected a single value; recreate it with: {how}")
        if k == "format_version" and int(x) != FORMAT_VERSION:
            fail(f"dataset {path} has format version {int(x)}, expected {FORMAT_VERSION}; recreate it with: {how}")
        if k == "env_id" and str(x) != args.env_id:
            fail(f"dataset {path} was recorded on {x}, not {args.env_id}; pass --env-id {x} or another dataset")
        if k == "epsilon" and not 0.0 <= float(x) <= 1.0:
            fail(f"dataset {path} has epsilon {float(x)}, outside [0, 1]; recreate it with: {how}")
        if k == "epsilon" and not np.isclose(float(x), args.epsilon):
            fail(f"dataset {path} was collected with epsilon {float(x):g}, not {args.epsilon:g}; pass --epsilon {float(x):g}")
        if k == "actions" and (x.ndim != 1 or len(x) == 0):
            fail(f"dataset {path}: actions has shape {x.shape}, expected (N,) with N > 0 (one action index per "
                 f"transition); recreate it with: {how}")
        if row is not None and x.shape != (len(d["actions"]), *row):
            fail(f"dataset {path}: {k} has shape {x.shape}, expected {(len(d['actions']), *row)} for {args.env_id} "
                 f"(observation size {obs_dim}, {n_actions} actions); was it recorded on another task?")
        if row is not None:
            with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, refused below
                d[k] = x.astype({"real": np.float32, "int": np.int64, "bool": bool}[kind], copy=False)
            if x.dtype.kind in "iu" and not np.array_equal(d[k], x):
                fail(f"dataset {path}: {k} holds integers that {d[k].dtype} cannot represent exactly; store them as "
                     f"{d[k].dtype} (recreate it with: {how})")
    for k in ("observations", "next_observations", "rewards", "behavior_probs", "next_behavior_probs", "behavior_return"):
        if not np.isfinite(d[k]).all():
            fail(f"dataset {path}: {k} contains NaN or inf ({np.count_nonzero(~np.isfinite(d[k]))} values); recreate it with: {how}")
    if (d["terminals"] & d["timeouts"]).any():
        fail(f"dataset {path}: {np.count_nonzero(d['terminals'] & d['timeouts'])} transitions are both terminal and a "
             f"time-limit truncation (timeouts must exclude terminals); recreate it with: {how}")
    if d["actions"].min() < 0 or d["actions"].max() >= n_actions:
        fail(f"dataset {path}: actions outside [0, {n_actions}); was it recorded on another task?")
    for k in ("behavior_probs", "next_behavior_probs"):
        if (d[k] < 0).any() or not np.allclose(d[k].sum(1), 1.0, atol=1e-4):
            fail(f"dataset {path}: {k} rows are not probability distributions; recreate it with: {how}")
    for k, shape in layout.items():
        w = d[f"behavior_{k}"]
        if w.dtype.kind != "f" or w.shape != shape or not np.isfinite(w).all():
            fail(f"dataset {path}: behavior_{k} is not a finite float array of shape {shape} (the behaviour network "
                 f"obs -> 32 -> 16 -> {n_actions}); recreate it with: {how}")
        d[f"behavior_{k}"] = w.astype(np.float32, copy=False)
    # Evaluation recomputes beta from the stored behaviour network: it must be the one that made the data.
    check = slice(0, min(len(d["actions"]), 1000))
    weights = {k: d[f"behavior_{k}"] for k in layout}
    if not np.allclose(behavior_probs(weights, float(d["epsilon"]), d["observations"][check]), d["behavior_probs"][check],
                       atol=1e-5):
        fail(f"dataset {path}: behavior_probs disagree with the stored behaviour network and epsilon; "
             f"recreate it with: {how}")
    if args.batch_size > len(d["actions"]):
        fail(f"--batch-size {args.batch_size} exceeds the dataset's {len(d['actions'])} transitions")
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


def write_atomic(path: Path, data: bytes) -> None:
    """The file appears whole (temporary file, then rename) or not at all."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, obj: dict) -> None:
    # a flag may be inf on purpose (brpo's --kappa-max inf): JSON has no inf, so such a value is written as text
    args = {k: str(v) if isinstance(v, float) and math.isinf(v) else v for k, v in obj.get("args", {}).items()}
    try:
        text = json.dumps({**obj, "args": args} if "args" in obj else obj, indent=1, allow_nan=False)
    except ValueError:
        fail(f"the run produced NaN or inf numbers (training diverged?); nothing written to {path.parent}")
    write_atomic(path, text.encode())


def save_model_atomic(path: Path, obj: dict) -> None:
    buffer = io.BytesIO()  # serialised in memory, so that a full disk surfaces as an OSError of write_atomic
    torch.save(obj, buffer)
    write_atomic(path, buffer.getvalue())


RUN_FILES = ("result.json", "model.pt")  # with events.out.tfevents.* and *.tmp: what a run writes in its directory


def remove_run_files(run_dir: Path) -> None:
    for p in run_dir.iterdir():
        if p.name in RUN_FILES or p.name.startswith("events.out.tfevents.") or p.name.endswith(".tmp"):
            p.unlink()


@contextlib.contextmanager
def run_directory(args: Args):
    """<runs-dir>/<run-name>/ and its TensorBoard writer, locked for this run: a second process on the same run name
    is refused. A finished run (result.json) is replaced only with --overwrite; what a failed or killed run left is
    removed first. If this run fails or is interrupted, what it wrote is removed: a run directory holds a finished
    run or a running one."""
    name = args.run_name or f"{args.env_id}__eps{args.epsilon:g}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.runs_dir) / name
    try:
        created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # removed again if the run fails
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir, os.O_RDONLY)
    except OSError as e:
        fail(f"cannot create the run directory {run_dir} ({e.strerror}); pass a writable --runs-dir and a valid "
             f"--run-name")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the process ends, however it ends
        except OSError:
            fail(f"{run_dir} is in use by another running process; pass another --run-name")
        if (run_dir / "result.json").exists() and not args.overwrite:
            fail(f"{run_dir} holds a finished run; pass --overwrite to replace it, or another --run-name")
        writer = None
        try:
            remove_run_files(run_dir)
            writer = SummaryWriter(str(run_dir)) if args.tensorboard else None
            yield run_dir, writer
        except BaseException as e:
            with contextlib.suppress(Exception):  # the writer's thread must not write on after the clean-up
                writer and writer.close()
            with contextlib.suppress(OSError):
                remove_run_files(run_dir)
                for p in dict.fromkeys([run_dir, *created]):  # only if empty (run_grid.py's run.log stays)
                    p.rmdir()
            if isinstance(e, OSError):
                fail(f"cannot write to {run_dir} ({e.strerror or e}); nothing of this run was kept")
            raise
    finally:
        os.close(fd)


def load_checkpoint(path: str, keys: dict) -> dict:
    """A model.pt of this script's --save-model, loaded as weights only (a checkpoint's code is never run), with
    `keys` (name -> type) and a task whose sizes are those of its environment."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        fail(f"checkpoint {path} not found")
    except Exception as e:  # not a torch file, or one holding more than weights
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        fail(f"checkpoint {path} is unreadable ({reason}): it is not a model.pt written by --save-model")
    if not isinstance(ckpt, dict) or ckpt.get("algorithm") != Path(__file__).stem:
        saved_by = ckpt.get("algorithm") if isinstance(ckpt, dict) else None
        fail(f"checkpoint {path} was not saved by {Path(__file__).name}" + (f" but by {saved_by}.py" if saved_by else ""))
    keys = {"env_id": str, "obs_dim": int, "n_actions": int, **keys}
    missing = [k for k in keys if k not in ckpt]
    if missing:
        fail(f"checkpoint {path} lacks {missing}; save it again with --save-model")
    wrong = [k for k, kind in keys.items() if not isinstance(ckpt[k], kind) or isinstance(ckpt[k], bool) != (kind is bool)
             or (kind is int and not 0 <= ckpt[k] < 2**40) or (kind is float and not math.isfinite(ckpt[k]))]
    if wrong:
        fail(f"checkpoint {path}: {wrong} have the wrong type; save it again with --save-model")
    env = make_env(ckpt["env_id"])
    if (ckpt["obs_dim"], ckpt["n_actions"]) != (env.observation_space.shape[0], int(env.action_space.n)):
        fail(f"checkpoint {path} is for observation size {ckpt['obs_dim']} and {ckpt['n_actions']} actions, but "
             f"{ckpt['env_id']} has {env.observation_space.shape[0]} and {env.action_space.n}")
    return ckpt


def load_weights(path: str, network: nn.Module, state: dict) -> None:
    """Refuse, in one line, weights that do not fit the network or are not finite."""
    if not all(isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64) for t in state.values()):
        fail(f"checkpoint {path} holds weights that are not float32 or float64 tensors")
    try:
        network.load_state_dict(state)
    except Exception as e:  # missing or unexpected keys, shapes of another network
        fail(f"checkpoint {path} does not hold the weights of this script's network: {' '.join(str(e).split())}")
    if not all(torch.isfinite(t).all() for t in network.state_dict().values()):
        fail(f"checkpoint {path} holds NaN or inf weights")


def check_finite(step: int, *networks: nn.Module) -> None:
    """A run whose weights became NaN or inf fails: its scores would mean nothing."""
    if not all(torch.isfinite(p).all() for net in networks for p in net.parameters()):
        fail(f"training diverged: the weights are NaN or inf after {step} updates; try a lower --learning-rate")


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
    ckpt = load_checkpoint(args.eval_checkpoint, {"q_network": dict, "behavior": dict, "epsilon": float, "args": dict,
                                                  "n_updates": int})
    # beta and the threshold are part of the learned policy: use the ones it was trained with;
    # --eval-greedy of this command chooses how to act.
    threshold = ckpt["args"].get("spibb_threshold")
    if not isinstance(threshold, float) or not 0.0 <= threshold <= 1.0 or not 0.0 <= ckpt["epsilon"] <= 1.0:
        fail(f"checkpoint {args.eval_checkpoint} has no --spibb-threshold or epsilon in [0, 1]; save it again with --save-model")
    layout = {"w0": (32, ckpt["obs_dim"]), "b0": (32,), "w1": (16, 32), "b1": (16,), "w2": (ckpt["n_actions"], 16),
              "b2": (ckpt["n_actions"],)}
    weights = ckpt["behavior"]
    if {k: tuple(getattr(v, "shape", ())) for k, v in weights.items()} != layout or not all(
            v.dtype in (torch.float32, torch.float64) and torch.isfinite(v).all() for v in weights.values()):
        fail(f"checkpoint {args.eval_checkpoint} does not hold a finite behaviour network obs -> 32 -> 16 -> actions")
    envs = [make_env(ckpt["env_id"]) for _ in range(args.eval_episodes)]
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(args.eval_checkpoint, q_network, ckpt["q_network"])
    policy = make_policy(q_network, {k: v.numpy() for k, v in weights.items()}, ckpt["epsilon"], threshold,
                         args.eval_greedy, args.eval_seed)
    policy.n_updates = ckpt["n_updates"]  # the sampling noise of the run's own evaluation at that point
    try:
        returns = evaluate(policy, envs, args.eval_seed)
    except (RuntimeError, ValueError, OverflowError) as e:  # weights that load but give no policy (inf logits)
        fail(f"checkpoint {args.eval_checkpoint} cannot be evaluated: {' '.join(str(e).split())}")
    print(f"{args.eval_checkpoint}: {ckpt['env_id']} return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} episodes")


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

    with run_directory(args) as (run_dir, writer):  # everything is validated: only now create outputs
        train(args, data, dataset_path, run_dir, writer, obs_dim, n_actions)


def train(args: Args, data: dict, dataset_path: Path, run_dir: Path, writer: Optional[SummaryWriter], obs_dim: int,
          n_actions: int) -> None:
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
            check_finite(step, q_network)
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
    if writer:
        writer.add_scalar("eval/final_score", final_score, args.total_steps)
        writer.flush()  # raises what the writer's thread met (e.g. a full disk)
        writer.close()
    if args.save_model:
        save_model_atomic(run_dir / "model.pt", {
            "algorithm": Path(__file__).stem, "env_id": args.env_id, "obs_dim": obs_dim, "n_actions": n_actions,
            "args": asdict(args), "q_network": q_network.state_dict(), "epsilon": float(data["epsilon"]),
            "behavior": {k: torch.from_numpy(v) for k, v in weights.items()}, "n_updates": args.total_steps})
    write_json_atomic(run_dir / "result.json", result)  # last: a run directory with result.json is a finished run
    print(f"final score {final_score:.1f} (behaviour {result['behavior_return']:.1f}); results in {run_dir}")


if __name__ == "__main__":
    # TensorBoard writes from a thread; its OSError (a full disk) surfaces again at the next write or flush, where
    # run_directory turns it into one line, so the thread's own traceback is not printed
    threading.excepthook = lambda a: None if issubclass(a.exc_type, OSError) else threading.__excepthook__(a)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on, an interrupt removes what the run wrote
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # and a stopped run cleans up like an interrupted one
    try:
        main(tyro.cli(Args))
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted; nothing written", file=sys.stderr)
        raise SystemExit(130)
