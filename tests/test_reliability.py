"""Bad input and faults end in one clear line, a non-zero exit and nothing half-written; a finished run is never
overwritten unless asked. Most cases run a script's main() in-process (they fail before training); interrupts,
full disks and unwritable directories need a real process."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ALGORITHMS, REPO, run, run_in_process
from test_common import load_script, main_in_process

TINY = ["--total-steps", "200", "--eval-frequency", "100", "--eval-episodes", "2"]


def one_line_failure(module, runs, **overrides) -> str:
    """main() exits with one line and leaves no run directory."""
    with pytest.raises(SystemExit) as exc:
        main_in_process(module, runs_dir=str(runs), **overrides)
    message = str(exc.value.code)
    assert "error" in message and "\n" not in message, message
    assert not runs.exists() or not any(runs.rglob("*.*")), list(runs.rglob("*"))
    return message


def failed_cleanly(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode not in (0, None), proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def rewritten(src: Path, dst: Path, **changes) -> str:
    with np.load(src) as f:
        d = {k: f[k] for k in f.files}
    np.savez(dst, **{**d, **changes})
    return str(dst)


# ------------------------------------------------------------------------------------------------
# datasets: dtype and shape of every array
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALGORITHMS)
def test_arrays_of_wrong_dtype_or_shape_are_refused_before_any_output(name, datasets, tmp_path):
    module = load_script(name)
    src = datasets[0.15]
    with np.load(src) as f:
        actions, obs, terminals, f_beta = f["actions"], f["observations"], f["terminals"], f["behavior_probs"]
    cases = {
        "float actions": (dict(actions=actions.astype(np.float32)), "actions has dtype float32"),
        "actions [N, 1]": (dict(actions=actions[:, None]), "actions has shape"),
        "0-d actions": (dict(actions=np.array(1)), "actions has shape ()"),
        "0-d observations": (dict(observations=np.array(1.0)), "observations has shape ()"),
        "float terminals": (dict(terminals=terminals.astype(np.float32)), "terminals has dtype float32"),
        "terminals 0/1/2": (dict(terminals=terminals.astype(np.int64) * 2), "terminals has dtype int64"),
        "observations beyond float32": (dict(observations=np.full(obs.shape, 1e300)), "NaN or inf"),
        "env_id array": (dict(env_id=np.array(["CartPole-v1"])), "env_id has shape (1,)"),
        "string epsilon": (dict(epsilon=np.array("0.15")), "epsilon has dtype"),
        "no transitions": (dict(actions=actions[:0]), "actions has shape (0,)"),
        "integers float32 cannot hold": (dict(observations=np.full(obs.shape, 16_777_217, dtype=np.int64)),
                                         "cannot represent exactly"),
        "terminal and timeout": (dict(timeouts=terminals | True, terminals=terminals | True), "both terminal"),
        "epsilon NaN": (dict(epsilon=np.float64("nan")), "outside [0, 1]"),
        "behaviour floor array": (dict(behavior_floor=np.zeros(2)), "['behavior_floor'] must be single values"),
        # beyond the 1,000 rows checked against the behaviour network: the logged action never taken by beta
        "logged action at beta 0": (dict(behavior_probs=np.where(np.arange(len(actions))[:, None] >= 1000, np.eye(
            2, dtype=np.float32)[1 - actions], f_beta)), "probability 0 to the logged action in"),
        "rewards whose squares overflow": (dict(rewards=np.full(len(actions), 1e25, np.float32)), "rescale them"),
    }
    if name in ("brpo.py", "brpo_c.py"):  # they load the behaviour network
        with np.load(src) as f:
            w0 = f["behavior_w0"].astype(np.float64)
        w0[0, 0] = 1e300
        cases["behaviour weight beyond float32"] = (dict(behavior_w0=w0), "behavior_w0 is not an array of shape")
    for i, (case, (changes, needle)) in enumerate(cases.items()):
        path = rewritten(src, tmp_path / f"bad{i}.npz", **changes)
        message = one_line_failure(module, tmp_path / f"runs{i}", dataset_path=path)
        assert needle in message, (case, message)


@pytest.mark.parametrize("name", ("bc.py", "brpo.py", "spibb.py"))
def test_convertible_dtypes_are_converted_not_reinterpreted(name, datasets, tmp_path):
    module = load_script(name)
    src = datasets[0.15]
    with np.load(src) as f:
        obs, actions, terminals = f["observations"], f["actions"], f["terminals"]
    path = rewritten(src, tmp_path / "wide.npz", observations=obs.astype(np.float64), actions=actions.astype(np.int32),
                     terminals=terminals.astype(np.uint8))
    _, d = module.common.load_dataset(module.Args(dataset_path=path), 4, 2)
    _, ref = module.common.load_dataset(module.Args(dataset_path=str(src)), 4, 2)
    for k in ("observations", "actions", "terminals"):
        assert d[k].dtype == ref[k].dtype and np.array_equal(d[k], ref[k]), k


# ------------------------------------------------------------------------------------------------
# arguments: non-finite numbers, seeds, run names, sizes
# ------------------------------------------------------------------------------------------------
BAD_ARGS = {
    "learning rate inf": (dict(learning_rate=float("inf")), "--learning-rate must be a finite number"),
    "negative eval seed": (dict(eval_seed=-1), "--eval-seed must lie in"),
    "negative seed": (dict(seed=-1), "--seed must lie in"),
    "seed too large": (dict(seed=2**64), "--seed must lie in"),
    "run name escapes": (dict(run_name="../escaped"), "--run-name must be a relative path"),
    "absolute run name": (dict(run_name="/tmp/abs"), "--run-name must be a relative path"),
    "dot-dot run name": (dict(run_name=".."), "--run-name must be a relative path"),
    "exp name with slash": (dict(exp_name="a/b"), "--exp-name must be a single directory name"),
    "threads beyond the cores": (dict(threads=10**6), "--threads"),
    "overwrite and skip": (dict(overwrite=True, skip_finished=True), "contradict each other"),
    "huge evaluation": (dict(eval_episodes=10**7), "--eval-episodes"),
    "frequency beyond a long": (dict(eval_frequency=10**20), "--eval-frequency must lie in"),
    "batch beyond the data": (dict(batch_size=10**8), "--batch-size"),
    "no behaviour policy": (dict(env_id="MountainCar-v0", dataset_path=None), "no dataset for MountainCar-v0"),
    "observations not a vector": (dict(env_id="FrozenLake-v1", dataset_path=None), "only vector observations"),
    "run name with a newline": (dict(run_name="a\nb"), "printable characters"),
    "run name not UTF-8": (dict(run_name="\udcff"), "printable characters"),
    "run name too long": (dict(run_name="a" * 300), "at most 255 bytes each"),
    "--overwrite's own directory": (dict(run_name="a/.replaced/b"), "no '.replaced'"),
    "a task with no simulator nor dataset": (dict(env_id="MyTask-v0", dataset_path=None), "import_data.py made"),
    "a swept value twice": (dict(sweep=("learning-rate=1e-3,0.001",)), "0.001 more than once"),
    "dataset name too long": (dict(dataset_path="/tmp/" + "a" * 300 + ".npz"), "File name too long"),
    "empty runs dir": (dict(runs_dir=""), "--runs-dir must not be empty"),
    "empty checkpoint": (dict(eval_checkpoint=""), "--eval-checkpoint must not be empty"),
}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_bad_arguments_are_refused_up_front(name, datasets, tmp_path):
    module = load_script(name)
    for i, (case, (overrides, needle)) in enumerate(BAD_ARGS.items()):
        overrides = {"runs_dir": str(tmp_path / f"runs{i}"), "dataset_path": str(datasets[0.15]), **overrides}
        with pytest.raises(SystemExit) as exc:
            main_in_process(module, **overrides)
        message = str(exc.value.code)
        assert "error" in message and "\n" not in message, message
        assert needle in message, (case, message)
    assert not (tmp_path.parent / "escaped").exists() and not Path("/tmp/abs").exists()


@pytest.mark.parametrize("name", [*ALGORITHMS, "collect_data.py", "import_data.py", "certify.py"])
def test_flags_that_do_not_parse_are_one_line(name):
    """tyro's multi-line error box becomes one line (what is wrong, then a suggestion or the flag's usage), exit 2;
    --help still prints its help."""
    cases = {"--seedz": (["--seedz", "3"], "Unrecognized options: --seedz, 3")}
    if name in ALGORITHMS:
        cases["a typo"] = (["--total-stepz", "5"], "--total-stepz, 5; perhaps you meant --total-steps")
        cases["a value"] = (["--seed", "abc"], "Error parsing --seed: invalid literal for int() with base 10: 'abc'; "
                                               "usage: --seed INT")
    for argv, needle in cases.values():
        proc = run_in_process([REPO / name, *(["x.pt"] if name == "certify.py" else []), *argv])
        assert proc.returncode == 2 and proc.stderr.endswith(f"(see {name} --help)\n"), proc.stderr
        failed_cleanly(proc, f"{name}: error: ")
        assert needle in proc.stderr, proc.stderr
    shown = run_in_process([REPO / name, "--help"])
    assert shown.returncode == 0 and "usage:" in shown.stdout and not shown.stderr, shown.stderr


def test_a_path_too_long_and_a_package_that_does_not_import_are_one_line(tmp_path):
    """Met wherever a path is first looked at (a checkpoint here), or a task's package fails to import."""
    long = str(tmp_path / ("a" * 300 + ".pt"))
    runs = ["--runs-dir", str(tmp_path / "runs")]
    for argv, needle in ((["dqn_offline.py", "--eval-checkpoint", long, *runs], "File name too long (the file system "),
                         (["certify.py", long], "File name too long (the file system allows"),
                         (["bc.py", "--env-id", "GymV26Environment-v0", *runs], "needs a package that does not import")):
        proc = run_in_process([REPO / argv[0], *argv[1:]])
        failed_cleanly(proc, needle)
    assert not (tmp_path / "runs").exists()


def test_a_run_name_the_terminal_cannot_show_does_not_cost_the_run(datasets, tmp_path):
    """With an ASCII standard output, the final line's non-ASCII run name is escaped; the run is kept."""
    proc = subprocess.run([sys.executable, REPO / "bc.py", "--dataset-path", datasets[0.15], "--runs-dir", tmp_path,
                           "--run-name", "r\u00e9sultat", "--no-tensorboard", *TINY], capture_output=True, text=True,
                          env={**os.environ, "PYTHONIOENCODING": "ascii"}, timeout=300)
    assert proc.returncode == 0 and "r\\xe9sultat" in proc.stdout, proc.stderr
    assert (tmp_path / "r\u00e9sultat" / "result.json").is_file()


def test_a_flag_and_its_list_together_are_refused():
    """--seed 2 --seeds 1 3 would train seeds 1 and 3 only: one line instead (either spelling of the flag)."""
    for argv, both in ((["--seed", "2", "--seeds", "1", "3"], "--seed and --seeds"),
                       (["--epsilons", "0.05", "--epsilon=0.15"], "--epsilon and --epsilons")):
        proc = run_in_process([REPO / "bc.py", *argv])
        failed_cleanly(proc, f"bc.py: error: {both} were both given; pass ")


def test_a_flag_that_does_not_parse_is_one_line_from_a_unicode_box():
    """The same in a new interpreter with UTF-8 output, where tyro draws its box in Unicode (in-process above, stdout is
    captured and the box is ASCII); text that is not tyro's box is left to pass through."""
    proc = subprocess.run([sys.executable, REPO / "bc.py", "--total-stepz", "5"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    failed_cleanly(proc, "bc.py: error: Unrecognized options: --total-stepz, 5; perhaps you meant --total-steps (see")
    assert load_script("dqn_offline.py").common.usage_error("usage: bc.py [-h]\nbc.py: error: something else\n") == ""


@pytest.mark.parametrize("name", [n for n in ALGORITHMS if n != "bc.py"])
def test_a_negative_huber_delta_is_refused(name, datasets, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main_in_process(load_script(name), huber_delta=-1.0, runs_dir=str(tmp_path), dataset_path=str(datasets[0.15]))
    assert str(exc.value.code).endswith("--huber-delta must be >= 0 (0: the squared TD error), got -1.0")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ALGORITHMS)
def test_diverged_training_fails_without_a_result(name, datasets, tmp_path):
    module = load_script(name)
    runs = tmp_path / "new" / "runs"  # created by the run: removed with it
    message = one_line_failure(module, runs, dataset_path=str(datasets[0.15]), learning_rate=1e30, run_name="r")
    assert "diverged" in message and not (tmp_path / "new").exists()


@pytest.mark.parametrize("name", ALGORITHMS)
def test_unwritable_runs_dir_under_a_file(name, datasets, tmp_path):
    module = load_script(name)
    (tmp_path / "file").write_text("x")
    message = one_line_failure(module, tmp_path / "file" / "runs", dataset_path=str(datasets[0.15]))
    assert "cannot create the run directory" in message and "--runs-dir" in message


@pytest.mark.parametrize("status", (0, 1))
def test_a_signal_after_the_runs_finished_does_not_fail_them(status, monkeypatch):
    """Once main() has returned (or exited 1: a member failed alone), what the runs wrote is final: a Ctrl-C while the
    interpreter shuts down (about a second) ends the process with main's status, not 'interrupted' and exit 130."""
    common = load_script("dqn_offline.py").common
    monkeypatch.setattr(sys, "argv", ["dqn_offline.py"])
    exits = []
    monkeypatch.setattr(common.os, "_exit", exits.append)

    def main(args):
        if status:
            raise SystemExit(status)

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.suppress(SystemExit):
            common.cli(dataclasses.make_dataclass("Args", []), main)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.getsignal(sig)(sig, None)
        assert exits == [status, status]
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_overwrite_keeps_the_finished_run_until_the_new_one_finishes(datasets, tmp_path):
    """--overwrite sets the finished run aside: a replacement that fails (or is killed) gives it back, a finished one
    replaces all of it (the old model.pt too when the new run saves none)."""
    module, runs = load_script("dqn_offline.py"), tmp_path / "runs"
    run = dict(runs_dir=str(runs), run_name="r", dataset_path=str(datasets[0.15]))
    main_in_process(module, **run, save_model=True)
    old = {p.name: p.read_bytes() for p in (runs / "r").iterdir() if p.is_file()}
    assert set(old) >= {"result.json", "model.pt"}
    with pytest.raises(SystemExit, match="diverged"):
        main_in_process(module, **run, overwrite=True, learning_rate=1e30)
    assert {p.name: p.read_bytes() for p in (runs / "r").iterdir()} == old
    # killed while replacing: the old files wait in .replaced/, the new run's curves beside them
    (runs / "r" / ".replaced").mkdir()
    for name in old:
        (runs / "r" / name).replace(runs / "r" / ".replaced" / name)
    (runs / "r" / "events.out.tfevents.1.host").write_bytes(b"partial")
    with pytest.raises(SystemExit, match="holds a finished run"):
        main_in_process(module, **run)
    assert {p.name: p.read_bytes() for p in (runs / "r").iterdir()} == old
    main_in_process(module, **run, overwrite=True, seed=3)
    assert sorted(p.name for p in (runs / "r").iterdir() if not p.name.startswith("events")) == ["result.json"]
    assert (runs / "r" / "result.json").read_bytes() != old["result.json"]
    # killed just after finishing (result.json written, .replaced/ not yet removed): the finished run is the new one
    new = (runs / "r" / "result.json").read_bytes()
    (runs / "r" / ".replaced").mkdir()
    (runs / "r" / ".replaced" / "result.json").write_bytes(old["result.json"])
    with pytest.raises(SystemExit, match="holds a finished run"):
        main_in_process(module, **run)
    assert (runs / "r" / "result.json").read_bytes() == new and not (runs / "r" / ".replaced").exists()


def test_a_pipe_given_for_a_file_is_one_line_not_a_hang(datasets, tmp_path):
    """A FIFO blocks whoever opens it for reading: every reader checks for a regular file before opening."""
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    for argv in (["dqn_offline.py", "--dataset-path", fifo, "--runs-dir", tmp_path / "runs", *TINY],
                 ["dqn_offline.py", "--eval-checkpoint", fifo], ["certify.py", fifo],
                 ["import_data.py", "--logs", fifo, "--env-id", "CartPole-v1", "--dataset-path", tmp_path / "d.npz"]):
        proc = subprocess.run([sys.executable, REPO / argv[0], *map(str, argv[1:])], capture_output=True, text=True,
                              timeout=120, cwd=REPO)
        failed_cleanly(proc, "not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.npz"]


def test_runs_dir_longer_than_the_system_allows_with_skip_finished(datasets, tmp_path):
    """--skip-finished looks for each member's result.json first: a path beyond PATH_MAX is the same one line."""
    runs = tmp_path.joinpath(*["d" * 200] * 21)  # > 4,096 bytes
    with pytest.raises(SystemExit) as exc:
        main_in_process(load_script("dqn_offline.py"), runs_dir=str(runs), dataset_path=str(datasets[0.15]),
                        skip_finished=True, run_name="r")
    message = str(exc.value.code)
    assert "cannot create the run directory" in message and "--runs-dir" in message and "\n" not in message
    assert os.listdir(tmp_path) == []  # the directories it had begun to create are removed


# ------------------------------------------------------------------------------------------------
# run directories: never overwritten unless asked, never shared, stale files cleared
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALGORITHMS)
def test_finished_run_is_kept_unless_overwrite_and_checkpoints_are_validated(name, datasets, tmp_path):
    module = load_script(name)
    runs, data = tmp_path / "runs", str(datasets[0.15])
    main_in_process(module, dataset_path=data, runs_dir=str(runs), run_name="r", save_model=True, total_steps=100)
    first = (runs / "r" / "result.json").read_bytes()
    with pytest.raises(SystemExit) as exc:
        main_in_process(module, dataset_path=data, runs_dir=str(runs), run_name="r", seed=2, total_steps=100)
    assert "holds a finished run" in str(exc.value.code) and "--overwrite" in str(exc.value.code)
    assert (runs / "r" / "result.json").read_bytes() == first
    main_in_process(module, dataset_path=data, runs_dir=str(runs), run_name="r", seed=2, total_steps=100,
                    overwrite=True)
    assert json.loads((runs / "r" / "result.json").read_text())["seed"] == 2
    assert len(list((runs / "r").glob("events.out.tfevents.*"))) == 1  # the earlier run's curves are gone
    assert not (runs / "r" / "model.pt").exists()  # and its model, which this run did not save

    # --eval-checkpoint: weights only, every key and shape checked, one line
    main_in_process(module, dataset_path=data, runs_dir=str(runs), run_name="m", save_model=True, total_steps=100,
                    tensorboard=False)
    good = torch.load(runs / "m" / "model.pt", weights_only=True)
    nets = [k for k, v in good.items() if isinstance(v, dict) and k != "args" and k != "behavior"]
    marker = tmp_path / "code_ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    bad = {
        "not a checkpoint": (None, "unreadable"),
        "code in it": ({**good, "payload": Payload()}, "unreadable"),
        "missing key": ({k: v for k, v in good.items() if k != nets[0]}, f"lacks ['{nets[0]}']"),
        "wrong type": ({**good, "obs_dim": "4"}, "wrong type"),
        "task of other sizes": ({**good, "env_id": "Acrobot-v1"}, "Acrobot-v1 has 6 and 3"),
        "weights of another task": ({**good, "env_id": "Acrobot-v1", "obs_dim": 6, "n_actions": 3},
                                    "does not hold"),
        "NaN weights": ({**good, nets[0]: {k: torch.full_like(v, float("nan")) for k, v in good[nets[0]].items()}},
                        "NaN or inf"),
        "another script's": ({**good, "algorithm": "nope"}, "not saved by"),
        "bfloat16 weights": ({**good, nets[0]: {k: v.bfloat16() for k, v in good[nets[0]].items()}}, "float32 or float64"),
        "huge weights": ({**good, nets[0]: {k: v * 1e38 for k, v in good[nets[0]].items()}}, "checkpoint"),
    }
    if name in ("brpo.py", "brpo_c.py"):  # their saved settings are part of the policy: validated like flags
        bad["settings of another type"] = ({**good, "args": {**good["args"], "seeds": ["a"]}}, "saved settings are invalid")
    for i, (case, (ckpt, needle)) in enumerate(bad.items()):
        path = tmp_path / f"ckpt{i}.pt"
        if ckpt is None:
            path.write_bytes(Path(data).read_bytes())
        else:
            torch.save(ckpt, path)
        try:  # weights that load and still act are fine; anything else is one line
            main_in_process(module, eval_checkpoint=str(path))
            assert case == "huge weights", case
        except SystemExit as exc:
            message = str(exc.code)
            assert needle in message and "\n" not in message, (case, message)
    assert not marker.exists()


@pytest.mark.parametrize("name", ("bc.py", "brpo.py"))
def test_run_directory_in_use_and_stale_files(name, datasets, tmp_path):
    module = load_script(name)
    runs, data = tmp_path / "runs", str(datasets[0.15])
    (runs / "r").mkdir(parents=True)
    held = os.open(runs / "r", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a process running in runs/r holds it
    with pytest.raises(SystemExit) as exc:
        main_in_process(module, dataset_path=data, runs_dir=str(runs), run_name="r")
    assert "in use by another running process" in str(exc.value.code)
    os.close(held)
    # what a killed run left (curves, a model, a temporary file) is cleared; other files are not touched
    for stale in ("events.out.tfevents.1.old.0", "model.pt", "result.json.x.tmp", "run.log"):
        (runs / "r" / stale).write_text("stale")
    main_in_process(module, dataset_path=data, runs_dir=str(runs), run_name="r", total_steps=100)
    names = sorted(p.name for p in (runs / "r").iterdir())
    assert names[-2:] == ["result.json", "run.log"] and len(names) == 3 and names[0] != "events.out.tfevents.1.old.0"


# ------------------------------------------------------------------------------------------------
# faults that need a real process: a full disk, an unwritable directory, interrupts
# ------------------------------------------------------------------------------------------------
def run_limited(args, max_bytes=None, drop_dac=False, **kw) -> subprocess.CompletedProcess:
    """Run a script with files limited to `max_bytes` (writes beyond fail as on a full disk: Python ignores
    SIGXFSZ, so write() returns EFBIG) and, for root, without the capability that lets root write anywhere."""
    def preexec():
        if max_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
        if drop_dac and os.geteuid() == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH out of the bounding set (PR_CAPBSET_DROP)
                libc.prctl(24, cap)
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, preexec_fn=preexec,
                          timeout=300, **kw)


@pytest.mark.parametrize("name, flags", [(n, ["--save-model", "--no-tensorboard"] if i % 2 else [])
                                         for i, n in enumerate(ALGORITHMS)])
def test_full_disk_is_one_line_and_leaves_nothing(name, flags, datasets, tmp_path):
    proc = run_limited([REPO / name, "--dataset-path", datasets[0.15], "--runs-dir", tmp_path / "runs", "--run-name",
                        "r", *TINY, *flags], max_bytes=1024)
    failed_cleanly(proc, "cannot write to")
    assert not (tmp_path / "runs").exists()  # the run created it: it goes with the run


def test_read_only_runs_dir_and_dataset_location(datasets, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    proc = run_limited([REPO / "bc.py", "--dataset-path", datasets[0.15], "--runs-dir", ro / "runs", *TINY],
                       drop_dac=True)
    failed_cleanly(proc, "cannot create the run directory")
    proc = run_limited([REPO / "collect_data.py", "--epsilon", "0.15", "--num-transitions", "100",
                        "--dataset-path", ro / "d.npz"], drop_dac=True)
    failed_cleanly(proc, "cannot write")
    assert list(ro.iterdir()) == []


def test_a_relative_dataset_path_is_recorded_absolute(datasets, tmp_path):
    """certify.py (and --eval-checkpoint) find the batch from any working directory."""
    (tmp_path / "ds").mkdir()
    shutil.copy(datasets[0.15], tmp_path / "ds" / "b.npz")
    proc = run([REPO / "dqn_offline.py", "--dataset-path", "ds/b.npz", *TINY, "--save-model", "--run-name", "r",
                "--no-tensorboard"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "runs" / "r" / "result.json").read_text())
    absolute = str((tmp_path / "ds" / "b.npz").resolve())
    assert result["dataset_path"] == result["args"]["dataset_path"] == absolute
    proc = run([REPO / "certify.py", tmp_path / "runs" / "r" / "model.pt", "--json"], cwd=tmp_path / "ds")
    assert proc.returncode == 0 and json.loads(proc.stdout)["dataset_path"] == absolute, proc.stderr


def test_a_task_name_that_cannot_name_a_directory_asks_for_run_name(datasets, tmp_path):
    path = rewritten(datasets[0.15], tmp_path / "esc.npz", env_id=np.array("../escape"))
    proc = run([REPO / "dqn_offline.py", "--env-id", "../escape", "--dataset-path", path, *TINY], cwd=tmp_path)
    failed_cleanly(proc, "--env-id '../escape' cannot start a run directory's name; pass --run-name")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escape__eps0.15").exists()


def test_collect_data_behaviour_file_is_never_replaced_unasked_and_a_pipe_does_not_hang(tmp_path):
    net = tmp_path / "net.npz"
    net.write_bytes(b"a user's file")
    proc = run([REPO / "collect_data.py", "--epsilon", "0.15", "--dataset-path", tmp_path / "d.npz", "--train-behavior",
                "--behavior-path", net])
    failed_cleanly(proc, "pass --overwrite to replace it")
    assert net.read_bytes() == b"a user's file"
    os.mkfifo(tmp_path / "fifo.npz")
    proc = run([REPO / "collect_data.py", "--epsilon", "0.15", "--dataset-path", tmp_path / "d.npz", "--behavior-path",
                tmp_path / "fifo.npz"], timeout=60)
    failed_cleanly(proc, "is not a regular file")
    assert not (tmp_path / "d.npz").exists()
    proc = run([REPO / "collect_data.py", "--epsilon", "0.15", "--dataset-path", tmp_path / "fifo.npz"], timeout=60)
    failed_cleanly(proc, "is not a regular file (a pipe or device)")


def test_collect_data_full_disk_and_bad_seeds(tmp_path):
    proc = run_limited([REPO / "collect_data.py", "--epsilon", "0.15", "--num-transitions", "500",
                        "--behavior-eval-episodes", "2", "--behavior-eval-passes", "1",
                        "--dataset-path", tmp_path / "d.npz"], max_bytes=4096)
    failed_cleanly(proc, "cannot write")
    assert list(tmp_path.iterdir()) == []
    for flag in ("--seed", "--eval-seed"):
        proc = run([REPO / "collect_data.py", f"{flag}=-1", "--dataset-path", tmp_path / "d.npz", "--epsilon", "0.15"])
        failed_cleanly(proc, f"{flag} must lie in")


@pytest.mark.parametrize("name, sig", [("bc.py", signal.SIGINT), ("brpo.py", signal.SIGTERM)])
def test_interrupted_run_says_so_and_leaves_nothing(name, sig, datasets, tmp_path):
    run_dir = tmp_path / "runs" / "r"
    proc = subprocess.Popen([sys.executable, REPO / name, "--dataset-path", datasets[0.15], "--runs-dir",
                             tmp_path / "runs", "--run-name", "r", "--total-steps", "1000000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    deadline = time.time() + 60
    while not list(run_dir.glob("events.out.tfevents.*")) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # where it hangs: every thread's stack, printed by the fault handler on SIGABRT
        proc.send_signal(signal.SIGABRT)
        pytest.fail(f"{name} still running 60 s after the signal:\n{proc.communicate()[1]}")
    assert proc.returncode == 130
    assert err.strip().splitlines() == [f"{name}: interrupted; nothing written"], err
    assert not run_dir.exists()


INTERRUPTED_INSIDE = {  # patched code that, the first time training calls it, has a SIGINT arrive inside
    # a library that swallows the KeyboardInterrupt (a finalizer, an `except BaseException`)
    "a library that swallows it": """
step = common.Adam.step
def patched(self, *a, **k):
    common.Adam.step = step
    try:
        signal.raise_signal(signal.SIGINT)
    except BaseException:
        pass
    return step(self, *a, **k)
common.Adam.step = patched
""",
    # TensorBoard's queue holding its lock, which a KeyboardInterrupt there can leave held (Condition.__enter__)
    "TensorBoard's queue": """
from torch.utils.tensorboard import SummaryWriter
add_scalar = SummaryWriter.add_scalar
def patched(self, *a, **k):
    SummaryWriter.add_scalar = add_scalar
    mutex = self.file_writer.event_writer._async_writer._byte_queue.mutex
    mutex.acquire()
    signal.raise_signal(signal.SIGINT)
    mutex.release()
    return add_scalar(self, *a, **k)
SummaryWriter.add_scalar = patched
"""}


@pytest.mark.parametrize("inside", INTERRUPTED_INSIDE)
def test_interrupt_while_training_stops_at_the_next_update(inside, datasets, tmp_path):
    """A signal while the members train stops the run at its next update (or evaluation step), not wherever it
    struck: one line, exit 130, nothing written (before, the first case trained on and the second hung)."""
    argv = [str(REPO / "bc.py"), "--dataset-path", str(datasets[0.15]), "--runs-dir", str(tmp_path / "runs"),
            "--run-name", "r", "--total-steps", "300", "--eval-frequency", "100", "--eval-episodes", "2"]
    code = (f"import runpy, signal, sys\nsys.path.insert(0, {str(REPO)!r})\nimport common\n"
            f"{INTERRUPTED_INSIDE[inside]}\nsys.argv = {argv!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 130 and proc.stderr.strip().splitlines() == ["bc.py: interrupted; nothing written"], \
        proc.stderr
    assert not (tmp_path / "runs").exists()


def test_tensorboard_missing_is_one_line(datasets, tmp_path, monkeypatch):
    """TensorBoard is imported only when a run writes to it: without the package, --tensorboard is one line."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if it were not installed
    message = one_line_failure(load_script("bc.py"), tmp_path / "runs", dataset_path=str(datasets[0.15]),
                               tensorboard=True)
    assert "--no-tensorboard" in message


def test_stdout_closed_by_its_reader(datasets, tmp_path):
    """`script | head`: a run stops like an interrupted one (one line, exit 141 as SIGPIPE would, nothing kept), not
    blaming its run directory; `--help | head` is no failure. No traceback either way."""
    run_dir = tmp_path / "runs" / "r"
    proc = subprocess.Popen([sys.executable, REPO / "bc.py", "--dataset-path", datasets[0.15], "--runs-dir",
                             tmp_path / "runs", "--run-name", "r", "--total-steps", "1000000", "--eval-frequency", "100",
                             "--eval-episodes", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("step=100 ")
    proc.stdout.close()  # the reader exits, as head does after its lines
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141
    assert err.strip().splitlines() == ["bc.py: standard output was closed by its reader; stopped, nothing written"]
    assert not run_dir.exists()
    for script in ("brpo.py", "collect_data.py", "benchmark/throughput.py"):
        proc = subprocess.Popen([sys.executable, REPO / script, "--help"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        proc.stdout.close()  # before the help is printed (the interpreter is still starting)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and err == "", (script, err)


@pytest.mark.parametrize("name", ("brpo.py", "brpo_c.py"))
def test_brpo_documented_settings_and_limits(name, datasets, tmp_path):
    """The paper's state-dependent temperature (--kappa-max inf) finishes, its inf recorded as text; a confidence
    level whose Bonferroni level rounds to 1, and a dataset whose beta is not its behaviour network's, are refused."""
    module = load_script(name)
    data = str(datasets[0.15])
    main_in_process(module, dataset_path=data, runs_dir=str(tmp_path), run_name="inf", kappa_max=float("inf"),
                    kappa_scale=0.02, pessimism=0.0, total_steps=100, tensorboard=False)
    assert json.loads((tmp_path / "inf" / "result.json").read_text())["args"]["kappa_max"] == "inf"
    message = one_line_failure(module, tmp_path / "r1", dataset_path=data, certificate_confidence=1 - 1e-16)
    assert "--certificate-confidence" in message
    with np.load(datasets[1.0]) as f:  # uniform beta, labelled 0.15
        probs = f["behavior_probs"]
    mislabelled = rewritten(datasets[0.15], tmp_path / "mislabelled.npz", behavior_probs=probs[:2000])
    assert "disagree" in one_line_failure(module, tmp_path / "r2", dataset_path=mislabelled)
    with np.load(datasets[0.15]) as f:  # a lower precision moves some argmax: the message names it
        half = {k: f[k].astype(np.float16) for k in ("observations", "next_observations")}
    half_precision = rewritten(datasets[0.15], tmp_path / "half.npz", **half)
    message = one_line_failure(module, tmp_path / "r3", dataset_path=half_precision)
    assert "disagree" in message and "float16" in message


@pytest.mark.parametrize("sig, delay", [(signal.SIGINT, 0.6), (signal.SIGTERM, 0.6)])
def test_interrupt_while_loading_is_one_line(sig, delay, datasets, tmp_path):
    proc = subprocess.Popen([sys.executable, REPO / "dqn_offline.py", "--dataset-path", datasets[0.15], "--runs-dir",
                             tmp_path / "runs"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines() == ["dqn_offline.py: interrupted; nothing written"], err
    assert not (tmp_path / "runs").exists()


def test_collect_data_interrupted_leaves_no_directory(tmp_path):
    out = tmp_path / "new" / "deeper" / "d.npz"
    proc = subprocess.Popen([sys.executable, REPO / "collect_data.py", "--epsilon", "0.15", "--num-transitions",
                             "5000000", "--dataset-path", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(3.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines() == [
        "collect_data.py: interrupted; no partial dataset was kept"], err
    assert list(tmp_path.iterdir()) == []
