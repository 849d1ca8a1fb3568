"""BRPO-C: BRPO with a constant confidence (Sohn et al., IJCAI 2020, Sec. "Experimental Results").

The residual policy pi(a|s) = (1 - lam) beta(a|s) + lam rho(a|s) with a constant lam (--lam, paper's grid
0.25 .. 0.75, final 0.5): a constant confidence always satisfies sum_a lam (rho - beta) = 0, so there is no
confidence solver, no confidence network and no projection layer. Everything else is brpo.py line for line
(`diff brpo.py brpo_c.py` shows only the confidence): rho is the relative softmax with lambda = lam
(eq. relative_soft, same temperature), the critic and W are the mu-mixed ones of Algorithm 1. One update:
  1. sample a minibatch; 2. one critic step towards r + gamma V(s'), V = (1-mu) E_beta Q' + mu max Q';
  3. soft target update. rho (and so pi) follows the critic at every state through W = Q - V.
Departures from the paper, the reported bound and the improvement certificate: docs/brpo.md.

    python brpo_c.py --env-id Acrobot-v1 --epsilon 0.15 --lam 0.5
"""

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
# Our defaults where the paper's settings leave rho at beta (docs/brpo.md, "Departures from the paper"): a
# constant temperature 0.99 in advantage units (kappa capped at 0.02) and a candidate pessimistic about
# actions the batch rarely shows (pessimism 1).
KAPPA_MAX_DEFAULT = 0.02
PESSIMISM_DEFAULT = 1.0


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
    mu: float = 0.9
    """critic mixing (Algorithm 1): V = (1-mu) E_beta Q + mu max Q, for the TD target and for W = Q - V"""
    lam: float = 0.5
    """constant confidence lambda in [0, 1] (paper's final value 0.5)"""
    kappa_max: float = KAPPA_MAX_DEFAULT
    """cap of the temperature's kappa: kappa <- min(kappa_max, kappa) (paper, end of Sec. 5); <= 1: a constant temperature"""
    kappa_decay: float = 1.0
    """temperature decay kappa <- kappa * kappa_decay**n after n updates (paper, end of Sec. 5)"""
    kappa_scale: float = 1.0
    """constant factor on kappa (ours): with --kappa-max inf, the paper's state-dependent kappa(s) at a usable scale"""
    pessimism: float = PESSIMISM_DEFAULT
    """in the candidate policy, lower W(s,a) by pessimism / sqrt(beta(a|s)) advantage units (ours; 0 = the paper)"""
    advantage_unit: bool = True
    """in the relative softmax, measure W in units of the critic's mean action gap (running average) so that the
    temperature means the same on every task (departure from the paper; --no-advantage-unit: raw W)"""
    penalty_one_minus_mu: bool = True
    """scale the bound's penalty L'' L''' by (1 - mu) like the appendix's mu-weighted bound (off: main text)"""
    eval_greedy: bool = False
    """evaluate argmax_a pi(a|s) instead of sampling a ~ pi(.|s) (the guarantee is about the stochastic pi)"""
    safety_test: bool = False
    """deploy (evaluate, save) pi only while the batch certifies its improvement over beta (improvement_certificate,
    ours), beta otherwise; off (the paper): always pi. The certificate is computed and reported either way"""
    certificate_confidence: float = 0.95
    """simultaneous one-sided confidence level of the certificate's lower bounds, one per --deploy-pessimism level
    (Bonferroni: z = 1.96 at 0.95 for the default two levels, 1.645 for one)"""
    certificate_gamma: float = 0.99
    """discount of the logged returns-to-go in the certificate (1.0: the undiscounted return, noisier)"""
    deploy_pessimism: tuple[float, ...] = (PESSIMISM_DEFAULT, 0.0)
    """pessimism levels of the deployed policy (ours): at each evaluation pi is rebuilt from the trained networks
    with each level in the candidate; the first level is deployed while the batch certifies its improvement,
    otherwise the certified level with the highest lower bound, and where no level is certified the level nearest
    to beta (total variation on the batch); one value fixes it (--deploy-pessimism 1: pi as trained)"""


def fail(msg: str) -> None:
    """One line on stderr, exit status 1, no traceback."""
    raise SystemExit(f"{Path(sys.argv[0]).name}: error: {msg}".replace("\n", "\\n"))


def check_args(args: Args) -> None:
    for f in fields(args):  # NaN and inf pass the range checks below, then poison training
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value) and f.name != "kappa_max":  # inf: kappa(s) uncapped
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
    if not 0.0 <= args.mu <= 1.0:
        fail(f"--mu must lie in [0, 1], got {args.mu}")
    if not 0.0 <= args.lam <= 1.0:
        fail(f"--lam must lie in [0, 1], got {args.lam}")
    if not args.kappa_max > 0:
        fail(f"--kappa-max must be positive, got {args.kappa_max}")
    if not 0.0 < args.kappa_scale < math.inf:
        fail(f"--kappa-scale must be positive and finite, got {args.kappa_scale}")
    if not 0.0 <= args.pessimism <= 1e3:  # in advantage units: 1e3 already pins rho to beta's most frequent action
        fail(f"--pessimism must lie in [0, 1000], got {args.pessimism}")
    if not 0.0 < args.kappa_decay <= 1.0:
        fail(f"--kappa-decay must lie in (0, 1], got {args.kappa_decay}")
    # below 1 by more than rounding, or the Bonferroni level 1 - (1 - c) / levels rounds to 1 (z = inf)
    if not 0.5 <= args.certificate_confidence <= 1.0 - 1e-9:
        fail(f"--certificate-confidence must lie in [0.5, 1), got {args.certificate_confidence}")
    if not 0.0 <= args.certificate_gamma <= 1.0:
        fail(f"--certificate-gamma must lie in [0, 1], got {args.certificate_gamma}")
    if not args.deploy_pessimism or not all(0.0 <= p <= 1e3 for p in args.deploy_pessimism):
        fail(f"--deploy-pessimism needs one or more levels in [0, 1000], got {list(args.deploy_pessimism)}")


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
    check = torch.from_numpy(d["observations"][:1000])  # beta at unseen states comes from the stored network
    beta = BehaviorPolicy({k: d[f"behavior_{k}"] for k in layout}, float(d["epsilon"]))(check).numpy()
    if not np.allclose(beta, d["behavior_probs"][:1000], atol=1e-5):
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



# ---------------------------------------------------------------------------------------------
# BRPO math (paper Sec. 5 "The BRPO Algorithm" and Appendix "Practical Implementation Details")
# ---------------------------------------------------------------------------------------------
LOG_CLAMP = 1e-12  # floor inside logs of probabilities: exact zeros (eps=0) must give 0*log0 = 0, not NaN
W_CLAMP = 1e100  # |W| cap before squaring in kappa: W^2 must stay finite in float64
TEMP_MIN = 1e-200  # smallest temperature (see temperature())
UNIT_RATE = 0.01  # running-average rate of the advantage unit (about the last 100 updates)
UNIT_MIN = 1e-8  # floor of the advantage unit: a constant critic (all gaps 0) must not divide by 0
BETA_MIN = 1e-12  # floor of beta in the pessimism term (beta = 0 actions get rho = 0 from log beta anyway)


def log_probs(p: np.ndarray) -> np.ndarray:
    """log p with log 0 = -inf and no warning: actions outside beta's support drop out of every
    expectation and every softmax below."""
    pos = p > 0
    return np.where(pos, np.log(np.where(pos, p, 1.0)), -np.inf)


def logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)  # finite: beta has at least one positive entry per state
    return m[..., 0] + np.log(np.exp(x - m).sum(-1))


def kappa(log_beta: np.ndarray, g2: np.ndarray) -> np.ndarray:
    """kappa_g(s) = 1 + log E_{a~beta}[exp(g(a|s)^2)] (paper, below eq. crpo_mu_2) from g2 = g^2, in log-space:
    logsumexp(log beta + g^2) cannot overflow for large |g| (it is ~max g^2)."""
    return 1.0 + logsumexp(log_beta + g2)


def temperature(beta, lam, w, gamma, kappa_scale, kappa_max, kappa_decay, n_updates, log_beta=None):
    """tau_lambda(s) = gamma * max{kappa_lambda(s), kappa_{|W| lambda}(s)} / (2 - 2 gamma) (eq. relative_soft),
    with kappa <- kappa_scale * min(kappa_max, kappa) * kappa_decay**n_updates.

    Why a remedy is needed: kappa >= 1 always, so temp >= gamma / (2 - 2 gamma) = 49.5 at gamma = 0.99 while
    advantages are O(1) (in action-gap units, see advantage_unit): lambda W / temp ~ 1e-2 and rho equals beta to
    within ~1%, so BRPO could never move away from beta. The paper offers a cap (kappa_max) and a decay
    (kappa_decay); a cap below 1 binds at every state and leaves a constant temperature (our default). The
    scale (ours) instead keeps the paper's kappa(s): temp grows like lambda^2 W^2 where the critic claims large
    advantages, so lambda W / temp stays bounded (by 0.62 / (49.5 kappa_scale) for two equally likely actions;
    tested). The defaults: docs/brpo.md."""
    if kappa_max <= 1.0:  # both kappas are >= 1 (log E exp(g^2) >= 0): the cap binds at every state
        kap = np.full(beta.shape[0], kappa_max)
    else:
        lb = log_probs(beta) if log_beta is None else log_beta
        lam2 = np.square(lam)
        # kappa_lambda and kappa_{|W| lambda} in one log-space pass (see kappa)
        both = kappa(lb, np.stack([lam2, lam2 * np.square(np.minimum(np.abs(w), W_CLAMP))]))
        kap = np.minimum(np.maximum(both[0], both[1]), kappa_max)
    # floor: a decayed kappa may underflow to 0; with |W| <= W_CLAMP, lambda W / temp stays <= 1e300 (finite)
    return np.maximum(gamma * kap * (kappa_scale * kappa_decay**n_updates) / (2.0 - 2.0 * gamma), TEMP_MIN)


def candidate_policy(beta, lam, w, temp, log_beta=None):
    """Relative softmax rho(a|s) ∝ beta(a|s) exp(lambda(s,a) W(s,a) / temp(s)) (paper eq. relative_soft, temp = tau_lambda), as a
    softmax of log beta + lambda W / temp: beta = 0 gives rho = 0 exactly; huge advantages or a tiny
    temperature give a (near) one-hot rho, never inf/NaN. float64 numpy (no gradient flows through rho:
    coordinate ascent holds rho fixed while lambda is fitted)."""
    w = np.clip(w, -W_CLAMP, W_CLAMP)
    logits = (log_probs(beta) if log_beta is None else log_beta) + lam * w / temp[:, None]
    e = np.exp(logits - logits.max(-1)[:, None])
    return e / e.sum(-1)[:, None]


def residual_policy(beta, rho, lam):
    """pi = (1 - lambda) beta + lambda rho (paper Sec. 2). A distribution by construction whenever lambda is
    feasible; the clamp/renormalisation only removes float rounding."""
    pi = (beta + lam * (rho - beta)).clamp_min(0.0)
    return pi / pi.sum(-1, keepdim=True)


def lower_bound_terms(beta, rho, lam, w, gamma, mu, scale_penalty_by_mu=True):
    """SAA estimates of the paper's L', L'', L''' (Sec. 5, "The Closed-form Confidence") and of the bound

        L = L' - (1 - mu) L'' L'''   (Appendix "Practical Implementation Details": with the mu-weighted
                                       advantage W the penalty carries a factor (1 - mu); mu = 0 -> paper
                                       main text).
    Returns floats (L, L', L'', L''')."""
    d = rho - beta
    n = beta.shape[0]
    l1 = (lam * d * w).sum() / ((1.0 - gamma) * n)
    l2 = (lam * d.abs()).sum() / ((1.0 - gamma) * n)
    l3 = gamma * (lam * d.abs() * w.abs()).sum() / ((1.0 - gamma) * n)
    pen = (1.0 - mu) if scale_penalty_by_mu else 1.0
    return float(l1 - pen * l2 * l3), float(l1), float(l2), float(l3)


def evaluate(act, envs: list, seed: int) -> np.ndarray:
    """Undiscounted return of one episode per env; all episodes advance together so the policy
    runs one batched forward per time step. Episode i always starts from reset(seed=seed + i)."""
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



class BehaviorPolicy:
    """beta(a|s) = (1-eps) 1[a = argmax Q_b(s,.)] + eps/|A| from the behaviour network stored in the dataset
    (docs/formats.md), in float64 like collect_data.py so that near-ties resolve to the same action."""

    def __init__(self, weights: dict, epsilon: float):
        self.layers = [(torch.as_tensor(weights[f"w{i}"], dtype=torch.float64),
                        torch.as_tensor(weights[f"b{i}"], dtype=torch.float64)) for i in range(3)]
        self.epsilon = float(epsilon)

    def q_values(self, obs: torch.Tensor) -> torch.Tensor:
        h = obs.double()
        for i, (w, b) in enumerate(self.layers):
            h = h @ w.T + b
            if i < 2:
                h = h.clamp_min(0.0)
        return h

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        h = self.q_values(obs)
        n_actions = h.shape[1]
        probs = torch.full_like(h, self.epsilon / n_actions)
        probs[torch.arange(h.shape[0]), h.argmax(1)] += 1.0 - self.epsilon  # first index on ties
        return probs


class ConstantConfidence:
    """lambda(s, a) = lam everywhere: feasible for any rho since sum_a (rho - beta) = 0."""

    def __init__(self, lam: float, n_actions: int):
        self.lam, self.n_actions = float(lam), n_actions

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], self.n_actions), self.lam, dtype=torch.float64)


def mixed_value(q: np.ndarray, beta: np.ndarray, mu: float, q_max: Optional[np.ndarray] = None) -> np.ndarray:
    """V(s) = (1-mu) E_{a~beta}[Q(s,a)] + mu max_a Q(s,a) (Algorithm 1, line 6; appendix), for the critic's target
    and for the weighted advantage W = Q - V."""
    return (1.0 - mu) * (beta * q).sum(-1) + mu * (q.max(-1) if q_max is None else q_max)


def critic_output_grad(q_all: np.ndarray, a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of the TD loss mean_s (Q(s, a_s) - y_s)^2 w.r.t. the critic's outputs Q(s, .) (float32, like
    autograd through gather + mse_loss: 2 / |B| (Q - y) at the taken action, 0 elsewhere; tested to agree bit
    for bit), and the TD errors. Passing it to backward() leaves those small graph nodes out of every update."""
    rows = np.arange(a.shape[0])
    td_error = q_all[rows, a] - y
    g = np.zeros_like(q_all)
    g[rows, a] = np.float32(2.0 / a.shape[0]) * td_error
    return g, td_error


def advantage_unit(q: np.ndarray, q_max: Optional[np.ndarray] = None) -> float:
    """Mean action gap max_a Q(s,a) - min_a Q(s,a) over a batch of states: the unit in which the relative
    softmax measures W (--advantage-unit). Why (departure): the paper's temperature is a pure number (kappa
    is dimensionless) while lambda W carries the reward's units, so one kappa_max gives an almost greedy rho
    on a task with large advantages and rho = beta on one with small ones (measured: CartPole's advantages are
    ~10x Acrobot's). Dividing W by its typical scale makes the defaults task-independent; the choice between
    actions inside a state, and which states have larger advantages than others, are unchanged."""
    gap = (q.max(-1) if q_max is None else q_max) - q.min(-1)
    return float(gap.sum() / gap.shape[0])  # = gap.mean() bit for bit (the same pairwise sum), with less call overhead


def sqrt_floored(beta: np.ndarray) -> np.ndarray:
    """sqrt(beta) floored at sqrt(BETA_MIN): the pessimism term's denominator, finite where beta = 0."""
    return np.sqrt(np.maximum(beta, BETA_MIN))


def candidate(beta, lam_tilde, w, args, n_updates, unit, log_beta=None, sqrt_beta=None):
    """rho from the current confidence (coordinate ascent, Sec. 5): the temperature from kappa, then relative softmax of a
    pessimistic W. Takes and returns float64 numpy arrays.

    Pessimism (--pessimism, our departure): the critic's error at (s, a) shrinks like 1 / sqrt(n(s, a)), and in
    a batch drawn from beta, n(s, a) is proportional to beta(a|s) times the visits of s. So W(s, a) -
    pessimism / sqrt(beta(a|s)) is, up to a per-state constant, a lower confidence bound on the advantage, and
    the candidate follows the critic to an action only as far as the batch has seen that action there. On
    uniform data (eps = 1) the correction is the same for every action of a state; it still enters rho's exponent
    multiplied by the raw confidence lambda~(s, a), which differs between actions, so it leans rho a little towards
    the actions of lower lambda~ (not nothing: the two --deploy-pessimism levels differ at eps = 1 too); on
    near-deterministic data (eps = 0.05) an action taken 2.5% of the time must be claimed better than the
    usual one by ~5 advantage units before rho moves towards it. This is what BRPO's confidence is meant to
    do ("exploit where the batch covers, stay where it does not"), but the paper's lambda-bar* sees W and
    not coverage, and W is wrong exactly where coverage is thin (see KAPPA_MAX_DEFAULT's measurements)."""
    log_beta = log_probs(beta) if log_beta is None else log_beta
    w = w / max(unit, UNIT_MIN) if args.advantage_unit else w
    if args.pessimism > 0:  # beta = 0: rho = 0 there anyway (log beta = -inf); the floor only avoids 1 / 0
        w = w - args.pessimism / (sqrt_floored(beta) if sqrt_beta is None else sqrt_beta)
    temp = temperature(beta, lam_tilde, w, args.gamma, args.kappa_scale, args.kappa_max, args.kappa_decay, n_updates,
                       log_beta)
    return candidate_policy(beta, lam_tilde, w, temp, log_beta), temp


def policy_probs(obs, beta, q_network, confidence, args, n_updates, unit):
    """pi(.|s), lambda(s, .), rho(.|s) and W(s, .) at arbitrary states (no gradient): the deployed residual policy."""
    with torch.no_grad():
        q = q_network(obs).double()
        w = q - torch.from_numpy(mixed_value(q.numpy(), beta.numpy(), args.mu))[:, None]
        lam_tilde = confidence(obs)
        rho, _ = candidate(beta.numpy(), lam_tilde.numpy(), w.numpy(), args, n_updates, unit)
        lam = lam_tilde  # constant: already feasible
        rho = torch.from_numpy(rho)
        return residual_policy(beta, rho, lam), lam, rho, w


def make_actor(behavior, q_network, confidence, args, greedy: bool):
    """act(obs) for evaluate(); sampling uses its own generator, re-seeded with eval_seed + k before the
    evaluation after k updates: evaluations do not depend on training randomness, each is reproducible on
    its own (a checkpoint re-evaluates to the same returns), and the last 10 evaluations that make the final
    score average 10 independent draws of pi's randomness, like the behaviour policy's 10 passes in
    `behavior_return` (state['n_updates'] drives the temperature decay, state['unit'] is the advantage unit
    at that time; state['args'] the settings pi is built with, i.e. the deployed pessimism level; state['deploy_pi']
    False deploys beta itself: the safety test)."""
    state = {"n_updates": 0, "unit": 1.0, "generator": torch.Generator(), "deploy_pi": True, "args": args}

    def act(obs: np.ndarray) -> np.ndarray:
        o = torch.from_numpy(obs)
        beta = behavior(o)
        pi = policy_probs(o, beta, q_network, confidence, state["args"], state["n_updates"], state["unit"])[0] if state["deploy_pi"] else beta
        if greedy:
            return pi.argmax(1).numpy()
        return torch.multinomial(pi, 1, generator=state["generator"]).squeeze(1).numpy()

    return act, state


def policy_stats(obs, beta, q_network, confidence, args, n_updates, unit) -> dict:
    """Diagnostics on a set of dataset states: confidence, distance to beta, SAA bound and its terms."""
    pi, lam, rho, w = policy_probs(obs, beta, q_network, confidence, args, n_updates, unit)
    with torch.no_grad():
        kl = (pi * (torch.log(pi.clamp_min(LOG_CLAMP)) - torch.log(beta.clamp_min(LOG_CLAMP)))).sum(1).mean()
        bound, l1, l2, l3 = lower_bound_terms(beta, rho, lam, w, args.gamma, args.mu, args.penalty_one_minus_mu)
        support = beta > 0
    return {"mean_lambda": float(lam[support].mean()), "share_lambda_gt_half": float((lam[support] > 0.5).double().mean()),
            "kl_pi_beta": float(kl), "tv_pi_beta": float(0.5 * (pi - beta).abs().sum(1).mean()),
            "lower_bound": bound, "L1": l1, "L2": l2, "L3": l3}


# ---------------------------------------------------------------------------------------------
# Improvement certificate and safety test (ours: beyond the paper)
# ---------------------------------------------------------------------------------------------
# The paper's bound (lower_bound above) cannot be checked by a user: it trusts the critic, replaces a max
# over states by a mean, and at the paper's scale is negative for every useful pi. What the batch can
# certify without trusting the critic is the first-order term of the improvement, the paper's L' with A_beta
# (Theorem 1, CPI): along the mixture pi_c = beta + c (pi - beta), the expected sum over an episode's steps
# of the discounted return-to-go changes at c = 0 at the rate (the policy-gradient identity)
#     g = E_{episodes ~ beta}[ sum_t (pi(a_t|s_t) / beta(a_t|s_t) - 1) G_t ],
# G_t the logged episode's discounted return-to-go from step t. Every term is known: a_t was drawn from the
# stored beta, so the per-episode sum is an unbiased sample of g, and logged episodes are independent, so their
# spread gives g's standard error se. To lower the variance we use the doubly robust form with a control
# variate q(s, a) (any function not fitted to the episode it is applied to keeps it unbiased):
#     g = E[ sum_t sum_a (pi - beta)(a|s_t) q(s_t, a) + (pi / beta - 1)(a_t|s_t) (G_t - q(s_t, a_t)) ].
# q: an affine function of the critic's Q(s, a), E_beta Q(s, .), max Q(s, .) and the behaviour network's
# E_beta Q_b(s, .), max Q_b(s, .), fitted by least squares to the G_t of the other half of the episodes
# (cross-fitting: q never sees the returns it is subtracted from). The critic itself was trained on every
# episode, so this is unbiased up to that weak dependence; a poor critic costs variance, not bias (with the
# behaviour network's state values alone the standard error on CartPole eps 0.25 was ~1.75x larger).
# Every evaluation reports g, se and the one-sided lower confidence bound g - z se, with z for one bound per
# deployable pessimism level (Bonferroni), which decide the deployed level (in main). The safety test
# (--safety-test, off by default) deploys pi only while that bound is above 0, and beta otherwise.
# What it does NOT certify (docs/brpo.md): (1) it is first order: the distribution shift of a pi far from beta
# (the paper's penalty term) is not in it, and a gain that needs a large coordinated change (Acrobot eps 1:
# uniform data, a few successful episodes) can be invisible to it; (2) pi was fitted to the same batch, so
# where the critic over-fits the batch's returns the estimate is optimistic (no held-out split); (3) the
# certificate discount (--certificate-gamma 0.99, the critic's) weights rewards far after a decision less, the
# usual variance reduction of policy gradients; 1.0 estimates the undiscounted episode return the scripts are
# scored on, at a higher variance.
MIN_CERT_EPISODES = 2  # a standard error needs two independent episodes
MAX_BROKEN_SHARE = 0.01  # more rows than this whose next state is not the next row's state: not episode order


def certificate_data(data: dict, beta: np.ndarray, gamma: float, behavior: "BehaviorPolicy"):
    """What the certificate needs, computed once per run: the rows of complete logged episodes, their episode
    index, beta(.|s_t), beta(a_t|s_t), the discounted returns-to-go G_t and the behaviour network's state values
    (E_beta Q_b, max Q_b). Returns (dict, None), or (None, reason) if the batch cannot certify."""
    obs, nxt, actions = data["observations"], data["next_observations"], data["actions"]
    end = data["terminals"] | data["timeouts"]
    n = len(end)
    # collect_data.py stores transitions in collection order; a row whose next state is not the next row's
    # state (shuffled or concatenated data) cuts the episode there, and a cut episode has no return-to-go
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
    for t in range(n - 1, -1, -1):  # discounted return-to-go inside each episode (once per run, ~50 ms)
        acc = rewards[t] + (0.0 if stop[t] else gamma * acc)
        returns[t] = acc
    with torch.no_grad():
        q_b = behavior.q_values(torch.from_numpy(obs[rows])).numpy()
    state_features = np.stack([np.ones(len(rows)), (beta[rows] * q_b).sum(1), q_b.max(1)], 1)
    return {"rows": rows, "episode": episode, "n_episodes": n_episodes, "actions": actions[rows], "beta": beta[rows],
            "beta_taken": beta_taken, "returns": returns[rows], "state_features": state_features}, None


def tv_to_beta(pi: np.ndarray, beta: np.ndarray) -> float:
    """Mean total-variation distance of pi to beta over the rows' states. Theorem 2's (thm:cpi_2) regulariser L''
    is E_s sum_a lambda |rho - beta| = E_s sum_a |pi - beta|, twice this distance."""
    return float(0.5 * np.abs(pi - beta).sum(1).mean())


def improvement_certificate(pi: np.ndarray, q: np.ndarray, cert: dict, z: float) -> dict:
    """Estimate g of the first-order improvement of pi over beta (comment above) from pi(.|s_t) and the critic's
    Q(s_t, .) on the certificate's rows, its standard error over episodes, the one-sided lower confidence bound
    g - z se, and whether it certifies (bound > 0)."""
    n = len(cert["actions"])
    beta, taken, fold = cert["beta"], cert["actions"], cert["episode"] % 2
    # control variate q_cv(s, a) = features(s, a) . coef: the critic's action value plus state-only terms
    state = np.concatenate([cert["state_features"], (beta * q).sum(-1)[:, None], q.max(-1)[:, None]], 1)
    per_step = np.zeros(n)
    for f in (0, 1):  # cross-fitting over the two halves of the episodes (both hold >= 1 episode: n_episodes >= 2)
        fit, use = fold != f, fold == f
        x_fit = np.concatenate([state[fit], q[fit, taken[fit]][:, None]], 1)
        coef = np.linalg.lstsq(x_fit, cert["returns"][fit], rcond=None)[0]
        # in sum_a (pi - beta) q_cv the state-only terms cancel: the direct term carries the critic's Q(s, a) only
        q_cv = (state[use] @ coef[:-1])[:, None] + coef[-1] * q[use]
        direct = ((pi[use] - beta[use]) * q_cv).sum(-1)
        weight = pi[use, taken[use]] / cert["beta_taken"][use] - 1.0  # beta(a_t|s_t) > 0 (certificate_data)
        per_step[use] = direct + weight * (cert["returns"][use] - q_cv[np.arange(len(q_cv)), taken[use]])
    per_episode = np.bincount(cert["episode"], weights=per_step, minlength=cert["n_episodes"])
    g = float(per_episode.mean())
    se = float(per_episode.std(ddof=1) / math.sqrt(len(per_episode)))
    lcb = g - z * se
    return {"certificate": g, "certificate_se": se, "certificate_lcb": lcb, "certified": float(lcb > 0.0)}


def run_checkpoint(args: Args) -> None:
    ckpt = load_checkpoint(args.eval_checkpoint, {
        "q_network": dict, "behavior": dict, "epsilon": float, "args": dict, "n_updates": int,
        "advantage_unit": float, "deploy_pi": bool, "deploy_pessimism": float})
    # the policy's own settings come from the checkpoint, evaluation settings from the command line
    defaults = Args()
    saved = {k: v for k, v in ckpt["args"].items() if k in Args.__dataclass_fields__}
    wrong = [k for k, v in saved.items() if getattr(defaults, k) is not None and not isinstance(v, type(getattr(defaults, k)))]
    layout = {"w0": (32, ckpt["obs_dim"]), "b0": (32,), "w1": (16, 32), "b1": (16,), "w2": (ckpt["n_actions"], 16),
              "b2": (ckpt["n_actions"],)}
    weights = ckpt["behavior"]
    if wrong or not 0.0 <= ckpt["epsilon"] <= 1.0:
        fail(f"checkpoint {args.eval_checkpoint}: its settings {wrong or ['epsilon']} are invalid; save it again with --save-model")
    if {k: tuple(getattr(v, "shape", ())) for k, v in weights.items()} != layout or not all(
            v.dtype in (torch.float32, torch.float64) and torch.isfinite(v).all() for v in weights.values()):
        fail(f"checkpoint {args.eval_checkpoint} does not hold a finite behaviour network obs -> 32 -> 16 -> actions")
    saved = Args(**saved)
    try:
        check_args(replace(saved, threads=1, run_name=None, exp_name="x", eval_checkpoint=None, dataset_path=None))
    except SystemExit as e:
        fail(f"checkpoint {args.eval_checkpoint}: its saved settings are invalid ({str(e.code).split('error: ', 1)[-1]})")
    if not ckpt["advantage_unit"] > 0 or not 0.0 <= ckpt["deploy_pessimism"] <= 1e3:
        fail(f"checkpoint {args.eval_checkpoint}: its advantage unit or deployed pessimism is invalid")
    envs = [make_env(ckpt["env_id"]) for _ in range(args.eval_episodes)]
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(args.eval_checkpoint, q_network, ckpt["q_network"])
    confidence = load_confidence(ckpt, saved, args.eval_checkpoint)
    behavior = BehaviorPolicy({k: v.numpy() for k, v in weights.items()}, ckpt["epsilon"])
    act, state = make_actor(behavior, q_network, confidence, saved, args.eval_greedy)
    state["n_updates"], state["unit"] = ckpt["n_updates"], ckpt["advantage_unit"]
    state["deploy_pi"] = ckpt["deploy_pi"]  # the safety test's decision when saved
    state["args"] = replace(saved, pessimism=ckpt["deploy_pessimism"])  # the level deployed
    state["generator"].manual_seed(args.eval_seed + ckpt["n_updates"])  # the run's own evaluation at that point
    try:
        returns = evaluate(act, envs, args.eval_seed)
    except (RuntimeError, ValueError, OverflowError) as e:  # weights that load but give no policy (inf logits)
        fail(f"checkpoint {args.eval_checkpoint} cannot be evaluated: {' '.join(str(e).split())}")
    print(f"{args.eval_checkpoint}: {ckpt['env_id']} return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} episodes"
          + ("" if state["deploy_pi"] else " (beta: pi was not certified when saved)"))


def load_confidence(ckpt: dict, args: Args, path: str = ""):
    return ConstantConfidence(args.lam, ckpt["n_actions"])


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
    actions = torch.as_tensor(data["actions"])
    actions_np = actions.numpy()
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    bootstrap = torch.as_tensor(args.gamma * (1.0 - data["terminals"].astype(np.float32)))  # gamma, 0 at terminals
    # beta in float64, renormalised: sum_a (rho - beta) must be 0 to ~1e-16 for the equality constraint
    behavior_probs = torch.as_tensor(data["behavior_probs"], dtype=torch.float64)
    behavior_probs /= behavior_probs.sum(1, keepdim=True)
    behavior_probs_np = behavior_probs.numpy()
    # the float32 per-transition arrays side by side, so that a minibatch is one row gather (numpy's take: a
    # fraction of torch's indexing overhead at 64 rows); next beta only enters the critic target: float32
    table = np.concatenate([data["observations"], data["next_observations"], data["next_behavior_probs"],
                            data["rewards"][:, None], bootstrap.numpy()[:, None]], 1, dtype=np.float32)
    columns = (slice(0, obs_dim), slice(obs_dim, 2 * obs_dim), slice(2 * obs_dim, 2 * obs_dim + n_actions),
               2 * obs_dim + n_actions, 2 * obs_dim + n_actions + 1)  # s, s', beta(.|s'), r, gamma (1 - terminal)
    behavior = BehaviorPolicy({k: data[f"behavior_{k}"] for k in ("w0", "b0", "w1", "b1", "w2", "b2")}, float(data["epsilon"]))
    # fixed dataset states for the diagnostics in result.json (own generator: training draws are unchanged)
    stats_idx = torch.randperm(len(actions), generator=torch.Generator().manual_seed(0))[:4096]
    # the certificate's inputs (rows of complete episodes, returns, behaviour-network state values), once
    cert, no_cert = certificate_data(data, behavior_probs_np, args.certificate_gamma, behavior)
    # one bound per deployable level, simultaneous (Bonferroni): the chosen level's bound holds at the stated level
    z = statistics.NormalDist().inv_cdf(1.0 - (1.0 - args.certificate_confidence) / len(args.deploy_pessimism))
    if no_cert:
        print(f"warning: no improvement certificate: {no_cert}; " + ("the safety test deploys beta (--no-safety-test "
              "deploys pi uncertified)" if args.safety_test else "pi is deployed uncertified"), flush=True)
    else:
        cert_obs, cert_beta = obs[cert["rows"]], behavior_probs[cert["rows"]]
    certificate = {}

    q_network = QNetwork(obs_dim, n_actions)
    target_network = QNetwork(obs_dim, n_actions)
    target_network.load_state_dict(q_network.state_dict())
    # fused Adam: the same update in one kernel; at this size the per-parameter Python loop of the default
    # implementation is a visible share of an update
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)
    confidence = load_confidence({"n_actions": n_actions}, args)
    eval_envs = [make_env(args.env_id) for _ in range(args.eval_episodes)]
    act, actor_state = make_actor(behavior, q_network, confidence, args, args.eval_greedy)

    evaluations, train_time, eval_time, start = [], 0.0, 0.0, time.time()
    block_start = time.perf_counter()
    for step in range(1, args.total_steps + 1):
        idx = torch.randint(len(actions), (args.batch_size,), generator=generator)
        idx_np = idx.numpy()
        batch_np = table.take(idx_np, 0)
        s, next_s, _, r, boot = (torch.from_numpy(batch_np[:, c]) for c in columns)
        beta = torch.from_numpy(behavior_probs_np.take(idx_np, 0))
        with torch.no_grad():
            next_q = target_network(next_s).numpy()
        next_v = mixed_value(next_q, batch_np[:, columns[2]], args.mu)  # V(s'), Algorithm 1 line 6
        td_target = torch.addcmul(r, torch.from_numpy(next_v), boot)  # r + gamma (1 - terminal) V(s')
        q_all = q_network(s)
        q32 = q_all.detach().numpy()
        if not np.isfinite(q32).all():  # stop before a diverged critic's values reach the confidence step
            fail(f"training diverged: the critic's values are NaN or inf after {step - 1} updates; try a lower --learning-rate")
        # d/dQ of the TD loss mean (Q(s, a) - y)^2 without gather + mse_loss in the graph (see critic_output_grad)
        q_grad, td_error = critic_output_grad(q32, actions_np[idx_np], td_target.numpy())
        q_np = q32.astype(np.float64)
        # running advantage unit (see advantage_unit), from the critic before its step like W
        q_max = q_np.max(-1)
        unit = advantage_unit(q_np, q_max) if step == 1 else (1.0 - UNIT_RATE) * unit + UNIT_RATE * advantage_unit(q_np, q_max)

        optimizer.zero_grad()
        q_all.backward(torch.from_numpy(q_grad))
        optimizer.step()

        if step % args.target_update_frequency == 0:
            with torch.no_grad():
                for p, tp in zip(q_network.parameters(), target_network.parameters()):
                    tp.lerp_(p, args.tau)

        if writer and step % 100 == 0:
            writer.add_scalar("losses/td_loss", float(np.square(td_error, dtype=np.float64).mean()), step)
            writer.add_scalar("losses/q_values", float(q32[np.arange(len(idx_np)), actions_np[idx_np]].mean()), step)
            writer.add_scalar("confidence/advantage_unit", unit, step)
            for key, value in policy_stats(s, beta, q_network, confidence, args, step, unit).items():
                writer.add_scalar(f"confidence/{key}" if "lambda" in key else f"losses/{key}", value, step)

        if step % args.eval_frequency == 0 or step == args.total_steps:
            now = time.perf_counter()
            train_time += now - block_start
            check_finite(step, q_network)
            actor_state["n_updates"], actor_state["unit"] = step, unit
            level = 0
            if cert:  # pi's certificate on the whole batch decides the deployed level (and, with the safety test, pi or beta)
                with torch.no_grad():
                    q_batch = q_network(cert_obs).double().numpy()
                pis = [policy_probs(cert_obs, cert_beta, q_network, confidence, replace(args, pessimism=p), step,
                                   unit)[0].numpy() for p in args.deploy_pessimism]
                options = [improvement_certificate(pi, q_batch, cert, z) for pi in pis]
                distance = [tv_to_beta(pi, cert["beta"]) for pi in pis]  # on the batch's states
                # Deployed level (ours). The pessimism term that keeps rho from following the critic to actions
                # beta rarely takes also moves beta's exploration mass to its most frequent action, whether or not
                # that helps: on CartPole eps <= 0.25 the critic's claims about the rare actions are wrong and the
                # pessimism is what keeps pi above beta, on LunarLander eps = 0.05 they are right and the drift to
                # beta's greedy policy is what costs pi its gain (docs/brpo.md). The critic cannot tell these apart.
                # The certificate can say whether a level is shown to improve on beta: pi as trained (the first level)
                # while it is certified, else the certified level with the highest bound. Where no level is
                # certified the batch cannot rank them by their gain (the bounds of uncertified levels differ by
                # noise and flip between evaluations); what remains of Theorem 2's bound (L' minus a penalty
                # proportional to L'' and L''', both growing with |pi - beta|) is the penalty: the level nearest beta.
                certified = [i for i, o in enumerate(options) if o["certified"]]
                if options[0]["certified"]:
                    level = 0
                elif certified:
                    level = max(certified, key=lambda i: options[i]["certificate_lcb"])
                else:
                    level = min(range(len(options)), key=lambda i: distance[i])
                certificate = {**options[level], "tv_to_beta": distance[level]}
            actor_state["args"] = replace(args, pessimism=args.deploy_pessimism[level])
            actor_state["deploy_pi"] = not args.safety_test or certificate.get("certified", 0.0) == 1.0
            actor_state["generator"].manual_seed(args.eval_seed + step)  # see make_actor
            returns = evaluate(act, eval_envs, args.eval_seed)
            block_start = time.perf_counter()
            eval_time += block_start - now
            evaluations.append({"step": step, "return_mean": float(returns.mean()), "return_std": float(returns.std()),
                                "deployed": "pi" if actor_state["deploy_pi"] else "beta",
                                "pessimism": args.deploy_pessimism[level], **certificate})
            sps = step / train_time
            print(f"step={step} eval_return={returns.mean():.1f} +- {returns.std():.1f} SPS={sps:.0f}", flush=True)
            if writer:
                writer.add_scalar("eval/episodic_return", returns.mean(), step)
                writer.add_scalar("charts/SPS", sps, step)
                writer.add_scalar("charts/deployed_pi", float(actor_state["deploy_pi"]), step)
                writer.add_scalar("charts/deployed_pessimism", args.deploy_pessimism[level], step)
                for key in ("certificate", "certificate_lcb"):
                    if key in certificate:
                        writer.add_scalar(f"losses/{key}", certificate[key], step)

    final_score = float(np.mean([e["return_mean"] for e in evaluations[-10:]]))
    # diagnostics of the policy deployed at the end (its pessimism level)
    extra = policy_stats(obs[stats_idx], behavior_probs[stats_idx], q_network, confidence, actor_state["args"],
                         args.total_steps, unit)
    extra.update(certificate, deployed_pi=float(actor_state["deploy_pi"]),  # the last evaluation's certificate
                 deployed_pessimism=actor_state["args"].pessimism)
    result = {
        "algorithm": Path(__file__).stem, "env_id": args.env_id, "epsilon": args.epsilon, "seed": args.seed,
        "args": asdict(args), "evaluations": evaluations, "final_score": final_score,
        "behavior_return": float(data["behavior_return"]), "wall_time": time.time() - start,
        "train_time": train_time, "eval_time": eval_time, "updates_per_second": args.total_steps / train_time,
        "dataset_path": str(dataset_path), "format_version": FORMAT_VERSION, "extra": extra,
    }
    if writer:
        writer.add_scalar("eval/final_score", final_score, args.total_steps)
        writer.flush()  # raises what the writer's thread met (e.g. a full disk)
        writer.close()
    if args.save_model:
        save_model_atomic(run_dir / "model.pt", {
            "algorithm": Path(__file__).stem, "env_id": args.env_id, "obs_dim": obs_dim, "n_actions": n_actions,
            "args": asdict(args), "q_network": q_network.state_dict(),
            "behavior": {k: torch.as_tensor(data[f"behavior_{k}"]) for k in ("w0", "b0", "w1", "b1", "w2", "b2")},
            "epsilon": float(data["epsilon"]), "n_updates": args.total_steps, "deploy_pi": actor_state["deploy_pi"],
            "deploy_pessimism": actor_state["args"].pessimism, "advantage_unit": unit})
    write_json_atomic(run_dir / "result.json", result)  # last: a run directory with result.json is a finished run
    print(f"final score {final_score:.1f} (behaviour {result['behavior_return']:.1f}); "
          f"mean lambda {extra['mean_lambda']:.3f}, KL(pi||beta) {extra['kl_pi_beta']:.4f}; results in {run_dir}")
    print(f"SAA estimate of the paper's bound on J_pi - J_beta over {len(stats_idx):,} dataset states: {extra['lower_bound']:.4g} "
          "(a diagnostic, not a guarantee: docs/brpo.md)")
    if certificate:
        print(f"improvement certificate (first order, {cert['n_episodes']} logged episodes): {certificate['certificate']:.4g} "
              f"+- {certificate['certificate_se']:.3g}, {args.certificate_confidence:.0%} lower bound "
              f"{certificate['certificate_lcb']:.4g}: " + ("certified" if certificate["certified"] else "not certified")
              + (f"; deployed: pi, pessimism {actor_state['args'].pessimism:g}" if actor_state["deploy_pi"]
                 else "; deployed: beta (the safety test)"))


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
