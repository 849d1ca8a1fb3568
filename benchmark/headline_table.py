#!/usr/bin/env python
"""The README's headline table: every Table 1 cell as "our defaults / the paper's protocol (the paper's value)".

    python benchmark/headline_table.py benchmark/table1_result benchmark/paper_protocol_result

Reads each directory's configs.csv (the selected configuration of every cell and its seeds, as aggregate.py wrote
them; the protocol's numbers are its selection seeds, the paper's own protocol), averages those runs' final scores
from its runs.csv as aggregate.py does (configs.csv's mean has 4 decimals: rounded again to 1, 64.14998 would print
64.2 where table1.md prints 64.1), takes the behaviour returns from both directories' runs.csv (they must agree: the
same datasets) and the paper's numbers from benchmark/paper_table1.csv; prints the Markdown table.
"—": no result for that cell.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aggregate import LABELS, PAPER_CSV, AggregateError, load_paper, read_table  # noqa: E402
from run_grid import ENVS, PAPER_EPSILONS, Parser, too_long  # noqa: E402

SHORT = {"CartPole-v1": "CartPole", "Acrobot-v1": "Acrobot", "LunarLander-v3": "LunarLander"}


def number(row: dict, column: str, path: Path) -> float:
    try:
        x = float(row[column])
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise AggregateError(f"'{path}': bad {column} {row[column]!r} in {row}; regenerate it with benchmark/aggregate.py")
    return x


def selected_means(result_dir: Path) -> dict:
    path, runs_path = result_dir / "configs.csv", result_dir / "runs.csv"
    selected = {}
    for r in read_table(path, ("env_id", "epsilon", "algorithm", "config", "selected", "mean", "seeds"), f"'{path}'",
                        "a configs.csv"):
        if r["selected"] == "1":
            key = (r["env_id"], round(number(r, "epsilon", path), 6), r["algorithm"])
            if key in selected:  # aggregate.py selects one configuration per cell
                raise AggregateError(f"'{path}': two selected configurations for {key[2]} on {key[0]} eps {key[1]:g}; "
                                     "regenerate it with benchmark/aggregate.py")
            selected[key] = (r["config"], set(r["seeds"].split()), number(r, "mean", path))
    scores = {key: [] for key in selected}
    for r in read_table(runs_path, ("env_id", "epsilon", "algorithm", "config", "seed", "final_score"),
                        f"'{runs_path}'", "a runs.csv"):
        key = (r["env_id"], round(number(r, "epsilon", runs_path), 6), r["algorithm"])
        if key in selected and r["config"] == selected[key][0] and r["seed"] in selected[key][1]:
            scores[key].append(number(r, "final_score", runs_path))
    means = {}
    for key, (config, seeds, listed) in selected.items():
        m = sum(scores[key]) / len(scores[key]) if len(scores[key]) == len(seeds) else math.nan
        if not abs(m - listed) <= 5e-5:  # configs.csv's 4 decimals
            raise AggregateError(f"'{result_dir}': the runs of {key[2]} ({config}) on {key[0]} eps {key[1]:g} in runs.csv "
                                 f"do not give configs.csv's mean {listed:g} over seeds {' '.join(sorted(seeds))}; "
                                 "regenerate both with benchmark/aggregate.py")
        means[key] = m
    return means


def behaviour_returns(result_dir: Path) -> dict:
    path = result_dir / "runs.csv"
    return {(r["env_id"], round(number(r, "epsilon", path), 6)): number(r, "behavior_return", path)
            for r in read_table(path, ("env_id", "epsilon", "behavior_return"), f"'{path}'", "a runs.csv")
            if r["behavior_return"]}


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}".replace("-", "−")


def table(defaults_dir: Path, protocol_dir: Path) -> str:
    default, protocol, paper = selected_means(defaults_dir), selected_means(protocol_dir), load_paper(PAPER_CSV)
    behaviour, other = behaviour_returns(defaults_dir), behaviour_returns(protocol_dir)
    differ = [k for k in behaviour.keys() & other.keys() if abs(behaviour[k] - other[k]) > 1e-6]
    if differ:  # the two tables would compare runs on different datasets
        raise AggregateError(f"the two directories' behaviour returns differ on {sorted(differ)}: their runs used "
                             "different datasets; aggregate runs on the same datasets")
    labels = list(LABELS.values())
    lines = ["| task, ε | " + " | ".join(labels) + " | behaviour |", "|---" * (len(labels) + 2) + "|"]
    for env in ENVS:
        for eps in PAPER_EPSILONS:
            cells = []
            for a in labels:
                key = (env, eps, a)
                cells.append(f"{fmt(default.get(key))} / {fmt(protocol.get(key))}"
                             + (f" ({fmt(paper[key][0])})" if key in paper else ""))
            beh = fmt(behaviour.get((env, eps))) + (f" ({fmt(paper[(env, eps, 'Behavior')][0])})"
                                                     if (env, eps, "Behavior") in paper else "")
            lines.append(f"| {SHORT[env]} {eps:g} | " + " | ".join(cells) + f" | {beh} |")
    return "\n".join(lines)


if __name__ == "__main__":
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("defaults_dir", type=Path, help="aggregate.py's output for the defaults (benchmark/table1_result)")
    p.add_argument("protocol_dir", type=Path,
                   help="aggregate.py's output for the paper's protocol (benchmark/paper_protocol_result)")
    opts = p.parse_args()
    try:
        print(table(opts.defaults_dir, opts.protocol_dir))
    except (AggregateError, OSError) as e:
        if isinstance(e, OSError) and not too_long(e):
            raise
        sys.exit(f"headline_table.py: error: {too_long(e) or e}")
