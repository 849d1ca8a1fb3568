#!/usr/bin/env python
"""Run (or print, or submit to Slurm) a grid of offline-RL benchmark runs.

The grid is  tasks x epsilons x algorithms x hyperparameter configurations x seeds.
Every grid cell is one run with a deterministic run directory, e.g. Acrobot-v1/eps0.15/brpo/seed3.
Cells that differ only in dataset (epsilon), seed or the hyperparameters a script can train side by
side (its MEMBER_FLAGS) are packed as the members of one process, at most --max-members each:

    python brpo.py --env-id Acrobot-v1 --epsilons 0.05 0.15 --seeds 1 2 3 --threads 1 --skip-finished \
        --runs-dir benchmark/results/table1 --run-name '{env_id}/eps{epsilon}/brpo/seed{seed}'

An interrupted grid can simply be started again: runs whose ``result.json`` is valid are skipped,
everything else is (re)run.

Examples
    python benchmark/run_grid.py --dry-run                          # paper grid, print commands
    python benchmark/run_grid.py --workers 2 --total-steps 20000 --seeds 1 2 3
    python benchmark/run_grid.py --algos brpo_c --sweep brpo_c:lam=0.25,0.5,0.75
    python benchmark/run_grid.py --grid benchmark/paper_sweep.json --slurm
    python benchmark/run_grid.py --cells report/selected.json --seeds 6 7 8 9 10   # aggregate.py's selection

See docs/benchmark.md for the full description.
"""
from __future__ import annotations

import argparse
import ast
import ctypes
import dataclasses
import datetime
import errno
import fcntl
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmark" / "results" / "table1"
RESULT_FILE = "result.json"

# algorithm key -> (script, column name in the paper's Table 1). Order = Table 1 column order, then the algorithms
# this repository adds (not in the paper: no paper values, not ranked against the paper's seven by aggregate.py).
ALGORITHMS: dict[str, tuple[str, str]] = {
    "dqn": ("dqn_offline.py", "DQN"),
    "brpo_c": ("brpo_c.py", "BRPO-C"),
    "brpo": ("brpo.py", "BRPO"),
    "bcq": ("bcq_discrete.py", "BCQ"),
    "klq": ("klq.py", "KL-Q"),
    "spibb": ("spibb.py", "SPIBB"),
    "bc": ("bc.py", "BC"),
    "cql": ("cql_discrete.py", "CQL"),
}
# The paper's Table 1 columns: the default grid (--algos) and the columns aggregate.py ranks and compares.
PAPER_ALGORITHMS = ("dqn", "brpo_c", "brpo", "bcq", "klq", "spibb", "bc")
ENVS = ("CartPole-v1", "Acrobot-v1", "LunarLander-v3")
# The paper used gym's LunarLander-v2; gymnasium 1.x only ships LunarLander-v3.
ENV_RENAMES = {"LunarLander-v2": "LunarLander-v3"}
PAPER_EPSILONS = (0.05, 0.15, 0.25, 0.5, 1.0)
PAPER_SEEDS = (1, 2, 3, 4, 5)

# Common flags every script accepts (docs/formats.md), in their python (underscore) spelling.
COMMON_FLAGS = {
    "env_id", "epsilon", "seed", "total_steps", "eval_frequency", "eval_sparse_frequency", "eval_episodes", "eval_seed",
    "dataset_path", "learning_rate", "batch_size", "gamma", "target_update_frequency", "tau",
    "runs_dir", "run_name", "exp_name", "save_model", "eval_checkpoint", "threads", "track",
}
# Flags that define the cell itself, or how the runner runs it, and can therefore not be swept.
RESERVED_FLAGS = {"env_id", "epsilon", "seed", "runs_dir", "run_name", "threads", "exp_name", "dataset_path"}
RUNNER_FLAGS = {"seeds", "epsilons", "sweep", "overwrite", "skip_finished", "eval_checkpoint"}


def reserved(key: str) -> str:
    """Why a flag cannot be a hyperparameter of the grid ('' if it can)."""
    return ("defines the grid cell" if key in RESERVED_FLAGS else "is set by the runner" if key in RUNNER_FLAGS else "")


class GridError(Exception):
    """Bad user input; reported as a one-line error message."""


# --------------------------------------------------------------------------------------------
# grid description
# --------------------------------------------------------------------------------------------
def fmt_value(v) -> str:
    """Canonical, filesystem-friendly text for a flag value (0.5 -> '0.5', 1.0 -> '1', 3e-4 -> '0.0003')."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return format(v, ".15g")  # exact enough to keep distinct values distinct
    return str(v).replace("/", "_")


def parse_value(text: str):
    text = text.strip()
    if text in ("True", "False", "true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def norm_key(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def canonical_env(env_id: str) -> str:
    if env_id in ENV_RENAMES:
        raise GridError(f"{env_id} is not available in gymnasium 1.x; use {ENV_RENAMES[env_id]} "
                        f"(the paper's {env_id} rows are compared against it)")
    if env_id not in ENVS:
        raise GridError(f"unknown env '{env_id}' (choose from {', '.join(ENVS)})")
    return env_id


def canonical_algo(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    aliases = {"dqn_offline": "dqn", "bcq_discrete": "bcq", "kl_q": "klq", "brpoc": "brpo_c", "cql_discrete": "cql"}
    key = aliases.get(key, key)
    if key not in ALGORITHMS:
        raise GridError(f"unknown algorithm '{name}' (choose from {', '.join(ALGORITHMS)})")
    return key


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid cell = one run of one algorithm script."""

    env_id: str
    epsilon: float
    algo: str
    seed: int
    hparams: tuple[tuple[str, object], ...] = ()  # sorted (flag, value) pairs

    @property
    def config_name(self) -> str:
        """'<algo>' or '<algo>__key=value,key=value' (keys sorted)."""
        if not self.hparams:
            return self.algo
        return self.algo + "__" + ",".join(f"{k}={fmt_value(v)}" for k, v in self.hparams)

    @property
    def run_name(self) -> str:
        return f"{self.env_id}/eps{fmt_value(float(self.epsilon))}/{self.config_name}/seed{self.seed}"

    def run_dir(self, out: Path) -> Path:
        return Path(out) / self.run_name

    @property
    def script(self) -> str:
        return ALGORITHMS[self.algo][0]


def member_flags(script: Path) -> set[str]:
    """The flags a script can vary between the members of one process: common.py's SHARED_MEMBER_FLAGS and the
    script's MEMBER_FLAGS, read with ast (no drift from the scripts); empty if they cannot be read."""
    def constant(path: Path, name: str) -> tuple:
        try:
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                    return tuple(ast.literal_eval(node.value))
        except (OSError, SyntaxError, ValueError):
            pass
        return ()
    return set(constant(Path(script).parent / "common.py", "SHARED_MEMBER_FLAGS")) | set(constant(Path(script),
                                                                                                   "MEMBER_FLAGS"))


@dataclasses.dataclass
class Pack:
    """Cells trained as the members of one process: every combination of its epsilons, member hyperparameter
    values and seeds (those already finished are skipped by the script, --skip-finished)."""

    env_id: str
    algo: str
    fixed: tuple  # (flag, value) pairs the same for every member
    epsilons: list
    swept: dict  # member flag -> values
    seeds: list
    cells: list  # the pending cells among the members

    @property
    def size(self) -> int:
        return len(self.epsilons) * len(self.seeds) * math.prod(len(v) for v in self.swept.values())


def fewest_parts(sizes: list[int], max_members: int) -> tuple[int, ...]:
    """Into how many near-equal parts to split each dimension (epsilons, each value list, seeds) so that the product
    of the largest parts is at most max_members with the fewest packs (the most members per process: the per-member
    rate grows with M); among those, the smallest largest pack, then the outer dimensions split first. Searched over
    each dimension's distinct largest parts (about 2 sqrt(n) of them, with the fewest parts giving each)."""
    options = [sorted({-(-n // k) for k in range(1, n + 1)}) for n in sizes]  # each dimension's largest parts

    def key(parts):
        largest = math.prod(-(-n // k) for n, k in zip(sizes, parts))
        return largest > max(1, max_members), math.prod(parts), largest, [-k for k in parts]
    return min((tuple(-(-n // c) for n, c in zip(sizes, largest)) for largest in itertools.product(*options)), key=key)


def split_evenly(values: list, parts: int) -> list[list]:
    """values in `parts` contiguous chunks whose lengths differ by at most one."""
    q, r = divmod(len(values), parts)
    bounds = [i * q + min(i, r) for i in range(parts + 1)]
    return [values[a:b] for a, b in zip(bounds, bounds[1:])]


def pack_cells(cells: list[Cell], repo: Path, max_members: int, grid: list[Cell] | None = None) -> list[Pack]:
    """Every cell in exactly one pack: cells of one task, algorithm and non-member settings share a pack, split into
    as few packs of at most max_members members as the grid's dimensions allow (fewest_parts). A process
    trains every combination of its epsilons, values and seeds: where that would include a cell outside the grid
    (grid: all its cells, finished ones too; default: cells), the cells are split into the products their union is
    made of (products below), then, where that is not enough (e.g. the per-cell configurations of --cells), grouped
    by configuration, then by configuration and epsilon."""
    flags = {a: member_flags(Path(repo) / ALGORITHMS[a][0]) for a in dict.fromkeys(c.algo for c in cells)}
    names = {c.run_name for c in (cells if grid is None else grid)}

    def complete(members: list[Cell]) -> bool:  # every cell the process would train is in the grid
        keys = sorted({k for c in members for k, _ in c.hparams if k in flags[c.algo]})
        fixed = [(k, v) for k, v in members[0].hparams if k not in keys]
        values = [list(dict.fromkeys(dict(c.hparams)[k] for c in members)) for k in keys]
        return all(Cell(members[0].env_id, e, members[0].algo, s, tuple(sorted(fixed + list(zip(keys, combo))))
                       ).run_name in names for e in {c.epsilon for c in members} for s in {c.seed for c in members}
                   for combo in itertools.product(*values))

    def products(members: list[Cell], keys: list[str]) -> list[list[Cell]]:
        """A union of products (a grid file's blocks alike in their flags, e.g. BRPO's critic blocks) split by one
        flag's values at a time, the flag leaving the most members in complete parts first, until each is a product."""
        if complete(members) or not keys:
            return [members]
        best = None
        for k in keys:
            parts: dict = {}
            for c in members:
                parts.setdefault(dict(c.hparams)[k], []).append(c)
            done = sum(len(p) for p in parts.values() if complete(p))
            if len(parts) > 1 and (best is None or done > best[0]):
                best = (done, k, list(parts.values()))
        if best is None:
            return [members]
        return [q for p in best[2] for q in products(p, [k for k in keys if k != best[1]])]

    groups: dict = {}
    for c in cells:
        fixed = tuple((k, v) for k, v in c.hparams if k not in flags[c.algo])
        swept = tuple(k for k, _ in c.hparams if k in flags[c.algo])
        groups.setdefault((c.env_id, c.algo, fixed, swept), []).append(c)
    groups = {key + (i,): part for key, members in groups.items() for i, part in enumerate(products(members, list(key[3])))}
    for by in (lambda c: c.hparams, lambda c: (c.hparams, c.epsilon)):  # split only where needed
        split: dict = {}
        for key, members in groups.items():
            whole = complete(members)
            for c in members:
                split.setdefault(key if whole else key[:5] + (by(c),), []).append(c)
        groups = split
    packs = []
    for (env_id, algo, fixed, *_), members in groups.items():
        swept_keys = sorted({k for c in members for k, _ in c.hparams if k in flags[algo]})
        dims = [list(dict.fromkeys(c.epsilon for c in members)), *[
            list(dict.fromkeys(dict(c.hparams)[k] for c in members)) for k in swept_keys],
            list(dict.fromkeys(c.seed for c in members))]
        chunks = [split_evenly(d, k) for d, k in zip(dims, fewest_parts([len(d) for d in dims], max_members))]
        where = [{v: i for i, chunk in enumerate(cs) for v in chunk} for cs in chunks]  # a value's chunk, per dimension
        held: dict = {}  # each member under its chunks' indices, in the members' order
        for c in members:
            coords = (c.epsilon, *(dict(c.hparams)[k] for k in swept_keys), c.seed)
            held.setdefault(tuple(w[v] for w, v in zip(where, coords)), []).append(c)
        for index in itertools.product(*(range(len(cs)) for cs in chunks)):
            combo, inside = [cs[i] for cs, i in zip(chunks, index)], held.get(index)
            if inside:
                packs.append(Pack(env_id, algo, fixed, list(combo[0]), dict(zip(swept_keys, combo[1:-1])),
                                  list(combo[-1]), inside))
    return packs


def pack_command(pack: Pack, settings: dict, out: Path, python: str, threads: int) -> list[str]:
    """One process for the pack's members; the run-name template gives each member its cell's run directory."""
    cmd = [python, ALGORITHMS[pack.algo][0], "--env-id", pack.env_id,
           "--epsilons", *[fmt_value(float(e)) for e in pack.epsilons], "--seeds", *map(str, pack.seeds)]
    requested = {k: v for k, v in settings.items() if v is not None}
    requested.update(dict(pack.fixed))
    for key, value in requested.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):  # the scripts' boolean flags are --flag / --no-flag
            cmd.append(flag if value else "--no-" + flag[2:])
        else:
            cmd += [flag, format(value, ".15g") if isinstance(value, float) else str(value)]
    if pack.swept:  # one --sweep holding every swept flag (the scripts' --sweep is a list: a second would replace it)
        cmd += ["--sweep", *(f"{key.replace('_', '-')}=" + ",".join(format(v, ".15g") if isinstance(v, float) else
                                                                    str(v) for v in values)
                             for key, values in pack.swept.items())]
    names = dict(pack.fixed) | {k: f"{{{k}}}" for k in pack.swept}
    literal = lambda v: fmt_value(v).replace("{", "{{").replace("}", "}}")  # noqa: E731
    config = pack.algo + ("__" + ",".join(f"{k}={names[k] if k in pack.swept else literal(names[k])}"
                                          for k in sorted(names)) if names else "")
    cmd += ["--threads", str(threads), "--skip-finished", "--runs-dir", str(out),
            "--run-name", f"{pack.env_id}/eps{{epsilon}}/{config}/seed{{seed}}"]
    return cmd


def cell_settings(cell: Cell, settings: dict) -> dict:
    """Flags requested for this cell besides the cell identity: global settings overridden by hparams."""
    requested = {k: v for k, v in settings.items() if v is not None}
    requested.update(dict(cell.hparams))
    return requested


def parse_sweep(spec: str, algos: list[str]) -> dict[str, dict[str, list]]:
    """'brpo_c:lam=0.25,0.5' -> {'brpo_c': {'lam': [0.25, 0.5]}}; 'all:learning_rate=...' for every algo."""
    try:
        algo_part, rest = spec.split(":", 1)
        key, values = rest.split("=", 1)
    except ValueError:
        raise GridError(f"bad --sweep '{spec}' (expected ALGO:KEY=V1,V2,..., e.g. brpo_c:lam=0.25,0.5)") from None
    if any(not v.strip() for v in values.split(",")):
        raise GridError(f"bad --sweep '{spec}': an empty value; separate the values by single commas")
    vals = check_values([parse_value(v) for v in values.split(",")], f"bad --sweep '{spec}'")
    targets = algos if algo_part.strip() in ("all", "*") else [canonical_algo(algo_part)]
    return {a: {norm_key(key): vals} for a in targets}


def param_blocks(params) -> list[dict]:
    """An algorithm's grid entry: one block {flag: [values]}, the product of its lists, or a list of blocks, the
    union of their products (e.g. a second part of a sweep that fixes other flags)."""
    return [params] if isinstance(params, dict) else list(params)


def load_grid_file(path: Path, algos: list[str]) -> dict[str, list[dict[str, list]]]:
    """JSON grid file: {"algorithms": {"<algo>|*": {"<flag>": [values, ...], ...} or [{...}, {...}], ...}}."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GridError(f"grid file '{path}' not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise GridError(f"grid file '{path}' is not a readable JSON file ({e})") from None
    table = data.get("algorithms") if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise GridError(f"grid file '{path}' has no \"algorithms\" object")
    entries = []
    for name, params in table.items():
        if not (isinstance(params, dict) or isinstance(params, list) and params
                and all(isinstance(b, dict) for b in params)):
            raise GridError(f"grid file '{path}': entry for '{name}' must be an object of flag -> list of values, "
                            "or a non-empty list of such objects")
        for block in param_blocks(params):
            distinct_keys(block, f"grid file '{path}', {name}")
        blocks = [{norm_key(key): check_values(values if isinstance(values, list) else [values],
                                               f"grid file '{path}', {name}.{key}") for key, values in block.items()}
                  for block in param_blocks(params)]
        entries.append({a: blocks for a in (algos if name in ("all", "*") else [canonical_algo(name)])})
    return merge_grids(*entries)


def load_cells(path: Path, seeds: list[int]) -> list[Cell]:
    """The cells of a selected.json (aggregate.py --selection-seeds): {"cells": [{"env_id", "epsilon", "algorithm",
    "hparams": {flag: value}}, ...]}, each for every seed."""
    try:
        entries = json.loads(Path(path).read_text())["cells"]
        cells = []
        for e in entries:
            hp, eps = e.get("hparams", {}), e["epsilon"]
            if not isinstance(hp, dict) or isinstance(eps, bool) or not isinstance(eps, (int, float)) \
                    or not 0.0 <= eps <= 1.0:
                raise ValueError(f"entry {e}: needs an epsilon in [0, 1] and hparams as an object of flag: value")
            for key, value in hp.items():  # one value per flag: flags may share a value (pessimism 0, penalty_scale 0)
                check_values([value], f"cells file '{path}', {e['algorithm']}.{key}")
            distinct_keys(hp, f"cells file '{path}', {e['algorithm']}")
            for key in hp:
                why = reserved(norm_key(key))
                if why:
                    raise GridError(f"cells file '{path}': '{key}' {why} and cannot be a hyperparameter")
            cells += [Cell(canonical_env(e["env_id"]), float(e["epsilon"]), canonical_algo(e["algorithm"]), int(seed),
                           tuple(sorted((norm_key(k), v) for k, v in hp.items()))) for seed in seeds]
    except FileNotFoundError:
        raise GridError(f"cells file '{path}' not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError,
            RecursionError) as e:  # RecursionError: JSON nested deeper than the parser's stack
        raise GridError(f"cells file '{path}' is not a selected.json of aggregate.py --selection-seeds "
                        f"({type(e).__name__}: {e})") from None
    if not cells:
        raise GridError(f"cells file '{path}' lists no cells")
    return list({c.run_name: c for c in cells}.values())


def check_values(values: list, where: str) -> list:
    """Sweep values are numbers (not NaN; inf where a script accepts it, e.g. brpo's kappa_max), booleans or
    strings, at least one."""
    if not values:
        raise GridError(f"{where}: no values")
    for v in values:
        if not isinstance(v, (bool, int, float, str)) or (isinstance(v, float) and math.isnan(v)):
            raise GridError(f"{where}: {v!r} is not a number, a boolean or a string")
        if isinstance(v, str) and ("," in v or not v.strip()):  # the scripts' --sweep separates values by commas
            raise GridError(f"{where}: {v!r}: a value may not be empty or hold a comma; list the values separately")
    twice = [v for i, v in enumerate(values) if v in values[:i]]  # 1e-3 and 0.001: likely a typo
    if twice:
        raise GridError(f"{where}: {twice[0]!r} is listed more than once; give each value once")
    return values


def distinct_keys(keys, where: str) -> None:
    """Refuse two spellings of one flag (learning-rate and learning_rate): one would silently replace the other."""
    seen = {}
    for key in keys:
        if norm_key(key) in seen:
            raise GridError(f"{where}: '{seen[norm_key(key)]}' and '{key}' name the same flag; give it once")
        seen[norm_key(key)] = key


def merge_grids(*grids: dict) -> dict[str, list[dict[str, list]]]:
    """Later grids set their flags in every block of earlier ones (a block per pair of blocks)."""
    merged: dict[str, list[dict[str, list]]] = {}
    for grid in grids:
        for algo, params in grid.items():
            merged[algo] = [{**a, **b} for a in merged.get(algo, [{}]) for b in param_blocks(params)]
    return merged


def expand_grid(envs, epsilons, algos, seeds, grid: dict | None = None) -> list[Cell]:
    """All cells, in a stable order (env, epsilon, algorithm, configuration, seed), without duplicates."""
    grid = grid or {}
    cells: list[Cell] = []
    seen: set[str] = set()
    for env_id, eps, algo in itertools.product(envs, epsilons, algos):
        for params in param_blocks(grid.get(algo, {})):
            keys = sorted(params)
            for key in keys:
                why = reserved(key)
                if why:
                    raise GridError(f"'{key}' {why} and cannot be swept")
            for combo in itertools.product(*(params[k] for k in keys)):
                hp = tuple(zip(keys, combo))
                # a configuration's directory name is a file name (the processes' {key} templates are checked
                # by the scripts once formatted)
                if len((algo + "__" + ",".join(f"{k}={fmt_value(v)}" for k, v in hp)).encode()) > 255:
                    raise GridError(f"the configuration names of {algo} over {', '.join(keys)} exceed the 255 bytes "
                                    "of a file name; sweep fewer flags in one grid entry")
                for seed in seeds:
                    cell = Cell(env_id, float(eps), algo, int(seed), hp)
                    if cell.run_name not in seen:
                        seen.add(cell.run_name)
                        cells.append(cell)
    return cells


def script_flags(script: Path) -> dict[str, str] | None:
    """Field names of the script's `Args` dataclass (its flags, underscore spelling), each with its annotation's text,
    with those of its base classes in common.py (the shared flags), read with ast so that the list cannot drift from
    the scripts; None if the script or its Args class cannot be read."""
    def classes(path: Path) -> dict:
        try:
            return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
        except (OSError, SyntaxError):
            return {}

    shared = classes(Path(script).parent / "common.py")

    def fields(node: ast.ClassDef) -> dict[str, str]:
        own = {t.target.id: ast.unparse(t.annotation) for t in node.body
               if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
        for base in node.bases:  # common.TDArgs or TDArgs
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if name in shared:
                own = fields(shared[name]) | own
        return own

    args = classes(Path(script)).get("Args")
    return fields(args) if args is not None else None


SCALARS = {"float": (int, float), "int": (int,), "bool": (bool,)}  # what each annotation's --sweep accepts


def flag_errors(grid: dict, repo: Path | None = None) -> list[str]:
    """Flags the scripts do not have, and values of a type theirs cannot parse (mu=abc): every run would fail on
    them, so the grid stops before starting any (a dry run included). Ranges stay the scripts' own checks."""
    repo = Path(repo) if repo else Path(__file__).resolve().parent.parent
    out = []
    for algo, params in grid.items():
        script = ALGORITHMS[algo][0]
        known = script_flags(repo / script)
        if known is None:  # its Args cannot be read: the script's own parser will say what is wrong
            continue
        for block in param_blocks(params):
            for key, values in block.items():
                flag = f"--{key.replace('_', '-')}"
                if key not in known:
                    out.append(f"{flag} is not a flag of {script}")
                    continue
                kind = re.sub(r"^Optional\[(.*)\]$", r"\1", known[key])
                for v in values if kind in SCALARS else ():
                    # an int flag takes a float that is written as digits: 1e3 (1000), not 1e20 (1e+20)
                    whole = kind == "int" and isinstance(v, float) and fmt_value(v).lstrip("-").isdigit()
                    if not (isinstance(v, SCALARS[kind]) or whole) or isinstance(v, bool) != (kind == "bool"):
                        out.append(f"{flag} of {script} takes {kind} values, got {v!r}")
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------
# result validation (shared with aggregate.py)
# --------------------------------------------------------------------------------------------
def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):  # a multi-value flag (--deploy-pessimism 0 1)
        a, b = (list(x) if isinstance(x, (list, tuple)) else [x] for x in (a, b))  # records [0.0] for a requested 0
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return str(a) == str(b)


def expected_evaluations(total_steps, eval_frequency, sparse=0) -> set[int] | None:
    """Accepted numbers of evaluations: the updates the scripts evaluate after (every eval_frequency; every sparse
    before the last 10 with --eval-sparse-frequency), one more for scripts that also evaluate at step 0."""
    try:
        total, freq, sparse = int(total_steps), int(eval_frequency), int(sparse or 0)
    except (TypeError, ValueError, OverflowError):
        return None
    if total < 1 or freq < 1 or sparse < 0:
        return None
    dense_from = max(total - 10 * freq, 0) if sparse else 0  # counted, not listed: a result may claim 10^12 updates
    n = total // freq - dense_from // freq + (dense_from // sparse if sparse else 0) + (total % freq != 0)
    return {n, n + 1}


def check_result(path: Path, cell: Cell | None = None, requested: dict | None = None) -> str | None:
    """Return None if ``path`` is a finished, valid result for ``cell`` run with ``requested`` flags,
    otherwise a short reason why not."""
    path = Path(path)
    if not path.is_file():
        return "no result.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        return f"unreadable result.json ({type(e).__name__})"
    if not isinstance(data, dict):
        return "result.json is not an object"
    score = data.get("final_score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return "missing or non-finite final_score"
    if data.get("score", "return") != "return":
        return "scored by the improvement certificate (no simulator), not by returns"
    evals = data.get("evaluations")
    if not isinstance(evals, list) or not evals:
        return "no evaluations"
    if not all(isinstance(e, dict) and "step" in e and "return_mean" in e for e in evals):
        return "malformed evaluations"
    args = {norm_key(k): v for k, v in (data.get("args") or {}).items()} if isinstance(data.get("args"), dict) else {}
    if cell is not None:
        if "env_id" in data and data["env_id"] != cell.env_id:
            return f"env_id {data['env_id']} != {cell.env_id}"
        if "epsilon" in data and not _same(data["epsilon"], cell.epsilon):
            return f"epsilon {data['epsilon']} != {cell.epsilon:g}"
        if "seed" in data and not _same(data["seed"], cell.seed):
            return f"seed {data['seed']} != {cell.seed}"
    requested = dict(requested or {})
    for key, value in requested.items():
        if key in args and not _same(args[key], value):
            return f"{key}={args[key]} but {fmt_value(value)} was requested"
    total = requested.get("total_steps", args.get("total_steps"))
    freq = requested.get("eval_frequency", args.get("eval_frequency"))
    accepted = expected_evaluations(total, freq, requested.get("eval_sparse_frequency",
                                                               args.get("eval_sparse_frequency", 0)))
    if accepted is not None and len(evals) not in accepted:
        return f"{len(evals)} evaluations, expected {min(accepted)} (total_steps={total}, eval_frequency={freq})"
    return None


# --------------------------------------------------------------------------------------------
# datasets
# --------------------------------------------------------------------------------------------
def dataset_path(repo: Path, env_id: str, epsilon: float) -> Path:
    """Default dataset location of the scripts (docs/formats.md)."""
    return Path(repo) / "datasets" / f"{env_id}_eps{float(epsilon):g}.npz"


def missing_datasets(cells: list[Cell], repo: Path) -> dict[str, list[float]]:
    """env_id -> epsilons whose default dataset does not exist yet (for the given cells)."""
    missing: dict[str, list[float]] = {}
    for env_id, eps in dict.fromkeys((c.env_id, c.epsilon) for c in cells):
        if not dataset_path(repo, env_id, eps).exists():
            missing.setdefault(env_id, []).append(eps)
    return missing


def collect_command(python: str, env_id: str, epsilons: list[float]) -> list[str]:
    return [python, "collect_data.py", "--env-id", env_id, "--epsilon", *[fmt_value(float(e)) for e in epsilons]]


# --------------------------------------------------------------------------------------------
# local execution
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Job:
    name: str
    cmd: list[str]
    log: Path
    check: object  # callable () -> str | None (None = success); for a pack: () -> {cell: str | None}
    cells: list = dataclasses.field(default_factory=list)  # a pack's pending cells (progress counts runs)
    proc: subprocess.Popen | None = None
    log_handle: object = None
    out: Path | None = None  # a pack's --out
    start: float = 0.0


def stop_with_parent(parent: int):
    """preexec_fn: the child gets SIGTERM when this runner dies, even by SIGKILL (Linux's parent-death signal);
    the scripts treat SIGTERM as an interrupt and remove what the unfinished run wrote. Elsewhere a no-op."""
    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the runner died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec if sys.platform.startswith("linux") else None


def lock_results(out: Path):
    """Hold an exclusive lock on <out> for this runner's life (the kernel releases it however the runner ends,
    so a crashed runner leaves no stale lock); a second runner on the same --out is refused."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = open(out / ".run_grid.lock", "a+")
    except OSError as e:
        raise GridError(f"cannot write to --out {out} ({e.strerror}); pass a writable directory") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise GridError(f"another run_grid.py ({holder}) is running on {out}; wait for it or pass another --out")
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Runner:
    """Runs jobs with at most ``workers`` concurrent child processes; Ctrl-C/SIGTERM stops them all."""

    def __init__(self, repo: Path, workers: int, already_done: int = 0, heartbeat: float = 60.0):
        self.repo, self.workers, self.heartbeat = Path(repo), max(1, workers), heartbeat
        self.already_done = already_done
        self.done = 0
        self.failed: list[tuple[str, str, Path]] = []  # (run or job name, reason, log)
        self.durations: list[float] = []

    def _env(self) -> dict:
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _launch(self, job: Job) -> None:
        try:
            job.log.parent.mkdir(parents=True, exist_ok=True)
            job.log_handle = open(job.log, "w")
        except OSError as e:  # e.g. a file where the run directory should be
            print(f"cannot start {job.name}: cannot write {job.log} ({e.strerror})", file=sys.stderr)
            job.proc = None
            return
        now = datetime.datetime.now(datetime.timezone.utc)
        job.log_handle.write(f"# {now:%Y-%m-%d %H:%M:%S} UTC  cwd={self.repo}\n# {shlex.join(job.cmd)}\n")
        job.log_handle.flush()
        job.start = time.time()
        try:
            # own session: a terminal Ctrl-C reaches only this runner, which then stops children itself
            job.proc = subprocess.Popen(job.cmd, cwd=self.repo, stdout=job.log_handle, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=self._env(), start_new_session=True,
                                        preexec_fn=stop_with_parent(os.getpid()))
        except OSError as e:
            job.log_handle.write(f"# could not start: {e}\n")
            job.log_handle.close()
            job.proc = None

    def _progress(self, total: int, running: int, queued: int, t0: float, event: str = "") -> None:
        elapsed = time.time() - t0
        eta = None
        if self.durations:
            mean = sum(self.durations) / len(self.durations)
            eta = mean * (queued + running * 0.5) / self.workers
        elif queued == 0 and running == 0:
            eta = 0.0
        line = (f"[{self.already_done + self.done}/{total} done | {running} running | {len(self.failed)} failed | "
                f"{queued} remaining | elapsed {fmt_duration(elapsed)} | ETA {fmt_duration(eta)}]")
        print(f"{line} {event}".rstrip(), flush=True)

    def _stop_all(self, running: list[Job]) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abort the clean-up
        for job in running:
            if job.proc is not None and job.proc.poll() is None:
                try:
                    os.killpg(job.proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.time() + 10
        for job in running:
            if job.proc is None:
                continue
            try:
                job.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(job.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                job.proc.wait()
            if job.log_handle and not job.log_handle.closed:
                job.log_handle.write("\n# interrupted by run_grid.py\n")
                job.log_handle.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def run(self, jobs: list[Job], total: int | None = None, label: str = "run") -> bool:
        """Run all jobs; returns False if interrupted. Failures are collected in self.failed."""
        total = total if total is not None else sum(max(1, len(j.cells)) for j in jobs) + self.already_done
        queue = list(jobs)
        running: list[Job] = []
        t0 = last_print = time.time()

        def runs(jobs: list) -> int:  # progress counts runs: a pack holds several
            return sum(max(1, len(j.cells)) for j in jobs)

        def on_sigterm(signum, frame):  # SIGTERM/SIGHUP: stop the children like Ctrl-C
            raise KeyboardInterrupt

        previous = {sig: signal.signal(sig, on_sigterm) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            while queue or running:
                while queue and len(running) < self.workers:
                    job = queue.pop(0)
                    running.append(job)  # before launching, so an interrupt can never orphan it
                    self._launch(job)
                    if job.proc is None:
                        running.remove(job)
                        self.failed += [(c.run_name, "could not start", job.log) for c in job.cells] or [
                            (job.name, "could not start", job.log)]
                for job in list(running):
                    rc = job.proc.poll()
                    if rc is None:
                        continue
                    running.remove(job)
                    job.log_handle.close()
                    dt = time.time() - job.start
                    self.durations.append(dt / max(1, len(job.cells)))
                    if job.cells:  # a pack: each member's own result decides
                        problems = {c: p for c, p in job.check().items() if p is not None}
                        self.done += len(job.cells) - len(problems)
                        for c, p in problems.items():
                            self.failed.append((c.run_name, p if rc == 0 else f"exit code {rc}, {p}", job.log))
                            quarantine(Path(job.out) / c.run_name / RESULT_FILE)
                        event = (f"ok     {job.name} ({dt:.0f}s)" if not problems else
                                 f"FAILED {len(problems)} of {len(job.cells)} runs of {job.name} (log: {job.log})")
                    else:
                        problem = f"exit code {rc}" if rc != 0 else job.check()
                        if problem is None:
                            self.done += 1
                            event = f"ok     {job.name} ({dt:.0f}s)"
                        else:
                            self.failed.append((job.name, problem, job.log))
                            event = f"FAILED {job.name} ({problem}; log: {job.log})"
                    self._progress(total, runs(running), runs(queue), t0, event)
                    last_print = time.time()
                if time.time() - last_print > self.heartbeat:
                    self._progress(total, runs(running), runs(queue), t0)
                    last_print = time.time()
                time.sleep(0.05)
        except KeyboardInterrupt:
            print(f"\ninterrupted: stopping {len(running)} running {label}(s) ...", file=sys.stderr, flush=True)
            self._stop_all(running)
            return False
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return True


def quarantine(result: Path) -> None:
    """Move a result file that must not count as finished out of the way (never deleted)."""
    if result.exists():
        os.replace(result, result.with_name(RESULT_FILE + ".stale"))


# --------------------------------------------------------------------------------------------
# Slurm
# --------------------------------------------------------------------------------------------
def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


def pack_log(pack: Pack, index: int, out: Path, stamp: str = "") -> Path:
    """The log of pack `index` (stdout and stderr of its process); stamp: the invocation's, so a resume keeps the
    logs of earlier attempts."""
    return Path(out) / "logs" / f"{pack.env_id}__{pack.algo}__{index:03d}{stamp}.log"


def slurm_line(pack: Pack, index: int, settings: dict, out: Path, python: str, threads: int) -> str:
    log = pack_log(pack, index, out)
    cmd = pack_command(pack, settings, out, python, threads)
    return f"mkdir -p {shlex.quote(str(log.parent))} && {shlex.join(cmd)} > {shlex.quote(str(log))} 2>&1"


def write_slurm(packs: list[Pack], settings: dict, out: Path, repo: Path, python: str, threads: int,
                missing: dict[str, list[float]], opts: argparse.Namespace) -> Path:
    """Write <out>/slurm/{commands.txt, cells.tsv, grid_NNN.sbatch, [collect.sbatch], submit.sh}.

    Pack i (one process, several runs as members) is line i+1 of commands.txt. The packs are split into job
    arrays of at most --slurm-array-max tasks: array task t of grid_NNN.sbatch runs pack OFFSET+t, so every cell
    maps to exactly one (script, array index) pair; cells.tsv lists the mapping."""
    sdir = Path(out) / "slurm"
    (sdir / "logs").mkdir(parents=True, exist_ok=True)
    for old in sdir.glob("grid_*.sbatch"):
        old.unlink()
    chunk = max(1, opts.slurm_array_max)
    chunks = [(k, start, min(start + chunk, len(packs))) for k, start in enumerate(range(0, len(packs), chunk))]
    lines = [slurm_line(pack, i, settings, out, python, threads) for i, pack in enumerate(packs)]
    write_atomic(sdir / "commands.txt", "\n".join(lines) + "\n")
    write_atomic(sdir / "cells.tsv", "pack\tsbatch\tarray_index\trun_dir\n" + "".join(
        f"{i}\tgrid_{k:03d}.sbatch\t{i - start}\t{cell.run_dir(out)}\n"
        for k, start, stop in chunks for i in range(start, stop) for cell in packs[i].cells))
    partition = f"#SBATCH --partition={opts.slurm_partition}\n" if opts.slurm_partition else ""
    throttle = f"%{opts.slurm_max_parallel}" if opts.slurm_max_parallel else ""
    header = "#!/bin/bash\n" + partition + f"#SBATCH --cpus-per-task=1\n#SBATCH --mem={opts.slurm_mem}\n"
    commands = shlex.quote(str(sdir / "commands.txt"))
    for k, start, stop in chunks:
        script = (header +
                  f"#SBATCH --job-name=brpo-grid-{k:03d}\n#SBATCH --time={opts.slurm_time}\n"
                  f"#SBATCH --array=0-{stop - start - 1}{throttle}\n"
                  f"#SBATCH --output={sdir}/logs/grid_{k:03d}_%a.out\n"
                  "# Generated by benchmark/run_grid.py: array task t runs pack OFFSET+t (one process, its runs\n"
                  "# as members), i.e. line OFFSET+t+1 of commands.txt (cells.tsv maps runs to packs).\n"
                  "set -euo pipefail\n"
                  f"OFFSET={start}\n"
                  "export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1\n"
                  f"cd {shlex.quote(str(repo))}\n"
                  f"CMD=$(sed -n \"$((OFFSET + SLURM_ARRAY_TASK_ID + 1))p\" {commands})\n"
                  "if [ -z \"$CMD\" ]; then echo \"no command for array index $SLURM_ARRAY_TASK_ID\" >&2; exit 1; fi\n"
                  "echo \"$CMD\"\n"
                  "eval \"$CMD\"\n")
        write_atomic(sdir / f"grid_{k:03d}.sbatch", script, 0o755)
    submit = ["#!/bin/bash", "# Submit the benchmark grid (datasets first, if any are missing).", "set -euo pipefail",
              f"cd {shlex.quote(str(sdir))}"]
    dependency = ""
    if missing:
        collect = (header + "#SBATCH --job-name=brpo-datasets\n#SBATCH --time=02:00:00\n"
                   f"#SBATCH --output={sdir}/logs/datasets_%j.out\nset -euo pipefail\n"
                   f"cd {shlex.quote(str(repo))}\n" +
                   "".join(shlex.join(collect_command(python, env, eps)) + "\n" for env, eps in missing.items()))
        write_atomic(sdir / "collect.sbatch", collect, 0o755)
        submit.append("jid=$(sbatch --parsable collect.sbatch)")
        dependency = "--dependency=afterok:$jid "
    else:
        (sdir / "collect.sbatch").unlink(missing_ok=True)
    submit += [f"sbatch {dependency}grid_{k:03d}.sbatch" for k, _, _ in chunks]
    write_atomic(sdir / "submit.sh", "\n".join(submit) + "\n", 0o755)
    return sdir


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line (the scripts' form), not the usage block above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def make_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="run_grid.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("grid")
    g.add_argument("--envs", nargs="+", default=list(ENVS), help="tasks")
    g.add_argument("--epsilons", nargs="+", type=float, default=list(PAPER_EPSILONS), help="dataset epsilons")
    g.add_argument("--algos", nargs="+", default=list(PAPER_ALGORITHMS), help="algorithms: " + ", ".join(ALGORITHMS))
    g.add_argument("--seeds", nargs="+", type=int, default=list(PAPER_SEEDS), help="seeds")
    g.add_argument("--sweep", action="append", default=[], metavar="ALGO:KEY=V1,V2",
                   help="sweep a flag for one algorithm ('all:' for every algorithm), in every block of --grid; repeatable")
    g.add_argument("--cells", type=Path, default=None, metavar="SELECTED_JSON",
                   help="run exactly these (task, epsilon, algorithm, configuration) cells for --seeds, e.g. the "
                        "selected.json of aggregate.py --selection-seeds (instead of --envs/--epsilons/--algos/--grid)")
    g.add_argument("--except-cells", type=Path, default=None, metavar="OLD_SELECTED_JSON",
                   help="with --cells: leave out the cells that this selected.json selects the same way, e.g. the "
                        "previous report's, whose fresh seeds have run: only the selections that changed are run")
    g.add_argument("--grid", type=Path, default=None,
                   help="JSON hyperparameter grid file, e.g. benchmark/paper_sweep.json (an algorithm's entry is one "
                        "product of value lists or a list of them, their union)")
    s = p.add_argument_group("settings passed to every script (omitted = the script's default)")
    s.add_argument("--total-steps", type=int, default=None)
    s.add_argument("--eval-frequency", type=int, default=None)
    s.add_argument("--eval-episodes", type=int, default=None)
    s.add_argument("--eval-sparse-frequency", type=int, default=None,
                   help="evaluate every N updates before the last 10 evaluations (a sparse curve, same final score)")
    s.add_argument("--threads", type=int, default=1, help="torch threads per run")
    e = p.add_argument_group("execution")
    e.add_argument("--out", type=Path, default=DEFAULT_OUT, help="runs directory (--runs-dir of the scripts)")
    e.add_argument("--workers", type=int, default=1, help="parallel local processes")
    e.add_argument("--max-members", type=int, default=100,
                   help="most runs trained side by side in one process (1: one process per run)")
    e.add_argument("--dry-run", action="store_true", help="print the commands of unfinished runs and exit")
    e.add_argument("--no-collect", action="store_true", help="do not create missing datasets first")
    e.add_argument("--repo", type=Path, default=REPO_ROOT, help="directory holding the algorithm scripts")
    e.add_argument("--python", default=sys.executable, help="python interpreter for the scripts")
    e.add_argument("--heartbeat", type=float, default=60.0, help="seconds between progress lines while waiting")
    sl = p.add_argument_group("slurm")
    sl.add_argument("--slurm", action="store_true", help="write a Slurm job-array script instead of running")
    sl.add_argument("--slurm-time", default="04:00:00")
    sl.add_argument("--slurm-mem", default="2G")
    sl.add_argument("--slurm-partition", default=None)
    sl.add_argument("--slurm-max-parallel", type=int, default=None, help="array throttle (%%N)")
    sl.add_argument("--slurm-array-max", type=int, default=1000,
                    help="tasks per job array (clusters limit MaxArraySize); larger grids get several arrays")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    opts = parser.parse_args(argv)
    opts.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(opts)
    except (GridError, OSError) as e:
        if isinstance(e, OSError) and not too_long(e):
            raise
        print(f"run_grid.py: error: {too_long(e) or e}", file=sys.stderr)
        return 2


def too_long(e: BaseException) -> str:
    """One line for a path longer than the file system allows, met in any check (empty for any other error); the
    scripts' twin is common.too_long (this file does not import common, which loads torch)."""
    if not (isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG):
        return ""
    name = os.fsdecode(e.filename) if e.filename is not None else "a path"
    return f"{name if len(name) <= 80 else name[:40] + '...' + name[-30:]}: {e.strerror} (the file system allows " \
           "255 bytes per name, 4096 per path); pass a shorter path"


def _main(opts: argparse.Namespace) -> int:
    envs = list(dict.fromkeys(canonical_env(e) for e in opts.envs))
    algos = list(dict.fromkeys(canonical_algo(a) for a in opts.algos))
    epsilons, seeds = [float(e) for e in opts.epsilons], list(opts.seeds)
    # epsilons as their datasets name them (eps{:g}), as the scripts compare them: a value twice is likely a typo
    for name, values in (("--epsilons", [f"{e:g}" for e in epsilons]), ("--seeds", seeds)):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise GridError(f"{name} lists {', '.join(map(str, twice))} more than once; give each value once")
    for name, value in (("--workers", opts.workers), ("--threads", opts.threads), ("--max-members", opts.max_members)):
        if value < 1:
            raise GridError(f"{name} must be >= 1")
    if opts.threads > (os.cpu_count() or 1):
        raise GridError(f"--threads must be at most {os.cpu_count()} (the cores of this machine)")
    if any(not 0 <= s < 2**32 for s in seeds):
        raise GridError("seeds must lie in [0, 2**32)")
    for name, value in (("--total-steps", opts.total_steps), ("--eval-frequency", opts.eval_frequency),
                        ("--eval-episodes", opts.eval_episodes)):
        if value is not None and value < 1:
            raise GridError(f"{name} must be >= 1")
    if opts.eval_sparse_frequency is not None and opts.eval_sparse_frequency < 0:
        raise GridError("--eval-sparse-frequency must be >= 0")
    if any(not 0.0 <= e <= 1.0 for e in epsilons):
        raise GridError("epsilons must lie in [0, 1]")
    if not 0 < opts.heartbeat < math.inf:
        raise GridError(f"--heartbeat must be a positive number of seconds, got {opts.heartbeat}")
    for name in ("slurm_max_parallel", "slurm_array_max"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            raise GridError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("slurm_time", "slurm_mem", "slurm_partition"):  # written into #SBATCH lines
        if getattr(opts, name) is not None and not re.fullmatch(r"[\w:.,+-]+", getattr(opts, name)):
            raise GridError(f"--{name.replace('_', '-')} {getattr(opts, name)!r}: expected a Slurm value such as "
                            "04:00:00, 2G or a partition name (letters, digits and : . , + - _)")

    grids = [load_grid_file(opts.grid, algos)] if opts.grid else []
    sweeps = [parse_sweep(s, algos) for s in opts.sweep]
    named = [(a, k) for sweep in sweeps for a, block in sweep.items() for k in block]
    twice = sorted({f"{a}:{k}" for a, k in named if named.count((a, k)) > 1})
    if twice:
        raise GridError(f"--sweep sets {', '.join(twice)} twice (the last would replace the first); give all values "
                        "in one --sweep, e.g. dqn:tau=0.5,1")
    grids += sweeps
    grid = {a: p for a, p in merge_grids(*grids).items() if a in algos}

    settings = {"total_steps": opts.total_steps, "eval_frequency": opts.eval_frequency,
                "eval_sparse_frequency": opts.eval_sparse_frequency,
                "eval_episodes": opts.eval_episodes}
    out = opts.out.resolve()
    repo = opts.repo.resolve()
    if opts.cells and (opts.grid or opts.sweep):
        raise GridError("--cells names each cell's configuration: it cannot be combined with --grid or --sweep")
    if opts.except_cells and not opts.cells:
        raise GridError("--except-cells removes cells from --cells: give both")
    cells = load_cells(opts.cells, seeds) if opts.cells else expand_grid(envs, epsilons, algos, seeds, grid)
    if opts.except_cells:
        same = {dataclasses.replace(c, seed=0) for c in load_cells(opts.except_cells, [0])}
        cells = [c for c in cells if dataclasses.replace(c, seed=0) not in same]
        print(f"--except-cells: {len(cells)} runs of --cells are selected differently in {opts.except_cells}")
        if not cells:
            print("nothing to run: every selection is unchanged")
            return 0
    if opts.cells:
        grid = {}  # for the unknown-flag check below
        for c in cells:
            grid.setdefault(c.algo, {}).update({k: [v] for k, v in c.hparams})
        envs, epsilons, algos = (list(dict.fromkeys(getattr(c, f) for c in cells))
                                 for f in ("env_id", "epsilon", "algo"))
    errors = flag_errors(grid, repo)
    if errors:
        raise GridError(f"{errors[0]} (see the script's --help for its flags)")
    if not (opts.dry_run or opts.slurm):  # before --out is touched (a dry run or a cluster may name other paths)
        collect = [] if opts.no_collect or not missing_datasets(cells, repo) else ["collect_data.py"]
        for script in collect + list(dict.fromkeys(c.script for c in cells)):
            if not (repo / script).is_file():
                raise GridError(f"script {script} not found in {repo} (use --repo to point at the algorithm scripts)")
        python = shutil.which(opts.python)  # absolute: the processes run in --repo, not here
        if python is None:
            raise GridError(f"--python {opts.python}: no such executable; pass the interpreter the scripts run with")
        opts.python = python
    lock = None if opts.dry_run else lock_results(out)  # noqa: F841 (held while this function runs)

    finished, pending, stale = [], [], []
    for cell in cells:
        path = cell.run_dir(out) / RESULT_FILE
        reason = check_result(path, cell, cell_settings(cell, settings))
        if reason is None:
            finished.append(cell)
        else:
            pending.append(cell)
            if path.exists():
                stale.append((cell, reason))
    missing = {} if opts.no_collect else missing_datasets(pending, repo)

    print(f"grid: {len(envs)} env(s) x {len(epsilons)} eps x {len(algos)} algo(s) "
          f"-> {len(cells)} runs ({len(finished)} finished, {len(pending)} to run) in {out}", file=sys.stderr)
    for cell, reason in stale:
        print(f"rerun {cell.run_name}: {reason}", file=sys.stderr)

    if opts.dry_run:
        for env_id, eps in missing.items():
            print(shlex.join(collect_command(opts.python, env_id, eps)))
        for pack in pack_cells(pending, repo, opts.max_members, cells):
            print(shlex.join(pack_command(pack, settings, out, opts.python, opts.threads)))
        return 0

    if not pending:
        print("nothing to do: every run has a valid result.json", file=sys.stderr)
        return 0

    if opts.slurm:
        packs = pack_cells(pending, repo, opts.max_members, cells)
        sdir = write_slurm(packs, settings, out, repo, opts.python, opts.threads, missing, opts)
        log_invocation(out, opts, len(cells), len(pending))
        n_arrays = len(list(sdir.glob("grid_*.sbatch")))
        print(f"wrote {n_arrays} job array script(s) for {len(pending)} runs in {len(packs)} processes in {sdir}; "
              f"submit with: bash {sdir}/submit.sh")
        return 0

    log_invocation(out, opts, len(cells), len(pending))
    failed: list[tuple[str, str, Path]] = []

    # 1) datasets, one collect_data.py call per env, before any algorithm run (no two workers may create
    #    the same default dataset concurrently)
    if missing:
        print(f"creating {sum(map(len, missing.values()))} missing dataset(s) first", flush=True)
        jobs = []
        for env_id, eps in missing.items():
            paths = [dataset_path(repo, env_id, e) for e in eps]
            jobs.append(Job(name=f"collect {env_id}", cmd=collect_command(opts.python, env_id, eps),
                            log=out / "logs" / f"collect_{env_id}.log",
                            check=lambda paths=paths: None if all(p.exists() for p in paths)
                            else "dataset file(s) missing after collect_data.py"))
        runner = Runner(repo, opts.workers, heartbeat=opts.heartbeat)
        completed = runner.run(jobs, label="collection")
        failed += runner.failed
        if not completed:
            return report(failed, interrupted=True)
        # runs whose dataset could not be made are not started (a script would try to create it itself)
        blocked = {c for c in pending if not dataset_path(repo, c.env_id, c.epsilon).exists()}
        failed += [(c.run_name, "dataset missing (collect_data.py failed)", out / "logs" / f"collect_{c.env_id}.log")
                   for c in pending if c in blocked]
        pending = [c for c in pending if c not in blocked]

    # 2) algorithm runs
    for cell in pending:
        quarantine(cell.run_dir(out) / RESULT_FILE)  # an invalid/stale result must never look finished
    # the longest processes first, so that the last ones to finish are short (relative costs measured on the 2-core
    # machine: LunarLander's evaluation is bound by Box2D, BRPO's update by its solver)
    packs = sorted(pack_cells(pending, repo, opts.max_members, cells), key=lambda pack: -pack.size * {
        "LunarLander-v3": 4, "Acrobot-v1": 2}.get(pack.env_id, 1) * {"brpo": 4, "brpo_c": 2, "bcq": 2}.get(pack.algo, 1))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("__%Y%m%d-%H%M%S")
    print(f"{len(pending)} runs in {len(packs)} processes (at most {opts.max_members} runs each)", flush=True)
    jobs = [Job(name=f"{pack.env_id} {pack.algo} ({len(pack.cells)} runs)",
                cmd=pack_command(pack, settings, out, opts.python, opts.threads), log=pack_log(pack, i, out, stamp),
                cells=pack.cells, out=out,
                check=lambda pack=pack: {c: check_result(c.run_dir(out) / RESULT_FILE, c, cell_settings(c, settings))
                                         for c in pack.cells})
            for i, pack in enumerate(packs)]
    runner = Runner(repo, opts.workers, already_done=len(finished), heartbeat=opts.heartbeat)
    completed = runner.run(jobs, total=len(cells))
    failed += runner.failed
    return report(failed, interrupted=not completed,
                  summary=f"{len(finished) + runner.done}/{len(cells)} runs finished")


def report(failed: list[tuple[str, str, Path]], interrupted: bool = False, summary: str = "") -> int:
    if summary:
        print(summary)
    if failed:
        print(f"{len(failed)} failed run(s):")
        for name, reason, log in failed:
            print(f"  {name}: {reason}; log: {log}")
    if interrupted:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 1 if failed else 0


def log_invocation(out: Path, opts: argparse.Namespace, n_cells: int, n_pending: int) -> None:
    """Append this invocation to <out>/invocations.jsonl (aggregate.py quotes it in its header)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join(["python", "benchmark/run_grid.py", *opts.argv]),
              "argv": opts.argv, "cells": n_cells, "pending": n_pending,
              "mode": "slurm" if opts.slurm else "local"}
    with open(out / "invocations.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. `run_grid.py --dry-run | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
