#!/usr/bin/env bash
# moe-train on a grid of ranks (expert-parallel, data-parallel, ZeRO-1)
# follows the loss curve of one rank reading the same global batches, and a
# checkpoint written on the grid resumes on one rank on the same curve.
# Tolerance: 1e-5 relative per step, as float summation order allows.
# Usage: train_grid.sh BINDIR MPIEXEC [MPIEXEC FLAGS...]
set -u
bin=$1
shift
launcher=("$@")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_NUM_THREADS=1
common=(--steps 12 --eval-every 6 --eval-batches 2 --seq-len 32)
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

# The per-step losses of a run's metrics.jsonl, one per line (evaluation
# lines carry val_loss, not loss).
losses() { grep -o '"loss":[^,]*' "$1/metrics.jsonl" | cut -d: -f2; }
same_curve() { # name, file of losses A, file of losses B
    paste "$2" "$3" | awk 'BEGIN { bad = 0; n = 0 }
        { n++; d = $1 - $2; if (d < 0) d = -d; s = $2 < 0 ? -$2 : $2; if (d > 1e-5 * s) { bad = 1; print "  step " n ": " $1 " vs " $2 } }
        END { exit bad || n == 0 }'
    check "$1" "$?"
}

"$bin/moe-train" "${common[@]}" --batch-size 8 --save-every 6 --out "$out/one" >"$out/one.log" 2>&1 ||
    { echo "FAIL: one rank did not run"; tail "$out/one.log"; exit 1; }
"${launcher[@]}" -np 2 "$bin/moe-train" "${common[@]}" --batch-size 4 --ep 2 --zero 1 --save-every 6 \
    --out "$out/grid" >"$out/grid.log" 2>&1 || { echo "FAIL: 2 ranks did not run"; tail "$out/grid.log"; exit 1; }
same_curve "2 ranks, --ep 2 --zero 1, against 1 rank" <(losses "$out/grid") <(losses "$out/one")

"$bin/moe-train" "${common[@]}" --batch-size 8 --resume "$out/grid/step-000006" --out "$out/resumed" \
    >"$out/resumed.log" 2>&1 || { echo "FAIL: the resume did not run"; tail "$out/resumed.log"; exit 1; }
# The resumed run logs steps 7..12.
same_curve "a 2-rank checkpoint resumed on 1 rank" <(losses "$out/resumed") <(losses "$out/one" | tail -n +7)

summary
