#!/usr/bin/env bash
# A rank killed in the middle of a run (MOE_FAULT_KILL) must end the whole
# job with a non-zero exit that names the rank, well within --comm-timeout,
# and leave the last checkpoint on disk loadable.
# Usage: fault_kill.sh BINDIR MPIEXEC [MPIEXEC FLAGS...]
set -u
bin=$1
shift
launcher=("$@")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_NUM_THREADS=1
passed=0 failed=0
check() { # name, condition status
    if [ "$2" -eq 0 ]; then echo "PASS: $1"; passed=$((passed + 1)); else echo "FAIL: $1"; failed=$((failed + 1)); fi
}

start=$(date +%s)
MOE_FAULT_KILL=1:3 timeout 120 "${launcher[@]}" -np 2 "$bin/moe-train" \
    --steps 6 --save-every 1 --eval-every 0 --comm-timeout 30 --out "$out/run" >"$out/log" 2>&1
rc=$?
elapsed=$(($(date +%s) - start))
check "the job exits non-zero (exit $rc)" "$([ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; echo $?)"
check "it ends within the timeout (${elapsed}s)" "$([ "$elapsed" -lt 60 ]; echo $?)"
check "the dead rank is named" "$(grep -q 'rank 1' "$out/log"; echo $?)"
check "the last checkpoint before the fault is complete" "$([ -f "$out/run/step-000002/model.safetensors" ]; echo $?)"
"$bin/moe-train" --eval-only --init-from "$out/run/step-000002" --eval-batches 2 >"$out/eval" 2>&1
check "the last checkpoint loads" "$(tail -n 1 "$out/eval" | grep -q '^val_loss [0-9]'; echo $?)"
if [ "$failed" -ne 0 ]; then
    echo "--- log of the killed run:"
    grep -v '^step' "$out/log" | tail -n 20
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
