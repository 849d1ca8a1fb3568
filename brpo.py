"""BRPO: Batch Residual Policy Optimization (Sohn et al., IJCAI 2020), single file.

The learned policy is the residual policy (paper Sec. 2)
    pi(a|s) = (1 - lambda(s,a)) beta(a|s) + lambda(s,a) rho(a|s),
with beta the known behaviour policy of the batch, rho a candidate policy and lambda in [0,1] a state-action
confidence constrained to sum_a lambda(s,a) (rho - beta)(a|s) = 0, so that pi is a distribution at every state.
One gradient update (paper Algorithm 1, coordinate ascent):
  1. sample a minibatch (s, a, r, s') of the batch;
  2. rho <- relative softmax of beta with the current confidence network lambda_phi (eq. relative_soft);
  3. lambda-bar* <- argmax of the SAA lower bound over the minibatch (Sec. 5, "The Closed-form Confidence"),
     solved exactly (solve_confidence);
  4. one Adam step of lambda_phi on the KL fitting loss towards (1 - lambda-bar*) beta + lambda-bar* rho
     ("Learning the Confidence"); lambda_phi ends in an exact projection layer (eq. optimize_lambda), so it is
     feasible at any state;
  5. one critic step towards r + gamma V(s'), V = (1-mu) E_beta Q' + mu max Q' (Algorithm 1, line 6);
  6. soft target update.
The critic supplies the weighted advantage W = Q - V (appendix "Practical Implementation Details"). Where and why
this departs from the paper, what the reported bound and the improvement certificate do and do not guarantee:
docs/brpo.md.

    python brpo.py --env-id Acrobot-v1 --epsilon 0.15
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
# Our defaults where the paper's settings leave BRPO at beta (docs/brpo.md, "Departures from the paper"): a
# constant temperature 0.99 in advantage units (kappa capped at 0.02), a candidate pessimistic about actions
# the batch rarely shows (pessimism 1), and the bound's penalty scaled by 0.1 (Args.penalty_scale).
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
    confidence_learning_rate: float = 1e-4
    """Adam learning rate of the confidence network lambda_phi (paper: 1e-4)"""
    kappa_max: float = KAPPA_MAX_DEFAULT
    """cap of the temperature's kappa: kappa <- min(kappa_max, kappa) (paper, end of Sec. 5); <= 1: a constant temperature"""
    kappa_decay: float = 1.0
    """temperature decay kappa <- kappa * kappa_decay**n after n updates (paper, end of Sec. 5)"""
    kappa_scale: float = 1.0
    """constant factor on kappa (ours): with --kappa-max inf, the paper's state-dependent kappa(s) at a usable scale"""
    pessimism: float = PESSIMISM_DEFAULT
    """lower W(s,a) by pessimism / sqrt(beta(a|s)) advantage units in the candidate policy, and (centred under beta)
    in lambda-bar*'s objective (ours; 0 = the paper)"""
    advantage_unit: bool = True
    """in the relative softmax, measure W in units of the critic's mean action gap (running average) so that the
    temperature means the same on every task (departure from the paper; --no-advantage-unit: raw W)"""
    penalty_one_minus_mu: bool = True
    """scale the bound's penalty L'' L''' by (1 - mu) like the appendix's mu-weighted bound (off: main text)"""
    penalty_scale: float = 0.1
    """multiplies the penalty of the objective the lambda-bar* solver maximises (1 = the paper's SAA bound)"""
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
    if not args.confidence_learning_rate > 0:
        fail(f"--confidence-learning-rate must be positive, got {args.confidence_learning_rate}")
    if not args.penalty_scale >= 0:
        fail(f"--penalty-scale must be >= 0, got {args.penalty_scale}")
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
D_ZERO = 1e-12  # |rho - beta| below this is rounding noise of two distributions that agree (probabilities <= 1)
SNAP = 1e-12  # solver: a vertex coordinate within SNAP of 0 is rounding noise (enumerate_vertices)
TINY = 1e-300  # floor of denominators that are positive up to underflow


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


# ---------------------------------------------------------------------------------------------
# Constraint-projection layer (paper eq. optimize_lambda)
# ---------------------------------------------------------------------------------------------
def projection_root(lt: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The root nu of g(nu) = d . clip(lt - nu d, 0, 1) = 0, and the projection clip(lt - nu d, 0, 1): see
    project_confidence."""
    nz = d != 0
    safe_d = np.where(nz, d, 1.0)
    # breakpoints of g; coordinates with d_j = 0 add a spurious breakpoint at 0, harmless: g is evaluated
    # there exactly and stays piecewise linear between any superset of its breakpoints
    bp = np.sort(np.concatenate([np.where(nz, lt / safe_d, 0.0), np.where(nz, (lt - 1.0) / safe_d, 0.0)], -1), -1)
    g = (np.clip(lt[:, None, :] - bp[:, :, None] * d[:, None, :], 0.0, 1.0) * d[:, None, :]).sum(-1)  # non-increasing
    nb = bp.shape[-1]
    k = np.clip((g > 0).sum(-1) - 1, 0, nb - 2)
    rows = np.arange(bp.shape[0])
    b0, b1, g0, g1 = bp[rows, k], bp[rows, k + 1], g[rows, k], g[rows, k + 1]
    den = g0 - g1
    frac = np.where(den > 0, g0 / np.where(den > 0, den, 1.0), 0.0)
    nu = np.where(nz.any(-1), b0 + np.clip(frac, 0.0, 1.0) * (b1 - b0), 0.0)
    return np.clip(lt - nu[:, None] * d, 0.0, 1.0)


def project_confidence(lam_tilde: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Exact Euclidean projection of lam_tilde onto Lambda(s) = [0,1]^|A| ∩ {lambda . d = 0}, d = rho - beta (the
    constraint-projection layer, eq. optimize_lambda).

    Departure from the paper: its closed form (shift by the hyperplane multiplier, then clip) stays in the box
    but breaks the equality as soon as a coordinate is clipped, and then pi = beta + lambda (rho - beta) is
    not a distribution. KKT of the projection: lambda = clip(lam_tilde - nu d, 0, 1) with the scalar nu
    solving g(nu) = d . clip(lam_tilde - nu d, 0, 1) = 0. g is non-increasing and piecewise linear with
    breakpoints lam_tilde_j / d_j and (lam_tilde_j - 1) / d_j, so nu is found exactly by evaluating g at the
    sorted 2|A| breakpoints and interpolating inside the bracket (vectorised, no iterations). d == 0
    (rho = beta): any box point is feasible, the projection is the clip. float64: the equality holds to ~1e-16.
    Its gradient (confidence_fit): I - d_F d_F^T / |d_F|^2 on the free coordinates F = {j: 0 < lambda_j < 1}, 0 on
    clipped ones (the implicit-function derivative; tests check it against autograd through the same KKT form)."""
    d = np.where(np.abs(d) > D_ZERO, d, 0.0)
    if d.shape[1] == 2:  # d = (delta, -delta): Lambda(s) is the diagonal, the projection is the clip of the mean
        return np.where((d != 0).any(1, keepdims=True), np.clip(lam_tilde.mean(1, keepdims=True), 0.0, 1.0),
                        np.clip(lam_tilde, 0.0, 1.0)) * np.ones_like(lam_tilde)
    return projection_root(lam_tilde, d)


def confidence_fit(lam_tilde: np.ndarray, d: np.ndarray, beta: np.ndarray, rho: np.ndarray, target: np.ndarray):
    """The paper's distribution-fitting loss (Sec. 5, "Learning the Confidence")
        mean_s sum_a pi_phi log(pi_phi / target),  pi_phi = beta + project_confidence(lam_tilde, d) d,
    logs floored at LOG_CLAMP, and its gradient w.r.t. lam_tilde, in numpy (one tiny autograd graph per update
    costs more than this whole computation; tests check both against autograd): dL/dpi = (log pi - log target
    + 1) / |B| (0 where pi is clamped), dL/dlambda = dL/dpi * d, then the projection's Jacobian."""
    d = np.where(np.abs(d) > D_ZERO, d, 0.0)
    lam = project_confidence(lam_tilde, d)
    pi = beta + lam * d
    lp = np.log(np.maximum(pi, LOG_CLAMP))
    lq = np.log(np.maximum(target, LOG_CLAMP))
    n = pi.shape[0]
    lr = lp - lq
    loss = float((pi * lr).sum() / n)
    g_lam = (lr + (pi > LOG_CLAMP)) * d / n
    free = (lam > 0.0) & (lam < 1.0)
    d_free = d * free
    n_free = (np.square(d_free)).sum(-1)[:, None]
    proj = (d_free * g_lam).sum(-1)[:, None] / np.where(n_free > 0, n_free, 1.0)
    return loss, np.where(free, g_lam - d_free * proj, 0.0)


def penalty_weight(batch_size, gamma, mu, scale_penalty_by_mu=True):
    """k in f(lambda) = C - k U V, the solver's form of the SAA bound (|B| (1-gamma) times L-bar)."""
    pen = (1.0 - mu) if scale_penalty_by_mu else 1.0
    return gamma * pen / (batch_size * (1.0 - gamma))


# ---------------------------------------------------------------------------------------------
# Batch confidence solver  lambda-bar* = argmax_{lambda in Lambda-bar} f(lambda)
# ---------------------------------------------------------------------------------------------
# Problem (paper Sec. 5, "The Closed-form Confidence"), per minibatch of |B| states:
#     f(lambda) = C - k U V,  C = <(rho-beta) W, lambda>, U = <|rho-beta|, lambda>, V = <|rho-beta||W|, lambda>
#     s.t. 0 <= lambda <= 1 and d_s . lambda_s = 0 for every state s (d = rho - beta).
# Why not the paper's closed form: Theta = k (D u u^T + u u^T D) has rank <= 2 (not invertible) and is
# indefinite in general (u v^T + v u^T has eigenvalues of both signs), so the QP is NOT concave; and the
# clip in eq. lambda_vector breaks the equality constraint. We solve the non-concave QP exactly instead:
#
# (1) Geometry. lambda -> (C, U, V) maps the product polytope P = prod_s P_s onto the 3-D polytope
#     Z = sum_s Z_s (Minkowski sum of the per-state images). f = C - kUV depends on lambda only through
#     (C, U, V), increases with C, and on any 2-D face of Z is C = affine(U,V) - kUV, a saddle in (U, V)
#     (Hessian -k[[0,1],[1,0]]). So the maximum sits on an EDGE or a VERTEX of Z, and along an edge f is a
#     1-D quadratic with a closed-form maximiser.
# (2) Vertices of P_s = [0,1]^|A| ∩ {d.lambda = 0} have at most one fractional coordinate: enumerate the
#     |A| 2^(|A|-1) points "coordinate j free, the others in {0,1}, lambda_j = -d_{-j}.x / d_j" (invalid
#     ones replaced by the vertex 0). One (B, M, |A|) tensor, built once per call; weakly Pareto-dominated
#     candidates (smaller c, larger u and v) are dropped (_prune).
#     Shortcut for most states: if one coordinate j of d_s has the opposite sign of all the others (always
#     for |A| <= 3; for |A| = 4 unless d_s has two positive and two negative entries), the constraint reads
#     lambda_j = sum_{i != j} (|d_i| / |d_j|) lambda_i with sum_{i != j} |d_i| / |d_j| = 1, so the other
#     lambda_i are free in [0, 1] and P_s is the parallelepiped sum_i [0, g_i], g_i = e_i + (|d_i|/|d_j|) e_j
#     (lonely_generators). Z_s is then a sum of |A| - 1 segments, and along a ray each segment simply
#     switches off at s = c_g / w_g: no vertex enumeration, no envelope sweep. |A| = 2 is the case of one
#     generator (1, 1) per state; the paths are the same as the envelope sweep's (the envelope of a
#     parallelepiped's vertices switches its generators off one by one).
# (3) First-order optimality: grad f = c - kV u - kU v, so an optimum
#     maximises the LINEAR function (c - a u - b v).lambda with (a, b) = (kV*, kU*) >= 0. For a ray
#     (a, b) = s (alpha, beta_), s in [0, inf), the per-state LP maximiser is piecewise constant in s and
#     changes at the breakpoints of the upper envelope of the lines c_m - s w_m (w = alpha u + beta_ v),
#     computed by a vectorised "kinetic" sweep. Merging all states' breakpoints in order of s gives a
#     path of vertices of Z from the unpenalised LP optimum (s = 0) to lambda = 0 (s = inf) whose
#     consecutive vertices are joined by edges of Z. We evaluate f at every vertex and the exact 1-D
#     quadratic maximum on every edge of the path.
#     If the ray passes through (kV*, kU*) the path contains the global optimum (vertex of Z: its normal
#     cone contains (a*, b*); edge of Z: the ray crosses the common boundary of the two normal cones at
#     (a*, b*) and that crossing is an edge of the path). The unknown direction is searched by 4 ray
#     angles, then 5 rays around the fixed-point angle of the best point found (theta <- angle(kV, kU):
#     the direction the optimum reproduces). This is the part that is a search, not a proof: it is
#     validated against exhaustive enumeration of all (vertex, edge) combinations on random small
#     instances in tests/test_brpo.py (agreement to ~1e-8 typically; the test demands 1e-4), and a grid
#     alone is NOT enough (it misses the optimum by up to 80% on ~4% of the instances).
# (4) The result is compared with lambda = 0 and the best constant lambda (both always feasible because
#     sum_a d_a = 0) and the best of all is returned, so the solver is never worse than either.
# Cost: two vectorised passes of O(K |B| M J) numpy float64 work (K rays, M candidates after pruning, J envelope
# pieces); only the states that are not parallelepipeds go through the envelope sweep, whose Python loop over J
# is per-call overhead. LunarLander (|A| = 4, states with two coordinates of each sign) is the slowest task.
_PATTERN_CACHE: dict = {}


def _patterns(n):
    if n not in _PATTERN_CACHE:
        js, xs = [], []
        for j in range(n):
            # others all 0 gives lambda = 0 and others all 1 gives lambda = 1 (as sum_a d_a = 0) for every j:
            # those two vertices are added once, in enumerate_vertices
            for bits in range(1, 2 ** (n - 1) - 1):
                x = np.zeros(n)
                others = [i for i in range(n) if i != j]
                for t, i in enumerate(others):
                    x[i] = (bits >> t) & 1
                js.append(j)
                xs.append(x)
        js = np.array(js, dtype=np.int64)
        _PATTERN_CACHE[n] = (js, np.array(xs).reshape(-1, n), np.eye(n)[js])
    return _PATTERN_CACHE[n]


def enumerate_vertices(d):
    """All candidate vertices of P_s for every state: (B, M, n) array (invalid candidates -> zero vector)."""
    bsz, n = d.shape
    js, x, onehot = _patterns(n)
    num = d @ x.T  # (B, M): sum_{i != j} d_i x_i
    dj = d[:, js]
    ok = dj != 0
    lamj = -num / np.where(ok, dj, 1.0)
    ok &= (lamj >= -1e-9) & (lamj <= 1.0 + 1e-9)
    # snap float noise (lambda_j = 1 - 1e-16 from d_1 != -d_0 in the last bit) so duplicates are exact and
    # _prune removes them; moves d . lambda by <= 1e-9 |d_j|. Near 0 the snap is far tighter (SNAP): there a
    # small lambda_j can be a vertex's whole value (at 1e-9 the solver lost 40% of the optimum on an instance
    # whose gain came from an action with |d_i| = 1e-10 |d_j|: tests/test_brpo.py::test_solver_tiny_coordinates)
    lamj = np.where(np.abs(lamj) < SNAP, 0.0, np.where(np.abs(lamj - 1.0) < 1e-9, 1.0, np.clip(lamj, 0.0, 1.0)))
    cand = x[None, :, :] + onehot[None, :, :] * lamj[:, :, None]
    ends = np.broadcast_to(np.stack([np.zeros(n), np.ones(n)]), (bsz, 2, n))
    return np.concatenate([ends, cand * ok[:, :, None]], 1)


def lonely_generators(d):
    """Parallelepiped form of P_s (see the solver comment, (2)). Returns lonely (B,), True where one
    coordinate j = argmax |d_s| has the opposite sign of every other nonzero d_i, and g (B, |A|-1, |A|):
    g[s, i] = e_i + (|d_i| / |d_j|) e_j for the other coordinates i (in the order j+1, j+2, ... mod |A|).
    At lonely states P_s = {sum_i t_i g[s, i] : t in [0, 1]^(|A|-1)}. Ratios within 1e-9 of 1 are snapped like
    enumerate_vertices does (|A| = 2: g = (1, 1) exactly); small ratios are kept (they are exact quotients,
    not noise, and can carry the state's whole gain)."""
    bsz, n = d.shape
    rows = np.arange(bsz)[:, None]
    j = np.abs(d).argmax(1)
    others = (j[:, None] + np.arange(1, n)) % n  # (B, n-1)
    dj = d[rows[:, 0], j]
    do = d[rows, others]
    lonely = ~(do * dj[:, None] > 0).any(1)
    adj = np.abs(dj)[:, None]
    ratio = np.clip(np.abs(do) / np.where(adj > 0, adj, 1.0), 0.0, 1.0)
    ratio = np.where(ratio > 1.0 - 1e-9, 1.0, ratio)
    g = np.zeros((bsz, n - 1, n))
    gi = np.arange(n - 1)[None, :]
    g[rows, gi, others] = 1.0
    g[rows, gi, j[:, None]] = ratio
    return lonely, g


def _generator_path(gvals, alpha, beta_):
    """Along the ray (a, b) = s (alpha, beta_) a generator with c_g > 0 (the only ones passed: c_g <= 0 keeps
    t_g = 0 all along) is on (t_g = 1) until s = c_g / w_g, w_g = alpha u_g + beta_ v_g (> 0 up to underflow:
    c_g > 0 needs u_g, v_g > 0). Returns the switch-off points s (K, G) and the path start (3,)."""
    wg = alpha[:, None] * gvals[None, :, 1] + beta_[:, None] * gvals[None, :, 2]
    with np.errstate(divide="ignore"):
        return gvals[:, 0] / wg, gvals.sum(0)


def _sweep(vals, gvals, alpha, beta_, k):
    """Exact search along rays (a, b) = s (alpha_r, beta_r), s in [0, inf), one ray per entry of alpha.

    vals: (B, M, 3) = (c, u, v) . candidate for each non-parallelepiped state and candidate vertex (B may be
    0); gvals: (G, 3) = (c, u, v) . generator of the parallelepiped states, those with c_g > 0. Rows r*B + b of
    the flattened (K*B, M) arrays are (ray r, state b). Returns per ray the best f on its path of vertices
    and edges of Z, and what _rebuild needs to turn that point back into lambda."""
    bsz, m, _ = vals.shape
    kr = alpha.shape[0]
    nr = kr * bsz
    ar = np.arange(nr)
    sg, p0 = _generator_path(gvals, alpha, beta_)
    p0 = np.broadcast_to(p0, (kr, 3))
    jn, s_flat, delta = 0, np.zeros((kr, 0)), np.zeros((kr, 0, 3))
    idx = np.zeros((0, 1), dtype=np.int64)
    if bsz:
        c = np.tile(vals[:, :, 0], (kr, 1))  # (R, M)
        w = (alpha[:, None, None] * vals[None, :, :, 1] + beta_[:, None, None] * vals[None, :, :, 2]).reshape(nr, m)
        # s = 0: LP maximiser of c; ties -> smallest w (the one that survives for s > 0)
        cmax = c.max(1, keepdims=True)
        cur = np.where(c >= cmax - 1e-12 * np.abs(cmax), w, np.inf).argmin(1)
        idx_seq, s_seq = [cur], []
        c_cur, w_cur = c[ar, cur], w[ar, cur]
        tol_w = (1e-12 * w.max(1))[:, None]
        for _ in range(m - 1):  # kinetic sweep of each state's upper envelope of the lines c_m - s w_m
            dw = w_cur[:, None] - w
            valid = dw > tol_w
            if not valid.any():
                break
            s = np.where(valid, (c_cur[:, None] - c) / np.where(valid, dw, 1.0), np.inf)
            smin = s.min(1)
            # among lines tied at the crossing take the largest w: walks a degenerate face vertex by vertex
            nxt = np.where(s <= smin[:, None] * (1 + 1e-10), w, -np.inf).argmax(1)
            done = np.isinf(smin)
            cur = np.where(done, cur, nxt)
            s_seq.append(smin)
            idx_seq.append(cur)
            c_cur, w_cur = c[ar, cur], w[ar, cur]
        idx = np.stack(idx_seq, 1)  # (R, J+1)
        jn = idx.shape[1] - 1
        pts = vals[(ar % bsz)[:, None], idx]  # (R, J+1, 3)
        p0 = p0 + pts[:, 0, :].reshape(kr, bsz, 3).sum(1)  # (K, 3)
        if jn:
            # event (b, j) of ray r at column b*jn + j. The running max keeps a state's own events in order
            # through the stable sort below: where several lines cross at one point (equal advantages) the
            # computed crossings can decrease by a rounding error, and a reordered event would make the path
            # disagree with the lambda that _rebuild reconstructs (it counts each state's events in order)
            s_flat = np.maximum.accumulate(np.stack(s_seq, 1), axis=1).reshape(kr, bsz * jn)
            delta = (pts[:, 1:, :] - pts[:, :-1, :]).reshape(kr, bsz * jn, 3)
    # generator events (switch-offs) after the envelope events: columns bsz*jn + g
    s_flat = np.concatenate([s_flat, sg], 1)
    delta = np.concatenate([delta, np.broadcast_to(-gvals, (kr,) + gvals.shape)], 1)
    if s_flat.shape[1] == 0:
        return p0[:, 0] - k * p0[:, 1] * p0[:, 2], idx, None, 0, np.zeros(kr, dtype=np.int64), np.zeros(kr)
    order = np.argsort(s_flat, axis=1, kind="stable")  # stable: a state's own events stay in order
    d_flat = delta[np.arange(kr)[:, None], order]  # (K, E, 3)
    path = np.cumsum(d_flat, 1) + p0[:, None, :]
    path = np.concatenate([p0[:, None, :], path], 1)  # (K, E+1, 3): vertices of Z along the ray
    fv = path[..., 0] - k * path[..., 1] * path[..., 2]
    dc, du, dv = d_flat[..., 0], d_flat[..., 1], d_flat[..., 2]
    q = -k * du * dv  # f along an edge: f0 + lin sigma + q sigma^2, concave iff q < 0
    lin = dc - k * (path[:, :-1, 1] * dv + path[:, :-1, 2] * du)
    neg = q < 0
    sig = np.where(neg, np.clip(lin / np.where(neg, -2.0 * q, 1.0), 0.0, 1.0), 0.0)
    # position e < E: best point of edge e (sigma = 0 is its first vertex); position E: the last vertex
    fall = np.concatenate([fv[:, :-1] + lin * sig + q * sig * sig, fv[:, -1:]], 1)
    best_e = fall.argmax(1)
    sig_best = np.concatenate([sig, np.zeros((kr, 1))], 1)[np.arange(kr), best_e]
    return fall[np.arange(kr), best_e], idx, order, jn, best_e, sig_best


def _rebuild(cand, n_gen, idx, order, jn, r, e, sig):
    """lambda of ray r after the first e events of its sorted path, plus a fraction sig of event e.
    cand: (B, M, |A|) candidates of the non-parallelepiped states; returns their lambdas (B, |A|) and the
    weights t (n_gen,) of the generators passed to _sweep."""
    bsz = cand.shape[0]
    rows = r * bsz + np.arange(bsz)
    t = np.ones(n_gen)
    lam = cand[np.arange(bsz), idx[rows, 0]] if bsz else cand[:, 0]
    if order is None:
        return lam, t
    ev = order[r]
    n_poly = bsz * jn
    if bsz:
        n_app = np.bincount(ev[:e][ev[:e] < n_poly] // jn, minlength=bsz) if jn else np.zeros(bsz, dtype=np.int64)
        lam = cand[np.arange(bsz), idx[rows, n_app]]
    t[ev[:e][ev[:e] >= n_poly] - n_poly] = 0.0
    if sig > 0 and e < ev.shape[0]:
        if ev[e] >= n_poly:  # generator ev[e] - n_poly is on its way off
            t[ev[e] - n_poly] = 1.0 - sig
        else:
            b = ev[e] // jn
            nxt = cand[b, idx[rows[b], min(n_app[b] + 1, jn)]]
            lam[b] = (1.0 - sig) * lam[b] + sig * nxt
    return lam, t


def _prune(cand, vals):
    """Drop candidates that are weakly Pareto-dominated (c not larger, u and v not smaller than another
    candidate of the same state; duplicates keep their first copy). Safe: replacing a dominated vertex by
    its dominator in ANY combination raises C and lowers U, V >= 0, hence f. Leaves ~2-8 per state, which
    is what makes the sweep cheap."""
    # candidates with (c, u, v) = 0 (among them enumerate_vertices' zeroed invalid patterns) duplicate
    # lambda = 0 in column 0 and would be dropped below: dropping them first makes the O(M^2) test smaller
    cand, vals = _keep_columns(cand, vals, (vals != 0).any(-1) | (np.arange(vals.shape[1]) == 0))
    c, u, v = vals[..., 0], vals[..., 1], vals[..., 2]
    m = c.shape[1]
    ge = (c[:, None, :] >= c[:, :, None]) & (u[:, None, :] <= u[:, :, None]) & (v[:, None, :] <= v[:, :, None])
    strict = (c[:, None, :] > c[:, :, None]) | (u[:, None, :] < u[:, :, None]) | (v[:, None, :] < v[:, :, None])
    earlier = np.tri(m, m, -1, dtype=bool)[None]  # [i, j]: j < i
    dominated = (ge & (strict | earlier)).any(-1)  # [b, i]: some j dominates i
    return _keep_columns(cand, vals, ~dominated)


def _keep_columns(cand, vals, keep):
    """The candidates where keep (B, M) is True, in their order, as (B, M', .) arrays."""
    mk = int(keep.sum(1).max())
    order = np.argsort(~keep, axis=1, kind="stable")[:, :mk]
    # pad short rows with their first kept candidate (a duplicate: never a new vertex)
    order = np.where(np.take_along_axis(keep, order, 1), order, order[:, :1])
    b = np.arange(cand.shape[0])[:, None]
    return cand[b, order], vals[b, order]


def _ray_angles(thetas):
    """(cos, sin) of ray angles, clipped to the quadrant [0, pi/2]."""
    th = np.minimum(np.maximum(thetas, 0.0), 0.5 * np.pi)
    return np.cos(th), np.sin(th)


_GRID_CACHE: dict = {}


def _grid_rays(n_rays):
    if n_rays not in _GRID_CACHE:
        _GRID_CACHE[n_rays] = _ray_angles(np.linspace(0.0, 0.5 * np.pi, n_rays))
    return _GRID_CACHE[n_rays]


def _solve_generators(gvals, k, wbar, n_rays, refine_rays, best_f, t_best):
    """All states are parallelepipeds (always for |A| <= 3): Z is the sum of the generators' segments
    [0, (c_g, u_g, v_g)] (gvals: (G, 3)) and f = sum t_g c_g - k (sum t_g u_g)(sum t_g v_g), t in [0, 1]^G. Same
    ray method as _sweep, specialised: along a ray (a, b) = s (alpha, beta_) generator g switches from 1 to 0 at
    s = c_g / (alpha u_g + beta_ v_g), so the path adds generators in decreasing order of that ratio (a few
    numpy calls instead of the general sweep). Returns (best_f, t_best), t_best unchanged (the same object)
    if no point of the paths beats best_f."""
    g = gvals.shape[0]
    # a generator with c_g <= 0 is dominated by t_g = 0: only the others take part (smaller arrays; the same
    # paths, as they would all come last)
    pos = np.flatnonzero(gvals[:, 0] > 0)
    if pos.size == 0:
        return best_f, t_best
    cuv = gvals[pos].T  # (3, P); c_g > 0 needs u_g, v_g > 0
    cs, us, vs = gvals.T
    cos_t, sin_t = _grid_rays(n_rays)
    for it in range(2):
        wgt = cos_t[:, None] * cuv[1] + (sin_t / wbar)[:, None] * cuv[2]  # (K, P), > 0 up to underflow
        order = np.argsort(-cuv[0] / np.maximum(wgt, TINY), axis=1, kind="stable")
        dc, du, dv = delta = cuv[:, order]  # (3, K, P): the e-th generator added along each ray's path
        c0, u0, v0 = np.cumsum(delta, 2) - delta  # path vertex before adding it
        q = -k * du * dv  # < 0 unless k = 0 (then sigma = 1: the edge's end)
        lin = dc - k * (u0 * dv + v0 * du)
        sig = np.minimum(np.maximum(lin / np.maximum(-2.0 * q, TINY), 0.0), 1.0)
        fseg = c0 - k * u0 * v0 + lin * sig + q * sig * sig  # best point of edge e (sigma = 1: next vertex)
        r, e = divmod(int(fseg.argmax()), pos.size)
        if fseg[r, e] > best_f:
            t = np.zeros(g)
            t[pos[order[r, :e]]] = 1.0
            t[pos[order[r, e]]] = sig[r, e]
            f = float(t @ cs - k * (t @ us) * (t @ vs))
            if f > best_f:
                best_f, t_best = f, t
        uu, vv = t_best @ us, t_best @ vs
        if it == 1 or (uu <= 0 and vv <= 0) or len(refine_rays) == 0:
            break
        cos_t, sin_t = _ray_angles(math.atan2(uu * wbar, vv) + np.asarray(refine_rays))
    return best_f, t_best


def solve_confidence(d, w, k, n_rays=4, refine_rays=(0.0, -0.03, 0.03, -0.1, 0.1)):
    """Batch confidence lambda-bar* (paper Sec. 5) for d = rho - beta, W (both (B, |A|), float64 numpy).

    Returns lambda (B, |A|), feasible: 0 <= lambda <= 1 exactly and |d_s . lambda_s| ~ 1e-16. See the
    comment block above for the method: one sweep over n_rays ray angles, one refinement sweep around the
    fixed-point angle of the best point found."""
    d = np.asarray(d, dtype=np.float64)
    w = np.minimum(np.maximum(np.asarray(w, dtype=np.float64), -W_CLAMP), W_CLAMP)
    # rounding noise relative to the minibatch's largest move, not absolute: f(lambda; s d, W, k / s) = s f(lambda;
    # d, W, k), so the maximiser does not depend on the scale of d, and with an absolute 1e-12 the solver returned
    # lambda = 0 for a minibatch whose moves were all ~1e-13 (tests/test_brpo.py::test_solver_is_scale_free)
    d = np.where(np.abs(d) > D_ZERO * np.abs(d).max(initial=0.0), d, 0.0)
    c = d * w
    u = np.abs(d)
    v = u * np.abs(w)
    su, sv, sc = u.sum(), v.sum(), c.sum()
    if su == 0.0:
        return np.zeros_like(d)
    # best constant lambda (and lambda = 0): f(t 1) = t sc - k t^2 su sv
    if k * su * sv > 0:
        t_const = min(max(sc / (2.0 * k * su * sv), 0.0), 1.0)
    else:
        t_const = 1.0 if sc > 0 else 0.0
    best_f = t_const * sc - k * t_const * t_const * su * sv
    best_lam = np.full_like(d, t_const)
    wbar = sv / su if sv > 0 else 1.0
    bsz, n = d.shape
    if n == 2:  # lonely_generators' answer without its cost: one generator (1, 1) per state, lambda = (t, t)
        gvals = np.empty((bsz, 3))
        gvals[:, 0], gvals[:, 1], gvals[:, 2] = c.sum(-1), u.sum(-1), v.sum(-1)
        t0 = np.full(bsz, t_const)
        best_f, t = _solve_generators(gvals, k, wbar, n_rays, refine_rays, best_f, t0)
        return best_lam if t is t0 else np.repeat(t[:, None], 2, 1)
    lonely, gvec = lonely_generators(d)
    cuv = np.stack([c, u, v], -1)  # (B, |A|, 3)
    if lonely.all():
        gvals = (gvec @ cuv).reshape(-1, 3)  # (B (|A|-1), 3): (c, u, v) of every generator
        t0 = np.full(gvals.shape[0], t_const)
        best_f, t = _solve_generators(gvals, k, wbar, n_rays, refine_rays, best_f, t0)
        # the clip only removes rounding: sum_i |d_i| / |d_j| is 1 up to ~1e-15, and so is lambda_j at t = 1
        return best_lam if t is t0 else np.clip((t.reshape(bsz, n - 1, 1) * gvec).sum(1), 0.0, 1.0)
    gvec, cuv_g = gvec[lonely].reshape(-1, n), cuv[lonely]
    gvals = (gvec.reshape(-1, n - 1, n) @ cuv_g).reshape(-1, 3)  # (G, 3)
    gpos = np.flatnonzero(gvals[:, 0] > 0)  # the others stay at t_g = 0
    hard = ~lonely  # states whose P_s is not a parallelepiped: vertex enumeration and envelope sweep
    cand = enumerate_vertices(d[hard])
    cand, vals = _prune(cand, cand @ cuv[hard])
    cos_t, sin_t = _grid_rays(n_rays)
    for it in range(2):
        f, idx, order, jn, e, sig = _sweep(vals, gvals[gpos], cos_t, sin_t / wbar, k)
        r = int(f.argmax())
        if f[r] > best_f:
            lam_hard, t_pos = _rebuild(cand, gpos.size, idx, order, jn, r, int(e[r]), float(sig[r]))
            t = np.zeros(gvals.shape[0])
            t[gpos] = t_pos
            lam = np.empty_like(d)
            lam[hard] = lam_hard
            lam[lonely] = np.clip((t.reshape(-1, n - 1, 1) * gvec.reshape(-1, n - 1, n)).sum(1), 0.0, 1.0)
            fl = float((lam * c).sum() - k * (lam * u).sum() * (lam * v).sum())
            if fl > best_f:
                best_f, best_lam = fl, lam
        uu, vv = (best_lam * u).sum(), (best_lam * v).sum()
        if it == 1 or (uu <= 0 and vv <= 0):
            break
        # the optimum lies on the ray through (kV*, kU*): angle atan(wbar U / V) in our scaling
        if len(refine_rays) == 0:
            break
        cos_t, sin_t = _ray_angles(math.atan2(uu * wbar, vv) + np.asarray(refine_rays))
    return best_lam


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


class ConfidenceNetwork(nn.Module):
    """Raw confidence lambda~_phi(s, .) in (0, 1)^|A|: FC(32)-FC(16) (paper's architecture) -> sigmoid.
    The feasible confidence is project_confidence(lambda~, rho - beta): the projection layer needs rho,
    and rho needs a confidence, so rho is built from lambda~ (see policy_probs)."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 like the network: the numpy side converts to float64 (exactly), and the training loss
        # (lambda~ . g) then backpropagates without a float64 copy in the graph (same gradient: g is rounded
        # to float32 either way)
        return torch.sigmoid(self.net(x))


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


def solver_advantage(w, beta, args, unit, sqrt_beta=None):
    """The advantage lambda-bar*'s objective sees (our departure with --pessimism > 0; = W at 0):
    W(s, a) - pessimism * unit * (1 / sqrt(beta(a|s)) - E_{b~beta}[1 / sqrt(beta(b|s))]), the candidate's lower
    confidence bound (see candidate()) in W's units, centred under beta so that it stays an advantage (the
    bound's penalty sees |W|, which a per-state shift would change). Why: with the critic's W, lambda-bar*
    undoes the pessimism where it matters. On CartPole eps = 0.25 rho moves towards beta's usual action at
    almost every state (the pessimism term), lambda-bar* set lambda = 0 wherever the critic claimed the rare
    action better, and pi scored ~5 below beta on 400 start states; constant lambda on the same networks scored
    ~5 above (docs/brpo.md). On uniform data (eps = 1) the correction is 0."""
    # beta = 0: finite, and d = 0 there (rho = beta = 0)
    inv = 1.0 / (sqrt_floored(beta) if sqrt_beta is None else sqrt_beta)
    scale = max(unit, UNIT_MIN) if args.advantage_unit else 1.0
    return w - args.pessimism * scale * (inv - (beta * inv).sum(-1)[:, None])


def policy_probs(obs, beta, q_network, confidence, args, n_updates, unit):
    """pi(.|s), lambda(s, .), rho(.|s) and W(s, .) at arbitrary states (no gradient): the deployed residual policy."""
    with torch.no_grad():
        q = q_network(obs).double()
        w = q - torch.from_numpy(mixed_value(q.numpy(), beta.numpy(), args.mu))[:, None]
        lam_tilde = confidence(obs).double()
        rho, _ = candidate(beta.numpy(), lam_tilde.numpy(), w.numpy(), args, n_updates, unit)
        lam = torch.from_numpy(project_confidence(lam_tilde.numpy(), rho - beta.numpy()))
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
    confidence = ConfidenceNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    load_weights(path, confidence, ckpt.get("confidence", {}))
    return confidence


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
    log_behavior_probs = log_probs(behavior_probs.numpy())  # once, not per update
    sqrt_behavior_probs = sqrt_floored(behavior_probs.numpy())  # the pessimism term's, shared by rho and lambda-bar*
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
    confidence = ConfidenceNetwork(obs_dim, n_actions)
    # one optimiser, one parameter group (own learning rate) per network: the same two Adam updates as two
    # optimisers, with half the per-step Python overhead
    optimizer = torch.optim.Adam([{"params": q_network.parameters(), "lr": args.learning_rate},
                                  {"params": confidence.parameters(), "lr": args.confidence_learning_rate}], fused=True)
    # k of f = C - k U V (solver form of the SAA bound), fixed by |B|, gamma, mu
    k_penalty = penalty_weight(args.batch_size, args.gamma, args.mu, args.penalty_one_minus_mu) * args.penalty_scale
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
        # weighted advantage W = Q - V with the same mu (appendix), from the critic before its step, in float64
        beta_np = beta.numpy()
        w_np = q_np - mixed_value(q_np, beta_np, args.mu, q_max)[:, None]

        # --- confidence (Algorithm 1, lines 3-5) ---
        lam_tilde = confidence(s)  # float32, in the graph
        lam_np = lam_tilde.detach().numpy().astype(np.float64)
        sqrt_beta = sqrt_behavior_probs[idx_np]
        rho_np, temp = candidate(beta_np, lam_np, w_np, args, step - 1, unit,
                                log_behavior_probs[idx_np], sqrt_beta)  # eq. relative_soft
        d = rho_np - beta_np
        # lambda-bar* judges rho's move by the same lower confidence bound on the advantage that built rho
        lam_star = solve_confidence(d, solver_advantage(w_np, beta_np, args, unit, sqrt_beta), k_penalty)  # lambda-bar*
        target_pi = beta_np + lam_star * d  # lambda-bar* is feasible: a distribution up to rounding
        # KL fit of pi_phi = beta + Phi(lambda~; rho - beta)(rho - beta) to the target (eq. optimize_lambda and
        # "Learning the Confidence"): value and d/d lambda~ (confidence_fit); (lambda~ . g) then carries exactly
        # that gradient into the network
        confidence_loss, grad = confidence_fit(lam_np, d, beta_np, rho_np, target_pi)

        optimizer.zero_grad()
        # disjoint parameters: one backward pass from both output gradients
        torch.autograd.backward((q_all, lam_tilde), (torch.from_numpy(q_grad), torch.from_numpy(grad).float()))
        optimizer.step()

        if step % args.target_update_frequency == 0:
            with torch.no_grad():
                for p, tp in zip(q_network.parameters(), target_network.parameters()):
                    tp.lerp_(p, args.tau)

        if writer and step % 100 == 0:
            writer.add_scalar("losses/td_loss", float(np.square(td_error, dtype=np.float64).mean()), step)
            writer.add_scalar("losses/q_values", float(q32[np.arange(len(idx_np)), actions_np[idx_np]].mean()), step)
            writer.add_scalar("confidence/advantage_unit", unit, step)
            writer.add_scalar("losses/confidence_loss", confidence_loss, step)
            writer.add_scalar("confidence/mean_lambda_star", float(lam_star.mean()), step)
            writer.add_scalar("confidence/mean_temperature", float(temp.mean()), step)
            star = lower_bound_terms(beta, torch.from_numpy(rho_np), torch.from_numpy(lam_star), torch.from_numpy(w_np),
                                     args.gamma, args.mu, args.penalty_one_minus_mu)[0]
            writer.add_scalar("losses/lower_bound_star", star, step)
            for key, value in policy_stats(s, beta, q_network, confidence, args, step, unit).items():
                writer.add_scalar(f"confidence/{key}" if "lambda" in key else f"losses/{key}", value, step)

        if step % args.eval_frequency == 0 or step == args.total_steps:
            now = time.perf_counter()
            train_time += now - block_start
            check_finite(step, q_network, confidence)
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
            "args": asdict(args), "q_network": q_network.state_dict(), "confidence": confidence.state_dict(),
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
