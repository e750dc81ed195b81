#!/usr/bin/env bash
# One call on the GPU machine that does a session's must-haves in order, for sessions whose
# device time is short and whose machine may not start twice: the GPU gate first (its record
# and log under $OUT), then, in the time left, FlashInfer's SM90 kernel beside msa
# (benchmarks/flashinfer_sm90.py, rows written to $OUT/rows as each is measured).
#
#   here:  bash benchmarks/carry_dsl.sh .dsl; bash benchmarks/engine_baselines/flashinfer_sm90.sh
#   there: bash benchmarks/device_call.sh          (run with carry [".dsl", ".baselines"])
#
# Environment: BUDGET (seconds the whole call may take, default 570: keep it under the call's
# limit), ROWS (flashinfer_sm90.py row set, default core), REPS (default 20), BACKENDS (msa
# backends beside `auto`, default none), Q_DTYPE (the query msa is given: bf16, the default, or
# fp8), GATE=0 to skip the gate.
set -uo pipefail
: "${OUT:?the device machine sets OUT}"
start=$SECONDS
budget=${BUDGET:-570}
source .dsl/setup.sh || { echo "no .dsl/setup.sh: run benchmarks/carry_dsl.sh here and carry .dsl"; exit 2; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ "${GATE:-1}" != 0 ]; then  # (bounded: a gate past the budget would take the rows' time, not the call)
    timeout -k 10 $((budget - 60)) make gpu-check GPU_CHECK_RECORD="$OUT/gpu-check.txt" > "$OUT/gate.log" 2>&1
    echo "gate rc=$? after $((SECONDS - start)) s (124: stopped at the budget)"
fi
left=$((budget - (SECONDS - start) - 5))
kernel=${MSA_FLASHINFER_SM90:-.baselines/flashinfer_sm90/sparse_decode_sm90.py}
if [ ! -f "$kernel" ]; then
    echo "no $kernel: run benchmarks/engine_baselines/flashinfer_sm90.sh here and carry .baselines"
elif [ "$left" -lt 60 ]; then
    echo "rows skipped: ${left} s left"
else
    timeout -k 10 "$left" python3 benchmarks/flashinfer_sm90.py --out "$OUT/rows" --rows "${ROWS:-core}" \
        --reps "${REPS:-20}" --backends "${BACKENDS-}" --q-dtype "${Q_DTYPE:-bf16}" > "$OUT/rows.log" 2>&1
    echo "rows rc=$? (124: stopped at the budget; the rows measured are in rows/flashinfer_sm90.json)"
    grep -v -i warn "$OUT/rows.log" | grep -v '^{' | tail -20
fi
if [ -f "$OUT/gpu-check.txt" ]; then sed -n 2,3p "$OUT/gpu-check.txt"; fi
exit 0
