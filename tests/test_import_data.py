"""import_data.py: users' own logs (npz, csv, parquet, Minari) become datasets every script trains on."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest

from conftest import ALGORITHMS, REPO, make_dataset, run, run_in_process

LOG_KEYS = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """One of our datasets (CartPole eps 0.25, 6,000 transitions) with its true beta, and its logs without beta."""
    root = tmp_path_factory.mktemp("own")
    path = make_dataset(root / "CartPole-v1_eps0.25.npz", epsilon=0.25, n=6000)
    with np.load(path) as f:
        d = {k: f[k] for k in f.files}
    last = np.flatnonzero(d["terminals"] | d["timeouts"])[-1] + 1  # whole episodes only
    logs = {k: d[k][:last] for k in LOG_KEYS}
    return {"logs": logs, "beta": d["behavior_probs"][:last].astype(np.float64), "root": root}


def write_csv(path, logs, extra=None):
    obs, a = logs["observations"], logs["actions"]
    names = [f"obs_{i}" for i in range(obs.shape[1])] + ["action", "reward", "terminal", "timeout"] + list(extra or {})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        for t in range(len(a)):
            w.writerow([*(repr(float(x)) for x in obs[t]), int(a[t]), repr(float(logs["rewards"][t])),
                        int(logs["terminals"][t]), int(logs["timeouts"][t]), *(repr(float(v[t])) for v in (extra or {}).values())])
    return path


def import_logs(src, out, *extra, env="CartPole-v1", fit_steps=3000):
    return run_in_process([REPO / "import_data.py", "--logs", src, "--env-id", env, "--dataset-path", out,
                           "--fit-steps", str(fit_steps), *extra])


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_estimated_beta_is_close_to_the_true_one(own, tmp_path):
    np.savez(tmp_path / "logs.npz", **own["logs"])
    proc = import_logs(tmp_path / "logs.npz", tmp_path / "d.npz", fit_steps=8000)
    assert proc.returncode == 0, proc.stderr
    d = load(tmp_path / "d.npz")
    assert int(d["format_version"]) == 2 and str(d["behavior_kind"]) == "softmax" and np.isnan(d["epsilon"])
    tv = 0.5 * np.abs(d["behavior_probs"] - own["beta"]).sum(1)
    assert tv.mean() < 0.05, tv.mean()
    assert abs(float(d["behavior_floor"]) - 0.125) < 0.03  # the fitted floor recovers eps / |A|
    assert (d["behavior_probs"] >= float(d["behavior_floor"]) - 1e-7).all()  # no logged action has probability 0
    fit = json.loads(str(d["settings_json"]))["fit"]
    assert fit["heldout_log_likelihood"] > fit["uniform_log_likelihood"] and 0.0 <= fit["expected_calibration_error"] < 1
    for k in LOG_KEYS:
        assert np.array_equal(d[k], own["logs"][k]), k


def test_csv_and_parquet_round_trip_to_the_same_arrays(own, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    logs = own["logs"]
    write_csv(tmp_path / "logs.csv", logs)
    table = {f"obs_{i}": logs["observations"][:, i] for i in range(4)}
    table.update(action=logs["actions"], reward=logs["rewards"], terminal=logs["terminals"], timeout=logs["timeouts"])
    pq.write_table(pa.table(table), tmp_path / "logs.parquet")
    np.savez(tmp_path / "logs.npz", **{k: v for k, v in logs.items() if k != "next_observations"})
    out = {}
    for src in ("logs.csv", "logs.parquet", "logs.npz"):
        proc = import_logs(tmp_path / src, tmp_path / f"{src}.out.npz", fit_steps=300)  # the same fit in all
        assert proc.returncode == 0, proc.stderr
        out[src] = load(tmp_path / f"{src}.out.npz")
    for k in (*LOG_KEYS, "behavior_probs", "next_behavior_probs", "behavior_w0", "behavior_temperature"):
        assert np.array_equal(out["logs.csv"][k], out["logs.parquet"][k]), k
        assert np.array_equal(out["logs.csv"][k], out["logs.npz"][k]), k
    # next observations derived inside episodes are the logged ones
    ends = logs["terminals"] | logs["timeouts"]
    assert np.array_equal(out["logs.csv"]["next_observations"][~ends], logs["next_observations"][~ends])


def test_logged_probabilities_are_used_as_logged(own, tmp_path):
    logs, beta = own["logs"], own["beta"]
    rows = np.arange(len(logs["actions"]))
    write_csv(tmp_path / "p.csv", logs, {"propensity": beta[rows, logs["actions"]]})
    np.savez(tmp_path / "full.npz", **logs, behavior_probs=beta)
    for src in ("p.csv", "full.npz"):
        assert import_logs(tmp_path / src, tmp_path / f"{src}.npz", fit_steps=300).returncode == 0  # beta as logged
    full, prop = load(tmp_path / "full.npz.npz"), load(tmp_path / "p.csv.npz")
    assert np.allclose(full["behavior_probs"], beta, atol=1e-7)
    assert np.allclose(prop["behavior_probs"][rows, logs["actions"]], beta[rows, logs["actions"]], atol=1e-7)
    assert np.allclose(prop["behavior_probs"].sum(1), 1.0, atol=1e-6)  # two actions: the other one is 1 - p
    assert np.allclose(prop["behavior_probs"], beta, atol=1e-6)
    inside = ~(logs["terminals"] | logs["timeouts"])
    assert np.allclose(full["next_behavior_probs"][inside], np.roll(beta, -1, 0)[inside], atol=1e-7)


def test_every_algorithm_trains_on_an_imported_minari_dataset(tmp_path):
    """A Minari dataset made inside the test (from episode buffers; Minari's DataCollector needs jax), imported and
    trained on by all 7 scripts, then certified."""
    minari = pytest.importorskip("minari")
    from minari.data_collector import EpisodeBuffer
    import gymnasium as gym
    os.environ["MINARI_DATASETS_PATH"] = str(tmp_path / "minari")
    env, rng, buffers = gym.make("CartPole-v1"), np.random.default_rng(0), []
    for ep in range(12):
        o, _ = env.reset(seed=ep)
        obs, acts, rews, terms, truncs = [o], [], [], [], []
        while not (terms and (terms[-1] or truncs[-1])):
            a = int(o[2] + 0.5 * o[3] > 0) if rng.random() > 0.3 else int(rng.integers(2))  # a noisy balancing policy
            o, r, term, trunc, _ = env.step(a)
            obs.append(o), acts.append(a), rews.append(r), terms.append(term), truncs.append(trunc)
        buffers.append(EpisodeBuffer(id=ep, observations=np.array(obs), actions=np.array(acts), rewards=np.array(rews),
                                     terminations=np.array(terms), truncations=np.array(truncs), infos={}))
    minari.create_dataset_from_buffers("cartpole/noisy-v0", buffers, env=env, algorithm_name="noisy", author="tests",
                                       author_email="tests@example.org", code_permalink="tests/test_import_data.py",
                                       description="test", eval_env=env)
    out = tmp_path / "minari.npz"
    proc = run_in_process([REPO / "import_data.py", "--minari-id", "cartpole/noisy-v0", "--dataset-path", out,
                           "--fit-steps", "2000"])
    assert proc.returncode == 0, proc.stderr
    d = load(out)
    assert str(d["env_id"]) == "CartPole-v1" and len(d["actions"]) == sum(len(b.actions) for b in buffers)
    for name in ALGORITHMS:
        proc = run_in_process([REPO / name, "--dataset-path", out, "--runs-dir", tmp_path / "runs", "--run-name",
                               name[:-3], "--total-steps", "200", "--eval-frequency", "100", "--eval-episodes", "2",
                               "--no-tensorboard", "--save-model"])
        assert proc.returncode == 0, (name, proc.stderr)
        assert json.loads((tmp_path / "runs" / name[:-3] / "result.json").read_text())["final_score"] > 0
    proc = run_in_process([REPO / "certify.py", tmp_path / "runs" / "brpo" / "model.pt"])
    assert proc.returncode == 0 and "certified" in proc.stdout, proc.stderr


BAD = {
    "mismatched lengths": (lambda L: {**L, "rewards": L["rewards"][:-1]}, "different lengths"),
    "missing column": (lambda L: {k: v for k, v in L.items() if k != "rewards"}, "lack ['rewards']"),
    "continuous actions": (lambda L: {**L, "actions": L["actions"] + 0.5}, "not integers"),
    "2-d actions": (lambda L: {**L, "actions": np.stack([L["actions"]] * 2, 1)}, "continuous actions are not"),
    "action outside the space": (lambda L: {**L, "actions": np.where(np.arange(len(L["actions"])) == 3, 2, L["actions"])},
                                 "outside the action space"),
    "propensity above 1": (lambda L: {**L, "propensities": np.full(len(L["actions"]), 1.5)}, "propensities must lie"),
    "propensity 0": (lambda L: {**L, "propensities": np.zeros(len(L["actions"]))}, "propensities must lie"),
    "probabilities not summing to 1": (lambda L: {**L, "behavior_probs": np.full((len(L["actions"]), 2), 0.6)},
                                       "not distributions"),
    "an episode with no end": (lambda L: {k: v[:-1] for k, v in L.items()}, "has no end"),
    "NaN reward": (lambda L: {**L, "rewards": np.where(np.arange(len(L["rewards"])) == 5, np.nan, L["rewards"])},
                   "NaN or inf"),
    "no timeouts column": (lambda L: {k: v for k, v in L.items() if k != "timeouts"}, "timeouts or episode_ends"),
    "wrong observation size": (lambda L: {**L, "observations": L["observations"][:, :3]}, "observations have 3 values"),
    "2-d rewards": (lambda L: {**L, "rewards": L["rewards"][:, None]}, "expected ("),
    "2-d terminals": (lambda L: {**L, "terminals": L["terminals"][:, None]}, "one value per transition"),
    "observation beyond float32": (lambda L: {**L, "observations": np.where(
        np.arange(len(L["actions"]))[:, None] == 3, 1e300, L["observations"].astype(np.float64))}, "beyond float32"),
    "probabilities and propensities that disagree": (lambda L: {**L, "behavior_probs": np.full((len(L["actions"]), 2),
        0.5), "propensities": np.full(len(L["actions"]), 0.75)}, "disagree at"),
    "a misspelt array": (lambda L: {**L, "propensity": np.full(len(L["actions"]), 0.5)}, "'propensities', which it"),
    "NaN propensities beside probabilities": (lambda L: {**L, "behavior_probs": np.full((len(L["actions"]), 2), 0.5),
                                                         "propensities": np.full(len(L["actions"]), np.nan)},
                                              "propensities must lie"),
    "action beyond int64": (lambda L: {**L, "actions": np.where(np.arange(len(L["actions"])) == 3, 1e300,
                                                                  L["actions"].astype(np.float64))}, "outside the action space"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_logs_one_line_nothing_written(own, tmp_path, case):
    change, needle = BAD[case]
    logs = {k: v for k, v in own["logs"].items() if k != "next_observations"}
    np.savez(tmp_path / "bad.npz", **change(logs))
    proc = import_logs(tmp_path / "bad.npz", tmp_path / "out" / "d.npz")
    assert proc.returncode == 1, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_bad_invocations(own, tmp_path):
    np.savez(tmp_path / "logs.npz", **own["logs"])
    (tmp_path / "exists.npz").write_bytes(b"x")
    (tmp_path / "text.npz").write_text("state,action,reward\n")
    np.savez(tmp_path / "objects.npz", observations=np.array([{"x": 1}], dtype=object))
    np.savez(tmp_path / "text_actions.npz", **{**own["logs"], "actions": own["logs"]["actions"].astype(str)})
    np.savez(tmp_path / "scalar_probs.npz", **own["logs"], behavior_probs=np.array(0.5))
    for argv, needle in (([], "exactly one of --logs and --minari-id"),
                         (["--logs", tmp_path / "logs.npz"], "pass --env-id"),
                         (["--logs", tmp_path / "none.csv", "--env-id", "CartPole-v1"], "not found"),
                         (["--logs", tmp_path / "logs.npz", "--env-id", "CartPole-v1", "--dataset-path",
                           tmp_path / "exists.npz"], "exists; pass --overwrite"),
                         (["--logs", tmp_path / "logs.npz", "--env-id", "Acrobot-v1"], "observations have 4 values"),
                         (["--logs", tmp_path / "logs.npz", "--env-id", "MyTask-v0", "--n-actions", "100000000"],
                          "at most 1000 are supported"),
                         (["--logs", tmp_path / "logs.npz", "--env-id", "MyTask-v0", "--n-actions", "0"],
                          "--n-actions 0: at least 2"),
                         (["--logs", tmp_path / "text.npz", "--env-id", "CartPole-v1"], "not an .npz archive"),
                         (["--logs", tmp_path / "objects.npz", "--env-id", "CartPole-v1"], "holds object arrays"),
                         (["--logs", tmp_path / "text_actions.npz", "--env-id", "MyTask-v0"],
                          "actions (<U21) must hold real numbers"),
                         (["--logs", tmp_path / "scalar_probs.npz", "--env-id", "MyTask-v0"],
                          "their behavior_probs are not (N, actions)"),
                         (["--logs", tmp_path / ("x" * 300 + ".npz"), "--env-id", "CartPole-v1"], "File name too long")):
        proc = run_in_process([REPO / "import_data.py", *argv])
        assert proc.returncode == 1 and needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert (tmp_path / "exists.npz").read_bytes() == b"x"


def test_example_logs_import(tmp_path):
    proc = run([REPO / "import_data.py", "--logs", REPO / "examples" / "logs_example.csv", "--env-id", "CartPole-v1",
                "--dataset-path", tmp_path / "ex.npz", "--fit-steps", "1000"])
    assert proc.returncode == 0, proc.stderr
    assert "logged propensities" in proc.stdout


def test_csv_header_quirks(tmp_path):
    """A spreadsheet's byte-order mark before the header is read as the same file, and so is one with a long column
    the importer ignores; a column named twice is refused (which one holds the actions?)."""
    lines = (REPO / "examples" / "logs_example.csv").read_text().splitlines()
    (tmp_path / "bom.csv").write_text("\n".join(lines) + "\n", encoding="utf-8-sig")
    (tmp_path / "twice.csv").write_text("\n".join([lines[0] + ",action"] + [x + ",1" for x in lines[1:]]) + "\n")
    (tmp_path / "long.csv").write_text("\n".join([lines[0] + ",note"] + [x + "," + "n" * 200_000 for x in lines[1:]]))
    args = ["--env-id", "CartPole-v1", "--fit-steps", "200"]
    for name in ("bom", "long"):  # long: a column it ignores holds fields beyond csv's 128 KB default limit
        proc = run_in_process([REPO / "import_data.py", "--logs", tmp_path / f"{name}.csv", "--dataset-path",
                               tmp_path / f"{name}.npz", *args])
        assert proc.returncode == 0, proc.stderr
    proc = run_in_process([REPO / "import_data.py", "--logs", tmp_path / "twice.csv", "--dataset-path",
                           tmp_path / "t.npz", *args])
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "['action'] appear more than once" in proc.stderr
    assert not (tmp_path / "t.npz").exists()


def test_a_misspelt_column_is_refused_and_others_are_ignored_aloud(tmp_path):
    """A column the importer does not read but whose name is close to one it does would be dropped unseen (a misspelt
    propensity: the import would estimate the behaviour policy instead): refused; a user id, an episode id, a timestamp
    are ignored (not even parsed), and the import says so."""
    lines = (REPO / "examples" / "logs_example.csv").read_text().splitlines()
    (tmp_path / "typo.csv").write_text("\n".join([lines[0].replace("propensity", "propensty")] + lines[1:]) + "\n")
    (tmp_path / "extra.csv").write_text("\n".join([lines[0] + ",user_id,episode_id,timestamp,p_action"]
                                                  + [x + ",7,3,2026-01-01T00:00:00,0.5" for x in lines[1:]]) + "\n")
    args = ["--env-id", "CartPole-v1", "--fit-steps", "200"]
    proc = run_in_process([REPO / "import_data.py", "--logs", tmp_path / "typo.csv", "--dataset-path",
                           tmp_path / "t.npz", *args])
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "'propensity', which it resembles, is missing" in proc.stderr
    assert not (tmp_path / "t.npz").exists()
    proc = run_in_process([REPO / "import_data.py", "--logs", tmp_path / "extra.csv", "--dataset-path",
                           tmp_path / "e.npz", *args])
    assert proc.returncode == 0, proc.stderr
    assert "ignoring columns ['user_id', 'episode_id', 'timestamp', 'p_action']" in proc.stdout
    assert "logged propensities" in proc.stdout
    # an .npz array the importer does not read is not checked either (here: one value per episode)
    with np.load(tmp_path / "e.npz") as f:
        logs = {k: f[k] for k in ("observations", "actions", "rewards", "terminals", "timeouts")}
    np.savez(tmp_path / "extra.npz", **logs, episode_returns=np.zeros(3))
    proc = run_in_process([REPO / "import_data.py", "--logs", tmp_path / "extra.npz", "--dataset-path",
                           tmp_path / "n.npz", *args])
    assert proc.returncode == 0 and "ignoring arrays ['episode_returns']" in proc.stdout, proc.stderr


def test_without_a_simulator_the_certificate_is_the_score(own, tmp_path):
    """A task that is not installed here: sizes from the logs, training without evaluation episodes, each
    evaluation the batch's improvement certificate, clearly labelled; aggregate.py leaves such runs out."""
    np.savez(tmp_path / "logs.npz", **own["logs"])
    proc = import_logs(tmp_path / "logs.npz", tmp_path / "d.npz", env="MyCartPole-v0")
    assert proc.returncode == 0 and "without a simulator" in proc.stdout, proc.stderr
    for name in ("bc.py", "brpo.py"):
        proc = run_in_process([REPO / name, "--env-id", "MyCartPole-v0", "--dataset-path", tmp_path / "d.npz",
                               "--runs-dir", tmp_path / "runs", "--run-name", name[:-3], "--total-steps", "200",
                               "--eval-frequency", "100", "--save-model"])
        assert proc.returncode == 0, proc.stderr
        assert "no simulator" in proc.stdout and "improvement certificate" in proc.stdout
        r = json.loads((tmp_path / "runs" / name[:-3] / "result.json").read_text())
        assert r["score"] == "improvement_certificate" and all("return_mean" not in e for e in r["evaluations"])
        assert r["final_score"] == pytest.approx(np.mean([e["certificate"] for e in r["evaluations"]]))
        assert all(np.isfinite([e["certificate"], e["certificate_se"], e["tv_to_beta"]]).all() for e in r["evaluations"])
    proc = run([REPO / "benchmark" / "aggregate.py", tmp_path / "runs", "--out", tmp_path / "report", "--no-plots"])
    assert "improvement certificate" in proc.stdout + proc.stderr
    # its saved model: certified from the batch, and refused (one line) by --eval-checkpoint, which needs a simulator
    model = tmp_path / "runs" / "brpo" / "model.pt"
    proc = run_in_process([REPO / "certify.py", model, "--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["certificate"] == pytest.approx(r["evaluations"][-1]["certificate"], rel=1e-9, abs=1e-12)
    proc = run_in_process([REPO / "brpo.py", "--eval-checkpoint", model])
    assert proc.returncode == 1 and "no simulator" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
