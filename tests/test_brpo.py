"""BRPO's math (candidate policy, projection layer, batch confidence solver, lower bound) against
independent references, and brpo.py / brpo_c.py end to end on a small dataset."""

from __future__ import annotations

import itertools
import json
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from conftest import REPO, run, run_in_process
import common
from test_common import load_script

TINY = ["--total-steps", "300", "--eval-frequency", "100", "--eval-episodes", "2"]


def one_member(mod, args):
    """The flags of one run as the member columns the method's functions read."""
    return common.columns([args], *mod.FLAGS)


def candidate1(mod, beta, lam, w, args, n_updates, unit):
    """mod.candidate for one run's states [B, |A|] (the functions take members [M, B, |A|])."""
    p = one_member(mod, args)
    rho, tau = mod.candidate(beta[None], lam[None], w[None], p, p.pessimism, n_updates, np.array([float(unit)]))
    return rho[0], tau[0]


def solver_advantage1(mod, w, beta, args, unit):
    return mod.solver_advantage(w[None], beta[None], one_member(mod, args), np.array([float(unit)]))[0]


@pytest.fixture(scope="module")
def brpo():
    return load_script("brpo.py")


# ---------------------------------------------------------------------------------------------
# Brute-force reference for the confidence QP (tests only)
# ---------------------------------------------------------------------------------------------
def vertices_reference(d: np.ndarray) -> np.ndarray:
    """Vertices of [0,1]^n ∩ {d.x = 0}: cube corners on the hyperplane and hyperplane ∩ cube edges."""
    n = len(d)
    pts = [np.array(c) for c in itertools.product([0.0, 1.0], repeat=n) if abs(d @ np.array(c)) <= 1e-12]
    for j in range(n):
        if d[j] == 0:
            continue
        for corner in itertools.product([0.0, 1.0], repeat=n - 1):
            x = np.insert(np.array(corner), j, 0.0)
            t = -(d @ x) / d[j]
            if -1e-12 <= t <= 1 + 1e-12:
                x[j] = min(max(t, 0.0), 1.0)
                pts.append(x)
    return np.unique(np.round(np.array(pts), 12), axis=0)


def brute_force_max(d: np.ndarray, w: np.ndarray, k: float) -> float:
    """max of C - kUV by exhaustion. The maximum of f over the image polytope Z = sum_s Z_s lies on an
    edge or a vertex of Z (f increases in C; on a 2-D face it is a saddle in (U, V)); every such point is
    reached with one state on a segment between two of its vertices and all others at vertices, where f
    is a 1-D quadratic maximised in closed form. Enumerates all of these."""
    d = np.where(np.abs(d) > 1e-12, d, 0.0)
    cuv = np.stack([d * w, np.abs(d), np.abs(d) * np.abs(w)], -1)
    imgs = [vertices_reference(d[i]) @ cuv[i] for i in range(len(d))]
    best = -np.inf
    for i in range(len(d)):
        rest = np.zeros((1, 3))
        for j in range(len(d)):
            if j != i:
                rest = np.unique(np.round((rest[:, None, :] + imgs[j][None]).reshape(-1, 3), 13), axis=0)
        for a, b in itertools.product(range(len(imgs[i])), repeat=2):
            p0, dl = rest + imgs[i][a], imgs[i][b] - imgs[i][a]
            f0 = p0[:, 0] - k * p0[:, 1] * p0[:, 2]
            q = -k * dl[1] * dl[2]
            lin = dl[0] - k * (p0[:, 1] * dl[2] + p0[:, 2] * dl[1])
            s = np.clip(lin / (-2 * q), 0, 1) if q < 0 else np.zeros_like(lin)
            best = max(best, (f0 + lin * s + q * s * s).max(), (f0 + lin + q).max())
    return best


def arrangement_max(d: np.ndarray, w: np.ndarray, k: float, perturb: float = 1e-10) -> float:
    """max of C - kUV by a second, independent exact method, polynomial in |B| (so it reaches |B| = 8 with
    |A| = 4, where brute_force_max's product over states is out of reach). First-order optimality: an
    optimum maximises the linear function (c - a u - b v).lambda for (a, b) = (kV*, kU*) >= 0; the
    maximiser of that LP, as (a, b) ranges over the quadrant, changes only across the lines where two
    vertices z_p, z_q of one state's image tie (c_p - c_q = a (u_p - u_q) + b (v_p - v_q)), and the edges of
    Z lie on those lines. So walk every such line through the quadrant, take every state's LP vertex in
    every interval between its crossings with the other lines, put the line's own state on the segment
    [z_p, z_q], and maximise the 1-D quadratic f on it. w is perturbed by ~1e-10 (relative) to put the lines
    in general position; every point is evaluated with the original w, so the value is a feasible one and
    within ~1e-10 of the true maximum."""
    d = np.where(np.abs(d) > 1e-12, d, 0.0)
    bsz = len(d)
    wp = w + perturb * (1.0 + np.abs(w)) * np.random.default_rng(0).standard_normal(w.shape)
    cuv = np.stack([d * wp, np.abs(d), np.abs(d) * np.abs(wp)], -1)
    cands = [vertices_reference(d[s]) for s in range(bsz)]
    imgs = [cands[s] @ cuv[s] for s in range(bsz)]
    lines = [(s, p, q, *(imgs[s][p] - imgs[s][q])) for s in range(bsz)
             for p, q in itertools.combinations(range(len(imgs[s])), 2)]
    coef = np.array([line[3:] for line in lines]).reshape(-1, 3)  # (g, alpha, beta): g = a alpha + b beta

    def lp_vertices(ab):  # (m, 2) points -> (m, B, |A|) LP maximisers
        return np.stack([cands[s][np.argmax(imgs[s][None, :, 0] - ab[:, :1] * imgs[s][None, :, 1]
                                            - ab[:, 1:] * imgs[s][None, :, 2], 1)] for s in range(bsz)], 1)

    best = objective(lp_vertices(np.zeros((1, 2)))[0], d, w, k)  # the vertex of the unpenalised LP
    for s0, p, q, g, al, be in lines:
        nrm2 = al * al + be * be
        if nrm2 == 0.0:
            continue
        p0, dirv = g * np.array([al, be]) / nrm2, np.array([be, -al]) / np.sqrt(nrm2)
        lo, hi = -np.inf, np.inf  # the line's part inside a, b >= 0
        for i in range(2):
            if dirv[i] == 0.0:
                lo, hi = (lo, hi) if p0[i] >= 0 else (1.0, 0.0)
            elif dirv[i] > 0:
                lo = max(lo, -p0[i] / dirv[i])
            else:
                hi = min(hi, -p0[i] / dirv[i])
        if lo > hi:
            continue
        den = coef[:, 1] * dirv[0] + coef[:, 2] * dirv[1]
        ok = den != 0
        cross = (coef[ok, 0] - coef[ok, 1] * p0[0] - coef[ok, 2] * p0[1]) / den[ok]
        ends = np.array([x for x in (lo, hi) if np.isfinite(x)])
        sig = np.unique(np.concatenate([ends, cross[(cross > lo) & (cross < hi)]]))
        if sig.size == 0:
            sig = np.zeros(1)
        mids = np.concatenate([sig, 0.5 * (sig[:-1] + sig[1:]), [sig[0] - 1.0] * int(np.isinf(lo)), [sig[-1] + 1.0] * int(np.isinf(hi))])
        base = lp_vertices(np.maximum(p0[None] + mids[:, None] * dirv[None], 0.0))
        lam0, lam1 = base.copy(), base.copy()
        lam0[:, s0], lam1[:, s0] = cands[s0][p], cands[s0][q]
        terms = [np.stack([(x * d * w).sum((1, 2)), (x * np.abs(d)).sum((1, 2)), (x * np.abs(d * w)).sum((1, 2))])
                 for x in (lam0, lam1)]
        (c0, u0, v0), (c1, u1, v1) = terms
        dc, du, dv = c1 - c0, u1 - u0, v1 - v0
        quad, lin = -k * du * dv, dc - k * (u0 * dv + v0 * du)
        t = np.where(quad < 0, np.clip(lin / np.where(quad < 0, -2.0 * quad, 1.0), 0.0, 1.0), 0.0)
        for tt in (t, np.ones_like(t)):
            best = max(best, float((c0 + tt * dc - k * (u0 + tt * du) * (v0 + tt * dv)).max()))
    return best


def random_instance(rng, n_states, n_actions, kind):
    beta = rng.dirichlet(np.ones(n_actions) * 0.7, size=n_states)
    if kind in ("zeros", "mixed"):  # eps = 0 style: beta has zeros (rho inherits them)
        mask = rng.random((n_states, n_actions)) < 0.4
        mask[np.arange(n_states), rng.integers(0, n_actions, n_states)] = False
        beta = np.where(mask, 0.0, beta)
        beta /= beta.sum(1, keepdims=True)
    w = rng.normal(size=(n_states, n_actions)) * rng.choice([0.1, 1.0, 10.0])
    if kind == "positive":
        w = np.abs(w)
    if kind == "zero_adv":
        w[rng.random(n_states) < 0.5] = 0.0
    lam = rng.random((n_states, n_actions))
    logits = np.where(beta > 0, np.log(np.maximum(beta, 1e-300)) + lam * w / rng.choice([0.05, 0.5, 5.0]), -np.inf)
    rho = np.exp(logits - logits.max(1, keepdims=True))
    rho /= rho.sum(1, keepdims=True)
    if kind in ("same", "mixed"):  # rho = beta at some states: d = 0 there
        same = rng.random(n_states) < 0.4
        rho[same] = beta[same]
    d = rho - beta
    # penalty weight spread around the scale where it binds, so optima are interior as well as at vertices
    scale = np.abs(d * w).sum() / max(np.abs(d).sum() * (np.abs(d) * np.abs(w)).sum(), 1e-300)
    return d, w, scale * 10 ** rng.uniform(-2, 1.5)


def objective(lam, d, w, k):
    return (lam * d * w).sum() - k * (lam * np.abs(d)).sum() * (lam * np.abs(d) * np.abs(w)).sum()


def assert_feasible(lam, d):
    assert np.isfinite(lam).all()
    assert lam.min() >= 0.0 and lam.max() <= 1.0
    assert np.abs((lam * d).sum(1)).max() <= 1e-6


KINDS = ("generic", "zeros", "positive", "zero_adv", "same", "mixed")


def test_vertex_enumeration(brpo):
    rng = np.random.default_rng(9)
    for n_actions in (2, 3, 4, 5):
        for kind in KINDS:
            d, _, _ = random_instance(rng, 10, n_actions, kind)
            d = np.where(np.abs(d) > 1e-12, d, 0.0)
            cand = brpo.enumerate_vertices(d)
            for i in range(len(d)):
                # coordinates with d_j = 0 change neither f nor feasibility: compare the rest
                nz = d[i] != 0
                got = {tuple(r[nz]) for r in np.round(cand[i], 9)}
                ref = {tuple(r[nz]) for r in np.round(vertices_reference(d[i]), 9)}
                assert ref <= got  # every vertex is a candidate
                assert all(abs(np.dot(d[i], r)) <= 1e-9 and min(r) >= 0 and max(r) <= 1 for r in cand[i])


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_advantage_unit_is_the_mean_action_gap(script):
    module = load_script(script)
    rng = np.random.default_rng(3)
    for n_actions in (1, 2, 3, 4, 6):
        q = torch.from_numpy(rng.normal(size=(3, 64, n_actions)))  # 3 members
        unit = module.advantage_unit(q)
        assert unit.shape == (3,)
        for m in range(3):
            assert unit[m] == (q[m].max(1).values - q[m].min(1).values).mean()  # bit for bit
        assert torch.equal(module.advantage_unit(q, q.amax(-1)), unit)


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_mixed_value_in_numpy_is_torchs(script):
    """The mixed value V in numpy (W at evaluation and in the confidence update) gives exactly torch's numbers (the
    TD target's)."""
    module = load_script(script)
    torch.manual_seed(0)
    for n_actions in (2, 3, 4):
        for batch in (64, 37):
            q_all = torch.randn(batch, n_actions) * 30.0
            beta = torch.softmax(torch.randn(batch, n_actions) * 3.0, 1)
            q = q_all.detach()
            ref = (1.0 - 0.9) * (beta * q).sum(1) + 0.9 * q.max(1).values  # torch, as evaluation computed it
            for dtype in (torch.float32, torch.float64):
                got = module.mixed_value(q.to(dtype).numpy(), beta.to(dtype).numpy(), 0.9)
                assert np.array_equal(got, ((1.0 - 0.9) * (beta.to(dtype) * q.to(dtype)).sum(1)
                                            + 0.9 * q.to(dtype).max(1).values).numpy())
            assert np.array_equal(module.mixed_value(q.numpy(), beta.numpy(), 0.9), ref.numpy())


def test_lonely_generators(brpo):
    """Where one coordinate's sign is opposite to all others, P_s is the parallelepiped of the generators:
    its corners (0/1 combinations of the generators) are exactly the reference vertices."""
    rng = np.random.default_rng(10)
    for n_actions in (2, 3, 4, 5):
        for kind in KINDS:
            d, _, _ = random_instance(rng, 10, n_actions, kind)
            d = np.where(np.abs(d) > 1e-12, d, 0.0)
            lonely, g = brpo.lonely_generators(d)
            assert g.shape == (10, n_actions - 1, n_actions)
            signs = np.stack([(d > 0).sum(1), (d < 0).sum(1)], 1)
            assert (lonely == (signs.min(1) <= 1)).all()  # one coordinate of its sign (or d = 0)
            if n_actions == 2:
                assert (g[(d != 0).any(1)] == 1.0).all()  # the diagonal segment t (1, 1), exactly
            for i in np.flatnonzero(lonely):
                corners = np.array([np.array(t) @ g[i] for t in itertools.product([0.0, 1.0], repeat=n_actions - 1)])
                assert np.abs(corners @ d[i]).max() <= 1e-12 and corners.min() >= 0 and corners.max() <= 1 + 1e-12
                if (d[i] != 0).any():
                    nz = d[i] != 0
                    got = {tuple(r[nz]) for r in np.round(corners, 9)}
                    ref = {tuple(r[nz]) for r in np.round(vertices_reference(d[i]), 9)}
                    assert got == ref


@pytest.mark.parametrize("kind", KINDS)
def test_solver_matches_brute_force(brpo, kind):
    rng = np.random.default_rng(list(KINDS).index(kind))
    for _ in range(25):
        n_states, n_actions = int(rng.integers(1, 6)), int(rng.integers(2, 5))
        d, w, k = random_instance(rng, n_states, n_actions, kind)
        lam = brpo.solve_confidence(d, w, k)
        assert_feasible(lam, d)
        ref = brute_force_max(d, w, k)
        f = objective(lam, d, w, k)
        assert f <= ref + 1e-9 * max(1.0, abs(ref))  # the reference really is the maximum
        assert ref - f <= 1e-4 * abs(ref) + 1e-12 * np.abs(d * w).sum(), (kind, n_states, n_actions, f, ref)


def test_arrangement_reference_agrees_with_brute_force():
    """The two exact references (exhaustive and arrangement) agree where both run."""
    rng = np.random.default_rng(77)
    for i in range(60):
        d, w, k = random_instance(rng, int(rng.integers(1, 5)), int(rng.integers(2, 5)), KINDS[i % len(KINDS)])
        ref = brute_force_max(d, w, k)
        assert arrangement_max(d, w, k) == pytest.approx(ref, rel=1e-7, abs=1e-12 * np.abs(d * w).sum())


@pytest.mark.parametrize("n_actions", [2, 3, 4])
def test_solver_eight_states(brpo, n_actions):
    """|B| = 8, the largest batch the issue asks about, against the arrangement reference: with |A| = 4
    half the states or more have two coordinates of d of each sign (the general vertex path)."""
    rng = np.random.default_rng(123 + n_actions)
    for i in range(24):
        d, w, k = random_instance(rng, 8, n_actions, KINDS[i % len(KINDS)])
        lam = brpo.solve_confidence(d, w, k)
        assert_feasible(lam, d)
        ref = arrangement_max(d, w, k)
        f = objective(lam, d, w, k)
        assert f <= ref + 1e-8 * abs(ref) + 1e-12 * np.abs(d * w).sum()
        assert ref - f <= 1e-4 * abs(ref) + 1e-12 * np.abs(d * w).sum(), (i, f, ref)


@pytest.mark.parametrize("n_actions", [2, 3, 4, 6])
def test_solver_full_batch_feasible_and_beats_constants(brpo, n_actions):
    rng = np.random.default_rng(n_actions)
    for kind in KINDS:
        d, w, k = random_instance(rng, 64, n_actions, kind)
        lam = brpo.solve_confidence(d, w, k)
        assert_feasible(lam, d)
        f = objective(lam, d, w, k)
        assert f >= -1e-12  # lambda = 0 is feasible with f = 0
        for t in np.linspace(0, 1, 101):  # every constant lambda is feasible
            assert f >= objective(np.full_like(d, t), d, w, k) - 1e-12 * max(1.0, abs(f))


def test_solver_degenerate_inputs(brpo):
    d = np.zeros((5, 3))
    assert_feasible(brpo.solve_confidence(d, np.ones((5, 3)), 1.0), d)
    rng = np.random.default_rng(0)
    d, w, _ = random_instance(rng, 6, 3, "generic")
    for k in (0.0, 1e-300, 1e300):
        lam = brpo.solve_confidence(d, w, k)
        assert_feasible(lam, d)
        assert objective(lam, d, w, k) >= -1e-12
    lam = brpo.solve_confidence(d, w * 1e12, 1e-12)  # huge advantages
    assert_feasible(lam, d)
    lam = brpo.solve_confidence(d, np.zeros_like(w), 1.0)  # no advantage at all
    assert_feasible(lam, d)
    # k = 0: f is linear, optimum = sum of per-state LP maxima over the vertices
    lam = brpo.solve_confidence(d, w, 0.0)
    ref = sum(max(vertices_reference(d[i]) @ (d[i] * w[i])) for i in range(len(d)))
    assert objective(lam, d, w, 0.0) == pytest.approx(ref, rel=1e-9, abs=1e-12)


def exact_lp_max(d_row, c_row):
    """max of c . lambda over {0 <= lambda <= 1, d . lambda = 0} for one state, in exact rational arithmetic
    (the float references round vertices to 12 decimals, which is too coarse for coordinates ~1e-10)."""
    d, c, n = [Fraction(x) for x in d_row], [Fraction(x) for x in c_row], len(d_row)
    best = Fraction(0)
    for j in range(n):
        if d[j] == 0:
            continue
        for corner in itertools.product([0, 1], repeat=n - 1):
            x = list(corner[:j]) + [0] + list(corner[j:])
            t = -sum(di * xi for di, xi in zip(d, x)) / d[j]
            if 0 <= t <= 1:
                x[j] = t
                best = max(best, sum(ci * xi for ci, xi in zip(c, x)))
    return best


def test_solver_tiny_coordinates(brpo):
    """Instances whose whole gain comes from coordinates with |d_i| ~ 1e-10 |d_j| (an action beta takes with
    probability ~1e-10, next to large moves elsewhere in the state). The solver's float-noise snapping once
    rounded such vertex coordinates to 0 and lost up to 40% of the optimum (found by a stress run)."""
    rng = np.random.default_rng(5)
    for i in range(40):
        n_states, n_actions = int(rng.integers(1, 5)), int(rng.integers(3, 5))
        d = np.zeros((n_states, n_actions))
        w = np.zeros((n_states, n_actions))
        for s in range(n_states):
            x, delta = rng.uniform(0.1, 0.9), rng.choice([1e-11, 1e-10, 1e-9]) * rng.uniform(0.5, 2.0)
            # rho moves mass x away from a good action and delta away from a bad, nearly untaken action, to a
            # middling one: only the tiny move pays (w0 > w2 > 0 > w1)
            row = np.array([-x, -delta, x + delta] + [0.0] * (n_actions - 3))
            wr = np.array([rng.uniform(2, 3), -rng.uniform(0.5, 2), rng.uniform(0.5, 1.5)] + [0.0] * (n_actions - 3))
            if n_actions == 4 and rng.random() < 0.5:  # two coordinates of each sign: the vertex-enumeration path
                row = np.array([-x, -delta, x + delta - 0.05, 0.05])
                wr[3] = -rng.uniform(3, 4)
            perm = rng.permutation(n_actions)
            d[s], w[s] = row[perm], wr[perm]
        ref = float(sum(exact_lp_max(d[s], d[s] * w[s]) for s in range(n_states)))
        assert ref > 0
        # the LP optimum (k = 0) bounds f from above for any k; at its maximiser U, V <= 4e-9 |B| |W|max, so the
        # penalty there is below k (4e-9 |B|)^2 * 16: the lower bound for k > 0
        for k in (0.0, 99.0 / n_states):
            lam = brpo.solve_confidence(d, w, k)
            assert_feasible(lam, d)
            f = objective(lam, d, w, k)
            assert f <= ref * (1 + 1e-9)
            assert f >= ref * (1 - 1e-4) - k * (2 * 2e-9) ** 2 * n_states ** 2 * 16, (i, k, f, ref)


def test_solver_is_scale_free(brpo):
    """f(lambda; s d, W, k / s) = s f(lambda; d, W, k): the confidence problem has the same maximiser whatever
    the scale of d = rho - beta, and so must the solver (an absolute rounding threshold of 1e-12 on |d| once
    returned lambda = 0 for every minibatch whose moves were all ~1e-13, as when beta takes an action with
    probability ~1e-12)."""
    rng = np.random.default_rng(21)
    for i in range(60):
        d, w, k = random_instance(rng, int(rng.integers(1, 9)), int(rng.integers(2, 5)), KINDS[i % len(KINDS)])
        f1 = objective(brpo.solve_confidence(d, w, k), d, w, k)
        for s in (1e-13, 1e-40, 1e-150):
            lam = brpo.solve_confidence(s * d, w, k / s)
            assert lam.min() >= 0.0 and lam.max() <= 1.0
            assert np.abs((lam * d).sum(1)).max() <= 1e-9 * np.abs(d).max()
            assert objective(lam, s * d, w, k / s) / s == pytest.approx(f1, rel=1e-9, abs=1e-15), (i, s)
    # rounding noise next to real moves is still not a move: rho = beta up to 1e-17 at state 1, where the
    # critic's large W would otherwise pull lambda to a vertex
    d = np.array([[0.3, -0.3, 0.0], [1e-17, -1e-17, 0.0]])
    lam = brpo.solve_confidence(d, np.array([[1.0, 0.0, 0.0], [0.0, 5.0, 0.0]]), 0.0)
    assert lam[0, 0] == lam[0, 1] == 1.0 and np.all(lam[1] == lam[1, 0])


# ---------------------------------------------------------------------------------------------
# Lower bound (SAA) and MM properties
# ---------------------------------------------------------------------------------------------
def t64(x):
    return torch.as_tensor(np.asarray(x), dtype=torch.float64)


def lower_bound_terms(beta, rho, lam, w, gamma, mu, scale_penalty_by_mu=True):
    """The SAA estimates of the paper's L1, L2, L3 (Sec. 5) and the bound L = L1 - (1 - mu) L2 L3 (appendix; mu = 0:
    the main text): the bound brpo.solve_confidence maximises, as f = C - k U V."""
    d = rho - beta
    n = beta.shape[0]
    l1 = (lam * d * w).sum() / ((1.0 - gamma) * n)
    l2 = (lam * d.abs()).sum() / ((1.0 - gamma) * n)
    l3 = gamma * (lam * d.abs() * w.abs()).sum() / ((1.0 - gamma) * n)
    pen = (1.0 - mu) if scale_penalty_by_mu else 1.0
    return float(l1 - pen * l2 * l3), float(l1), float(l2), float(l3)


def test_lower_bound_mm_properties(brpo):
    rng = np.random.default_rng(1)
    d, w, _ = random_instance(rng, 32, 3, "mixed")
    beta = rng.dirichlet(np.ones(3), size=32)
    rho = beta + d * 0  # rho = beta
    lam = rng.random((32, 3))
    for mu in (0.0, 0.9):
        assert lower_bound_terms(t64(beta), t64(rho), t64(lam), t64(w), 0.99, mu)[0] == 0.0
    # lambda = 0, arbitrary rho
    rho = rng.dirichlet(np.ones(3), size=32)
    assert lower_bound_terms(t64(beta), t64(rho), t64(np.zeros((32, 3))), t64(w), 0.99, 0.9) == (0.0, 0.0, 0.0, 0.0)
    # the solver's objective is the same bound: L-bar = f / ((1 - gamma) |B|)
    d = rho - beta
    for mu, scaled in ((0.9, True), (0.5, True), (0.9, False)):
        k = brpo.penalty_weight(32, 0.99, mu, scaled)
        bound = lower_bound_terms(t64(beta), t64(rho), t64(lam), t64(w), 0.99, mu, scaled)[0]
        assert bound == pytest.approx(objective(lam, d, w, k) / (0.01 * 32), rel=1e-9)
        lam_star = brpo.solve_confidence(d, w, k)
        assert lower_bound_terms(t64(beta), t64(rho), t64(lam_star), t64(w), 0.99, mu, scaled)[0] >= 0.0


# ---------------------------------------------------------------------------------------------
# Candidate policy rho
# ---------------------------------------------------------------------------------------------
def test_candidate_policy(brpo):
    rng = np.random.default_rng(2)
    beta = rng.dirichlet(np.ones(4), size=50)
    beta[:10, 1] = 0.0  # eps = 0 style zeros
    beta /= beta.sum(1, keepdims=True)
    w = rng.normal(size=(50, 4)) * 5
    lam = rng.random((50, 4))
    tau = brpo.temperature(beta, lam, w, 0.99, 1.0, 1.0, 1.0, 0)
    assert (tau >= 0.99 / 0.02 * 1.0 - 1e-9).all()  # kappa >= 1 (and capped at kappa_max = 1 here)
    rho = brpo.candidate_policy(beta, lam, w, tau)
    assert np.allclose(rho.sum(1), 1.0, atol=1e-12) and (rho >= 0).all()
    assert (rho[beta == 0] == 0).all()
    # lambda = 0 or W = 0: rho = beta
    assert np.allclose(brpo.candidate_policy(beta, np.zeros_like(lam), w, tau), beta, atol=1e-15)
    assert np.allclose(brpo.candidate_policy(beta, lam, np.zeros_like(w), tau), beta, atol=1e-15)
    # it is the relative softmax of the paper
    ref = beta * np.exp(lam * w / tau[:, None])
    assert np.allclose(rho, ref / ref.sum(1, keepdims=True), atol=1e-12)
    # higher weighted advantage -> more mass than beta
    assert ((rho - beta)[w * lam == (w * lam).max(1, keepdims=True)] >= -1e-15).all()
    # huge advantages and vanishing temperatures: no NaN / inf, a distribution
    for scale, decay, k in ((1e6, 1.0, 0), (1e100, 1.0, 0), (1e300, 0.5, 2000), (1.0, 0.9, 10_000)):
        tau = brpo.temperature(beta, lam, w * scale, 0.99, 1.0, 1e6, decay, k)
        rho = brpo.candidate_policy(beta, lam, w * scale, tau)
        assert np.isfinite(tau).all() and np.isfinite(rho).all()
        assert np.allclose(rho.sum(1), 1.0) and (rho[beta == 0] == 0).all()
    # kappa in log-space: no overflow for |W| lambda ~ 1e3 (exp(1e6) would be inf)
    tau = brpo.temperature(beta, np.ones_like(beta), np.full_like(beta, 1e3), 0.99, 1.0, np.inf, 1.0, 0)  # g = 1e3
    assert np.isfinite(tau).all() and np.allclose(tau, 0.99 * (1.0 + 1e6) / 0.02)


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_advantage_unit_makes_rho_scale_free(script):
    mod = load_script(script)
    q = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 4.0]])
    assert float(mod.advantage_unit(q)) == pytest.approx(3.0)  # mean of the gaps 2 and 4
    rng = np.random.default_rng(7)
    beta = rng.dirichlet(np.ones(3), size=20)
    beta[:5, 0] = 0.0
    beta /= beta.sum(1, keepdims=True)
    w, lam = rng.normal(size=(20, 3)), rng.random((20, 3))
    args = mod.Args(kappa_max=1.0, kappa_scale=0.02, kappa_decay=1.0, pessimism=0.0)
    rho, tau = candidate1(mod, beta, lam, w, args, 0, 0.5)
    # rewards x 1000 -> advantages and their unit x 1000: the same candidate policy
    rho_big, _ = candidate1(mod, beta, lam, 1000.0 * w, args, 0, 500.0)
    assert np.allclose(rho, rho_big, atol=1e-12) and np.allclose(tau, 0.99 * 0.02 / 0.02)
    # it is the relative softmax of W / unit
    ref = beta * np.exp(lam * (w / 0.5) / tau[:, None])
    assert np.allclose(rho, ref / ref.sum(1, keepdims=True), atol=1e-12)
    # --no-advantage-unit: the paper's raw W, the unit is ignored
    raw = mod.Args(kappa_max=1.0, kappa_scale=0.02, kappa_decay=1.0, advantage_unit=False, pessimism=0.0)
    assert np.allclose(candidate1(mod, beta, lam, w, raw, 0, 0.5)[0], candidate1(mod, beta, lam, w, raw, 0, 123.0)[0])
    # a zero unit (constant critic) is floored, never a division by zero
    rho0, _ = candidate1(mod, beta, lam, w, args, 0, 0.0)
    assert np.isfinite(rho0).all() and np.allclose(rho0.sum(1), 1.0)


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_pessimism(script):
    """W(s,a) - c / sqrt(beta(a|s)) inside the relative softmax: exactly that formula; no effect where beta is
    uniform and lambda constant; less mass on rarely taken actions than without it, never NaN with beta = 0."""
    mod = load_script(script)
    rng = np.random.default_rng(8)
    beta = rng.dirichlet(np.ones(3) * 0.5, size=30)
    beta[:6, 2] = 0.0
    beta /= beta.sum(1, keepdims=True)
    w, lam = 3.0 * rng.normal(size=(30, 3)), rng.random((30, 3))
    off, on = mod.Args(pessimism=0.0), mod.Args(pessimism=1.0)
    rho_off, tau = candidate1(mod, beta, lam, w, off, 0, 1.0)
    rho_on, _ = candidate1(mod, beta, lam, w, on, 0, 1.0)
    pos = beta > 0
    ref = np.where(pos, beta * np.exp(lam * (w - 1.0 / np.sqrt(np.where(pos, beta, 1.0))) / tau[:, None]), 0.0)
    assert np.allclose(rho_on, ref / ref.sum(1, keepdims=True), atol=1e-12)
    assert np.isfinite(rho_on).all() and (rho_on[~pos] == 0).all() and np.allclose(rho_on.sum(1), 1.0)
    # with a state-constant lambda the rarest action of each state never gains mass from the correction
    lam1 = np.repeat(lam[:, :1], 3, 1)
    rare = np.where(pos, beta, np.inf).argmin(1)
    rows = np.arange(30)
    assert (candidate1(mod, beta, lam1, w, on, 0, 1.0)[0][rows, rare] <= candidate1(mod, beta, lam1, w, off, 0, 1.0)[0][rows, rare] + 1e-12).all()
    # uniform beta and a state-constant lambda: the correction is a constant per state, rho is unchanged
    uni = np.full((30, 3), 1.0 / 3.0)
    assert np.allclose(candidate1(mod, uni, lam1, w, on, 0, 1.0)[0], candidate1(mod, uni, lam1, w, off, 0, 1.0)[0], atol=1e-12)



def test_tv_to_beta():
    """The deployed-level rule's distance: 0 at pi = beta, 1 for disjoint supports, symmetric, and for the
    residual policy half of Theorem 2's regulariser E_s sum_a lambda |rho - beta|."""
    mod = common
    rng = np.random.default_rng(3)
    beta, pi = rng.dirichlet(np.ones(4), size=50), rng.dirichlet(np.ones(4), size=50)
    assert mod.tv_to_beta(beta, beta) == 0.0
    assert mod.tv_to_beta(np.eye(4)[[0, 1]], np.eye(4)[[2, 3]]) == 1.0
    lam = np.repeat(rng.random((50, 1)), 4, 1)  # a state-constant lambda is feasible for any rho
    mix = beta + lam * (pi - beta)
    assert mod.tv_to_beta(mix, beta) == pytest.approx(0.5 * (lam * np.abs(pi - beta)).sum(1).mean(), rel=1e-12)
    assert mod.tv_to_beta(pi, beta) == pytest.approx(mod.tv_to_beta(beta, pi), rel=1e-15)
    assert 0.0 < mod.tv_to_beta(pi, beta) < 1.0

def test_solver_advantage(brpo):
    """lambda-bar* sees W minus the candidate's pessimism term centred under beta: W itself at pessimism 0 and
    on uniform data, an advantage (beta-mean unchanged), finite with beta = 0, in W's units."""
    rng = np.random.default_rng(9)
    beta = rng.dirichlet(np.ones(4) * 0.5, size=40)
    beta[:8, 3] = 0.0
    beta /= beta.sum(1, keepdims=True)
    w = 5.0 * rng.normal(size=(40, 4))
    on = brpo.Args(pessimism=1.0)
    assert np.array_equal(solver_advantage1(brpo, w, beta, brpo.Args(pessimism=0.0), 2.0), w)
    got = solver_advantage1(brpo, w, beta, on, 2.0)
    assert np.isfinite(got).all()
    assert np.allclose((beta * got).sum(1), (beta * w).sum(1), atol=1e-9)
    pos = beta[:, :3] > 0
    inv = 1.0 / np.sqrt(beta[:, :3])
    assert np.allclose(np.where(pos, got[:, :3] - w[:, :3], 0.0), np.where(pos, -2.0 * (inv - (beta * np.where(beta > 0, 1.0 / np.sqrt(np.where(beta > 0, beta, 1.0)), 0.0)).sum(1, keepdims=True)), 0.0))
    uni = np.full((40, 4), 0.25)
    assert np.allclose(solver_advantage1(brpo, w, uni, on, 2.0), w, atol=1e-12)
    # raw W (--no-advantage-unit): the correction is in raw units, the unit is ignored
    raw = brpo.Args(pessimism=1.0, advantage_unit=False)
    assert np.allclose(solver_advantage1(brpo, w, beta, raw, 7.0), solver_advantage1(brpo, w, beta, on, 1.0))


def test_solver_keeps_the_pessimistic_move(brpo):
    """The case that made BRPO lose on CartPole eps = 0.25: two actions, beta = (0.875, 0.125), rho moved
    towards the usual action by the pessimism term while the critic claims the rare one slightly better.
    With W the solver refuses that move (lambda = 0: pi = beta); with solver_advantage it keeps it."""
    args = brpo.Args(pessimism=1.0)
    beta = np.tile([0.875, 0.125], (8, 1))
    w = np.tile([-0.3, 0.2], (8, 1))  # critic: rare action better by 0.5 units (less than the ~1.76 pessimism gap)
    rho, _ = candidate1(brpo, beta, np.ones((8, 2)), w, args, 0, 1.0)
    d = rho - beta
    assert (d[:, 0] > 0).all()  # rho moved towards the usual action
    k = brpo.penalty_weight(64, 0.99, 0.9) * 0.1
    assert np.all(brpo.solve_confidence(d, w, k) == 0.0)
    assert np.all(brpo.solve_confidence(d, solver_advantage1(brpo, w, beta, args, 1.0), k) > 0.5)


def test_penalty_scale_zero_is_the_unpenalised_lp(brpo):
    rng = np.random.default_rng(11)
    for n_actions in (2, 3, 4):
        beta = rng.dirichlet(np.ones(n_actions), size=16)
        rho = rng.dirichlet(np.ones(n_actions), size=16)
        d, w = rho - beta, rng.normal(size=(16, n_actions))
        lam = brpo.solve_confidence(d, w, 0.0)
        assert (lam >= 0).all() and (lam <= 1).all() and (np.abs((lam * d).sum(1)) <= 1e-9).all()
        # without penalty the objective is linear and separable: each state's best vertex (brute force)
        best = sum(max(float(v @ (d[i] * w[i])) for v in brpo.enumerate_vertices(d[i:i + 1])[0]) for i in range(16))
        assert float((lam * d * w).sum()) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_temperature_cap_and_decay(brpo):
    beta = np.full((3, 2), 0.5)
    lam = np.ones((3, 2))
    w = np.array([[0.0, 0.0], [3.0, -3.0], [30.0, 1.0]])
    tau = brpo.temperature(beta, lam, w, 0.99, 1.0, 1e9, 1.0, 0)
    kappa_w = 1 + np.logaddexp(np.log(0.5) + w[:, 0] ** 2, np.log(0.5) + w[:, 1] ** 2)  # exp(900) overflows
    expected = 0.99 * np.maximum(1 + np.log(np.e), kappa_w) / 0.02
    assert expected[2] == pytest.approx(0.99 * (1 + 900 + np.log(0.5)) / 0.02)
    assert np.allclose(tau, expected)
    assert np.allclose(brpo.temperature(beta, lam, w, 0.99, 1.0, 1.5, 1.0, 0), 0.99 * 1.5 / 0.02)
    assert np.allclose(brpo.temperature(beta, lam, w, 0.99, 1.0, 1.5, 0.9, 3), 0.99 * 1.5 * 0.9**3 / 0.02)
    # the scale multiplies the paper's state-dependent kappa (no cap): tau = scale * paper's tau
    assert np.allclose(brpo.temperature(beta, lam, w, 0.99, 0.02, np.inf, 1.0, 0), 0.02 * expected)
    # a cap below 1 binds everywhere: a constant temperature, scaled too
    assert np.allclose(brpo.temperature(beta, lam, w, 0.99, 0.5, 0.02, 1.0, 0), 0.99 * 0.5)


# ---------------------------------------------------------------------------------------------
# Projection layer
# ---------------------------------------------------------------------------------------------
def torch_projection(brpo, lam_tilde: torch.Tensor, d: np.ndarray) -> torch.Tensor:
    """The projection layer in autograd form (reference for brpo.project_confidence and confidence_fit): nu
    re-expressed inside the graph from the active set F = {j: 0 < lambda_j < 1} of the exact numpy root,
    nu = (sum_F d_j lam_tilde_j + sum_{not F} d_j lambda_j) / sum_F d_j^2, so autograd gives the implicit-function
    derivative I - d_F d_F^T / |d_F|^2 on F and 0 on clipped coordinates."""
    d = np.where(np.abs(d) > brpo.D_ZERO, d, 0.0)
    lt = lam_tilde.double()
    if d.shape[1] == 2:
        on = torch.from_numpy((d != 0).any(1, keepdims=True))
        return torch.where(on, lt.mean(1, keepdim=True).clamp(0.0, 1.0).expand_as(lt), lt.clamp(0.0, 1.0))
    lam0 = torch.from_numpy(brpo.project_confidence(lt.detach().numpy(), d))
    dt = torch.from_numpy(d)
    free = (lam0 > 0.0) & (lam0 < 1.0)
    d_free = dt * free
    n_free = d_free.square().sum(-1)
    has = n_free > 0
    num = (d_free * lt).sum(-1) + (dt * lam0 * ~free).sum(-1)
    nu = torch.where(has, num / torch.where(has, n_free, 1.0), 0.0)
    return torch.where(free, lt - nu[:, None] * dt, lam0).clamp(0.0, 1.0)


def torch_kl_fit_loss(brpo, pi_phi, target):
    """The paper's fitting loss mean_s sum_a pi_phi log(pi_phi / target) in autograd form, logs floored."""
    lp = torch.log(pi_phi.clamp_min(brpo.LOG_CLAMP))
    lq = torch.log(target.clamp_min(brpo.LOG_CLAMP))
    return (pi_phi * (lp - lq)).sum(-1).mean()


def test_projection_feasible_and_optimal(brpo, monkeypatch):
    rng = np.random.default_rng(3)
    for n_actions in (2, 3, 4, 5):
        for kind in KINDS:
            d, w, _ = random_instance(rng, 40, n_actions, kind)
            lt = rng.normal(0.5, 1.0, size=d.shape)  # also outside [0, 1]
            lam = brpo.project_confidence(lt, d)
            assert_feasible(lam, d)
            assert np.allclose(lam, torch_projection(brpo, torch.as_tensor(lt), d).numpy(), atol=1e-12)
            # no feasible point is closer: vertices and random convex combinations of vertices
            dist = ((lam - lt) ** 2).sum(1)
            for i in range(len(d)):
                verts = vertices_reference(np.where(np.abs(d[i]) > 1e-12, d[i], 0.0))
                mix = rng.dirichlet(np.ones(len(verts)), size=200) @ verts
                others = np.concatenate([verts, mix])
                assert dist[i] <= ((others - lt[i]) ** 2).sum(1).min() * (1 + 1e-10) + 1e-12
    # d = 0: projection is the clip
    lt = rng.normal(0.5, 1.0, size=(10, 3))
    assert np.allclose(brpo.project_confidence(lt, np.zeros((10, 3))), np.clip(lt, 0, 1))
    # feasible input is a fixed point
    d, _, _ = random_instance(rng, 10, 3, "generic")
    x = brpo.project_confidence(rng.random((10, 3)), d)
    assert np.allclose(brpo.project_confidence(x, d), x, atol=1e-12)
    # a large batch is projected in blocks of states: the same numbers as in one pass
    d, _, _ = random_instance(rng, 50, 4, "generic")
    lt = rng.random(d.shape)
    whole = brpo.project_confidence(lt, d)
    monkeypatch.setattr(brpo, "PROJECT_BLOCK", 7)
    assert np.array_equal(brpo.project_confidence(lt, d), whole)


def test_projection_gradcheck(brpo):
    rng = np.random.default_rng(4)
    for kind in ("generic", "zeros", "mixed"):
        d, _, _ = random_instance(rng, 6, 4, kind)
        lt = torch.tensor(rng.normal(0.5, 0.6, size=d.shape), dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x: torch_projection(brpo, x, d), (lt,), eps=1e-7, atol=1e-6)
        out = torch_projection(brpo, lt, d)
        out.sum().backward()  # gradient exists and is finite
        assert torch.isfinite(lt.grad).all()


def test_confidence_fit_matches_autograd(brpo):
    """Training uses confidence_fit (numpy value + gradient); it must equal autograd through the
    differentiable projection layer and the paper's KL loss."""
    rng = np.random.default_rng(6)
    for n_actions in (2, 3, 4):
        for kind in KINDS:
            d, w, k = random_instance(rng, 32, n_actions, kind)
            floor = np.maximum(-d, 0.0)  # a beta with rho = beta + d >= 0
            beta = floor + (1.0 - floor.sum(1, keepdims=True)) * rng.dirichlet(np.ones(n_actions), size=32)
            rho = beta + d
            target = beta + brpo.solve_confidence(d, w, k) * d
            lt = rng.normal(0.5, 0.6, size=d.shape)
            loss, grad = brpo.confidence_fit(lt, d, beta, rho, target)
            x = torch.tensor(lt, requires_grad=True)
            lam = torch_projection(brpo, x, d)
            ref = torch_kl_fit_loss(brpo, t64(beta) + lam * t64(d), t64(target))
            ref.backward()
            assert loss == pytest.approx(ref.item(), rel=1e-10, abs=1e-14)
            assert np.allclose(grad, x.grad.numpy(), rtol=1e-8, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Networks: pi is a distribution at unseen states
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("epsilon", [0.0, 0.15, 1.0])
def test_residual_policy_is_distribution_anywhere(brpo, epsilon):
    torch.manual_seed(0)
    rng = np.random.default_rng(5)
    obs_dim, n_actions = 6, 3
    weights = {f"w{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate([(32, obs_dim), (16, 32), (n_actions, 16)])}
    weights.update({f"b{i}": rng.normal(size=s[0]).astype(np.float32) for i, s in enumerate([(32,), (16,), (n_actions,)])})
    behavior = common.BehaviorPolicy(weights, epsilon)
    q_net, confidence_net = brpo.QNetwork(obs_dim, n_actions), brpo.ConfidenceNetwork(obs_dim, n_actions)
    with torch.no_grad():  # a critic with huge values and a confident lambda net
        q_net.net[4].weight.mul_(1e4)
        confidence_net.net[4].bias.fill_(3.0)
    q_network, confidence = common.Stack([q_net.net]), common.Stack([confidence_net.net], output=torch.sigmoid)
    args = brpo.Args(kappa_max=0.01, kappa_decay=0.999)
    p = one_member(brpo, args)
    obs = torch.as_tensor(rng.normal(size=(500, obs_dim)) * np.array([1, 10, 100, 1e3, 1e4, 1e5]), dtype=torch.float32)
    beta = behavior(obs)
    for n_updates, unit in ((0, 1.0), (10_000, 1e-3), (10_000, 0.0)):  # unit 0: a constant critic's gap
        pi = torch.from_numpy(brpo.policy_probs(obs[None], beta.numpy()[None], q_network, confidence, p, p.pessimism,
                                                n_updates, np.array([unit]))[0])
        # the deployment builds pi on the batch in blocks of states: the same numbers as in one pass
        assert np.array_equal(common.in_blocks(lambda b: brpo.policy_probs(obs[None, b], beta.numpy()[None, b], q_network,
                              confidence, p, p.pessimism, n_updates, np.array([unit])), len(obs), 37), pi[None].numpy())
        with torch.no_grad():  # pi's parts, as policy_probs builds them
            q = q_net(obs).double().numpy()
            w = q - brpo.mixed_value(q, beta.numpy(), args.mu)[:, None]
            lam_tilde = torch.sigmoid(confidence_net.net(obs)).double().numpy()
        rho = candidate1(brpo, beta.numpy(), lam_tilde, w, args, n_updates, unit)[0]
        lam = torch.from_numpy(brpo.project_confidence(lam_tilde, rho - beta.numpy()))
        rho = torch.from_numpy(rho)
        assert np.isfinite(w).all()
        assert torch.isfinite(pi).all() and (pi >= 0).all()
        assert torch.allclose(pi.sum(1), torch.ones(500, dtype=torch.float64), atol=1e-12)
        assert (lam >= 0).all() and (lam <= 1).all()
        assert ((lam * (rho - beta)).sum(1).abs() <= 1e-9).all()
        assert (pi[beta == 0] == 0).all()  # never an action the behaviour policy cannot take
        # without the renormalisation pi is already a distribution (it only removes rounding)
        raw = beta + lam * (rho - beta)
        assert (raw >= -1e-15).all() and torch.allclose(raw.sum(1), torch.ones(500, dtype=torch.float64), atol=1e-12)


def test_kl_fit_loss(brpo):
    """confidence_fit's loss is the paper's KL(pi_phi || target); with d = 0, pi_phi = beta."""
    p = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = np.array([[0.25, 0.75, 0.0], [0.5, 0.5, 0.0]])
    lt, zero = np.full((2, 3), 0.5), np.zeros((2, 3))
    assert brpo.confidence_fit(lt, zero, p, p, p)[0] == 0.0
    ref = (0.5 * np.log(2) + 0.5 * np.log(0.5 / 0.75) + np.log(2)) / 2
    assert brpo.confidence_fit(lt, zero, p, p, q)[0] == pytest.approx(ref)
    assert np.isfinite(brpo.confidence_fit(lt, zero, q, q, p)[0])  # zero target mass: clamped, finite


# ---------------------------------------------------------------------------------------------
# End to end (the command line run in this process: test_common runs each script as a new process; tiny budgets)
# ---------------------------------------------------------------------------------------------
def train(script, dataset, tmp_path, name, *extra, runner=run_in_process):
    proc = runner([REPO / script, "--dataset-path", dataset, "--runs-dir", tmp_path / "runs", "--run-name", name, *TINY,
                   *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "runs" / name / "result.json").read_text())


def test_brpo_variants_tool(datasets, tmp_path):
    """benchmark/brpo_variants.py on a saved model: every variant is scored, reproducibly; bad input fails clearly."""
    train("brpo.py", datasets[0.15], tmp_path, "m", "--save-model")
    model = tmp_path / "runs" / "m" / "model.pt"
    proc = run_in_process([REPO / "benchmark" / "brpo_variants.py", model, "--episodes", "3"])
    assert proc.returncode == 0, proc.stderr
    scores = dict(re.findall(r"^(\S+)\s+(-?[\d.]+)\s+\(s\.e\.", proc.stdout, re.M))
    assert set(scores) == {"pi", "beta", "greedy", "q-greedy", "lam-const", "w-zero", "no-pess", "uniform"}
    assert all(np.isfinite(float(v)) for v in scores.values())
    again = run_in_process([REPO / "benchmark" / "brpo_variants.py", model, "--episodes", "3"])
    assert again.stdout == proc.stdout  # same start states and sampling seeds: the same numbers
    cert = run_in_process([REPO / "benchmark" / "brpo_variants.py", model, "--episodes", "1", "--certificate",
                           "--variants", "pi", "beta", "pess=0.5"])
    assert cert.returncode == 0, cert.stderr
    rows = re.findall(r"^  (\S+)\s+-?[\d.]+ \+- [\d.]+\s+lcb\s+(-?[\d.]+)\s+tv\s+([\d.]+)", cert.stdout, re.M)
    lcb, tv = {v: float(l) for v, l, _ in rows}, {v: float(t) for v, _, t in rows}
    assert set(lcb) == {"pi", "beta", "pess=0.5"} and lcb["beta"] == 0.0  # beta's improvement over itself
    assert tv["beta"] == 0.0 and 0.0 < tv["pi"] < 1.0 and tv["pess=0.5"] != tv["pi"]
    bad = run_in_process([REPO / "benchmark" / "brpo_variants.py", tmp_path / "none.pt"])
    assert bad.returncode != 0 and "cannot read" in bad.stderr
    bad = run_in_process([REPO / "benchmark" / "brpo_variants.py", model, "--variants", "nope"])
    assert bad.returncode != 0 and "unknown variant" in bad.stderr


def test_evaluations_draw_fresh_sampling_noise(datasets, tmp_path):
    """--lam 0 makes pi = beta whatever the networks learn, so the three evaluations score one policy on the
    same start states and differ only by pi's sampling noise. It must be fresh at each evaluation (seeded
    eval_seed + updates): the final score's 10-evaluation window then averages 10 draws of it."""
    r = train("brpo_c.py", datasets[0.15], tmp_path, "x", "--lam", "0")
    assert len({e["return_mean"] for e in r["evaluations"]}) == 3


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_end_to_end_deterministic(script, datasets, tmp_path):
    # strong settings so that pi departs from beta and the sampling path is really exercised
    extra = ["--kappa-max", "0.01", "--seed", "3"] + (["--save-model"] if script == "brpo.py" else [])
    r1 = train(script, datasets[0.15], tmp_path, "a", *extra)
    r2 = train(script, datasets[0.15], tmp_path, "b", *extra, runner=run)  # a new interpreter: another hash seed
    assert r1["evaluations"] == r2["evaluations"]
    assert r1["extra"] == r2["extra"]
    assert [e["step"] for e in r1["evaluations"]] == [100, 200, 300]
    assert r1["algorithm"] == script[:-3]
    for key in ("certificate", "certificate_se", "certificate_lcb", "tv_to_beta", "deployed_pi", "deployed_pessimism"):
        assert np.isfinite(r1["extra"][key])
    assert r1["extra"]["tv_to_beta"] > 0  # pi is not beta
    if script == "brpo.py":
        model = tmp_path / "runs" / "a" / "model.pt"
        proc = run_in_process([REPO / script, "--eval-checkpoint", model, "--eval-episodes", "2"])
        assert proc.returncode == 0, proc.stderr
        assert f"{r1['evaluations'][-1]['return_mean']:.2f}" in proc.stdout  # same policy, same eval seed


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_end_to_end_epsilon_zero(script, datasets, tmp_path):
    """eps = 0: beta is one-hot, rho and pi must keep zeros (log 0 everywhere) without NaN."""
    r = train(script, datasets[0.0], tmp_path, "x", "--epsilon", "0", "--kappa-max", "0.001", "--eval-greedy")
    assert all(np.isfinite(e["return_mean"]) for e in r["evaluations"])
    assert all(np.isfinite(v) for v in r["extra"].values())


def test_brpo_c_differs_only_in_confidence():
    import ast

    def top_level(path):
        src = path.read_text()
        return {n.name: ast.get_source_segment(src, n) for n in ast.parse(src).body
                if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

    brpo, brpo_c = top_level(REPO / "brpo.py"), top_level(REPO / "brpo_c.py")
    # every function and class the two files share is verbatim the same, except where the confidence enters
    differ = {name for name in brpo.keys() & brpo_c.keys() if brpo[name] != brpo_c[name]}
    assert differ == {"Args", "check_args", "policy_probs", "load_policy", "train"}
    assert set(brpo_c) - set(brpo) == {"ConstantConfidence"}
    brpo_src, c_src = (REPO / "brpo.py").read_text().splitlines(), set((REPO / "brpo_c.py").read_text().splitlines())
    # inside train, the critic update, the target update and the evaluation are verbatim the same lines
    for needle in ("next_v = mixed_value(next_q, batch(next_beta), mu32", "td_target = torch.addcmul(batch(rewards), next_v",
                   "common.soft_update(step, target_network, q_network, period, tau)", "runs.log(step, {\"charts/deployed_pi\": deploy_pi",
                   "common.deploy(runs, step, obs, next_obs, q_network", "unit = batch_unit if step == 1",
                   "td_loss = td_loss_of(q_taken, td_target)", "critic_loss = td_loss + (cql_alpha"):
        line = next(line for line in brpo_src if needle in line)
        assert line in c_src


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_deployed_pessimism_rule(script, datasets, tmp_path):
    """--deploy-pessimism 1 0: at every evaluation level 1 is deployed while its simultaneous lower bound (z of 0.975
    for two levels) is positive, else level 0 if certified and no farther from beta, else the level nearer beta
    (total variation on the batch); what is deployed is exactly the single-level run's pi at that level (training
    does not depend on the levels). The saved model deploys the last chosen level."""
    flags = ["--kappa-max", "0.01", "--seed", "4"]  # seed 4: both the certified and the nearest-to-beta branch occur
    both = train(script, datasets[0.15], tmp_path, "b", *flags, "--deploy-pessimism", "1", "0", "--save-model")
    one = {p: train(script, datasets[0.15], tmp_path, f"p{p}", *flags, "--deploy-pessimism", str(p)) for p in (1.0, 0.0)}
    z2 = 1.959963984540054
    branches = set()
    for i, e in enumerate(both["evaluations"]):
        single = {p: r["evaluations"][i] for p, r in one.items()}
        assert single[1.0]["certificate"] != single[0.0]["certificate"]  # the two levels deploy different policies
        lcb = {p: s["certificate"] - z2 * s["certificate_se"] for p, s in single.items()}
        chosen = single[e["pessimism"]]
        tv = {p: s["tv_to_beta"] for p, s in single.items()}
        assert 0.0 < tv[1.0] != tv[0.0] < 1.0
        expect = 1.0 if lcb[1.0] > 0 else 0.0 if lcb[0.0] > 0 and tv[0.0] <= tv[1.0] else min(tv, key=tv.get)
        branches.add("certified" if lcb[expect] > 0 else "nearest")
        assert e["pessimism"] == expect
        assert e["tv_to_beta"] == pytest.approx(tv[expect], rel=1e-12)
        assert e["certificate_lcb"] == pytest.approx(lcb[e["pessimism"]], rel=1e-12, abs=1e-12)
        assert e["return_mean"] == chosen["return_mean"] and e["certificate"] == chosen["certificate"]
    assert branches == {"certified", "nearest"}
    assert both["extra"]["deployed_pessimism"] == both["evaluations"][-1]["pessimism"]
    if script == "brpo.py":
        model = tmp_path / "runs" / "b" / "model.pt"
        proc = run_in_process([REPO / script, "--eval-checkpoint", model, "--eval-episodes", "2"])
        assert proc.returncode == 0, proc.stderr
        assert f"{both['evaluations'][-1]['return_mean']:.2f}" in proc.stdout


def test_deployed_levels_follow_the_trained_pessimism():
    """The first deployed level is pi as trained: --pessimism, then the paper's 0, or at --pessimism 0 our 1."""
    brpo = load_script("brpo.py")
    assert common.deploy_levels(brpo.Args()) == (0.0, 1.0)  # trained as the paper, our pessimism as the fallback
    assert common.deploy_levels(brpo.Args(pessimism=2.0)) == (2.0, 0.0)
    assert common.deploy_levels(brpo.Args(pessimism=0.0)) == (0.0, 1.0)
    assert common.deploy_levels(brpo.Args(pessimism=2.0, deploy_pessimism=(0.5,))) == (0.5,)


@pytest.mark.parametrize("script,flag,value", [("brpo.py", "mu", 1.5), ("brpo.py", "kappa_decay", 0.0),
                                               ("brpo.py", "kappa_max", -1.0), ("brpo.py", "kappa_scale", 0.0),
                                               ("brpo_c.py", "kappa_scale", float("inf")), ("brpo.py", "pessimism", -1.0), ("brpo.py", "confidence_learning_rate", 0.0),
                                               ("brpo.py", "penalty_scale", -0.1), ("brpo.py", "penalty_scale", 1e308),
                                               ("brpo_c.py", "cql_alpha", -0.1),
                                               ("brpo.py", "cql_alpha", float("inf")),
                                               ("brpo_c.py", "lam", 2.0), ("brpo.py", "certificate_confidence", 1.0),
                                               ("brpo_c.py", "certificate_gamma", 1.5), ("brpo.py", "deploy_pessimism", ()),
                                               ("brpo_c.py", "deploy_pessimism", (1.0, -0.5)),
                                               ("brpo.py", "deploy_pessimism", (float("nan"),)),
                                               ("brpo_c.py", "deploy_pessimism", (1.0, 0.0, 0.0))])
def test_bad_flags(script, flag, value):
    module = load_script(script)
    with pytest.raises(SystemExit, match="--" + flag.replace("_", "-")):
        module.check_args(module.Args(**{flag: value}))


def test_state_dependent_temperature_bounds_the_exponent(brpo):
    """With the paper's kappa(s) (no cap), tau grows like lambda^2 W^2: the relative-softmax exponent
    lambda W / tau stays bounded however large the critic's claimed advantage (for two equally likely actions
    by sup_x x / (1 + log(0.5 + 0.5 e^{x^2})) / (49.5 scale) = 0.619 / (49.5 scale)), while a constant
    temperature (a cap below 1) follows any claim."""
    beta = np.full((6, 2), 0.5)
    lam = np.ones((6, 2))
    w = np.array([[0.0, s] for s in (0.5, 1.0, 2.0, 5.0, 20.0, 100.0)])
    scale = 0.02
    exponent = np.abs(w[:, 1]) / brpo.temperature(beta, lam, w, 0.99, scale, np.inf, 1.0, 0)
    assert exponent.max() <= 0.62 / (49.5 * scale)
    assert exponent[-1] < exponent[3] < exponent[2]  # decreasing in the claimed advantage once it is large
    tau_const = brpo.temperature(beta, lam, w, 0.99, scale, 1.0, 1.0, 0)
    assert np.allclose(tau_const, 0.99)
    assert (np.abs(w[:, 1]) / tau_const)[-1] > 100


# ---------------------------------------------------------------------------------------------
# Improvement certificate and safety test
# ---------------------------------------------------------------------------------------------
def logged_batch(rng, episodes, length, epsilon, reward_of_action, obs_dim=4, timeout_every=0, noise=1.0):
    """A batch logged by an epsilon-greedy policy over 2 actions (greedy action 0 everywhere) in collection
    order: episodes of `length` steps, reward r(a) + noise * N(0, 1) per step, the last step terminal (or a
    time-limit truncation for every `timeout_every`-th episode). Random behaviour-network weights (only the
    certificate's state features use them)."""
    n = episodes * length
    beta = np.tile([1 - epsilon / 2, epsilon / 2], (n, 1))
    actions = (rng.random(n) < epsilon / 2).astype(np.int64)
    obs = rng.normal(size=(n + 1, obs_dim)).astype(np.float32)
    nxt = obs[1:].copy()
    terminals, timeouts = np.zeros(n, bool), np.zeros(n, bool)
    for e in range(episodes):
        last = (e + 1) * length - 1
        (timeouts if timeout_every and e % timeout_every == 0 else terminals)[last] = True
    sizes = [(32, obs_dim), (32,), (16, 32), (16,), (2, 16), (2,)]
    weights = {f"behavior_{k}": rng.normal(size=sz).astype(np.float32) for k, sz in zip(("w0", "b0", "w1", "b1", "w2", "b2"), sizes)}
    rewards = (np.asarray(reward_of_action)[actions] + noise * rng.normal(size=n)).astype(np.float32)
    return dict(observations=obs[:-1], next_observations=nxt, actions=actions, rewards=rewards, terminals=terminals,
                timeouts=timeouts, **weights), beta


def behavior_of(m, data):
    return m.BehaviorPolicy({k: data[f"behavior_{k}"] for k in ("w0", "b0", "w1", "b1", "w2", "b2")}, 0.3)


def test_certificate_returns_and_episodes():
    """Discounted returns-to-go inside each logged episode; a time-limit truncation ends an episode like a
    terminal; the trailing episode the collection cut off is left out."""
    m = common
    rng = np.random.default_rng(0)
    data, beta = logged_batch(rng, episodes=3, length=4, epsilon=0.5, reward_of_action=[1.0, 0.0], timeout_every=2)
    data = {k: v[:-2] if k.startswith(("obs", "next", "act", "rew", "term", "time")) else v for k, v in data.items()}
    beta = beta[:-2]  # the third episode is cut after 2 of its 4 steps
    data["rewards"] = np.arange(10, dtype=np.float32)
    cert, reason = m.certificate_data(data, beta, 0.5, behavior_of(m, data))
    assert reason is None
    np.testing.assert_array_equal(cert["rows"], np.arange(8))
    np.testing.assert_array_equal(cert["episode"], [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(cert["time"], [0, 1, 2, 3, 0, 1, 2, 3])  # t inside its episode
    assert cert["n_episodes"] == 2 and data["timeouts"][3] and data["terminals"][7]
    returns = [0 + .5 * (1 + .5 * (2 + .5 * 3)), 1 + .5 * (2 + .5 * 3), 2 + .5 * 3, 3,
               4 + .5 * (5 + .5 * (6 + .5 * 7)), 5 + .5 * (6 + .5 * 7), 6 + .5 * 7, 7]
    np.testing.assert_allclose(cert["returns"], returns, rtol=1e-12)
    np.testing.assert_array_equal(cert["beta_taken"], beta[np.arange(8), data["actions"][:8]])


def tabular_mdp(rng, n_states=5, gamma=0.9, stop=0.2):
    """A random MDP over 2 actions that ends with probability `stop` at every step, its behaviour policy beta and
    another policy pi (one row per state), and exact values by linear solves: Q^pi and J(pi) - J(beta) from s_0 = 0."""
    p = rng.dirichlet(np.ones(n_states), size=(n_states, 2)) * (1.0 - stop)  # P(s' | s, a), the rest ends
    r = rng.normal(size=(n_states, 2))
    beta, pi = rng.dirichlet(np.ones(2), size=n_states), rng.dirichlet([0.3, 0.3], size=n_states)

    def q_of(policy):
        p_pi = np.einsum("sat,tb->satb", p, policy).reshape(2 * n_states, 2 * n_states)  # (s, a) -> (s', a')
        return np.linalg.solve(np.eye(2 * n_states) - gamma * p_pi, r.reshape(-1)).reshape(n_states, 2)

    q_pi, q_beta = q_of(pi), q_of(beta)
    return p, r, beta, pi, q_pi, (pi[0] * q_pi[0]).sum() - (beta[0] * q_beta[0]).sum()


def test_performance_difference_is_exact_on_beta_episodes():
    """Departure 15's estimator, sum_t gamma^t sum_a (pi - beta)(a|s_t) Q^pi(s_t, a) averaged over beta's episodes,
    is J(pi) - J(beta) (the performance-difference lemma) for the true Q^pi on a random tabular MDP: within 4
    standard errors over 20,000 logged episodes and 5 MDPs; an error of Q^pi constant over actions changes nothing;
    pi = beta gains exactly 0."""
    gamma = 0.9
    for seed in range(5):
        rng = np.random.default_rng(seed)
        p, _, beta, pi, q_pi, truth = tabular_mdp(rng, gamma=gamma)
        states, episode, time = [], [], []
        for e in range(20_000):  # beta's episodes from s_0 = 0
            s, t = 0, 0
            while True:
                states.append(s), episode.append(e), time.append(t)
                a = int(rng.random() < beta[s, 1])
                nxt = rng.choice(len(p) + 1, p=np.append(p[s, a], 1.0 - p[s, a].sum()))
                if nxt == len(p):
                    break
                s, t = nxt, t + 1
        states = np.array(states)
        cert = {"beta": beta[states], "episode": np.array(episode), "time": np.array(time), "n_episodes": 20_000}
        out = common.performance_difference(pi[states], q_pi[states], cert, gamma)
        assert abs(out["fqe_gain"] - truth) < 4 * out["fqe_gain_se"] and 0 < out["fqe_gain_se"] < 0.05
        shifted = q_pi[states] + rng.normal(size=(len(states), 1)) * 100  # per state, the same for every action
        assert common.performance_difference(pi[states], shifted, cert, gamma)["fqe_gain"] == pytest.approx(
            out["fqe_gain"], abs=1e-9)
        assert common.performance_difference(beta[states], q_pi[states], cert, gamma)["fqe_gain"] == 0.0


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_evaluation_critic_gates_deployment(script, datasets, tmp_path):
    """Departure 15 (--evaluation-critic): every evaluation records the evaluation critic's gain of pi (finite) and
    deploys pi exactly when that gain is >= 0 (the safety test off); the critic changes nothing else: without it (the
    default) every certificate is the same, pi is always deployed, and no gain is recorded."""
    flags = ["--seed", "4", "--total-steps", "600"]
    on = train(script, datasets[0.15], tmp_path, "on", *flags, "--evaluation-critic")
    off = train(script, datasets[0.15], tmp_path, "off", *flags)
    for a, b in zip(on["evaluations"], off["evaluations"]):
        assert np.isfinite(a["fqe_gain"]) and a["fqe_gain_se"] > 0
        assert a["deployed"] == ("pi" if a["fqe_gain"] >= 0 else "beta")
        assert "fqe_gain" not in b and b["deployed"] == "pi"
        assert (a["certificate"], a["tv_to_beta"], a["pessimism"]) == (b["certificate"], b["tv_to_beta"], b["pessimism"])
        if a["deployed"] == "pi":
            assert a["return_mean"] == b["return_mean"]
    assert {e["deployed"] for e in on["evaluations"]} == {"pi", "beta"}  # seed 4: the gate closes at some evaluations


def test_certificate_is_unbiased_and_decides():
    """On a logged batch whose action 0 pays 1 more per step than action 1, the first-order improvement of the
    greedy policy over epsilon-greedy beta is known exactly (per step: beta(1) * (Q_beta(s, 0) - Q_beta(s, 1)) =
    beta(1), summed over the episode's steps). The estimate must find it within its standard error, certify the better
    policy, refuse the worse one, and be exactly 0 (not certified) for pi = beta."""
    m = common
    rng = np.random.default_rng(1)
    length, eps, gamma = 5, 0.3, 0.9
    data, beta = logged_batch(rng, episodes=4000, length=length, epsilon=eps, reward_of_action=[1.0, 0.0], noise=0.1)
    cert, reason = m.certificate_data(data, beta, gamma, behavior_of(m, data))
    assert reason is None and cert["n_episodes"] == 4000
    z = 1.6448536269514722
    taken, rows = cert["actions"], cert["rows"]
    # true rate: sum_t sum_a (pi - beta)(a) Q_beta(s_t, a); Q_beta(s_t, 0) - Q_beta(s_t, 1) = 1 at every step
    exact = length * (eps / 2) * 1.0
    greedy, worst = np.tile([1.0, 0.0], (len(rows), 1)), np.tile([0.0, 1.0], (len(rows), 1))
    # the control variate from a critic: a useless one (noise) and a good one (its action gap is right)
    t = np.arange(len(rows)) % length
    useless = rng.normal(size=(len(rows), 2))
    good = np.array([1.0, 0.0]) + ((1 - eps / 2) * gamma * (1 - gamma ** (length - 1 - t)) / (1 - gamma))[:, None]  # Q_beta
    found = {}
    for name, q in (("useless", useless), ("good", good), ("zero", np.zeros((len(rows), 2)))):
        better = m.improvement_certificate(greedy, q, cert, z)
        assert abs(better["certificate"] - exact) < 4 * better["certificate_se"], name  # unbiased with any critic
        assert better["certified"] == 1.0 and better["certificate_lcb"] > 0, name
        worse = m.improvement_certificate(worst, q, cert, z)
        assert worse["certificate"] < 0 and worse["certified"] == 0.0, name
        same = m.improvement_certificate(beta[rows], q, cert, z)
        assert same["certificate"] == 0.0 and same["certified"] == 0.0, name
        found[name] = better["certificate_se"]
    assert found["good"] < 0.5 * found["useless"]  # a critic that knows the action gap shrinks the error


def test_no_certificate_where_beta_never_acts():
    """A greedy behaviour (epsilon 0) never takes action 1: no logged return can check a critic that calls it 10 better.
    The estimate then is the critic's claim alone (its lower bound positive), and pi moving there is not certified;
    pi = beta, on the support, has no off-support mass."""
    rng = np.random.default_rng(4)
    length, gamma = 5, 0.9
    data, beta = logged_batch(rng, episodes=500, length=length, epsilon=0.0, reward_of_action=[1.0, 0.0], noise=0.1)
    cert, reason = common.certificate_data(data, beta, gamma, behavior_of(common, data))
    assert reason is None and cert["unsupported"] is not None
    t = np.arange(len(cert["rows"])) % length
    q0 = (1 - gamma ** (length - t)) / (1 - gamma)  # Q_beta(s_t, 0): the discounted return-to-go of action 0
    q = np.stack([q0, q0 + 10.0], 1)
    z = 1.6448536269514722
    off = common.improvement_certificate(np.tile([0.0, 1.0], (len(t), 1)), q, cert, z)
    assert off["certificate_lcb"] > 0 and off["off_support_mass"] == 1.0 and off["certified"] == 0.0
    same = common.improvement_certificate(beta[cert["rows"]], q, cert, z)
    assert same["off_support_mass"] == 0.0 and same["certified"] == 0.0


def test_choose_levels_builds_later_levels_only_where_needed():
    """The deployed-level rule for several members at once: a member whose first level is certified keeps it (and its
    later levels are never built), else the certified level with the highest lower bound among those no farther from
    beta than the first, else the level nearest beta; each member's choice is the one it gets alone."""
    rng = np.random.default_rng(5)
    data, beta = logged_batch(rng, episodes=400, length=5, epsilon=0.5, reward_of_action=[1.0, 0.0], noise=0.1)
    cert, reason = common.certificate_data(data, beta, 0.9, behavior_of(common, data))
    b, z = cert["beta"], 1.959963984540054
    good, bad = np.tile([1.0, 0.0], (len(b), 1)), np.tile([0.0, 1.0], (len(b), 1))
    near = 0.9 * b + 0.1 * bad  # worse than beta, but nearer to it than bad
    levels = [[good, bad], [bad, good], [bad, near], [near, good]]  # [member][level]: pi
    q_cv = common.control_variate(np.zeros((4, len(b), 2)), cert)
    asked = {}

    def pi_of(level, idx):
        asked[level] = list(idx)
        return np.stack([levels[i][level] for i in idx])

    chosen = common.choose_levels(pi_of, 2, q_cv, cert, z)
    assert reason is None and asked == {0: [0, 1, 2, 3], 1: [1, 2, 3]}
    assert [level for level, _, _ in chosen] == [0, 1, 1, 0]  # the last: good is certified but farther than near
    assert [c["certified"] for _, c, _ in chosen] == [1.0, 1.0, 0.0, 0.0]
    assert all(np.array_equal(pi, levels[i][level]) for i, (level, _, pi) in enumerate(chosen))
    assert common.improvement_certificate(good, None, cert, z, q_cv[3])["certified"] == 1.0
    for i, (level, c, _) in enumerate(chosen):
        alone = common.choose_levels(lambda lv, idx: np.stack([levels[i][lv]]), 2, q_cv[i:i + 1], cert, z)
        assert [a[:2] for a in alone] == [(level, c)]
        assert c["tv_to_beta"] == common.tv_to_beta(levels[i][level], b)


def test_no_certificate_from_rounding_noise():
    """One-step episodes with the same reward for either action: no policy improves on beta, and g and its standard
    error are rounding noise (~1e-16) whose lower bound can land above 0; that is not certified."""
    rng = np.random.default_rng(4)
    data, beta = logged_batch(rng, episodes=300, length=1, epsilon=0.5, reward_of_action=[1.0, 1.0], noise=0.0)
    cert, reason = common.certificate_data(data, beta, 0.9, behavior_of(common, data))
    n = len(cert["rows"])
    c = common.improvement_certificate(np.tile([1.0, 0.0], (n, 1)), np.ones((n, 2)), cert, 1.6448536269514722)
    assert reason is None and 0 < c["certificate_lcb"] < 1e-12 and c["certified"] == 0.0


def test_control_variate_batched_over_members():
    """control_variate fits every member's critic in one batched solve: each member's q_cv is bit for bit its fit
    alone, equals numpy's per-member least squares (the fit it replaced) to rounding, and a diverged member's NaN
    critic gives NaN for that member only instead of stopping the process."""
    rng = np.random.default_rng(3)
    data, beta = logged_batch(rng, episodes=60, length=8, epsilon=0.3, reward_of_action=[1.0, 0.0], noise=0.5)
    cert, _ = common.certificate_data(data, beta, 0.9, behavior_of(common, data))
    n = len(cert["rows"])
    q = rng.normal(size=(4, n, 2)) + cert["returns"][:, None]
    together = common.control_variate(q, cert)
    assert together.shape == q.shape
    for m in range(4):
        assert np.array_equal(together[m], common.control_variate(q[m], cert))
        fold, x_state = cert["episode"] % 2, np.concatenate([cert["state_features"], (cert["beta"] * q[m]).sum(1)[:, None],
                                                             q[m].max(1)[:, None]], 1)
        for f in (0, 1):
            fit, use = fold != f, fold == f
            x = np.concatenate([x_state[fit], q[m][fit, cert["actions"][fit]][:, None]], 1)
            coef = np.linalg.lstsq(x, cert["returns"][fit], rcond=None)[0]
            np.testing.assert_allclose(together[m][use], (x_state[use] @ coef[:-1])[:, None] + coef[-1] * q[m][use],
                                       rtol=1e-9, atol=1e-9)
    q[2, 3, 1] = np.nan
    with_nan = common.control_variate(q, cert)
    assert np.isnan(with_nan[2]).any() and np.array_equal(with_nan[[0, 1, 3]], together[[0, 1, 3]])


@pytest.mark.parametrize("n_actions", [1, 2, 3, 4, 7, 8, 11])
def test_row_reductions_are_numpys(n_actions):
    """row_sum and row_max (the per-action reductions of the deployment's 2.5M states) give numpy's numbers bit for
    bit, NaN included, with and without keepdims, on contiguous and strided arrays."""
    rng = np.random.default_rng(n_actions)
    x = rng.normal(size=(5, 301, n_actions)) * 10.0 ** rng.integers(-12, 12, size=(5, 301, n_actions))
    x[0, 0, 0] = np.nan
    for a in (x, x[:, ::3], np.asfortranarray(x)):
        for keep in (False, True):
            assert np.array_equal(common.row_sum(a, keep), a.sum(-1, keepdims=keep), equal_nan=True)
            assert np.array_equal(common.row_max(a, keep), a.max(-1, keepdims=keep), equal_nan=True)


@pytest.mark.parametrize("k", [2, 5, 6, 8])
def test_sort_rows_is_numpys_sort(k):
    """The sorting networks sort every 0/1 input (so every input: Knuth's 0-1 principle), and sort_rows gives
    np.sort's numbers, ties, signed zeros and infinities included."""
    import itertools
    for bits in itertools.product((0.0, 1.0), repeat=k):
        assert list(common.sort_rows([np.array([b]) for b in bits])[:, 0]) == sorted(bits)
    rng = np.random.default_rng(k)
    x = rng.choice([-np.inf, -1.5, -0.0, 0.0, 0.25, 3.0, np.inf], size=(k, 999)) * rng.integers(1, 3, size=(k, 999))
    assert np.array_equal(common.sort_rows(list(x)), np.sort(x, 0))


def test_certificate_refuses_batches_without_returns():
    """Shuffled rows have no returns-to-go; one complete episode has no standard error. Each is refused with a
    reason, not a number. (Logged actions with probability 0 under the stored beta: load_dataset refuses the batch.)"""
    m = common
    rng = np.random.default_rng(2)
    data, beta = logged_batch(rng, episodes=50, length=6, epsilon=0.3, reward_of_action=[1.0, 0.0])
    perm = rng.permutation(len(beta))
    shuffled = {k: v[perm] if k.startswith(("obs", "next", "act", "rew", "term", "time")) else v for k, v in data.items()}
    assert "episode order" in m.certificate_data(shuffled, beta[perm], 0.99, behavior_of(m, data))[1]
    one = {k: v[:6] if k.startswith(("obs", "next", "act", "rew", "term", "time")) else v for k, v in data.items()}
    assert "1 complete episode" in m.certificate_data(one, beta[:6], 0.99, behavior_of(m, data))[1]


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_deployment_of_many_members_on_one_dataset(script, datasets, tmp_path):
    """deploy evaluates the members of a dataset 25 at a time (its arrays are [members, N, |A|]): with 27 members,
    the first and the last (the second group) certify and deploy what their single runs do."""
    seeds, critic = [str(s) for s in range(1, 28)], "--evaluation-critic"  # departure 15 on: its gains too
    result = lambda name: json.loads((tmp_path / "runs" / name / "result.json").read_text())  # noqa: E731
    proc = run_in_process([REPO / script, "--dataset-path", datasets[0.15], "--runs-dir", tmp_path / "runs",
                           "--run-name", "m{seed}", *TINY, critic, "--seeds", *seeds])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for seed in ("1", "27"):
        member, alone = result(f"m{seed}"), train(script, datasets[0.15], tmp_path, f"a{seed}", critic, "--seed", seed)
        for e, f in zip(member["evaluations"], alone["evaluations"], strict=True):
            assert (e["pessimism"], e["deployed"], e["certified"]) == (f["pessimism"], f["deployed"], f["certified"])
            assert e["return_mean"] == f["return_mean"]
            for key in ("certificate", "certificate_lcb"):
                assert e[key] == pytest.approx(f[key], rel=1e-6, abs=1e-9)
            assert e["fqe_gain"] == pytest.approx(f["fqe_gain"], rel=1e-4, abs=1e-6)  # its own pi and Q^pi


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_members_of_different_pessimism_deploy_their_own_levels(script, datasets, tmp_path):
    """--sweep pessimism=0,1 in one process: each member chooses among its own levels ((0, 1) and (1, 0): the first
    is the one it was trained at), with its own Bonferroni z, exactly as its single run does (the first member's levels
    once served all)."""
    flags = ["--kappa-max", "0.01", "--seed", "4"]
    proc = run_in_process([REPO / script, "--dataset-path", datasets[0.15], "--runs-dir", tmp_path / "runs",
                           "--run-name", "p{pessimism}", *TINY, *flags, "--sweep", "pessimism=0,1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for p in ("0", "1"):
        member = json.loads((tmp_path / "runs" / f"p{p}" / "result.json").read_text())
        alone = train(script, datasets[0.15], tmp_path, f"a{p}", *flags, "--pessimism", p)
        assert {e["pessimism"] for e in member["evaluations"]} <= {0.0, 1.0}
        for e, f in zip(member["evaluations"], alone["evaluations"], strict=True):
            assert (e["pessimism"], e["deployed"], e["certified"], e["return_mean"]) == (
                f["pessimism"], f["deployed"], f["certified"], f["return_mean"])
            for key in ("certificate", "certificate_lcb"):
                assert e[key] == pytest.approx(f[key], rel=1e-6, abs=1e-9)
    assert any(e["pessimism"] == 1.0 for e in json.loads((tmp_path / "runs" / "p1" / "result.json").read_text())[
        "evaluations"])  # the member trained at 1 does deploy level 1, its own first level


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_conservative_critic_members(script, datasets, tmp_path):
    """--cql-alpha (departure 13) as a member flag: each member of --sweep cql_alpha=0,1 is its single run, and the
    conservative member's trained critic differs from the paper's critic's (the term is not dropped)."""
    proc = run_in_process([REPO / script, "--dataset-path", datasets[0.15], "--runs-dir", tmp_path / "runs",
                           "--run-name", "c{cql_alpha}", *TINY, "--seed", "2", "--sweep", "cql_alpha=0,1",
                           "--save-model"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = {}
    for alpha in ("0", "1"):
        member = json.loads((tmp_path / "runs" / f"c{alpha}" / "result.json").read_text())
        alone = train(script, datasets[0.15], tmp_path, f"a{alpha}", "--seed", "2", "--cql-alpha", alpha)
        assert [e["return_mean"] for e in member["evaluations"]] == [e["return_mean"] for e in alone["evaluations"]]
        weights[alpha] = torch.load(tmp_path / "runs" / f"c{alpha}" / "model.pt", weights_only=False)["q_network"]
    assert any(not torch.equal(weights["0"][k], weights["1"][k]) for k in weights["0"])


@pytest.mark.parametrize("script", ["brpo.py", "brpo_c.py"])
def test_safety_test_deploys_beta_until_certified(script, datasets, tmp_path):
    """On eps = 0 data pi = beta exactly (rho keeps beta's zeros): there is no improvement to certify, so
    --safety-test deploys beta and records it; by default (the paper) pi is deployed. Training is the same."""
    flags = ["--epsilon", "0"]
    gated = train(script, datasets[0.0], tmp_path, "g", *flags, "--safety-test")
    assert all(e["deployed"] == "beta" and e["certified"] == 0.0 for e in gated["evaluations"])
    assert gated["extra"]["deployed_pi"] == 0.0 and gated["extra"]["certificate"] == 0.0
    # the decision travels with the saved model: re-evaluating it deploys beta too
    gated = train(script, datasets[0.0], tmp_path, "s", *flags, "--safety-test", "--save-model")
    model = tmp_path / "runs" / "s" / "model.pt"
    proc = run_in_process([REPO / script, "--eval-checkpoint", model, "--eval-episodes", "2"])
    assert proc.returncode == 0 and "pi was not certified when saved" in proc.stdout, proc.stderr
    assert f"{gated['evaluations'][-1]['return_mean']:.2f}" in proc.stdout
    free = train(script, datasets[0.0], tmp_path, "f", *flags)
    assert all(e["deployed"] == "pi" for e in free["evaluations"])
    assert free["extra"] == gated["extra"] | {"deployed_pi": 1.0}


def test_solver_over_members_is_each_members_solver(brpo):
    """lambda-bar* of every member at once (the training loop's form) is exactly each member's own solve_confidence:
    members of different sizes of move, penalties (0 too) and kinds of states, including all-zero moves; with |A| >= 4
    more members than one padded chunk of the vertex sweep (MIXED_CHUNK), so padding and chunks are exercised."""
    rng = np.random.default_rng(21)
    for n_actions in (2, 3, 4, 5):
        for kind in KINDS:
            members = 5 if n_actions < 4 else 2 * brpo.MIXED_CHUNK + 1
            instances = [random_instance(rng, 32, n_actions, kind) for _ in range(members)]
            d = np.stack([x[0] * rng.choice([1e-3, 1.0, 10.0]) for x in instances])
            d[2] = 0.0  # a member whose candidate equals beta: lambda = 0
            w = np.stack([x[1] for x in instances])
            k = np.array([x[2] * rng.choice([0.01, 1.0, 100.0]) for x in instances])
            k[3::2] = 0.0  # no penalty (the LP): with |A| >= 4 more such members than one chunk too
            got = brpo.solve_confidence_members(d, w, k)
            for m in range(members):
                assert np.array_equal(got[m], brpo.solve_confidence(d[m], w[m], k[m])), (n_actions, kind, m)
