"""collect_data.py: dataset schema, behaviour-policy correctness, reproducibility, bad input."""

from __future__ import annotations

import json
from types import SimpleNamespace
import platform

import numpy as np
import pytest
import torch

from conftest import REPO, make_dataset, run

KEYS = {
    "observations", "actions", "rewards", "next_observations", "terminals", "timeouts", "behavior_probs",
    "next_behavior_probs", "behavior_w0", "behavior_b0", "behavior_w1", "behavior_b1", "behavior_w2", "behavior_b2",
    "epsilon", "env_id", "behavior_return", "behavior_return_std", "format_version", "settings_json", "behavior_kind", "behavior_temperature", "behavior_floor",
}


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def greedy_from_stored_network(d, obs):
    """Independent re-implementation (torch, float64) of the stored behaviour network."""
    x = torch.as_tensor(obs, dtype=torch.float64)
    for i in range(3):
        x = x @ torch.as_tensor(d[f"behavior_w{i}"], dtype=torch.float64).T + torch.as_tensor(d[f"behavior_b{i}"], dtype=torch.float64)
        if i < 2:
            x = torch.relu(x)
    return x.argmax(1).numpy()


def test_schema(datasets):
    d = load(datasets[0.15])
    assert set(d) == KEYS
    n = len(d["actions"])
    assert n == 2000
    assert d["observations"].shape == d["next_observations"].shape == (n, 4)
    assert d["observations"].dtype == np.float32 and d["actions"].dtype == np.int64
    assert d["behavior_probs"].shape == d["next_behavior_probs"].shape == (n, 2)
    assert d["terminals"].dtype == bool and d["timeouts"].dtype == bool
    assert not (d["terminals"] & d["timeouts"]).any()
    assert str(d["env_id"]) == "CartPole-v1" and float(d["epsilon"]) == 0.15 and int(d["format_version"]) == 2
    assert str(d["behavior_kind"]) == "epsilon_greedy"
    settings = json.loads(str(d["settings_json"]))
    assert settings["num_transitions"] == n and settings["seed"] == 0
    assert settings["numpy_version"] == np.__version__
    assert settings["numpy_simd"] or platform.machine() not in ("x86_64", "AMD64")  # at least numpy's baseline
    assert np.isfinite(d["behavior_return"])


@pytest.mark.parametrize("eps", [0.15, 0.0, 1.0])
def test_behavior_probs_are_the_epsilon_greedy_formula(datasets, eps):
    d = load(datasets[eps])
    for probs, obs in ((d["behavior_probs"], d["observations"]), (d["next_behavior_probs"], d["next_observations"])):
        np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-6)
        greedy = greedy_from_stored_network(d, obs)
        expected = np.full(probs.shape, eps / 2)
        expected[np.arange(len(obs)), greedy] += 1 - eps
        np.testing.assert_allclose(probs, expected, atol=1e-6)
    # Actions were drawn from beta: never an action of probability zero.
    assert (d["behavior_probs"][np.arange(len(d["actions"])), d["actions"]] > 0).all()


def test_uniform_data_is_uniform(datasets):
    d = load(datasets[1.0])
    share = np.mean(d["actions"] == 0)
    assert abs(share - 0.5) < 0.05  # 2000 draws: 4.5 standard deviations


def test_transitions_chain_within_episodes(datasets):
    d = load(datasets[0.15])
    cont = ~(d["terminals"] | d["timeouts"])[:-1]
    np.testing.assert_array_equal(d["next_observations"][:-1][cont], d["observations"][1:][cont])
    assert d["terminals"].any()


def test_same_seed_same_dataset(tmp_path):
    a = load(make_dataset(tmp_path / "a.npz", epsilon=0.25, n=1500))
    b = load(make_dataset(tmp_path / "b.npz", epsilon=0.25, n=1500))
    c = load(make_dataset(tmp_path / "c.npz", epsilon=0.25, n=1500, seed=1))
    for k in KEYS - {"settings_json"}:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert not np.array_equal(a["actions"], c["actions"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "b.npz", "c.npz"]  # no temp files left


def test_behavior_policy_is_in_the_papers_regime(datasets):
    """The committed CartPole behaviour policy is good but far from optimal (paper: 219 at eps 0.05)."""
    d = load(datasets[0.0])
    settings = json.loads(str(d["settings_json"]))
    assert settings["dataset_episode_return_mean"] > 100


@pytest.mark.parametrize("argv, needle", [
    (["--env-id", "CartPole-v1", "--epsilon", "1.5"], "--epsilon"),
    (["--env-id", "LunarLander-v2"], "LunarLander-v3"),
    (["--env-id", "NoSuchEnv-v0"], "NoSuchEnv-v0"),
    (["--env-id", "CartPole-v1", "--num-transitions", "-5"], "--num-transitions"),
    (["--env-id", "CartPole-v1", "--epsilon", "0.1", "0.2", "--dataset-path", "x.npz"], "--dataset-path"),
    (["--env-id", "Acrobot-v1", "--behavior-path", str(REPO / "behavior_policies" / "CartPole-v1.npz")], "obs dim"),
    (["--env-id", "CartPole-v1", "--epsilon"], "--epsilon needs at least one value"),
    (["--env-id", "CartPole-v1", "--epsilon", "0.15", "0.150"], "--epsilon lists 0.15 more than once"),
    (["--env-id", "CartPole-v1", "--behavior-path", "b" * 300 + ".npz"], "File name too long (the file system allows"),
    (["--env-id", "CartPole-v1", "--train-behavior", "--behavior-path", "b.npz", "--behavior-train-steps", "0"],
     "--behavior-train-steps must be at least 2500, got 0"),
    (["--env-id", "CartPole-v1", "--behavior-path", str(REPO / "README.md")], "not an .npz archive"),
])
def test_bad_input(tmp_path, argv, needle):
    proc = run([REPO / "collect_data.py", *argv], cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_broken_behaviour_network_is_refused_before_collecting(tmp_path):
    """NaN, infinite or misshapen weights would give a dataset of a policy no script can load: refused in one line."""
    with np.load(REPO / "behavior_policies" / "CartPole-v1.npz") as f:
        good = {k: f[k] for k in f.files}
    nan_w2 = good["w2"].copy()
    nan_w2[0, 0] = np.nan
    for i, (k, bad) in enumerate({"w2": nan_w2, "w0": good["w0"][0], "b0": np.array(["a"] * 32),
                                  "w1": good["w1"][:, :5]}.items()):
        np.savez(tmp_path / f"b{i}.npz", **{**good, k: bad})
        proc = run([REPO / "collect_data.py", "--epsilon", "0.15", "--num-transitions", "50", "--behavior-path",
                    tmp_path / f"b{i}.npz", "--dataset-path", tmp_path / f"d{i}.npz"], cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and f"{k} is not an array of shape" in lines[0], proc.stderr
        assert not (tmp_path / f"d{i}.npz").exists()


def test_behavior_return_is_measured_on_the_evaluation_start_states(datasets):
    """eps = 0: the behaviour policy is the greedy policy of the stored network, so its stored return must be
    that policy's mean return from the start states the scripts evaluate on (reset(seed=eval_seed + i)),
    recomputed here with an independent implementation of the network."""
    import gymnasium as gym

    d = load(datasets[0.0])
    settings = json.loads(str(d["settings_json"]))
    returns = []
    for i in range(settings["behavior_eval_episodes"]):
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=settings["eval_seed"] + i)
        total, done = 0.0, False
        while not done:
            obs, r, term, trunc, _ = env.step(int(greedy_from_stored_network(d, obs[None])[0]))
            total, done = total + r, term or trunc
        returns.append(total)
    assert float(d["behavior_return"]) == pytest.approx(np.mean(returns))


def test_behavior_return_uses_the_noise_of_the_scripts_final_evaluations(monkeypatch):
    """behavior_return is paired with the final score: the evaluator's noise seeds are those of the last 10
    evaluations of the scripts' default schedule (also with the sparse curve), so a run deploying beta scores it."""
    import collect_data
    import common

    seen = []
    monkeypatch.setattr(common.Simulators, "run", lambda self, act, noise_seed: seen.append(noise_seed) or np.zeros((1, 3)))
    weights = {f"{k}{i}": np.zeros(s, np.float32) for i, (o, n) in enumerate([(4, 32), (32, 16), (16, 2)])
               for k, s in (("w", (n, o)), ("b", (n,)))}
    returns = collect_data.behavior_returns("CartPole-v1", weights, 0.15, 3, 10, 10_000)
    assert returns.shape == (10, 3)
    for sparse in (0, 5000):
        first = common.RunArgs(eval_sparse_frequency=sparse)
        due = [s for s in range(1, first.total_steps + 1) if common.Members.due(SimpleNamespace(first=first), s)]
        assert seen == [first.eval_seed + s for s in due[-10:]]


def test_behavior_return_is_the_final_score_of_a_run_deploying_beta(datasets):
    """The stored behaviour return is what a member deploying beta over the last evaluations scores: beta from the
    scripts' batched MemberBehavior (two members side by side), the noise of the recorded steps, the final score's
    mean of the evaluations' means; equal, not close."""
    import common

    for eps in (0.15, 1.0):
        d = load(datasets[eps])
        settings = json.loads(str(d["settings_json"]))
        assert settings["behavior_noise_steps"] == [common.RunArgs().total_steps]  # 1 pass in the fixture
        policy = common.behavior_policy(d)
        behavior = common.MemberBehavior([policy, policy], [0, 0])
        simulators = common.Simulators("CartPole-v1", 2, settings["behavior_eval_episodes"], settings["eval_seed"])
        scores = [simulators.run(lambda obs, u: common.sample(behavior(obs), u.double()), settings["eval_seed"] + s)
                  for s in settings["behavior_noise_steps"]]
        finals = [float(np.mean([float(r[m].mean()) for r in scores])) for m in range(2)]
        assert finals == [float(d["behavior_return"])] * 2
