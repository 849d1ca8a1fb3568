#!/usr/bin/env python
"""Aggregate benchmark result.json files into the paper's Table 1 layout, learning curves and a summary.

    python benchmark/aggregate.py benchmark/results/table1            # writes benchmark/results/table1/report/

Reads every ``result.json`` below RESULTS_DIR (docs/formats.md schema; several directories are read as one,
e.g. a sweep and the fresh seeds of its selection written to another --out by run_grid.py). Seeds of one
configuration are the sibling ``seed<k>`` run directories written by run_grid.py (results laid out differently
are grouped by their hyperparameters instead). When several configurations of an algorithm exist for a (task, epsilon)
cell -- a sweep -- the one with the highest mean final score is reported, as in the paper, and the
selection is listed (--selection-seeds: selected on those seeds only; the selection is also scored on the
other seeds, fresh_seeds.md, and written to selected.json for run_grid.py --cells). Cells show mean +- sample
standard deviation (ddof=1) over seeds of final_score, the paper's value beside it; the top-2 of the paper's seven
algorithms in each row are bold. The algorithms this repository adds (CQL) are columns after the paper's, shown when
they have results or are named in --algos, with no paper value and no rank.

Outputs (written atomically): table1.md, configs.csv, runs.csv, curves_<env>.png (mean +- standard error over
seeds).

    python benchmark/aggregate.py benchmark/results/table1 --merge-runs benchmark/table1_result/runs.csv ...

--merge-runs adds the runs listed in an earlier runs.csv (this script's own output) to those found on disk:
a grid that outlives its result files (another machine, a cleaned checkout) keeps growing from its committed
per-run table. A result.json for the same cell, configuration and seed replaces the listed row. Listed runs
carry no learning curve (runs.csv has none).

--behavior-from DATASETS_DIR scores every run against the behaviour return of its dataset in that directory
(collect_data.py's file names) instead of the one its result file recorded: the runs do not depend on how beta was
scored, so results from before a change of that measurement can be compared with the new one.
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_grid import (ALGORITHMS, ENVS, ENV_RENAMES, PAPER_ALGORITHMS, RESULT_FILE, Parser, check_result,  # noqa: E402
                      fmt_value, norm_key, parse_value, too_long)

PAPER_CSV = Path(__file__).resolve().parent / "paper_table1.csv"
LABELS = {key: label for key, (_, label) in ALGORITHMS.items()}
ALGO_ORDER = list(ALGORITHMS)
# args that differ between seeds of one configuration or do not change the learning problem
PER_RUN_KEYS = {"seed", "run_name", "runs_dir", "exp_name", "track", "tensorboard", "threads", "save_model",
                "eval_checkpoint", "dataset_path", "wandb_project_name", "wandb_entity", "capture_video", "cuda",
                "env_id", "epsilon", "overwrite", "skip_finished"}
# U of the normalised score (score - behaviour) / (U - behaviour), the share of the available improvement over the
# behaviour policy an algorithm captures: CartPole's maximum return, and returns near the best reported for the
# others (a solved LunarLander is 200+, Acrobot's best policies take ~60 steps)
UPPER = {"CartPole-v1": 500.0, "Acrobot-v1": -60.0, "LunarLander-v3": 250.0}
BOOTSTRAP_REPS = 2000  # rliable's stratified bootstrap; seeded, so a report is reproducible
HEADER_SETTINGS = ("total_steps", "eval_frequency", "eval_episodes", "eval_seed", "batch_size", "gamma",
                   "learning_rate", "target_update_frequency", "tau")


class AggregateError(Exception):
    pass


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
@dataclass
class Run:
    path: Path
    env_id: str
    epsilon: float
    algo: str
    seed: int
    final_score: float
    behavior_return: float | None
    steps: list[int]
    returns: list[float]
    args: dict
    group: str = ""
    hparams: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # the script's own end-of-run diagnostics (numbers only)
    eval_se: float | None = None  # standard error of the final score's episodes (see load_runs)
    dataset_sha256: str | None = None  # of the dataset file the run loaded (result files before it lack it)


def resolve_algo(data: dict, path: Path) -> str | None:
    """Map the result's algorithm name (or, failing that, the script/dir name) to a Table 1 key."""
    def norm(s):
        return re.sub(r"[^a-z0-9]", "", str(s).lower())
    aliases = {norm(k): k for k in ALGORITHMS}
    aliases.update({norm(label): k for k, label in LABELS.items()})
    aliases.update({norm(Path(script).stem): k for k, (script, _) in ALGORITHMS.items()})
    args = data.get("args") if isinstance(data.get("args"), dict) else {}
    candidates = [data.get("algorithm"), args.get("exp_name"), path.parent.parent.name.split("__")[0]]
    for c in candidates:
        if c is not None and norm(c) in aliases:
            return aliases[norm(c)]
    return None


def malformed(data: dict) -> str | None:
    """What makes a result that check_result accepts unusable here (fields of the wrong type, NaN)."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if not number(data.get("epsilon")) or not isinstance(data.get("seed"), int) or isinstance(data["seed"], bool):
        return "epsilon or seed is not a number"
    if not 0.0 <= data["epsilon"] <= 1.0 or data["seed"] < 0:
        return f"epsilon {data['epsilon']} outside [0, 1] or seed {data['seed']} negative"
    if abs(data["final_score"]) > 1e15:  # no return is that large; means of such numbers would overflow
        return f"final_score {data['final_score']:.3g} is not a plausible return"
    if not all(isinstance(e.get("step"), int) and not isinstance(e["step"], bool) and number(e.get("return_mean"))
               for e in data["evaluations"]):
        return "an evaluation's step or return_mean is not a number"
    if data.get("behavior_return") is not None and not number(data["behavior_return"]):
        return "behavior_return is not a finite number"
    if not isinstance(data.get("args") or {}, dict) or not isinstance(data.get("extra") or {}, dict):
        return "args or extra is not an object"
    return None


def load_runs(root: Path) -> tuple[list[Run], list[tuple[Path, str]]]:
    runs, skipped = [], []
    for path in sorted(root.rglob(RESULT_FILE)):
        if ".replaced" in path.parts:  # a finished run set aside by --overwrite, back in place if the new run fails
            continue
        reason = check_result(path)
        if reason is not None:
            skipped.append((path, reason))
            continue
        data = json.loads(path.read_text())
        algo = resolve_algo(data, path)
        env_id = data.get("env_id")
        eps = data.get("epsilon")
        if algo is None or not isinstance(env_id, str) or eps is None or data.get("seed") is None:
            skipped.append((path, "cannot tell algorithm/env_id/epsilon/seed"))
            continue
        problem = malformed(data)
        if problem:
            skipped.append((path, problem))
            continue
        args = {norm_key(k): v for k, v in (data.get("args") or {}).items()}
        beh = data.get("behavior_return")
        # standard error of one evaluation: the episodes' std / sqrt(episodes), averaged over the last 10. It
        # includes the spread between start states, which the behaviour return (same start states) shares, so
        # it over-states the noise of score - behaviour; for scripts older than fresh per-evaluation sampling
        # noise (eval_seed + updates) the final score was about as noisy as this one evaluation
        n_ep = args.get("eval_episodes")
        last = [e.get("return_std") for e in data["evaluations"][-10:]]
        eval_se = (sum(last) / len(last) / math.sqrt(n_ep) if isinstance(n_ep, int) and n_ep > 0 and last
                   and all(isinstance(x, (int, float)) and math.isfinite(x) for x in last) else None)
        runs.append(Run(path=path, env_id=ENV_RENAMES.get(env_id, env_id), epsilon=float(eps), algo=algo,
                        # at the precision runs.csv keeps, so that a run's numbers and ties do not depend on which
                        # of the two it was read from
                        seed=int(data["seed"]), final_score=round(float(data["final_score"]), 4),
                        behavior_return=round(float(beh), 4) if isinstance(beh, (int, float)) else None,
                        steps=[int(e["step"]) for e in data["evaluations"]],
                        returns=[float(e["return_mean"]) for e in data["evaluations"]], args=args,
                        extra={k: v for k, v in (data.get("extra") or {}).items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)},
                        eval_se=eval_se, dataset_sha256=data.get("dataset_sha256") if isinstance(
                            data.get("dataset_sha256"), str) else None))
    for run in runs:
        run.hparams = {k: v for k, v in run.args.items() if k not in PER_RUN_KEYS}
        if re.fullmatch(r"seed\d+", run.path.parent.name):  # run_grid.py layout: seeds are siblings
            run.group = "dir:" + str(run.path.parent.parent.relative_to(root))
        else:
            run.group = "args:" + json.dumps(run.hparams, sort_keys=True, default=str)
    return runs, skipped


RUNS_CSV_COLUMNS = ("env_id", "epsilon", "algorithm", "config", "seed", "final_score", "behavior_return")


def read_table(path: Path, columns: tuple[str, ...], name: str, kind: str) -> list[dict]:
    """The rows of a CSV table this script wrote (kind: "a runs.csv", "a configs.csv"), or one AggregateError line."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise AggregateError(f"cannot read {name} ({e}); pass {kind} written by aggregate.py")
    if not rows or any(c not in rows[0] for c in columns):
        raise AggregateError(f"{name} is not {kind} of aggregate.py (needs the columns {', '.join(columns)})")
    for i, row in enumerate(rows, start=2):  # a row cut short (or run on) would read as None (or under key None)
        if None in row or None in row.values():
            raise AggregateError(f"{name}, line {i}: {'more' if None in row else 'fewer'} fields than its header; "
                                 "fix or delete that line")
    return rows


def load_runs_csv(path: Path) -> list[Run]:
    """Runs listed in an earlier runs.csv, grouped as run_grid.py lays their seeds out on disk (so that a
    result.json of the same cell, configuration and seed is recognised as the same run)."""
    by_label = {label: key for key, label in LABELS.items()}
    rows = read_table(path, RUNS_CSV_COLUMNS, f"--merge-runs file '{path}'", "a runs.csv")
    runs = []
    for i, row in enumerate(rows, start=2):
        try:
            algo = by_label[row["algorithm"]]
            eps, seed, score = float(row["epsilon"]), int(row["seed"]), float(row["final_score"])
            beh = float(row["behavior_return"]) if row["behavior_return"] else None
            eval_se = float(row["eval_se"]) if row.get("eval_se") else None
            if not all(math.isfinite(x) for x in (eps, score, beh or 0.0, eval_se or 0.0)):
                raise ValueError("non-finite number")
            if not 0.0 <= eps <= 1.0:
                raise ValueError(f"epsilon {eps:g} outside [0, 1]")
        except (KeyError, ValueError) as e:
            raise AggregateError(f"--merge-runs file '{path}', line {i}: bad row ({e}); fix or delete that line")
        env = ENV_RENAMES.get(row["env_id"], row["env_id"])
        # the label lists the flags as "k=v, k=v"; run_grid.py's directory names them "k=v,k=v"
        config = algo if row["config"] in ("", "default") else f"{algo}__{row['config'].replace(', ', ',')}"
        extra = {}
        for k, v in row.items():
            if k not in RUNS_CSV_COLUMNS and k not in ("score_minus_behavior", "eval_se") and v:
                try:
                    value = float(v)
                except ValueError:
                    continue
                if math.isfinite(value):  # a diagnostic that is not a finite number is left out, as in load_runs
                    extra[k] = value
        runs.append(Run(path=path, env_id=env, epsilon=eps, algo=algo, seed=seed, final_score=score,
                        behavior_return=beh, steps=[], returns=[], args={}, extra=extra,
                        group=f"dir:{env}/eps{fmt_value(eps)}/{config}", eval_se=eval_se))
    return runs


def dataset_behavior_return(path: Path) -> float:
    """A dataset's behavior_return (--behavior-from), at runs.csv's precision, or one AggregateError line."""
    try:
        with np.load(path) as d:
            beh = float(d["behavior_return"])
            kind = str(d["behavior_kind"]) if "behavior_kind" in d.files else "epsilon_greedy"
            paired = "behavior_noise_steps" in json.loads(str(d["settings_json"])) if "settings_json" in d.files else False
    except Exception as e:  # noqa: BLE001  (a missing, truncated or foreign file: one line, whatever numpy raises)
        raise AggregateError(f"--behavior-from: cannot read behavior_return from '{path}' ({type(e).__name__}: {e}); "
                             "create the dataset with collect_data.py or pass the directory that holds it")
    if not math.isfinite(beh):
        raise AggregateError(f"--behavior-from: '{path}' has a behavior_return of {beh}; recreate it with "
                             "collect_data.py --overwrite")
    if kind == "epsilon_greedy" and not paired:  # imported datasets (softmax) keep their logged episodes' mean
        raise AggregateError(f"--behavior-from: '{path}' scored beta before the paired measurement (its settings have "
                             "no behavior_noise_steps); recreate it with collect_data.py --overwrite")
    return round(beh, 4)


def merge_runs(found: list[Run], listed: list[Run]) -> list[Run]:
    """found + the listed runs that no found run replaces (same group = cell and configuration, same seed)."""
    have = {(r.group, r.seed) for r in found}
    seen, kept = set(have), []
    for r in listed:
        if (r.group, r.seed) not in seen:
            seen.add((r.group, r.seed))
            kept.append(r)
    return found + kept


def load_paper(path: Path) -> dict[tuple[str, float, str], tuple[float, float | None, bool]]:
    """(env_id in our naming, epsilon, column label) -> (mean, std or None, top2)."""
    paper = {}
    if not path.is_file():
        return paper
    try:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                env = ENV_RENAMES.get(row["env_id"], row["env_id"])
                std = float(row["std"]) if row.get("std") not in (None, "") else None
                paper[(env, round(float(row["epsilon"]), 6), row["algorithm"])] = (
                    float(row["mean"]), std, row.get("top2") == "1")
    except (OSError, UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError) as e:
        raise AggregateError(f"cannot read --paper-csv '{path}' ({type(e).__name__}: {e}); pass a table with the columns "
                             "env_id, epsilon, algorithm, mean, std, top2 (like benchmark/paper_table1.csv)") from None
    return paper


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------
def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and SAMPLE standard deviation (ddof=1); std is None for a single value."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))


@dataclass
class Config:
    group: str
    runs: list[Run]
    label: str = "default"

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def stats(self) -> tuple[float, float | None]:
        return mean_std([r.final_score for r in self.runs])

    @property
    def total(self) -> int:
        """The final scores' sum in units of 1e-4, their precision: exact, so that equal means compare equal."""
        return sum(round(r.final_score * 10_000) for r in self.runs)


@dataclass
class CellResult:
    env_id: str
    epsilon: float
    algo: str
    configs: list[Config]
    selected: Config | None = None
    ties: int = 0  # other configurations with the selected one's mean (over as many seeds)


def group_cells(runs: list[Run]) -> tuple[dict[tuple[str, float, str], CellResult], list[str]]:
    warnings = []
    by_cell: dict[tuple[str, float, str], dict[str, dict[int, Run]]] = defaultdict(lambda: defaultdict(dict))
    for run in runs:
        seeds = by_cell[(run.env_id, round(run.epsilon, 6), run.algo)][run.group]
        if run.seed in seeds:
            keep = max(seeds[run.seed], run, key=lambda r: r.path.stat().st_mtime)
            warnings.append(f"duplicate seed {run.seed} for {run.env_id} eps={run.epsilon:g} {run.algo}: "
                            f"using {keep.path}")
            seeds[run.seed] = keep
        else:
            seeds[run.seed] = run
    cells = {}
    for (env, eps, algo), groups in by_cell.items():
        configs = [Config(g, sorted(seeds.values(), key=lambda r: r.seed)) for g, seeds in sorted(groups.items())]
        label_configs(configs)
        # best configuration = highest mean final score among those with the most seeds (as in the paper,
        # but a config with fewer finished seeds is not preferred over complete ones); a tie (identical runs, e.g.
        # SPIBB equal to β at every threshold) goes to the configuration naming the fewest flags in its directory
        # name (that of a smaller sweep merged into a larger one), then to the first in name order, and is reported
        most = max(c.n for c in configs)
        best = max(c.total for c in configs if c.n == most)
        tied = sorted((c for c in configs if c.n == most and c.total == best),
                      key=lambda c: (len(run_label(c).split(", ")) if run_label(c) != "default" else 0, c.group))
        cells[(env, eps, algo)] = CellResult(env, eps, algo, configs, tied[0], len(tied) - 1)
    return cells, warnings


def label_configs(configs: list[Config]) -> None:
    """Label each configuration by the hyperparameters that differ between the configurations of a cell."""
    if len(configs) == 1:  # run_grid.py names non-default configurations <algo>__<flag>=<value>,...
        name = configs[0].group.split("/")[-1]
        configs[0].label = name.split("__", 1)[1] if configs[0].group.startswith("dir:") and "__" in name \
            else "default"
        return
    if any(not c.runs[0].args and c.group.startswith("dir:") for c in configs):  # runs listed by --merge-runs: label
        for c in configs:  # every configuration by its directory name (their flags are not known otherwise)
            c.label = dir_flags(c.group)
        return
    params = [c.runs[0].hparams for c in configs]
    keys = sorted({k for p in params for k in p if len({json.dumps(q.get(k), default=str) for q in params}) > 1})
    for c, p in zip(configs, params):
        label = ", ".join(f"{k}={fmt_value(p[k])}" for k in keys if k in p)
        c.label = label or c.group.split("/")[-1]


def dir_flags(group: str) -> str:
    """The flags run_grid.py put in a configuration's directory name, as "k=v, k=v" ("default": none)."""
    name = group.split("/")[-1]
    return name.split("__", 1)[1].replace(",", ", ") if "__" in name else "default"


def run_label(c: Config) -> str:
    """A configuration's name in runs.csv: its directory's flags, the same whichever other configurations share the
    cell (label_configs' labels depend on them, so a configuration's selection-seed and fresh-seed runs, reported
    apart, would otherwise be listed under two names and not merge back as one)."""
    return dir_flags(c.group) if c.group.startswith("dir:") else c.label


# --------------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------------
def fmt_num(x: float) -> str:
    return f"{x:.1f}"


def row_key(env: str, eps: float) -> tuple:
    order = sorted(ENVS)  # the paper lists Acrobot, CartPole, LunarLander
    return (order.index(env) if env in order else len(order), env, eps)


def top2(means: dict[str, float]) -> set[str]:
    """Algorithms whose mean is >= the second-highest mean of the row (ties included)."""
    if not means:
        return set()
    ranked = sorted(means.values(), reverse=True)
    threshold = ranked[min(1, len(ranked) - 1)]
    return {a for a, m in means.items() if m >= threshold}


def build_report(roots: list[Path], runs: list[Run], skipped, expected_seeds: int | None, paper,
                 invocations: list[str], command: str, algos: list[str] | None = None) -> tuple[str, dict]:
    # the columns: the paper's algorithms and those of ours that have runs, or the chosen ones (--algos, whose runs
    # main() already selected) in the paper's order; "top-2" is among the shown columns of the paper's algorithms
    # (ours have no paper value to compare with; no bold with fewer than three: it would be all)
    shown = [a for a in ALGO_ORDER if (a in algos if algos is not None else
                                       a in PAPER_ALGORITHMS or any(r.algo == a for r in runs))]
    ranks = [a for a in shown if a in PAPER_ALGORITHMS]
    ours = [a for a in shown if a not in PAPER_ALGORITHMS]
    rank = len(ranks) >= 3
    cells, warnings = group_cells(runs)
    rows = sorted({(env, eps) for env, eps, _ in cells}, key=lambda r: row_key(*r))
    n_expected = expected_seeds or max((c.n for cell in cells.values() for c in cell.configs), default=0)

    behavior: dict[tuple[str, float], list[float]] = defaultdict(list)
    files: dict[tuple[str, float], set] = defaultdict(set)  # the dataset files' fingerprints, where recorded
    for run in runs:
        if run.behavior_return is not None:
            behavior[(run.env_id, round(run.epsilon, 6))].append(run.behavior_return)
        if run.dataset_sha256:
            files[(run.env_id, round(run.epsilon, 6))].add(run.dataset_sha256)

    lines: list[str] = []
    summary = {a: {"rows": 0, "ranked": 0, "top2": 0, "ge_behavior": 0, "paper_top2": 0, "paper_ge_behavior": 0}
               for a in shown}
    header = ["Task-ε"] + [LABELS[a] for a in shown] + ["Behavior"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for env, eps in rows:
        means = {a: cells[(env, eps, a)].selected.stats[0] for a in ranks if (env, eps, a) in cells}
        # a row is ranked only when every ranked column has a result in it: top-2 among the columns that
        # happen to have finished (a partial grid) would bold whatever ran first
        ranked = rank and len(means) == len(ranks)
        best = top2(means) if ranked else set()
        beh_values = behavior.get((env, eps), [])
        beh = sum(beh_values) / len(beh_values) if beh_values else None
        paper_beh = paper.get((env, eps, "Behavior"), (None,))[0]
        paper_means = {a: paper[(env, eps, LABELS[a])][0] for a in shown if (env, eps, LABELS[a]) in paper}
        paper_best = {a for a in shown if paper.get((env, eps, LABELS[a]), (0, 0, False))[2]}
        cells_text = []
        for a in shown:
            cell = cells.get((env, eps, a))
            p = paper.get((env, eps, LABELS[a]))
            paper_txt = f" (paper {fmt_num(p[0])})" if p else ""
            if cell is None:
                cells_text.append(f"— n=0/{n_expected}{paper_txt}")
                continue
            m, s = cell.selected.stats
            n = cell.selected.n
            text = fmt_num(m) + (f" ± {fmt_num(s)}" if s is not None else "")
            if a in best:
                text = f"**{text}**"
            if n != n_expected:
                text += f" n={n}/{n_expected}"
            cells_text.append(text + paper_txt)
            summary[a]["rows"] += 1
            summary[a]["ranked"] += ranked and a in ranks
            summary[a]["top2"] += a in best
            # exactly, in the scores' 1e-4 units: a run that deploys beta ties it, whatever the rounding of two means
            if beh is not None and cell.selected.total * len(beh_values) >= sum(round(b * 10_000) for b in beh_values) * n:
                summary[a]["ge_behavior"] += 1
            summary[a]["paper_top2"] += ranked and a in paper_best
            if a in paper_means and paper_beh is not None and paper_means[a] >= paper_beh:
                summary[a]["paper_ge_behavior"] += 1
        if beh is None:
            beh_text = "—"
        else:
            beh_text = fmt_num(beh)
            if max(beh_values) - min(beh_values) > 1e-6 * max(1.0, abs(beh)):
                beh_text += " (varies)"
                warnings.append(f"behavior_return differs between result files of {env} eps={eps:g}")
        if len(files.get((env, eps), ())) > 1:  # e.g. collected again on a machine that rounds differently
            warnings.append(f"the runs of {env} eps={eps:g} were trained on {len(files[(env, eps)])} different dataset "
                            "files (dataset_sha256)")
        if paper_beh is not None:
            beh_text += f" (paper {fmt_num(paper_beh)})"
        lines.append(f"| {env}-{eps:.2f} | " + " | ".join(cells_text) + f" | {beh_text} |")

    # header ------------------------------------------------------------------------------------
    settings = defaultdict(set)
    n_files = sum(1 for r in runs if r.path.name == RESULT_FILE)
    for run in runs:
        for key in HEADER_SETTINGS:
            if key in run.args:
                settings[key].add(json.dumps(run.args[key]))
        if run.steps:  # runs merged from a runs.csv have no curve
            settings["evaluations per run"].add(str(len(run.steps)))
    seeds = sorted({r.seed for r in runs})
    now = datetime.datetime.now(datetime.timezone.utc)
    head = [
        "# Table 1 reproduction (Sohn et al., IJCAI 2020)",
        "",
        f"Generated {now:%Y-%m-%d %H:%M} UTC by `{command}` from `{' + '.join(map(str, roots))}`: {n_files} result files"
        + (f", {len(skipped)} invalid/unfinished skipped" if skipped else "")
        + (f", and {len(runs) - n_files} runs listed in the `--merge-runs` table(s)" if len(runs) > n_files else "")
        + ".",
        "",
        "Settings found in the result files: "
        + "".join(f"{k} = {', '.join(sorted(v, key=_num_sort))}; " for k, v in settings.items())
        + f"seeds = {', '.join(map(str, seeds)) or '—'} (expected {n_expected} per cell).",
    ]
    if invocations:
        head += ["", f"Runner invocations recorded in the results director{'ies' if len(roots) > 1 else 'y'}:"]
        head += [f"- `{c}`" for c in invocations]
    head += [
        "",
        "Each run's score is its `final_score` (mean of the last 10 evaluations, the paper's sliding window of 10; "
        "each evaluation averages its evaluation episodes). Cells: mean ± **sample** standard deviation "
        "(ddof=1) over seeds (the paper does not say which it used); no ± when only one seed. "
        + ("Bold: top-2 of the row among the paper's seven algorithms (ties included), in rows where all seven have "
           "a result. " if len(ranks) == len(PAPER_ALGORITHMS) else
           f"Only {', '.join(LABELS[a] for a in shown)} shown (`--algos`); "
           + (f"bold: top-2 of the row among {'them' if not ours else ', '.join(LABELS[a] for a in ranks)} (ties "
              "included), in rows where all of them have a result. " if rank else "no top-2 marks. "))
        + (f"{', '.join(LABELS[a] for a in ours)}: not in the paper (added here), so no paper value and not ranked. "
           if ours else "")
        + "`n=k/N`: only k of N seeds finished; "
        "`—`: no finished run. In parentheses: the paper's value. The paper's LunarLander-v2 rows are "
        "compared with our LunarLander-v3. Behavior: the dataset's `behavior_return`; since `collect_data.py` at "
        "`ccd9aaf`, the ε-greedy behaviour policy scored by the scripts' evaluator on the same start states with the "
        "exploration noise of a default run's last 10 evaluations (a run that deploys β ties it), before that with "
        "an independent draw of the noise.",
        "",
    ]
    missing_rows = sorted({(env, eps) for env, eps, _ in paper} - set(rows), key=lambda r: row_key(*r))
    body = head + lines
    if missing_rows:
        body += ["", "Paper rows without any result here: "
                 + ", ".join(f"{env}-{eps:.2f}" for env, eps in missing_rows) + "."]

    # selected configurations ------------------------------------------------------------------
    swept = [c for c in cells.values() if len(c.configs) > 1]
    if swept:
        body += ["", "## Selected hyperparameters", "",
                 "Several configurations were found for these cells; the table reports the one with the highest "
                 "mean final score (among the configurations with the most finished seeds), as the paper did. "
                 "Configurations with exactly that mean (often identical runs) are a tie, resolved by taking the one "
                 "naming the fewest flags in its directory name, then the first in name order, and marked "
                 "`(tie: k others)`.", "",
                 "| Task-ε | Algorithm | Selected | Mean | Configurations compared |", "|---|---|---|---|---|"]
        for c in sorted(swept, key=lambda c: (row_key(c.env_id, c.epsilon), ALGO_ORDER.index(c.algo))):
            others = "; ".join(f"{o.label}: {fmt_num(o.stats[0])} (n={o.n})"
                               for o in sorted(c.configs, key=lambda o: -o.stats[0]))
            tie = f" (tie: {c.ties} other{'s' * (c.ties > 1)})" if c.ties else ""
            body.append(f"| {c.env_id}-{c.epsilon:.2f} | {LABELS[c.algo]} | {c.selected.label}{tie} | "
                        f"{fmt_num(c.selected.stats[0])} | {len(c.configs)}: {others} |")

    # summary ----------------------------------------------------------------------------------
    body += ["", "## Summary", "",
             "How often each algorithm's mean is at or above the behaviour policy, over the rows it has results "
             "for (Rows), and how often it is among the top-2 of a row, over the rows where every ranked column has a "
             "result (Ranked); the paper's columns count the same rows with the paper's numbers"
             + ("" if len(ranks) == len(PAPER_ALGORITHMS) else "; the paper's top-2 is among all seven algorithms")
             + ("" if not ours else f"; {', '.join(LABELS[a] for a in ours)}: not in the paper, not ranked") + ".", "",
             "| Algorithm | Rows | ≥ Behavior | ≥ Behavior (paper) | Ranked | Top-2 | Top-2 (paper) |",
             "|---|---|---|---|---|---|---|"]
    for a in shown:
        s = summary[a]
        body.append(f"| {LABELS[a]} | {s['rows']} | {s['ge_behavior']} | "
                    + (f"{s['paper_ge_behavior']} | " if a in ranks else "— | ")
                    + (f"{s['ranked']} | {s['top2']} | {s['paper_top2']} |" if rank and a in ranks else "— | — | — |"))
    body += normalised_section(cells, rows, behavior, paper, shown, ranks)
    if warnings or skipped:
        body += ["", "## Warnings", ""]
        body += [f"- {w}" for w in warnings]
        body += [f"- skipped `{p}`: {r}" for p, r in skipped]
    return "\n".join(body) + "\n", {"cells": cells, "rows": rows, "behavior": behavior,
                                                 "summary": summary, "n_expected": n_expected, "algos": shown}


def normalisable_rows(rows, behavior) -> tuple[list, dict, list]:
    """The rows with a known U (UPPER) and a behaviour return below it, their behaviour returns, and the rows left
    out because β is already at or above U (no improvement to share: the score is not defined there)."""
    rows = [(env, eps) for env, eps in rows if env in UPPER and behavior.get((env, eps))]
    beh = {r: sum(behavior[r]) / len(behavior[r]) for r in rows}
    above = [r for r in rows if beh[r] >= UPPER[r[0]]]
    return [r for r in rows if r not in above], beh, above


def normalised(env: str, score: float, beh: float) -> float:
    return (score - beh) / (UPPER[env] - beh)


def mean_normalised(cells, rows, behavior, algo, among=None) -> float | None:
    """The mean over the algorithm's normalisable rows (those in among, if given) of its selected configuration's
    normalised mean score."""
    rows, beh, _ = normalisable_rows(rows, behavior)
    vals = [normalised(r[0], cells[(*r, algo)].selected.stats[0], beh[r]) for r in rows
            if (*r, algo) in cells and (among is None or r in among)]
    return sum(vals) / len(vals) if vals else None


def normalised_section(cells, rows, behavior, paper, shown, ranks) -> list[str]:
    """Per algorithm over its rows with a known U (UPPER) below the behaviour return: the mean normalised improvement
    of its cells' means (and of the paper's numbers on the same rows), and, with the rliable package, the
    interquartile mean of its runs' normalised scores with a 95% stratified-bootstrap interval and the probability
    that BRPO improves on it, on the rows both have (Agarwal et al. 2021)."""
    rows, beh, above = normalisable_rows(rows, behavior)
    if not rows:
        return []
    own = {a: [r for r in rows if (*r, a) in cells] for a in shown}
    scores = {}  # [runs, rows] (rliable's layout): each algorithm's runs, as many per row as its fewest
    for a, mine in own.items():
        n = min((cells[(*r, a)].selected.n for r in mine), default=0)
        if n >= 2:
            scores[a] = np.array([[normalised(r[0], run.final_score, beh[r]) for run in cells[(*r, a)].selected.runs[:n]]
                                  for r in mine]).T
    try:
        from rliable import library as rly, metrics
    except Exception:  # not installed, or its dependencies do not import (arch with pandas 3)
        rly = None
    iqm, poi = {}, {}
    if rly is not None and scores:
        iqm = {a: interval(rly, {a: s}, lambda x: np.array([metrics.aggregate_iqm(x)]))[a] for a, s in scores.items()}
        for a in [a for a in scores if a != "brpo"] if "brpo" in scores else []:
            both = [r for r in own["brpo"] if r in own[a]]  # the rows both have, as columns of each one's scores
            if both:
                pair = tuple(scores[x][:, [own[x].index(r) for r in both]] for x in ("brpo", a))
                poi[a] = interval(rly, {a: pair}, metrics.probability_of_improvement)[a]
    lines = ["", "## Normalised improvement", "",
             "The share of the available improvement over the behaviour policy an algorithm captures, (score − β) / "
             "(U − β), with U = " + ", ".join(f"{fmt_num(u)} ({e})" for e, u in UPPER.items()) + " and β the row's "
             "behaviour return (1: U reached, 0: β's return, below 0: worse than β), over the rows the algorithm has "
             "(Rows). Mean: of its cells' means; paper: the paper's numbers on the same rows, with its behaviour "
             "returns. "
             + (f"IQM: the interquartile mean of its runs' normalised scores (as many runs per row as its fewest), "
                f"[95% stratified-bootstrap interval, {BOOTSTRAP_REPS} resamples, seeded] (rliable); P(BRPO > X): the "
                "probability that a run of BRPO scores above a run of X on a random row of the rows both have, with "
                "its interval. " if rly is not None else
                "IQM and P(BRPO > X) need the rliable package (`pip install -e \".[bench]\"`). ")
             + "IQM needs at least 2 runs in every row of the algorithm."
             + (" Rows left out (behaviour return at or above U): " + ", ".join(f"{e}-{x:.2f}" for e, x in above) + "."
                if above else "")]
    lines += ["", "| Algorithm | Rows | Mean normalised improvement | Paper | IQM [95% CI] | P(BRPO > X) [95% CI] |",
              "|---|---|---|---|---|---|"]
    ci = lambda t: f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]" if t else "—"  # noqa: E731
    for a in shown:
        mean = [normalised(r[0], cells[(*r, a)].selected.stats[0], beh[r]) for r in own[a]]
        pap = [normalised(r[0], paper[(*r, LABELS[a])][0], paper[(*r, "Behavior")][0]) for r in own[a]
               if (*r, LABELS[a]) in paper and (*r, "Behavior") in paper and paper[(*r, "Behavior")][0] < UPPER[r[0]]]
        lines.append(f"| {LABELS[a]} | {len(mean)} | " + (f"{sum(mean) / len(mean):.2f} | " if mean else "— | ")
                     + (f"{sum(pap) / len(pap):.2f} | " if pap and a in ranks else "— | ")
                     + f"{ci(iqm.get(a))} | {ci(poi.get(a))} |")
    return lines


def selection_section(info: dict, fresh: dict | None, seeds: list[int]) -> str:
    """How much of each number is selection: the paper's protocol (best configuration per cell on the selection seeds)
    against the same configurations on the other seeds, per algorithm."""
    lines = ["", "## Selection and fresh seeds", "",
             f"The table above is the paper's protocol: in every cell, the configuration with the highest mean final "
             f"score on seeds {', '.join(map(str, seeds))} (listed under Selected hyperparameters), scored on those "
             "same seeds. Fresh seeds: the selected configurations on the other seeds (`fresh_seeds.md`; "
             "`selected.json` runs them: `python benchmark/run_grid.py --cells selected.json --seeds ...`). The gap "
             "between the two columns is what the selection adds."]
    if fresh is None:
        return "\n".join(lines + ["", "No run of a selected configuration on other seeds yet.", ""])
    lines += ["", "| Algorithm | Rows (selection / fresh) | ≥ Behavior | Top-2 | Mean normalised improvement, on the "
              "rows both have |", "|---|---|---|---|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    for a in info["algos"]:
        s, f = info["summary"][a], fresh["summary"].get(a)
        if f is None:
            continue
        top = f"{s['top2']} / {f['top2']}" if s["ranked"] or f["ranked"] else "—"
        both = {r for r in info["rows"] if (*r, a) in info["cells"] and (*r, a) in fresh["cells"]}
        lines.append(f"| {LABELS[a]} | {s['rows']} / {f['rows']} | {s['ge_behavior']} / {f['ge_behavior']} | {top} | "
                     f"{fmt(mean_normalised(info['cells'], info['rows'], info['behavior'], a, both))} / "
                     f"{fmt(mean_normalised(fresh['cells'], fresh['rows'], fresh['behavior'], a, both))} |")
    return "\n".join(lines + [""])


def selected_cells(info: dict, seeds: list[int]) -> str:
    """selected.json: the selected configuration of every cell laid out by run_grid.py, as run_grid.py --cells reads
    it (its hyperparameters are those of the run directory's name, <algo>__<flag>=<value>,...)."""
    out = []
    order = lambda kv: (row_key(*kv[0][:2]), ALGO_ORDER.index(kv[0][2]))  # noqa: E731
    for (env, eps, algo), cell in sorted(info["cells"].items(), key=order):
        name = cell.selected.group.rsplit("/", 1)[-1]
        if not cell.selected.group.startswith("dir:") or name.split("__")[0] != algo:
            continue  # not run_grid.py's layout: its flags cannot be told from the directory
        pairs = [kv.split("=", 1) for kv in name.split("__", 1)[1].split(",")] if "__" in name else []
        if any(len(p) != 2 for p in pairs):
            continue  # a directory named by hand, not <algo>__<flag>=<value>,...
        out.append({"env_id": env, "epsilon": eps, "algorithm": algo,
                    "hparams": {k: parse_value(v) for k, v in pairs}})
    return json.dumps({"description": f"configurations selected on seeds {', '.join(map(str, seeds))} by "
                                      "benchmark/aggregate.py --selection-seeds", "selection_seeds": seeds,
                       "cells": out}, indent=1) + "\n"


def interval(rly, score_dict: dict, func) -> dict:
    """rliable's point estimate and 95% interval per key, (estimate, low, high). rliable resamples with numpy's
    global generator (its random_state is not used for the resamples): seeded here, before every call, and restored,
    so a report is the same at every run and one algorithm's interval does not depend on which others are shown."""
    import warnings
    state = np.random.get_state()
    np.random.seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # arch's deprecation notices
            est, ci = rly.get_interval_estimates(score_dict, func, reps=BOOTSTRAP_REPS)
    finally:
        np.random.set_state(state)
    return {k: (float(np.ravel(est[k])[0]), *np.ravel(ci[k]).tolist()) for k in score_dict}


def _num_sort(text: str):
    try:
        return (0, float(json.loads(text)))
    except (ValueError, TypeError):
        return (1, text)


# --------------------------------------------------------------------------------------------
# learning curves
# --------------------------------------------------------------------------------------------
def curve(config: Config, smooth: int) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard error over seeds at the evaluation steps common to all seeds (of those with a curve:
    runs merged from a runs.csv have none)."""
    runs = [r for r in config.runs if r.steps]
    if not runs:
        return [], [], []
    common = set(runs[0].steps)
    for r in runs[1:]:
        common &= set(r.steps)
    steps = sorted(common)
    series = []
    for r in runs:
        by_step = dict(zip(r.steps, r.returns))
        ys = [by_step[s] for s in steps]
        if smooth > 1:  # trailing moving average, as the paper's sliding window
            ys = [sum(ys[max(0, i - smooth + 1):i + 1]) / (i + 1 - max(0, i - smooth + 1)) for i in range(len(ys))]
        series.append(ys)
    means, ses = [], []
    for i in range(len(steps)):
        m, s = mean_std([ys[i] for ys in series])
        means.append(m)
        ses.append(s / math.sqrt(len(series)) if s is not None else 0.0)
    return steps, means, ses


def plot_curves(info: dict, out_dir: Path, smooth: int) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, rows, behavior = info["cells"], info["rows"], info["behavior"]
    written = []
    colors = dict(zip(ALGO_ORDER, plt.get_cmap("tab10").colors))
    for env in sorted({env for env, _ in rows}, key=lambda e: row_key(e, 0)):
        epsilons = [eps for e, eps in rows if e == env]
        fig, axes = plt.subplots(1, len(epsilons), figsize=(4.2 * len(epsilons), 3.6), squeeze=False)
        for ax, eps in zip(axes[0], epsilons):
            for a in info["algos"]:
                cell = cells.get((env, eps, a))
                if cell is None:
                    continue
                steps, means, ses = curve(cell.selected, smooth)
                if not steps:
                    continue
                lab = f"{LABELS[a]} (n={cell.selected.n})"
                ax.plot(steps, means, color=colors[a], label=lab, lw=1.4)
                ax.fill_between(steps, [m - s for m, s in zip(means, ses)], [m + s for m, s in zip(means, ses)],
                                color=colors[a], alpha=0.2, lw=0)
            beh = behavior.get((env, eps))
            if beh:
                ax.axhline(sum(beh) / len(beh), color="black", ls="--", lw=1, label="Behavior")
            ax.set_title(f"{env}  ε={eps:g}")
            ax.set_xlabel("training updates")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("average return" + (f" (window {smooth})" if smooth > 1 else ""))
        handles, labels = {}, {}
        for ax in axes[0]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                labels.setdefault(lab.split(" (")[0], h)
        fig.legend(list(labels.values()), list(labels.keys()), loc="lower center", ncol=len(labels),
                   bbox_to_anchor=(0.5, -0.02), frameon=False)
        fig.suptitle(f"{env}: mean ± standard error over seeds")
        fig.tight_layout(rect=(0, 0.08, 1, 0.95))
        path = out_dir / f"curves_{env}.png"
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise AggregateError(f"cannot write {path} ({e.strerror or e}); pass a writable --out") from None


def read_invocations(root: Path) -> list[str]:
    commands = []
    for path in sorted(root.rglob("invocations.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                c = json.loads(line).get("command")
            except (json.JSONDecodeError, AttributeError, RecursionError):
                continue
            if c and c not in commands:
                commands.append(c)
    return commands


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except (AggregateError, OSError) as e:  # raised while reading the paper's table or writing the report
        if isinstance(e, OSError) and not too_long(e):
            raise
        print(f"aggregate.py: error: {too_long(e) or e}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None = None) -> int:
    p = Parser(prog="aggregate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("results_dirs", type=Path, nargs="+", metavar="RESULTS_DIR",
                   help="directory searched recursively for result.json; several (e.g. a sweep and its fresh seeds, "
                        "each written by run_grid.py) are read as one, a run found in two of them is an error")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: the first RESULTS_DIR/report); a report already there is "
                        "replaced, and the output says so")
    p.add_argument("--expected-seeds", type=int, default=None,
                   help="seeds expected per cell (default: the largest number found for any configuration)")
    p.add_argument("--paper-csv", type=Path, default=PAPER_CSV)
    p.add_argument("--smooth", type=int, default=1,
                   help="trailing moving-average window for the curves (the paper used 10)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--merge-runs", type=Path, action="append", default=[], metavar="RUNS_CSV",
                   help="also count the runs listed in this earlier runs.csv (repeatable); a result.json of the "
                        "same cell, configuration and seed replaces its row")
    p.add_argument("--selection-seeds", nargs="+", type=int, default=None, metavar="SEED",
                   help="the paper's protocol: select each cell's configuration on these seeds only (table1.md), "
                        "score the selected configurations on every other seed (fresh_seeds.md), and write "
                        "selected.json for run_grid.py --cells")
    p.add_argument("--algos", nargs="+", default=None, metavar="ALGO",
                   help=f"only these algorithms' columns ({' '.join(ALGO_ORDER)}; default: the paper's and any "
                        "other with results)")
    p.add_argument("--behavior-from", type=Path, default=None, metavar="DATASETS_DIR",
                   help="take each run's behaviour return from its dataset <env>_eps<e>.npz in this directory (e.g. "
                        "datasets) instead of from its result file")
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = p.parse_args(argv)
    try:
        roots = opts.results_dirs
        for i, root in enumerate(roots):
            for other in roots[:i]:  # the result files of one inside the other would count twice
                a, b = other.resolve(), root.resolve()
                if a == b or a in b.parents or b in a.parents:
                    raise AggregateError(f"results directories '{other}' and '{root}' overlap; pass each one once")
            try:
                is_dir = root.is_dir()
            except OSError as e:
                raise AggregateError(f"results directory '{root}' is invalid ({e.strerror})") from None
            if not is_dir:
                raise AggregateError(f"results directory '{root}' does not exist")
        if opts.expected_seeds is not None and opts.expected_seeds < 1:
            raise AggregateError("--expected-seeds must be >= 1")
        if opts.smooth < 1:
            raise AggregateError(f"--smooth must be >= 1 (1: no smoothing), got {opts.smooth}")
        unknown = sorted(set(opts.algos or ()) - set(ALGO_ORDER))
        if unknown:
            raise AggregateError(f"unknown algorithm(s) {' '.join(unknown)} in --algos; choose from {' '.join(ALGO_ORDER)}")
        if opts.paper_csv != PAPER_CSV and not opts.paper_csv.is_file():
            raise AggregateError(f"paper table '{opts.paper_csv}' not found")
        runs, skipped, where = [], [], {}
        for root in roots:
            found, bad = load_runs(root)
            for r in found:  # the same cell, configuration and seed in two directories: which counts is not ours to guess
                key = (r.env_id, round(r.epsilon, 6), r.algo, r.group, r.seed)
                other = where.setdefault(key, (root, r.path))
                if other[0] != root:
                    raise AggregateError(f"the same run is in two results directories ({other[1]} and {r.path}); "
                                         "pass directories with different seeds or configurations")
            runs, skipped = runs + found, skipped + bad
        root = " + ".join(map(str, roots))  # how the messages name the source
        for path in opts.merge_runs:
            runs = merge_runs(runs, load_runs_csv(path))
        if opts.algos:
            runs = [r for r in runs if r.algo in opts.algos]
        if opts.behavior_from is not None:
            behavior = {}
            for r in runs:
                key = (r.env_id, round(r.epsilon, 6))
                if key not in behavior:
                    behavior[key] = dataset_behavior_return(opts.behavior_from / f"{r.env_id}_eps{r.epsilon:g}.npz")
                r.behavior_return = behavior[key]
        if opts.selection_seeds and runs and not any(r.seed in opts.selection_seeds for r in runs):
            raise AggregateError(f"no result for the --selection-seeds {' '.join(map(str, opts.selection_seeds))} "
                                 f"under '{root}' (seeds found: {' '.join(map(str, sorted({r.seed for r in runs})))})")
        if not runs:
            raise AggregateError(f"no valid result.json under '{root}'"
                                 + (f" for --algos {' '.join(opts.algos)}" if opts.algos else "")
                                 + (f" ({len(skipped)} invalid/unfinished, e.g. {skipped[0][1]})" if skipped else ""))
    except AggregateError as e:
        print(f"aggregate.py: error: {e}", file=sys.stderr)
        return 2

    final = opts.out or roots[0] / "report"
    # the report is written to a scratch directory and moved into place at the end: an interrupted or failed
    # aggregation leaves the earlier report as it was
    out = Path(tempfile.mkdtemp(prefix="aggregate."))
    try:
        return write_report(opts, argv, roots, runs, skipped, out, final)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def write_report(opts, argv, roots: list[Path], runs, skipped, out: Path, final: Path) -> int:
    command = shlex.join(["python", "benchmark/aggregate.py", *argv])
    paper, invocations = load_paper(opts.paper_csv), list(dict.fromkeys(c for r in roots for c in read_invocations(r)))
    chosen = set(opts.selection_seeds or [r.seed for r in runs])
    text, info = build_report(roots, [r for r in runs if r.seed in chosen], skipped, opts.expected_seeds, paper,
                              invocations, command, opts.algos)
    infos = [info]
    if opts.selection_seeds:  # the paper's protocol, and the selected configurations on the other seeds
        picked = {key: cell.selected.group for key, cell in info["cells"].items()}
        fresh = [r for r in runs if r.seed not in chosen
                 and picked.get((r.env_id, round(r.epsilon, 6), r.algo)) == r.group]
        fresh_info = None
        if fresh:
            fresh_text, fresh_info = build_report(roots, fresh, [], None, paper, invocations, command, opts.algos)
            write_atomic(out / "fresh_seeds.md", fresh_text.replace(
                "# Table 1 reproduction", "# Table 1 reproduction: the selected configurations on fresh seeds", 1))
            infos.append(fresh_info)
        text = text.replace("\n## Summary", selection_section(info, fresh_info, sorted(chosen)) + "\n## Summary", 1)
        write_atomic(out / "selected.json", selected_cells(info, sorted(chosen)))
    write_atomic(out / "table1.md", text)
    buf = io.StringIO()
    fields = ["env_id", "epsilon", "algorithm", "config", "selected", "n", "mean", "std", "seeds"]
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    for cell in sorted(info["cells"].values(), key=lambda c: (row_key(c.env_id, c.epsilon), ALGO_ORDER.index(c.algo))):
        for c in cell.configs:
            m, s = c.stats
            w.writerow({"env_id": cell.env_id, "epsilon": fmt_value(cell.epsilon), "algorithm": LABELS[cell.algo],
                        "config": c.label, "selected": int(c is cell.selected), "n": c.n, "mean": f"{m:.4f}",
                        "std": "" if s is None else f"{s:.4f}", "seeds": " ".join(str(r.seed) for r in c.runs)})
    write_atomic(out / "configs.csv", buf.getvalue())
    # one row per run: the per-seed numbers behind the table, with each script's diagnostics (e.g. BRPO's
    # mean lambda, KL(pi || beta) and bound estimate)
    cells = [cell for i in infos for cell in i["cells"].values()]  # with --selection-seeds: the fresh seeds' too
    if opts.selection_seeds:  # other seeds of configurations not selected (an earlier selection's): kept
        rest = [r for r in runs
                if r.seed not in chosen and picked.get((r.env_id, round(r.epsilon, 6), r.algo)) != r.group]
        cells.extend(group_cells(rest)[0].values())
    extra_keys = sorted({k for cell in cells for c in cell.configs for r in c.runs for k in r.extra})
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["env_id", "epsilon", "algorithm", "config", "seed", "final_score",
                                        "behavior_return", "score_minus_behavior", "eval_se", *extra_keys])
    w.writeheader()
    for cell in sorted(cells, key=lambda c: (row_key(c.env_id, c.epsilon), ALGO_ORDER.index(c.algo))):
        for c in cell.configs:
            for r in c.runs:
                beh = r.behavior_return
                w.writerow({"env_id": cell.env_id, "epsilon": fmt_value(cell.epsilon), "algorithm": LABELS[cell.algo],
                            "config": run_label(c), "seed": r.seed, "final_score": f"{r.final_score:.4f}",
                            "behavior_return": "" if beh is None else f"{beh:.4f}",
                            "score_minus_behavior": "" if beh is None else f"{r.final_score - beh:.4f}",
                            "eval_se": "" if r.eval_se is None else f"{r.eval_se:.4f}",
                            **{k: f"{r.extra[k]:.6g}" if k in r.extra else "" for k in extra_keys}})
    write_atomic(out / "runs.csv", buf.getvalue())
    try:
        plots = [] if opts.no_plots else plot_curves(info, out, opts.smooth)
    except OSError as e:
        raise AggregateError(f"cannot write the learning curves to {out} ({e.strerror or e})") from None
    try:
        final.mkdir(parents=True, exist_ok=True)
        taken = [f.name for f in sorted(out.iterdir()) if (final / f.name).exists() and not (final / f.name).is_file()]
        if taken:  # checked before anything moves: the report is replaced whole or not at all
            raise AggregateError(f"cannot write the report to {final}: {taken} exist there and are not files; remove "
                                 "them or pass another --out")
        # a report is derived from its runs: an earlier one is replaced, and the last line says so; its learning
        # curves stay unless made again (a --no-plots report of merged runs has none to draw)
        earlier = (final / "table1.md").exists()
        gone = [name for name in ("fresh_seeds.md", "selected.json")  # an earlier selection's, not made again
                if (final / name).exists() and not (out / name).exists()]
        kept = sorted(f.name for f in final.glob("curves_*.png") if not (out / f.name).exists())
        for name in gone:
            (final / name).unlink(missing_ok=True)
        for f in sorted(out.iterdir()):
            shutil.move(str(f), final / f.name)
    except OSError as e:
        raise AggregateError(f"cannot write the report to {final} ({e.strerror or e}); pass a writable --out") from None
    print(text)
    print(f"wrote {final / 'table1.md'}, {final / 'configs.csv'}, {final / 'runs.csv'}"
          + "".join(f", {final / p.name}" for p in plots), file=sys.stderr)
    if earlier:
        notes = ([f"removed its {', '.join(gone)}"] if gone else []) + (
            [f"kept its {', '.join(kept)}, not made again"] if kept else [])
        print(f"replaced the report that was in {final}" + (f" ({'; '.join(notes)})" if notes else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped like interrupted
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("aggregate.py: interrupted; the report was not changed", file=sys.stderr)
        sys.exit(130)
