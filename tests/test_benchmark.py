"""Tests of the benchmark tooling (benchmark/run_grid.py, benchmark/aggregate.py).

They never call the real algorithm scripts: a fake algorithm script (and a fake collect_data.py) is
written into pytest's tmp_path and used as the "repo" the runner launches.
"""
from __future__ import annotations

import csv
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmark"
sys.path.insert(0, str(BENCH))
import aggregate  # noqa: E402
import run_grid  # noqa: E402
from run_grid import ALGORITHMS, PAPER_ALGORITHMS, Cell, expand_grid  # noqa: E402

FAKE_ALGO = textwrap.dedent('''
    """Fake algorithm script honouring the member flags of the scripts (--epsilons, --seeds, --sweep, a run-name
    template, --skip-finished) and the result.json schema: one result per member."""
    import argparse, itertools, json, os, sys, time
    MEMBER_FLAGS = ("mu",)
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", required=True)
    p.add_argument("--epsilons", type=float, nargs="+", required=True)
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--sweep", nargs="+", default=[])  # a list, as the scripts' (tyro): a second --sweep replaces it
    p.add_argument("--skip-finished", action="store_true")
    p.add_argument("--total-steps", type=int, default=5000)
    p.add_argument("--eval-frequency", type=int, default=1000)
    p.add_argument("--eval-episodes", type=int, default=40)
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--run-name", required=True)
    p.add_argument("--threads", type=int, default=1)
    args, extra = p.parse_known_args()
    fixed = {extra[i].lstrip("-").replace("-", "_"): float(extra[i + 1]) for i in range(0, len(extra), 2)}
    swept = {}
    for spec in args.sweep:
        key, values = spec.split("=")
        swept[key.replace("-", "_")] = [float(v) for v in values.split(",")]
    algo = os.path.splitext(os.path.basename(__file__))[0]
    if os.environ.get("FAKE_PIDS"):
        with open(os.path.join(os.environ["FAKE_PIDS"], str(os.getpid())), "w") as f:
            f.write(args.run_name)
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
    failed = False
    for eps, combo, seed in itertools.product(args.epsilons, itertools.product(*swept.values()), args.seeds):
        values = dict(zip(swept, combo))
        text = {"env_id": args.env_id, "epsilon": format(eps, ".15g"), "seed": seed,
                **{k: format(v, ".15g") for k, v in values.items()}}
        run_dir = os.path.join(args.runs_dir, args.run_name.format(**text))
        if args.skip_finished and os.path.exists(os.path.join(run_dir, "result.json")):
            print("skipped", run_dir)
            continue
        if os.environ.get("FAKE_CALLS"):
            with open(os.environ["FAKE_CALLS"], "a") as f:
                f.write(run_dir + "\\n")
        os.makedirs(run_dir, exist_ok=True)
        if os.environ.get("FAKE_FAIL") and os.environ["FAKE_FAIL"] in run_dir:
            print("fake failure: boom", run_dir, file=sys.stderr)
            failed = True
            continue
        if os.environ.get("FAKE_NO_RESULT") and os.environ["FAKE_NO_RESULT"] in run_dir:
            continue
        n = args.total_steps // args.eval_frequency
        evals = [{"step": (k + 1) * args.eval_frequency, "return_mean": 10.0 * seed + k, "return_std": 1.0}
                 for k in range(n)]
        last = evals[-10:]
        flags = {k: v for k, v in vars(args).items() if k not in ("epsilons", "seeds", "sweep")}
        result = {"algorithm": algo, "env_id": args.env_id, "epsilon": eps, "seed": seed,
                  "args": {**flags, "epsilon": eps, "seed": seed, **fixed, **values}, "evaluations": evals,
                  "final_score": sum(e["return_mean"] for e in last) / len(last), "behavior_return": 5.0,
                  "wall_time": 0.1, "train_time": 0.05, "eval_time": 0.05, "updates_per_second": 1e5,
                  "dataset_path": "x.npz", "format_version": 1, "extra": {}}
        tmp = os.path.join(run_dir, "result.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(run_dir, "result.json"))
        print("done", algo, run_dir)
    sys.exit(3 if failed else 0)
''')

FAKE_COLLECT = textwrap.dedent('''
    import argparse, os
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", required=True)
    p.add_argument("--epsilon", type=float, nargs="+", required=True)
    a = p.parse_args()
    if os.environ.get("FAKE_CALLS"):
        with open(os.environ["FAKE_CALLS"], "a") as f:
            f.write("collect " + a.env_id + " " + " ".join(format(e, "g") for e in a.epsilon) + "\\n")
    os.makedirs("datasets", exist_ok=True)
    for e in a.epsilon:
        with open(os.path.join("datasets", f"{a.env_id}_eps{e:g}.npz"), "wb") as f:
            f.write(b"fake")
''')


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A fake repo: the algorithm scripts + collect_data.py, all fakes."""
    root = tmp_path / "repo"
    root.mkdir()
    for script, _ in ALGORITHMS.values():
        (root / script).write_text(FAKE_ALGO)
    (root / "collect_data.py").write_text(FAKE_COLLECT)
    (root / "common.py").write_text('SHARED_MEMBER_FLAGS = ("learning_rate",)\n')
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.txt"))
    for var in ("FAKE_FAIL", "FAKE_NO_RESULT", "FAKE_SLEEP", "FAKE_PIDS"):
        monkeypatch.delenv(var, raising=False)
    return root


def calls(tmp_path) -> list[str]:
    path = tmp_path / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def small_grid_args(repo, out, *extra):
    return ["--repo", str(repo), "--out", str(out), "--envs", "CartPole-v1", "--epsilons", "0.05", "1.0",
            "--algos", "brpo", "dqn", "--seeds", "1", "2", "--total-steps", "3000", "--eval-frequency", "1000",
            "--workers", "2", *extra]


# ----------------------------------------------------------------------------------------------
# grid expansion
# ----------------------------------------------------------------------------------------------
def test_paper_grid_counts_and_unique_names():
    cells = expand_grid(run_grid.ENVS, run_grid.PAPER_EPSILONS, list(PAPER_ALGORITHMS), run_grid.PAPER_SEEDS)
    assert len(cells) == 3 * 5 * 7 * 5
    assert len({c.run_name for c in cells}) == len(cells)
    assert len(set(cells)) == len(cells)
    c = Cell("Acrobot-v1", 0.15, "brpo", 3)
    assert c.run_name == "Acrobot-v1/eps0.15/brpo/seed3"
    assert Cell("CartPole-v1", 1.0, "brpo_c", 1, (("lam", 0.5),)).run_name == "CartPole-v1/eps1/brpo_c__lam=0.5/seed1"


def test_the_runners_run_names_for_the_whole_paper_sweep_are_accepted_by_the_scripts(capsys):
    """Every process of the full sweep (all of an algorithm's flags in the name), as the runner writes it, passes the
    scripts' own checks: its template (it once refused BRPO's seven-flag template; BRPO's longest is now over the
    255 bytes of a file name, which only the formatted names must respect) and each member's formatted name."""
    sys.path.insert(0, str(BENCH.parent))
    import common
    assert run_grid.main(["--dry-run", "--no-collect", "--out", "/nonexistent/runs", "--envs", "LunarLander-v3",
                          "--epsilons", "0.05", "--seeds", "1", "--algos", *ALGORITHMS,
                          "--grid", str(BENCH / "paper_sweep.json")]) == 0
    modules, longest, members = {}, 0, 0
    for line in capsys.readouterr().out.splitlines():
        if "--run-name" not in line:
            continue
        argv = shlex.split(line)
        script, template = argv[1], argv[argv.index("--run-name") + 1]
        if script not in modules:
            spec = importlib.util.spec_from_file_location(f"names_{script[:-3]}", BENCH.parent / script)
            modules[script] = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = modules[script]
            spec.loader.exec_module(modules[script])
        sweep = argv[argv.index("--sweep") + 1:argv.index("--threads")] if "--sweep" in argv else []
        args = dataclasses.replace(modules[script].Args(), env_id="LunarLander-v3", epsilons=(0.05,), seeds=(1,),
                                   sweep=tuple(sweep), run_name=template)
        common.check_args(args)  # SystemExit if refused
        runs = common.member_args(args, common.check_args, getattr(modules[script], "MEMBER_FLAGS", ()))
        assert all(len(part.encode()) <= 255 for a in runs for part in a.run_name.split("/"))
        longest, members = max(longest, *(len(part.encode()) for part in template.split("/"))), members + len(runs)
    assert set(modules) == {script for script, _ in ALGORITHMS.values()}
    assert longest > 255 and members == 9 + 135 * 3 + (108 + 36 + 24) * 3 + 36 * 3 + 3 + 9 * 5


def test_sweep_expansion_counts_and_dedup():
    with pytest.raises(run_grid.GridError, match="0.5 is listed more than once"):  # within one list: likely a typo
        run_grid.parse_sweep("brpo_c:lam=0.25,0.5,0.75,0.5", ["brpo_c", "dqn"])
    grid = run_grid.merge_grids(run_grid.parse_sweep("brpo_c:lam=0.25,0.5,0.75", ["brpo_c", "dqn"]),
                                run_grid.parse_sweep("all:learning-rate=0.001,0.0003", ["brpo_c", "dqn"]))
    cells = expand_grid(["CartPole-v1", "Acrobot-v1"], [0.05, 0.5], ["brpo_c", "dqn"], [1, 2, 3], grid)
    # brpo_c: 3 lam x 2 lr; dqn: 2 lr
    assert len(cells) == 2 * 2 * (3 * 2 + 2) * 3
    assert len({c.run_name for c in cells}) == len(cells)
    assert {dict(c.hparams)["lam"] for c in cells if c.algo == "brpo_c"} == {0.25, 0.5, 0.75}
    # blocks that overlap (a grid file's) run their shared configurations once
    cells = expand_grid(["CartPole-v1"], [0.5], ["brpo_c"], [1], {"brpo_c": [{"lam": [0.25, 0.5]}, {"lam": [0.5, 0.75]}]})
    assert sorted(dict(c.hparams)["lam"] for c in cells) == [0.25, 0.5, 0.75]


def test_paper_sweep_file_matches_paper_ranges():
    algos = list(PAPER_ALGORITHMS)
    grid = run_grid.load_grid_file(BENCH / "paper_sweep.json", algos)
    (brpo_c,), (brpo, brpo_cql, brpo_alpha), (dqn,) = grid["brpo_c"], grid["brpo"], grid["dqn"]
    assert brpo_c["lam"] == [0.25, 0.33, 0.5, 0.66, 0.75]
    assert brpo["confidence_learning_rate"] == [0.0002, 0.0001]
    assert dqn["target_update_frequency"] == [150, 500, 1500]
    assert grid["klq"][0]["kl_weight"] == [0.01, 0.03, 0.1, 0.3]
    cells = expand_grid(["CartPole-v1"], [0.5], algos, [1], grid)
    expected = sum(math.prod(len(v) for v in block.values()) for a in algos for block in grid[a])
    assert brpo["kappa_max"] == brpo_c["kappa_max"] == [0.001, 0.005, 0.02]  # the temperature
    assert brpo["penalty_scale"] == [0.1, 0]  # ours: how far BRPO moves on uniform data
    # ours, BRPO's second block: a conservative critic without the pessimism term, the rest of the first block
    critic_only = ("cql_alpha", "pessimism", "kappa_max", "deploy_pessimism")
    assert {k: v for k, v in brpo_cql.items() if k not in critic_only} == {
        k: v for k, v in brpo.items() if k not in critic_only}
    assert (brpo_cql["cql_alpha"], brpo_cql["pessimism"], brpo_cql["kappa_max"]) == ([0.1], [0], [0.001])
    # the flags the committed report ran with, named since the defaults moved (pessimism 0 with a fallback to 1):
    # the first block trains at pessimism 1, the critic blocks deploy their trained pi at level 0 alone
    assert brpo["pessimism"] == [1] and "deploy_pessimism" not in brpo
    assert brpo_cql["deploy_pessimism"] == brpo_alpha["deploy_pessimism"] == [0]
    # its third block: the critic's alpha on either side of 0.1, at the extreme mu values and lr 1e-4 only
    narrowed = ("cql_alpha", "mu", "confidence_learning_rate")
    assert {k: v for k, v in brpo_alpha.items() if k not in narrowed} == {
        k: v for k, v in brpo_cql.items() if k not in narrowed}
    assert [brpo_alpha[k] for k in narrowed] == [[0.03, 0.3], [0.1, 0.9], [0.0001]]
    assert len(cells) == expected == 9 + 135 * 3 + (108 + 36 + 24) * 3 + 36 + 36 + 36 + 3
    assert len({c.run_name for c in cells}) == len(cells)
    assert run_grid.flag_errors(grid) == []
    # CQL, not in the paper: DQN's ranges and our alpha range, every flag one of cql_discrete.py's
    grid = run_grid.load_grid_file(BENCH / "paper_sweep.json", list(ALGORITHMS))
    assert {k: v for k, v in grid["cql"][0].items() if k != "cql_alpha"} == grid["dqn"][0]
    assert grid["cql"][0]["cql_alpha"] == [0.1, 0.5, 1.0, 2.0, 5.0]
    assert len(expand_grid(["CartPole-v1"], [0.5], ["cql"], [1], grid)) == 9 * 5
    assert run_grid.flag_errors(grid) == []
    # the specific part: the same blocks without the learning rate and target period
    specific = run_grid.load_grid_file(BENCH / "paper_sweep_specific.json", list(ALGORITHMS))
    assert specific["brpo"] == [{k: v for k, v in b.items() if k not in ("learning_rate", "target_update_frequency")}
                                for b in grid["brpo"]]
    assert len(expand_grid(["CartPole-v1"], [0.5], list(ALGORITHMS), [1], specific)) == 120


def test_grid_file_blocks_are_a_union(tmp_path):
    """An algorithm's entry may be a list of products (their union, duplicates once); a --sweep or a '*' entry
    sets its flag in every block; anything else in the list is refused with one line."""
    f = tmp_path / "g.json"
    f.write_text(json.dumps({"algorithms": {"brpo": [{"mu": [0.1, 0.9], "kappa_max": [0.001]},
                                                     {"mu": [0.9], "kappa_max": [0.001]}, {"cql_alpha": [0.1, 1]}],
                                            "*": {"learning_rate": [0.001]}}}))
    grid = run_grid.load_grid_file(f, ["brpo", "dqn"])
    assert grid["dqn"] == [{"learning_rate": [0.001]}] and all(b["learning_rate"] == [0.001] for b in grid["brpo"])
    cells = expand_grid(["CartPole-v1"], [0.5], ["brpo"], [1, 2], grid)
    assert len(cells) == (2 + 2) * 2 == len({c.run_name for c in cells})
    swept = run_grid.merge_grids(grid, run_grid.parse_sweep("brpo:penalty_scale=0,0.1", ["brpo"]))
    assert len(expand_grid(["CartPole-v1"], [0.5], ["brpo"], [1], swept)) == 4 * 2
    for bad in ([], [{"mu": [0.1]}, [0.5]], [{"mu": []}]):
        f.write_text(json.dumps({"algorithms": {"brpo": bad}}))
        with pytest.raises(run_grid.GridError, match="brpo"):
            run_grid.load_grid_file(f, ["brpo"])


def test_default_grid_is_the_papers_seven_and_cql_is_known():
    assert run_grid.make_parser().parse_args([]).algos == list(PAPER_ALGORITHMS) == [
        a for a in ALGORITHMS if a != "cql"]
    assert run_grid.canonical_algo("cql_discrete") == run_grid.canonical_algo("CQL") == "cql"
    assert ALGORITHMS["cql"] == ("cql_discrete.py", "CQL") and list(ALGORITHMS)[-1] == "cql"
    assert run_grid.member_flags(BENCH.parent / "cql_discrete.py") >= {"cql_alpha"}


def test_flags_are_read_from_the_scripts():
    brpo = run_grid.script_flags(BENCH.parent / "brpo.py")  # with their annotations, the shared ones from common.py
    assert {"mu", "confidence_learning_rate", "penalty_scale", "kappa_max"} <= brpo.keys()
    assert brpo["mu"] == brpo["learning_rate"] == "float" and brpo["target_update_frequency"] == "int"
    assert "lam" in run_grid.script_flags(BENCH.parent / "brpo_c.py") and "lam" not in run_grid.script_flags(BENCH.parent / "brpo.py")
    assert run_grid.flag_errors({"brpo": {"lam": [0.5]}, "klq": {"kl_weight": [0.1]}}) == [
        "--lam is not a flag of brpo.py"]
    # a value of a type the script cannot parse, an int flag given a float, a float flag given a boolean
    grid = {"brpo": [{"mu": [0.5, "abc"]}, {"target_update_frequency": [2.5, 1e3, 1e20]}],  # 1e3: written 1000, fine
            "dqn": {"learning_rate": [True, 1]}}
    assert run_grid.flag_errors(grid) == [
        "--mu of brpo.py takes float values, got 'abc'", "--target-update-frequency of brpo.py takes int values, got 2.5",
        "--target-update-frequency of brpo.py takes int values, got 1e+20",
        "--learning-rate of dqn_offline.py takes float values, got True"]


def test_pack_command_format():
    cells = [Cell("Acrobot-v1", e, "brpo", seed, (("mu", 0.5), ("penalty_scale", 0.1))) for e in (0.15, 1.0)
             for seed in (3, 4)]
    pack, = run_grid.pack_cells(cells, BENCH.parent, 100)
    cmd = run_grid.pack_command(pack, {"total_steps": 20000, "eval_frequency": None}, Path("/o"), "python", 1)
    assert cmd[:2] == ["python", "brpo.py"]
    text = " ".join(cmd)
    assert "--env-id Acrobot-v1 --epsilons 0.15 1 --seeds 3 4 --total-steps 20000" in text
    assert "--sweep mu=0.5 penalty-scale=0.1 --threads" in text and "--eval-frequency" not in text
    assert text.endswith("--threads 1 --skip-finished --runs-dir /o --run-name "
                         "Acrobot-v1/eps{epsilon}/brpo__mu={mu},penalty_scale={penalty_scale}/seed{seed}")
    # the template names each member's cell exactly
    for c in cells:
        assert cmd[-1].format(epsilon=format(c.epsilon, ".15g"), seed=c.seed, mu="0.5", penalty_scale="0.1") == c.run_name
    # flags no member may vary make separate processes; boolean flags are --flag / --no-flag
    cells = [Cell("CartPole-v1", 1.0, "bc", 1, (("eval_greedy", value),)) for value in (True, False)]
    packs = run_grid.pack_cells(cells, BENCH.parent, 100)
    assert len(packs) == 2
    for value, pack in zip((True, False), packs):
        cmd = run_grid.pack_command(pack, {}, Path("/o"), "python", 1)
        assert ("--eval-greedy" if value else "--no-eval-greedy") in cmd
        assert cmd[-1] == f"CartPole-v1/eps{{epsilon}}/bc__eval_greedy={value}/seed{{seed}}"


def test_packs_hold_every_cell_exactly_once():
    """The Table 1 grid and a sweep: every cell in exactly one process, no process above --max-members, and each
    process's members (the product of its epsilons, swept values and seeds) are cells of the grid."""
    grid = run_grid.load_grid_file(BENCH / "paper_sweep.json", list(ALGORITHMS))
    for cells in (expand_grid(run_grid.ENVS, run_grid.PAPER_EPSILONS, list(ALGORITHMS), run_grid.PAPER_SEEDS),
                  expand_grid(["CartPole-v1"], [0.05, 0.5], list(ALGORITHMS), [1, 2, 3], grid)):
        names = {c.run_name for c in cells}
        for max_members in (1, 7, 25, 100):
            packs = run_grid.pack_cells(cells, BENCH.parent, max_members)
            held = [c.run_name for pack in packs for c in pack.cells]
            assert sorted(held) == sorted(names)
            assert all(pack.size <= max_members for pack in packs)
            for pack in packs[:40]:
                cmd = run_grid.pack_command(pack, {}, Path("/o"), "python", 1)
                members = {cmd[-1].format(epsilon=format(e, ".15g"), seed=seed, **{
                    k: format(v, ".15g") if isinstance(v, float) else v for k, v in zip(pack.swept, values)})
                    for e in pack.epsilons for seed in pack.seeds
                    for values in itertools.product(*pack.swept.values())}
                assert len(members) == pack.size and members <= names
    table1 = run_grid.pack_cells(expand_grid(run_grid.ENVS, run_grid.PAPER_EPSILONS, list(PAPER_ALGORITHMS),
                                             run_grid.PAPER_SEEDS), BENCH.parent, 100)
    assert len(table1) == 3 * 7 and all(pack.size == 25 for pack in table1)  # one process per task and algorithm


def test_packs_are_as_few_as_the_bound_allows():
    """A sweep is packed into the fewest processes of at most --max-members (the per-member rate grows with M):
    BRPO-C's 45 configurations x 5 datasets x 5 seeds at 100 members are 15 processes of 75, one dataset each (the
    former halving made 64 of ~18); 5 datasets x 5 seeds at 10 members are 3 processes, not 4."""
    grid = run_grid.load_grid_file(BENCH / "paper_sweep_specific.json", list(ALGORITHMS))
    packs = run_grid.pack_cells(expand_grid(["CartPole-v1"], run_grid.PAPER_EPSILONS, ["brpo_c"], [1, 2, 3, 4, 5],
                                            grid), BENCH.parent, 100)
    assert len(packs) == 15 and all(p.size == 75 and len(p.epsilons) == 1 for p in packs)
    # BRPO's critic blocks share their flags: their union is split by cql_alpha into its products (12, 4 and 4
    # configurations x 25 runs), 14 processes of 100 with the first block's 36, not one per critic configuration (29)
    packs = run_grid.pack_cells(expand_grid(["CartPole-v1"], run_grid.PAPER_EPSILONS, ["brpo"], [1, 2, 3, 4, 5],
                                            grid), BENCH.parent, 100)
    assert len(packs) == 14 and all(p.size == 100 == len(p.cells) for p in packs)
    assert sorted(tuple(p.swept.get("cql_alpha", ())) for p in packs) == [()] * 9 + [(0.03,)] + [(0.1,)] * 3 + [(0.3,)]
    assert run_grid.fewest_parts([5, 5], 10) == (3, 1)
    assert run_grid.split_evenly([1, 2, 3, 4, 5], 3) == [[1, 2], [3, 4], [5]]
    assert run_grid.fewest_parts([5, 3, 5], 1) == (5, 3, 5) and run_grid.fewest_parts([5, 3, 5], 75) == (1, 1, 1)
    rng = random.Random(0)  # the search over distinct largest parts finds what trying every split finds
    for _ in range(100):
        sizes, bound = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))], rng.randint(1, 200)
        every = itertools.product(*[range(1, n + 1) for n in sizes])
        largest = lambda k: math.prod(-(-n // p) for n, p in zip(sizes, k))  # noqa: E731
        best = min((math.prod(k), largest(k)) for k in every if largest(k) <= bound)  # fewest, then smallest
        chosen = run_grid.fewest_parts(sizes, bound)
        assert (math.prod(chosen), largest(chosen)) == best


# ----------------------------------------------------------------------------------------------
# CLI errors and dry-run
# ----------------------------------------------------------------------------------------------
def test_packs_never_train_a_cell_outside_the_grid():
    """Per-cell configurations (run_grid.py --cells): a process trains every combination of its epsilons, values and
    seeds, so cells whose configurations differ are not packed together; a resumed full grid stays one process."""
    configs = {0.05: (("lam", 0.25), ("mu", 0.1)), 0.15: (("lam", 0.75), ("mu", 0.9)), 0.5: (("lam", 0.25), ("mu", 0.9)),
               1.0: (("lam", 0.25), ("mu", 0.1))}
    cells = [Cell("CartPole-v1", e, "brpo_c", s, hp) for e, hp in configs.items() for s in (1, 2)]
    packs = run_grid.pack_cells(cells, BENCH.parent, 100)
    assert sum(p.size for p in packs) == len(cells) == sum(len(p.cells) for p in packs)
    assert sorted(len(p.cells) for p in packs) == [2, 2, 4]  # eps 0.05 and 1 share their configuration
    full = expand_grid(["CartPole-v1"], [0.05, 0.5], ["brpo_c"], [1, 2, 3], {"brpo_c": {"lam": [0.25, 0.5]}})
    pending = [c for c in full if c.seed != 2 or c.epsilon != 0.5]  # some runs finished
    pack, = run_grid.pack_cells(pending, BENCH.parent, 100, full)
    assert pack.size == len(full) and len(pack.cells) == len(pending)


def test_packs_of_random_unions_of_products_train_exactly_the_grid():
    """Random grid files of overlapping blocks (BRPO's member flags, in some blocks a fixed flag), some runs finished: every
    pending cell is in exactly one process, and every member a process trains (its epsilons x values x seeds) is a
    cell of the grid."""
    rng = random.Random(1)
    values = {"mu": [0.1, 0.5, 0.9], "cql_alpha": [0.03, 0.1, 0.3], "penalty_scale": [0, 0.1], "kappa_max": [0.001, 0.02]}
    for _ in range(40):
        blocks = [{k: rng.sample(v, rng.randint(1, len(v))) for k, v in values.items()} for _ in range(rng.randint(1, 4))]
        for block in blocks:  # a flag no member may vary, in some blocks: separate processes
            if rng.random() < 0.5:
                block["deploy_pessimism"] = [rng.choice([0, 1])]
        full = expand_grid(["CartPole-v1"], [0.05, 0.5], ["brpo"], [1, 2], {"brpo": blocks})
        pending = [c for c in full if rng.random() < 0.8] or full
        names = {c.run_name for c in full}
        packs = run_grid.pack_cells(pending, BENCH.parent, rng.choice([4, 25, 100]), full)
        assert sorted(c.run_name for p in packs for c in p.cells) == sorted(c.run_name for c in pending)
        for pack in packs:
            trained = {Cell(pack.env_id, e, "brpo", seed, tuple(sorted([*pack.fixed, *zip(pack.swept, combo)]))).run_name
                       for e in pack.epsilons for seed in pack.seeds for combo in itertools.product(*pack.swept.values())}
            assert trained <= names and len(trained) == pack.size


@pytest.mark.parametrize("argv, message", [
    (["--algos", "sac"], "unknown algorithm 'sac'"),
    (["--envs", "Pong-v5"], "unknown env 'Pong-v5'"),
    (["--envs", "LunarLander-v2"], "use LunarLander-v3"),
    (["--sweep", "brpo_c-lam"], "bad --sweep"),
    (["--sweep", "brpo:seed=1,2"], "cannot be swept"),
    (["--sweep", "dqn:seeds=3"], "'seeds' is set by the runner and cannot be swept"),
    (["--sweep", "dqn:overwrite=1"], "'overwrite' is set by the runner and cannot be swept"),
    (["--algos", "brpo", *(x for k in ("mu", "kappa_max", "penalty_scale", "cql_alpha", "pessimism", "learning_rate",
                                       "tau", "gamma", "confidence_learning_rate")
                           for x in ("--sweep", f"brpo:{k}=0.123456789012345"))], "exceed the 255 bytes of a file name"),
    (["--sweep", "brpo:lam=0.5"], "--lam is not a flag of brpo.py"),
    (["--sweep", "brpo:mu=abc"], "--mu of brpo.py takes float values, got 'abc'"),
    (["--grid", "/nonexistent.json"], "not found"),
    (["--seeds", "-1"], "seeds must lie in"),
    (["--grid", "/"], "not a readable JSON file"),
    (["--sweep", "bc:learning_rate=nan"], "is not a number"),
    (["--threads", "100000"], "--threads must be at most"),
    (["--heartbeat", "nan"], "--heartbeat must be a positive"),
    (["--slurm", "--slurm-max-parallel", "-1"], "--slurm-max-parallel must be >= 1"),
    (["--slurm", "--slurm-time", "1:00\n#SBATCH --x"], "--slurm-time"),
    (["--sweep", "dqn:tau=0.5", "--sweep", "dqn:tau=1"], "sets dqn:tau twice"),
    (["--sweep", "dqn:learning_rate=1e-3,,2e-3"], "an empty value"),
    (["--sweep", "dqn:learning_rate=1e-3,0.001"], "0.001 is listed more than once"),
    (["--seeds", "1", "2", "1"], "--seeds lists 1 more than once"),
    (["--epsilons", "0.15", "0.15"], "--epsilons lists 0.15 more than once"),
])
def test_bad_input_one_line_error(argv, message, capsys, tmp_path):
    assert run_grid.main(["--dry-run", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("run_grid.py: error:") and message in err[0]


def test_paths_too_long_and_json_nested_too_deep_are_one_line(capsys, tmp_path):
    long = str(tmp_path / ("a" * 300))
    (tmp_path / "deep.json").write_text('{"cells": ' + "[" * 100_000)
    for main, argv, needle in ((run_grid.main, ["--dry-run", "--out", long], "File name too long (the file system"),
                               (run_grid.main, ["--dry-run", "--cells", str(tmp_path / "deep.json")],
                                "is not a selected.json of aggregate.py --selection-seeds (RecursionError"),
                               (aggregate.main, [str(tmp_path), "--paper-csv", long], "File name too long (the file")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_benchmark_tools_refuse_bad_flags_in_one_line(tmp_path):
    for script, argv, needle in (("throughput.py", ["--env-id", "Foo-v0"], "--env-id must be"),
                                 ("throughput.py", ["--epsilon", "0.3"], "--epsilon must be one of"),
                                 ("throughput.py", ["--repeats", "0"], "--repeats must be at least 1"),
                                 ("evaluator.py", ["--copies", "0"], "--copies must be at least 1")):
        proc = subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0 and needle in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


def test_flags_argparse_cannot_parse_are_one_line(capsys):
    """run_grid.py and aggregate.py (and headline_table.py, the same Parser): no usage block above the error line."""
    for main, argv, needle in ((run_grid.main, ["--workerz", "2"], "run_grid.py: error: unrecognized arguments: "
                                "--workerz 2 (see run_grid.py --help)"),
                               (aggregate.main, [], "aggregate.py: error: the following arguments are required: "
                                "RESULTS_DIR (see aggregate.py --help)")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and capsys.readouterr().err == needle + "\n"


def test_grid_and_cells_files_name_each_flag_once_and_values_without_commas(tmp_path, capsys):
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"algorithms": {"dqn": {"learning-rate": [0.001], "learning_rate": [0.0003]}}}))
    assert run_grid.main(["--grid", str(grid), "--dry-run", "--out", str(tmp_path / "o")]) == 2
    assert "'learning-rate' and 'learning_rate' name the same flag" in capsys.readouterr().err
    cells = tmp_path / "c.json"
    for hp, message in (({"learning-rate": 0.001, "learning_rate": 0.0003}, "name the same flag"),
                        ({"run_label": "1e-3,2e-3"}, "may not be empty or hold a comma")):
        cells.write_text(json.dumps({"cells": [{"env_id": "CartPole-v1", "epsilon": 0.15, "algorithm": "dqn",
                                                "hparams": hp}]}))
        assert run_grid.main(["--cells", str(cells), "--dry-run", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_unwritable_out_is_one_line(repo, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert run_grid.main(small_grid_args(repo, tmp_path / "file" / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write to --out" in err[0]
    assert calls(tmp_path) == []


def test_missing_scripts_error(tmp_path, capsys):
    assert run_grid.main(["--repo", str(tmp_path), "--out", str(tmp_path / "o"), "--no-collect"]) == 2
    assert "not found" in capsys.readouterr().err


def test_dry_run_prints_commands_and_runs_nothing(repo, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_grid.main(small_grid_args(repo, out, "--dry-run")) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("collect_data.py --env-id CartPole-v1 --epsilon 0.05 1")
    algo_lines = lines[1:]
    assert len(algo_lines) == 2  # one process per algorithm: 2 epsilons x 2 seeds as members
    assert all("--threads 1" in line and f"--runs-dir {out}" in line for line in algo_lines)
    assert any("brpo.py --env-id CartPole-v1 --epsilons 0.05 1 --seeds 1 2 --total-steps 3000" in line
               for line in algo_lines)
    assert not out.exists() and calls(tmp_path) == [] and not (repo / "datasets").exists()


# ----------------------------------------------------------------------------------------------
# local execution: datasets, resume, failures, Ctrl-C
# ----------------------------------------------------------------------------------------------
def test_expected_evaluations_are_counted_as_the_scripts_evaluate():
    """The scripts' schedule (every eval_frequency; every sparse one before the last 10; and the last update),
    counted, not listed, so that a result claiming 10^12 updates is judged at once (plus one: an evaluation at 0)."""
    for total, freq, sparse in ((100_000, 1000, 0), (100_000, 1000, 5000), (2500, 1000, 0), (20_000, 1000, 5000),
                                (7, 3, 2), (1000, 1, 0)):
        due = [k for k in range(1, total + 1) if (k % sparse == 0 if sparse and k <= total - 10 * freq
                                                 else k % freq == 0 or k == total)]
        assert run_grid.expected_evaluations(total, freq, sparse) == {len(due), len(due) + 1}, (total, freq, sparse)
    assert run_grid.expected_evaluations(10**12, 1) == {10**12, 10**12 + 1}
    assert run_grid.expected_evaluations("x", 1) is None and run_grid.expected_evaluations(10, 0) is None


def test_check_result_compares_a_multi_value_flag_with_its_request(tmp_path):
    """A flag that takes several values (brpo.py's --deploy-pessimism) is recorded as a list: a requested 0 matches a
    recorded [0.0] (the run is finished, not failed), and other values or lengths still do not."""
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"final_score": 1.0, "evaluations": [{"step": 1, "return_mean": 1.0}],
                                "args": {"deploy_pessimism": [0.0], "mu": 0.5}}))
    assert run_grid.check_result(path, None, {"deploy_pessimism": 0, "mu": 0.5}) is None
    assert run_grid.check_result(path, None, {"deploy_pessimism": [0]}) is None
    assert "deploy_pessimism" in run_grid.check_result(path, None, {"deploy_pessimism": 1})
    assert "deploy_pessimism" in run_grid.check_result(path, None, {"deploy_pessimism": [0, 1]})
    assert "mu" in run_grid.check_result(path, None, {"mu": [0.5, 0.9]})


def test_run_creates_datasets_then_results_and_resumes(repo, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_grid.main(small_grid_args(repo, out)) == 0
    first = calls(tmp_path)
    assert first[0] == "collect CartPole-v1 0.05 1"  # datasets first, one call per env
    assert len(first) == 1 + 8
    cells = expand_grid(["CartPole-v1"], [0.05, 1.0], ["brpo", "dqn"], [1, 2])
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    for cell in cells:
        assert run_grid.check_result(cell.run_dir(out) / "result.json", cell, {"total_steps": 3000}) is None
        assert f"done {cell.script[:-3]} {cell.run_dir(out.resolve())}" in logs
    assert "8/8 done" in capsys.readouterr().out

    # damage some results: truncated JSON, too few evaluations, missing final_score, deleted
    broken = {cells[0]: "truncated", cells[1]: "short", cells[2]: "noscore", cells[3]: "deleted"}
    for cell, how in broken.items():
        path = cell.run_dir(out) / "result.json"
        data = json.loads(path.read_text())
        if how == "truncated":
            path.write_text(path.read_text()[:50])
        elif how == "short":
            data["evaluations"] = data["evaluations"][:1]
            path.write_text(json.dumps(data))
        elif how == "noscore":
            del data["final_score"]
            path.write_text(json.dumps(data))
        else:
            path.unlink()
    (tmp_path / "calls.txt").unlink()
    assert run_grid.main(small_grid_args(repo, out)) == 0
    assert sorted(calls(tmp_path)) == sorted(str(c.run_dir(out.resolve())) for c in broken)  # only those reran
    for cell in cells:
        assert run_grid.check_result(cell.run_dir(out) / "result.json", cell, {}) is None

    # a different number of steps makes every old result stale
    (tmp_path / "calls.txt").unlink()
    capsys.readouterr()
    assert run_grid.main(small_grid_args(repo, out, "--dry-run", "--total-steps", "4000")) == 0
    printed = capsys.readouterr()
    assert len(printed.out.strip().splitlines()) == 2 and "(0 finished, 8 to run)" in printed.err
    # nothing left to do with the original settings
    assert run_grid.main(small_grid_args(repo, out)) == 0
    assert calls(tmp_path) == []


def test_failures_reported_with_logs_and_nonzero_exit(repo, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("FAKE_FAIL", "/dqn/seed2")
    monkeypatch.setenv("FAKE_NO_RESULT", "eps0.05/brpo/seed1")
    assert run_grid.main(small_grid_args(repo, out)) == 1
    text = capsys.readouterr().out
    assert "3 failed run(s):" in text
    dqn_log, = (out / "logs").glob("CartPole-v1__dqn__*.log")
    brpo_log, = (out / "logs").glob("CartPole-v1__brpo__*.log")
    for name, reason, log in [("CartPole-v1/eps0.05/dqn/seed2", "exit code 3, no result.json", dqn_log),
                              ("CartPole-v1/eps1/dqn/seed2", "exit code 3, no result.json", dqn_log),
                              ("CartPole-v1/eps0.05/brpo/seed1", "no result.json", brpo_log)]:
        assert f"  {name}: {reason}; log: {log.resolve()}" in text
        assert not (out / name / "result.json").exists()
    assert "fake failure: boom" in dqn_log.read_text()
    assert (out / "CartPole-v1/eps1/dqn/seed1/result.json").exists()  # a failed member does not fail the others
    # resume reruns exactly the failed ones
    monkeypatch.delenv("FAKE_FAIL")
    monkeypatch.delenv("FAKE_NO_RESULT")
    (tmp_path / "calls.txt").unlink()
    assert run_grid.main(small_grid_args(repo, out)) == 0
    assert len(calls(tmp_path)) == 3


def test_ctrl_c_terminates_children(repo, tmp_path):
    out, pids = tmp_path / "out", tmp_path / "pids"
    pids.mkdir()
    (repo / "datasets").mkdir()
    env = dict(os.environ, FAKE_SLEEP="60", FAKE_PIDS=str(pids))
    # a shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT ignored: give the
    # runner the default disposition a user's terminal gives it, whatever started pytest
    proc = subprocess.Popen([sys.executable, str(BENCH / "run_grid.py"), *small_grid_args(repo, out, "--no-collect")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 15
    while len(list(pids.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.05)
    children = [int(p.name) for p in pids.iterdir()]
    assert len(children) == 2
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)  # generous: clean-up takes <= ~10 s, but a loaded CI machine is slow
    assert proc.returncode == 130, output
    assert "interrupted" in output
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not list(out.rglob("result.json"))


def alive(pid: int) -> bool:
    """A process that has not ended (a zombie waiting for its reaper has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_second_runner_is_refused_and_a_killed_runner_takes_its_children(repo, tmp_path, capsys):
    out, pids = tmp_path / "out", tmp_path / "pids"
    pids.mkdir()
    (repo / "datasets").mkdir()
    env = dict(os.environ, FAKE_SLEEP="60", FAKE_PIDS=str(pids))
    first = subprocess.Popen([sys.executable, str(BENCH / "run_grid.py"), *small_grid_args(repo, out, "--no-collect")],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 15
    while len(list(pids.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.05)
    children = [int(p.name) for p in pids.iterdir()]
    assert len(children) == 2
    # a second runner on the same --out runs nothing
    assert run_grid.main(small_grid_args(repo, out, "--no-collect")) == 2
    assert "another run_grid.py (pid " in capsys.readouterr().err
    assert calls(tmp_path) == []  # the two processes are still asleep: no run was started
    first.send_signal(signal.SIGKILL)  # no clean-up of its own: the children must still end
    first.wait()
    deadline = time.time() + 15
    while any(alive(pid) for pid in children) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in children)
    # the lock died with the runner; the resumed grid runs every cell once
    (tmp_path / "calls.txt").unlink(missing_ok=True)
    assert run_grid.main(small_grid_args(repo, out, "--no-collect")) == 0
    cells = expand_grid(["CartPole-v1"], [0.05, 1.0], ["brpo", "dqn"], [1, 2])
    assert sorted(calls(tmp_path)) == sorted(str(c.run_dir(out.resolve())) for c in cells)


# ----------------------------------------------------------------------------------------------
# Slurm
# ----------------------------------------------------------------------------------------------
def test_slurm_every_cell_maps_to_exactly_one_index(repo, tmp_path, capsys):
    out = tmp_path / "out"
    args = small_grid_args(repo, out, "--slurm", "--sweep", "brpo:mu=0.1,0.9", "--sweep", "dqn:tau=0.5,1.0",
                           "--slurm-max-parallel", "4", "--slurm-array-max", "2", "--max-members", "4")
    assert run_grid.main(args) == 0
    sdir = out / "slurm"
    lines = (sdir / "commands.txt").read_text().splitlines()
    cells = expand_grid(["CartPole-v1"], [0.05, 1.0], ["brpo", "dqn"], [1, 2], {"brpo": {"mu": [0.1, 0.9]},
                                                                                  "dqn": {"tau": [0.5, 1.0]}})
    # brpo: mu is a member flag (8 members, 2 processes of 4); dqn: tau is not in the fake repo's common.py (a process
    # per value: 4 members, both datasets)
    assert len(cells) == 16 and len(lines) == 4
    flags = [w for line in lines for f, w in zip(line.split(), line.split()[1:]) if f in ("--sweep", "--tau")]
    assert flags == ["mu=0.1,0.9", "mu=0.1,0.9", "0.5", "1"]
    scripts = sorted(sdir.glob("grid_*.sbatch"))
    assert [p.name for p in scripts] == ["grid_000.sbatch", "grid_001.sbatch"]  # 2 + 2

    # resolve (script, array index) -> commands.txt line exactly as the sbatch scripts do
    mapping = {}
    for script in scripts:
        text = script.read_text()
        assert "SLURM_ARRAY_TASK_ID" in text and subprocess.run(["bash", "-n", str(script)]).returncode == 0
        size = int(text.split("#SBATCH --array=0-")[1].split("%4")[0]) + 1
        offset = int(text.split("OFFSET=")[1].split()[0])
        for t in range(size):
            mapping[(script.name, t)] = lines[offset + t]
    assert len(mapping) == len(lines)
    table = [row.split("\t") for row in (sdir / "cells.tsv").read_text().splitlines()[1:]]
    assert sorted(Path(r[3]) for r in table) == sorted(c.run_dir(out.resolve()) for c in cells)  # each cell once
    for pack, sbatch, index, run_dir in table:
        line = mapping[(sbatch, int(index))]
        assert line == lines[int(pack)] and f"--runs-dir {out.resolve()} " in line
    submit = (sdir / "submit.sh").read_text()
    assert "collect.sbatch" in submit and submit.count("--dependency=afterok:$jid grid_") == 2
    assert "collect_data.py --env-id CartPole-v1 --epsilon 0.05 1" in (sdir / "collect.sbatch").read_text()
    assert not list(out.rglob("result.json"))

    # execute two array tasks the way Slurm would: every member of their processes gets its cell's result
    ran = set()
    for sbatch, index in (("grid_000.sbatch", "0"), ("grid_001.sbatch", "1")):
        env = dict(os.environ, SLURM_ARRAY_TASK_ID=index)
        assert subprocess.run(["bash", str(sdir / sbatch)], env=env, capture_output=True).returncode == 0
        ran |= {Path(r[3]) for r in table if (r[1], r[2]) == (sbatch, index)}
    assert len(ran) == 8 and all((d / "result.json").is_file() for d in ran)
    assert {p.parent for p in out.rglob("result.json")} == ran
    # regenerating skips the finished cells; the rest still map one-to-one
    assert run_grid.main(args) == 0
    assert len((sdir / "commands.txt").read_text().splitlines()) == 2
    assert len(list(sdir.glob("grid_*.sbatch"))) == 1


# ----------------------------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------------------------
def write_result(root, env, eps, algo, seed, score, config=None, hparams=None, behavior=50.0, n_evals=12,
                 freq=1000, extra=None):
    config = config or algo
    run_dir = Path(root) / env / f"eps{eps:g}" / config / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    evals = [{"step": (k + 1) * freq, "return_mean": score + k - (n_evals - 1), "return_std": 1.0}
             for k in range(n_evals)]
    args = {"env_id": env, "epsilon": eps, "seed": seed, "total_steps": n_evals * freq, "eval_frequency": freq,
            "eval_episodes": 40, "run_name": f"{env}/{config}/seed{seed}", **(hparams or {})}
    data = {"algorithm": ALGORITHMS[algo][1], "env_id": env, "epsilon": eps, "seed": seed, "args": args,
            "evaluations": evals, "final_score": score, "behavior_return": behavior, "wall_time": 1.0,
            "train_time": 1.0, "eval_time": 0.1, "updates_per_second": 1000.0, "dataset_path": "d.npz",
            "format_version": 1, "extra": extra or {}}
    (run_dir / "result.json").write_text(json.dumps(data))
    return run_dir


def table_row(text, label):
    row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def summary_rows(text):
    """The report's summary table (up to the next section) as {algorithm label: cells}."""
    section = text.split("## Summary")[1].split("\n## ")[0]
    return {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ") and "Algorithm" not in line}


def test_aggregate_warns_when_a_rows_runs_loaded_different_dataset_files(tmp_path):
    """result.json's dataset_sha256: runs of one row trained on different files (a dataset collected again, e.g. on a
    machine that rounds differently) are named in the report; result files without it (older runs) are not."""
    res = tmp_path / "res"
    for algo, sha in (("dqn", "a" * 64), ("brpo", "a" * 64), ("bc", None)):
        run = write_result(res, "Acrobot-v1", 0.15, algo, 1, 1.0) / "result.json"
        data = json.loads(run.read_text())
        run.write_text(json.dumps({**data, "dataset_sha256": sha} if sha else data))
    assert aggregate.main([str(res), "--no-plots"]) == 0
    assert "different dataset files" not in (res / "report" / "table1.md").read_text()
    run = res / "Acrobot-v1" / "eps0.15" / "bc" / "seed1" / "result.json"
    run.write_text(json.dumps({**json.loads(run.read_text()), "dataset_sha256": "b" * 64}))
    assert aggregate.main([str(res), "--no-plots"]) == 0
    assert "the runs of Acrobot-v1 eps=0.15 were trained on 2 different dataset files" in (
        res / "report" / "table1.md").read_text()


def test_aggregate_table_stats_top2_missing(tmp_path, capsys):
    res = tmp_path / "res"
    scores = {"dqn": [10, 20, 30], "brpo_c": [40, 50, 60], "brpo": [100, 110, 120], "bcq": [0, 0, 0],
              "klq": [70, 80], "spibb": [5], "bc": [-5]}  # klq/spibb/bc partial
    for algo, vals in scores.items():
        for seed, v in enumerate(vals, start=1):
            write_result(res, "Acrobot-v1", 0.15, algo, seed, float(v), behavior=-114.0)
    # LunarLander-v3 results are compared with the paper's LunarLander-v2 row
    for seed in (1, 2, 3):
        write_result(res, "LunarLander-v3", 0.5, "brpo", seed, 100.0 + seed, behavior=-36.0,
                     extra={"mean_lambda": 0.25 * seed, "note": "text is not a diagnostic"})
    (res / "junk" / "seed1").mkdir(parents=True)
    (res / "junk" / "seed1" / "result.json").write_text("{not json")
    assert aggregate.main([str(res)]) == 0
    text = (res / "report" / "table1.md").read_text()
    assert "| Acrobot-v1-0.15 |" in capsys.readouterr().out  # the table is also printed
    cols = table_row(text, "Acrobot-v1-0.15")
    labels = [ALGORITHMS[a][1] for a in PAPER_ALGORITHMS]  # no CQL column: no CQL results
    assert "| Task-ε | " + " | ".join(labels) + " | Behavior |" in text
    cell = dict(zip(labels + ["Behavior"], cols))
    assert cell["DQN"] == "20.0 ± 10.0 (paper -83.1)"  # sample std (ddof=1)
    assert cell["BRPO"] == "**110.0 ± 10.0** (paper -86.1)"
    assert cell["KL-Q"] == f"**75.0 ± {math.sqrt(50):.1f}** n=2/3 (paper -92.1)"
    assert cell["SPIBB"] == "5.0 n=1/3 (paper -91.1)"
    assert cell["BC"] == "-5.0 n=1/3 (paper -113.1)"
    assert cell["BCQ"] == "0.0 ± 0.0 (paper -97.1)"
    assert cell["Behavior"] == "-114.0 (paper -114.3)"
    assert sum("**" in c for c in cols) == 2
    ll = dict(zip(labels + ["Behavior"], table_row(text, "LunarLander-v3-0.50")))
    # a row where some columns have no result is not ranked: BRPO alone is not "top-2"
    assert ll["BRPO"] == "102.0 ± 1.0 (paper 101.0)" and ll["Behavior"] == "-36.0 (paper -36.0)"
    assert "n=0/3" in ll["DQN"] and "**" not in table_row(text, "LunarLander-v3-0.50")
    assert "sample** standard deviation (ddof=1)" in text
    assert "total_steps = 12000" in text and "eval_episodes = 40" in text and "seeds = 1, 2, 3" in text
    assert "1 invalid/unfinished skipped" in text and "junk" in text
    assert "CartPole-v1-0.05" in text  # paper rows without results are listed
    summary = summary_rows(text)
    # rows, >= behaviour (ours, paper), ranked rows, top-2 (ours, paper on the same rows)
    assert summary["BRPO"][1:7] == ["2", "2", "2", "1", "1", "1"]
    assert summary["BC"][1:7] == ["1", "1", "1", "1", "0", "0"]
    assert summary["DQN"][1:7] == ["1", "1", "1", "1", "0", "1"]
    for env in ("Acrobot-v1", "LunarLander-v3"):
        png = res / "report" / f"curves_{env}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((res / "report").glob(".*tmp*"))
    rows = list(csv.DictReader(open(res / "report" / "configs.csv")))
    assert {r["algorithm"] for r in rows} == {"DQN", "BRPO-C", "BRPO", "BCQ", "KL-Q", "SPIBB", "BC"}
    runs = list(csv.DictReader(open(res / "report" / "runs.csv")))
    assert len(runs) == 3 + 3 + 3 + 3 + 2 + 1 + 1 + 3  # one row per valid result file
    ll = [r for r in runs if r["env_id"] == "LunarLander-v3"]
    assert [(r["seed"], float(r["score_minus_behavior"]), r["mean_lambda"]) for r in ll] == \
        [("1", 137.0, "0.25"), ("2", 138.0, "0.5"), ("3", 139.0, "0.75")]
    # write_result: return_std 1.0 over 40 episodes
    assert all(float(r["eval_se"]) == pytest.approx(1.0 / math.sqrt(40), abs=1e-4) for r in runs)
    assert "note" not in runs[0] and all(r["mean_lambda"] == "" for r in runs if r["env_id"] == "Acrobot-v1")


def test_aggregate_selects_best_config_and_says_so(tmp_path):
    res = tmp_path / "res"
    for lam, base in ((0.25, 10.0), (0.5, 30.0), (0.66, 30.0), (0.75, 20.0)):  # 0.5 and 0.66 tie
        for seed in (1, 2):
            write_result(res, "CartPole-v1", 0.25, "brpo_c", seed, base + seed, config=f"brpo_c__lam={lam}",
                         hparams={"lam": lam})
    # a config with more score but fewer seeds is not preferred over complete ones
    write_result(res, "CartPole-v1", 0.25, "brpo_c", 1, 999.0, config="brpo_c__lam=0.33", hparams={"lam": 0.33})
    for seed in (1, 2):
        write_result(res, "CartPole-v1", 0.25, "dqn", seed, 5.0 + seed)
    assert aggregate.main([str(res), "--out", str(tmp_path / "rep"), "--no-plots"]) == 0
    text = (tmp_path / "rep" / "table1.md").read_text()
    assert "31.5 ± 0.7" in table_row(text, "CartPole-v1-0.25")[1]
    assert "| CartPole-v1-0.25 | BRPO-C | lam=0.5 (tie: 1 other) | 31.5 | 5:" in text  # as many flags: name order
    rows = list(csv.DictReader(open(tmp_path / "rep" / "configs.csv")))
    selected = [r for r in rows if r["selected"] == "1"]
    assert {(r["algorithm"], r["config"]) for r in selected} == {("BRPO-C", "lam=0.5"), ("DQN", "default")}
    # a single non-default configuration is named after its run directory
    write_result(res, "Acrobot-v1", 0.25, "klq", 1, 1.0, config="klq__kl_weight=0.3", hparams={"kl_weight": 0.3})
    assert aggregate.main([str(res), "--out", str(tmp_path / "rep"), "--no-plots"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "rep" / "configs.csv")))
    assert [r["config"] for r in rows if r["algorithm"] == "KL-Q"] == ["kl_weight=0.3"]
    assert not list((tmp_path / "rep").glob("*.png"))


def test_aggregate_breaks_a_tie_toward_fewer_flags_whichever_source_the_runs_come_from(tmp_path):
    """Identical runs (SPIBB equal to β at every setting) tie: the configuration naming the fewest flags in its
    directory name wins, not the first in name order, and the selection is the same when one configuration's runs
    come from a runs.csv (4 decimals) and the other's from result files (full precision, here a little higher)."""
    res, listed = tmp_path / "res", tmp_path / "listed"
    for seed in (1, 2):
        score = 120.0 + seed / 3  # not exact at 4 decimals
        write_result(res, "Acrobot-v1", 0.15, "spibb", seed, score + 1e-9, config="spibb__learning_rate=0.0003,"
                     "spibb_threshold=0.1", hparams={"learning_rate": 0.0003, "spibb_threshold": 0.1})
        write_result(listed, "Acrobot-v1", 0.15, "spibb", seed, score, config="spibb__spibb_threshold=0.1",
                     hparams={"learning_rate": 0.001, "spibb_threshold": 0.1})
    assert aggregate.main([str(listed), "--no-plots", "--out", str(tmp_path / "a")]) == 0
    # labelled by the differing flag from result files, by the directory's flags from a runs.csv
    for argv, label in (([str(res), str(listed)], "learning_rate=0.001"),
                        ([str(res), "--merge-runs", str(tmp_path / "a" / "runs.csv")], "spibb_threshold=0.1")):
        assert aggregate.main([*argv, "--no-plots", "--out", str(tmp_path / "b")]) == 0
        rows = list(csv.DictReader(open(tmp_path / "b" / "configs.csv")))
        assert [r["config"] for r in rows if r["selected"] == "1"] == [label]
        assert "(tie: 1 other)" in (tmp_path / "b" / "table1.md").read_text()


def test_aggregate_selection_seeds_fresh_seeds_and_selected_cells(repo, tmp_path, capsys):
    res = tmp_path / "res"
    # selection seeds 1, 2: lam=0.5 wins; on fresh seeds 6, 7 it scores less, and lam=0.25's fresh runs (which the
    # selection did not pick) must not be counted
    for lam, sel, fresh in ((0.25, 10.0, 90.0), (0.5, 30.0, 20.0)):
        for seed in (1, 2):
            write_result(res, "CartPole-v1", 0.25, "brpo_c", seed, sel + seed, config=f"brpo_c__lam={lam}",
                         hparams={"lam": lam})
        for seed in (6, 7):
            write_result(res, "CartPole-v1", 0.25, "brpo_c", seed, fresh + seed, config=f"brpo_c__lam={lam}",
                         hparams={"lam": lam})
    for seed in (1, 2, 6):
        write_result(res, "CartPole-v1", 0.25, "dqn", seed, 60.0 + seed)
    write_result(res, "Acrobot-v1", 0.5, "bc", 1, 0.0, config="bc__old")  # named by hand: not in selected.json
    rep = tmp_path / "rep"
    assert aggregate.main([str(res), "--out", str(rep), "--no-plots", "--selection-seeds", "1", "2"]) == 0
    text, fresh = (rep / "table1.md").read_text(), (rep / "fresh_seeds.md").read_text()
    assert table_row(text, "CartPole-v1-0.25")[:2] == ["61.5 ± 0.7 (paper 368.5)", "31.5 ± 0.7 (paper 405.1)"]
    assert table_row(fresh, "CartPole-v1-0.25")[:2] == ["66.0 n=1/2 (paper 368.5)", "26.5 ± 0.7 (paper 405.1)"]
    assert "seeds = 1, 2 " in text and "seeds = 6, 7 " in fresh and "## Selected hyperparameters" not in fresh
    section = text.split("## Selection and fresh seeds")[1].split("\n## ")[0]
    norm = lambda x: (x - 50.0) / (500.0 - 50.0)  # noqa: E731
    assert f"| BRPO-C | 1 / 1 | 0 / 0 | — | {norm(31.5):.2f} / {norm(26.5):.2f} |" in section
    assert f"| DQN | 1 / 1 | 1 / 1 | — | {norm(61.5):.2f} / {norm(66.0):.2f} |" in section
    runs = list(csv.DictReader(open(rep / "runs.csv")))
    assert sorted((r["algorithm"], r["config"], r["seed"]) for r in runs if r["seed"] in ("6", "7")) == [
        ("BRPO-C", "lam=0.25", "6"), ("BRPO-C", "lam=0.25", "7"),  # listed for the record, not counted above
        ("BRPO-C", "lam=0.5", "6"), ("BRPO-C", "lam=0.5", "7"), ("DQN", "default", "6")]
    selected = json.loads((rep / "selected.json").read_text())
    assert selected["selection_seeds"] == [1, 2] and selected["cells"] == [
        {"env_id": "CartPole-v1", "epsilon": 0.25, "algorithm": "dqn", "hparams": {}},
        {"env_id": "CartPole-v1", "epsilon": 0.25, "algorithm": "brpo_c", "hparams": {"lam": 0.5}}]
    # run_grid.py runs exactly the selected cells on the fresh seeds, into the same configuration directories
    capsys.readouterr()
    assert run_grid.main(["--repo", str(repo), "--out", str(res), "--no-collect", "--dry-run",
                          "--cells", str(rep / "selected.json"), "--seeds", "8", "9"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("--seeds 8 9" in line and "--epsilons 0.25" in line for line in lines)
    assert any("brpo_c.py" in line and "--lam 0.5" in line and "brpo_c__lam=0.5/seed{seed}" in line for line in lines)
    assert any("dqn_offline.py" in line and "/dqn/seed{seed}" in line for line in lines)
    # --except-cells: against an older selection that picked lam=0.25 and the same DQN, only BRPO-C's cell runs
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"cells": [dict(selected["cells"][0]), {**selected["cells"][1], "hparams": {"lam": 0.25}}]}))
    capsys.readouterr()
    assert run_grid.main(["--repo", str(repo), "--out", str(res), "--no-collect", "--dry-run", "--cells",
                          str(rep / "selected.json"), "--except-cells", str(old), "--seeds", "8", "9"]) == 0
    lines = [x for x in capsys.readouterr().out.strip().splitlines() if "--seeds" in x]
    assert len(lines) == 1 and "brpo_c.py" in lines[0] and "--lam 0.5" in lines[0]
    assert run_grid.main(["--repo", str(repo), "--out", str(res), "--no-collect", "--dry-run", "--cells",
                          str(rep / "selected.json"), "--except-cells", str(rep / "selected.json")]) == 0
    assert "every selection is unchanged" in capsys.readouterr().out
    # bad input: one line
    assert aggregate.main([str(res), "--out", str(rep), "--selection-seeds", "42"]) == 2
    assert "no result for the --selection-seeds 42" in capsys.readouterr().err
    for i, bad in enumerate(('{"cells": [{"env_id": "CartPole-v1"}]}', '{"cells": [3]}', '{"cells": [{"env_id": '
                             '"CartPole-v1", "epsilon": 5, "algorithm": "dqn"}]}', '{"cells": [{"env_id": "CartPole-v1", '
                             '"epsilon": 0.5, "algorithm": "dqn", "hparams": [["lam", 0.5]]}]}')):
        (tmp_path / f"bad{i}.json").write_text(bad)
    for argv in ([["--cells", str(tmp_path / f"bad{i}.json")] for i in range(4)]
                 + [["--cells", str(rep / "selected.json"), "--sweep", "bc:lr=1"], ["--except-cells", str(old)]]):
        assert run_grid.main(["--repo", str(repo), "--out", str(res), "--dry-run", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("run_grid.py: error:"), err
    # a report without the selection leaves no earlier selection's files behind, and says what it replaced
    capsys.readouterr()
    assert aggregate.main([str(res), "--out", str(rep), "--no-plots"]) == 0
    assert not (rep / "fresh_seeds.md").exists() and not (rep / "selected.json").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"replaced the report that was in {rep} (removed its "
                                                                "fresh_seeds.md, selected.json)")
    (rep / "curves_CartPole-v1.png").write_bytes(b"png")  # an earlier report's curves, not drawn with --no-plots
    assert aggregate.main([str(res), "--out", str(rep), "--no-plots"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("(kept its curves_CartPole-v1.png, not made again)")


def test_a_runner_that_cannot_start_leaves_no_out_directory(tmp_path, capsys):
    for argv, message in ((["--repo", str(tmp_path / "none")], "not found in"),
                          (["--python", str(tmp_path / "none")], "no such executable")):
        assert run_grid.main(["--envs", "CartPole-v1", "--algos", "dqn", "--seeds", "1", "--out", str(tmp_path / "o"),
                              *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "o").exists()
    # flags of one cell may share a value (BRPO's pessimism 0 and penalty scale 0): not a value listed twice
    cells = tmp_path / "c.json"
    cells.write_text(json.dumps({"cells": [{"env_id": "CartPole-v1", "epsilon": 0.15, "algorithm": "brpo",
                                            "hparams": {"pessimism": 0, "penalty_scale": 0, "mu": 0.1, "cql_alpha": 0.1}}]}))
    assert run_grid.main(["--cells", str(cells), "--seeds", "6", "--dry-run", "--out", str(tmp_path / "o")]) == 0


def test_aggregate_algos_restricts_the_columns(tmp_path, capsys):
    res = tmp_path / "res"
    for algo, score in (("brpo", 60.0), ("brpo_c", 40.0), ("dqn", 99.0), ("bc", 10.0)):
        write_result(res, "CartPole-v1", 0.15, algo, 1, score, behavior=50.0)
    assert aggregate.main([str(res), "--out", str(tmp_path / "rep"), "--no-plots", "--algos", "brpo", "brpo_c"]) == 0
    text = (tmp_path / "rep" / "table1.md").read_text()
    assert "| Task-ε | BRPO-C | BRPO | Behavior |" in text and "DQN" not in text.split("## Summary")[1]
    assert table_row(text, "CartPole-v1-0.15") == ["40.0 (paper 305.6)", "60.0 (paper 409.9)", "50.0 (paper 149.5)"]
    assert "no top-2 marks" in text  # top-2 of two columns would mark both
    summary = summary_rows(text)
    assert set(summary) == {"BRPO-C", "BRPO"} and summary["BRPO"][2] == "1" and summary["BRPO-C"][2] == "0"
    # three columns: top-2 among them (BC's 10 is not marked, DQN's 99 and BRPO's 60 are)
    assert aggregate.main([str(res), "--out", str(tmp_path / "rep3"), "--no-plots", "--algos", "brpo", "dqn", "bc"]) == 0
    row = table_row((tmp_path / "rep3" / "table1.md").read_text(), "CartPole-v1-0.15")
    assert row[:3] == ["**99.0** (paper 299.3)", "**60.0** (paper 409.9)", "10.0 (paper 151.6)"]
    capsys.readouterr()
    assert aggregate.main([str(res), "--algos", "brpo", "ppo"]) == 2
    assert capsys.readouterr().err.strip().startswith("aggregate.py: error: unknown algorithm(s) ppo in --algos")
    assert aggregate.main([str(res), "--algos", "klq"]) == 2
    assert capsys.readouterr().err.strip() == f"aggregate.py: error: no valid result.json under '{res}' for --algos klq"
    assert not (res / "report").exists()


def test_aggregate_cql_column_has_no_paper_value_and_no_rank(tmp_path):
    """CQL, not in the paper, is the column after BC when it has results: never bold (the top-2 stays among the
    paper's seven, here BRPO and BRPO-C under CQL's 500), no paper value, no paper or rank counts in the summary."""
    res = tmp_path / "res"
    for algo, score in {"dqn": 10, "brpo_c": 40, "brpo": 60, "bcq": 0, "klq": 20, "spibb": 5, "bc": -5, "cql": 500}.items():
        write_result(res, "CartPole-v1", 0.15, algo, 1, float(score), behavior=50.0)
    assert aggregate.main([str(res), "--out", str(tmp_path / "rep"), "--no-plots"]) == 0
    text = (tmp_path / "rep" / "table1.md").read_text()
    labels = [ALGORITHMS[a][1] for a in ALGORITHMS]
    assert labels[-1] == "CQL" and "| Task-ε | " + " | ".join(labels) + " | Behavior |" in text
    row = dict(zip(labels + ["Behavior"], table_row(text, "CartPole-v1-0.15")))
    assert row["CQL"] == "500.0" and row["BRPO"] == "**60.0** (paper 409.9)" and row["BRPO-C"] == "**40.0** (paper 305.6)"
    assert sum("**" in c for c in row.values()) == 2 and "top-2 of the row among the paper's seven" in text
    summary = summary_rows(text)
    # rows, >= behaviour (ours, paper), ranked rows, top-2 (ours, paper on the same rows)
    assert summary["CQL"][1:7] == ["1", "1", "—", "—", "—", "—"]
    assert summary["BRPO"][1:7] == ["1", "1", "1", "1", "1", "1"] and summary["KL-Q"][1:7] == ["1", "0", "1", "1", "0", "1"]
    # --algos with three of the paper's and CQL: top-2 among the three
    assert aggregate.main([str(res), "--out", str(tmp_path / "rep2"), "--no-plots", "--algos", "cql", "dqn", "bc",
                           "klq"]) == 0
    text = (tmp_path / "rep2" / "table1.md").read_text()
    assert table_row(text, "CartPole-v1-0.15") == ["**10.0** (paper 299.3)", "**20.0** (paper 357.7)",
                                                   "-5.0 (paper 151.6)", "500.0", "50.0 (paper 149.5)"]
    assert "top-2 of the row among DQN, KL-Q, BC" in text and "CQL: not in the paper" in text


def test_aggregate_normalised_improvement_iqm_and_probability_of_improvement(tmp_path):
    """(score - beta) / (U - beta) per row, averaged over rows for ours and for the paper's numbers; rliable's IQM of
    the runs' normalised scores (the 25% trimmed mean of the pooled runs for these numbers) and P(BRPO > X): 1 when
    every BRPO run beats every run of X, 0.5 against identical runs."""
    pytest.importorskip("rliable")
    res = tmp_path / "res"
    rows = {("CartPole-v1", 0.15): (100.0, 500.0), ("Acrobot-v1", 0.5): (-180.0, -60.0)}  # beta, U
    own = {"brpo": [0.2, 0.3, 0.4, 0.5], "dqn": [-0.5, -0.4, 0.0, 0.1], "bc": [0.2, 0.3, 0.4, 0.5]}  # normalised
    for (env, eps), (beta, upper) in rows.items():
        for algo, values in own.items():
            for seed, x in enumerate(values, start=1):
                write_result(res, env, eps, algo, seed, beta + x * (upper - beta), behavior=beta)
    for seed in (1, 2, 3, 4):  # a row only BC has does not take the others' IQM away
        write_result(res, "LunarLander-v3", 0.5, "bc", seed, -10.0 + seed, behavior=-30.0)
    assert aggregate.main([str(res), "--out", str(tmp_path / "rep"), "--no-plots", "--algos", "brpo", "dqn", "bc"]) == 0
    text = (tmp_path / "rep" / "table1.md").read_text().split("## Normalised improvement")[1]
    assert aggregate.main([str(res), "--out", str(tmp_path / "rep"), "--no-plots", "--algos", "brpo", "dqn", "bc"]) == 0
    assert (tmp_path / "rep" / "table1.md").read_text().split("## Normalised improvement")[1] == text  # seeded
    got = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")][1:]
           for line in text.splitlines() if line.startswith("| ") and "Algorithm" not in line}
    paper = {(e, a): v for e, a, v in [("CartPole-v1", "BRPO", 409.9), ("CartPole-v1", "Behavior", 149.5),
                                        ("Acrobot-v1", "BRPO", -83.7), ("Acrobot-v1", "Behavior", -172.4)]}
    want_paper = np.mean([(paper[(e, "BRPO")] - paper[(e, "Behavior")]) / (u - paper[(e, "Behavior")])
                          for e, u in (("CartPole-v1", 500.0), ("Acrobot-v1", -60.0))])
    assert got["BRPO"][:3] == ["2", "0.35", f"{want_paper:.2f}"] and got["DQN"][:2] == ["2", "-0.20"]
    iqm = float(got["BRPO"][3].split()[0])
    assert abs(iqm - np.mean(np.sort(own["brpo"] * 2)[2:6])) < 0.005
    assert got["DQN"][4] == "1.00 [1.00, 1.00]" and got["BC"][4].startswith("0.50 [") and got["BRPO"][4] == "—"
    lo, hi = (float(x) for x in got["BC"][4].split("[")[1].rstrip("]").split(","))
    assert lo <= 0.5 <= hi and lo < hi and "stratified-bootstrap" in text
    assert got["BC"][0] == "3" and got["BC"][3] != "—" and got["BRPO"][0] == "2"  # BC's extra row in its own IQM


def test_aggregate_learning_curve_stats():
    runs = [aggregate.Run(Path(f"/x/seed{s}/result.json"), "CartPole-v1", 0.5, "dqn", s, 0.0, None,
                          [1000, 2000, 3000], [float(s), 2.0 * s, 3.0 * s], {}) for s in (1, 2, 3)]
    steps, means, ses = aggregate.curve(aggregate.Config("g", runs), smooth=1)
    assert steps == [1000, 2000, 3000] and means == [2.0, 4.0, 6.0]
    assert ses[0] == pytest.approx(1.0 / math.sqrt(3))


def test_aggregate_errors(tmp_path, capsys):
    assert aggregate.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"aggregate.py: error: results directory '{tmp_path / 'nope'}' does not exist"
    (tmp_path / "empty").mkdir()
    assert aggregate.main([str(tmp_path / "empty")]) == 2
    assert "no valid result.json" in capsys.readouterr().err
    # results that parse but hold the wrong types are skipped, not a traceback
    good = {"algorithm": "bc", "env_id": "CartPole-v1", "epsilon": 0.15, "seed": 1, "final_score": 1.0,
            "evaluations": [{"step": 1000, "return_mean": 1.0, "return_std": 0.0}], "args": {}, "extra": {}}
    for i, bad in enumerate([{"epsilon": float("nan")}, {"seed": "abc"}, {"extra": [1, 2]},
                             {"evaluations": [{"step": "abc", "return_mean": 1.0}]}, {"final_score": 1.7e308},
                             {"epsilon": 7.0}, {"seed": -3}, {"evaluations": [{"step": True, "return_mean": 1.0}]}]):
        (tmp_path / "bad" / f"r{i}").mkdir(parents=True)
        (tmp_path / "bad" / f"r{i}" / "result.json").write_text(json.dumps({**good, **bad}))
    assert aggregate.main([str(tmp_path / "bad"), "--no-plots"]) == 2
    assert "no valid result.json" in capsys.readouterr().err
    # a report file's name taken by a directory: refused before any file of the report is replaced
    (tmp_path / "good" / "r").mkdir(parents=True)
    (tmp_path / "good" / "r" / "result.json").write_text(json.dumps({**good, "extra": {"x": float("inf"), "y": 2.0}}))
    (tmp_path / "out" / "runs.csv").mkdir(parents=True)
    (tmp_path / "out" / "table1.md").write_text("old")
    assert aggregate.main([str(tmp_path / "good"), "--no-plots", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "['runs.csv'] exist there and are not files" in err[0]
    assert (tmp_path / "out" / "table1.md").read_text() == "old"
    # a diagnostic that is not a finite number is left out of runs.csv, never written as inf
    assert aggregate.main([str(tmp_path / "good"), "--no-plots", "--out", str(tmp_path / "out2")]) == 0
    header, row = (tmp_path / "out2" / "runs.csv").read_text().splitlines()
    assert header.endswith(",eval_se,y") and row.endswith(",2") and "inf" not in row


def test_aggregate_ignores_what_is_not_a_hyperparameter_or_a_run(tmp_path):
    """--overwrite / --skip-finished do not make another configuration; a finished run set aside by --overwrite
    (.replaced/) is not counted; a NaN evaluation spread gives no standard error rather than nan."""
    res = tmp_path / "res"
    write_result(res, "CartPole-v1", 0.15, "dqn", 1, 10.0, hparams={"overwrite": False}).joinpath(".replaced").mkdir()
    write_result(res, "CartPole-v1", 0.15, "dqn", 2, 30.0, hparams={"overwrite": True, "skip_finished": True})
    (res / "CartPole-v1/eps0.15/dqn/seed1/result.json").rename(res / "CartPole-v1/eps0.15/dqn/seed1/.replaced/result.json")
    write_result(res, "CartPole-v1", 0.15, "dqn", 1, 20.0, hparams={"overwrite": True})
    data = json.loads((res / "CartPole-v1/eps0.15/dqn/seed2/result.json").read_text())
    data["evaluations"][-1]["return_std"] = float("nan")
    (res / "CartPole-v1/eps0.15/dqn/seed2/result.json").write_text(json.dumps(data))
    for seed in (1, 2):  # out of run_grid's layout: runs are grouped by their flags
        (res / f"CartPole-v1/eps0.15/dqn/seed{seed}").rename(res / f"run{seed}")
    assert aggregate.main([str(res), "--no-plots", "--out", str(tmp_path / "out")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "out" / "runs.csv")))
    assert sorted((r["seed"], r["final_score"], r["eval_se"]) for r in rows) == [("1", "20.0000", "0.1581"),
                                                                               ("2", "30.0000", "")]
    assert len(list(csv.DictReader(open(tmp_path / "out" / "configs.csv")))) == 1


def test_aggregate_merge_runs_with_sweeps_of_several_flags(tmp_path):
    """A sweep's runs.csv (configurations of several flags) merged with new result files of the same cell: the listed
    configuration and its new seed are one configuration, a new one (an added flag) is another, each labelled by its
    flags, and the selection's selected.json gives run_grid.py the flags as they are named."""
    old, new, out = tmp_path / "old", tmp_path / "new", tmp_path / "out"
    for root, config, seeds, hp in ((old, "brpo__kappa_max=0.02,mu=0.9", (1, 2), {"kappa_max": 0.02, "mu": 0.9}),
                                    (old, "brpo__kappa_max=0.001,mu=0.1", (1, 2), {"kappa_max": 0.001, "mu": 0.1}),
                                    (new, "brpo__kappa_max=0.02,mu=0.9", (3,), {"kappa_max": 0.02, "mu": 0.9}),
                                    (new, "brpo__kappa_max=0.001,mu=0.1,penalty_scale=0", (1, 2, 3),
                                     {"kappa_max": 0.001, "mu": 0.1, "penalty_scale": 0.0})):
        for seed in seeds:
            score = 300.0 + seed if "penalty_scale" in config else 100.0 + seed
            write_result(root, "CartPole-v1", 1.0, "brpo", seed, score, config=config, hparams=hp, behavior=21.7)
    assert aggregate.main([str(old), "--no-plots", "--out", str(tmp_path / "b")]) == 0
    listed = {r["config"] for r in csv.DictReader(open(tmp_path / "b" / "runs.csv"))}
    assert listed == {"kappa_max=0.02, mu=0.9", "kappa_max=0.001, mu=0.1"}
    assert aggregate.main([str(new), "--no-plots", "--merge-runs", str(tmp_path / "b" / "runs.csv"),
                           "--selection-seeds", "1", "2", "3", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "runs.csv")))
    configs = {r["config"] for r in rows}
    assert configs == {"kappa_max=0.02, mu=0.9", "kappa_max=0.001, mu=0.1", "kappa_max=0.001, mu=0.1, penalty_scale=0"}
    assert sorted(r["seed"] for r in rows if r["config"] == "kappa_max=0.02, mu=0.9") == ["1", "2", "3"]
    cell, = json.loads((out / "selected.json").read_text())["cells"]
    assert cell["hparams"] == {"kappa_max": 0.001, "mu": 0.1, "penalty_scale": 0}


def test_aggregate_merge_runs_keeps_the_fresh_seeds_of_an_earlier_selection(tmp_path):
    """A configuration selected earlier and run on fresh seeds, then beaten by a configuration added later: its
    fresh-seed runs stay in runs.csv (under its label) but no longer count as the cell's fresh seeds."""
    old, new = tmp_path / "old", tmp_path / "new"
    for root, config, seeds, hp, base in ((old, "brpo__mu=0.9", (1, 2, 6), {"mu": 0.9}, 100.0),
                                          (old, "brpo__mu=0.1", (1, 2), {"mu": 0.1}, 50.0),
                                          (new, "brpo__mu=0.1,penalty_scale=0", (1, 2), {"mu": 0.1, "penalty_scale": 0.0}, 300.0)):
        for seed in seeds:
            write_result(root, "CartPole-v1", 1.0, "brpo", seed, base + seed, config=config, hparams=hp, behavior=21.7)
    sel = ["--no-plots", "--selection-seeds", "1", "2"]
    assert aggregate.main([str(old), *sel, "--out", str(tmp_path / "a")]) == 0
    assert "106.0" in (tmp_path / "a" / "fresh_seeds.md").read_text()
    assert aggregate.main([str(new), *sel, "--merge-runs", str(tmp_path / "a" / "runs.csv"), "--out", str(tmp_path / "b")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "b" / "runs.csv")))
    assert len(rows) == 7 and {(r["config"], r["seed"]) for r in rows if r["seed"] == "6"} == {("mu=0.9", "6")}
    assert not (tmp_path / "b" / "fresh_seeds.md").exists()  # the selected configuration has no fresh seed yet
    assert json.loads((tmp_path / "b" / "selected.json").read_text())["cells"][0]["hparams"]["penalty_scale"] == 0
    # merged once more, the old fresh-seed run is still there (and still not the cell's)
    assert aggregate.main([str(new), *sel, "--merge-runs", str(tmp_path / "b" / "runs.csv"), "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "runs.csv").read_text() == (tmp_path / "b" / "runs.csv").read_text()


def test_aggregate_runs_csv_names_a_configuration_alike_on_every_seed(tmp_path):
    """runs.csv lists a configuration under one name on the selection and the fresh seeds (its directory's flags,
    not the report's label, which depends on the cell's other configurations), so the three tasks' runs.csv merged
    into one report find every selected configuration's fresh seeds again."""
    res = tmp_path / "res"
    for config, hp, base in (("brpo__mu=0.1", {"mu": 0.1, "pessimism": 1.0}, 100.0),
                             ("brpo__mu=0.1,pessimism=0", {"mu": 0.1, "pessimism": 0.0}, 50.0)):
        for seed in (1, 2) + ((6, 7) if base == 100.0 else ()):
            write_result(res, "CartPole-v1", 1.0, "brpo", seed, base + seed, config=config, hparams=hp, behavior=21.7)
    sel = ["--no-plots", "--selection-seeds", "1", "2"]
    assert aggregate.main([str(res), *sel, "--out", str(tmp_path / "a")]) == 0
    assert "pessimism=1" in (tmp_path / "a" / "table1.md").read_text()  # the report's label: the flag that differs
    rows = list(csv.DictReader(open(tmp_path / "a" / "runs.csv")))
    assert sorted((r["config"], r["seed"]) for r in rows) == [("mu=0.1", "1"), ("mu=0.1", "2"), ("mu=0.1", "6"),
        ("mu=0.1", "7"), ("mu=0.1, pessimism=0", "1"), ("mu=0.1, pessimism=0", "2")]
    (tmp_path / "none").mkdir()
    assert aggregate.main([str(tmp_path / "none"), *sel, "--merge-runs", str(tmp_path / "a" / "runs.csv"),
                           "--out", str(tmp_path / "b")]) == 0
    fresh = (tmp_path / "b" / "fresh_seeds.md").read_text()
    assert table_row(fresh, "CartPole-v1-1.00")[2].startswith("106.5 ± 0.7")
    # merged with its own result files, every run is found once
    assert aggregate.main([str(res), *sel, "--merge-runs", str(tmp_path / "a" / "runs.csv"),
                           "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "runs.csv").read_text() == (tmp_path / "a" / "runs.csv").read_text()


def test_aggregate_reads_several_results_directories_as_one(tmp_path, capsys):
    """A sweep and the fresh seeds of its selection, written to two run_grid.py directories, give the same report
    as one directory holding both; a run in two directories, or directories that overlap, is a one-line error."""
    one, sweep, fresh = tmp_path / "one", tmp_path / "sweep", tmp_path / "fresh"
    for config, hp, base in (("brpo__mu=0.1", {"mu": 0.1}, 100.0), ("brpo__mu=0.9", {"mu": 0.9}, 50.0)):
        for seed in (1, 2, 6, 7) if base == 100.0 else (1, 2):
            for root in (one, fresh if seed > 5 else sweep):
                write_result(root, "CartPole-v1", 1.0, "brpo", seed, base + seed, config=config, hparams=hp,
                             behavior=21.7)
    sel = ["--no-plots", "--selection-seeds", "1", "2"]
    assert aggregate.main([str(one), *sel, "--out", str(tmp_path / "a")]) == 0
    assert aggregate.main([str(sweep), str(fresh), *sel, "--out", str(tmp_path / "b")]) == 0
    for name in ("runs.csv", "configs.csv", "selected.json"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert table_row((tmp_path / "b" / "fresh_seeds.md").read_text(), "CartPole-v1-1.00")[2].startswith("106.5")
    write_result(fresh, "CartPole-v1", 1.0, "brpo", 2, 0.0, config="brpo__mu=0.9", hparams={"mu": 0.9})
    capsys.readouterr()
    assert aggregate.main([str(sweep), str(fresh), *sel, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aggregate.py: error: the same run is in two results directories") and "\n" not in err
    # results outside run_grid.py's layout (grouped by their flags): the same flags and seed in two cells are two
    # runs, in one directory or in two
    other = tmp_path / "other"
    for env in ("CartPole-v1", "Acrobot-v1"):
        data = json.loads((sweep / "CartPole-v1" / "eps1" / "brpo__mu=0.1" / "seed1" / "result.json").read_text())
        (other / env / "r").mkdir(parents=True)
        (other / env / "r" / "result.json").write_text(json.dumps({**data, "env_id": env}))
    assert aggregate.main([str(other), "--no-plots", "--out", str(tmp_path / "e")]) == 0
    assert aggregate.main([str(other / "CartPole-v1"), str(other / "Acrobot-v1"), "--no-plots",
                           "--out", str(tmp_path / "f")]) == 0
    source = f"from `{other / 'CartPole-v1'} + {other / 'Acrobot-v1'}`: 2 result files"
    assert source in (tmp_path / "f" / "table1.md").read_text()
    assert (tmp_path / "e" / "runs.csv").read_text() == (tmp_path / "f" / "runs.csv").read_text()
    assert aggregate.main([str(sweep), str(sweep / "CartPole-v1"), "--out", str(tmp_path / "d")]) == 2
    assert "overlap; pass each one once" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_aggregate_merge_runs_keeps_a_grid_growing(tmp_path, capsys):
    """A grid whose result files are gone keeps growing from its runs.csv: merging the old table with new
    result files gives the same cells as aggregating all result files at once, a new result.json replaces
    the listed run of the same cell and seed, and a broken table is a one-line error."""
    every, old, new = tmp_path / "every", tmp_path / "old", tmp_path / "new"
    for root, seeds in ((every, (1, 2, 3)), (old, (1, 2)), (new, (3,))):
        for seed in seeds:
            for algo, base in (("dqn", 10.0), ("brpo", 100.0)):
                write_result(root, "Acrobot-v1", 0.15, algo, seed, base + seed, behavior=-114.0,
                             extra={"mean_lambda": 0.25 * seed} if algo == "brpo" else None)
    assert aggregate.main([str(every), "--no-plots", "--out", str(tmp_path / "a")]) == 0
    assert aggregate.main([str(old), "--no-plots", "--out", str(tmp_path / "b")]) == 0
    merged = tmp_path / "m"
    assert aggregate.main([str(new), "--no-plots", "--merge-runs", str(tmp_path / "b" / "runs.csv"),
                           "--out", str(merged)]) == 0
    assert (merged / "runs.csv").read_text() == (tmp_path / "a" / "runs.csv").read_text()
    assert (merged / "configs.csv").read_text() == (tmp_path / "a" / "configs.csv").read_text()
    text = (merged / "table1.md").read_text()
    assert table_row(text, "Acrobot-v1-0.15")[2].startswith("102.0 ± 1.0 (paper")  # BRPO: seeds 1, 2 listed + 3 found
    assert text.split("## Summary")[1] == (tmp_path / "a" / "table1.md").read_text().split("## Summary")[1]
    assert "1 result files" not in text and "4 runs listed in the `--merge-runs` table(s)" in text
    # a new result for a listed seed replaces it
    write_result(new, "Acrobot-v1", 0.15, "brpo", 1, 500.0, behavior=-114.0)
    assert aggregate.main([str(new), "--no-plots", "--merge-runs", str(tmp_path / "b" / "runs.csv"),
                           "--out", str(merged)]) == 0
    rows = list(csv.DictReader(open(merged / "runs.csv")))
    assert [r["final_score"] for r in rows if r["algorithm"] == "BRPO"] == ["500.0000", "102.0000", "103.0000"]
    capsys.readouterr()
    bad, runs_text = tmp_path / "bad.csv", (tmp_path / "b" / "runs.csv").read_text()
    for content, message in (("a,b\n1,2\n", "is not a runs.csv"),
                             ((tmp_path / "b" / "runs.csv").read_text().replace("Acrobot-v1,0.15,DQN", "Acrobot-v1,0.15,XYZ", 1),
                              "line 2: bad row"),
                             (runs_text.replace(",0.15,", ",7,", 1), "line 2: bad row (epsilon 7 outside [0, 1])"),
                             (runs_text.split(",DQN,")[0] + ",DQN\n", "line 2: fewer fields than its header")):
        bad.write_text(content)
        assert aggregate.main([str(new), "--merge-runs", str(bad), "--out", str(merged)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
    assert aggregate.main([str(new), "--merge-runs", str(tmp_path / "none.csv"), "--out", str(merged)]) == 2
    assert "cannot read --merge-runs file" in capsys.readouterr().err


def test_paper_csv_shipped():
    rows = list(csv.DictReader(open(BENCH / "paper_table1.csv")))
    assert len(rows) == 3 * 5 * 8
    assert {r["env_id"] for r in rows} == {"CartPole-v1", "Acrobot-v1", "LunarLander-v2"}
    paper = aggregate.load_paper(BENCH / "paper_table1.csv")
    assert paper[("LunarLander-v3", 0.25, "BRPO")][:2] == (141.6, 11.0)
    assert sum(top for _, _, top in paper.values()) == 15 * 2


# ----------------------------------------------------------------------------------------------
# shell presets
# ----------------------------------------------------------------------------------------------
def _shell_env(tmp_path, **extra):
    env = dict(os.environ, OUT=str(tmp_path / "out"), **extra)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # `python` = this interpreter
    return env


@pytest.mark.parametrize("script", ["table1.sh", "quick.sh"])
def test_shell_presets_dry_run(script, repo, tmp_path):
    proc = subprocess.run(["bash", str(BENCH / script), "--dry-run", "--repo", str(repo)],
                          env=_shell_env(tmp_path), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert sum("collect_data.py" in line for line in lines) == 3
    # a process per task and algorithm: 5 epsilons x the seeds as members; table1.sh also runs CQL
    assert len(lines) == 3 + 3 * (8 if script == "table1.sh" else 7)
    assert all("--eval-frequency 1000 --eval-episodes 40" in line for line in lines[3:])
    if script == "quick.sh":
        assert all("--total-steps 20000" in line for line in lines[3:])
    else:
        assert not any("--total-steps" in line for line in lines[3:])  # scripts' (paper) defaults


def test_shell_preset_runs_and_aggregates(repo, tmp_path):
    """table1.sh end to end on the fake scripts, restricted to 4 runs by overriding the grid flags."""
    proc = subprocess.run(["bash", str(BENCH / "table1.sh"), "--repo", str(repo), "--envs", "CartPole-v1",
                           "--epsilons", "0.5", "--algos", "dqn", "bc", "--total-steps", "2000"],
                          env=_shell_env(tmp_path, SEEDS="1 2 3", FAKE_FAIL="bc/seed3", BEHAVIOR_FROM=""),
                          capture_output=True, text=True)  # the fake datasets hold no behaviour return
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one failed run -> non-zero, report still written
    assert "CartPole-v1/eps0.5/bc/seed3: exit code 3, no result.json; log: " in proc.stdout
    report = tmp_path / "out" / "report" / "table1.md"
    assert report.is_file() and (tmp_path / "out" / "report" / "curves_CartPole-v1.png").is_file()
    text = report.read_text()
    assert "| CartPole-v1-0.50 |" in text and "python benchmark/run_grid.py" in text  # invocation recorded
    assert "n=2/3" in text and "seeds = 1, 2, 3" in text


def test_paper_protocol_selects_then_runs_the_selection_on_fresh_seeds(repo, tmp_path):
    """paper_protocol.sh end to end on the fake scripts: a two-configuration sweep on the selection seeds, then only
    the selected configuration on the fresh seed, and the report with both."""
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"algorithms": {"brpo_c": {"lam": [0.25, 0.5]}}}))
    env = _shell_env(tmp_path, ENVS="CartPole-v1", EPSILONS="0.5", ALGOS="brpo_c dqn", SWEEP=str(sweep),
                     SELECTION_SEEDS="1 2", FRESH_SEEDS="3")
    proc = subprocess.run(["bash", str(BENCH / "paper_protocol.sh"), "--repo", str(repo), "--total-steps", "2000"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out" / "CartPole-v1" / "eps0.5"
    report = tmp_path / "out" / "report"
    selected = json.loads((report / "selected.json").read_text())["cells"]
    lam = next(c["hparams"]["lam"] for c in selected if c["algorithm"] == "brpo_c")
    for value in (0.25, 0.5):
        seeds = sorted(p.parent.name for p in (out / f"brpo_c__lam={value}").glob("seed*/result.json"))
        assert seeds == ["seed1", "seed2"] + (["seed3"] if value == lam else [])
    assert sorted(p.parent.name for p in (out / "dqn").glob("seed*/result.json")) == ["seed1", "seed2", "seed3"]
    text = (report / "table1.md").read_text()
    assert "## Selection and fresh seeds" in text and "## Selected hyperparameters" in text
    assert "| BRPO-C | 1 / 1 |" in text and "seeds = 3 " in (report / "fresh_seeds.md").read_text()
    assert proc.stdout.strip().endswith(f"report: {tmp_path / 'out'}/report/table1.md")


def test_failed_dataset_collection_blocks_its_runs(repo, tmp_path, capsys):
    (repo / "collect_data.py").write_text("import sys; print('no behaviour policy'); sys.exit(1)\n")
    out = tmp_path / "out"
    assert run_grid.main(small_grid_args(repo, out)) == 1
    text = capsys.readouterr().out
    assert f"collect CartPole-v1: exit code 1; log: {out / 'logs' / 'collect_CartPole-v1.log'}" in text
    assert "9 failed run(s)" in text and "dataset missing (collect_data.py failed)" in text
    assert calls(tmp_path) == []  # no algorithm script was started
    assert "no behaviour policy" in (out / "logs" / "collect_CartPole-v1.log").read_text()


def test_readme_headline_table_is_what_the_committed_results_give(tmp_path):
    """The README's Table 1 is benchmark/headline_table.py's output on the two committed result directories, exactly
    (regenerate it after either report changes), and the merged protocol report selects what the three per-task ones
    and CQL's do (regenerate it after any of them changes); a malformed table is one line and a non-zero exit."""
    import headline_table
    want = headline_table.table(BENCH / "table1_result", BENCH / "paper_protocol_result")
    assert len(want.splitlines()) == 2 + 15 and "—" not in want
    readme = (BENCH.parent / "README.md").read_text()
    start = readme.index("| task, ε |")
    assert readme[start:readme.index("\n\n", start)] == want
    per_task = [c for t in ("cartpole", "acrobot", "lunarlander", "cql")  # CQL's cells: its own report's only
                for c in json.loads((BENCH / f"paper_protocol_{t}" / "selected.json").read_text())["cells"]
                if (t == "cql") == (c["algorithm"] == "cql")]
    merged = json.loads((BENCH / "paper_protocol_result" / "selected.json").read_text())["cells"]
    key = lambda c: (c["env_id"], c["epsilon"], c["algorithm"], json.dumps(c["hparams"], sort_keys=True))  # noqa: E731
    assert sorted(map(key, merged)) == sorted(map(key, per_task)) and len(merged) == 15 * 8
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "configs.csv").write_text("env_id,epsilon,algorithm,mean\nCartPole-v1,0.05,BRPO,1.0\n")
    (bad / "runs.csv").write_text((BENCH / "table1_result" / "runs.csv").read_text())
    proc = subprocess.run([sys.executable, str(BENCH / "headline_table.py"), str(BENCH / "table1_result"), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "needs the columns" in proc.stderr and "selected" in proc.stderr
    assert proc.stderr.startswith("headline_table.py: error:")
    header = "env_id,epsilon,algorithm,config,selected,mean,seeds\n"
    (bad / "configs.csv").write_text(header + "CartPole-v1,0.05,BRPO,default,1,nan,1\n")
    proc = subprocess.run([sys.executable, str(BENCH / "headline_table.py"), str(BENCH / "table1_result"), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == "" and "bad mean 'nan'" in proc.stderr
    (bad / "configs.csv").write_text(header + "CartPole-v1,0.05,BRPO,default,1,1.0,1\n" * 2)
    proc = subprocess.run([sys.executable, str(BENCH / "headline_table.py"), str(BENCH / "table1_result"), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == "" and "two selected configurations for BRPO" in proc.stderr
    (bad / "configs.csv").write_text(header + "CartPole-v1,0.05,BRPO,default,1,248.0,1 2 3 4 5\n")  # runs: 248.1805
    proc = subprocess.run([sys.executable, str(BENCH / "headline_table.py"), str(BENCH / "table1_result"), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == "" and "do not give configs.csv's mean 248 " in proc.stderr


def test_merged_learning_rate_report_selects_what_the_per_task_reports_do():
    """benchmark/paper_protocol_lr_result merges the three learning-rate reports: the same 120 selections (regenerate it
    after any of them changes)."""
    key = lambda c: (c["env_id"], c["epsilon"], c["algorithm"], json.dumps(c["hparams"], sort_keys=True))  # noqa: E731
    per_task = [key(c) for t in ("cartpole", "acrobot", "lunarlander")
                for c in json.loads((BENCH / f"paper_protocol_{t}_lr" / "selected.json").read_text())["cells"]]
    merged = [key(c) for c in json.loads((BENCH / "paper_protocol_lr_result" / "selected.json").read_text())["cells"]]
    assert sorted(merged) == sorted(per_task) and len(merged) == 15 * 8


def test_headline_table_prints_the_reports_own_means():
    """Each headline cell is the mean table1.md prints for that cell (mean of the runs, rounded once: configs.csv's
    4-decimal mean rounded again once printed 64.2 for table1.md's 64.1)."""
    import headline_table
    for directory, column in (("table1_result", 0), ("paper_protocol_result", 1)):
        printed = {}
        for line in (BENCH / directory / "table1.md").read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) > 8 and "-v" in cells[0] and cells[0].rsplit("-", 1)[-1][:1].isdigit():
                env, eps = cells[0].rsplit("-", 1)
                for label, cell in zip(headline_table.LABELS.values(), cells[1:]):
                    printed[(env, round(float(eps), 6), label)] = cell.split()[0].strip("*")
        for line in headline_table.table(BENCH / "table1_result", BENCH / "paper_protocol_result").splitlines()[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            task, eps = cells[0].rsplit(" ", 1)
            env = {v: k for k, v in headline_table.SHORT.items()}[task]
            for label, cell in zip(headline_table.LABELS.values(), cells[1:]):
                ours = cell.split(" (")[0].split(" / ")[column].replace("−", "-")
                assert ours == printed[(env, round(float(eps), 6), label)], (directory, env, eps, label)


def test_aggregate_behavior_from_datasets(tmp_path, capsys):
    """--behavior-from: every run, found on disk or listed in a runs.csv, is scored against its dataset's
    behavior_return (the at-or-above-beta count follows it); a missing dataset is one error line and no report."""
    res, data = tmp_path / "res", tmp_path / "data"
    data.mkdir()
    for seed in (1, 2):
        write_result(res, "CartPole-v1", 0.15, "dqn", seed, 100.0, behavior=50.0)
        write_result(res, "CartPole-v1", 1.0, "dqn", seed, 100.0, behavior=50.0)
    assert aggregate.main([str(res), "--no-plots", "--out", str(tmp_path / "a")]) == 0
    paired = np.array(json.dumps({"behavior_noise_steps": [100_000]}))
    np.savez(data / "CartPole-v1_eps0.15.npz", behavior_return=np.float64(120.123456), settings_json=paired)
    np.savez(data / "CartPole-v1_eps1.npz", behavior_return=np.float64(20.0), settings_json=paired)
    for source in ([str(res)], [str(tmp_path / "none"), "--merge-runs", str(tmp_path / "a" / "runs.csv")]):
        (tmp_path / "none").mkdir(exist_ok=True)
        out = tmp_path / f"b{len(source)}"
        assert aggregate.main([*source, "--no-plots", "--behavior-from", str(data), "--out", str(out)]) == 0
        rows = list(csv.DictReader(open(out / "runs.csv")))
        assert sorted((r["epsilon"], r["behavior_return"]) for r in rows) == [("0.15", "120.1235")] * 2 + [("1", "20.0000")] * 2
        assert summary_rows((out / "table1.md").read_text())["DQN"][1:3] == ["2", "1"]
    capsys.readouterr()
    # measured the earlier way (no noise steps recorded), a truncated file, no file: one line each, no report
    unpaired = lambda p: np.savez(p, behavior_return=np.float64(20.0), settings_json=np.array("{}"))  # noqa: E731
    truncated = lambda p: p.write_bytes(p.read_bytes()[:40])  # noqa: E731
    for bad, why in ((unpaired, "before the paired measurement"), (truncated, "cannot read"),
                     (lambda p: p.unlink(), "cannot read")):
        bad(data / "CartPole-v1_eps1.npz")
        assert aggregate.main([str(res), "--no-plots", "--behavior-from", str(data), "--out", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "CartPole-v1_eps1.npz" in err[0] and why in err[0] and not (tmp_path / "c").exists()


def test_aggregate_counts_a_tie_with_beta_as_at_or_above(tmp_path):
    """A cell whose every run scores beta's return exactly (it deploys beta) is at beta, although the float means of
    5 scores and of the row's 15 behaviour returns differ in their last bit (29.0115 * 15 / 15 > 29.0115)."""
    assert sum([29.0115] * 5) / 5 < sum([29.0115] * 15) / 15
    for algo, score in (("spibb", 29.0115), ("dqn", 10.0), ("bc", 29.0114)):
        for seed in range(1, 6):
            write_result(tmp_path / "res", "CartPole-v1", 0.15, algo, seed, score, behavior=29.0115)
    assert aggregate.main([str(tmp_path / "res"), "--no-plots", "--out", str(tmp_path / "out")]) == 0
    rows = summary_rows((tmp_path / "out" / "table1.md").read_text())
    assert [rows[label][2] for label in ("SPIBB", "DQN", "BC")] == ["1", "0", "0"]
