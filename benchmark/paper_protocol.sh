#!/bin/bash
# Table 1 the paper's way: every algorithm's hyperparameter sweep (benchmark/paper_sweep.json, the ranges of the
# paper's two hyperparameter tables), the best configuration of each cell selected on seeds 1-5 as the paper did,
# then the selected configurations trained again on fresh seeds 6-10, so that the report shows how much of each
# number is selection (docs/benchmark.md, "The paper's protocol").
#
#   bash benchmark/paper_protocol.sh                                   # the whole sweep, WORKERS=2 processes
#   ENVS=CartPole-v1 ALGOS="brpo bcq" bash benchmark/paper_protocol.sh # a part of it
#   bash benchmark/paper_protocol.sh --eval-sparse-frequency 5000      # sparse curves (the final score is unchanged)
#   bash benchmark/paper_protocol.sh --dry-run                         # the sweep's commands only
#   bash benchmark/paper_protocol.sh --slurm      # only the sweep's job arrays; once they have run: the selection
#     (aggregate.py --selection-seeds) and the fresh seeds' arrays (run_grid.py --cells ... --slurm), docs/benchmark.md
#
# Resumable like table1.sh. Report: $OUT/report/table1.md (selection seeds, with the comparison to the fresh seeds),
# fresh_seeds.md, selected.json (the selected configuration of every cell), runs.csv, configs.csv, curves_*.png.
set -uo pipefail
cd "$(dirname "$0")/.."

WORKERS=${WORKERS:-2}
OUT=${OUT:-benchmark/results/paper_protocol}
SWEEP=${SWEEP:-benchmark/paper_sweep.json}
ENVS=${ENVS:-CartPole-v1 Acrobot-v1 LunarLander-v3}
EPSILONS=${EPSILONS:-0.05 0.15 0.25 0.5 1.0}
ALGOS=${ALGOS:-dqn brpo_c brpo bcq klq spibb bc cql}
SELECTION_SEEDS=${SELECTION_SEEDS:-1 2 3 4 5}
FRESH_SEEDS=${FRESH_SEEDS:-6 7 8 9 10}
common=(--eval-frequency 1000 --eval-episodes 40 ${TOTAL_STEPS:+--total-steps "$TOTAL_STEPS"} --workers "$WORKERS"
        --out "$OUT")

# 1) the sweep on the selection seeds
python benchmark/run_grid.py --envs $ENVS --epsilons $EPSILONS --algos $ALGOS --grid "$SWEEP" \
    --seeds $SELECTION_SEEDS "${common[@]}" "$@"
status=$?
case " $* " in *" --dry-run "* | *" --slurm "* | *" -h "* | *" --help "*) exit $status ;; esac
[ $status -eq 0 ] || exit $status   # the selection needs every configuration of the sweep
# 2) the selection, and the selected configurations on the fresh seeds
python benchmark/aggregate.py "$OUT" --selection-seeds $SELECTION_SEEDS --expected-seeds "$(wc -w <<< "$SELECTION_SEEDS")" \
    --out "$OUT/report" >/dev/null || exit
python benchmark/run_grid.py --cells "$OUT/report/selected.json" --seeds $FRESH_SEEDS "${common[@]}" "$@"
status=$?
[ $status -eq 2 ] || [ $status -eq 130 ] && exit $status
python benchmark/aggregate.py "$OUT" --selection-seeds $SELECTION_SEEDS --expected-seeds "$(wc -w <<< "$SELECTION_SEEDS")" \
    --out "$OUT/report" >/dev/null || exit $?
echo "report: $OUT/report/table1.md"
exit $status
