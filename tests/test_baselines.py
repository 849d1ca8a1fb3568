"""The baselines BCQ (bcq_discrete.py), KL-Q (klq.py), SPIBB (spibb.py) and CQL (cql_discrete.py): each one's
defining invariant on its own functions, no NaN/inf at epsilon 0.05, 0 and 1, and short end-to-end runs
(result.json, determinism, checkpoints). The contract shared with every script is in test_common.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, make_dataset, run

BASELINES = ("bcq_discrete.py", "klq.py", "spibb.py", "cql_discrete.py")
TINY = dict(env_id="CartPole-v1", total_steps=300, eval_frequency=100, eval_episodes=2, tensorboard=False)


def load_script(name):
    """Import a script as a module (tests may; scripts never import each other)."""
    spec = importlib.util.spec_from_file_location(f"baseline_{name[:-3]}", REPO / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bcq():
    return load_script("bcq_discrete.py")


@pytest.fixture(scope="module")
def klq():
    return load_script("klq.py")


@pytest.fixture(scope="module")
def spibb():
    return load_script("spibb.py")


@pytest.fixture(scope="module")
def cql():
    return load_script("cql_discrete.py")


@pytest.fixture(scope="module")
def data(datasets, tmp_path_factory):
    """Tiny CartPole datasets at eps 0.05 (made here), 0 and 1 (shared with test_common.py)."""
    eps005 = make_dataset(tmp_path_factory.mktemp("baselines") / "d.npz", epsilon=0.05)
    return {0.05: eps005, 0.0: datasets[0.0], 1.0: datasets[1.0]}


def train_in_process(module, dataset, epsilon, runs_dir, run_name, **overrides):
    args = dataclasses.replace(module.Args(), **{**TINY, "epsilon": epsilon, "dataset_path": str(dataset),
                                                 "runs_dir": str(runs_dir), "run_name": run_name, **overrides})
    module.main(args)
    return json.loads((runs_dir / run_name / "result.json").read_text())


def random_beta(n, n_actions, epsilon, generator):
    """epsilon-greedy distributions with a random greedy action, as in the datasets."""
    greedy = torch.randint(n_actions, (n,), generator=generator)
    beta = torch.full((n, n_actions), epsilon / n_actions)
    beta[torch.arange(n), greedy] += 1.0 - epsilon
    return beta


# ----------------------------------------------------------------------------------------------
# BCQ
def test_bcq_allowed_set_is_the_ratio_rule(bcq):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 4, generator=g) * 3
    probs = torch.softmax(logits.double(), 1)
    ratio = probs / probs.max(1, keepdim=True).values
    for tau in (0.1, 0.3, 0.5, 0.9):
        allowed = bcq.allowed_actions(logits, bcq.log_threshold(tau))
        clear = (ratio - tau).abs() > 1e-5  # away from float ties
        assert torch.equal(allowed[clear], (ratio >= tau)[clear])
        assert allowed.gather(1, logits.argmax(1, keepdim=True)).all()  # the most likely action always is
    assert bcq.allowed_actions(logits, bcq.log_threshold(0.0)).all()
    assert torch.equal(bcq.allowed_actions(logits, bcq.log_threshold(1.0)).sum(1), torch.ones(500, dtype=torch.long))


def bcq_towers(bcq, obs_dim, n_actions):
    """One member's Q and G networks as bcq_discrete.py stacks them (networks 0 and 1)."""
    return bcq.common.Stack([bcq.QNetwork(obs_dim, n_actions).net, bcq.QNetwork(obs_dim, n_actions).net])


def test_bcq_acts_and_bootstraps_only_on_allowed_actions(bcq):
    torch.manual_seed(0)
    net, target = bcq_towers(bcq, 4, 3), bcq_towers(bcq, 4, 3)
    with torch.no_grad():  # make the imitation net confident and the Q-net prefer other actions
        net.layers[2][0][1].mul_(20.0)
        net.layers[2][0][0].mul_(-50.0)
        target.layers[2][0][0].mul_(1e6)  # huge finite target values must not leak NaN either
    obs = torch.randn(2000, 4) * 2
    log_tau = bcq.log_threshold(0.3)
    with torch.no_grad():
        q, logits = (x[0] for x in bcq.towers(net, obs[None]))
        allowed = bcq.allowed_actions(logits, log_tau)
        assert not allowed.all(), "test needs disallowed actions"
        assert (q.argmax(1) != bcq.masked_argmax(q, allowed)).any(), "test needs the unconstrained argmax to be disallowed"
        actions = bcq.greedy_policy(net, log_tau)(obs[None])[0]
        assert allowed.gather(1, actions[:, None]).all()
        best_allowed = torch.where(allowed, q, -math.inf).max(1).values
        assert torch.equal(q.gather(1, actions[:, None]).squeeze(1), best_allowed)

        rewards, not_done = torch.randn(2000), (torch.rand(2000) > 0.1).float()
        y, next_allowed = (x[0] for x in bcq.bcq_target(net, target.part(slice(0, None, 2)), obs[None], rewards[None], not_done[None], 0.99,
                                                         log_tau))
        assert torch.equal(next_allowed, allowed) and torch.isfinite(y).all()
        # The target is the TARGET network's value of the ONLINE network's best allowed action.
        q_target = bcq.towers(target, obs[None])[0][0]
        expected = rewards + 0.99 * q_target.gather(1, actions[:, None]).squeeze(1) * not_done
        assert torch.equal(y, expected)
        # ... never the value of the unconstrained choice when that one is disallowed.
        unconstrained = q.argmax(1)
        rows = ~allowed.gather(1, unconstrained[:, None]).squeeze(1) & (not_done > 0)
        rows &= q_target.gather(1, unconstrained[:, None]).squeeze(1) != q_target.gather(1, actions[:, None]).squeeze(1)
        assert rows.sum() > 50
        naive = rewards + 0.99 * q_target.gather(1, unconstrained[:, None]).squeeze(1) * not_done
        assert (y[rows] != naive[rows]).all()


@pytest.mark.parametrize("deltas", [(1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (1.0, 0.0, 0.3)])
def test_bcq_hand_written_gradient_is_autograds(bcq, deltas):
    """loss_gradient, bcq_discrete.py's gradient of the summed loss with respect to the towers' outputs, equals
    autograd's of losses() exactly, for Huber's TD loss, the squared error, and members mixing them; and through
    Stack.backward, the networks' gradient."""
    torch.manual_seed(0)
    M, B, A = 3, 64, 3
    net = bcq.common.Stack([bcq.QNetwork(4, A).net for _ in range(2 * M)])
    delta = torch.tensor(deltas)[:, None]
    td_loss_of = bcq.common.td_loss(delta)
    obs, actions = torch.randn(M, B, 4), torch.randint(A, (M, B, 1))
    q_all, logits = bcq.towers(net, obs)
    td_target = q_all.detach().gather(-1, actions).squeeze(-1) + torch.randn(M, B) * 2  # errors within and beyond 1
    out = net(obs.repeat_interleave(2, 0))
    out.retain_grad()
    q_all, logits = out.unflatten(0, (-1, 2))[:, 0], out.unflatten(0, (-1, 2))[:, 1]
    td, imitation, penalty = bcq.losses(q_all, logits, actions, td_target, td_loss_of)
    (td + imitation + 0.01 * penalty).sum().backward()
    by_hand = bcq.loss_gradient(delta, B, A)(q_all.detach(), logits.detach(), actions, td_target)
    assert torch.equal(by_hand, out.grad)
    expected = net.gradient()
    bcq.towers(net, obs, keep=True)  # as the training update runs it
    assert torch.equal(net.backward(by_hand), expected)


def test_bcq_networks_are_two_independent_towers(bcq):
    torch.manual_seed(1)
    q_net, g_net = bcq.QNetwork(4, 2), bcq.QNetwork(4, 2)
    net = bcq.common.Stack([q_net.net, g_net.net])
    x = torch.randn(7, 4)
    q, logits = (out[0] for out in bcq.towers(net, x[None]))
    for tower, out in ((q_net, q), (g_net, logits)):  # each tower is exactly the network it was built from
        assert torch.allclose(out, tower(x), atol=1e-6)
    # The imitation loss alone moves G only.
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 0, 1, 0, 1, 0])).backward()
    grad = net.gradient()
    assert grad[0].abs().sum() == 0 and grad[1].abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# KL-Q
@pytest.mark.parametrize("kl_calc", ["sample", "integral"])
def test_klq_target_is_dqn_target_at_weight_zero(klq, kl_calc):
    g = torch.Generator().manual_seed(0)
    n, n_actions = 256, 3
    rewards, not_done = torch.randn(n, generator=g), (torch.rand(n, generator=g) > 0.2).float()
    next_q, q = torch.randn(n, n_actions, generator=g) * 50, torch.randn(n, n_actions, generator=g) * 50
    actions = torch.randint(n_actions, (n,), generator=g)
    for beta in (random_beta(n, n_actions, 0.05, g), random_beta(n, n_actions, 0.0, g)):
        dqn = rewards + 0.99 * next_q.max(1).values * not_done  # dqn_offline.py's target, same operations
        assert torch.equal(klq.klq_target(rewards, not_done, next_q, q, actions, beta, 0.99, 0.0, kl_calc), dqn)
        y = klq.klq_target(rewards, not_done, next_q, q, actions, beta, 0.99, 0.1, kl_calc)
        assert torch.isfinite(y).all()
        assert torch.allclose(y - dqn, klq.kl_reward(q, actions, beta, 0.1, kl_calc), atol=1e-4)


def test_klq_reward_formulas_and_zero_probabilities(klq):
    g = torch.Generator().manual_seed(1)
    n, n_actions = 200, 4
    q = torch.randn(n, n_actions, generator=g) * 30
    actions = torch.randint(n_actions, (n,), generator=g)
    log_pi = torch.log_softmax(q.double(), 1)
    beta = random_beta(n, n_actions, 0.2, g)
    sample = klq.kl_reward(q, actions, beta, 0.1, "sample")
    expected = 0.1 * (beta.double().log() - log_pi).gather(1, actions[:, None]).squeeze(1)
    assert torch.allclose(sample.double(), expected, atol=1e-4)
    integral = klq.kl_reward(q, actions, beta, 0.1, "integral")
    assert torch.allclose(integral.double(), -0.1 * (beta * (beta.double().log() - log_pi)).sum(1), atol=1e-4)
    assert (integral <= 1e-6).all()  # a KL is never negative
    # epsilon = 0: beta has exact zeros, the rewards stay finite (zeros of beta are floored / weighted by 0).
    beta0 = random_beta(n, n_actions, 0.0, g)
    for kl_calc in ("sample", "integral"):
        assert torch.isfinite(klq.kl_reward(q, actions, beta0, 0.1, kl_calc)).all()
    off_support = actions != beta0.argmax(1)
    floored = 0.1 * (math.log(1e-8) - log_pi.gather(1, actions[:, None]).squeeze(1))  # log beta floored at 1e-8
    assert torch.allclose(klq.kl_reward(q, actions, beta0, 0.1, "sample")[off_support].double(), floored[off_support], atol=1e-4)


# ----------------------------------------------------------------------------------------------
# SPIBB
def test_spibb_policy_invariants(spibb):
    g = torch.Generator().manual_seed(0)
    n, n_actions = 1000, 4
    q = torch.randn(n, n_actions, generator=g)
    beta = torch.distributions.Dirichlet(torch.full((n_actions,), 0.7)).sample((n,))
    beta[:100] = random_beta(100, n_actions, 0.0, g)  # exact zeros
    for threshold in (0.0, 0.1, 0.2, 0.4, 1.0):
        pi = spibb.spibb_policy(q, beta, threshold)
        boot = beta < threshold
        assert (pi >= 0).all() and torch.allclose(pi.sum(1), torch.ones(n), atol=1e-6)
        assert torch.equal(pi[boot], beta[boot])  # beta kept on the bootstrapped set
        free = ~boot
        some_free = free.any(1)
        # all the free mass goes to the best free action, the other free actions get nothing
        best = torch.where(free, q, -math.inf).argmax(1)
        free_mass = beta.masked_fill(boot, 0.0).sum(1)
        rows = torch.arange(n)[some_free]
        assert torch.allclose(pi[rows, best[some_free]], free_mass[some_free], atol=1e-6)
        others = free.clone()
        others[torch.arange(n), best] = False
        assert (pi[others] == 0).all()
        # every action bootstrapped: pi is beta
        assert torch.equal(pi[~some_free], beta[~some_free])
    uniform = torch.full((5, n_actions), 1.0 / n_actions)
    assert torch.equal(spibb.spibb_policy(q[:5], uniform, 0.3), uniform)  # all bootstrapped
    assert torch.equal(spibb.spibb_policy(q, beta, 0.0), torch.nn.functional.one_hot(q.argmax(1), n_actions).float())


@pytest.mark.parametrize("epsilon", [0.0, 0.05, 0.5, 1.0])
def test_spibb_target_is_expectation_under_pi_spibb(spibb, epsilon):
    g = torch.Generator().manual_seed(2)
    n, n_actions = 512, 3
    rewards, not_done = torch.randn(n, generator=g), (torch.rand(n, generator=g) > 0.2).float()
    next_q = torch.randn(n, n_actions, generator=g) * 100
    beta = random_beta(n, n_actions, epsilon, g)
    for threshold in (0.0, 0.2, 0.4, 1.0):
        y = spibb.spibb_target(rewards, not_done, next_q, beta, threshold, 0.99)
        pi = spibb.spibb_policy(next_q, beta, threshold)
        assert torch.isfinite(y).all()
        assert torch.allclose(y, rewards + 0.99 * (pi * next_q).sum(1) * not_done, atol=1e-3)
    dqn = rewards + 0.99 * next_q.max(1).values * not_done
    assert torch.equal(spibb.spibb_target(rewards, not_done, next_q, beta, 0.0, 0.99), dqn)


def test_spibb_beta_from_behaviour_network_matches_dataset(spibb, data):
    for eps, path in data.items():
        with np.load(path) as f:
            weights = {k: f[f"behavior_{k}"] for k in spibb.common.BEHAVIOR_KEYS}
            for obs_key, probs_key in (("observations", "behavior_probs"), ("next_observations", "next_behavior_probs")):
                beta = spibb.common.BehaviorPolicy(weights, eps)(torch.from_numpy(f[obs_key])).numpy()
                assert np.allclose(beta, f[probs_key], atol=1e-6)


def test_spibb_evaluation_policy(spibb, data, tmp_path):
    """Sampling acts only with actions pi_spibb gives mass to, both ways are reproducible, and with
    CartPole eps <= 0.25 pi_spibb is beta itself (its non-greedy action has beta < 0.2)."""
    with np.load(data[0.05]) as f:
        weights = {k: f[f"behavior_{k}"] for k in spibb.common.BEHAVIOR_KEYS}
        obs = f["observations"][:500]
    q_network = spibb.QNetwork(4, 2)
    behavior = spibb.common.BehaviorPolicy(weights, 0.05)
    beta = behavior(torch.from_numpy(obs)).float()
    pi = spibb.spibb_policy(q_network(torch.from_numpy(obs)).detach(), beta, 0.2)
    assert torch.allclose(pi, beta)
    q, member_beta = spibb.common.Stack([q_network.net]), lambda o: behavior(o[0])[None]  # one member
    u = torch.rand(len(obs), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a1 = spibb.make_policy(q, member_beta, 0.2, False)(torch.from_numpy(obs)[None], u)[0].numpy()
        assert np.array_equal(a1, spibb.make_policy(q, member_beta, 0.2, False)(torch.from_numpy(obs)[None], u)[0].numpy())
        assert (pi.numpy()[np.arange(len(obs)), a1] > 0).all() and (a1 != beta.argmax(1).numpy()).any()
        greedy = spibb.make_policy(q, member_beta, 0.2, True)(torch.from_numpy(obs)[None], u)[0].numpy()
    assert np.array_equal(greedy, pi.argmax(1).numpy())


# ----------------------------------------------------------------------------------------------
# CQL
def test_cql_gap_is_logsumexp_minus_the_batch_action_value(cql):
    """cql_gap against log(sum_a exp Q(s, a)) - Q(s, a_data) computed in float64 on its own (shifted by the max, so
    that Q of a few hundred does not overflow); it is never negative, and its gradient, the push of eq. 4 on Q, is
    softmax(Q(s, .)) - onehot(a_data): down on every action by its softmax weight, up on the batch's action."""
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 300.0):
        q = (torch.randn(2, 64, 3, generator=g) * scale).requires_grad_()
        actions = torch.randint(3, (2, 64), generator=g)
        gap = cql.cql_gap(q, actions)
        qd = q.detach().double().numpy()
        top, taken = qd.max(-1), np.take_along_axis(qd, actions.numpy()[..., None], -1)[..., 0]
        reference = top + np.log(np.exp(qd - top[..., None]).sum(-1)) - taken
        assert gap.shape == (2, 64) and np.allclose(gap.detach().double().numpy(), reference, rtol=1e-6, atol=1e-4)
        assert (gap >= 0).all()
        gap.sum().backward()
        push = torch.softmax(q.detach().double(), -1) - torch.nn.functional.one_hot(actions, 3).double()
        assert torch.allclose(q.grad.double(), push, atol=1e-6)
    # equal Q on every action: the gap is log |A| whatever the batch's action
    assert torch.allclose(cql.cql_gap(torch.full((1, 5, 4), 7.0), torch.arange(5)[None] % 4), torch.full((1, 5), math.log(4)))


# ----------------------------------------------------------------------------------------------
# Runs
@pytest.mark.parametrize("name", BASELINES)
def test_no_nan_at_eps_005_0_and_1(name, data, tmp_path):
    module = load_script(name)
    for eps, path in data.items():
        result = train_in_process(module, path, eps, tmp_path, f"e{eps:g}", save_model=True)
        assert all(np.isfinite([e["return_mean"], e["return_std"]]).all() for e in result["evaluations"]), eps
        assert all(np.isfinite(v) for v in result["extra"].values()), (eps, result["extra"])
        state = torch.load(tmp_path / f"e{eps:g}" / "model.pt", weights_only=True)
        net = state.get("network", state.get("q_network"))
        assert all(torch.isfinite(v).all() for v in net.values()), eps


def test_klq_weight_zero_and_spibb_threshold_zero_are_dqn(data, tmp_path):
    """Both reduce to the offline DQN update: the same network bit for bit, and the same as
    dqn_offline.py up to the rounding of fused vs. per-parameter Adam."""
    nets = {}
    for name, overrides in (("klq.py", dict(kl_weight=0.0)), ("spibb.py", dict(spibb_threshold=0.0)),
                            ("dqn_offline.py", {})):
        train_in_process(load_script(name), data[0.05], 0.05, tmp_path, name, save_model=True, **overrides)
        nets[name] = torch.load(tmp_path / name / "model.pt", weights_only=True)["q_network"]
    for k in nets["klq.py"]:
        assert torch.equal(nets["klq.py"][k], nets["spibb.py"][k])
        assert torch.allclose(nets["klq.py"][k], nets["dqn_offline.py"][k], atol=1e-4)


def test_cql_alpha_zero_is_dqn(data, tmp_path):
    """At alpha 0 cql_discrete.py trains dqn_offline.py's network with Huber's loss (CQL's default, departure 2) bit
    for bit (the regulariser's zero gradient adds exact zeros), and with the squared error at --huber-delta 0; at
    alpha 1 it does not."""
    nets = {}
    for name, overrides in (("cql_discrete.py", dict(cql_alpha=0.0)), ("dqn_offline.py", dict(huber_delta=1.0)),
                            ("cql_discrete.py", dict(cql_alpha=0.0, huber_delta=0.0)), ("dqn_offline.py", {}),
                            ("cql_discrete.py", dict(cql_alpha=1.0))):
        run_name = name + str(overrides)
        train_in_process(load_script(name), data[0.05], 0.05, tmp_path, run_name, save_model=True, **overrides)
        nets[run_name] = torch.load(tmp_path / run_name / "model.pt", weights_only=True)["q_network"]
    dqn_huber, alpha0, dqn, alpha0_squared, alpha1 = (nets[k] for k in (
        "dqn_offline.py{'huber_delta': 1.0}", "cql_discrete.py{'cql_alpha': 0.0}", "dqn_offline.py{}",
        "cql_discrete.py{'cql_alpha': 0.0, 'huber_delta': 0.0}", "cql_discrete.py{'cql_alpha': 1.0}"))
    assert all(torch.equal(dqn_huber[k], alpha0[k]) for k in dqn)
    assert all(torch.equal(dqn[k], alpha0_squared[k]) for k in dqn)
    assert not all(torch.equal(dqn[k], dqn_huber[k]) for k in dqn)  # the default loss is not the squared error
    assert not all(torch.equal(dqn_huber[k], alpha1[k]) for k in dqn)


def test_cql_alpha_is_a_member_flag(cql, data, tmp_path, monkeypatch):
    """--sweep cql-alpha=0,2: each member trains as the run with its alpha alone (the [M, 1] column reaches each
    member's loss), and the larger alpha ends with the smaller gap logsumexp_a Q - Q(s, a_data) on its minibatches."""
    seen = {}

    def log(self, step, scalars, every=100):
        for name, values in (scalars() if callable(scalars) else scalars).items():
            seen.setdefault(name, []).append(torch.as_tensor(values).detach().double())
    monkeypatch.setattr(cql.common.Members, "log", log)

    def losses(**overrides):
        seen.clear()
        cql.main(dataclasses.replace(cql.Args(), **{**TINY, "total_steps": 1000, "eval_frequency": 500, "epsilon": 0.05,
                                                    "dataset_path": str(data[0.05]), "runs_dir": str(tmp_path), **overrides}))
        return {name: torch.stack(v) for name, v in seen.items()}  # name -> [updates, members]
    together = losses(sweep=("cql-alpha=0,2",), run_name="a{cql_alpha}")
    alone = [losses(cql_alpha=a, run_name=f"alone{a:g}") for a in (0.0, 2.0)]
    for m, single in enumerate(alone):
        for name in ("losses/td_loss", "losses/cql_loss"):
            assert torch.allclose(together[name][:, m], single[name][:, 0], rtol=1e-4, atol=1e-6), (m, name)
        assert (single["losses/cql_loss"] >= 0).all()
    assert json.loads((tmp_path / "a2" / "result.json").read_text())["args"]["cql_alpha"] == 2.0
    last = [single["losses/cql_loss"][-100:].mean().item() for single in alone]
    assert last[1] < 0.75 * last[0], last  # measured: 0.69 (about log 2: CartPole's two Q values alike) and 0.39


@pytest.mark.parametrize("name,option", [("bcq_discrete.py", "--bcq-threshold"), ("klq.py", "--kl-weight"),
                                         ("spibb.py", "--spibb-threshold"), ("cql_discrete.py", "--cql-alpha")])
def test_end_to_end_determinism_and_checkpoint(name, option, data, tmp_path):
    module = load_script(name)
    ra = train_in_process(module, data[0.05], 0.05, tmp_path, "a", seed=5)
    rb = train_in_process(module, data[0.05], 0.05, tmp_path, "b", seed=5)
    assert ra["evaluations"] == rb["evaluations"] and ra["extra"] == rb["extra"]

    cmd = [REPO / name, "--env-id", "CartPole-v1", "--epsilon", "0.05", "--dataset-path", data[0.05], "--runs-dir",
           tmp_path, "--run-name", "cli", "--total-steps", "300", "--eval-frequency", "100", "--eval-episodes", "2",
           "--seed", "5", "--save-model", "--no-tensorboard"]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "cli" / "result.json").read_text())
    assert result["algorithm"] == name[:-3] and result["evaluations"] == ra["evaluations"]
    assert [e["step"] for e in result["evaluations"]] == [100, 200, 300] and result["format_version"] == 1
    assert result["args"][option[2:].replace("-", "_")] == pytest.approx({"--bcq-threshold": 0.3, "--kl-weight": 0.1,
                                                                           "--spibb-threshold": 0.2,
                                                                           "--cql-alpha": 1.0}[option])
    ev = run([REPO / name, "--eval-checkpoint", tmp_path / "cli" / "model.pt", "--eval-episodes", "2"])
    assert ev.returncode == 0, ev.stderr
    assert float(re.search(r"return (-?[\d.]+)", ev.stdout).group(1)) == pytest.approx(
        result["evaluations"][-1]["return_mean"], abs=0.01)


def test_bad_algorithm_options_fail_clearly(data, tmp_path):
    for name, overrides, needle in (("bcq_discrete.py", dict(bcq_threshold=1.5), "--bcq-threshold"),
                                    ("klq.py", dict(kl_weight=-0.1), "--kl-weight"),
                                    ("spibb.py", dict(spibb_threshold=-0.2), "--spibb-threshold"),
                                    ("cql_discrete.py", dict(cql_alpha=-1.0), "--cql-alpha"),
                                    ("cql_discrete.py", dict(cql_alpha=float("inf")), "--cql-alpha")):
        with pytest.raises(SystemExit) as exc:
            train_in_process(load_script(name), data[0.05], 0.05, tmp_path / "runs", "x", **overrides)
        assert needle in str(exc.value.code) and not (tmp_path / "runs").exists()
