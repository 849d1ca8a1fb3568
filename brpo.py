"""BRPO: Batch Residual Policy Optimization (Sohn et al., IJCAI 2020), single file.

The learned policy is the residual policy (paper Sec. 2)
    pi(a|s) = (1 - lambda(s,a)) beta(a|s) + lambda(s,a) rho(a|s),
with beta the behaviour policy of the batch (known or estimated), rho a candidate policy and lambda in [0,1] a state-action
confidence constrained to sum_a lambda(s,a) (rho - beta)(a|s) = 0, so that pi is a distribution at every state.
One gradient update (paper Algorithm 1, coordinate ascent):
  1. sample a minibatch (s, a, r, s') of the batch;
  2. rho <- relative softmax of beta with the current confidence (eq. relative_soft);
  3. lambda-bar* <- the exact argmax of the minibatch's SAA lower bound (Sec. 5, "The Closed-form Confidence");
  4. one Adam step of the confidence network on the KL loss towards (1 - lambda-bar*) beta + lambda-bar* rho
     ("Learning the Confidence"), through an exact projection layer (eq. optimize_lambda);
  5. one critic step towards r + gamma V(s'), V = (1-mu) E_beta Q' + mu max Q' (Algorithm 1, line 6);
  6. soft target update.
At each evaluation the improvement certificate (and an evaluation critic of pi, opt-in) chooses what is deployed.
The critic supplies the weighted advantage W = Q - V (appendix "Practical Implementation Details"). The
departures from the paper are marked "Departure N" below and explained in docs/brpo.md, one numbered item each.

    python brpo.py --env-id Acrobot-v1 --epsilon 0.15
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

import common


# --sweep may vary these (and --learning-rate, --gamma, --tau, --target-update-frequency) between members
MEMBER_FLAGS = ("confidence_learning_rate", "mu", "kappa_max", "kappa_decay", "kappa_scale", "pessimism",
                "penalty_scale", "cql_alpha")


@dataclass
class Args(common.DeployArgs):  # DeployArgs: --deploy-pessimism and the certificate's flags
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    eval_greedy: bool = False
    """evaluate argmax_a pi(a|s) instead of sampling a ~ pi(.|s) (the guarantee is about the stochastic pi)"""
    mu: float = 0.9
    """critic mixing (Algorithm 1): V = (1-mu) E_beta Q + mu max Q, for the TD target and for W = Q - V"""
    confidence_learning_rate: float = 1e-4
    """Adam learning rate of the confidence network (paper: 1e-4)"""
    kappa_max: float = 0.02
    """cap of the temperature's kappa (paper, end of Sec. 5); <= 1: a constant temperature (departure 4)"""
    kappa_decay: float = 1.0
    """temperature decay kappa <- kappa * kappa_decay**n after n updates (paper, end of Sec. 5)"""
    kappa_scale: float = 1.0
    """constant factor on kappa (ours, departure 4): with --kappa-max inf, the paper's kappa(s) at a usable scale"""
    pessimism: float = 0.0
    """lower W(s,a) by pessimism / sqrt(beta(a|s)) advantage units in rho and lambda-bar* while training (departures
    6, 7; 0: the paper's, the default, and then level 1 is the deployment's fallback, departure 11)"""
    cql_alpha: float = 0.0
    """weight of CQL(H)'s term logsumexp_a Q(s, a) - Q(s, a_data) in the critic's loss (departure 13; 0: the paper)"""
    advantage_unit: bool = True
    """measure W in units of the critic's mean action gap in the relative softmax (departure 5; off: raw W)"""
    penalty_one_minus_mu: bool = True
    """scale the bound's penalty by (1 - mu) like the appendix's mu-weighted bound (departure 9; off: main text)"""
    penalty_scale: float = 0.1
    """multiplies the penalty of the objective lambda-bar* maximises (departure 8; 1: the paper's SAA bound)"""


def check_args(args: Args) -> None:
    common.check_args(args, allow_inf=("kappa_max",))  # inf: the paper's kappa(s), uncapped
    require = common.require
    require(0.0 <= args.mu <= 1.0, f"--mu must lie in [0, 1], got {args.mu}")
    require(args.confidence_learning_rate > 0, f"--confidence-learning-rate must be positive, got {args.confidence_learning_rate}")
    require(0 <= args.penalty_scale <= 1e3, f"--penalty-scale must lie in [0, 1000] (1: the paper's), got {args.penalty_scale}")
    require(args.kappa_max > 0, f"--kappa-max must be positive, got {args.kappa_max}")
    require(0.0 < args.kappa_scale < math.inf, f"--kappa-scale must be positive and finite, got {args.kappa_scale}")
    require(0.0 < args.kappa_decay <= 1.0, f"--kappa-decay must lie in (0, 1], got {args.kappa_decay}")
    # in advantage units: 1e3 already pins rho to beta's most frequent action
    require(0.0 <= args.pessimism <= 1e3, f"--pessimism must lie in [0, 1000], got {args.pessimism}")
    require(0.0 <= args.cql_alpha < math.inf, f"--cql-alpha must be a finite number >= 0, got {args.cql_alpha}")


# ---- Networks: FC(32)-FC(16), the architecture of every network in the paper
class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConfidenceNetwork(QNetwork):
    """Raw confidence lambda~(s, .) in (0, 1)^|A|; feasible: project_confidence(lambda~, rho - beta), with rho built
    from lambda~ (departure 3: the projection needs rho, and rho needs a confidence)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(x))  # float32; the numpy side converts to float64 exactly


def load_confidence(ckpt: dict, args: Args, path: str = "") -> common.Stack:
    confidence = ConfidenceNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    common.load_weights(path, confidence, ckpt.get("confidence", {}))
    return common.Stack([confidence.net], output=torch.sigmoid)


# ---- Candidate policy rho (paper Sec. 5, eq. relative_soft), float64 numpy
LOG_CLAMP = 1e-12  # floor inside logs of probabilities: exact zeros (eps=0) must give 0*log0 = 0, not NaN
W_CLAMP = 1e100  # |W| cap before squaring in kappa: W^2 must stay finite in float64
TEMP_MIN = 1e-200  # smallest temperature: with |W| <= W_CLAMP, lambda W / temp stays finite
UNIT_RATE = 0.01  # running-average rate of the advantage unit (about the last 100 updates)
UNIT_MIN = 1e-8  # floor of the advantage unit: a constant critic (all gaps 0) must not divide by 0
BETA_MIN = 1e-12  # floor of beta in the pessimism term (beta = 0 actions get rho = 0 from log beta anyway)
D_ZERO = 1e-12  # |rho - beta| below this is rounding noise of two distributions that agree
SNAP = 1e-12  # solver: a vertex coordinate within SNAP of 0 is rounding noise
TINY = 1e-300  # floor of denominators that are positive up to underflow
PROJECT_BLOCK = 16384  # states per block of project_confidence


def log_probs(p: np.ndarray) -> np.ndarray:
    """log p with log 0 = -inf: actions outside beta's support drop out of every expectation and softmax."""
    pos = p > 0
    return np.where(pos, np.log(np.where(pos, p, 1.0)), -np.inf)


def temperature(beta, lam, w, gamma, kappa_scale, kappa_max, kappa_decay, n_updates, log_beta=None):
    """tau(s) = gamma max{kappa_lambda(s), kappa_{|W| lambda}(s)} / (2 - 2 gamma) (eq. relative_soft), kappa_g(s) = 1 +
    log E_beta exp(g^2), kappa <- kappa_scale min(kappa_max, kappa) kappa_decay**n. Departure 4: kappa >= 1 keeps rho
    within ~1% of beta at gamma = 0.99; our default cap 0.02 < 1 binds everywhere, a constant temperature.
    beta, lam, w: [M, B, |A|]; the flags: [M, 1] (one row per member); returns [M, B]."""
    capped = np.asarray(kappa_max) <= 1.0  # both kappas are >= 1: the cap binds at every state
    if capped.all():
        kap = np.broadcast_to(kappa_max, beta.shape[:-1])
    else:
        lb = log_probs(beta) if log_beta is None else log_beta
        lam2 = np.square(lam)
        x = lb + np.stack([lam2, lam2 * np.square(np.minimum(np.abs(w), W_CLAMP))])
        m = x.max(-1, keepdims=True)  # finite: beta has at least one positive entry per state
        both = 1.0 + (m[..., 0] + np.log(np.exp(x - m).sum(-1)))  # 1 + logsumexp: no overflow for large |g|
        kap = np.where(capped, kappa_max, np.minimum(np.maximum(both[0], both[1]), kappa_max))
    return np.maximum(gamma * kap * (kappa_scale * kappa_decay**n_updates) / (2.0 - 2.0 * gamma), TEMP_MIN)


def candidate_policy(beta, lam, w, temp, log_beta=None):
    """rho(a|s) ∝ beta(a|s) exp(lambda W / temp) (eq. relative_soft), as a softmax of log beta + lambda W / temp:
    beta = 0 gives rho = 0 exactly, huge advantages a one-hot rho, never inf/NaN. No gradient flows through rho."""
    w = np.clip(w, -W_CLAMP, W_CLAMP)
    logits = (log_probs(beta) if log_beta is None else log_beta) + lam * w / temp[..., None]
    e = np.exp(logits - common.row_max(logits, True))
    return e / common.row_sum(e, True)


def advantage_unit(q: torch.Tensor, q_max: torch.Tensor | None = None) -> torch.Tensor:
    """Departure 5: the mean action gap max_a Q - min_a Q over a batch [M, B, |A|], per member: the relative softmax's
    unit of W, so that one temperature means the same on every task (the paper's lambda W carries reward units)."""
    return ((q.amax(-1) if q_max is None else q_max) - q.amin(-1)).mean(-1)


def sqrt_floored(beta: np.ndarray) -> np.ndarray:
    return np.sqrt(np.maximum(beta, BETA_MIN))


def candidate(beta, lam_tilde, w, p, pessimism, n_updates, unit, log_beta=None, sqrt_beta=None):
    """rho and its temperature from the current raw confidence (coordinate ascent, Sec. 5), W in advantage units
    (departure 5). Departure 6: W lowered by pessimism / sqrt(beta(a|s)) units, a lower confidence bound on the
    advantage (the critic's error at (s, a) shrinks like 1 / sqrt(n(s, a)), n(s, a) proportional to beta(a|s)): rho
    follows the critic to an action only as far as the batch has seen it there. p: the members' flags
    (common.columns), pessimism [M, 1], unit [M]."""
    log_beta = log_probs(beta) if log_beta is None else log_beta
    w = np.where(p.advantage_unit[..., None], w / np.maximum(unit, UNIT_MIN)[:, None, None], w)
    w = w - pessimism[..., None] / (sqrt_floored(beta) if sqrt_beta is None else sqrt_beta)
    temp = temperature(beta, lam_tilde, w, p.gamma, p.kappa_scale, p.kappa_max, p.kappa_decay, n_updates, log_beta)
    return candidate_policy(beta, lam_tilde, w, temp, log_beta), temp


def residual_policy(beta, rho, lam):
    """pi = (1 - lambda) beta + lambda rho (Sec. 2); the clamp and renormalisation only remove rounding."""
    pi = np.maximum(beta + lam * (rho - beta), 0.0)
    return pi / common.row_sum(pi, True)


# ---- Batch confidence lambda-bar* = argmax_{lambda in Lambda-bar} f(lambda) (Sec. 5, "The Closed-form Confidence")
def solver_advantage(w, beta, p, unit, sqrt_beta=None):
    """Departure 7: lambda-bar*'s objective sees rho's lower confidence bound on W, centred under beta (= W at
    pessimism 0); with the raw W, lambda-bar* undoes the pessimism exactly where the critic is wrong."""
    inv = 1.0 / (sqrt_floored(beta) if sqrt_beta is None else sqrt_beta)
    scale = np.where(p.advantage_unit, np.maximum(unit, UNIT_MIN)[:, None], 1.0)
    return w - (p.pessimism * scale)[..., None] * (inv - common.row_sum(beta * inv, True))


def penalty_weight(batch_size, gamma, mu, scale_penalty_by_mu=True):
    """k of f = C - k U V: the SAA bound L1 - L2 L3 times |B| (1 - gamma), only lambda-bar*'s objective (departure 10)."""
    pen = np.where(scale_penalty_by_mu, 1.0 - mu, 1.0)
    return gamma * pen / (batch_size * (1.0 - gamma))


# Departure 1, an exact solver (the geometry: docs/brpo.md). Maximise f(lambda) = C - k U V with C = <d W, lambda>,
# U = <|d|, lambda>, V = <|d||W|, lambda>, d = rho - beta, over 0 <= lambda <= 1, d_s . lambda_s = 0 (the paper's
# Theta has rank <= 2 and is indefinite: its closed form does not apply). f sees lambda only through (C, U, V), a
# Minkowski sum Z of per-state polytopes, and peaks on an edge or vertex of Z. An optimum maximises the linear
# (c - a u - b v) . lambda at (a, b) = (kV*, kU*): along rays (a, b) = s (alpha, beta_) a kinetic sweep of each
# state's upper envelope traces vertices and edges of Z, f's exact maximum taken on each edge; 4 rays, then 5 around
# the best point's angle. Parallelepiped states (always for |A| <= 3) switch generators off along a ray.
_PATTERN_CACHE: dict = {}


def _patterns(n):
    if n not in _PATTERN_CACHE:
        js, xs = [], []
        for j in range(n):  # others all 0 (lambda = 0) and all 1 (lambda = 1) are added once, in enumerate_vertices
            for bits in range(1, 2 ** (n - 1) - 1):
                x = np.zeros(n)
                for t, i in enumerate(i for i in range(n) if i != j):
                    x[i] = (bits >> t) & 1
                js.append(j)
                xs.append(x)
        js = np.array(js, dtype=np.int64)
        _PATTERN_CACHE[n] = (js, np.array(xs).reshape(-1, n), np.eye(n)[js])
    return _PATTERN_CACHE[n]


def enumerate_vertices(d):
    """Vertices of P_s = [0,1]^|A| ∩ {d.lambda = 0} (at most one fractional coordinate j, lambda_j = -d_{-j}.x / d_j)
    for every state: (B, M, n); invalid candidates are the zero vector."""
    bsz, n = d.shape
    js, x, onehot = _patterns(n)
    num = (d[:, None, :] * x[None]).sum(-1)  # not d @ x.T: BLAS rounds one row (gemv) unlike many, and members batch rows
    dj = d[:, js]
    ok = dj != 0
    lamj = -num / np.where(ok, dj, 1.0)
    ok &= (lamj >= -1e-9) & (lamj <= 1.0 + 1e-9)
    # snap float noise so duplicates are exact; near 0 far tighter (SNAP): a tiny lambda_j can be a vertex's whole gain
    lamj = np.where(np.abs(lamj) < SNAP, 0.0, np.where(np.abs(lamj - 1.0) < 1e-9, 1.0, np.clip(lamj, 0.0, 1.0)))
    cand = x[None, :, :] + onehot[None, :, :] * lamj[:, :, None]
    ends = np.broadcast_to(np.stack([np.zeros(n), np.ones(n)]), (bsz, 2, n))
    return np.concatenate([ends, cand * ok[:, :, None]], 1)


def lonely_generators(d):
    """Where j = argmax |d_s| has the opposite sign of every other nonzero d_i (lonely), P_s is the parallelepiped
    {sum_i t_i g[s, i], t in [0, 1]^(|A|-1)}, g[s, i] = e_i + (|d_i| / |d_j|) e_j. Returns lonely (B,), g (B, |A|-1, |A|)."""
    bsz, n = d.shape
    rows = np.arange(bsz)[:, None]
    j = np.abs(d).argmax(1)
    others = (j[:, None] + np.arange(1, n)) % n
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


def _sweep(vals, gvals, gok, alpha, beta_, k):
    """The path of each member's rays (a, b) = s (alpha_r, beta_r): vals [M, B, V, 3] = (c, u, v) of the other states'
    vertices, gvals [M, G, 3] of the generators with c_g > 0 (gok: not padding), rays alpha, beta_ [M, R], k [M].
    Members are padded to one shape with zero states, repeated vertices and zero generators: padding adds only moves
    of zero at s = inf after each member's own events, so each member's result is the one it gets alone (test_solver_over_members_is_each_members_solver).
    Returns each ray's best f [M, R] and what _rebuild needs."""
    mm, bsz, m, _ = vals.shape
    kr = alpha.shape[1]
    nr = mm * kr * bsz
    ar = np.arange(nr)
    kk = k[:, None, None]
    wg = alpha[:, :, None] * gvals[:, None, :, 1] + beta_[:, :, None] * gvals[:, None, :, 2]
    with np.errstate(divide="ignore", invalid="ignore"):  # a generator switches off at s = c_g / w_g
        sg = np.where(gok[:, None, :], gvals[:, None, :, 0] / wg, np.inf)
    p0 = np.broadcast_to(gvals.sum(1)[:, None, :], (mm, kr, 3))
    s_flat, delta = np.zeros((mm, kr, 0)), np.zeros((mm, kr, 0, 3))  # no envelope events (jn = 0)
    c = np.broadcast_to(vals[:, None, :, :, 0], (mm, kr, bsz, m)).reshape(nr, m)
    w = (alpha[:, :, None, None] * vals[:, None, :, :, 1] + beta_[:, :, None, None] * vals[:, None, :, :, 2]).reshape(nr, m)
    cmax = c.max(1, keepdims=True)  # s = 0: the LP maximiser of c; ties -> smallest w (survives for s > 0)
    cur = np.where(c >= cmax - 1e-12 * np.abs(cmax), w, np.inf).argmin(1)
    idx_seq, s_seq = [cur], []
    c_cur, w_cur = c[ar, cur], w[ar, cur]
    tol_w = (1e-12 * w.max(1))[:, None]
    for _ in range(m - 1 if k.all() else 0):  # kinetic sweep of each state's upper envelope of lines c_m - s w_m
        dw = w_cur[:, None] - w
        valid = dw > tol_w
        if not valid.any():
            break
        s = np.where(valid, (c_cur[:, None] - c) / np.where(valid, dw, 1.0), np.inf)
        smin = s.min(1)
        # among lines tied at the crossing take the largest w: walks a degenerate face vertex by vertex
        nxt = np.where(s <= smin[:, None] * (1 + 1e-10), w, -np.inf).argmax(1)
        cur = np.where(np.isinf(smin), cur, nxt)
        s_seq.append(smin)
        idx_seq.append(cur)
        c_cur, w_cur = c[ar, cur], w[ar, cur]
    idx = np.stack(idx_seq, 1)
    jn = idx.shape[1] - 1
    pts = _take_rows(vals, ((ar // (kr * bsz) * bsz + ar % bsz) * m)[:, None] + idx)  # vals[member, state, idx]
    p0 = p0 + pts[:, 0, :].reshape(mm, kr, bsz, 3).sum(2)
    if jn:
        # the running max keeps each state's own events in order through the stable sort (rounding can make
        # tied crossings decrease), as _rebuild counts them in order
        s_flat = np.maximum.accumulate(np.stack(s_seq, 1), axis=1).reshape(mm, kr, bsz * jn)
        delta = (pts[:, 1:, :] - pts[:, :-1, :]).reshape(mm, kr, bsz * jn, 3)
    s_flat = np.concatenate([s_flat, sg], 2)  # generator switch-offs after the envelope events
    delta = np.concatenate([delta, np.broadcast_to(-gvals[:, None], (mm, kr) + gvals.shape[1:])], 2)
    order = np.argsort(s_flat, axis=2, kind="stable")
    im, ir = np.arange(mm)[:, None], np.arange(kr)[None]
    d_flat = _take_rows(delta, order + order.shape[2] * np.arange(mm * kr).reshape(mm, kr, 1))  # delta[im, ir, order]
    path = np.concatenate([p0[:, :, None, :], np.cumsum(d_flat, 2) + p0[:, :, None, :]], 2)  # vertices of Z on the ray
    fv = path[..., 0] - kk * path[..., 1] * path[..., 2]
    dc, du, dv = d_flat[..., 0], d_flat[..., 1], d_flat[..., 2]
    q = -kk * du * dv  # f along an edge: f0 + lin sigma + q sigma^2
    lin = dc - kk * (path[:, :, :-1, 1] * dv + path[:, :, :-1, 2] * du)
    neg = q < 0
    sig = np.where(neg, np.clip(lin / np.where(neg, -2.0 * q, 1.0), 0.0, 1.0), 0.0)
    fall = np.concatenate([fv[..., :-1] + lin * sig + q * sig * sig, fv[..., -1:]], 2)  # each edge's best, last vertex
    best_e = fall.argmax(2)
    sig_best = np.concatenate([sig, np.zeros((mm, kr, 1))], 2)[im, ir, best_e]
    return fall[im, ir, best_e], idx, order, jn, best_e, sig_best


def _take_rows(x, rows):  # x[..., 3] at flat row numbers over its leading axes: np.take, several times a fancy index
    return np.take(x.reshape(-1, x.shape[-1]), rows, 0)


def _rebuild(cand, n_gen, idx, ev, jn, e, sig):
    """lambda of one ray after the first e events of its path ev plus a fraction sig of event e: the lambdas (B, |A|) of
    the non-parallelepiped states (idx (B, jn + 1): their vertices along the ray), the generators' weights t (n_gen,)."""
    bsz = cand.shape[0]
    t = np.ones(n_gen)
    n_poly = bsz * jn
    n_app = np.bincount(ev[:e][ev[:e] < n_poly] // jn, minlength=bsz) if jn else np.zeros(bsz, dtype=np.int64)
    lam = cand[np.arange(bsz), idx[np.arange(bsz), n_app]]
    t[ev[:e][ev[:e] >= n_poly] - n_poly] = 0.0
    if sig > 0 and e < ev.shape[0]:
        if ev[e] >= n_poly:
            t[ev[e] - n_poly] = 1.0 - sig
        else:
            b = ev[e] // jn
            nxt = cand[b, idx[b, min(n_app[b] + 1, jn)]]
            lam[b] = (1.0 - sig) * lam[b] + sig * nxt
    return lam, t


def _prune(cand, vals):
    """Drop weakly Pareto-dominated vertices (c not larger, u and v not smaller; the first of duplicates stays)."""
    cand, vals = _keep_columns(cand, vals, (vals != 0).any(-1) | (np.arange(vals.shape[1]) == 0))
    c, u, v = vals[..., 0], vals[..., 1], vals[..., 2]
    ge = (c[:, None, :] >= c[:, :, None]) & (u[:, None, :] <= u[:, :, None]) & (v[:, None, :] <= v[:, :, None])
    strict = (c[:, None, :] > c[:, :, None]) | (u[:, None, :] < u[:, :, None]) | (v[:, None, :] < v[:, :, None])
    earlier = np.tri(c.shape[1], c.shape[1], -1, dtype=bool)[None]
    return _keep_columns(cand, vals, ~(ge & (strict | earlier)).any(-1))


def _keep_columns(cand, vals, keep):
    mk = int(keep.sum(1).max())
    order = np.argsort(~keep, axis=1, kind="stable")[:, :mk]
    order = np.where(np.take_along_axis(keep, order, 1), order, order[:, :1])  # pad with a duplicate
    b = np.arange(cand.shape[0])[:, None]
    return cand[b, order], vals[b, order]


def _ray_angles(thetas):
    th = np.minimum(np.maximum(thetas, 0.0), 0.5 * np.pi)
    return np.cos(th), np.sin(th)


_GRID_RAYS = _ray_angles(np.linspace(0.0, 0.5 * np.pi, 4))  # 4 rays, computed once
MIXED_CHUNK = 6  # members per _solve_mixed call, sorted by their number of hard states (padding vs per-call overhead)


def solve_confidence(d, w, k):
    """lambda-bar* (B, |A|) for d = rho - beta and the advantage w: 0 <= lambda <= 1 exactly, |d_s . lambda_s| ~ 1e-16,
    never worse than lambda = 0 or the best constant lambda (both feasible as sum_a d_a = 0)."""
    return solve_confidence_members(d[None], w[None], np.array([k], dtype=np.float64))[0]


def _front(rows, counts):
    """rows of several members (member after member, counts [M] each) as [M, max count, ...], zero-padded, and the mask."""
    mask = np.arange(max(int(counts.max()), 1))[None] < counts[:, None]
    out = np.zeros(mask.shape + rows.shape[1:])
    out[mask] = rows
    return out, mask


def _solve_mixed(d, c, u, v, k, wbar, best_f, best_lam, lonely, gvec, refine_rays=(0.0, -0.03, 0.03, -0.1, 0.1)):
    """Members whose states are not all parallelepipeds ([M, B, |A|], k != 0 for all or for none): vertex enumeration
    and envelope sweep of the other states, the members at once (_sweep's padding)."""
    mm, bsz, n = d.shape
    cuv = np.stack([c, u, v], -1)
    gfull = np.zeros((mm, bsz, n - 1, 3))
    gfull[lonely] = gvec[lonely] @ cuv[lonely]
    gfull = gfull.reshape(mm, -1, 3)
    gpos = gfull[..., 0] > 0
    gvals, gok = _front(gfull[gpos], gpos.sum(1))  # each member's generators with c_g > 0 (at least one column)
    hard = ~lonely  # vertex enumeration and envelope sweep
    cand_h = enumerate_vertices(d[hard])
    cand_h, vals_h = _prune(cand_h, cand_h @ cuv[hard])
    (cand, real), (vals, _) = _front(cand_h, hard.sum(1)), _front(vals_h, hard.sum(1))
    grid = _GRID_RAYS if k.all() else (_GRID_RAYS[0][:1], _GRID_RAYS[1][:1])  # k = 0: the rays' common start
    cos_t, sin_t = (np.broadcast_to(a, (mm, len(a))) for a in grid)
    going = np.ones(mm, bool)
    for it in range(2):
        sub = np.flatnonzero(going)
        f, idx, order, jn, e, sig = _sweep(vals[sub], gvals[sub], gok[sub], cos_t[sub], sin_t[sub] / wbar[sub, None], k[sub])
        for si, i in enumerate(sub):
            r = int(f[si].argmax())
            if f[si, r] > best_f[i]:
                rows = (si * f.shape[1] + r) * real.shape[1] + np.arange(real.shape[1])
                lam_hard, t_pos = _rebuild(cand[i], gok.shape[1], idx[rows], order[si, r],
                                           jn, int(e[si, r]), float(sig[si, r]))
                t = np.zeros(gfull.shape[1])
                t[gpos[i]] = t_pos[gok[i]]
                lam = np.empty_like(d[i])
                lam[hard[i]] = lam_hard[real[i]]
                lam[lonely[i]] = np.clip((t.reshape(bsz, n - 1, 1)[lonely[i]] * gvec[i][lonely[i]]).sum(1), 0.0, 1.0)
                fl = float((lam * c[i]).sum() - k[i] * (lam * u[i]).sum() * (lam * v[i]).sum())
                if fl > best_f[i]:
                    best_f[i], best_lam[i] = fl, lam
        if it == 1 or not k.all():  # k = 0: f = C, each state at its LP maximiser is optimal
            break
        uu, vv = (best_lam * u).sum((1, 2)), (best_lam * v).sum((1, 2))
        if not (going := ~((uu <= 0) & (vv <= 0))).any():
            break
        # the ray through (kV*, kU*) of each member
        ray = np.array([math.atan2(a, b) for a, b in zip(uu * wbar, vv)])  # not np.arctan2: it rounds differently
        cos_t, sin_t = _ray_angles(ray[:, None] + np.asarray(refine_rays))
    return best_lam


def _solve_generators(gvals, k, wbar, best_f, t_best, refine_rays=(0.0, -0.03, 0.03, -0.1, 0.1)):
    """All states parallelepipeds, every member at once (gvals [M, G, 3], k, wbar, best_f [M], t_best [M, G]):
    f = sum t c - k (sum t u)(sum t v), t in [0, 1]^G; a ray's path adds generators by decreasing
    c_g / (alpha u_g + beta_ v_g) (generators with c_g <= 0 sort last with t_g = 0 and move nothing). Returns best_f,
    t_best and whether a member's t_best was improved."""
    m, g = gvals.shape[:2]
    rows = np.arange(m)
    pos = gvals[..., 0] > 0
    cuv = np.where(pos[..., None], gvals, 0.0)
    cs, us, vs = np.moveaxis(gvals, -1, 0)
    kk = k[:, None, None]
    cos_t, sin_t = np.broadcast_to(_GRID_RAYS[0], (m, 4)), np.broadcast_to(_GRID_RAYS[1], (m, 4))
    improved, going = np.zeros(m, bool), pos.any(1)  # no generator with c_g > 0: t = 0 is optimal
    for it in range(2):
        wgt = cos_t[..., None] * cuv[:, None, :, 1] + (sin_t / wbar[:, None])[..., None] * cuv[:, None, :, 2]
        key = np.where(pos[:, None, :], -cuv[:, None, :, 0] / np.maximum(wgt, TINY), np.inf)
        order = np.argsort(key, axis=2, kind="stable")  # [M, rays, G]
        delta = _take_rows(cuv, order + g * rows[:, None, None])  # cuv[rows, order]: [M, rays, G, 3]
        dc, du, dv = np.moveaxis(delta, -1, 0)
        c0, u0, v0 = np.moveaxis(np.cumsum(delta, 2) - delta, -1, 0)
        q = -kk * du * dv
        lin = dc - kk * (u0 * dv + v0 * du)
        sig = np.minimum(np.maximum(lin / np.maximum(-2.0 * q, TINY), 0.0), 1.0)
        fseg = (c0 - kk * u0 * v0 + lin * sig + q * sig * sig).reshape(m, -1)
        best = fseg.argmax(1)
        r, e = np.divmod(best, g)
        better = going & (fseg[rows, best] > best_f)
        rank = np.empty((m, g), dtype=np.int64)  # each generator's place on the best ray: the inverse permutation
        rank[rows[:, None], order[rows, r]] = np.arange(g)
        t = np.where(rank < e[:, None], 1.0, np.where(rank == e[:, None], sig[rows, r, e][:, None], 0.0)) * pos
        f = (t * cs).sum(1) - k * (t * us).sum(1) * (t * vs).sum(1)
        better &= f > best_f
        best_f, t_best, improved = np.where(better, f, best_f), np.where(better[:, None], t, t_best), improved | better
        uu, vv = (t_best * us).sum(1), (t_best * vs).sum(1)
        going &= ~((uu <= 0) & (vv <= 0)) & (len(refine_rays) > 0)
        if it == 1 or not going.any():
            break
        cos_t, sin_t = _ray_angles(np.arctan2(uu * wbar, vv)[:, None] + np.asarray(refine_rays))
    return best_f, t_best, improved


def solve_confidence_members(d, w, k):
    """lambda-bar* of every member: d, w [M, B, |A|], k [M]. Members whose states are all parallelepipeds (always
    for |A| <= 3) are solved together; the others by the sweep (_solve_mixed), MIXED_CHUNK at a time."""
    m, bsz, n = d.shape
    d = np.asarray(d, dtype=np.float64)
    w = np.minimum(np.maximum(np.asarray(w, dtype=np.float64), -W_CLAMP), W_CLAMP)
    scale = np.abs(d).max((1, 2), initial=0.0)[:, None, None]
    d = np.where(np.abs(d) > D_ZERO * scale, d, 0.0)  # noise relative to each member's largest move
    c, u = d * w, np.abs(d)
    v = u * np.abs(w)
    su, sv, sc = u.sum((1, 2)), v.sum((1, 2)), c.sum((1, 2))
    with np.errstate(divide="ignore", invalid="ignore"):  # best constant lambda: f(t 1) = t sc - k t^2 su sv
        t_const = np.where(k * su * sv > 0, np.clip(sc / (2.0 * k * su * sv), 0.0, 1.0), np.where(sc > 0, 1.0, 0.0))
    best_f = t_const * sc - k * t_const * t_const * su * sv
    lam = np.broadcast_to(t_const[:, None, None], d.shape).copy()
    wbar = np.where(sv > 0, sv / np.where(su > 0, su, 1.0), 1.0)
    if n == 2:  # one generator (1, 1) per state: lambda = (t, t)
        gvals = np.stack([c.sum(-1), u.sum(-1), v.sum(-1)], -1)
        _, t, improved = _solve_generators(gvals, k, wbar, best_f, np.repeat(t_const[:, None], bsz, 1))
        lam = np.where(improved[:, None, None], t[..., None], lam)
    else:
        lonely, gvec = lonely_generators(d.reshape(-1, n))
        lonely, gvec = lonely.reshape(m, bsz), gvec.reshape(m, bsz, n - 1, n)
        together = lonely.all(1)
        if together.any():
            sub = np.flatnonzero(together)
            gvals = (gvec[sub] @ np.stack([c[sub], u[sub], v[sub]], -1)).reshape(len(sub), -1, 3)
            _, t, improved = _solve_generators(gvals, k[sub], wbar[sub], best_f[sub],
                                                       np.repeat(t_const[sub, None], gvals.shape[1], 1))
            mixed = np.clip((t.reshape(len(sub), bsz, n - 1, 1) * gvec[sub]).sum(2), 0.0, 1.0)
            lam[sub] = np.where(improved[:, None, None], mixed, lam[sub])
        for pick in (~together & (su > 0) & (k != 0), ~together & (su > 0) & (k == 0)):
            by_size = np.flatnonzero(pick)[np.argsort((~lonely[pick]).sum(1), kind="stable")]  # little padding
            for sub in np.array_split(by_size, -(-len(by_size) // MIXED_CHUNK)) if len(by_size) else ():
                lam[sub] = _solve_mixed(d[sub], c[sub], u[sub], v[sub], k[sub], wbar[sub], best_f[sub], lam[sub],
                                        lonely[sub], gvec[sub])
    return np.where((su == 0.0)[:, None, None], 0.0, lam)


# ---- Projection layer and confidence fit (eq. optimize_lambda, "Learning the Confidence")
def project_confidence(lam_tilde: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Departure 2: the exact Euclidean projection onto Lambda(s) = [0,1]^|A| ∩ {lambda . d = 0} (the paper's
    shift-then-clip breaks the equality). KKT: lambda = clip(lam_tilde - nu d, 0, 1) with g(nu) = d . lambda = 0;
    g is non-increasing and piecewise linear, so nu is interpolated exactly between its sorted breakpoints."""
    if len(d) > PROJECT_BLOCK:  # row by row the same; in blocks its temporaries stay in cache (2-3x on a batch)
        return np.concatenate([project_confidence(lam_tilde[i:i + PROJECT_BLOCK], d[i:i + PROJECT_BLOCK])
                               for i in range(0, len(d), PROJECT_BLOCK)])
    d = np.where(np.abs(d) > D_ZERO, d, 0.0)
    if d.shape[1] == 2:  # d = (delta, -delta): Lambda(s) is the diagonal, the projection is the clip of the mean
        return np.where((d[:, :1] != 0) | (d[:, 1:] != 0), np.clip((lam_tilde[:, :1] + lam_tilde[:, 1:]) / 2, 0.0, 1.0),
                        np.clip(lam_tilde, 0.0, 1.0)) * np.ones_like(lam_tilde)
    lam_t, d_t = np.ascontiguousarray(lam_tilde.T), np.ascontiguousarray(d.T)  # [|A|, N]: action-major, elementwise
    nz = d_t != 0
    safe_d = np.where(nz, d_t, 1.0)
    # a spurious breakpoint at 0 for d_j = 0 is harmless: g is piecewise linear between any superset of breakpoints
    bp = common.sort_rows([*np.where(nz, lam_t / safe_d, 0.0), *np.where(nz, (lam_t - 1.0) / safe_d, 0.0)])  # [2|A|, N]
    g = 0.0  # sum_j clip(lam_tilde_j - bp d_j, 0, 1) d_j, one buffer per action
    for lt, dj in zip(lam_t, d_t):
        t = bp * dj
        g = g + np.multiply(np.clip(np.subtract(lt, t, out=t), 0.0, 1.0, out=t), dj, out=t)
    n, k = bp.shape[1], np.clip((g > 0).sum(0) - 1, 0, len(bp) - 2)
    at = k * n + np.arange(n)  # (k, state) in the flattened [2 |A|, N] arrays, then (k + 1, state)
    b0, b1, g0, g1 = bp.ravel()[at], bp.ravel()[at + n], g.ravel()[at], g.ravel()[at + n]
    frac = np.where(g0 > g1, g0 / np.where(g0 > g1, g0 - g1, 1.0), 0.0)
    nu = np.where(nz.any(0), b0 + np.clip(frac, 0.0, 1.0) * (b1 - b0), 0.0)
    return np.clip(lam_tilde - nu[:, None] * d, 0.0, 1.0)


def confidence_fit(lam_tilde: np.ndarray, d: np.ndarray, beta: np.ndarray, rho: np.ndarray, target: np.ndarray):
    """The KL loss mean_s sum_a pi log(pi / target) of each member ([M, B, |A|] arrays), pi = beta +
    project_confidence(lam_tilde, d) d, and its gradient w.r.t. lam_tilde: dL/dlambda = (log pi - log target + 1) d /
    |B|, times the projection's Jacobian I - d_F d_F^T / |d_F|^2 on the free coordinates F (0 on clipped ones).
    Numpy: cheaper than an autograd graph (tests compare). Returns the losses [M] and the gradient."""
    d = np.where(np.abs(d) > D_ZERO, d, 0.0)
    lam = project_confidence(lam_tilde.reshape(-1, d.shape[-1]), d.reshape(-1, d.shape[-1])).reshape(d.shape)
    pi = beta + lam * d
    lr = np.log(np.maximum(pi, LOG_CLAMP)) - np.log(np.maximum(target, LOG_CLAMP))
    n = pi.shape[-2]
    loss = (pi * lr).sum((-1, -2)) / n
    g_lam = (lr + (pi > LOG_CLAMP)) * d / n
    free = (lam > 0.0) & (lam < 1.0)
    d_free = d * free
    n_free = common.row_sum(np.square(d_free), True)
    proj = common.row_sum(d_free * g_lam, True) / np.where(n_free > 0, n_free, 1.0)
    return loss, np.where(free, g_lam - d_free * proj, 0.0)


# ---- Critic (Algorithm 1, line 6)
def mixed_value(q, beta, mu, q_max=None):
    """V(s) = (1-mu) E_beta Q(s, .) + mu max_a Q(s, a), for the TD target and for W = Q - V (mu: [M, 1])."""
    return (1.0 - mu) * common.row_sum(beta * q) + mu * (common.row_max(q) if q_max is None else q_max)


# ---- The deployed policy and its evaluation
FLAGS = ("mu", "gamma", "kappa_scale", "kappa_max", "kappa_decay", "pessimism", "advantage_unit", "penalty_scale",
         "penalty_one_minus_mu")  # the flags the method's functions read, one row per member (common.columns)


def policy_probs(obs, beta, q_network, confidence, p, pessimism, n_updates, unit, q=None, log_beta=None,
                 sqrt_beta=None, lam_tilde=None):
    """pi(.|s) [M, N, |A|] at arbitrary states obs [M, N, dim] (no gradient): the deployed residual policy. q (the
    critic's values), log_beta, sqrt_beta, lam_tilde (the raw confidence): computed here unless given."""
    with torch.no_grad():
        q = q_network(obs).double().numpy() if q is None else q
        w = q - mixed_value(q, beta, p.mu)[..., None]
        lam_tilde = confidence(obs).double().numpy() if lam_tilde is None else lam_tilde
        rho, _ = candidate(beta, lam_tilde, w, p, pessimism, n_updates, unit, log_beta, sqrt_beta)
        lam = project_confidence(lam_tilde.reshape(-1, q.shape[-1]), (rho - beta).reshape(-1, q.shape[-1]))
        return residual_policy(beta, rho, lam.reshape(q.shape))


def make_actor(behavior, q_network, confidence, p, greedy: bool):
    """act(obs [M, E, dim], u) -> actions [M, E] for evaluation: pi's argmax, or a draw of pi with the uniforms u;
    state: n_updates, unit [M], pessimism [M, 1] (the deployed levels), deploy_pi [M] (False: beta)."""
    state = {"n_updates": 0, "unit": np.ones(len(p.mu)), "pessimism": p.pessimism, "deploy_pi": np.ones(len(p.mu), bool)}

    def act(obs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        beta = behavior(obs).numpy()
        pi = policy_probs(obs, beta, q_network, confidence, p, state["pessimism"], state["n_updates"], state["unit"])
        # beta where pi is not deployed, and for a diverged member (NaN; its run is dropped)
        pi = torch.from_numpy(np.where(state["deploy_pi"][:, None, None] & np.isfinite(pi), pi, beta))
        return pi.argmax(-1) if greedy else common.sample(pi, u.double())

    return act, state


def load_policy(path: str, greedy: bool = False, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): checkpoint, act(obs, u), probs(obs, beta) -> pi(.|s), critic
    Q(s, .), on observations [1, N, dim]."""
    ckpt = common.load_checkpoint(path, Path(__file__).stem, dict(q_network=dict, behavior=dict, args=dict,
        n_updates=int, advantage_unit=float, deploy_pi=bool, deploy_pessimism=float))
    saved = common.saved_args(ckpt, Args, check_args, path)  # the policy's own settings; evaluation's from the flags
    common.require(ckpt["advantage_unit"] > 0 and 0.0 <= ckpt["deploy_pessimism"] <= 1e3,
                   f"checkpoint {path}: its advantage unit or deployed pessimism is invalid")
    behavior = common.behavior_from_checkpoint(ckpt, path)
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    common.load_weights(path, q_network, ckpt["q_network"])
    q, confidence = common.Stack([q_network.net]), load_confidence(ckpt, saved, path)
    p = common.columns([saved], *FLAGS)
    act, state = make_actor(lambda obs: behavior(obs[0])[None], q, confidence, p, greedy)
    state.update(n_updates=ckpt["n_updates"], unit=np.array([ckpt["advantage_unit"]]), deploy_pi=np.array([ckpt[
        "deploy_pi"]]), pessimism=np.array([[ckpt["deploy_pessimism"]]]))  # the level deployed when saved

    def probs(obs, beta: np.ndarray) -> np.ndarray:
        pi = policy_probs(torch.as_tensor(obs), beta, q, confidence, p, state["pessimism"], state["n_updates"],
                          state["unit"]) if state["deploy_pi"][0] else beta
        return common.one_hot(pi.argmax(-1), ckpt["n_actions"]) if greedy else pi

    return ckpt, act, probs, common.q_function(q)


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint, args.eval_greedy, args.eval_seed)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed,
                               "" if ckpt["deploy_pi"] else " (beta: pi was not certified when saved)", ckpt["n_updates"])


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, behavior_network=True, member_flags=MEMBER_FLAGS)


# ---- Training
def train(runs: common.Members) -> None:
    # --- setup ---
    first, M, B = runs.first, runs.M, runs.first.batch_size
    p = common.columns(runs.args, *FLAGS)
    obs, next_obs, rewards = runs.tensor("observations"), runs.tensor("next_observations"), runs.tensor("rewards")
    actions, not_done = runs.tensor("actions"), 1.0 - runs.tensor("terminals").float()  # timeouts: bootstrapped
    gamma32 = torch.from_numpy(p.gamma.astype(np.float32))
    # beta in float64, renormalised: sum_a (rho - beta) must be 0 to ~1e-16 for the equality constraint
    beta_all = runs.tensor("behavior_probs").double().numpy()
    beta_all /= beta_all.sum(1, keepdims=True)
    log_beta_all, sqrt_beta_all = log_probs(beta_all), sqrt_floored(beta_all)  # once, not per update
    next_beta = runs.tensor("next_behavior_probs")
    mu32 = torch.from_numpy(p.mu.astype(np.float32))
    groups = common.deployment_groups(runs, beta_all, log_probs, sqrt_floored)  # departure 11

    # each member's critic and confidence network side by side (networks 2m and 2m + 1): one batched forward for both
    networks = common.Stack([net for pair in zip(*runs.build(lambda: [QNetwork(runs.obs_dim, runs.n_actions).net,
                             ConfidenceNetwork(runs.obs_dim, runs.n_actions).net])) for net in pair])
    q_network, confidence = networks.part(slice(0, None, 2)), networks.part(slice(1, None, 2))
    confidence.output = torch.sigmoid
    target_network = q_network.copy()
    optimizer = common.Adam(networks, torch.cat([runs.column("learning_rate"), runs.column("confidence_learning_rate")],
                                                1).view(-1, 1))
    k_penalty = (penalty_weight(B, p.gamma, p.mu, p.penalty_one_minus_mu) * p.penalty_scale)[:, 0]  # dep. 8, 9
    tau, period = runs.column("tau"), runs.column("target_update_frequency", torch.long)
    cql_alpha, td_loss_of = runs.column("cql_alpha"), common.td_loss(runs.column("huber_delta"))  # departure 14
    cql_on = bool(cql_alpha.any())  # once: the paper's critic (every alpha 0) skips the term
    evaluation = common.PolicyEvaluation(runs, lambda: QNetwork(runs.obs_dim, runs.n_actions).net,
                                         first.evaluation_critic)  # departure 15
    act, actor_state = make_actor(runs.behavior(), q_network, confidence, p, first.eval_greedy)
    certificates, unit = [{} for _ in range(M)], None

    for step in range(1, first.total_steps + 1):
        # --- update: critic target and W (Algorithm 1, line 6) ---
        batch = runs.minibatch(step)  # batch(t): t's rows [M, batch, ...]
        s = batch(obs)
        with torch.no_grad():
            next_q = target_network(batch(next_obs))
            next_v = mixed_value(next_q, batch(next_beta), mu32, next_q.max(-1).values)
        discount = gamma32 * batch(not_done)
        td_target = torch.addcmul(batch(rewards), next_v, discount)  # r + gamma (1 - terminal) V(s')
        out = networks(s.repeat_interleave(2, 0)).unflatten(0, (-1, 2))
        q_all, lam_tilde = out[:, 0], torch.sigmoid(out[:, 1])
        q64 = q_all.detach().double()
        for m in np.flatnonzero(~q64.isfinite().all(-1).all(-1).numpy()):  # a diverged critic would poison the rest
            if runs.alive[m]:
                runs.drop(m, f"training diverged: the critic's values are NaN or inf after {step - 1} updates; try a "
                             "lower --learning-rate")
            q64[m] = 0.0  # a dropped member's numbers are discarded: zeros, not NaN in every array below
        q_taken = q_all.gather(-1, batch(actions).unsqueeze(-1)).squeeze(-1)
        td_loss = td_loss_of(q_taken, td_target)  # [M]: each member's mean TD loss
        # departure 13: a conservative critic, CQL(H)'s alpha E_s[logsumexp_a Q(s, a) - Q(s, a_data)] (Kumar et al. eq. 4)
        critic_loss = td_loss + (cql_alpha * (torch.logsumexp(q_all, -1) - q_taken)).mean(1) if cql_on else td_loss
        q_max = q64.amax(-1)
        batch_unit = advantage_unit(q64, q_max)  # departure 5
        unit = batch_unit if step == 1 else (1.0 - UNIT_RATE) * unit + UNIT_RATE * batch_unit
        q_np, unit_np, beta, sqrt_beta = q64.numpy(), unit.numpy(), batch(beta_all), batch(sqrt_beta_all)
        w = q_np - mixed_value(q_np, beta, p.mu, q_max.numpy())[..., None]  # W = Q - V, the critic before its step

        # --- update: confidence (Algorithm 1, lines 3-5) ---
        lam_np = lam_tilde.detach().numpy().astype(np.float64)
        rho, temp = candidate(beta, lam_np, w, p, p.pessimism, step - 1, unit_np, batch(log_beta_all), sqrt_beta)  # 3
        d = rho - beta
        w_solver = solver_advantage(w, beta, p, unit_np, sqrt_beta)
        alive = np.array(runs.alive)  # a dropped member's values are NaN: its confidence is 0
        lam_star = solve_confidence_members(np.where(alive[:, None, None], d, 0.0), np.where(alive[:, None, None],
                                                                                              w_solver, 0.0), k_penalty)
        confidence_loss, grad = confidence_fit(lam_np, d, beta, rho, beta + lam_star * d)

        torch.autograd.backward((critic_loss.sum(), lam_tilde), (None, torch.from_numpy(grad).float()))
        optimizer.step()
        common.soft_update(step, target_network, q_network, period, tau)
        evaluation.update(step, batch, s, next_obs, actions, rewards, discount)

        # --- log ---
        runs.log(step, lambda: {"losses/td_loss": td_loss, "losses/q_values": q_taken.mean(1),
                        "losses/confidence_loss": confidence_loss, "confidence/advantage_unit": unit,
                        "confidence/mean_lambda_star": lam_star.mean((1, 2)), "confidence/mean_temperature": temp.mean(1)})

        # --- evaluate ---
        if runs.due(step):
            runs.pause()
            # departures 11 and 15: the certificate picks the pessimism level, the evaluation critic (opt-in) pi or beta
            pessimism, deploy_pi, certificates = common.deploy(runs, step, obs, next_obs, q_network, confidence, p,
                                                               unit.numpy(), groups, evaluation, policy_probs, FLAGS)
            actor_state.update(n_updates=step, unit=unit.numpy(), pessimism=pessimism, deploy_pi=deploy_pi)
            runs.evaluate(step, [q_network, confidence] + evaluation.nets, act, extra=[
                {"deployed": "pi" if deploy_pi[m] else "beta", "pessimism": float(pessimism[m, 0]), **certificates[m]}
                for m in range(M)])
            runs.log(step, {"charts/deployed_pi": deploy_pi, "charts/deployed_pessimism": pessimism[:, 0],
                            **{f"losses/{k}": [c.get(k, np.nan) for c in certificates] for k in ("certificate",
                               "certificate_lcb", "fqe_gain") if all(k in c for c in certificates)}}, every=1)

    # --- finish ---
    runs.finish("brpo", lambda m: {**certificates[m], "deployed_pi": float(actor_state["deploy_pi"][m]),  # the last
                                   "deployed_pessimism": float(actor_state["pessimism"][m, 0])}, lambda m: {
        "obs_dim": runs.obs_dim, "n_actions": runs.n_actions, "q_network": q_network.state_dict(m, "net."),
        "confidence": confidence.state_dict(m, "net."), "n_updates": first.total_steps,
        **common.behavior_spec(runs.data[m]), "deploy_pi": bool(actor_state["deploy_pi"][m]),
        "deploy_pessimism": float(actor_state["pessimism"][m, 0]), "advantage_unit": float(unit[m])})
    n_episodes = {m: cert and cert["n_episodes"] for cert, _, members in groups.values() for m in members}
    for m in range(M):
        if runs.alive[m]:
            common.report_certificate(certificates[m], n_episodes[m], runs.args[m], actor_state["deploy_pi"][m],
                                      float(actor_state["pessimism"][m, 0]))


if __name__ == "__main__":
    common.cli(Args, main)
