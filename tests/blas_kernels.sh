#!/usr/bin/env bash
# The OpenBLAS kernels moe-train runs, named on its device line: never
# OpenBLAS's Prescott fallback (SSE3) on a CPU with AVX unless asked for,
# as OpenBLAS falls back on a CPU model newer than itself, where moe sets
# OPENBLAS_CORETYPE and runs again; and OPENBLAS_CORETYPE as the user set
# it, Prescott included.
# Usage: blas_kernels.sh BINDIR (holding moe-train)
set -u
bin=$1
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

tiny_config "$out/tiny.json"
run=("$bin/moe-train" --config "$out/tiny.json" --steps 1 --batch-size 2 --seq-len 16 --eval-every 0 --eval-batches 1
    --device cpu --threads 1)
env -u OPENBLAS_CORETYPE -u MOE_OPENBLAS_FALLBACK "${run[@]}" --out "$out/own" >"$out/own.log" 2>&1
rc=$?
check "a run exits 0 (exit $rc)" "$rc"
kernels=$(grep '^device ' "$out/own.log" | grep -o 'OpenBLAS [A-Za-z0-9]* kernels[^,]*')
check "the device line names the kernels ($kernels)" "$([ -n "$kernels" ]; echo $?)"
if grep -qw avx /proc/cpuinfo; then
    check "on a CPU with AVX they are not Prescott's" "$(echo "$kernels" | grep -qv '^OpenBLAS Prescott'; echo $?)"
else
    echo "SKIP: this CPU has no AVX, whose kernels would replace Prescott's"
fi
# Run by the dynamic loader named on the command line, the program is not
# /proc/self/exe: it runs on, as it is.
loader=$(readelf -l "$bin/moe-train" 2>/dev/null | sed -n 's/.*interpreter: \(.*\)]$/\1/p')
if [ -n "$loader" ]; then
    env -u OPENBLAS_CORETYPE -u MOE_OPENBLAS_FALLBACK "$loader" "${run[@]}" --out "$out/loader" >"$out/loader.log" 2>&1
    rc=$?
    check "run by its loader ($loader), a run exits 0 (exit $rc: $(grep -o 'OpenBLAS [A-Za-z0-9]* kernels[^,]*' "$out/loader.log"))" "$rc"
    check "and it is not run again" "$(grep '^device ' "$out/loader.log" | grep -q 'OpenBLAS [A-Za-z0-9]* kernels, GEMM'; echo $?)"
else
    echo "SKIP: no interpreter named in moe-train (readelf missing, or a static program)"
fi
# Run again or not, the process keeps its name (pkill moe-train finds it).
env -u OPENBLAS_CORETYPE -u MOE_OPENBLAS_FALLBACK "$bin/moe-train" --config "$out/tiny.json" --steps 1000000 \
    --batch-size 2 --seq-len 16 --eval-every 0 --eval-batches 1 --device cpu --threads 1 --out "$out/name" \
    >"$out/name.log" 2>&1 &
pid=$!
logged "$out/name/metrics.jsonl"
name=$(cat "/proc/$pid/comm" 2>/dev/null)
kill "$pid"
wait "$pid" 2>/dev/null
check "the process is named moe-train ($name)" "$([ "$name" = moe-train ]; echo $?)"
OPENBLAS_CORETYPE=Prescott env -u MOE_OPENBLAS_FALLBACK "${run[@]}" --out "$out/asked" >"$out/asked.log" 2>&1
rc=$?
check "a run with OPENBLAS_CORETYPE=Prescott exits 0 (exit $rc)" "$rc"
check "it runs the kernels asked for, saying nothing of a fallback ($(grep -o 'OpenBLAS .*' "$out/asked.log"))" \
    "$(grep '^device ' "$out/asked.log" | grep -q 'OpenBLAS Prescott kernels, GEMM'; echo $?)"
summary
