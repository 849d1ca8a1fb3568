"""What every algorithm script shares and none of them is about: flags' checks, the batch dataset and its
validation, the run directory, atomic outputs, checkpoints, evaluation in the simulator, and the improvement
certificate. Each script holds its whole algorithm; it imports this file for the plumbing (fork a script
together with common.py). Bad input ends in one line on stderr and exit status 1, nothing half-written."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter

REPO = Path(__file__).resolve().parent
FORMAT_VERSION = 2  # of datasets; 1: collect_data.py's datasets before imported ones (still read)
RESULT_FORMAT_VERSION = 1  # of result.json
BEHAVIOR_KEYS = ("w0", "b0", "w1", "b1", "w2", "b2")  # the behaviour Q-network obs -> 32 -> 16 -> |A| (docs/formats.md)


@dataclass
class RunArgs:
    """The flags every script shares, with the same names and meanings (one runner drives them all)."""
    exp_name: str = "run"
    """name of this experiment (part of the run name; default: the script's name)"""
    env_id: str = "CartPole-v1"
    """gymnasium environment id (CartPole-v1, Acrobot-v1, LunarLander-v3; an imported dataset's task)"""
    epsilon: float = 0.15
    """exploration level of the behaviour policy that collected the dataset"""
    seed: int = 1
    """seed of network initialisation and minibatch sampling"""
    dataset_path: Optional[str] = None
    """batch dataset (.npz from collect_data.py or import_data.py); default datasets/<env-id>_eps<epsilon>.npz, created
    if missing"""
    total_steps: int = 100_000
    """gradient updates (the paper does not state its number; 100k is our documented default)"""
    learning_rate: float = 1e-3
    """Adam learning rate of the Q-network (bc.py: of the policy network)"""
    batch_size: int = 64
    """minibatch size"""
    eval_frequency: int = 1_000
    """updates between evaluations (in the simulator; without one, the improvement certificate)"""
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


@dataclass
class TDArgs(RunArgs):
    """RunArgs and the flags of the scripts that learn a Q-network by temporal differences."""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 0.5
    """soft target update rate: target <- tau * online + (1 - tau) * target"""
    target_update_frequency: int = 500
    """updates between soft target updates"""


@dataclass
class DeployArgs(TDArgs):
    """TDArgs and BRPO's deployment flags (brpo.py, brpo_c.py; docs/brpo.md, departure 11)."""
    deploy_pessimism: Optional[tuple[float, ...]] = None
    """pessimism levels of the deployed pi, the first as trained, chosen by the improvement certificate; one value
    fixes it (default: --pessimism and 0, or 0 alone at --pessimism 0)"""
    certificate_confidence: float = 0.95
    """simultaneous one-sided confidence of the certificate's lower bounds, one per --deploy-pessimism level"""
    certificate_gamma: float = 0.99
    """discount of the logged returns-to-go in the certificate (1.0: the undiscounted return, noisier)"""
    safety_test: bool = False
    """deploy beta instead of pi whenever the batch does not certify pi's improvement (off: the paper, always pi)"""


def fail(msg: str) -> None:
    """One line on stderr, exit status 1, no traceback."""
    raise SystemExit(f"{Path(sys.argv[0]).name}: error: {msg}".replace("\n", "\\n"))


def require(ok, msg: str) -> None:
    if not ok:
        fail(msg)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args, allow_inf: tuple = ()) -> None:
    """The checks every script's flags share; a script adds its own after these."""
    for f in fields(args):  # NaN and inf pass the range checks below, then poison training
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value) and not (f.name in allow_inf and value == math.inf):
            fail(f"{flag(f.name)} must be a finite number, got {value}")
    for name in ("seed", "eval_seed"):
        if not 0 <= getattr(args, name) < 2**32:
            fail(f"{flag(name)} must lie in [0, 2**32), got {getattr(args, name)}")
    for name in ("run_name", "exp_name"):  # a run directory is <runs-dir>/<one name>, never outside it
        value = getattr(args, name)
        if value is not None and (value in ("", ".", "..") or any(c in value for c in "/\\") or not value.isprintable()
                                  or len(value.encode()) > 200):
            fail(f"{flag(name)} must be a single directory name of at most 200 printable characters (no "
                 f"'/', not '..'), got {value!r}")
    for name in ("dataset_path", "eval_checkpoint", "runs_dir"):
        if getattr(args, name) == "":
            fail(f"{flag(name)} must not be empty")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        fail(f"--threads must lie in [1, {os.cpu_count()}] (the cores of this machine), got {args.threads}")
    for name in ("total_steps", "batch_size", "target_update_frequency", "eval_frequency", "eval_episodes"):
        if hasattr(args, name) and getattr(args, name) <= 0:
            fail(f"{flag(name)} must be positive, got {getattr(args, name)}")
    if args.eval_episodes > 10_000:  # one simulator each, side by side
        fail(f"--eval-episodes must be at most 10000, got {args.eval_episodes}")
    if not 0.0 <= args.epsilon <= 1.0:
        fail(f"--epsilon must lie in [0, 1], got {args.epsilon}")
    if not args.learning_rate > 0:
        fail(f"--learning-rate must be positive, got {args.learning_rate}")
    if hasattr(args, "gamma") and not 0.0 <= args.gamma < 1.0:
        fail(f"--gamma must lie in [0, 1), got {args.gamma}")
    if hasattr(args, "tau") and not 0.0 < args.tau <= 1.0:
        fail(f"--tau must lie in (0, 1], got {args.tau}")
    if isinstance(args, DeployArgs):
        require(args.deploy_pessimism is None or (args.deploy_pessimism and all(
            0.0 <= p <= 1e3 for p in args.deploy_pessimism)),
            f"--deploy-pessimism needs one or more levels in [0, 1000], got {list(args.deploy_pessimism or [])}")
        # below 1 by more than rounding, or the Bonferroni level 1 - (1 - c) / levels rounds to 1 (z = inf)
        require(0.5 <= args.certificate_confidence <= 1.0 - 1e-9,
                f"--certificate-confidence must lie in [0.5, 1), got {args.certificate_confidence}")
        require(0.0 <= args.certificate_gamma <= 1.0, f"--certificate-gamma must lie in [0, 1], got {args.certificate_gamma}")


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


class BehaviorPolicy:
    """beta(.|s) at any state from the behaviour network stored in the dataset (docs/formats.md), in float64 like
    collect_data.py so that near-ties resolve to the same action. kind "epsilon_greedy" (collect_data.py):
    beta(a|s) = (1-eps) 1[a = argmax Q_b(s,.)] + eps/|A|; kind "softmax" (import_data.py's fitted model):
    beta(a|s) = floor + (1 - |A| floor) softmax(f(s) / temperature)_a."""

    def __init__(self, weights: dict, epsilon: float, kind: str = "epsilon_greedy", temperature: float = 1.0,
                 floor: float = 0.0):
        self.layers = [(torch.as_tensor(weights[f"w{i}"], dtype=torch.float64),
                        torch.as_tensor(weights[f"b{i}"], dtype=torch.float64)) for i in range(3)]
        self.epsilon, self.kind, self.temperature, self.floor = float(epsilon), kind, float(temperature), float(floor)

    def q_values(self, obs: torch.Tensor) -> torch.Tensor:
        h = obs.double()
        for i, (w, b) in enumerate(self.layers):
            h = h @ w.T + b
            if i < 2:
                h = h.clamp_min(0.0)
        return h

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        h = self.q_values(obs)
        if self.kind == "softmax":
            return self.floor + (1.0 - h.shape[1] * self.floor) * torch.softmax(h / self.temperature, 1)
        probs = torch.full_like(h, self.epsilon / h.shape[1])
        probs[torch.arange(h.shape[0]), h.argmax(1)] += 1.0 - self.epsilon  # first index on ties
        return probs


BEHAVIOR_KINDS = ("epsilon_greedy", "softmax")


def behavior_spec(d: dict) -> dict:
    """The behaviour model of a validated dataset (load_dataset(..., behavior_network=True)), as a checkpoint keeps it."""
    return {"behavior": {k: torch.as_tensor(d[f"behavior_{k}"]) for k in BEHAVIOR_KEYS}, "epsilon": float(d["epsilon"]),
            "behavior_kind": d["behavior_kind"], "behavior_temperature": d["behavior_temperature"],
            "behavior_floor": d["behavior_floor"]}


def behavior_policy(d: dict) -> BehaviorPolicy:
    """beta at any state, from a validated dataset or from a checkpoint's behavior_spec."""
    weights = d["behavior"] if "behavior" in d else {k: d[f"behavior_{k}"] for k in BEHAVIOR_KEYS}
    return BehaviorPolicy(weights, d["epsilon"], d.get("behavior_kind", "epsilon_greedy"),
                          d.get("behavior_temperature", 1.0), d.get("behavior_floor", 0.0))


def load_dataset(args, obs_dim: int, n_actions: int, behavior_network: bool = False) -> tuple[Path, dict]:
    """Read and validate the batch (docs/formats.md); a missing *default* dataset is created with collect_data.py.
    behavior_network: the script also needs the stored behaviour network (beta at states outside the batch)."""
    path = Path(args.dataset_path) if args.dataset_path else REPO / "datasets" / f"{args.env_id}_eps{args.epsilon:g}.npz"
    how = (f"python collect_data.py --env-id {args.env_id} --epsilon {args.epsilon:g} --overwrite" if not args.dataset_path
           else f"collect_data.py (our tasks) or import_data.py (your logs), --dataset-path {path}")
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
    layout = {"w0": (32, obs_dim), "b0": (32,), "w1": (16, 32), "b1": (16,), "w2": (n_actions, 16), "b2": (n_actions,)}
    keys = (*spec, *(f"behavior_{k}" for k in layout)) if behavior_network else tuple(spec)
    v2 = ("behavior_kind", "behavior_temperature", "behavior_floor")  # format 2: the behaviour model's kind
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in keys if k not in f.files]
            if missing:
                fail(f"dataset {path} lacks {missing}: it was not written by collect_data.py or import_data.py; "
                     f"recreate it with: {how}")
            d = {k: f[k] for k in (*keys, *(k for k in v2 if k in f.files))}
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
        if k == "format_version" and int(x) not in (1, FORMAT_VERSION):
            fail(f"dataset {path} has format version {int(x)}, expected 1 or {FORMAT_VERSION}; recreate it with: {how}")
        if k == "format_version":
            d.update(read_behavior_kind(d, int(x), path, how))
        if k == "env_id" and str(x) != args.env_id:
            fail(f"dataset {path} was recorded on {x}, not {args.env_id}; pass --env-id {x} or another dataset")
        if k == "epsilon" and d["behavior_kind"] == "softmax" and math.isnan(float(x)):
            continue  # an imported dataset: its behaviour policy has no epsilon, and --epsilon is only a label
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
    if args.batch_size > len(d["actions"]):
        fail(f"--batch-size {args.batch_size} exceeds the dataset's {len(d['actions'])} transitions")
    if behavior_network:
        for k, shape in layout.items():
            w = d[f"behavior_{k}"]
            if w.dtype.kind != "f" or w.shape != shape or not np.isfinite(w).all():
                fail(f"dataset {path}: behavior_{k} is not a finite float array of shape {shape} (the behaviour network "
                     f"obs -> 32 -> 16 -> {n_actions}); recreate it with: {how}")
            d[f"behavior_{k}"] = w.astype(np.float32, copy=False)
        check = torch.from_numpy(d["observations"][:1000])  # beta at unseen states comes from the stored network
        beta = behavior_policy(d)(check).numpy()
        # an imported dataset's logged propensities are authoritative; its network estimates beta elsewhere
        if d["behavior_kind"] == "epsilon_greedy" and not np.allclose(beta, d["behavior_probs"][:1000], atol=1e-5):
            fail(f"dataset {path}: behavior_probs disagree with the stored behaviour network and epsilon; "
                 f"recreate it with: {how}")
    return path, d


def read_behavior_kind(d: dict, version: int, path: Path, how: str) -> dict:
    """The behaviour model's kind and parameters: format 1 is always epsilon-greedy."""
    if version == 1:
        return {"behavior_kind": "epsilon_greedy", "behavior_temperature": 1.0, "behavior_floor": 0.0}
    missing = [k for k in ("behavior_kind", "behavior_temperature", "behavior_floor") if k not in d]
    if missing:
        fail(f"dataset {path} (format 2) lacks {missing}; recreate it with: {how}")
    kind, temperature, floor = str(d["behavior_kind"]), float(d["behavior_temperature"]), float(d["behavior_floor"])
    if kind not in BEHAVIOR_KINDS or not 0.0 < temperature < math.inf or not 0.0 <= floor < 0.5:
        fail(f"dataset {path}: behaviour model {kind!r} (temperature {temperature}, floor {floor}) is not one of "
             f"{list(BEHAVIOR_KINDS)} with a positive temperature and a floor in [0, 0.5); recreate it with: {how}")
    return {"behavior_kind": kind, "behavior_temperature": temperature, "behavior_floor": floor}


def evaluate(act, envs: list, seed: int) -> np.ndarray:
    """Undiscounted return of one episode per env; all episodes advance together so the policy
    runs one batched forward per time step. Episode i always starts from reset(seed=seed + i)."""
    if hasattr(act, "reset"):
        act.reset()
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]).astype(np.float32)
    returns, active = np.zeros(len(envs)), np.ones(len(envs), dtype=bool)
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
def run_directory(args):
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
            if writer:
                writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
                    f"|{k}|{v}|" for k, v in vars(args).items()))
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


def load_checkpoint(path: str, algorithm: str, keys: dict) -> dict:
    """A model.pt of `algorithm`'s --save-model, loaded as weights only (a checkpoint's code is never run), with
    `keys` (name -> type) and a task whose sizes are those of its environment."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        fail(f"checkpoint {path} not found")
    except Exception as e:  # not a torch file, or one holding more than weights
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        fail(f"checkpoint {path} is unreadable ({reason}): it is not a model.pt written by --save-model")
    if not isinstance(ckpt, dict) or (algorithm and ckpt.get("algorithm") != algorithm):
        saved_by = ckpt.get("algorithm") if isinstance(ckpt, dict) else None
        fail(f"checkpoint {path} was not saved by " + (f"{algorithm}.py" if algorithm else "an algorithm script")
             + (f" but by {saved_by}.py" if saved_by else ""))
    keys = {"algorithm": str, "env_id": str, "obs_dim": int, "n_actions": int, **keys}
    missing = [k for k in keys if k not in ckpt]
    if missing:
        fail(f"checkpoint {path} lacks {missing}; save it again with --save-model")
    wrong = [k for k, kind in keys.items() if not isinstance(ckpt[k], kind) or isinstance(ckpt[k], bool) != (kind is bool)
             or (kind is int and not 0 <= ckpt[k] < 2**40) or (kind is float and not math.isfinite(ckpt[k]))]
    if wrong:
        fail(f"checkpoint {path}: {wrong} have the wrong type; save it again with --save-model")
    if not has_simulator(ckpt["env_id"]):  # trained on an imported dataset of a task not installed here
        return ckpt
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


def behavior_from_checkpoint(ckpt: dict, path: str) -> BehaviorPolicy:
    """The behaviour model a checkpoint carries (behavior_spec), validated."""
    weights = behavior_weights(ckpt, path)
    kind = ckpt.get("behavior_kind", "epsilon_greedy")  # checkpoints from before format 2: epsilon-greedy
    temperature, floor = ckpt.get("behavior_temperature", 1.0), ckpt.get("behavior_floor", 0.0)
    if kind not in BEHAVIOR_KINDS or not isinstance(temperature, float) or not isinstance(floor, float) or not (
            0.0 < temperature < math.inf and 0.0 <= floor < 0.5):
        fail(f"checkpoint {path}: its behaviour model ({kind!r}, temperature {temperature}, floor {floor}) is invalid")
    return BehaviorPolicy(weights, ckpt["epsilon"], kind, temperature, floor)


def behavior_weights(ckpt: dict, path: str) -> dict:
    """The behaviour network a checkpoint carries (ckpt["behavior"], ckpt["epsilon"]), validated, as numpy arrays."""
    n_in, n_out = ckpt["obs_dim"], ckpt["n_actions"]
    layout = {"w0": (32, n_in), "b0": (32,), "w1": (16, 32), "b1": (16,), "w2": (n_out, 16), "b2": (n_out,)}
    weights = ckpt["behavior"]
    if {k: tuple(getattr(v, "shape", ())) for k, v in weights.items()} != layout or not all(
            v.dtype in (torch.float32, torch.float64) and torch.isfinite(v).all() for v in weights.values()):
        fail(f"checkpoint {path} does not hold a finite behaviour network obs -> 32 -> 16 -> actions")
    epsilon = ckpt.get("epsilon")
    if not isinstance(epsilon, float) or not (0.0 <= epsilon <= 1.0 or (
            math.isnan(epsilon) and ckpt.get("behavior_kind") == "softmax")):
        fail(f"checkpoint {path}: its epsilon {epsilon} is outside [0, 1]; save it again with --save-model")
    return {k: v.numpy() for k, v in weights.items()}


def saved_args(ckpt: dict, args_type, check, path: str):
    """The settings a checkpoint was trained with (they are part of its policy), validated by the script's check."""
    defaults = args_type()
    saved = {k: v for k, v in ckpt["args"].items() if k in args_type.__dataclass_fields__}
    wrong = [k for k, v in saved.items() if getattr(defaults, k) is not None and not isinstance(v, type(getattr(defaults, k)))]
    if wrong:
        fail(f"checkpoint {path}: its settings {wrong} are invalid; save it again with --save-model")
    saved = replace(args_type(**saved), threads=1, run_name=None, exp_name="x", eval_checkpoint=None, dataset_path=None)
    try:
        check(saved)
    except SystemExit as e:
        fail(f"checkpoint {path}: its saved settings are invalid ({str(e.code).split('error: ', 1)[-1]})")
    return saved


def one_hot(actions: np.ndarray, n_actions: int) -> np.ndarray:
    """A deterministic policy's pi(.|s) from its actions."""
    return np.eye(n_actions)[actions]


def q_function(network):
    """obs (numpy float32) -> the network's first output Q(s, .) as float64 numpy, without gradient."""
    def q(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = network(torch.from_numpy(obs))
            return (out[0] if isinstance(out, tuple) else out).double().numpy()
    return q


def evaluate_checkpoint(path: str, act, env_id: str, episodes: int, seed: int, note: str = "") -> None:
    require(has_simulator(env_id), f"{env_id} has no simulator here, so {path} cannot be evaluated in it; its "
            f"improvement certificate: python certify.py {path}")
    envs = [make_env(env_id) for _ in range(episodes)]
    try:
        returns = evaluate(act, envs, seed)
    except (RuntimeError, ValueError, OverflowError) as e:  # weights that load but give no policy (inf logits)
        fail(f"checkpoint {path} cannot be evaluated: {' '.join(str(e).split())}")
    print(f"{path}: {env_id} return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} episodes{note}")


def check_finite(step: int, *networks: nn.Module) -> None:
    """A run whose weights became NaN or inf fails: its scores would mean nothing."""
    if not all(torch.isfinite(p).all() for net in networks for p in net.parameters()):
        fail(f"training diverged: the weights are NaN or inf after {step} updates; try a lower --learning-rate")


def has_simulator(env_id: str) -> bool:
    return env_id in gym.envs.registry


def make_eval_envs(args) -> list:
    """One simulator per evaluation episode; none for an imported dataset of a task not installed here."""
    return [make_env(args.env_id) for _ in range(args.eval_episodes)] if has_simulator(args.env_id) else []


class Evaluations:
    """The evaluation schedule of a run: the clock split between training and evaluation, one record per
    evaluation (stdout, TensorBoard), and the run's outputs at the end (result.json last). Without a simulator
    (an imported dataset of a task not installed here) an evaluation is the batch's improvement certificate of the
    policy over beta, and the run's score is that certificate (result.json: "score")."""

    def __init__(self, args, writer, data: dict):
        self.args, self.writer, self.records, self.data = args, writer, [], data
        self.simulator = has_simulator(args.env_id)
        self.train_time, self.eval_time, self.start = 0.0, 0.0, time.time()
        self.block_start = time.perf_counter()
        if not self.simulator:
            beta = data["behavior_probs"].astype(np.float64)
            self.cert, reason = certificate_data(data, beta / beta.sum(1, keepdims=True),
                                                 getattr(args, "certificate_gamma", 0.99), behavior_policy(data))
            require(not reason, f"{args.env_id} has no simulator here and the batch cannot certify, so the run has no "
                    f"score: {reason}")
            self.cert_obs = data["observations"][self.cert["rows"]]

    def evaluate(self, step: int, act, envs: list, probs, q=None) -> None:
        """In the simulator (envs), or by the certificate of probs(obs, beta) -> pi(.|s) with the critic q(obs)."""
        if envs:
            return self.record(step, evaluate(act, envs, self.args.eval_seed))
        pi, cert = probs(self.cert_obs, self.cert["beta"]), self.cert
        z = statistics.NormalDist().inv_cdf(getattr(self.args, "certificate_confidence", 0.95))
        c = improvement_certificate(pi, q(self.cert_obs) if q else cert["q_b"], cert, z)
        self.record(step, None, **c, tv_to_beta=tv_to_beta(pi, cert["beta"]))

    def due(self, step: int) -> bool:
        return step % self.args.eval_frequency == 0 or step == self.args.total_steps

    def pause(self) -> None:
        """Training stops here: what follows until record() counts as evaluation time."""
        self.now = time.perf_counter()
        self.train_time += self.now - self.block_start

    def record(self, step: int, returns: Optional[np.ndarray], **extra) -> None:
        """returns: of the evaluation episodes; None without a simulator (extra then holds the certificate)."""
        self.block_start = time.perf_counter()
        self.eval_time += self.block_start - self.now
        sps = step / self.train_time
        if returns is None:
            self.records.append({"step": step, **extra})
            print(f"step={step} improvement_certificate={extra['certificate']:.3g} +- {extra['certificate_se']:.3g} "
                  f"(no simulator) SPS={sps:.0f}", flush=True)
        else:
            self.records.append({"step": step, "return_mean": float(returns.mean()),
                                 "return_std": float(returns.std()), **extra})
            print(f"step={step} eval_return={returns.mean():.1f} +- {returns.std():.1f} SPS={sps:.0f}", flush=True)
        if self.writer:
            if returns is None:
                self.writer.add_scalar("eval/certificate", extra["certificate"], step)
            else:
                self.writer.add_scalar("eval/episodic_return", returns.mean(), step)
            self.writer.add_scalar("charts/SPS", sps, step)

    def finish(self, algorithm: str, data: dict, dataset_path: Path, run_dir: Path, extra: dict, model: dict) -> dict:
        """Write model.pt (with --save-model) and result.json (last: a directory with it holds a finished run)."""
        args = self.args
        # without a simulator an evaluation that deployed beta (brpo's safety test) scores beta's gain over itself: 0
        final_score = float(np.mean([e["return_mean"] if self.simulator else e["certificate"]
                                     if e.get("deployed", "pi") == "pi" else 0.0 for e in self.records[-10:]]))
        result = {
            "algorithm": algorithm, "env_id": args.env_id, "epsilon": args.epsilon, "seed": args.seed,
            "args": asdict(args), "evaluations": self.records, "final_score": final_score,
            "score": "return" if self.simulator else "improvement_certificate",
            "behavior_return": float(data["behavior_return"]), "wall_time": time.time() - self.start,
            "train_time": self.train_time, "eval_time": self.eval_time,
            "updates_per_second": args.total_steps / self.train_time, "dataset_path": str(dataset_path),
            "format_version": RESULT_FORMAT_VERSION, "extra": extra,
        }
        if self.writer:
            self.writer.add_scalar("eval/final_score", final_score, args.total_steps)
            self.writer.flush()  # raises what the writer's thread met (e.g. a full disk)
            self.writer.close()
        if args.save_model:
            save_model_atomic(run_dir / "model.pt", {"algorithm": algorithm, "env_id": args.env_id,
                                                     "args": asdict(args), **model})
        write_json_atomic(run_dir / "result.json", result)
        if self.simulator:
            print(f"final score {final_score:.1f} (behaviour {result['behavior_return']:.1f}); results in {run_dir}")
        else:
            print(f"final score: improvement certificate {final_score:.4g} over beta (no simulator: the batch's "
                  f"first-order estimate of the gain, mean of the last 10 evaluations); results in {run_dir}")
        return result


def main(args, check, train, run_checkpoint, behavior_network: bool = False) -> None:
    """Check the flags, then evaluate a checkpoint, or validate the dataset and train in a fresh run directory."""
    check(args)
    torch.set_num_threads(args.threads)
    if args.eval_checkpoint:
        return run_checkpoint(args)
    if has_simulator(args.env_id) or not args.dataset_path:
        env = make_env(args.env_id)
        obs_dim, n_actions = env.observation_space.shape[0], int(env.action_space.n)
    else:  # an imported dataset of a task not installed here: its sizes, and the certificate as the score
        obs_dim, n_actions = dataset_sizes(args.dataset_path)
        print(f"{args.env_id} is not an installed gymnasium task: no simulator; every evaluation is the batch's "
              "improvement certificate of the policy over beta", flush=True)
        behavior_network = True  # the certificate needs the behaviour model
    dataset_path, data = load_dataset(args, obs_dim, n_actions, behavior_network)
    with run_directory(args) as (run_dir, writer):  # everything is validated: only now create outputs
        train(args, data, dataset_path, run_dir, writer, obs_dim, n_actions)


def dataset_sizes(path: str) -> tuple[int, int]:
    """Observation size and action count of a dataset, read before it is validated (load_dataset checks them)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            obs, probs = f["observations"], f["behavior_probs"]
            require(obs.ndim == 2 and probs.ndim == 2, f"dataset {path}: observations or behavior_probs are not 2-D")
            return int(obs.shape[1]), int(probs.shape[1])
    except SystemExit:
        raise
    except Exception as e:
        fail(f"dataset {path} is unreadable or incomplete ({type(e).__name__}: {' '.join(str(e).split())})")


def cli(args_type, main) -> None:
    """`python script.py --flags`: Ctrl-C or SIGTERM removes what the run wrote and ends in one line, exit 130."""
    # TensorBoard writes from a thread; its OSError (a full disk) surfaces again at the next write or flush, where
    # run_directory turns it into one line, so the thread's own traceback is not printed
    threading.excepthook = lambda a: None if issubclass(a.exc_type, OSError) else threading.__excepthook__(a)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        main(tyro.cli(args_type))
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted; nothing written", file=sys.stderr)
        raise SystemExit(130)


# ---------------------------------------------------------------------------------------------
# Improvement certificate (ours, beyond the paper; docs/brpo.md "The improvement certificate")
# ---------------------------------------------------------------------------------------------
MIN_CERT_EPISODES = 2  # a standard error needs two independent episodes
MAX_BROKEN_SHARE = 0.01  # more rows than this whose next state is not the next row's state: not episode order


def certificate_data(data: dict, beta: np.ndarray, gamma: float, behavior: BehaviorPolicy):
    """What the certificate needs, computed once: the rows of complete logged episodes, their episode index,
    beta(.|s_t), beta(a_t|s_t), the discounted returns-to-go G_t and the behaviour network's state values
    (E_beta Q_b, max Q_b; for an imported dataset the behaviour model's logits). Returns (dict, None), or (None,
    reason) if the batch cannot certify."""
    obs, nxt, actions = data["observations"], data["next_observations"], data["actions"]
    end = data["terminals"] | data["timeouts"]
    n = len(end)
    # a row whose next state is not the next row's state (shuffled or concatenated data) cuts the episode there,
    # and a cut episode has no return-to-go
    broken = np.zeros(n, dtype=bool)
    broken[:-1] = ~end[:-1] & np.any(nxt[:-1] != obs[1:], axis=1)
    broken[-1] = not end[-1]  # the collection stopped mid-episode
    if broken[:-1].sum() > MAX_BROKEN_SHARE * n:
        return None, ("the dataset is not stored in episode order (next_observations[t] != observations[t+1] at "
                      f"{int(broken[:-1].sum())} rows), so the batch has no returns")
    stop = end | broken
    episode = np.concatenate([[0], np.cumsum(stop[:-1])])
    complete = np.zeros(int(episode[-1]) + 1, dtype=bool)
    complete[episode[end]] = True
    rows = np.flatnonzero(complete[episode])
    _, episode = np.unique(episode[rows], return_inverse=True)
    n_episodes = int(episode.max()) + 1 if len(rows) else 0
    if n_episodes < MIN_CERT_EPISODES:
        return None, f"the batch holds {n_episodes} complete episode(s); the certificate needs {MIN_CERT_EPISODES}"
    beta_taken = beta[rows, actions[rows]]
    if not (beta_taken > 0).all():
        return None, "the stored behaviour policy gives probability 0 to logged actions (was the batch drawn from it?)"
    rewards = data["rewards"].astype(np.float64)
    returns, acc = np.zeros(n), 0.0
    for t in range(n - 1, -1, -1):  # discounted return-to-go inside each episode
        acc = rewards[t] + (0.0 if stop[t] else gamma * acc)
        returns[t] = acc
    with torch.no_grad():
        q_b = behavior.q_values(torch.from_numpy(obs[rows])).numpy()
    state_features = np.stack([np.ones(len(rows)), (beta[rows] * q_b).sum(1), q_b.max(1)], 1)
    return {"rows": rows, "episode": episode, "n_episodes": n_episodes, "actions": actions[rows], "beta": beta[rows],
            "beta_taken": beta_taken, "returns": returns[rows], "state_features": state_features, "q_b": q_b}, None


def tv_to_beta(pi: np.ndarray, beta: np.ndarray) -> float:
    """Mean total-variation distance of pi to beta over the rows' states (Theorem 2's L'' is twice this)."""
    return float(0.5 * np.abs(pi - beta).sum(1).mean())


def improvement_certificate(pi: np.ndarray, q: np.ndarray, cert: dict, z: float) -> dict:
    """The first-order improvement g of pi over beta (the policy-gradient identity along beta + c (pi - beta)),
    in the doubly robust form with the control variate q_cv(s, a), an affine function of q(s, a) (a critic's
    action values, or the behaviour network's), E_beta q, max q, E_beta Q_b and max Q_b fitted to the returns
    of the other half of the episodes (cross-fitting keeps it unbiased):
        g = E_episodes[ sum_t sum_a (pi - beta)(a|s_t) q_cv(s_t, a) + (pi / beta - 1)(a_t|s_t) (G_t - q_cv(s_t, a_t)) ].
    Returns g, its standard error over episodes, the one-sided lower bound g - z se and whether it is > 0."""
    n = len(cert["actions"])
    beta, taken, fold = cert["beta"], cert["actions"], cert["episode"] % 2
    state = np.concatenate([cert["state_features"], (beta * q).sum(-1)[:, None], q.max(-1)[:, None]], 1)
    per_step = np.zeros(n)
    for f in (0, 1):  # both halves hold >= 1 episode: n_episodes >= 2
        fit, use = fold != f, fold == f
        x_fit = np.concatenate([state[fit], q[fit, taken[fit]][:, None]], 1)
        coef = np.linalg.lstsq(x_fit, cert["returns"][fit], rcond=None)[0]
        # in sum_a (pi - beta) q_cv the state-only terms cancel: the direct term carries q(s, a) only
        q_cv = (state[use] @ coef[:-1])[:, None] + coef[-1] * q[use]
        direct = ((pi[use] - beta[use]) * q_cv).sum(-1)
        weight = pi[use, taken[use]] / cert["beta_taken"][use] - 1.0  # beta(a_t|s_t) > 0 (certificate_data)
        per_step[use] = direct + weight * (cert["returns"][use] - q_cv[np.arange(len(q_cv)), taken[use]])
    per_episode = np.bincount(cert["episode"], weights=per_step, minlength=cert["n_episodes"])
    g = float(per_episode.mean())
    se = float(per_episode.std(ddof=1) / math.sqrt(len(per_episode)))
    lcb = g - z * se
    return {"certificate": g, "certificate_se": se, "certificate_lcb": lcb, "certified": float(lcb > 0.0)}


def deploy_levels(args: DeployArgs) -> tuple[float, ...]:
    """--deploy-pessimism, by default the level pi was trained at (--pessimism) and the paper's 0."""
    if args.deploy_pessimism is not None:
        return tuple(args.deploy_pessimism)
    return (args.pessimism, 0.0) if args.pessimism != 0.0 else (0.0,)


def deployment_certificate(args: DeployArgs, data: dict, beta: np.ndarray, behavior: BehaviorPolicy):
    """certificate_data for BRPO's deployed-level rule, and the z of one simultaneous (Bonferroni) lower bound per
    --deploy-pessimism level: the chosen level's bound holds at the stated confidence."""
    cert, reason = certificate_data(data, beta, args.certificate_gamma, behavior)
    if reason:
        print(f"warning: no improvement certificate: {reason}; " + ("the safety test deploys beta (--no-safety-test "
              "deploys pi uncertified)" if args.safety_test else "pi is deployed uncertified"), flush=True)
    return cert, statistics.NormalDist().inv_cdf(1.0 - (1.0 - args.certificate_confidence) / len(deploy_levels(args)))


def report_certificate(c: dict, n_episodes: int, args: DeployArgs, deploy_pi: bool, pessimism: float) -> None:
    if c:
        print(f"improvement certificate over {n_episodes} logged episodes: {c['certificate']:.4g} +- "
              f"{c['certificate_se']:.3g}, lower bound {c['certificate_lcb']:.4g} ({args.certificate_confidence:.0%}); "
              "deployed: " + (f"pi, pessimism {pessimism:g}" if deploy_pi else "beta (the safety test)"))


def choose_level(pis: list, q: np.ndarray, cert: dict, z: float) -> tuple[int, dict]:
    """BRPO's deployed level (departure 11 in docs/brpo.md), from pi rebuilt with each --deploy-pessimism level: pi
    as trained (the first) while the batch certifies it, else the certified level with the highest lower bound, else
    the level nearest beta (what remains of Theorem 2's penalty when no gain is shown). Returns the level and its
    certificate."""
    options = [improvement_certificate(pi, q, cert, z) for pi in pis]
    distance = [tv_to_beta(pi, cert["beta"]) for pi in pis]
    certified = [i for i, o in enumerate(options) if o["certified"]]
    if options[0]["certified"]:
        level = 0
    elif certified:
        level = max(certified, key=lambda i: options[i]["certificate_lcb"])
    else:
        level = min(range(len(options)), key=lambda i: distance[i])
    return level, {**options[level], "tv_to_beta": distance[level]}
