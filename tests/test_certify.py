"""certify.py: the improvement certificate of any script's saved policy, from its batch alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ALGORITHMS, REPO, run_in_process
from test_common import train


@pytest.fixture(scope="module")
def models(datasets, tmp_path_factory):
    """One tiny saved model per script on the eps 0.15 CartPole batch (and BRPO-C with lam 0: pi = beta)."""
    runs = tmp_path_factory.mktemp("runs")
    out = {}
    for name in ALGORITHMS:
        proc = train(name, datasets[0.15], runs, name[:-3], "--save-model", "--no-tensorboard", runner=run_in_process)
        assert proc.returncode == 0, proc.stderr
        out[name[:-3]] = runs / name[:-3]
    proc = train("brpo_c.py", datasets[0.15], runs, "lam0", "--save-model", "--no-tensorboard", "--lam", "0",
                 runner=run_in_process)
    assert proc.returncode == 0, proc.stderr
    out["lam0"] = runs / "lam0"
    return out


def certify(model, *extra):
    return run_in_process([REPO / "certify.py", model / "model.pt", *extra])


@pytest.mark.parametrize("name", [a[:-3] for a in ALGORITHMS])
def test_every_script_is_certified_one_command_away(models, name):
    proc = certify(models[name], "--json")
    assert proc.returncode == 0, proc.stderr
    c = json.loads(proc.stdout)
    assert c["algorithm"] == name and c["episodes"] > 2
    assert all(np.isfinite(c[k]) for k in ("certificate", "certificate_se", "certificate_lcb", "tv_to_beta"))
    assert 0.0 <= c["tv_to_beta"] <= 1.0 and c["certified"] == float(c["certificate_lcb"] > 0)
    assert c["certificate_lcb"] == pytest.approx(c["certificate"] - 1.6448536269514722 * c["certificate_se"], rel=1e-9)
    if name == "bc":  # the human-readable form: one line
        text = certify(models[name])
        assert text.returncode == 0 and text.stdout.count("\n") == 1 and "certified" in text.stdout


@pytest.mark.parametrize("name", ["brpo", "brpo_c"])
def test_brpo_certificate_matches_training(models, name):
    """The checker computes what training reported at its last evaluation (same pi, critic, batch)."""
    c = json.loads(certify(models[name], "--json").stdout)
    extra = json.loads((models[name] / "result.json").read_text())["extra"]
    assert c["certificate"] == pytest.approx(extra["certificate"], rel=1e-12, abs=1e-12)
    assert c["certificate_se"] == pytest.approx(extra["certificate_se"], rel=1e-12, abs=1e-12)
    assert c["tv_to_beta"] == pytest.approx(extra["tv_to_beta"], rel=1e-12, abs=1e-15)


def test_beta_itself_improves_by_exactly_nothing(models):
    c = json.loads(certify(models["lam0"], "--json").stdout)
    assert c["certificate"] == 0.0 and c["certificate_se"] == 0.0 and c["tv_to_beta"] == 0.0 and c["certified"] == 0.0


def test_greedy_certifies_the_argmax_policy(models):
    sampled = json.loads(certify(models["bc"], "--json").stdout)
    greedy = json.loads(certify(models["bc"], "--json", "--eval-greedy").stdout)
    assert greedy["tv_to_beta"] != sampled["tv_to_beta"]


def test_bad_input_is_one_line(models, datasets, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    for proc, needle in ((run_in_process([REPO / "certify.py", junk]), "is unreadable"),
                         (run_in_process([REPO / "certify.py", tmp_path / "none.pt"]), "not found"),
                         (certify(models["dqn_offline"], "--certificate-confidence", "1.5"), "--certificate-confidence must lie in"),
                         (certify(models["dqn_offline"], "--dataset-path", tmp_path / "none.npz"), "not found"),
                         (certify(models["dqn_offline"], "--dataset-path", datasets[0.0]), "collected with epsilon 0, "
                          "not 0.15; the certificate is about the batch the policy was trained on")):
        assert proc.returncode == 1, proc.stderr
        assert needle in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    # a batch not stored in episode order has no returns to certify with
    with np.load(datasets[0.15]) as f:
        d = {k: f[k] for k in f.files}
    perm = np.random.default_rng(0).permutation(len(d["actions"]))
    for k in ("observations", "next_observations", "actions", "rewards", "terminals", "timeouts", "behavior_probs",
              "next_behavior_probs"):
        d[k] = d[k][perm]
    np.savez(tmp_path / "shuffled.npz", **d)
    proc = certify(models["dqn_offline"], "--dataset-path", tmp_path / "shuffled.npz")
    assert proc.returncode == 1 and "cannot certify" in proc.stderr and "episode order" in proc.stderr
