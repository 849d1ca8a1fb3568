#!/bin/bash
# Quick preset of the Table 1 benchmark: the full grid of tasks, epsilons and algorithms, but only
# 20,000 updates per run and 2 seeds (210 runs), with the paper's evaluation settings (every 1000
# updates, 40 episodes; final score = mean of the last 10 evaluations).
# Its 21 processes train 10 runs each as members (docs/benchmark.md).
# Numbers are NOT comparable to the paper's (fewer updates, fewer seeds); use table1.sh for that.
#
#   bash benchmark/quick.sh              # WORKERS=2, results in benchmark/results/quick
#   bash benchmark/quick.sh --dry-run    # print the commands only
set -uo pipefail
cd "$(dirname "$0")/.."

WORKERS=${WORKERS:-2}
SEEDS=${SEEDS:-1 2}
OUT=${OUT:-benchmark/results/quick}
TOTAL_STEPS=${TOTAL_STEPS:-20000}

python benchmark/run_grid.py \
    --envs CartPole-v1 Acrobot-v1 LunarLander-v3 \
    --epsilons 0.05 0.15 0.25 0.5 1.0 \
    --algos dqn brpo_c brpo bcq klq spibb bc \
    --seeds $SEEDS \
    --total-steps "$TOTAL_STEPS" --eval-frequency 1000 --eval-episodes 40 \
    --workers "$WORKERS" --out "$OUT" "$@"
status=$?

case " $* " in *" --dry-run "* | *" --slurm "* | *" -h "* | *" --help "*) exit $status ;; esac
[ $status -eq 2 ] || [ $status -eq 130 ] && exit $status   # bad arguments / interrupted
python benchmark/aggregate.py "$OUT" --expected-seeds "$(wc -w <<< "$SEEDS")" >/dev/null && echo "report: $OUT/report/table1.md"
exit $status
