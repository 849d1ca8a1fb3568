"""Shared fixtures: small datasets made once per test session by the real collect_data.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the scripts import common.py from their directory, as `python script.py` does
ALGORITHMS = ("dqn_offline.py", "bc.py", "brpo.py", "brpo_c.py", "bcq_discrete.py", "klq.py", "spibb.py",
              "cql_discrete.py")


def run(args: list[str], cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a repo script with the current interpreter, capturing its output."""
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)


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
