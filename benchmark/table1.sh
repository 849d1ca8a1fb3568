#!/bin/bash
# Reproduce Table 1 of Sohn et al. (IJCAI 2020) with the paper's final hyperparameters (the scripts' defaults):
# 3 tasks x 5 epsilons x 8 algorithms (the paper's seven and CQL) x 5 seeds = 600 runs, evaluation every 1000
# updates over 40 episodes, trained as 24 processes (one per task and algorithm, its 25 runs as members;
# docs/benchmark.md). `--algos dqn brpo_c brpo bcq klq spibb bc` is the paper's 525-run grid.
# Missing datasets are created first (one collect_data.py call per task), then the runs, then the report
# (in $REPORT, by default $OUT/report; behaviour returns from the datasets in $BEHAVIOR_FROM, by default datasets/,
# as benchmark/table1_result's; BEHAVIOR_FROM= takes them from the result files).
# Resumable: run it again after an interruption or failure and only unfinished runs are (re)started.
#
#   bash benchmark/table1.sh                      # local, WORKERS=2 parallel processes
#   WORKERS=8 bash benchmark/table1.sh            # more processes (SEEDS="1 2 3", OUT=dir also work)
#   TOTAL_STEPS=200000 bash benchmark/table1.sh   # override the scripts' default number of updates
#   bash benchmark/table1.sh --dry-run            # print the commands only
#   bash benchmark/table1.sh --eval-sparse-frequency 5000   # sparse curves: every 5000 updates, the last 10 every 1000
#   bash benchmark/table1.sh --slurm              # write a Slurm job array instead (see docs/benchmark.md)
#   OUT=benchmark/results/sweep bash benchmark/table1.sh --grid benchmark/paper_sweep.json   # paper's sweep
#   REPORT=benchmark/table1_result bash benchmark/table1.sh --eval-sparse-frequency 5000   # the committed table
#
# Results: $OUT/<env>/eps<e>/<algo>/seed<k>/result.json, logs in $OUT/logs/; report: $REPORT/table1.md + curves_*.png
set -uo pipefail
cd "$(dirname "$0")/.."

WORKERS=${WORKERS:-2}
SEEDS=${SEEDS:-1 2 3 4 5}
OUT=${OUT:-benchmark/results/table1}
REPORT=${REPORT:-$OUT/report}
BEHAVIOR_FROM=${BEHAVIOR_FROM-datasets}

python benchmark/run_grid.py \
    --envs CartPole-v1 Acrobot-v1 LunarLander-v3 \
    --epsilons 0.05 0.15 0.25 0.5 1.0 \
    --algos dqn brpo_c brpo bcq klq spibb bc cql \
    --seeds $SEEDS \
    --eval-frequency 1000 --eval-episodes 40 \
    ${TOTAL_STEPS:+--total-steps "$TOTAL_STEPS"} \
    --workers "$WORKERS" --out "$OUT" "$@"
status=$?

case " $* " in *" --dry-run "* | *" --slurm "* | *" -h "* | *" --help "*) exit $status ;; esac
[ $status -eq 2 ] || [ $status -eq 130 ] && exit $status   # bad arguments / interrupted
python benchmark/aggregate.py "$OUT" --expected-seeds "$(wc -w <<< "$SEEDS")" ${BEHAVIOR_FROM:+--behavior-from "$BEHAVIOR_FROM"} \
    --out "$REPORT" >/dev/null && echo "report: $REPORT/table1.md"
exit $status
