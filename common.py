"""What every algorithm script shares and none of them is about: flags' checks, the batch dataset and its
validation, the run directory, atomic outputs, checkpoints, evaluation in the simulator, and the improvement
certificate. Each script holds its whole algorithm; it imports this file for the plumbing (fork a script
together with common.py). Bad input ends in one line on stderr and exit status 1, nothing half-written."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import io
import itertools
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro

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
    seeds: Optional[tuple[int, ...]] = None
    """train these seeds as members of one process, each the same run as --seed alone would be (default: --seed)"""
    epsilons: Optional[tuple[float, ...]] = None
    """train on these datasets of the task (datasets/<env-id>_eps<e>.npz) as members of one process (default:
    --epsilon)"""
    sweep: tuple[str, ...] = ()
    """FLAG=V1,V2,...: values of a hyperparameter trained as members, every combination (e.g. learning-rate=1e-3,3e-4;
    which flags: the script's docstring)"""
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
    eval_sparse_frequency: int = 0
    """updates between evaluations before the last 10 (0: every --eval-frequency throughout); e.g. 5000 draws a sparse
    curve whose final score, the mean of the last 10 evaluations every --eval-frequency, keeps its definition"""
    eval_episodes: int = 40
    """episodes per evaluation, run side by side"""
    eval_seed: int = 10_000
    """evaluation episode i starts from env.reset(seed=eval_seed + i), the same at every evaluation"""
    runs_dir: str = "runs"
    """directory holding one sub-directory per run"""
    run_name: Optional[str] = None
    """sub-directory of this run under --runs-dir (may hold '/'); default <env>__eps<eps>__<exp>__<seed>__<time>; with
    members, a template naming each: {env_id} {epsilon} {seed} {exp_name} and the swept flags, e.g. 'eps{epsilon}/s{seed}'"""
    overwrite: bool = False
    """replace a finished run of the same --run-name, once the new one has finished (without it, such a run is refused)"""
    skip_finished: bool = False
    """skip the members whose run directory holds a finished run (resuming a grid) instead of refusing them"""
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
    huber_delta: float = 0.0
    """TD loss: 0 = the squared error (the paper's Algorithm 1); > 0 = Huber's loss, quadratic within +-delta and
    linear beyond (Nature DQN's, discrete BCQ's, d3rlpy's), so no transition's gradient exceeds delta"""


@dataclass
class DeployArgs(TDArgs):
    """TDArgs and BRPO's deployment flags (brpo.py, brpo_c.py; docs/brpo.md, departure 11)."""
    deploy_pessimism: Optional[tuple[float, ...]] = None
    """pessimism levels of the deployed pi, the first as trained, chosen by the improvement certificate; one value
    fixes it (default: --pessimism, then 0; at --pessimism 0, then 1)"""
    certificate_confidence: float = 0.95
    """simultaneous one-sided confidence of the certificate's lower bounds, one per --deploy-pessimism level"""
    certificate_gamma: float = 0.99
    """discount of the logged returns-to-go in the certificate (1.0: the undiscounted return, noisier)"""
    safety_test: bool = False
    """deploy beta instead of pi whenever the batch does not certify pi's improvement (off: the paper, always pi)"""
    evaluation_critic: bool = False
    """deploy beta while a critic of pi alone (fitted Q evaluation) finds pi worse than beta on the logged episodes"""


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
    for name in ("run_name", "exp_name"):  # a run directory is <runs-dir>/<relative path>, never outside it
        value, parts = getattr(args, name), (getattr(args, name) or "").split("/") if name == "run_name" else [getattr(args, name)]
        # 255 bytes: the file systems' limit per name (a members' template is checked once formatted, per member)
        template = name == "run_name" and bool(args.seeds or args.epsilons or args.sweep)
        if value is not None and (not value.isprintable() or len(value.encode()) > 1000 or any(
                v in ("", ".", "..", REPLACED) or "\\" in v or "/" in v or len(v.encode()) > 255 and not template
                for v in parts)):  # REPLACED: --overwrite's own directory, emptied and removed by a later run
            fail(f"{flag(name)} must be " + ("a relative path of directory names" if name == "run_name" else
                 "a single directory name") + f" of printable characters, at most 255 bytes each and 1000 in all "
                 f"(no '..', no '{REPLACED}'), got {value!r}")
    for name in ("dataset_path", "eval_checkpoint", "runs_dir"):
        if getattr(args, name) == "":
            fail(f"{flag(name)} must not be empty")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        fail(f"--threads must lie in [1, {os.cpu_count()}] (the cores of this machine), got {args.threads}")
    for name in ("total_steps", "batch_size", "target_update_frequency", "eval_frequency", "eval_episodes"):
        if hasattr(args, name) and not 0 < getattr(args, name) <= 10**12:
            fail(f"{flag(name)} must lie in [1, 10**12], got {getattr(args, name)}")
    require(args.eval_sparse_frequency >= 0, f"--eval-sparse-frequency must be >= 0, got {args.eval_sparse_frequency}")
    if args.eval_episodes > 10_000:  # one simulator each, side by side
        fail(f"--eval-episodes must be at most 10000, got {args.eval_episodes}")
    for eps in (args.epsilon, *(args.epsilons or ())):
        if not 0.0 <= eps <= 1.0:
            fail(f"--epsilon must lie in [0, 1], got {eps}")
    for seed in args.seeds or ():
        require(0 <= seed < 2**32, f"--seeds must lie in [0, 2**32), got {seed}")
    require(args.seeds != () and args.epsilons != (), "--seeds and --epsilons need at least one value")
    require(not (args.overwrite and args.skip_finished), "--overwrite (replace finished runs) and --skip-finished (keep "
            "them) contradict each other; pass one of them")
    if not args.learning_rate > 0:
        fail(f"--learning-rate must be positive, got {args.learning_rate}")
    if hasattr(args, "gamma") and not 0.0 <= args.gamma < 1.0:
        fail(f"--gamma must lie in [0, 1), got {args.gamma}")
    if hasattr(args, "tau") and not 0.0 < args.tau <= 1.0:
        fail(f"--tau must lie in (0, 1], got {args.tau}")
    if hasattr(args, "huber_delta") and not args.huber_delta >= 0.0:
        fail(f"--huber-delta must be >= 0 (0: the squared TD error), got {args.huber_delta}")
    if isinstance(args, DeployArgs):
        require(args.deploy_pessimism is None or (args.deploy_pessimism and all(
            0.0 <= p <= 1e3 for p in args.deploy_pessimism) and len(set(args.deploy_pessimism)) == len(
            args.deploy_pessimism)), "--deploy-pessimism needs one or more distinct levels in [0, 1000] (each level "
            f"counts in the simultaneous bound), got {list(args.deploy_pessimism or [])}")
        # below 1 by more than rounding, or the Bonferroni level 1 - (1 - c) / levels rounds to 1 (z = inf)
        require(0.5 <= args.certificate_confidence <= 1.0 - 1e-9,
                f"--certificate-confidence must lie in [0.5, 1), got {args.certificate_confidence}")
        require(0.0 <= args.certificate_gamma <= 1.0, f"--certificate-gamma must lie in [0, 1], got {args.certificate_gamma}")


def ended(e: Exception) -> str:
    """An exception's message as a sentence (gymnasium's end in '.', '?' or nothing), for a hint to follow."""
    text = " ".join(str(e).split())
    return text if text.endswith((".", "?", "!")) else text + "."


def make_env(env_id: str, unknown_hint: str = "Pass an installed gymnasium task, or with the logs of another task, "
             "the dataset import_data.py made of them with --dataset-path") -> gym.Env:
    if env_id == "LunarLander-v2":
        fail("LunarLander-v2 is not registered in gymnasium 1.x; use --env-id LunarLander-v3")
    try:
        with warnings.catch_warnings():  # e.g. gymnasium's deprecation notice: the error, if any, says enough
            warnings.simplefilter("ignore")
            env = gym.make(env_id, disable_env_checker=True)
    except gym.error.Error as e:
        fail(f"cannot make environment {env_id!r}: {ended(e)} {unknown_hint}")
    except ImportError as e:  # a missing package, or one that does not load (gymnasium's shimmy tasks)
        fail(f"environment {env_id!r} needs a package that does not import ({e}); install it (Box2D tasks: "
             "pip install 'gymnasium[box2d]')")
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
        self.epsilon_t = torch.tensor(self.epsilon, dtype=torch.float64)

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
        return epsilon_greedy(h, self.epsilon_t)


def epsilon_greedy(h: torch.Tensor, epsilon: torch.Tensor) -> torch.Tensor:
    """(1 - eps) 1[a = argmax_a h] + eps / |A| (the first index on ties) from action values h [..., |A|] float64;
    epsilon broadcasts against h (one per member in MemberBehavior)."""
    low = epsilon / h.shape[-1]
    return torch.where(h.argmax(-1, keepdim=True) == torch.arange(h.shape[-1]), low + (1.0 - epsilon), low)


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


def load_dataset(args, obs_dim: int, n_actions: int, behavior_network: bool = False, other_batch: str = "") -> tuple[
        Path, dict]:
    """Read and validate the batch (docs/formats.md); a missing *default* dataset is created with collect_data.py.
    behavior_network: the script also needs the stored behaviour network (beta at states outside the batch).
    other_batch: what to do about a batch of another task or epsilon (default: pass the flag that matches it)."""
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
    require(not not_a_file(path), f"dataset {path} is unreadable ({NOT_A_FILE}); recreate it with: {how}")
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
        fail(f"dataset {path} is unreadable ({npz_error(path, e)}); recreate it with: {how}")
    obs_dtype = d["observations"].dtype  # before the conversion below: a lower precision explains a beta mismatch
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
            fail(f"dataset {path} was recorded on {x}, not {args.env_id}; " + (other_batch or f"pass --env-id {x} or "
                 "another dataset"))
        if k == "epsilon" and d["behavior_kind"] == "softmax" and math.isnan(float(x)):
            continue  # an imported dataset: its behaviour policy has no epsilon, and --epsilon is only a label
        if k == "epsilon" and not 0.0 <= float(x) <= 1.0:
            fail(f"dataset {path} has epsilon {float(x)}, outside [0, 1]; recreate it with: {how}")
        if k == "epsilon" and not np.isclose(float(x), args.epsilon):
            fail(f"dataset {path} was collected with epsilon {float(x):g}, not {args.epsilon:g}; " + (
                other_batch or f"pass --epsilon {float(x):g}"))
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
    never = np.flatnonzero(np.take_along_axis(d["behavior_probs"], d["actions"][:, None], 1)[:, 0] <= 0)
    if len(never):  # the logged action had probability 0 under the policy said to have logged it
        fail(f"dataset {path}: behavior_probs gives probability 0 to the logged action in {len(never)} transitions "
             f"(the first: row {never[0]}); recreate it with: {how}")
    if np.abs(d["rewards"]).max() > 1e12:  # squared TD errors of ~r / (1 - gamma) would overflow float32
        fail(f"dataset {path}: rewards reach {np.abs(d['rewards']).max():.3g}; rescale them to at most 1e12 in "
             f"magnitude (recreate it with: {how})")
    if args.batch_size > len(d["actions"]):
        fail(f"--batch-size {args.batch_size} exceeds the dataset's {len(d['actions'])} transitions")
    if behavior_network:
        for k, shape in layout.items():
            w = d[f"behavior_{k}"]
            with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf: refused here
                w32 = w.astype(np.float32) if w.dtype.kind == "f" else w
            if w.dtype.kind != "f" or w.shape != shape or not np.isfinite(w32).all():
                fail(f"dataset {path}: behavior_{k} is not an array of shape {shape} of finite float32 numbers (the "
                     f"behaviour network obs -> 32 -> 16 -> {n_actions}); recreate it with: {how}")
            d[f"behavior_{k}"] = w32
        check = torch.from_numpy(d["observations"][:1000])  # beta at unseen states comes from the stored network
        beta = behavior_policy(d)(check).numpy()
        # an imported dataset's logged propensities are authoritative; its network estimates beta elsewhere
        if d["behavior_kind"] == "epsilon_greedy" and not np.allclose(beta, d["behavior_probs"][:1000], atol=1e-5):
            low = (f" (its observations are stored as {obs_dtype}, whose rounding changes beta: store them as "
                   "float32)") if obs_dtype.kind == "f" and obs_dtype.itemsize < 4 else ""
            fail(f"dataset {path}: behavior_probs disagree with the stored behaviour network and epsilon{low}; "
                 f"recreate it with: {how}")
    return path, d


def read_behavior_kind(d: dict, version: int, path: Path, how: str) -> dict:
    """The behaviour model's kind and parameters: format 1 is always epsilon-greedy."""
    if version == 1:
        return {"behavior_kind": "epsilon_greedy", "behavior_temperature": 1.0, "behavior_floor": 0.0}
    missing = [k for k in ("behavior_kind", "behavior_temperature", "behavior_floor") if k not in d]
    if missing:
        fail(f"dataset {path} (format 2) lacks {missing}; recreate it with: {how}")
    wrong = [k for k in ("behavior_kind", "behavior_temperature", "behavior_floor") if np.ndim(d[k]) != 0 or (
        k != "behavior_kind" and np.asarray(d[k]).dtype.kind not in "iuf")]
    if wrong:
        fail(f"dataset {path}: {wrong} must be single values (a name, then numbers); recreate it with: {how}")
    kind, temperature, floor = str(d["behavior_kind"]), float(d["behavior_temperature"]), float(d["behavior_floor"])
    if kind not in BEHAVIOR_KINDS or not 0.0 < temperature < math.inf or not 0.0 <= floor < 0.5:
        fail(f"dataset {path}: behaviour model {kind!r} (temperature {temperature}, floor {floor}) is not one of "
             f"{list(BEHAVIOR_KINDS)} with a positive temperature and a floor in [0, 0.5); recreate it with: {how}")
    return {"behavior_kind": kind, "behavior_temperature": temperature, "behavior_floor": floor}


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
REPLACED = ".replaced"  # with --overwrite, the finished run being replaced waits here until the new one has finished


def run_files(run_dir: Path) -> list:
    return [p for p in run_dir.iterdir()
            if p.name in RUN_FILES or p.name.startswith("events.out.tfevents.") or p.name.endswith(".tmp")]


def remove_run_files(run_dir: Path) -> None:
    for p in run_files(run_dir):
        p.unlink()


def restore_replaced(run_dir: Path) -> None:
    """The finished run that --overwrite set aside comes back (the new run failed, or was killed before finishing)."""
    replaced = run_dir / REPLACED
    if replaced.is_dir():
        for p in replaced.iterdir():
            p.replace(run_dir / p.name)
        replaced.rmdir()


def close_quietly(writer) -> None:
    with contextlib.suppress(Exception):
        writer.close()


@contextlib.contextmanager
def run_directory(args):
    """<runs-dir>/<run-name>/ and its TensorBoard writer, locked for this run: a second process on the same run name
    is refused. A finished run (result.json) is replaced only with --overwrite, and only once the new one has
    finished (until then it is kept in .replaced/); what a failed or killed run left is removed first. If this run
    fails or is interrupted, what it wrote is removed: a run directory holds a finished run or a running one."""
    name = args.run_name or f"{args.env_id}__eps{args.epsilon:g}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.runs_dir) / name
    try:
        created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # removed again if the run fails
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir, os.O_RDONLY)
    except OSError as e:
        fail(f"cannot create the run directory {run_dir} ({e.strerror}); pass a writable --runs-dir and a valid "
             f"--run-name")

    def undo() -> None:
        """As if this run had not started: what it wrote goes, the run it was replacing comes back, and the
        directories it created go if empty (run_grid.py's run.log stays)."""
        with contextlib.suppress(OSError):
            remove_run_files(run_dir)
            restore_replaced(run_dir)
            for p in dict.fromkeys([run_dir, *created]):
                p.rmdir()

    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the process ends, however it ends
        except OSError:
            fail(f"{run_dir} is in use by another running process; pass another --run-name")
        if (run_dir / REPLACED).is_dir():  # a replacement was killed before it finished (what it wrote goes, the run
            if not (run_dir / "result.json").exists():  # it was replacing comes back) or just after (that run goes)
                remove_run_files(run_dir)
                restore_replaced(run_dir)
            else:
                shutil.rmtree(run_dir / REPLACED)
        if (run_dir / "result.json").exists() and not args.overwrite:
            fail(f"{run_dir} holds a finished run; pass --overwrite to replace it, or another --run-name")
        writer = None
        try:
            if (run_dir / "result.json").exists():  # --overwrite: set aside, not deleted, until this run finishes
                (run_dir / REPLACED).mkdir()
                for p in run_files(run_dir):
                    p.replace(run_dir / REPLACED / p.name)
            remove_run_files(run_dir)
            if args.tensorboard:  # imported here: it costs ~0.5 s, which a --no-tensorboard run does not pay
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    fail("--tensorboard needs the tensorboard package: pip install tensorboard, or pass "
                         "--no-tensorboard")
                writer = SummaryWriter(str(run_dir))
            if writer:
                writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
                    f"|{k}|{v}|" for k, v in vars(args).items()))
            yield run_dir, writer
        except BaseException as e:
            if writer:  # its thread must not write on after the clean-up; bounded, as an interrupt before training
                closing = threading.Thread(target=close_quietly, args=(writer,), daemon=True)  # may have struck
                closing.start()  # while the writer's queue held its lock (interrupt); run_grid waits 10 s
                closing.join(5)
            undo()
            if isinstance(e, OSError) and not isinstance(e, BrokenPipeError):  # that one is stdout's (cli)
                fail(f"cannot write to {run_dir} ({e.strerror or e}); nothing of this run was kept")
            raise
        if (run_dir / "result.json").exists():  # finished: what it replaced goes
            shutil.rmtree(run_dir / REPLACED, ignore_errors=True)
        else:  # failed alone (a member whose training diverged)
            undo()
    finally:
        os.close(fd)


def load_checkpoint(path: str, algorithm: str, keys: dict) -> dict:
    """A model.pt of `algorithm`'s --save-model, loaded as weights only (a checkpoint's code is never run), with
    `keys` (name -> type) and a task whose sizes are those of its environment."""
    require(not not_a_file(path), f"checkpoint {path} is unreadable ({NOT_A_FILE})")
    try:
        with warnings.catch_warnings():  # torch warns before refusing a pickle of more than weights: the error says it
            warnings.simplefilter("ignore")
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
    except (TypeError, ValueError) as e:  # a setting without a typed default (e.g. --seeds) holding another type
        fail(f"checkpoint {path}: its saved settings are invalid ({type(e).__name__}: {e}); save it again with "
             "--save-model")
    return saved


def one_hot(actions: np.ndarray, n_actions: int) -> np.ndarray:
    """A deterministic policy's pi(.|s) from its actions."""
    return np.eye(n_actions)[actions]


def q_function(network):
    """obs [M, N, dim] -> the network's first output Q(s, .) as float64 numpy [M, N, |A|], without gradient."""
    def q(obs) -> np.ndarray:
        with torch.no_grad():
            out = network(torch.as_tensor(obs))
            return (out[0] if isinstance(out, tuple) else out).double().numpy()
    return q


def evaluate_checkpoint(path: str, act, env_id: str, episodes: int, seed: int, note: str = "", n_updates: int = 0) -> None:
    """Evaluate a saved policy like its run did after n_updates updates (the same start states and noise)."""
    require(has_simulator(env_id), f"{env_id} has no simulator here, so {path} cannot be evaluated in it; its "
            f"improvement certificate: python certify.py {path}")
    try:
        returns = Simulators(env_id, 1, episodes, seed).run(act, seed + n_updates)[0]
    except (RuntimeError, ValueError, OverflowError) as e:  # weights that load but give no policy (inf logits)
        fail(f"checkpoint {path} cannot be evaluated: {' '.join(str(e).split())}")
    print(f"{path}: {env_id} return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} episodes{note}")


def has_simulator(env_id: str) -> bool:
    return env_id in gym.envs.registry


NOT_A_FILE = "not a regular file (a directory, pipe or device); a file that can be read from the start is needed"


def not_a_file(path) -> bool:
    """True for a path that exists but is not a regular file: checked before opening, since a pipe blocks its reader
    (or is drained by it)."""
    return Path(path).exists() and not Path(path).is_file()


def npz_error(path, e: Exception) -> str:
    """Why np.load could not read `path`, in words (numpy calls any file that is not a zip 'pickled data')."""
    try:
        if not Path(path).is_file():
            return NOT_A_FILE
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    if not head:
        return "the file is empty"
    if head.startswith(b"\x93NUMPY"):
        return "a single .npy array (numpy.save), not an .npz archive (numpy.savez)"
    if head[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
        return "not an .npz archive, the zip of .npy arrays that numpy.savez writes"
    if "Object arrays cannot be loaded" in str(e):
        return "it holds object arrays, which are not loaded for safety: save numeric or boolean arrays"
    return f"truncated or corrupt: {type(e).__name__}: {' '.join(str(e).split())}"


def dataset_sizes(path: str) -> tuple[int, int]:
    """Observation size and action count of a dataset, read before it is validated (load_dataset checks them)."""
    require(not not_a_file(path), f"dataset {path} is unreadable ({NOT_A_FILE})")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in ("observations", "behavior_probs") if k not in f.files]
            require(not missing, f"dataset {path} lacks {missing}: it was not written by collect_data.py or import_data.py")
            obs, probs = f["observations"], f["behavior_probs"]
            require(obs.ndim == 2 and probs.ndim == 2, f"dataset {path}: observations or behavior_probs are not 2-D")
            return int(obs.shape[1]), int(probs.shape[1])
    except SystemExit:
        raise
    except Exception as e:
        fail(f"dataset {path} is unreadable or incomplete ({npz_error(path, e)})")


INTERRUPTED = threading.Event()  # a SIGINT or SIGTERM arrived (cli's handler)
DEFERRED = threading.Event()  # set while the members train: the run stops at its next update or evaluation step


def interrupt(signum, frame):
    # KeyboardInterrupt strikes wherever the main thread is: inside TensorBoard's Queue.put it can leave the queue's
    # lock held (threading.Condition.__enter__ is Python code), and the writer's close() then waits forever; inside a
    # library's `except BaseException` it is lost. While training, the run stops at a point of ours instead
    # (stop_if_interrupted); a second signal does not wait.
    deferred = DEFERRED.is_set() and not INTERRUPTED.is_set()
    INTERRUPTED.set()
    if not deferred:
        raise KeyboardInterrupt


def stop_if_interrupted() -> None:
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt


def parse(args_type):
    """tyro.cli, with a parse error in one line: tyro's box (message, suggestion, argument helptext) condensed, exit
    2 as tyro's; --help and anything else tyro prints pass through unchanged, and so does a box of another shape."""
    captured, prog = io.StringIO(), Path(sys.argv[0]).name
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(args_type)
    except SystemExit as e:
        line = usage_error(captured.getvalue()) if e.code not in (0, None) else ""
        sys.stderr.write(f"{prog}: error: {line} (see {prog} --help)\n" if line else captured.getvalue())
        raise SystemExit(2 if line else e.code) from None
    sys.stderr.write(captured.getvalue())
    given = {a.partition("=")[0] for a in sys.argv[1:] if a.startswith("--")}
    for one in ("--seed", "--epsilon"):  # else the list would win silently: other runs than the ones asked for
        require(not {one, one + "s"} <= given, f"{one} and {one}s were both given; pass {one}s alone to train "
                f"several, or {one} alone for one")
    return args


def usage_error(text: str) -> str:
    """One line from tyro's error box, drawn in Unicode or (a non-UTF-8 stdout) ASCII: the section under its title, then
    '; perhaps you meant --x' or '; usage: --x TYPE'. Empty if the text is not such a box."""
    rows = [r for r in (line.replace("\u2502", " ").rstrip() for line in text.splitlines()) if r]  # sides blanked
    unicode_box = bool(rows) and rows[0].lstrip()[0] == "\u256d"
    if not (unicode_box or len(rows) > 1 and set(rows[1].strip()) == {"-"}):
        return ""
    sections = [[]]  # rows as (indentation, text)
    for r in rows[1:] if unicode_box else rows[2:]:  # under the title: its top edge, or its own row and rule
        if len(r.strip()) > 2 and set(r.strip()) <= {"\u2500", "-"}:  # a rule between sections
            sections.append([])
        elif r.lstrip()[0] != "\u2570":  # not the bottom edge
            sections[-1].append((len(r) - len(r.lstrip()), r.strip()))
    message = " ".join(text for _, text in sections[0])
    if not message:
        return ""
    for (_, head), *rest in (section for section in sections[1:] if section):
        if rest and "meant" in head:  # options, each above its indented description
            options = [text.split()[0] for indent, text in rest if indent == rest[0][0] and text.startswith("-")]
            message += ("; perhaps you meant " + " or ".join(options)) if options else ""
        elif rest and head.startswith("Argument helptext") and rest[0][1].startswith("-"):
            message += "; usage: " + rest[0][1]
    return message


def cli(args_type, main) -> None:
    """`python script.py --flags`: Ctrl-C or SIGTERM removes what the run wrote and ends in one line, exit 130; so
    does standard output closed by its reader (`| head`) once the run has started, exit 141 (as SIGPIPE would)."""
    # TensorBoard writes from a thread; its OSError (a full disk) surfaces again at the next write or flush, where
    # run_directory turns it into one line, so the thread's own traceback is not printed
    threading.excepthook = lambda a: None if issubclass(a.exc_type, OSError) else threading.__excepthook__(a)
    INTERRUPTED.clear()
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    with contextlib.suppress(AttributeError, ValueError):  # a run name an ASCII terminal cannot show is escaped,
        sys.stdout.reconfigure(errors="backslashreplace")  # not a failure that throws the finished run away
    args = None
    try:
        # --sweep is a list: a second --sweep would silently replace the first (tyro keeps the last)
        require(sum(a == "--sweep" or a.startswith("--sweep=") for a in sys.argv[1:]) <= 1, "--sweep is given more "
                "than once; name every swept flag in one --sweep, e.g. --sweep mu=0.5,0.9 learning-rate=1e-3,3e-4")
        args = parse(args_type)
        status = None
        try:
            main(args)
            status = 0
        except SystemExit as e:
            status = 1 if e.code == 1 else None  # 1: a member failed alone, the others finished
            raise
        finally:  # what the runs wrote is final: a signal while the interpreter shuts down ends it with that status
            if status is not None:
                signal.signal(signal.SIGINT, functools.partial(exit_now, status))
                signal.signal(signal.SIGTERM, functools.partial(exit_now, status))
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted; nothing written", file=sys.stderr)
        raise SystemExit(130)
    except BrokenPipeError:
        quiet_stdout()
        if args is None:  # `--help | head`: the reader has what it wanted
            raise SystemExit(0)
        print(f"{Path(sys.argv[0]).name}: standard output was closed by its reader; stopped, nothing written",
              file=sys.stderr)
        raise SystemExit(141)
    except OSError as e:  # a path flag the file system refuses (checked before anything is written)
        if not too_long(e):
            raise
        fail(too_long(e))


def too_long(e: BaseException) -> str:
    """One line for a path longer than the file system allows; empty for any other error (benchmark/run_grid.py has
    its twin)."""
    if not (isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG):
        return ""
    name = os.fsdecode(e.filename) if e.filename is not None else "a path"
    return f"{name if len(name) <= 80 else name[:40] + '...' + name[-30:]}: {e.strerror} (the file system allows " \
           "255 bytes per name, 4096 per path); pass a shorter path"


def exit_now(status: int, signum=None, frame=None) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(status)


def quiet_stdout() -> None:
    """stdout to /dev/null, so that the interpreter's flush at exit does not fail on the closed pipe again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# ---------------------------------------------------------------------------------------------
# Members: many runs in one process
# ---------------------------------------------------------------------------------------------
# Runs that differ only in seed, dataset or hyperparameter values are trained side by side as the members of one
# process: every network holds one copy per member, each layer's weights stacked [M, in, out] (CORL's
# VectorizedLinear), so one batched matmul runs a layer for all members. A member is the same algorithm as a single
# run: its own initial weights (built after torch.manual_seed(seed), like nn.Linear) and its own minibatch stream;
# no computation mixes members. A single run is the process with one member.
SHARED_MEMBER_FLAGS = ("learning_rate", "gamma", "tau", "target_update_frequency", "huber_delta")


class Stack:
    """K networks of one architecture (nn.Linear layers, ReLU between them): layer l's weight [K, in, out] and bias
    [K, 1, out] are views into one tensor `flat` [K, P], so that one Adam step updates every network. Network k
    computes exactly what the nn.Sequential it was built from computes. __call__(x [K, B, in]) -> [K, B, out]."""

    def __init__(self, nets: list, output=None):
        self.output = output  # applied to the last layer's output (e.g. torch.sigmoid), if given
        linear = [[m for m in net if isinstance(m, nn.Linear)] for net in nets]
        self.sizes = [(m.in_features, m.out_features) for m in linear[0]]
        self.flat = torch.stack([torch.cat([t for m in ls for t in (m.weight.detach().T.reshape(-1), m.bias.detach())])
                                 for ls in linear])
        self.layers = self._views(trainable=True)
        self.plain = self._views()  # the same weights outside autograd (forward_saved)

    def _views(self, trainable: bool = False) -> list:
        """The layers as views of flat, made once. Trainable: each view is a leaf of autograd (flat itself is not),
        so a backward leaves one dense gradient per view, which gradient() concatenates: cheaper than autograd
        scattering every view's gradient into a gradient of flat."""
        layers, o = [], 0
        for n_in, n_out in self.sizes:
            w = self.flat[:, o:o + n_in * n_out].unflatten(1, (n_in, n_out))
            b = self.flat[:, o + n_in * n_out:o + n_in * n_out + n_out].unsqueeze(1)
            layers.append((w.requires_grad_(), b.requires_grad_()) if trainable else (w, b))
            o += n_in * n_out + n_out
        return layers

    def gradient(self) -> torch.Tensor:
        """The gradient [K, P] of the last backward, laid out like flat; the views' gradients are cleared."""
        grads = torch.cat([t.grad.flatten(1) for layer in self.layers for t in layer], 1)
        for layer in self.layers:
            for t in layer:
                t.grad = None
        return grads

    def __call__(self, x: torch.Tensor, saved: Optional[list] = None) -> torch.Tensor:
        layers = self.layers if torch.is_grad_enabled() else self.plain  # the same weights; no autograd bookkeeping
        for i, (w, b) in enumerate(layers):
            x = torch.baddbmm(b, x, w)
            if i < len(layers) - 1:
                x = x.relu_()  # in place: baddbmm keeps no output for its backward
                if saved is not None:
                    saved.append(x)
        return self.output(x) if self.output else x

    def forward_saved(self, x: torch.Tensor) -> torch.Tensor:
        """__call__ outside autograd, keeping the input and the hidden layers' outputs for backward(): for a loss whose
        gradient with respect to the output is written by hand (bcq_discrete.py), which skips building and walking
        autograd's graph of the loss."""
        if self.output:
            raise ValueError("Stack.backward does not differentiate the output function; use autograd")
        self.saved = [x]
        with torch.no_grad():
            return self(x, self.saved)

    def backward(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient [K, P], laid out like flat, of a loss whose gradient with respect to the last forward_saved()
        output is g [K, B, out]: the operations autograd runs for __call__'s backward (baddbmm's and ReLU's), so the
        same numbers bit for bit (tested)."""
        grads = []
        for i in reversed(range(len(self.plain))):
            x = self.saved[i]
            grads[:0] = [x.transpose(1, 2).bmm(g).flatten(1), g.sum(1, keepdim=True).flatten(1)]
            if i:
                g = torch.ops.aten.threshold_backward(g.bmm(self.plain[i][0].transpose(1, 2)), x, 0)
        self.saved = None
        return torch.cat(grads, 1)

    def copy(self) -> "Stack":
        """A target network: the same weights, no gradient."""
        return self.select(list(range(len(self.flat))))

    def select(self, ks: list) -> "Stack":
        """A copy of networks ks (no gradient), e.g. one member's networks for its final diagnostics."""
        copy = object.__new__(Stack)
        copy.sizes, copy.flat, copy.output = self.sizes, self.flat[ks].clone(), self.output
        copy.layers = copy.plain = copy._views()
        return copy

    def part(self, ks: slice) -> "Stack":
        """Networks ks sharing this Stack's weights (a view, no gradient), e.g. the Q towers of a target network."""
        view = object.__new__(Stack)
        view.sizes, view.flat, view.output = self.sizes, self.flat[ks], self.output
        view.layers = view.plain = view._views()
        return view

    def state_dict(self, k: int, prefix: str = "") -> dict:
        """Network k as the state_dict of the nn.Sequential it was built from (Linear layers at 0, 2, 4, ...)."""
        out = {}
        for i, (w, b) in enumerate(self.layers):
            out[f"{prefix}{2 * i}.weight"] = w[k].detach().T.clone()
            out[f"{prefix}{2 * i}.bias"] = b[k, 0].detach().clone()
        return out


TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, 2^-126


class Adam:
    """torch.optim.Adam's update (betas 0.9, 0.999, eps 1e-8) of a Stack, with each network's own learning rate
    lr [K, 1]: one update for all members."""

    def __init__(self, stack: Stack, lr: torch.Tensor):
        self.stack, self.flat, self.lr, self.t = stack, stack.flat, lr, 0
        self.m, self.v = torch.zeros_like(self.flat), torch.zeros_like(self.flat)

    def step(self, g: Optional[torch.Tensor] = None) -> None:
        """One update with the gradient g [K, P] (default: the stack's, from the last backward)."""
        g, self.t = self.stack.gradient() if g is None else g, self.t + 1
        self.m.lerp_(g, 0.1)
        # m of a parameter whose gradient is 0 decays into subnormal numbers and stays at the smallest one (0.9 times it
        # rounds back up to it), on which every later update's arithmetic is many times slower. Flushing |m| < 2^-126
        # to 0 changes a step by under lr * 1.2e-29 (1 / (1 - 0.9^t) <= 10, denom >= 1e-8): no bit of any weight
        # with |w| > lr * 2e-22. Every 100 updates, as the flush costs about what an update's subnormals cost.
        if self.t % 100 == 0:
            self.m.masked_fill_(self.m.abs() < TINY, 0.0)
        self.v.mul_(0.999).addcmul_(g, g, value=0.001)
        # v of a parameter whose gradient is 0 (a dead ReLU unit) decays to 0 through subnormals, on which sqrt is
        # 5-30x slower. Below 1e-36, sqrt(v) / sqrt(1 - 0.999^t) < 4e-17 vanishes when 1e-8 is added (half an ulp of
        # 1e-8 in float32 is 4e-16): the floor changes no bit of denom.
        denom = (self.v.clamp_min(1e-36).sqrt_() / math.sqrt(1.0 - 0.999 ** self.t)).add_(1e-8)
        with torch.no_grad():  # flat is the base of the layers' views, which require gradients
            self.flat.addcdiv_(self.m * (self.lr / (1.0 - 0.9 ** self.t)), denom, value=-1.0)


def soft_update(step: int, target: Stack, online: Stack, period: torch.Tensor, tau: torch.Tensor) -> None:
    """target <- tau * online + (1 - tau) * target for the members whose --target-update-frequency divides step."""
    if any(step % k == 0 for k in set(period.flatten().tolist())):  # tested in Python: no tensor op on most updates
        with torch.no_grad():
            target.flat.lerp_(online.flat, tau * (step % period == 0))


def td_loss(delta: torch.Tensor):
    """The TD loss of members whose --huber-delta is delta [M, 1]: (q, target) [M, B] -> [M], each member's mean over
    its minibatch of the squared error (delta 0) or of Huber's loss (0.5 e^2 within +-delta, delta (|e| - delta / 2)
    beyond: at delta 1 exactly F.smooth_l1_loss's numbers)."""
    if not bool((delta > 0).any()):  # decided once: every member's loss is the paper's squared error
        return lambda q, target: (q - target).square().mean(1)

    def loss(q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        e = q - target
        a = e.abs()
        huber = torch.where(a < delta, 0.5 * e.square(), delta * (a - 0.5 * delta))
        return torch.where(delta > 0, huber, e.square()).mean(1)
    return loss


def row_sum(x, keepdims: bool = False):
    """x.sum(-1) over a short last axis (the actions), the same numbers: numpy's reduction along a short contiguous
    axis is 10-40x slower than |A| - 1 elementwise additions (docs/experiments/2026-11-25-fast-paths.md). numpy adds
    fewer than 8 numbers in order, as this fold does; torch tensors and longer axes take the plain sum."""
    if isinstance(x, torch.Tensor) or x.shape[-1] >= 8:
        return x.sum(-1, keepdims=keepdims)
    s = functools.reduce(np.add, [x[..., a] for a in range(x.shape[-1])])
    return s[..., None] if keepdims else s


# Sorting networks (Knuth, TAOCP 3, 5.3.4; optimal size for 6 and 8 inputs): comparators (i, j), i < j.
SORTING_NETWORKS = {6: ((0, 5), (1, 3), (2, 4), (1, 2), (3, 4), (0, 3), (2, 5), (0, 1), (2, 3), (4, 5), (1, 2), (3, 4)),
                    8: ((0, 2), (1, 3), (4, 6), (5, 7), (0, 4), (1, 5), (2, 6), (3, 7), (0, 1), (2, 3), (4, 5), (6, 7),
                        (2, 4), (3, 5), (1, 4), (3, 6), (1, 2), (3, 4), (5, 6))}


def sort_rows(rows: list) -> np.ndarray:
    """np.sort(np.stack(rows), 0) for values without NaN: k arrays sorted elementwise, by a sorting network of
    elementwise minima and maxima where one is known (3-4x faster than np.sort along a short axis)."""
    if len(rows) not in SORTING_NETWORKS:
        return np.sort(np.stack(rows), 0)
    rows = list(rows)
    for i, j in SORTING_NETWORKS[len(rows)]:
        rows[i], rows[j] = np.minimum(rows[i], rows[j]), np.maximum(rows[i], rows[j])
    return np.stack(rows)


def row_max(x: np.ndarray, keepdims: bool = False) -> np.ndarray:
    """x.max(-1) over a short last axis, the same numbers (NaN propagates as in max), |A| - 1 elementwise maxima."""
    s = functools.reduce(np.maximum, [x[..., a] for a in range(x.shape[-1])])
    return s[..., None] if keepdims else s


def in_blocks(f, n: int, size: int) -> np.ndarray:
    """f over consecutive blocks of `size` (at least 1) of n states, f(slice) -> [M, block, ...], concatenated on
    axis 1: the same numbers as f on all n at once, with the temporaries in cache (~2x on the certificate's 2.5M
    states)."""
    size = max(size, 1)
    return np.concatenate([f(slice(i, i + size)) for i in range(0, n, size)], 1)


def sample(pi: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Actions drawn from pi [..., E, |A|] by inverting its CDF at the uniforms u [E]: episode e of every member uses
    the same noise, so a member's evaluation does not depend on which other members share the process."""
    return (pi.cumsum(-1) < u[:, None]).sum(-1).clamp_max(pi.shape[-1] - 1)


class AcrobotVector:
    """Acrobot-v1 for n episodes at once: gymnasium's dynamics (AcrobotEnv._dsdt's expressions on arrays of states)
    integrated by the same one-step RK4, wrap, bound, reward, termination and 500-step limit as AcrobotEnv.step, in
    the same float64 operations: the same trajectories as n gymnasium environments (tested), without n Python calls
    per time step. step(actions) -> (obs, reward, terminated, truncated). The RK4 stages and the dynamics write into
    buffers made once (numpy's temporaries cost as much as the arithmetic on these ~1,000-element arrays)."""

    def __init__(self, starts: np.ndarray):
        from gymnasium.envs.classic_control.acrobot import AcrobotEnv
        self.env, self.state, self.steps = AcrobotEnv(), starts.astype(np.float64), 0  # state [4, n]
        self.limit = gym.spec("Acrobot-v1").max_episode_steps
        n = self.state.shape[1]
        self.k, self.y, self.tmp = np.empty((4, 5, n)), np.empty((2, 5, n)), np.empty((7, n))  # RK4 stages, scratch
        self.last_obs, self.terminated = np.empty((n, 6), dtype=np.float32), np.empty(n, dtype=bool)
        self.observe(slice(None))

    def obs(self, cos0: Optional[np.ndarray] = None, cols=slice(None)) -> np.ndarray:
        s = self.state[:, cols]
        cos0 = np.cos(s[0]) if cos0 is None else cos0
        return np.stack([cos0, np.sin(s[0]), np.cos(s[1]), np.sin(s[1]), s[2], s[3]], 1).astype(np.float32)

    def observe(self, cols) -> None:
        """The observations and terminations of episodes cols, from their states."""
        s = self.state[:, cols]
        cos0 = np.cos(s[0])
        self.last_obs[cols] = self.obs(cos0, cols)
        self.terminated[cols] = -cos0 - np.cos(s[1] + s[0]) > 1.0

    def dsdt(self, y: np.ndarray, out: np.ndarray) -> np.ndarray:
        """AcrobotEnv._dsdt ("book" dynamics), the same operations in the same order, into out [5, n]; cos(theta2) and
        sin(theta2) computed once instead of five times (the trigonometric functions are most of a step's cost);
        y [5, n]: state, torque."""
        e = self.env
        m1, m2, l1, lc1, lc2 = e.LINK_MASS_1, e.LINK_MASS_2, e.LINK_LENGTH_1, e.LINK_COM_POS_1, e.LINK_COM_POS_2
        I1 = I2 = e.LINK_MOI  # noqa: N806  (gymnasium's names)
        g, pi, n = 9.8, np.pi, y.shape[1]
        a, theta1, theta2, dtheta1, dtheta2 = y[4], y[0], y[1], y[2], y[3]
        cos2, sin2, d1, d2, phi1, phi2, t = self.tmp[:, :n]
        out[0], out[1], out[4] = dtheta1, dtheta2, 0.0  # the torque's derivative: 0
        np.cos(theta2, out=cos2)
        np.sin(theta2, out=sin2)
        # d1 = m1 lc1^2 + m2 (l1^2 + lc2^2 + 2 l1 lc2 cos2) + I1 + I2
        np.multiply(2 * l1 * lc2, cos2, out=d1)
        np.add(l1**2 + lc2**2, d1, out=d1)
        np.multiply(m2, d1, out=d1)
        np.add(m1 * lc1**2, d1, out=d1)
        d1 += I1
        d1 += I2
        # d2 = m2 (lc2^2 + l1 lc2 cos2) + I2
        np.multiply(l1 * lc2, cos2, out=d2)
        np.add(lc2**2, d2, out=d2)
        np.multiply(m2, d2, out=d2)
        d2 += I2
        # phi2 = m2 lc2 g cos(theta1 + theta2 - pi/2)
        np.add(theta1, theta2, out=phi2)
        phi2 -= pi / 2.0
        np.cos(phi2, out=phi2)
        np.multiply(m2 * lc2 * g, phi2, out=phi2)
        # phi1 = -m2 l1 lc2 dtheta2^2 sin2 - 2 m2 l1 lc2 dtheta2 dtheta1 sin2 + (m1 lc1 + m2 l1) g cos(theta1 - pi/2) + phi2
        np.square(dtheta2, out=phi1)
        np.multiply(-m2 * l1 * lc2, phi1, out=phi1)
        phi1 *= sin2
        np.multiply(2 * m2 * l1 * lc2, dtheta2, out=t)
        t *= dtheta1
        t *= sin2
        phi1 -= t
        np.subtract(theta1, pi / 2, out=t)
        np.cos(t, out=t)
        np.multiply((m1 * lc1 + m2 * l1) * g, t, out=t)
        phi1 += t
        phi1 += phi2
        # ddtheta2 = (a + d2 / d1 phi1 - m2 l1 lc2 dtheta1^2 sin2 - phi2) / (m2 lc2^2 + I2 - d2^2 / d1)
        dd2, dd1 = out[3], out[2]
        np.divide(d2, d1, out=dd2)
        dd2 *= phi1
        np.add(a, dd2, out=dd2)
        np.square(dtheta1, out=t)
        np.multiply(m2 * l1 * lc2, t, out=t)
        t *= sin2
        dd2 -= t
        dd2 -= phi2
        np.square(d2, out=t)
        t /= d1
        np.subtract(m2 * lc2**2 + I2, t, out=t)
        dd2 /= t
        # ddtheta1 = -(d2 ddtheta2 + phi1) / d1
        np.multiply(d2, dd2, out=dd1)
        dd1 += phi1
        np.negative(dd1, out=dd1)
        dd1 /= d1
        return out

    def step(self, actions: np.ndarray, active: Optional[np.ndarray] = None):
        """active: the episodes still running (default all); the others' states, observations and terminations stay
        as they are (each episode is integrated on its own, so stepping fewer changes none of the numbers)."""
        env, derivs = self.env, self.dsdt
        cols = slice(None) if active is None or active.all() else np.flatnonzero(active)
        n, dt = self.state.shape[1] if isinstance(cols, slice) else len(cols), env.dt
        (k1, k2, k3, k4), (y0, y) = self.k[:, :, :n], self.y[:, :, :n]
        y0[:4] = self.state[:, cols]
        np.take(np.asarray(env.AVAIL_TORQUE, dtype=np.float64), actions[cols], out=y0[4])
        # y0 + dt/2 k1, y0 + dt/2 k2, y0 + dt k3, y0 + dt/6 (k1 + 2 k2 + 2 k3 + k4): RK4 as gymnasium's rk4
        derivs(y0, k1)
        derivs(np.add(y0, np.multiply(dt / 2.0, k1, out=y), out=y), k2)
        derivs(np.add(y0, np.multiply(dt / 2.0, k2, out=y), out=y), k3)
        derivs(np.add(y0, np.multiply(dt, k3, out=y), out=y), k4)
        np.multiply(2, k2, out=y)
        np.add(k1, y, out=y)
        y += np.multiply(2, k3, out=k1)  # k1 is no longer needed
        y += k4
        y *= dt / 6.0
        ns = np.add(y0, y, out=y)[:4]
        for i in (0, 1):  # wrap(x, -pi, pi), one 2 pi at a time like gymnasium's loop
            while (ns[i] > np.pi).any() or (ns[i] < -np.pi).any():
                ns[i] = np.where(ns[i] > np.pi, ns[i] - 2 * np.pi, np.where(ns[i] < -np.pi, ns[i] + 2 * np.pi, ns[i]))
        ns[2] = np.minimum(np.maximum(ns[2], -env.MAX_VEL_1), env.MAX_VEL_1)
        ns[3] = np.minimum(np.maximum(ns[3], -env.MAX_VEL_2), env.MAX_VEL_2)
        self.state[:, cols], self.steps = ns, self.steps + 1
        self.observe(cols)
        terminated = self.terminated.copy()
        return (self.last_obs.copy(), np.where(terminated, 0.0, -1.0), terminated,
                np.full_like(terminated, self.steps >= self.limit))


class LunarLanderSteps:
    """LunarLander-v3 (discrete, no wind) for n episodes: gymnasium's environments and their Box2D worlds, each time
    step applying the engine impulses, stepping the world and computing the observation, reward and termination as
    LunarLander.step does, in the same operations (the same trajectories, tested), without its per-call checks.
    The engines' dispersion draws come from the environment's own generator, two per step as in step(), drawn a block
    at a time after each reset (a Generator's uniforms are the same numbers drawn one by one or as an array).
    step(active, actions) -> the active episodes' observations [k, 8] float32, rewards [k], terminated [k].

    What a step reads from and writes to the landers (pose, velocities, the engines' impulses) goes straight to Box2D's
    b2Body structs, all environments in a few numpy operations on views at the bodies' addresses, with
    b2Body::ApplyLinearImpulse's float32 arithmetic, so that Box2D's world step is nearly all of a step's cost (the
    measurement: docs/benchmark.md). The structs' layout (Box2D 2.3's) is checked against Box2D's accessors and one impulse at every reset; if it does not match,
    every step goes through the Python interface (direct = False), with the same numbers."""

    BLOCK = 512  # dispersion draws per environment at a time: two per step, 256 steps
    # b2Body's fields in float32 words (Box2D 2.3): m_xf.p, m_sweep.c, m_sweep.a, m_linearVelocity,
    # m_angularVelocity, m_invMass, m_invI; m_type (int32) is word 0, m_flags (uint16) byte 4
    POS, CENTER, ANGLE, VEL, SPIN, INV_MASS, INV_I = 3, 11, 14, 16, 18, 37, 39
    STRUCT_WORDS, AWAKE = 64, 0x0002  # a bound on the words read; b2Body::e_awakeFlag

    def __init__(self, envs: list, direct: bool = True):
        from gymnasium.envs.box2d import lunar_lander as ll
        self.envs, self.ll, self.t, self.allow_direct = [e.unwrapped for e in envs], ll, 0, direct

    def reset(self, seeds) -> np.ndarray:
        obs = np.stack([env.reset(seed=s)[0] for env, s in zip(self.envs, seeds)])
        self.noise = np.stack([env.np_random.uniform(-1.0, 1.0, self.BLOCK) / self.ll.SCALE for env in self.envs])
        self.prev_shaping = np.array([env.prev_shaping for env in self.envs])
        self.helipad_y = np.array([env.helipad_y for env in self.envs])
        self.t = 0
        self.direct = self.allow_direct and self.map_bodies()
        return obs

    def replay(self, ks: np.ndarray, seeds: list, past: np.ndarray) -> None:
        """Environments ks to where episodes reset(seed=seeds) are after the actions past [steps, len(ks)] (the steps
        so far of the copies they leave): reset, the same dispersion draws, then those steps one environment at a
        time through Box2D's Python interface, only the impulses and the world steps (the same numbers as
        step_direct's); the shaping the next reward starts from is computed once, at the end."""
        ll, scale = self.ll, self.ll.SCALE
        for k, seed, actions in zip(ks.tolist(), seeds, past.T.tolist()):
            env = self.envs[k]
            env.reset(seed=seed)
            noise = env.np_random.uniform(-1.0, 1.0, self.noise.shape[1]) / scale
            self.noise[k], self.helipad_y[k], lander, d = noise, env.helipad_y, env.lander, noise.tolist()
            for t, a in enumerate(actions):
                if 1 <= a <= 3:  # engines(), one episode in Python floats (the same IEEE operations)
                    angle, (px, py), d0, d1 = lander.angle, lander.position, d[2 * t], d[2 * t + 1]
                    tip0, tip1 = math.sin(angle), math.cos(angle)
                    if a == 2:
                        ox = tip0 * (ll.MAIN_ENGINE_Y_LOCATION / scale + 2 * d0) + (-tip1) * d1
                        oy = -tip1 * (ll.MAIN_ENGINE_Y_LOCATION / scale + 2 * d0) - tip0 * d1
                        power, x, y = ll.MAIN_ENGINE_POWER, px + ox, py + oy
                    else:
                        ox = tip0 * d0 + (-tip1) * (3 * d1 + (a - 2.0) * ll.SIDE_ENGINE_AWAY / scale)
                        oy = -tip1 * d0 - tip0 * (3 * d1 + (a - 2.0) * ll.SIDE_ENGINE_AWAY / scale)
                        power = ll.SIDE_ENGINE_POWER
                        x, y = px + ox - tip0 * 17 / scale, py + oy + tip1 * ll.SIDE_ENGINE_HEIGHT / scale
                    lander.ApplyLinearImpulse((-ox * power * 1.0, -oy * power * 1.0), (x, y), True)
                env.world.Step(1.0 / ll.FPS, 6 * 30, 2 * 30)
            self.prev_shaping[k] = self.shaping(self.states([k]))[0] if actions else env.prev_shaping
        self.direct = self.direct and self.map_bodies(ks)

    def map_bodies(self, ks: Optional[np.ndarray] = None) -> bool:
        """Views of the landers' b2Body structs (float32, uint16 and int32 views from the lowest address to past the
        highest; only the fields indexed are ever read) and each lander's word offset; ks: only those landers are
        new (replayed), the views are kept if they reach them. False (the Python interface) if the check fails."""
        try:
            ks = np.arange(len(self.envs)) if ks is None else ks
            addresses = np.array([int(self.envs[k].lander.this) for k in ks.tolist()], dtype=np.int64)
            rel = addresses - getattr(self, "base", 0)
            if len(ks) == len(self.envs) or rel.min() < 0 or (rel % 4).any() or rel.max() // 4 + self.STRUCT_WORDS > len(
                    self.f32):
                ks, addresses = np.arange(len(self.envs)), np.array([int(b.this) for b in self.landers()], np.int64)
                self.base = int(addresses.min()) & ~7
                words = (int(addresses.max()) - self.base) // 4 + self.STRUCT_WORDS
                self.f32 = np.ctypeslib.as_array((ctypes.c_float * words).from_address(self.base))
                self.u16 = np.ctypeslib.as_array((ctypes.c_uint16 * (2 * words)).from_address(self.base))
                self.i32 = np.ctypeslib.as_array((ctypes.c_int32 * words).from_address(self.base))
                self.off, rel = np.zeros(len(self.envs), dtype=np.int64), addresses - self.base
                if (rel % 4).any():
                    return False
            self.off[ks] = rel // 4
            return self.layout_holds(ks)
        except Exception:  # noqa: BLE001  (another Box2D build): the Python interface, the same numbers
            return False

    def layout_holds(self, ks: np.ndarray) -> bool:
        """The fields step_direct() uses, read at the offsets assumed, equal Box2D's accessors for landers ks, and one
        impulse applied to the first of them by Box2D and by step_direct()'s arithmetic gives the same velocities
        (then restored)."""
        f, o, bodies = self.f32, self.off[ks], [self.envs[k].lander for k in ks.tolist()]
        expected = {self.POS: [b.position.x for b in bodies], self.POS + 1: [b.position.y for b in bodies],
                    self.CENTER: [b.worldCenter.x for b in bodies], self.CENTER + 1: [b.worldCenter.y for b in bodies],
                    self.ANGLE: [b.angle for b in bodies], self.VEL: [b.linearVelocity.x for b in bodies],
                    self.VEL + 1: [b.linearVelocity.y for b in bodies], self.SPIN: [b.angularVelocity for b in bodies],
                    self.INV_MASS: [np.float32(1.0) / np.float32(b.mass) for b in bodies]}
        if not all(np.array_equal(f[o + k].astype(np.float64), np.asarray(v, dtype=np.float64))
                   for k, v in expected.items()):
            return False
        if not ((self.i32[o] == 2).all() and ((self.u16[2 * o + 2] & self.AWAKE) != 0).all()):  # dynamic and awake
            return False
        b, k, fields = bodies[0], o[:1], (self.VEL, self.VEL + 1, self.SPIN)
        saved = [f[k + i].copy() for i in fields]
        impulse, point = np.float32([0.37, -1.3]), np.float32([b.position.x + 0.11, b.position.y - 0.23])
        predicted = self.impulse_velocities(k, impulse[:1], impulse[1:], point[:1], point[1:])
        b.ApplyLinearImpulse(tuple(impulse.tolist()), tuple(point.tolist()), True)
        ok = all(np.array_equal(p, f[k + i]) for p, i in zip(predicted, fields))
        for i, value in zip(fields, saved):
            f[k + i] = value
        return ok and all(np.array_equal(f[k + i], value) for i, value in zip(fields, saved))

    def landers(self):
        return (env.lander for env in self.envs)

    def impulse_velocities(self, o, ix, iy, px, py):
        """b2Body::ApplyLinearImpulse on awake bodies at word offsets o, in float32 as Box2D computes it: v += invMass
        impulse, w += invI cross(point - center, impulse). Returns the new (v.x, v.y, w)."""
        f = self.f32
        inv_m, inv_i = f[o + self.INV_MASS], f[o + self.INV_I]
        cross = (px - f[o + self.CENTER]) * iy - (py - f[o + self.CENTER + 1]) * ix
        return f[o + self.VEL] + inv_m * ix, f[o + self.VEL + 1] + inv_m * iy, f[o + self.SPIN] + inv_i * cross

    def step(self, active: np.ndarray, actions: np.ndarray):
        ll, i0 = self.ll, 2 * self.t
        if i0 + 1 >= self.noise.shape[1]:  # the generators' next draws, continuing each one's stream
            self.noise = np.concatenate([self.noise, np.stack([env.np_random.uniform(-1.0, 1.0, self.BLOCK) / ll.SCALE
                                                               for env in self.envs])], 1)
        out = self.step_direct(active, actions) if self.direct else self.step_each(active, actions)
        self.t += 1
        return out

    def engines(self, angle, px, py, d0, d1, actions):
        """LunarLander.step's engine impulses (float64, as it computes them) of the firing episodes: their indices
        into the arguments, the impulses (x, y) and the points (x, y) they apply at."""
        ll, scale = self.ll, self.ll.SCALE
        fire = np.flatnonzero((actions >= 1) & (actions <= 3))
        tip0 = np.array([math.sin(a) for a in angle[fire].tolist()])  # math's, as step(): numpy's may round otherwise
        tip1 = np.array([math.cos(a) for a in angle[fire].tolist()])
        d0, d1, main = d0[fire], d1[fire], actions[fire] == 2
        direction = actions[fire] - 2.0
        # main engine (action 2): tip (sin, cos), side (-cos, sin), as in step()
        ox_main = tip0 * (ll.MAIN_ENGINE_Y_LOCATION / scale + 2 * d0) + (-tip1) * d1
        oy_main = -tip1 * (ll.MAIN_ENGINE_Y_LOCATION / scale + 2 * d0) - tip0 * d1
        # orientation engines (1, 3)
        ox_side = tip0 * d0 + (-tip1) * (3 * d1 + direction * ll.SIDE_ENGINE_AWAY / scale)
        oy_side = -tip1 * d0 - tip0 * (3 * d1 + direction * ll.SIDE_ENGINE_AWAY / scale)
        ox, oy = np.where(main, ox_main, ox_side), np.where(main, oy_main, oy_side)
        power = np.where(main, ll.MAIN_ENGINE_POWER, ll.SIDE_ENGINE_POWER)
        x = np.where(main, px[fire] + ox, px[fire] + ox - tip0 * 17 / scale)
        y = np.where(main, py[fire] + oy, py[fire] + oy + tip1 * ll.SIDE_ENGINE_HEIGHT / scale)
        return fire, -ox * power * 1.0, -oy * power * 1.0, x, y  # m_power = s_power = 1

    def step_direct(self, active: np.ndarray, actions: np.ndarray):
        ll, f, o, i0, fps = self.ll, self.f32, self.off[active], 2 * self.t, self.ll.FPS
        fire, ix, iy, px, py = self.engines(f[o + self.ANGLE].astype(np.float64), f[o + self.POS].astype(np.float64),
                                            f[o + self.POS + 1].astype(np.float64), self.noise[active, i0],
                                            self.noise[active, i0 + 1], actions)
        if fire.size:  # Box2D takes the impulse and its point as float32
            k = o[fire]
            f[k + self.VEL], f[k + self.VEL + 1], f[k + self.SPIN] = self.impulse_velocities(
                k, ix.astype(np.float32), iy.astype(np.float32), px.astype(np.float32), py.astype(np.float32))
        flags = []
        for j in active.tolist():
            env = self.envs[j]
            env.world.Step(1.0 / fps, 6 * 30, 2 * 30)
            flags.append((env.legs[0].ground_contact, env.legs[1].ground_contact, env.game_over))
        legs0, legs1, game_over = np.array(flags, dtype=bool).reshape(-1, 3).T
        w2, h2 = ll.VIEWPORT_W / ll.SCALE / 2, ll.VIEWPORT_H / ll.SCALE / 2
        x, y, vx, vy, angle, spin = (f[o + k].astype(np.float64) for k in (self.POS, self.POS + 1, self.VEL,
                                                                           self.VEL + 1, self.ANGLE, self.SPIN))
        s = np.stack([(x - w2) / w2, (y - (self.helipad_y[active] + ll.LEG_DOWN / ll.SCALE)) / h2, vx * w2 / fps,
                      vy * h2 / fps, angle, 20.0 * spin / fps, legs0.astype(np.float64), legs1.astype(np.float64)], 1)
        return self.outcome(active, s, actions, game_over, (self.u16[2 * o + 2] & self.AWAKE) != 0)

    @staticmethod
    def shaping(s: np.ndarray) -> np.ndarray:
        return (-100 * np.sqrt(s[:, 0] * s[:, 0] + s[:, 1] * s[:, 1]) - 100 * np.sqrt(s[:, 2] * s[:, 2] + s[:, 3] *
                s[:, 3]) - 100 * np.abs(s[:, 4]) + 10 * s[:, 6] + 10 * s[:, 7])

    def outcome(self, active, s, actions, game_over, awake):
        """step()'s reward and termination from the new states s [k, 8] (float64)."""
        shaping = self.shaping(s)
        reward = shaping - self.prev_shaping[active]
        self.prev_shaping[active] = shaping
        reward -= (actions == 2) * 0.30
        reward -= ((actions == 1) | (actions == 3)) * 0.03
        crash = game_over | (np.abs(s[:, 0]) >= 1.0)
        reward = np.where(~awake, 100.0, np.where(crash, -100.0, reward))
        return s.astype(np.float32), reward, crash | ~awake

    def step_each(self, active: np.ndarray, actions: np.ndarray):
        """The same step through Box2D's Python interface, one environment at a time."""
        landers = [self.envs[j].lander for j in active.tolist()]
        pose = np.array([(b.angle, *b.position) for b in landers], dtype=np.float64).reshape(-1, 3)
        fire, ix, iy, px, py = self.engines(pose[:, 0], pose[:, 1], pose[:, 2], self.noise[active, 2 * self.t],
                                            self.noise[active, 2 * self.t + 1], actions)
        for k, x, y, a, b in zip(fire.tolist(), ix.tolist(), iy.tolist(), px.tolist(), py.tolist()):
            landers[k].ApplyLinearImpulse((x, y), (a, b), True)
        for j in active.tolist():
            self.envs[j].world.Step(1.0 / self.ll.FPS, 6 * 30, 2 * 30)
        return self.outcome(active, self.states(active), actions, np.array([self.envs[j].game_over for j in active],
                            bool), np.array([b.awake for b in landers], bool))

    def states(self, active) -> np.ndarray:
        """step()'s states [k, 8] (float64) of environments `active`, read through Box2D's Python interface."""
        ll, fps, rows = self.ll, self.ll.FPS, []
        w2, h2 = ll.VIEWPORT_W / ll.SCALE / 2, ll.VIEWPORT_H / ll.SCALE / 2
        for j in list(active):
            env = self.envs[j]
            b = env.lander
            pos, vel = b.position, b.linearVelocity
            rows.append(((pos.x - w2) / w2, (pos.y - (env.helipad_y + ll.LEG_DOWN / ll.SCALE)) / h2, vel.x * w2 / fps,
                         vel.y * h2 / fps, b.angle, 20.0 * b.angularVelocity / fps,
                         1.0 if env.legs[0].ground_contact else 0.0, 1.0 if env.legs[1].ground_contact else 0.0))
        return np.array(rows, dtype=np.float64).reshape(-1, 8)


class Simulators:
    """copies x episodes simulators run side by side, one batched forward per time step for all of them; episode i
    of every copy starts from env.reset(seed=seed + i). CartPole-v1 runs as gymnasium's vectorised CartPole and
    Acrobot-v1 as gymnasium's Acrobot dynamics on arrays (AcrobotVector), their state set to those start states
    (the same dynamics in float64: the same returns), LunarLander-v3 as its gymnasium environments driven by
    LunarLanderSteps; other tasks as one gymnasium environment per episode. With one environment per episode, copies
    of an episode that have taken the same actions so far are in the same state: one of them is simulated for all,
    and a copy that takes another action gets its own environment then, replayed to that state (members that deploy
    the same policy, e.g. SPIBB's pi = beta on low-epsilon data, cost one simulation)."""

    def __init__(self, env_id: str, copies: int, episodes: int, seed: int):
        self.copies, self.episodes, n = copies, episodes, copies * episodes
        self.vector, self.acrobot = env_id == "CartPole-v1", env_id == "Acrobot-v1"
        if self.acrobot or self.vector:  # the start states [4, n] of reset(seed=seed + i), as the env stores them
            env, starts = make_env(env_id), []
            for i in range(episodes):
                env.reset(seed=seed + i)
                starts.append(np.array(env.unwrapped.state))
            self.starts = np.tile(np.stack(starts, 1), (1, copies))
        if self.vector:  # its state is float64
            self.starts = self.starts.astype(np.float64)
            self.venv = gym.make_vec(env_id, num_envs=n, vectorization_mode="vector_entry_point").unwrapped
        if not (self.acrobot or self.vector):
            self.envs, self.seed = [make_env(env_id) for _ in range(n)], seed
            # gymnasium's wrappers of a registered task only count steps and check call order: step the environments
            # themselves and count the time limit here (a tenth of LunarLander's cost per step), if that is all
            wrappers, env = [], self.envs[0]
            while isinstance(env, gym.Wrapper):
                wrappers.append(type(env))
                env = env.env
            plain = set(wrappers) <= {gym.wrappers.TimeLimit, gym.wrappers.OrderEnforcing, gym.wrappers.PassiveEnvChecker}
            self.limit = self.envs[0].spec.max_episode_steps if plain and gym.wrappers.TimeLimit in wrappers else None
            self.steppers = [e.unwrapped.step for e in self.envs] if self.limit else [e.step for e in self.envs]
            lander = self.envs[0].unwrapped
            self.lunar = LunarLanderSteps(self.envs) if self.limit and type(lander).__name__ == "LunarLander" and not (
                lander.continuous or lander.enable_wind or lander.render_mode) else None

    def run(self, act, noise_seed: int) -> np.ndarray:
        """Undiscounted returns [copies, episodes] of act(obs [copies, episodes, dim], u [episodes]) -> actions
        [copies, episodes]; u: this time step's uniforms, drawn from a generator seeded with noise_seed."""
        n, generator = self.copies * self.episodes, torch.Generator().manual_seed(noise_seed)
        if self.acrobot:
            venv = AcrobotVector(self.starts)
            obs = venv.obs()
        elif self.vector:
            self.venv.reset()
            self.venv.state, self.venv.steps = self.starts.copy(), np.zeros(n, dtype=np.int32)
            self.venv.prev_done = np.zeros(n, dtype=bool)
            obs = self.starts.T.astype(np.float32)
        elif self.lunar:
            obs = self.lunar.reset([self.seed + i % self.episodes for i in range(n)]).astype(np.float32)
        else:
            obs = np.stack([env.reset(seed=self.seed + i % self.episodes)[0] for i, env in enumerate(self.envs)])
            obs = obs.astype(np.float32)
        returns, active, t = np.zeros(n), np.ones(n, dtype=bool), 0
        # shared[k]: the copy whose environment stands in for copy k (the same episode, the same actions so far)
        shared, everyone = np.arange(n) % self.episodes, np.arange(n)
        steps = 0 if self.vector or self.acrobot else self.limit or 1000
        history = np.zeros((steps, n), dtype=np.int64)  # the actions taken, time step by time step
        while active.any():
            stop_if_interrupted()
            t += 1
            u = torch.rand(self.episodes, generator=generator)
            with torch.no_grad():
                actions = act(torch.from_numpy(obs).view(self.copies, self.episodes, -1), u).reshape(-1).numpy()
            if self.vector or self.acrobot:
                obs, reward, term, trunc = (venv.step(actions, active) if self.acrobot else self.venv.step(actions))[:4]
                returns += reward * active
                active &= ~(term | trunc)
                continue
            self.split(np.flatnonzero(active & (shared != everyone) & (actions != actions[shared])), shared, actions,
                       history[:t - 1])
            if t > len(history):  # no time limit: more room
                history = np.concatenate([history, np.zeros_like(history)])
            history[t - 1] = actions
            j, rewards = np.flatnonzero(active & (shared == everyone)), np.zeros(n)
            if self.lunar:
                obs[j], rewards[j], term = self.lunar.step(j, actions[j])
                active[j] = ~term & (t != self.limit)
            else:
                for k in j:
                    o, rewards[k], term, trunc, _ = self.steppers[k](int(actions[k]))
                    obs[k], active[k] = o, not (term or trunc or t == self.limit)
            copies = np.flatnonzero(shared != everyone)  # the same step as the copy they follow
            obs[copies], rewards[copies], active[copies] = obs[shared[copies]], rewards[shared[copies]], active[
                shared[copies]] & active[copies]
            returns += rewards
        return returns.reshape(self.copies, self.episodes)

    def split(self, ks: np.ndarray, shared: np.ndarray, actions: np.ndarray, history: np.ndarray) -> None:
        """Copies ks leave the copy they follow (their action differs from its): the first of each (copy followed,
        action) gets its own environment, replayed through the actions taken so far (history [steps, copies]), and
        the others follow it."""
        if not len(ks):
            return
        heads = {}
        for k in ks.tolist():
            shared[k] = heads.setdefault((int(shared[k]), int(actions[k])), k)
        heads = np.array(list(heads.values()))
        past = history[:, heads]
        seeds = [self.seed + int(k) % self.episodes for k in heads]
        if self.lunar:
            self.lunar.replay(heads, seeds, past)
        else:
            for k, seed, done in zip(heads.tolist(), seeds, past.T):
                self.envs[k].reset(seed=seed)
                for a in done.tolist():
                    self.steppers[k](a)


class Minibatch:
    """One update's rows idx [M, batch] of the members' concatenated data; batch(t) -> t[idx], [M, batch, ...], for a
    tensor or numpy array t: one flat index_select / np.take (2-3x cheaper than t[idx] on these sizes, the same
    numbers)."""

    def __init__(self, idx: torch.Tensor):
        self.idx, self.flat = idx, idx.reshape(-1)

    def __call__(self, t):
        if isinstance(t, np.ndarray):
            return np.take(t, self.flat.numpy(), 0).reshape(*self.idx.shape, *t.shape[1:])
        return t.index_select(0, self.flat).view(*self.idx.shape, *t.shape[1:])


def member_args(args, check, member_flags: tuple = ()) -> list:
    """The runs of this process: every combination of --epsilons, --sweep values and --seeds (in that order), each
    as the flags of the single run it is (validated by the script's check), with its own --run-name."""
    allowed = tuple(f for f in (*SHARED_MEMBER_FLAGS, *member_flags) if hasattr(args, f))
    sweep = {}
    for spec in args.sweep:
        name, _, values = spec.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        require(name in allowed and values, f"--sweep {spec!r}: expected FLAG=V1,V2,... with FLAG one of "
                f"{', '.join(flag(f)[2:] for f in allowed)}")
        require(name not in sweep, f"--sweep names {flag(name)} twice")
        kind = type(getattr(args, name))
        try:
            sweep[name] = [kind(v) for v in values.split(",")]
        except ValueError:
            fail(f"--sweep {spec!r}: {flag(name)} takes {kind.__name__} values")
        twice = sorted({v for v in sweep[name] if sweep[name].count(v) > 1})  # 1e-3,0.001: likely a typo
        require(not twice, f"--sweep {spec!r} names the value(s) {', '.join(map(str, twice))} more than once")
    # epsilons as their datasets name them (eps{:g}): 0.15 and 0.150000001 would train on the same file
    for name, values in (("--seeds", args.seeds), ("--epsilons", tuple(f"{e:g}" for e in args.epsilons or ()))):
        twice = sorted({v for v in values or () if values.count(v) > 1})
        require(not twice, f"{name} lists {', '.join(map(str, twice))} more than once; give each value once")
    runs, stamp = [], int(time.time())
    for eps, combo, seed in itertools.product(args.epsilons or (args.epsilon,), itertools.product(*sweep.values()),
                                              args.seeds or (args.seed,)):
        values = dict(zip(sweep, combo))
        a = replace(args, seed=seed, epsilon=eps, seeds=None, epsilons=None, sweep=(), **values)
        text = {"env_id": a.env_id, "epsilon": format(eps, ".15g"), "seed": seed, "exp_name": a.exp_name,
                **{k: format(v, ".15g") if isinstance(v, float) else v for k, v in values.items()}}
        if args.run_name and (args.seeds or args.epsilons or sweep):
            try:
                # plain field names only: str.format would also follow {seed.attr} and {seed[0]}
                parsed = [(f, spec) for _, f, spec, _ in string.Formatter().parse(args.run_name) if f is not None]
                named = [f for f, _ in parsed]
                if any(f not in text for f in named):
                    raise KeyError(next(f for f in named if f not in text))
                # a width such as {seed:>100000000}, or one read from a nested field ({epsilon:{seed}}), would build
                # the name before its length is checked
                require(all("{" not in (spec or "") and all(int(w) <= 255 for w in re.findall(r"\d+", spec or ""))
                            for _, spec in parsed), f"--run-name {args.run_name[:100]!r}: a field's width may be at "
                        "most 255, and not another field's value")
                a = replace(a, run_name=args.run_name.format(**text))
            except (KeyError, IndexError, ValueError) as e:
                fail(f"--run-name {args.run_name!r}: a template may name {{{'}, {'.join(text)}}}, not {e}")
        elif not args.run_name:
            require(all(v not in ("", ".", "..") and v.isprintable() and "\\" not in v for v in a.env_id.split("/")),
                    f"--env-id {a.env_id!r} cannot start a run directory's name; pass --run-name")
            config = "".join(f"__{k}={text[k]}" for k in values)
            a = replace(a, run_name=f"{a.env_id}__eps{text['epsilon']}__{a.exp_name}{config}__{seed}__{stamp}")
        check(a)
        runs.append(a)
    names = [a.run_name for a in runs]
    require(len(set(names)) == len(names), f"--run-name {args.run_name!r} gives several members the same directory; "
            "name {seed}" + (", {epsilon}" if args.epsilons else "") + "".join(f", {{{k}}}" for k in sweep) + " in it")
    require(not (args.dataset_path and len({a.epsilon for a in runs}) > 1),
            "--epsilons trains the default datasets of the task; --dataset-path names one dataset")
    return runs


def columns(runs: list, *names: str) -> SimpleNamespace:
    """Flags that may differ between members (the runs' args) as numpy columns [M, 1]: float64, booleans as bool."""
    return SimpleNamespace(**{n: np.array([[getattr(a, n)] for a in runs], dtype=bool if isinstance(
        getattr(runs[0], n), bool) else np.float64) for n in names})


class MemberBehavior:
    """Member m's behaviour policy at its own states: obs [M, N, dim] -> beta [M, N, |A|] float64. When every member's
    beta is epsilon-greedy on one behaviour network (a task's datasets differ only in epsilon), one forward serves
    all members and each applies its own epsilon (the same operations as BehaviorPolicy); else one forward per
    distinct dataset."""

    def __init__(self, policies: list, keys: list):
        self.policies, self.keys = policies, keys
        first = policies[0].layers
        self.shared = all(p.kind == "epsilon_greedy" and all(torch.equal(w, v) and torch.equal(b, c) for (w, b), (v, c)
                                                             in zip(p.layers, first)) for p in policies)
        self.epsilon = torch.tensor([p.epsilon for p in policies], dtype=torch.float64)[:, None, None]

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        if self.shared:
            return epsilon_greedy(self.policies[0].q_values(obs.reshape(-1, obs.shape[-1])).view(*obs.shape[:-1], -1),
                                  self.epsilon)
        out, done = [None] * len(self.keys), {}
        for m, key in enumerate(self.keys):
            if key not in done:
                members = [i for i, k in enumerate(self.keys) if k == key]
                done[key] = self.policies[m](obs[members].reshape(-1, obs.shape[-1])).view(len(members), *obs.shape[1:-1], -1)
                for j, i in enumerate(members):
                    out[i] = done[key][j]
        return torch.stack(out)


class Members:
    """The runs of one process, trained side by side: their flags, their datasets (concatenated: member m's rows
    start at offsets[m]), minibatches, per-member hyperparameters as columns, the evaluation schedule and clock,
    one record per evaluation (stdout, TensorBoard), and each run's outputs at the end (result.json last). A member
    whose training diverges is dropped alone (one line, its directory removed); the others go on. Without a
    simulator (an imported dataset of a task not installed here) an evaluation is the batch's improvement
    certificate of the policy over beta, and the run's score is that certificate (result.json: "score")."""

    def __init__(self, runs: list, datasets: dict, dirs: list, obs_dim: int, n_actions: int):
        self.args, self.M, self.obs_dim, self.n_actions = runs, len(runs), obs_dim, n_actions
        self.first = runs[0]
        self.paths = [p.resolve() for p, _ in (datasets[a.epsilon] for a in runs)]
        self.data = [d for _, d in (datasets[a.epsilon] for a in runs)]
        self.sha256 = {p: file_sha256(p) for p in set(self.paths)}  # as loaded, once per file
        self.platform = platform_info()
        self.dirs, self.writers = [d for d, _ in dirs], [w for _, w in dirs]
        self.records, self.alive = [[] for _ in runs], [True] * len(runs)
        self.keys = list(datasets)  # the distinct datasets, concatenated once
        sizes = {e: len(d["actions"]) for e, (_, d) in datasets.items()}
        starts = dict(zip(self.keys, np.cumsum([0] + [sizes[e] for e in self.keys])[:-1].tolist()))
        self.offsets = torch.tensor([starts[a.epsilon] for a in runs])[:, None]
        self.generators = [torch.Generator().manual_seed(a.seed) for a in runs]
        self.sizes = [sizes[a.epsilon] for a in runs]
        self.chunk = None
        self.simulator = has_simulator(self.first.env_id)
        self.train_time, self.eval_time, self.start = 0.0, 0.0, time.time()
        self.block_start, self.paused = time.perf_counter(), False
        if self.simulator:
            self.simulators = Simulators(self.first.env_id, self.M, self.first.eval_episodes, self.first.eval_seed)
        else:  # one dataset for all members (member_args)
            data = self.data[0]
            beta = data["behavior_probs"].astype(np.float64)
            self.cert, reason = certificate_data(data, beta / beta.sum(1, keepdims=True),
                                                 getattr(self.first, "certificate_gamma", 0.99), behavior_policy(data))
            require(not reason, f"{self.first.env_id} has no simulator here and the batch cannot certify, so the run "
                    f"has no score: {reason}")
            rows = torch.from_numpy(data["observations"][self.cert["rows"]])
            self.cert_obs = rows.expand(self.M, *rows.shape)

    def build(self, make) -> list:
        """Every member's networks: make() -> list of networks, called after torch.manual_seed(member's seed) (the
        initial weights of the single run with that seed); returns, per network of make(), the list over members."""
        nets = []
        for a in self.args:
            torch.manual_seed(a.seed)
            nets.append(make())
        return [list(column) for column in zip(*nets)]

    def tensor(self, key: str) -> torch.Tensor:
        """The datasets' array `key`, concatenated in the order of self.offsets."""
        data = {a.epsilon: d for a, d in zip(self.args, self.data)}
        return torch.as_tensor(np.concatenate([data[e][key] for e in self.keys]))

    def behavior(self) -> "MemberBehavior":
        """beta(.|s) of every member's dataset at any states: obs [M, N, dim] -> [M, N, |A|] float64."""
        return MemberBehavior([behavior_policy(d) for d in self.data], [a.epsilon for a in self.args])

    def rows(self, m: int) -> slice:
        """Member m's rows in the concatenated datasets (self.tensor)."""
        return slice(int(self.offsets[m]), int(self.offsets[m]) + self.sizes[m])

    def column(self, name: str, dtype=torch.float32) -> torch.Tensor:
        """A flag's value per member, [M, 1]."""
        return torch.tensor([getattr(a, name) for a in self.args], dtype=dtype)[:, None]

    def minibatch(self, step: int) -> "Minibatch":
        """The minibatch of update `step` (from 1), rows [M, batch]: member m's are torch.randint(n_m, (batch,)) from
        its generator, the single run's stream (drawn 1,000 updates at a time: the same numbers), plus its offset."""
        stop_if_interrupted()  # a signal while training stops the run here (interrupt)
        k = (step - 1) % 1000
        if step == 1:  # the training clock starts at the first update (set-up is neither training nor evaluation)
            self.block_start = time.perf_counter()
        if k == 0:
            b = self.first.batch_size
            self.chunk = torch.stack([torch.randint(n, (1000, b), generator=g)
                                      for n, g in zip(self.sizes, self.generators)], 1) + self.offsets
        return Minibatch(self.chunk[k])

    def due(self, step: int) -> bool:
        """Evaluate after this update? Every --eval-frequency updates (every --eval-sparse-frequency before the last
        10 evaluations), and after the last."""
        a = self.first
        if a.eval_sparse_frequency and step <= a.total_steps - 10 * a.eval_frequency:
            return step % a.eval_sparse_frequency == 0
        return step % a.eval_frequency == 0 or step == a.total_steps

    def log(self, step: int, scalars, every: int = 100) -> None:
        """TensorBoard scalars, name -> one value per member ([M] tensor or list), every `every` updates. scalars may
        be a function returning that dict: what is only logged is then computed only on the updates that log it."""
        if step % every == 0 and any(self.writers):
            scalars = scalars() if callable(scalars) else scalars
            values = zip(*(torch.as_tensor(v).detach().double().tolist() for v in scalars.values()))
            for m, (writer, row) in enumerate(zip(self.writers, values)):
                for name, value in zip(scalars, row):
                    if writer and self.alive[m]:
                        writer.add_scalar(name, value, step)

    def pause(self) -> None:
        """Training stops here: what follows until the end of evaluate() counts as evaluation time."""
        if not self.paused:
            self.paused, self.now = True, time.perf_counter()
            self.train_time += self.now - self.block_start

    def evaluate(self, step: int, networks: list, act, probs=None, q=None, extra: Optional[list] = None) -> None:
        """Stop the training clock, drop members whose weights are no longer finite, then evaluate every member in
        the simulator (act(obs, u), Simulators.run), or by the certificate of probs(obs [M, N, dim], beta) -> pi
        [M, N, |A|] with the critic q(obs) -> [M, N, |A|] (unless extra holds each member's certificate already).
        extra: one dict per member, added to its record."""
        self.pause()
        finite = torch.stack([s.flat.reshape(self.M, -1).isfinite().all(1) for s in networks]).all(0)
        for m in np.flatnonzero(~finite.numpy()):
            if self.alive[m]:
                self.drop(m, f"training diverged: the weights are NaN or inf after {step} updates; try a lower "
                             "--learning-rate")
        rows = [{"step": step, **(extra[m] if extra else {})} for m in range(self.M)]
        if self.simulator:
            returns = self.simulators.run(act, self.first.eval_seed + step)
            for m, row in enumerate(rows):
                row.update(return_mean=float(returns[m].mean()), return_std=float(returns[m].std()))
        elif not all("certificate" in row for row in rows):
            pi, c = probs(self.cert_obs, self.cert["beta"]), self.cert
            critic = q(self.cert_obs) if q else np.broadcast_to(c["q_b"], pi.shape)
            z = statistics.NormalDist().inv_cdf(getattr(self.first, "certificate_confidence", 0.95))
            q_cv = control_variate(critic, c)  # every member's fit at once
            for m, row in enumerate(rows):
                if self.alive[m]:
                    row.update(**improvement_certificate(pi[m], None, c, z, q_cv[m]),
                               tv_to_beta=tv_to_beta(pi[m], c["beta"]))
        self.block_start, self.paused = time.perf_counter(), False
        self.eval_time += self.block_start - self.now
        key, sps = "return_mean" if self.simulator else "certificate", step / self.train_time
        for m, row in enumerate(rows):
            if self.alive[m]:
                self.records[m].append(row)
                if self.writers[m]:
                    self.writers[m].add_scalar("eval/episodic_return" if self.simulator else "eval/certificate",
                                               row[key], step)
                    self.writers[m].add_scalar("charts/SPS", sps, step)
        scores = [row[key] for m, row in enumerate(rows) if self.alive[m]]
        name = "eval_return" if self.simulator else "improvement_certificate"
        if self.M == 1:
            spread = rows[0]["return_std"] if self.simulator else rows[0]["certificate_se"]
            print(f"step={step} {name}={scores[0]:.4g} +- {spread:.3g}" + ("" if self.simulator else " (no simulator)")
                  + f" SPS={sps:.0f}", flush=True)
        else:
            print(f"step={step} {name} over {len(scores)} runs: mean {np.mean(scores):.4g}, min {min(scores):.4g}, max "
                  f"{max(scores):.4g} SPS={sps:.0f} per run", flush=True)

    def drop(self, m: int, reason: str) -> None:
        """Member m fails alone: one line, its directory emptied; the others go on (if none is left, the process
        fails)."""
        self.alive[m] = False
        if not any(self.alive):
            fail(reason if self.M == 1 else f"every run failed; the last: {reason}")
        print(f"{Path(sys.argv[0]).name}: error: run {self.dirs[m]}: {reason}; nothing written for it", file=sys.stderr,
              flush=True)
        with contextlib.suppress(Exception):
            self.writers[m] and self.writers[m].close()
        with contextlib.suppress(OSError):
            remove_run_files(self.dirs[m])

    def finish(self, algorithm: str, extra, model) -> None:
        """Per member: model.pt (with --save-model) and result.json (last: a directory with it holds a finished run).
        extra(m) -> the run's final diagnostics, model(m) -> its checkpoint's contents."""
        for m, (args, records) in enumerate(zip(self.args, self.records)):
            if not self.alive[m]:
                continue
            # a dataset named relative to the working directory is recorded absolute, so that certify.py and
            # --eval-checkpoint find the same file from anywhere
            args = replace(args, dataset_path=str(self.paths[m]) if args.dataset_path else None)
            # without a simulator an evaluation that deployed beta (the safety test) scores beta's gain over itself: 0
            final_score = float(np.mean([e["return_mean"] if self.simulator else e["certificate"]
                                         if e.get("deployed", "pi") == "pi" else 0.0 for e in records[-10:]]))
            result = {
                "algorithm": algorithm, "env_id": args.env_id, "epsilon": args.epsilon, "seed": args.seed,
                "args": asdict(args), "evaluations": records, "final_score": final_score,
                "score": "return" if self.simulator else "improvement_certificate",
                "behavior_return": float(self.data[m]["behavior_return"]), "wall_time": time.time() - self.start,
                "train_time": self.train_time, "eval_time": self.eval_time, "members": self.M,
                "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # of the process
                "updates_per_second": args.total_steps / self.train_time, "dataset_path": str(self.paths[m]),
                "dataset_sha256": self.sha256[self.paths[m]],
                "format_version": RESULT_FORMAT_VERSION, "platform": self.platform, "extra": extra(m),
            }
            if self.writers[m]:
                self.writers[m].add_scalar("eval/final_score", final_score, args.total_steps)
                self.writers[m].flush()  # raises what the writer's thread met (e.g. a full disk)
                self.writers[m].close()
            if args.save_model:
                save_model_atomic(self.dirs[m] / "model.pt", {"algorithm": algorithm, "env_id": args.env_id,
                                                              "args": asdict(args), **model(m)})
            write_json_atomic(self.dirs[m] / "result.json", result)
            if self.simulator:
                print(f"final score {final_score:.1f} (behaviour {result['behavior_return']:.1f}); results in "
                      f"{self.dirs[m]}")
            else:
                print(f"final score: improvement certificate {final_score:.4g} over beta (no simulator: the batch's "
                      f"first-order estimate of the gain, mean of the last 10 evaluations); results in {self.dirs[m]}")


def file_sha256(path) -> Optional[str]:
    """The dataset file's fingerprint in result.json (None if it can no longer be read): collecting the same dataset
    on a machine with other vector extensions can round an observation differently (docs/benchmark.md,
    "Reproducibility")."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def platform_info() -> dict:
    """The library versions and the CPU features their kernels dispatch on, recorded in result.json: the same code
    and dataset can round differently on a machine with other vector extensions (docs/benchmark.md,
    "Reproducibility")."""
    try:  # the baseline numpy was built for, then what it found on this CPU
        simd = np.show_config(mode="dicts")["SIMD Extensions"]
        simd = list(simd["baseline"]) + list(simd["found"])
    except Exception:  # noqa: BLE001  (numpy < 1.26 has no mode="dicts"): a record, never a reason to fail a run
        simd = []
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "gymnasium": gym.__version__, "torch_cpu_capability": capability, "numpy_simd": simd}


def finished(result: Path) -> bool:
    try:
        return result.exists()
    except OSError:  # e.g. a path longer than the system allows: creating the run directory reports it in one line
        return False


def keep_freed_memory() -> bool:
    """glibc's malloc returns each freed array above its mmap threshold (32 MB at most) to the kernel, so the next one
    faults its pages in again: a third of BRPO's Acrobot evaluation with 25 members on one dataset (the certificate's
    [members, 100k, |A|] arrays; 5 members' fit under the threshold). Large arrays stay on the heap and freed memory
    in the process instead, which reuses it (the same numbers; peak memory up to ~6% higher). A no-op without glibc.
    Returns whether glibc took every setting."""
    if platform.libc_ver()[0] != "glibc":  # checked first: ctypes.CDLL(None) is glibc's symbols here, not everywhere
        return False
    mallopt = ctypes.CDLL(None).mallopt
    # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD (malloc.h): no mmap below 1 GB, no trim, grow by 256 MB
    return all(mallopt(option, value) == 1 for option, value in ((-3, 1 << 30), (-1, 1 << 30), (-2, 1 << 28)))


def main(args, check, train, run_checkpoint, behavior_network: bool = False, member_flags: tuple = ()) -> None:
    """Check the flags, then evaluate a checkpoint, or validate the datasets and train the members in fresh run
    directories. Exit status 1 if a member failed."""
    check(args)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    if args.eval_checkpoint:
        return run_checkpoint(args)
    runs = member_args(args, check, member_flags)
    if args.skip_finished and not args.overwrite:
        done = [a for a in runs if finished(Path(a.runs_dir) / a.run_name / "result.json")]
        for a in done:
            print(f"skipped {Path(a.runs_dir) / a.run_name}: it holds a finished run", flush=True)
        runs = [a for a in runs if a not in done]
        if not runs:
            return
    if has_simulator(args.env_id) or not args.dataset_path:
        env = make_env(args.env_id)
        obs_dim, n_actions = env.observation_space.shape[0], int(env.action_space.n)
    else:  # an imported dataset of a task not installed here: its sizes, and the certificate as the score
        obs_dim, n_actions = dataset_sizes(args.dataset_path)
        print(f"{args.env_id} is not an installed gymnasium task: no simulator; every evaluation is the batch's "
              "improvement certificate of the policy over beta", flush=True)
        behavior_network = True  # the certificate needs the behaviour model
    datasets = {}
    for a in runs:
        if a.epsilon not in datasets:
            datasets[a.epsilon] = load_dataset(a, obs_dim, n_actions, behavior_network)
    with contextlib.ExitStack() as stack:  # everything is validated: only now create outputs
        dirs = [stack.enter_context(run_directory(a)) for a in runs]
        members = Members(runs, datasets, dirs, obs_dim, n_actions)
        DEFERRED.set()
        try:
            train(members)
        finally:
            DEFERRED.clear()
        stop_if_interrupted()  # it arrived after the last update: what the run wrote is removed all the same
    if not all(members.alive):
        raise SystemExit(1)


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
    beta_taken = beta[rows, actions[rows]]  # > 0: load_dataset refuses a batch whose beta never takes a logged action
    rewards = data["rewards"].astype(np.float64)
    returns, acc = np.zeros(n), 0.0
    for t in range(n - 1, -1, -1):  # discounted return-to-go inside each episode
        acc = rewards[t] + (0.0 if stop[t] else gamma * acc)
        returns[t] = acc
    with torch.no_grad():
        q_b = behavior.q_values(torch.from_numpy(obs[rows])).numpy()
    state_features = np.stack([np.ones(len(rows)), (beta[rows] * q_b).sum(1), q_b.max(1)], 1)
    unsupported = beta[rows] == 0  # actions beta never takes (a greedy behaviour, --behavior-floor 0): None if none
    first = np.flatnonzero(np.diff(episode, prepend=-1))  # each episode's first row (episode is sorted)
    return {"rows": rows, "episode": episode, "n_episodes": n_episodes, "actions": actions[rows], "beta": beta[rows],
            "time": np.arange(len(rows)) - first[episode],  # t of each row inside its episode
            "beta_taken": beta_taken, "returns": returns[rows], "state_features": state_features, "q_b": q_b,
            "unsupported": unsupported if unsupported.any() else None}, None


def tv_to_beta(pi: np.ndarray, beta: np.ndarray) -> float:
    """Mean total-variation distance of pi to beta over the rows' states (Theorem 2's L'' is twice this)."""
    return float(0.5 * row_sum(np.abs(pi - beta)).mean())


def taken(x: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """x[..., t, actions[t]] of x [..., N, |A|]: one flat take (a fancy index on two axes is ~3x slower)."""
    n, k = x.shape[-2:]
    return np.take(x.reshape(*x.shape[:-2], n * k), np.arange(n) * k + actions, -1)


def control_variate(q: np.ndarray, cert: dict) -> np.ndarray:
    """q_cv(s_t, .) [..., N, |A|] of the certificate's rows: an affine function of q(s, a) (a critic's action values
    [..., N, |A|], one leading index per member, or the behaviour network's), E_beta q, max q, E_beta Q_b and max Q_b,
    fitted to the logged returns of the other half of the episodes (cross-fitting keeps the certificate unbiased).
    It depends on q, not on pi: one fit serves every policy compared on the same critic. The members' least-squares
    fits are one batched SVD solve; every other step is elementwise, so a member's fit is the same alone as among
    others."""
    fold, lead, state_features = cert["episode"] % 2, q.shape[:-2], cert["state_features"]  # 1, E_beta Q_b, max Q_b
    # the critic's features, [..., N] each: E_beta q, max q, q(s_t, a_t)
    member = [row_sum(q * cert["beta"]), row_max(q), taken(q, cert["actions"])]
    ok = np.isfinite(q.reshape(*lead, -1)).all(-1)  # False for a diverged member's critic
    s, state, slope = np.ascontiguousarray(state_features.T), [], []
    for f in (0, 1):  # both halves hold >= 1 episode: n_episodes >= 2
        fit = np.flatnonzero(fold != f)
        x = np.empty((*lead, 6, len(fit)))  # the design matrix, transposed: column-major, as LAPACK takes it
        x[..., :3, :] = np.take(s, fit, 1)
        for k, feature in enumerate(member):
            np.take(feature, fit, -1, out=x[..., 3 + k, :])
        coef = np.full((*lead, 6), np.nan)  # a diverged member's fit: NaN, not an error
        if ok.any():
            y = torch.from_numpy(cert["returns"][fit]).expand(int(ok.sum()), -1)[..., None].contiguous()
            coef[ok] = torch.linalg.lstsq(torch.from_numpy(x if ok.all() else x[ok]).reshape(-1, 6, len(fit)).mT, y,
                                          driver="gelss").solution.numpy()[..., 0]
        # in sum_a (pi - beta) q_cv the state-only terms cancel: the direct term carries q(s, a) only. Evaluated on
        # every row and kept on this fold's (elementwise: each row's numbers are the same as on the fold alone)
        c = coef[..., None, :]
        fs = c[..., 0] * s[0] + c[..., 1] * s[1] + c[..., 2] * s[2] + c[..., 3] * member[0] + c[..., 4] * member[1]
        state.append(fs)
        slope.append(c[..., 5])
    second = fold == 1
    out = np.multiply(np.where(second, slope[1], slope[0])[..., None], q)  # in place: [..., N, |A|] is ~10 MB
    out += np.where(second, state[1], state[0])[..., None]
    return out


OFF_SUPPORT_TOLERANCE = 1e-6  # pi's largest probability, in one state, on actions beta never takes, still certifiable
CERTIFICATE_FLOOR = 1e-9  # a certified lower bound exceeds this times the largest |return|


def improvement_certificate(pi: np.ndarray, q: np.ndarray, cert: dict, z: float, q_cv=None) -> dict:
    """The first-order improvement g of pi over beta (the policy-gradient identity along beta + c (pi - beta)),
    in the doubly robust form with the control variate q_cv (control_variate(q, cert) unless given):
        g = E_episodes[ sum_t sum_a (pi - beta)(a|s_t) q_cv(s_t, a) + (pi / beta - 1)(a_t|s_t) (G_t - q_cv(s_t, a_t)) ].
    Returns g, its standard error over episodes, the one-sided lower bound g - z se and whether it is > 0."""
    q_cv = control_variate(q, cert) if q_cv is None else q_cv
    direct = row_sum((pi - cert["beta"]) * q_cv)
    weight = taken(pi, cert["actions"]) / cert["beta_taken"] - 1.0  # beta(a_t|s_t) > 0 (load_dataset)
    per_step = direct + weight * (cert["returns"] - taken(q_cv, cert["actions"]))
    per_episode = np.bincount(cert["episode"], weights=per_step, minlength=cert["n_episodes"])
    g = float(per_episode.mean())
    se = float(per_episode.std(ddof=1) / math.sqrt(len(per_episode)))
    lcb = g - z * se
    # above rounding, not just 0: with constant returns g and se are ~1e-17 and their sign is noise
    floor = CERTIFICATE_FLOOR * float(np.abs(cert["returns"]).max())
    out = {"certificate": g, "certificate_se": se, "certificate_lcb": lcb, "certified": float(lcb > floor)}
    if cert.get("unsupported") is not None:  # no logged return can check the critic where beta never acts: pi may not
        # put mass there (the direct term would be the critic's claim alone), or it is not certified
        out["off_support_mass"] = float(row_sum(np.where(cert["unsupported"], pi, 0.0)).max())
        out["certified"] = float(lcb > floor and out["off_support_mass"] <= OFF_SUPPORT_TOLERANCE)
    return out


def deploy_levels(args: DeployArgs) -> tuple[float, ...]:
    """--deploy-pessimism, by default the level pi was trained at (--pessimism), then the paper's 0 as the
    fallback, or our 1 if trained at 0 (docs/brpo.md, departure 11)."""
    if args.deploy_pessimism is not None:
        return tuple(args.deploy_pessimism)
    return (args.pessimism, 0.0) if args.pessimism != 0.0 else (0.0, 1.0)


def deployment_certificate(args: DeployArgs, data: dict, beta: np.ndarray, behavior: BehaviorPolicy):
    """certificate_data for BRPO's deployed-level rule (None, with a warning, when the batch cannot give one)."""
    cert, reason = certificate_data(data, beta, args.certificate_gamma, behavior)
    if reason:
        print(f"warning: no improvement certificate: {reason}; " + ("the safety test deploys beta (--no-safety-test "
              "deploys pi uncertified)" if args.safety_test else "pi is deployed uncertified"), flush=True)
    return cert


def deployment_groups(runs, beta_all: np.ndarray, log_probs, sqrt_floored) -> dict:
    """The members of one dataset and one list of --deploy-pessimism levels (they may differ between members: --sweep
    pessimism), with the dataset's certificate data and the z of one simultaneous (Bonferroni) lower bound per level,
    so that the chosen level's bound holds at the stated confidence: {(epsilon, levels): (cert, z, members)}."""
    certs, groups = {}, {}
    for m, a in enumerate(runs.args):
        if a.epsilon not in certs:  # once per dataset, not at every evaluation
            certs[a.epsilon] = deployment_certificate(a, runs.data[m], beta_all[runs.rows(m)],
                                                      behavior_policy(runs.data[m]))
            if certs[a.epsilon]:
                certs[a.epsilon].update(log_beta=log_probs(certs[a.epsilon]["beta"]),
                                        sqrt_beta=sqrt_floored(certs[a.epsilon]["beta"]))
        levels = deploy_levels(a)
        z = statistics.NormalDist().inv_cdf(1.0 - (1.0 - a.certificate_confidence) / len(levels))
        groups.setdefault((a.epsilon, levels), (certs[a.epsilon], z, []))[2].append(m)
    return groups


def report_certificate(c: dict, n_episodes: int, args: DeployArgs, deploy_pi: bool, pessimism: float) -> None:
    why = (f"the evaluation critic's gain of pi is {c['fqe_gain']:.4g}" if c.get("fqe_gain", 0.0) < 0.0 else
           "the safety test")
    if c:
        print(f"improvement certificate over {n_episodes} logged episodes: {c['certificate']:.4g} +- "
              f"{c['certificate_se']:.3g}, lower bound {c['certificate_lcb']:.4g} ({args.certificate_confidence:.0%}); "
              "deployed: " + (f"pi, pessimism {pessimism:g}" if deploy_pi else f"beta ({why})"))


def choose_levels(pi_of, n_levels: int, q_cv: np.ndarray, cert: dict, z: float) -> list[tuple[int, dict, np.ndarray]]:
    """BRPO's deployed level (departure 11 in docs/brpo.md) for each of K members, from pi rebuilt with each
    --deploy-pessimism level: pi as trained (the first) while the batch certifies it, else the certified level no
    farther from beta with the highest lower bound, else the level nearest beta (what remains of Theorem 2's penalty
    when no gain is shown). pi_of(level, idx) -> the members idx's pi at that level [len(idx), N, |A|]: the later
    levels are built only for the members whose first is not certified. q_cv [K, N, |A|]: control_variate(q, cert) of
    their critics. Returns each member's level, its certificate and its pi."""
    first = pi_of(0, list(range(len(q_cv))))
    options = [[improvement_certificate(pi, None, cert, z, cv)] for pi, cv in zip(first, q_cv)]
    rest = [i for i, o in enumerate(options) if not o[0]["certified"]]
    later = [pi_of(level, rest) for level in range(1, n_levels)] if rest else []
    row = {i: j for j, i in enumerate(rest)}  # a member's row in later
    chosen = []
    for i, cv in enumerate(q_cv):  # a certified first level is the only option: its member keeps it
        pis = [first[i]] + ([pi[row[i]] for pi in later] if i in row else [])
        options[i] += [improvement_certificate(pi, None, cert, z, cv) for pi in pis[1:]]
        distance = [tv_to_beta(pi, cert["beta"]) for pi in pis]
        # a first-order certificate says little about a level farther from beta than pi as trained (log 2026-11-29)
        certified = [k for k, o in enumerate(options[i]) if o["certified"] and distance[k] <= distance[0]]
        level = (max(certified, key=lambda k: options[i][k]["certificate_lcb"]) if certified else
                 min(range(len(pis)), key=lambda k: distance[k]))
        chosen.append((level, {**options[i][level], "tv_to_beta": distance[level]}, pis[level]))
    return chosen


def deploy(runs, step, obs, next_obs, q_network, confidence, p, unit, groups, evaluation, policy_probs, flags):
    """BRPO's and BRPO-C's deployed policy (policy_probs: the script's pi, flags: its FLAGS). Departure 11 (docs/
    brpo.md): per member, the batch's improvement certificate picks the deployed pessimism level among
    its --deploy-pessimism levels (members sharing a dataset and levels are evaluated together, 25 at a time: the
    arrays are [members, N, |A|] on the batch's N states). Returns pessimism [M, 1], deploy_pi [M], each member's
    certificate (or {}). Departure 15: beta is deployed while the evaluation critic's gain of pi is negative, and
    it is given the deployed pi to evaluate next."""
    pessimism, deploy_pi, certificates = p.pessimism.copy(), np.ones(runs.M, bool), [{} for _ in range(runs.M)]
    for levels, cert, z, members in [(levels, c, z, ms[i:i + 25]) for (_, levels), (c, z, ms) in groups.items()
                                     for i in range(0, len(ms), 25)]:
        members = [m for m in members if runs.alive[m]]
        if cert is None or not members:
            continue
        rows = obs[runs.rows(members[0])][cert["rows"]]
        rows, beta = rows.expand(len(members), *rows.shape), np.broadcast_to(cert["beta"], (len(members), *cert["beta"].shape))
        q_sub, confidence_sub = q_network.select(members), confidence.select(members)
        blocks = lambda f, k: in_blocks(f, len(cert["rows"]), 16384 // k)  # noqa: E731  (~16k states)
        q_batch = blocks(lambda b: q_function(q_sub)(rows[:, b]), len(members))
        lam_batch = blocks(lambda b: np.asarray(confidence_sub(rows[:, b]), dtype=np.float64), len(members))
        q_cv = control_variate(q_batch, cert)  # the members' fits at once

        def pi_of(level: int, idx: list) -> np.ndarray:  # the members idx's pi at a level (q, raw confidence given)
            sub = columns([runs.args[members[i]] for i in idx], *flags)
            return blocks(lambda b: policy_probs(rows[:len(idx), b], beta[idx, b], None, None, sub, np.full_like(
                sub.pessimism, levels[level]), step, unit[members][idx], q_batch[idx, b], cert["log_beta"][b],
                cert["sqrt_beta"][b], lam_batch[idx, b]), len(idx))

        chosen = choose_levels(pi_of, len(levels), q_cv, cert, z)
        gains = evaluation.gain(members, rows, np.stack([c[2] for c in chosen]), cert)
        for m, (level, certificate, _), gain in zip(members, chosen, gains):
            pessimism[m], certificates[m] = levels[level], {**certificate, **gain}
            deploy_pi[m] = ((not runs.args[m].safety_test or certificate.get("certified", 0.0) == 1.0)
                            and gain.get("fqe_gain", 0.0) >= 0.0)

    def member_pi(m: int):  # member m's deployed pi at given next states (its networks and flags picked once)
        q_m, confidence_m, p_m = q_network.select([m]), confidence.select([m]), columns([runs.args[m]], *flags)
        return lambda b, beta_b: policy_probs(next_obs[b][None], beta_b[None], q_m, confidence_m, p_m, pessimism[[m]],
                                              step, unit[[m]])
    evaluation.refresh(member_pi)
    return pessimism, deploy_pi, certificates


# ---- The evaluation critic (departure 15 in docs/brpo.md): deploy beta where Q^pi shows pi is worse
def performance_difference(pi: np.ndarray, q_pi: np.ndarray, cert: dict, gamma: float) -> dict:
    """J(pi) - J(beta) by the performance-difference lemma on beta's logged episodes, given pi's action values q_pi
    [N, |A|] on the certificate's states: E_episodes[sum_t gamma^t sum_a (pi - beta)(a|s_t) q_pi(s_t, a)] (exact for
    the true Q^pi; an error of q_pi that is constant over actions cancels), with its standard error over episodes (of
    the sampling only, not of q_pi's own error)."""
    per_step = row_sum((pi - cert["beta"]) * q_pi) * gamma ** cert["time"]
    per_episode = np.bincount(cert["episode"], weights=per_step, minlength=cert["n_episodes"])
    return {"fqe_gain": float(per_episode.mean()), "fqe_gain_se": float(per_episode.std(ddof=1) / math.sqrt(len(
        per_episode)))}


FQE_PERIOD = 100  # updates between hard copies to its target: 1,000 fitted-Q iterations in 100k updates


class PolicyEvaluation:
    """Fitted Q evaluation (Le et al. 2019) of each member's deployed pi, beside the method's critic: a network of the
    paper's architecture trained on the batch towards r + gamma (1 - terminal) sum_a pi(a|s') Q_target(s', a), with
    pi at every next state refreshed at each evaluation (beta before the first), so that performance_difference sees
    what the first-order certificate cannot: that pi visits other states than beta (beta's greedy policy can be
    certified and lose 150 points: log 2026-11-29-evaluation-critic). Its initial weights are the member's critic's
    and its minibatches the member's; the method's own networks and random streams are unchanged."""

    def __init__(self, runs, make_net, on: bool = True):
        self.on, self.nets = on, []  # off (the default): every method below does nothing
        if not on:
            return
        with torch.random.fork_rng():  # the method's own random streams continue as without it
            self.net = Stack(runs.build(lambda: [make_net()])[0])
        self.target, self.optimizer = self.net.copy(), Adam(self.net, runs.column("learning_rate"))
        self.runs, self.start = runs, torch.tensor(np.cumsum([0] + runs.sizes[:-1]))[:, None]
        beta = runs.tensor("next_behavior_probs").double().numpy()
        self.next_beta = beta / beta.sum(1, keepdims=True)
        self.pi_next = torch.cat([torch.from_numpy(self.next_beta[runs.rows(m)]).float() for m in range(runs.M)])
        self.nets = [self.net]  # checked for divergence at every evaluation with the method's networks

    def update(self, step: int, batch, s, next_obs, actions, rewards, discount) -> None:
        """One step on the minibatch (s = batch(obs), discount = gamma (1 - terminal) [M, B])."""
        if not self.on:
            return
        with torch.no_grad():  # pi_next is stored per member: its rows are the minibatch's, shifted to the member's block
            pi = Minibatch(batch.idx - self.runs.offsets + self.start)(self.pi_next)
            target = torch.addcmul(batch(rewards), row_sum(self.target(batch(next_obs)) * pi), discount)
        q = self.net(s).gather(-1, batch(actions).unsqueeze(-1)).squeeze(-1)
        loss = (q - target).square().mean(1)
        loss.sum().backward()
        self.optimizer.step()
        if step % FQE_PERIOD == 0:
            self.target.flat.copy_(self.net.flat)
        self.runs.log(step, {"losses/fqe_td_loss": loss})

    def gain(self, members: list, states: torch.Tensor, pis: np.ndarray, cert: dict) -> list[dict]:
        """performance_difference of the members' pis [K, N, |A|] with their Q^pi on the certificate's states."""
        if not self.on:
            return [{} for _ in members]
        q_pi = q_function(self.net.select(members))
        q = in_blocks(lambda b: q_pi(states[:, b]), len(cert["rows"]), 16384 // len(members))
        return [performance_difference(pis[i], q[i], cert, self.runs.args[m].gamma) for i, m in enumerate(members)]

    def refresh(self, member_pi) -> None:
        """Each live member's pi at every next state of its batch: member_pi(m)(rows, next_beta[rows]) -> pi [1, n, |A|],
        rows a slice (<= 16,384 states) of the members' concatenated data."""
        for m in np.flatnonzero(self.runs.alive) if self.on else []:
            rows, probs = self.runs.rows(m), member_pi(m)
            pi = [probs(slice(i, min(i + 16384, rows.stop)), self.next_beta[i:i + 16384][:rows.stop - i])[0]
                  for i in range(rows.start, rows.stop, 16384)]
            self.pi_next[int(self.start[m]):int(self.start[m]) + self.runs.sizes[m]] = torch.from_numpy(
                np.concatenate(pi)).float()
