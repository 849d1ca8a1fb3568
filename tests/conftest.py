"""Shared fixtures: small datasets made once per test session by the real collect_data.py."""

from __future__ import annotations

import contextlib
import io
import runpy
import signal
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the scripts import common.py from their directory, as `python script.py` does
ALGORITHMS = ("dqn_offline.py", "bc.py", "brpo.py", "brpo_c.py", "bcq_discrete.py", "klq.py", "spibb.py",
              "cql_discrete.py")


def run(args: list[str], cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a repo script with the current interpreter, capturing its output."""
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def run_in_process(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`run` in this process: the script runs as __main__ with its output captured, which saves the second or more a
    new interpreter spends importing torch. As the interpreter would: a message exit is exit code 1 with the message
    on stderr, an exception is exit code 1 with its traceback, and warnings are printed to stderr under the default
    filters. The time limit raises TimeoutError; the signal handlers and thread hook the script installs are
    restored."""
    argv = [str(a) for a in args]
    saved = sys.argv, signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), threading.excepthook

    def expire(*_):
        raise TimeoutError(f"{argv[0]} ran longer than {timeout} s")

    out, err, code = io.StringIO(), io.StringIO(), 0
    previous_alarm = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        sys.argv = argv
        with (contextlib.redirect_stdout(out), contextlib.redirect_stderr(err),
              warnings.catch_warnings(record=True) as w):
            warnings.simplefilter("default")  # the interpreter's default filters:
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
            try:
                runpy.run_path(argv[0], run_name="__main__")
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except TimeoutError:
                raise
            except Exception:
                code = 1
                traceback.print_exc()
            for m in w:
                err.write(warnings.formatwarning(m.message, m.category, m.filename, m.lineno))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        sys.argv = saved[0]
        signal.signal(signal.SIGINT, saved[1])
        signal.signal(signal.SIGTERM, saved[2])
        threading.excepthook = saved[3]
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def make_dataset(path: Path, env_id: str = "CartPole-v1", epsilon: float = 0.15, n: int = 2000, seed: int = 0) -> Path:
    proc = run([REPO / "collect_data.py", "--env-id", env_id, "--epsilon", str(epsilon), "--num-transitions", str(n),
                "--behavior-eval-episodes", "3", "--behavior-eval-passes", "1", "--seed", str(seed), "--dataset-path", path])
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture(scope="session")
def datasets(tmp_path_factory) -> dict:
    """Small CartPole datasets at eps 0.15 (the default epsilon of the scripts), 0 and 1."""
    root = tmp_path_factory.mktemp("datasets")
    return {eps: make_dataset(root / f"CartPole-v1_eps{eps:g}.npz", epsilon=eps) for eps in (0.15, 0.0, 1.0)}
