"""Many runs in one process (common.Members): a member is the same algorithm as the run with its seed alone, members
fail alone, each writes its own run directory, and the batched evaluation scores what one simulator per episode
scores."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import gymnasium as gym
import numpy as np
import pytest
import torch

import common
from conftest import ALGORITHMS, run_in_process
from test_common import REPO, load_script

TINY = dict(total_steps=300, eval_frequency=100, eval_episodes=2, tensorboard=False)


@pytest.fixture
def task_datasets(datasets, tmp_path, monkeypatch):
    """The tiny datasets at their default paths (datasets/<env>_eps<e>.npz) of a repo in tmp_path, so that --epsilons
    trains on them."""
    (tmp_path / "datasets").mkdir()
    for eps, path in datasets.items():
        shutil.copy(path, tmp_path / "datasets" / f"CartPole-v1_eps{eps:g}.npz")
    monkeypatch.setattr(common, "REPO", tmp_path)
    return tmp_path


def recorded_losses(module, monkeypatch, **flags) -> dict:
    """Train in this process and record every member's logged training scalars at every update."""
    seen = {}

    def log(self, step, scalars, every=100):
        for name, values in (scalars() if callable(scalars) else scalars).items():
            seen.setdefault(name, []).append(np.asarray(torch.as_tensor(values).detach().double()))
    monkeypatch.setattr(common.Members, "log", log)
    module.main(dataclasses.replace(module.Args(), **{**TINY, **flags}))
    return {name: np.stack(v) for name, v in seen.items()}  # name -> [updates, members]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_member_is_the_run_with_its_seed_alone(name, task_datasets, tmp_path, monkeypatch):
    """Members train on their own datasets with their own seeds: the same losses as the single runs over the first
    1,000 updates (float tolerance: batched kernels), evaluated at the same steps; and the members' run repeated is
    the same bit for bit (losses, evaluation returns, final scores)."""
    module = load_script(name)
    flags = dict(total_steps=1000, eval_frequency=500, runs_dir=str(tmp_path / "runs"),
                 **({"evaluation_critic": True} if hasattr(module.Args, "evaluation_critic") else {}))  # BRPO's too
    together = recorded_losses(module, monkeypatch, seeds=(1, 2), epsilons=(0.15, 1.0), run_name="{epsilon}/{seed}",
                               **flags)
    again = recorded_losses(module, monkeypatch, seeds=(1, 2), epsilons=(0.15, 1.0), run_name="again{epsilon}/{seed}",
                            **flags)
    assert together.keys() == again.keys() and all(np.array_equal(together[k], again[k], equal_nan=True) for k in again)
    for eps, seed in [(0.15, 1), (0.15, 2), (1.0, 1), (1.0, 2)]:
        first, second = (json.loads((tmp_path / "runs" / f"{prefix}{eps:g}" / str(seed) / "result.json").read_text())
                         for prefix in ("", "again"))
        assert first["evaluations"] == second["evaluations"] and first["final_score"] == second["final_score"]
    for m, (eps, seed) in enumerate([(0.15, 1), (0.15, 2), (1.0, 1), (1.0, 2)]):
        alone = recorded_losses(module, monkeypatch, seed=seed, epsilon=eps, run_name=f"alone{eps:g}_{seed}", **flags)
        for loss in ("losses/td_loss", "losses/nll", "losses/cql_loss", "losses/fqe_td_loss"):
            if loss in alone:
                np.testing.assert_allclose(together[loss][:, m], alone[loss][:, 0], rtol=1e-4, atol=1e-6)
        member = json.loads((tmp_path / "runs" / f"{eps:g}" / str(seed) / "result.json").read_text())
        single = json.loads((tmp_path / "runs" / f"alone{eps:g}_{seed}" / "result.json").read_text())
        assert (member["seed"], member["epsilon"], member["args"]["seed"]) == (seed, eps, seed)
        assert member["args"]["seeds"] is None and member["args"]["sweep"] == []  # the single run's schema
        assert set(member) == set(single) and member["members"] == 4 and single["members"] == 1
        assert [e["step"] for e in member["evaluations"]] == [e["step"] for e in single["evaluations"]]


def test_minibatches_and_initial_weights_are_the_single_runs():
    """Member m draws torch.randint(n_m, (batch,)) from a generator seeded with its seed, as the run alone does,
    and starts from the weights nn.Linear gives after torch.manual_seed(seed)."""
    class Fake:
        def __init__(self, seed):
            self.seed, self.batch_size = seed, 8
    members = object.__new__(common.Members)
    members.args, members.first, members.sizes = [Fake(3), Fake(5)], Fake(3), [50, 70]
    members.offsets = torch.tensor([[0], [50]])
    members.generators = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(5)]
    alone = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(5)]
    for step in range(1, 2500):
        batch = members.minibatch(step)
        idx = batch.idx
        assert torch.equal(idx[0], torch.randint(50, (8,), generator=alone[0]))
        if step % 500 == 1:  # batch(t) is t[idx], for tensors and numpy arrays of any trailing shape
            data = torch.randn(120, 3, 2)
            assert torch.equal(batch(data), data[idx]) and torch.equal(batch(data[:, 0, 0]), data[idx, 0, 0])
            assert np.array_equal(batch(data.numpy()), data.numpy()[idx.numpy()])
        assert torch.equal(idx[1] - 50, torch.randint(70, (8,), generator=alone[1]))
    nets = members.build(lambda: [torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))])
    stack = common.Stack(nets[0])
    for k, seed in enumerate((3, 5)):
        torch.manual_seed(seed)
        ref = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        assert all(torch.equal(a, b) for a, b in zip(stack.state_dict(k).values(), ref.state_dict().values()))
        x = torch.randn(10, 4)
        assert torch.allclose(stack(x.expand(2, 10, 4))[k], ref(x), atol=1e-6)


def test_adams_floor_under_sqrt_changes_no_bit():
    """Adam floors v at 1e-36 before its sqrt and flushes subnormal m to 0 (subnormals are slow): the update equals
    the unfloored, unflushed formula exactly, for v and m holding zeros, subnormals and normal values, at the first
    step, an early and a late one; no subnormal m is left after a flush (every 100 updates)."""
    torch.manual_seed(0)
    stack = common.Stack([torch.nn.Sequential(torch.nn.Linear(20, 30)) for _ in range(2)])
    adam = common.Adam(stack, torch.tensor([[1e-3], [3e-2]]))
    for t in (0, 99, 99_999):
        adam.t = t
        adam.v = torch.rand_like(stack.flat) * torch.logspace(-45, 0, stack.flat.shape[1])  # zeros to 1
        adam.v[:, :50] = 0.0
        adam.m = torch.randn_like(stack.flat) * 1e-3
        adam.m[:, 50:150] = torch.randn(2, 100) * 1e-39  # m of dead units, decayed into subnormals
        g = torch.randn_like(stack.flat) * torch.logspace(-30, 0, stack.flat.shape[1])
        g[:, 50:150] = 0.0
        m = adam.m.lerp(g, 0.1)
        v = adam.v.mul(0.999).addcmul(g, g, value=0.001)
        assert (v < torch.finfo(torch.float32).tiny).float().mean() > 0.1  # the case this is about
        denom = (v.sqrt() / math.sqrt(1.0 - 0.999 ** (t + 1))).add_(1e-8)
        expected = stack.flat.addcdiv(m * (adam.lr / (1.0 - 0.9 ** (t + 1))), denom, value=-1.0)
        assert ((m != 0) & (m.abs() < torch.finfo(torch.float32).tiny)).sum() > 100
        adam.step(g)
        assert torch.equal(stack.flat, expected)
        assert ((adam.m != 0) & (adam.m.abs() < torch.finfo(torch.float32).tiny)).any() == (t == 0)


def test_stacks_backward_is_autograds_bit_for_bit():
    """Stack.backward(g) after forward_saved(x) is the gradient autograd gives __call__'s output for the loss
    sum(out * g), exactly, with dead ReLU units and several networks."""
    torch.manual_seed(0)
    stack = common.Stack([torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                                              torch.nn.ReLU(), torch.nn.Linear(16, 3)) for _ in range(4)])
    for _ in range(3):
        x, g = torch.randn(4, 64, 5), torch.randn(4, 64, 3)
        (stack(x) * g).sum().backward()
        expected = stack.gradient()
        out = stack.forward_saved(x)
        assert torch.equal(out, stack(x).detach())
        assert (stack.saved[1] == 0).float().mean() > 0.2  # dead units: ReLU's backward matters
        assert torch.equal(stack.backward(g), expected)
        stack.flat.add_(0.1 * torch.randn_like(stack.flat))  # the views see the new weights


def test_adam_is_torch_adam_per_member():
    """common.Adam with each member's learning rate is torch.optim.Adam on each network alone."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)) for _ in range(2)]
    refs = [torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)) for _ in range(2)]
    for net, ref in zip(nets, refs):
        ref.load_state_dict(net.state_dict())
    stack, lrs = common.Stack(nets), (1e-3, 3e-2)
    adam = common.Adam(stack, torch.tensor([[lrs[0]], [lrs[1]]]))
    ref_adams = [torch.optim.Adam(r.parameters(), lr=lr) for r, lr in zip(refs, lrs)]
    for _ in range(50):
        x = torch.randn(2, 16, 3)
        stack(x).square().mean((1, 2)).sum().backward()
        adam.step()
        for k, (ref, opt) in enumerate(zip(refs, ref_adams)):
            opt.zero_grad()
            ref(x[k]).square().mean().backward()
            opt.step()
    for k, ref in enumerate(refs):
        for a, b in zip(stack.state_dict(k).values(), ref.state_dict().values()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_td_loss_is_the_squared_error_or_hubers_per_member():
    """common.td_loss: delta 0 is the paper's squared error to the bit, delta > 0 Huber's loss (torch's, and at delta 1
    discrete BCQ's smooth L1 to the bit, values and gradients), each member with its own delta; no transition's
    gradient exceeds delta / batch."""
    torch.manual_seed(0)
    q, target = (torch.randn(3, 64) * 50.0).requires_grad_(), torch.randn(3, 64) * 50.0
    delta = torch.tensor([[0.0], [1.0], [0.3]])
    loss = common.td_loss(delta)(q, target)
    loss.sum().backward()
    e = (q - target).detach()
    assert torch.equal(loss[0], e[0].square().mean())
    assert torch.equal(loss[1], torch.nn.functional.smooth_l1_loss(q[1], target[1]))
    assert torch.allclose(loss[2], torch.nn.functional.huber_loss(q[2], target[2], delta=0.3), rtol=1e-6)
    ref = q.detach()[1].clone().requires_grad_()
    torch.nn.functional.smooth_l1_loss(ref, target[1]).backward()
    assert torch.equal(q.grad[1], ref.grad)
    assert torch.equal(q.grad[0], 2.0 * e[0] / 64) and (q.grad[1:].abs() <= delta[1:] / 64 + 1e-9).all()
    assert (e[1:].abs() > 1.0).float().mean() > 0.9  # the linear part is what is tested
    assert torch.equal(common.td_loss(torch.zeros(3, 1))(q, target), (q - target).square().mean(1))


@pytest.mark.parametrize("script", ALGORITHMS)
def test_a_diverging_member_fails_alone(script, datasets, tmp_path):
    """--sweep learning-rate=1e-3,1e30: the second member's weights overflow; it fails in one line (no warning about
    its NaN either) and leaves no directory, the first finishes; the exit status says a run failed."""
    proc = run_in_process([REPO / script, "--dataset-path", datasets[0.15], "--runs-dir", tmp_path,
                           "--run-name", "lr{learning_rate}", "--sweep", "learning-rate=0.001,1e30", "--total-steps",
                           "100", "--eval-frequency", "100", "--eval-episodes", "2", "--no-tensorboard"])
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "lr1e+30" in errors[0] and "training diverged" in errors[0]
    assert (tmp_path / "lr0.001" / "result.json").is_file()
    assert not (tmp_path / "lr1e+30").exists()  # as if it had not started
    result = json.loads((tmp_path / "lr0.001" / "result.json").read_text())
    assert result["args"]["learning_rate"] == 0.001 and result["members"] == 2


def test_member_names_sweeps_and_skip_finished(datasets, tmp_path):
    base = [REPO / "klq.py", "--dataset-path", datasets[0.15], "--runs-dir", tmp_path, "--total-steps", "200",
            "--eval-frequency", "100", "--eval-episodes", "2", "--no-tensorboard"]
    proc = run_in_process([*base, "--seeds", "1", "2", "--sweep", "kl-weight=0,0.3", "--run-name",
                           "w{kl_weight}/s{seed}"])
    assert proc.returncode == 0, proc.stderr
    dirs = sorted(str(p.parent.relative_to(tmp_path)) for p in tmp_path.rglob("result.json"))
    assert dirs == ["w0.3/s1", "w0.3/s2", "w0/s1", "w0/s2"]
    assert json.loads((tmp_path / "w0.3" / "s2" / "result.json").read_text())["args"]["kl_weight"] == 0.3
    # two swept flags in one --sweep: every combination
    proc = run_in_process([*base, "--sweep", "kl-weight=0.1", "tau=0.5,1", "--run-name", "two/w{kl_weight}t{tau}"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.parent.name for p in (tmp_path / "two").rglob("result.json")) == ["w0.1t0.5", "w0.1t1"]
    assert json.loads((tmp_path / "two" / "w0.1t1" / "result.json").read_text())["args"]["tau"] == 1.0
    # a template that names two members alike, a flag no member may vary, a finished run: one line each
    for extra, message in ((["--seeds", "1", "2", "--run-name", "same"], "gives several members the same directory"),
                           (["--sweep", "batch-size=32,64"], "--sweep 'batch-size=32,64': expected FLAG=V1,V2"),
                           (["--sweep", "kl-weight=a,b"], "takes float values"),
                           (["--sweep", "kl-weight=0", "--sweep", "tau=1"], "--sweep is given more than once"),
                           (["--seeds", "1", "2", "--run-name", "{nope}"], "a template may name"),
                           (["--seeds", "1", "2", "--run-name", "{seed.__class__}/{seed}"], "not 'seed.__class__'"),
                           (["--seeds", "1", "2", "--run-name", "{seed:>100000000}"], "width may be at most 255"),
                           (["--seeds", "1", "2", "--run-name", "a" * 255 + "{seed}"], "at most 255 bytes each"),
                           (["--seeds", "1", "2", "--run-name", "{epsilon:{seed}}"], "not another field's value"),
                           (["--seeds", "1", "2", "1"], "--seeds lists 1 more than once"),
                           (["--epsilons", "0.15", "0.150000001"], "--epsilons lists 0.15 more than once"),
                           (["--seeds", "1", "--run-name", "w0/s1"], "holds a finished run")):
        bad = run_in_process([*base, *extra])
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and message in bad.stderr, (extra, bad.stderr)
    # --skip-finished trains only what is missing
    (tmp_path / "w0" / "s1" / "result.json").unlink()
    proc = run_in_process([*base, "--seeds", "1", "2", "--sweep", "kl-weight=0,0.3", "--run-name",
                           "w{kl_weight}/s{seed}", "--skip-finished"])
    assert proc.returncode == 0 and proc.stdout.count("skipped") == 3 and (tmp_path / "w0" / "s1" / "result.json").is_file()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Acrobot-v1", "LunarLander-v3", "MountainCar-v0"])  # MountainCar: its
# 200-step limit ends the episodes
def test_batched_evaluation_scores_what_one_simulator_per_episode_scores(env_id):
    """Simulators (gymnasium's vectorised CartPole and Acrobot on arrays with their state set to the start states,
    or environments stepped without their wrappers, the time limit counted by Simulators) returns, for every copy,
    the returns of the plain loop over env.reset(seed=seed + i)."""
    env = gym.make(env_id)
    dim, n_actions = env.observation_space.shape[0], env.action_space.n
    w = torch.randn(3, dim, n_actions, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def act(obs, u):  # three different deterministic policies, one per copy
        return (obs.double() @ w).argmax(-1)

    got = common.Simulators(env_id, 3, 6, 123).run(act, 0)
    for m in range(3):
        for i in range(6):
            obs, _ = env.reset(seed=123 + i)
            total, done = 0.0, False
            while not done:
                a = int((torch.as_tensor(obs, dtype=torch.float32).double() @ w[m]).argmax())
                obs, r, term, trunc, _ = env.step(a)
                total, done = total + r, term or trunc
            assert got[m, i] == total, (m, i)


@pytest.mark.parametrize("env_id", ["LunarLander-v3", "MountainCar-v0"])
def test_copies_taking_the_same_actions_are_simulated_once(env_id, monkeypatch):
    """Copies of an episode whose policies agree share one simulation: here copies 0 and 1 follow the same policy
    (a stochastic one, through the shared noise u) and copy 2 that policy for its first 25 steps, then another. The
    returns are the plain loop's for every copy, and copy 1 costs no step of its own; copy 2 is replayed."""
    env = gym.make(env_id)
    dim, n_actions = env.observation_space.shape[0], env.action_space.n
    w = torch.randn(2, dim, n_actions, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    calls = [0]

    def policy(obs, u, m):  # softmax of a linear score, sampled at u (the same u for every copy)
        return int((torch.softmax(obs.double() @ w[m], -1).cumsum(-1) < u).sum().clamp_max(n_actions - 1))

    def act(obs, u):
        calls[0] += 1
        return torch.tensor([[policy(obs[c, i], u[i], int(c == 2 and calls[0] > 25)) for i in range(obs.shape[1])]
                             for c in range(3)])

    stepped, sims = [0], common.Simulators(env_id, 3, 4, 321)
    if sims.lunar:
        step = sims.lunar.step
        monkeypatch.setattr(sims.lunar, "step", lambda j, a: (stepped.__setitem__(0, stepped[0] + len(j)), step(j, a))[1])
    else:
        sims.steppers = [(lambda f: lambda a: (stepped.__setitem__(0, stepped[0] + 1), f(a))[1])(f) for f in sims.steppers]
    got = sims.run(act, 7)
    generator, lengths = torch.Generator().manual_seed(7), np.zeros((3, 4), dtype=int)
    us = torch.stack([torch.rand(4, generator=generator) for _ in range(1000)])
    for c in range(3):
        for i in range(4):
            obs, _ = env.reset(seed=321 + i)
            total, done, t = 0.0, False, 0
            while not done:
                m = int(c == 2 and t >= 25)
                obs, r, term, trunc, _ = env.step(policy(torch.as_tensor(obs, dtype=torch.float32), us[t, i], m))
                total, done, t = total + r, term or trunc, t + 1
            assert got[c, i] == total, (c, i)
            lengths[c, i] = t
    # copy 0 is stepped for all three, copy 1 never, copy 2 from where it first acts otherwise (the steps replayed up
    # to there go through the steppers, but not through LunarLanderSteps.step)
    assert (lengths[2] > 25).all()
    if sims.lunar:
        assert sims.lunar.direct and not (got[2] == got[0]).all()
        assert lengths[0].sum() < stepped[0] <= lengths[0].sum() + lengths[2].sum() - 25 * 4
    else:
        assert stepped[0] == lengths[0].sum() + lengths[2].sum()


def test_member_behavior_is_each_members_behavior_policy():
    """MemberBehavior gives each member its own beta: with one forward for all members when their epsilon-greedy
    betas share a network (a task's datasets), with one per dataset otherwise (a softmax beta among them)."""
    g = torch.Generator().manual_seed(5)
    net = {f"w{i}": torch.randn(o, n, generator=g, dtype=torch.float64) for i, (n, o) in enumerate([(4, 8), (8, 8), (8, 3)])}
    net.update({f"b{i}": torch.randn(o, generator=g, dtype=torch.float64) for i, o in enumerate([8, 8, 3])})
    obs = torch.randn(6, 50, 4, generator=g)
    greedy = [common.BehaviorPolicy(net, eps) for eps in (0.05, 0.05, 0.3, 0.3, 1.0, 0.0)]
    for policies in (greedy, greedy[:5] + [common.BehaviorPolicy(net, 0.0, "softmax", 0.7, 0.01)]):
        beta = common.MemberBehavior(policies, [p.epsilon for p in policies])
        assert beta.shared == (policies is greedy)
        got = beta(obs)
        assert got.dtype == torch.float64
        for m, p in enumerate(policies):
            assert torch.equal(got[m], p(obs[m])), m


def test_acrobot_on_arrays_is_gymnasiums_acrobot():
    """AcrobotVector follows n gymnasium Acrobot-v1 environments bit for bit: observations, rewards, terminations,
    under a policy that swings up (most episodes end before the 500-step limit; the ended ones are not stepped) and
    one that does not."""
    n = 30
    envs = [gym.make("Acrobot-v1") for _ in range(n)]
    starts = []
    for i, env in enumerate(envs):
        env.reset(seed=77 + i)
        starts.append(np.array(env.unwrapped.state))
    for swing in (True, False):
        for i, env in enumerate(envs):
            env.reset(seed=77 + i)
        vec = common.AcrobotVector(np.stack(starts, 1))
        obs, active, ended = vec.obs(), np.ones(n, bool), 0
        while active.any():
            actions = np.where(obs[:, 5] > 0, 2, 0) if swing else np.ones(n, dtype=np.int64)
            obs, reward, term, trunc = vec.step(actions, active.copy() if swing else None)  # ended: not stepped
            for j in np.flatnonzero(active):
                o, r, t, tr, _ = envs[j].step(int(actions[j]))
                assert np.array_equal(o, obs[j]) and r == reward[j] and t == term[j] and tr == trunc[j], (swing, j)
                if t or tr:
                    active[j], ended = False, ended + t
        assert (ended > n // 2) == swing  # swinging up ends most episodes early


@pytest.mark.parametrize("direct", [True, False])
def test_lunar_lander_steps_are_gymnasiums_lunar_lander(direct):
    """LunarLanderSteps follows n gymnasium LunarLander-v3 environments bit for bit (observations, rewards,
    terminations) under random actions, which fire all three engines and end episodes by crashing, flying off and
    (the heuristic controller's share) coming to rest: reading and writing the landers' b2Body structs directly
    (this Box2D build's layout is the one checked) and through Box2D's Python interface."""
    from gymnasium.envs.box2d.lunar_lander import heuristic
    n = 24
    envs, fast = [gym.make("LunarLander-v3") for _ in range(n)], common.LunarLanderSteps(
        [gym.make("LunarLander-v3") for _ in range(n)], direct=direct)
    fast.BLOCK = 6  # the dispersion stream continued block after block, many times per episode
    obs = fast.reset([5 + i for i in range(n)])
    assert fast.direct == direct, "the b2Body layout check failed on this Box2D build: the direct path is off"
    for i, env in enumerate(envs):
        assert np.array_equal(env.reset(seed=5 + i)[0], obs[i])
    rng, active, ends, fired = np.random.default_rng(0), np.ones(n, bool), set(), set()
    for t in range(1000):
        if not active.any():
            break
        j = np.flatnonzero(active)
        actions = np.array([heuristic(envs[i].unwrapped, obs[i]) if i % 2 else rng.integers(4) for i in j])
        o, reward, term = fast.step(j, actions)
        for k, i in enumerate(j):
            o_ref, r_ref, t_ref, _, _ = envs[i].step(int(actions[k]))
            assert np.array_equal(o_ref, o[k]) and r_ref == reward[k] and t_ref == term[k], (i, t)
            obs[i] = o_ref
            fired.add(int(actions[k]))
            if t_ref:
                active[i] = False
                ends.add(r_ref)
    assert fired == {0, 1, 2, 3} and {-100, 100} <= ends


def test_lunar_lander_steps_check_the_b2body_layout(monkeypatch):
    """A b2Body layout that is not the one assumed (here: the angular velocity one word off) is caught by the check at
    reset, and the steps go through Box2D's Python interface, with gymnasium's numbers."""
    monkeypatch.setattr(common.LunarLanderSteps, "SPIN", common.LunarLanderSteps.SPIN + 1)
    env, fast = gym.make("LunarLander-v3"), common.LunarLanderSteps([gym.make("LunarLander-v3")])
    obs = fast.reset([3])
    assert not fast.direct and np.array_equal(obs[0], env.reset(seed=3)[0])
    for t in range(50):
        o, reward, term = fast.step(np.array([0]), np.array([2 if t % 3 else 1]))
        o_ref, r_ref, t_ref, _, _ = env.step(2 if t % 3 else 1)
        assert np.array_equal(o[0], o_ref) and reward[0] == r_ref and term[0] == t_ref
        if t_ref:
            break


def test_sparse_curve_keeps_the_final_score_and_the_grid_accepts_it(datasets, tmp_path):
    """--eval-sparse-frequency evaluates every N updates before the last 10 evaluations, which stay every
    --eval-frequency (the final score's window); run_grid.py counts such a run as finished."""
    import sys
    sys.path.insert(0, str(REPO / "benchmark"))
    import run_grid
    proc = run_in_process([REPO / "bc.py", "--dataset-path", datasets[0.15], "--runs-dir", tmp_path, "--run-name",
                           "s", "--total-steps", "3000", "--eval-frequency", "100", "--eval-sparse-frequency", "1000",
                           "--eval-episodes", "2", "--no-tensorboard"])
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "s" / "result.json").read_text())
    steps = [e["step"] for e in result["evaluations"]]
    assert steps == [1000, 2000, *range(2100, 3001, 100)]
    assert result["final_score"] == pytest.approx(np.mean([e["return_mean"] for e in result["evaluations"][-10:]]))
    cell = run_grid.Cell("CartPole-v1", 0.15, "bc", 1)
    assert run_grid.check_result(tmp_path / "s" / "result.json", cell, {"eval_sparse_frequency": 1000}) is None
    assert "but 500 was requested" in run_grid.check_result(tmp_path / "s" / "result.json", cell, {
        "eval_sparse_frequency": 500})  # another schedule: rerun
