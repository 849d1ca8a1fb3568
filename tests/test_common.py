"""The contract every algorithm script keeps: same flags, result schema, TensorBoard tags,
determinism, checkpoints that evaluate on their own, and one-line failures on bad input."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import platform
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ALGORITHMS, REPO, run

TINY = ["--total-steps", "300", "--eval-frequency", "100", "--eval-episodes", "3"]
RESULT_KEYS = {"algorithm", "env_id", "epsilon", "seed", "args", "evaluations", "final_score", "behavior_return",
               "wall_time", "train_time", "eval_time", "updates_per_second", "dataset_path", "dataset_sha256",
               "format_version", "platform", "extra"}
COMMON_FLAGS = ("--env-id", "--epsilon", "--seed", "--dataset-path", "--total-steps", "--learning-rate", "--batch-size",
                "--eval-frequency", "--eval-episodes", "--eval-seed", "--runs-dir", "--run-name", "--exp-name",
                "--tensorboard", "--save-model", "--eval-checkpoint", "--threads")


def script(name):
    path = REPO / name
    if not path.exists():
        pytest.skip(f"{name} is not written yet")
    return path


def load_script(name):
    """Import a script as a module (tests may; scripts never import each other)."""
    spec = importlib.util.spec_from_file_location(f"script_{name[:-3]}", script(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def main_in_process(module, **overrides):
    """Run the script's main() on its Args, as `python script.py --flag value ...` would."""
    tiny = dict(env_id="CartPole-v1", epsilon=0.15, total_steps=300, eval_frequency=100, eval_episodes=3)
    module.main(dataclasses.replace(module.Args(), **{**tiny, **overrides}))


def train(name, dataset, runs, run_name, *extra, runner=run):
    return runner([script(name), "--env-id", "CartPole-v1", "--epsilon", "0.15", "--dataset-path", dataset,
                   "--runs-dir", runs, "--run-name", run_name, *TINY, *extra])


@pytest.mark.parametrize("name", ALGORITHMS)
def test_help_lists_common_flags(name):
    proc = run([script(name), "--help"])
    assert proc.returncode == 0
    missing = [f for f in COMMON_FLAGS if f not in proc.stdout]
    assert not missing, f"{name} lacks {missing}"
    if name not in ("bc.py",):  # every value-based script shares the critic's settings
        for flag in ("--gamma", "--tau", "--target-update-frequency"):
            assert flag in proc.stdout, f"{name} lacks {flag}"


@pytest.mark.parametrize("name", ALGORITHMS)
def test_end_to_end_result_and_tensorboard(name, datasets, tmp_path):
    proc = train(name, datasets[0.15], tmp_path, "r", "--save-model")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert RESULT_KEYS <= set(result)
    assert result["algorithm"] == name[:-3] and result["env_id"] == "CartPole-v1" and result["epsilon"] == 0.15
    assert [e["step"] for e in result["evaluations"]] == [100, 200, 300]
    assert result["final_score"] == pytest.approx(np.mean([e["return_mean"] for e in result["evaluations"]]))
    assert all(np.isfinite(e["return_mean"]) and e["return_mean"] > 0 for e in result["evaluations"])
    assert result["updates_per_second"] > 0 and result["wall_time"] >= result["train_time"] + result["eval_time"] * 0.99
    # what a float difference between machines is traced to: the libraries and the CPU features their kernels use
    assert result["platform"]["numpy"] == np.__version__ and result["platform"]["torch_cpu_capability"]
    assert result["platform"]["numpy_simd"] or platform.machine() not in ("x86_64", "AMD64")  # at least the baseline
    assert result["dataset_sha256"] == hashlib.sha256(Path(datasets[0.15]).read_bytes()).hexdigest()
    events = list((tmp_path / "r").glob("events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = EventAccumulator(str(events[0])).Reload().Tags()["scalars"]
    assert "eval/episodic_return" in tags and "charts/SPS" in tags and any(t.startswith("losses/") for t in tags)
    documented = set(re.findall(r"`([a-z]+/[A-Za-z0-9_]+)`", (REPO / "docs" / "formats.md").read_text()))
    assert set(tags) <= documented, f"TensorBoard tags missing from docs/formats.md: {set(tags) - documented}"
    assert not [p for p in (tmp_path / "r").iterdir() if p.suffix == ".tmp"]

    # The checkpoint evaluates on its own (no dataset) to the same return as the last evaluation.
    ev = run([script(name), "--eval-checkpoint", tmp_path / "r" / "model.pt", "--eval-episodes", "3"])
    assert ev.returncode == 0, ev.stderr
    printed = float(re.search(r"return (-?[\d.]+)", ev.stdout).group(1))
    assert printed == pytest.approx(result["evaluations"][-1]["return_mean"], abs=0.01)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_same_seed_same_run(name, datasets, tmp_path):
    module = load_script(name)
    for run_name, seed in (("a", 3), ("b", 3), ("c", 4)):
        main_in_process(module, dataset_path=str(datasets[0.15]), runs_dir=str(tmp_path), run_name=run_name,
                        seed=seed, tensorboard=False)
    ra, rb, rc = (json.loads((tmp_path / n / "result.json").read_text()) for n in "abc")
    assert ra["evaluations"] == rb["evaluations"]
    assert ra["extra"] == rb["extra"]
    assert not list(tmp_path.glob("*/events.out.tfevents.*"))


def corrupt_copies(src, tmp_path):
    """Bad datasets: garbage bytes, a truncated file, NaN in the data, another task's dataset."""
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not a zip file" * 10)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with np.load(src) as f:
        d = {k: f[k] for k in f.files}
    nan = tmp_path / "nan.npz"
    obs = d["observations"].copy()
    obs[5, 1] = np.nan
    np.savez(nan, **{**d, "observations": obs})
    wrong_task = tmp_path / "wrong_task.npz"  # claims Acrobot but has CartPole's shapes
    np.savez(wrong_task, **{**d, "env_id": np.array("Acrobot-v1")})
    return {"garbage": garbage, "truncated": truncated, "nan": nan, "wrong_task": wrong_task}


BAD_CASES = {
    "missing": (dict(dataset_path="{tmp}/nope.npz"), "not found"),
    "garbage": (dict(dataset_path="{garbage}"), "unreadable (not an .npz archive"),
    "truncated": (dict(dataset_path="{truncated}"), "unreadable (truncated or corrupt"),
    "nan": (dict(dataset_path="{nan}"), "NaN"),
    "other_env": (dict(dataset_path="{good}", env_id="Acrobot-v1"), "recorded on CartPole-v1"),
    "wrong_shapes": (dict(dataset_path="{wrong_task}", env_id="Acrobot-v1"), "shape"),
    "wrong_epsilon": (dict(dataset_path="{good}", epsilon=0.5), "epsilon"),
    "lunar_v2": (dict(env_id="LunarLander-v2"), "LunarLander-v3"),
    "unknown_env": (dict(env_id="NoSuchEnv-v0"), "NoSuchEnv-v0"),
    "negative_steps": (dict(total_steps=-5), "--total-steps"),
    "epsilon_range": (dict(epsilon=1.5), "--epsilon"),
    "zero_eval_episodes": (dict(eval_episodes=0), "--eval-episodes"),
    "zero_batch": (dict(batch_size=0), "--batch-size"),
    "bad_learning_rate": (dict(learning_rate=float("nan")), "--learning-rate"),
    "missing_checkpoint": (dict(eval_checkpoint="{tmp}/none.pt"), "not found"),
    "corrupt_checkpoint": (dict(eval_checkpoint="{garbage}"), "unreadable"),
}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_bad_input_fails_clearly_without_output(name, datasets, tmp_path):
    module = load_script(name)
    files = {k: str(v) for k, v in corrupt_copies(datasets[0.15], tmp_path).items()}
    for case, (overrides, needle) in BAD_CASES.items():
        runs = tmp_path / f"runs_{case}"
        overrides = {k: v.format(tmp=tmp_path, good=datasets[0.15], **files) if isinstance(v, str) else v
                     for k, v in overrides.items()}
        with pytest.raises(SystemExit) as exc:
            main_in_process(module, runs_dir=str(runs), **overrides)
        message = str(exc.value.code)
        assert needle in message and "error" in message and "\n" not in message, (case, message)
        assert not runs.exists(), case


@pytest.mark.parametrize("name", ALGORITHMS)
def test_bad_input_from_the_command_line_is_one_line(name, tmp_path):
    """What a user sees: one line on stderr, non-zero exit, no traceback."""
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    proc = run([script(name), "--dataset-path", bad, "--runs-dir", tmp_path / "runs"])
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreadable" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_keep_freed_memory_reuses_a_freed_large_arrays_pages():
    import resource

    import common

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    assert common.keep_freed_memory()  # every mallopt setting accepted (1), not silently refused (0)
    n = 8 << 20  # 64 MB of float64: above glibc's largest dynamic mmap threshold (32 MB)
    del_me = np.ones(n)
    del del_me
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = np.ones(n)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # glibc's default maps it afresh: hundreds of faults (16,384 pages; 32 even with 2 MB huge pages); kept: ~0
    assert faults <= 16 and again.sum() == n, faults
