#!/usr/bin/env bash
# Nsight Compute profiles of the cute kernel at the missed targets, on the GPU machine:
#
#   here:  bash benchmarks/carry_dsl.sh .dsl            (then run there with carry [".dsl"])
#   there: bash benchmarks/profile_misses.sh
#
# Each profile (benchmarks/profile_cute.py: one launch of the default shape, at the profiler's
# clocks; ncu's default `--cache-control all` empties the caches before each of its passes) reads the metrics of benchmarks/ncu_metrics.txt into $OUT/ncu-NAME.txt;
# the last lines are a table of each one's duration, DRAM share, issue and warp activity and its
# three largest stall reasons.
set -uo pipefail
: "${OUT:?the device machine sets OUT}"
source .dsl/setup.sh || { echo "no .dsl/setup.sh: run benchmarks/carry_dsl.sh here and carry .dsl"; exit 2; }
metrics=$(paste -sd, benchmarks/ncu_metrics.txt)
profile() {
    local name=$1; shift
    timeout 150 ncu --profile-from-start off --metrics "$metrics" python3 benchmarks/profile_cute.py "$@" \
        > "$OUT/ncu-$name.txt" 2>&1
    echo "$name: rc=$?"
}
profile fp8-tp1-b1 --tp 1 --batch 1
profile fp8-tp8-b16 --tp 8 --batch 16
profile fp8-tp4-b16 --tp 4 --batch 16
profile fp8-tp8-l4-80-b16 --tp 8 --batch 16 --query-len 4 --overlap 0.8
profile nvfp4-tp1-b64 --tp 1 --batch 64 --layout nvfp4
profile nvfp4-tp8-b16 --tp 8 --batch 16 --layout nvfp4
python3 benchmarks/ncu_summary.py "$OUT"/ncu-*.txt
