"""The README's headline table: every Table 1 cell as "our defaults / the paper's protocol (the paper's value)".

    python benchmark/headline_table.py benchmark/table1_result benchmark/paper_protocol_result

Reads each directory's configs.csv (the selected configuration of every cell, as aggregate.py wrote it; the protocol's
numbers are its selection seeds, the paper's own protocol), the behaviour returns from the first directory's runs.csv
and the paper's numbers from benchmark/paper_table1.csv; prints the Markdown table. "—": no result for that cell.
"""
import csv
import sys
from pathlib import Path

ALGORITHMS = ["DQN", "BRPO-C", "BRPO", "BCQ", "KL-Q", "SPIBB", "BC", "CQL"]  # aggregate.py's column labels
TASKS = [("CartPole-v1", "CartPole"), ("Acrobot-v1", "Acrobot"), ("LunarLander-v3", "LunarLander")]
EPSILONS = [0.05, 0.15, 0.25, 0.5, 1.0]
PAPER = Path(__file__).resolve().parent / "paper_table1.csv"


def selected_means(result_dir: Path) -> dict:
    with open(result_dir / "configs.csv", newline="") as f:
        return {(r["env_id"], float(r["epsilon"]), r["algorithm"]): float(r["mean"])
                for r in csv.DictReader(f) if r["selected"] == "1"}


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}".replace("-", "−")


def table(defaults_dir: Path, protocol_dir: Path) -> str:
    default, protocol = selected_means(defaults_dir), selected_means(protocol_dir)
    with open(PAPER, newline="") as f:  # the paper ran LunarLander-v2; ours is v3 (docs/benchmark.md)
        paper = {(r["env_id"].replace("LunarLander-v2", "LunarLander-v3"), float(r["epsilon"]), r["algorithm"]):
                 float(r["mean"]) for r in csv.DictReader(f)}
    with open(defaults_dir / "runs.csv", newline="") as f:
        behaviour = {(r["env_id"], float(r["epsilon"])): float(r["behavior_return"]) for r in csv.DictReader(f)}
    lines = ["| task, ε | " + " | ".join(ALGORITHMS) + " | behaviour |", "|---" * (len(ALGORITHMS) + 2) + "|"]
    for env, name in TASKS:
        for eps in EPSILONS:
            cells = [f"{fmt(default.get((env, eps, a)))} / {fmt(protocol.get((env, eps, a)))}"
                     + (f" ({fmt(paper[(env, eps, a)])})" if (env, eps, a) in paper else "") for a in ALGORITHMS]
            beh = fmt(behaviour.get((env, eps))) + (f" ({fmt(paper[(env, eps, 'Behavior')])})"
                                                     if (env, eps, "Behavior") in paper else "")
            lines.append(f"| {name} {eps:g} | " + " | ".join(cells) + f" | {beh} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3 or not all((Path(d) / f).is_file() for d in sys.argv[1:] for f in ("configs.csv", "runs.csv")):
        sys.exit("usage: python benchmark/headline_table.py DEFAULTS_DIR PROTOCOL_DIR (two aggregate.py output "
                 "directories with configs.csv and runs.csv, e.g. benchmark/table1_result benchmark/paper_protocol_result)")
    print(table(Path(sys.argv[1]), Path(sys.argv[2])))
