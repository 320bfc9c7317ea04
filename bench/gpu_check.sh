#!/usr/bin/env bash
# gpu_check.sh: the GPU check of moe: every CUDA test, `moe-bench gemm`,
# `moe-bench gate` (the fused gating pass against a copy),
# `moe-bench layer`, a short `moe-train --device cuda` (then `moe-generate`
# on its checkpoint, on the GPU and on the CPU) and the MFU of a
# 1.2B-parameter model's training steps on a machine with an NVIDIA GPU,
# ending with one summary table (tests passed/failed/skipped, TFLOP/s and
# ratios, MFU). Under 8 minutes.
#
#   bench/gpu_check.sh pack   on the build machine (Debian, CUDA toolkit and
#                             the project's dependencies): builds build-gpu/
#                             and packs the GPU binaries with the shared
#                             libraries they need into
#                             build-gpu-carry/moe-gpu.tar.gz
#   bench/gpu_check.sh run    on the GPU machine, from the repository root,
#                             with build-gpu-carry/ beside it: unpacks, runs,
#                             summarises
#   bench/gpu_check.sh all    both, on one machine that has a GPU and every
#                             dependency
#
# Why two steps: the GPU machine this project borrows (Ubuntu, nvcc, cmake,
# ninja, the CUDA libraries as Python packages) has no OpenBLAS and no
# Criterion, and the GPU tests need both: the CPU backend is their reference.
# So the binaries are built where those libraries are, and travel with every
# shared library they load except glibc's and CUDA's own (cudart, cuBLAS,
# cuBLASLt, NCCL), which `run` finds on the GPU machine at run time (python3's
# site-packages nvidia/*/lib, then the CUDA toolkit's lib64), so that they
# match its driver. A Debian 12 build (glibc 2.36) runs on a newer Ubuntu
# glibc. MPI and hwloc are off in this build: one GPU, one rank.
#
# With the project's device tool: `bench/gpu_check.sh pack` here, then
#   run(command="bash bench/gpu_check.sh run", carry=["build-gpu-carry"], timeout_s=540)
# Logs and JSON go to $OUT when it is set (else build-gpu-carry/results).
#
# Environment:
#   MOE_GPU_ARCHS   CUDA architectures to build for (default "80;90a": 90a carries the wgmma kernel)
#   MOE_GPU_BUILD   build directory of `pack` (default build-gpu)
#   MOE_GPU_T       tokens for moe-bench gemm (default: its own, 4096)
#   MOE_GPU_BUDGET  seconds for the whole run (default 480): each step's
#                   timeout is cut to what is left, less the summary's time
#
# At most 8 files go to the results folder (the device tool returns no more).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${MOE_GPU_BUILD:-$ROOT/build-gpu}
CARRY=$ROOT/build-gpu-carry
TARBALL=$CARRY/moe-gpu.tar.gz
BINARIES=(test_cuda_ops test_comm_nccl moe-bench moe-train moe-generate)
START=$(date +%s)
BUDGET=${MOE_GPU_BUDGET:-480}

die() {
    echo "gpu_check: $*" >&2
    exit 2
}

# A step's timeout: its own limit, or what the budget has left after 20 s
# kept for the summary, whichever is less (at least 5 s).
limit() {
    local left=$((START + BUDGET - 20 - $(date +%s)))
    [ "$left" -lt 5 ] && left=5
    echo $(("$1" < left ? "$1" : left))
}

# Shared libraries the binaries must not carry: glibc's, the loader's, and
# CUDA's, which come from the GPU machine.
is_system_lib() {
    case "$(basename "$1")" in
    linux-vdso* | ld-linux* | libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | \
        libcuda.so* | libcudart.so* | libcublas.so* | libcublasLt.so* | libnccl.so* | libnvidia*) return 0 ;;
    esac
    return 1
}

pack() {
    command -v cmake >/dev/null || die "cmake not found"
    local gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    cmake -S "$ROOT" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON \
        -DMOE_MPI=OFF -DMOE_HWLOC=OFF "-DCMAKE_CUDA_ARCHITECTURES=${MOE_GPU_ARCHS:-80;90a}" ||
        die "configure failed"
    cmake --build "$BUILD" -j "$(nproc)" --target "${BINARIES[@]}" || die "build failed"

    local stage
    stage=$(mktemp -d)
    mkdir -p "$stage/moe-gpu/bin" "$stage/moe-gpu/lib"
    for b in "${BINARIES[@]}"; do
        cp "$BUILD/$b" "$stage/moe-gpu/bin/" || die "missing $BUILD/$b"
        # Every library ldd resolves, minus the system's and CUDA's.
        ldd "$BUILD/$b" | awk '/=> \//{print $3}' | while read -r lib; do
            is_system_lib "$lib" || cp -L -n "$lib" "$stage/moe-gpu/lib/"
        done
    done
    mkdir -p "$CARRY"
    tar -C "$stage" -czf "$TARBALL" moe-gpu || die "tar failed"
    rm -rf "$stage"
    echo "gpu_check: packed $(du -h "$TARBALL" | cut -f1) into $TARBALL:"
    tar -tzf "$TARBALL" | grep -v '/$' | sed 's|^moe-gpu/|  |'
}

# Prints the directories holding CUDA's runtime, cuBLAS and NCCL libraries,
# one per line: python3's nvidia packages first, then the toolkit's.
cuda_lib_dirs() {
    local roots=()
    if command -v python3 >/dev/null; then
        while IFS= read -r sp; do
            [ -d "$sp/nvidia" ] && roots+=("$sp/nvidia")
        done < <(python3 -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null)
    fi
    roots+=("${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
    local lib dir
    for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
        for r in "${roots[@]}"; do
            [ -d "$r" ] || continue
            dir=$(find -L "$r" -maxdepth 4 -name "$lib*" -print -quit 2>/dev/null)
            if [ -n "$dir" ]; then
                dirname "$dir"
                break
            fi
        done
    done | awk '!seen[$0]++'
}

run() {
    local dir
    if [ -f "$TARBALL" ]; then
        dir=$(mktemp -d)/moe-gpu
        tar -C "$(dirname "$dir")" -xzf "$TARBALL" || die "cannot unpack $TARBALL"
        # A library this machine already has (by soname) is taken from the
        # machine: it is newer and matches the machine's other libraries.
        local have kept=()
        have=$(ldconfig -p 2>/dev/null | awk 'NR > 1 {print $1}')
        for f in "$dir"/lib/*; do
            if grep -qxF "$(basename "$f")" <<<"$have"; then
                rm -f "$f"
            else
                kept+=("$(basename "$f")")
            fi
        done
        echo "gpu_check: carried libraries in use: ${kept[*]:-(none)}"
        export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        dir=$dir/bin
    elif [ -x "$BUILD/test_cuda_ops" ]; then
        dir=$BUILD
    else
        die "no $TARBALL and no $BUILD/test_cuda_ops: run 'bench/gpu_check.sh pack' on the build machine first"
    fi
    local cuda_dirs
    cuda_dirs=$(cuda_lib_dirs | paste -sd: -)
    [ -n "$cuda_dirs" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$cuda_dirs"

    local results=${OUT:-$CARRY/results}
    mkdir -p "$results"
    echo "gpu_check: binaries from $dir"
    echo "gpu_check: CUDA libraries from ${cuda_dirs:-(none found)}"
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    local missing
    missing=$(for b in "${BINARIES[@]}"; do ldd "$dir/$b" | grep "not found"; done | sort -u)
    [ -z "$missing" ] || die "shared libraries not found:"$'\n'"$missing"

    # Eight files: the tests' log (both suites, each after its "== NAME"
    # line), five JSON files, the training log and every benchmark's
    # messages in bench.err.
    : >"$results/bench.err"

    # 1. The CUDA tests, verbose so that every skip says why.
    echo "== test_cuda_ops" | tee "$results/tests.log"
    timeout -k 5 "$(limit 240)" "$dir/test_cuda_ops" --verbose -j4 2>&1 | tee -a "$results/tests.log"
    local test_rc=${PIPESTATUS[0]}
    echo "== test_comm_nccl" | tee -a "$results/tests.log"
    timeout -k 5 "$(limit 90)" "$dir/test_comm_nccl" --verbose -j1 2>&1 | tee -a "$results/tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || test_rc=1

    # bench_step NAME SECONDS OUTPUT ARGS...: one moe-bench run, its JSON
    # appended to OUTPUT and its messages to bench.err and the screen.
    bench_step() {
        local name=$1 seconds=$2 output=$3
        shift 3
        echo "== moe-bench $name $*" | tee -a "$results/bench.err"
        timeout -k 5 "$(limit "$seconds")" "$dir/moe-bench" "$name" --device cuda --json "$@" \
            >>"$output" 2> >(tee -a "$results/bench.err" >&2)
    }

    # 2. Grouped GEMMs on the GPU.
    local t_args=()
    [ -n "${MOE_GPU_T:-}" ] && t_args=(--T "$MOE_GPU_T")
    #    Hopper's kernels run in a step of their own (with the dense GEMM for
    #    their ratio), so that one that hangs or faults on its first device
    #    costs its own step only.
    : >"$results/gemm.jsonl"
    bench_step gemm 150 "$results/gemm.jsonl" "${t_args[@]}" --algos mma,cublaslt-loop,cublas-grouped,dense
    local gemm_rc=$?
    bench_step gemm 90 "$results/gemm.jsonl" "${t_args[@]}" --algos wgmma,wgmma-tma,dense || gemm_rc=1

    # 3. The fused gating pass against a copy (at 65536 tokens, the size its
    #    target is set for, and at 16x that, past the L2 cache), then the MoE
    #    layer against the same GPU's fp32 GEMM.
    : >"$results/gate.jsonl"
    bench_step gate 45 "$results/gate.jsonl" --T 65536
    local gate_rc=$?
    bench_step gate 45 "$results/gate.jsonl" --T 1048576 || gate_rc=1
    : >"$results/layer.jsonl"
    bench_step layer 120 "$results/layer.jsonl"
    local layer_rc=$?
    [ "$gate_rc" = 0 ] || layer_rc=1
    # The 1b model's attention in bf16 math, and the same width at Mixtral's
    # head size of 128: the fused kernels against the batched cuBLAS path,
    # in alternation.
    : >"$results/attention.jsonl"
    bench_step attention 60 "$results/attention.jsonl" --gemm-math bf16 || layer_rc=1
    bench_step attention 60 "$results/attention.jsonl" --gemm-math bf16 --heads 8 --kv-heads 8 \
        --head-dim 128 || layer_rc=1

    # 4. Training on the GPU: the built-in run, short (its checkpoints
    #    outside the results), then steps of a 1.2B-parameter model for MFU.
    echo "== moe-train --device cuda"
    local train_out
    train_out="$(mktemp -d)/train"
    timeout -k 5 "$(limit 120)" "$dir/moe-train" --device cuda --steps 500 --eval-every 250 \
        --out "$train_out" 2>&1 | tee "$results/train.log" | grep -E "greedy answers|^val_loss"
    local train_rc=${PIPESTATUS[0]}
    # Greedy continuations of its checkpoint on the GPU and on the CPU (into
    # train.log: the results folder holds 8 files).
    echo "== moe-generate, cuda then cpu"
    local dev
    for dev in cuda cpu; do
        timeout -k 5 "$(limit 30)" "$dir/moe-generate" --device "$dev" --init-from "$train_out/step-000500" \
            --prompt '<arithmetic>3+4=' --max-new-tokens 24 >"$train_out.generate" 2>&1 || train_rc=1
        tail -n 1 "$train_out.generate" | sed "s/^/generate $dev: /" | tee -a "$results/train.log"
    done
    # Recomputation on the GPU: 20 steps with and without --recompute, whose
    #    losses the CPU tests hold to the same bits (into train.log).
    echo "== moe-train --device cuda --recompute"
    timeout -k 5 "$(limit 30)" "$dir/moe-train" --device cuda --steps 20 --out "$train_out.kept" \
        >/dev/null 2>&1 || train_rc=1
    timeout -k 5 "$(limit 30)" "$dir/moe-train" --device cuda --steps 20 --recompute --out "$train_out.recomputed" \
        >/dev/null 2>&1 || train_rc=1
    if [ -s "$train_out.kept/metrics.jsonl" ] && cmp -s <(grep -o '"loss":[^,]*' "$train_out.kept/metrics.jsonl") \
        <(grep -o '"loss":[^,]*' "$train_out.recomputed/metrics.jsonl"); then
        echo "recompute cuda: the 20 losses of the run without, bit for bit" | tee -a "$results/train.log"
    else
        echo "recompute cuda: losses differ from the run without" | tee -a "$results/train.log"
        train_rc=1
    fi
    : >"$results/train.jsonl"
    local math
    for math in fp32 bf16; do
        bench_step train 120 "$results/train.jsonl" --model 1b --gemm-math "$math" --warmup 1 --steps 3 ||
            train_rc=1
    done
    # The same bf16 steps recomputing the layers: their memory and cost.
    bench_step train 90 "$results/train.jsonl" --model 1b --gemm-math bf16 --warmup 1 --steps 3 --recompute ||
        train_rc=1
    # Where the bf16 step's time goes, op by op (into bench.err; its MFU
    # row, timed with the marks on, is not the one reported).
    bench_step train 90 /dev/null --model 1b --gemm-math bf16 --warmup 1 --steps 2 --profile || train_rc=1

    summary "$results" "$test_rc" "$gemm_rc" "$layer_rc" "$train_rc"
    [ "$test_rc" = 0 ] && [ "$gemm_rc" = 0 ] && [ "$layer_rc" = 0 ] && [ "$train_rc" = 0 ]
}

summary() {
    local results=$1 test_rc=$2 gemm_rc=$3 layer_rc=$4 train_rc=$5
    echo
    echo "==================== gpu_check summary ($(($(date +%s) - START)) s) ===================="
    local synth skipped suite section
    for suite in test_cuda_ops test_comm_nccl; do
        section=$(awk -v head="== $suite" '$0 == head { on = 1; next } /^== / { on = 0 } on' "$results/tests.log")
        synth=$(grep -a "Synthesis" <<<"$section" | tail -1)
        skipped=$(grep -ac "\[SKIP\]" <<<"$section")
        printf "%-14s | %s | skipped %s\n" "$suite" "${synth#*Synthesis: }" "$skipped"
    done
    printf "tests   exit %s\n" "$test_rc"
    printf "gemm    exit %s   gate+layer+attention exit %s   train exit %s\n" "$gemm_rc" "$layer_rc" "$train_rc"
    grep -a "^val_loss .* floor" "$results/train.log" | sed 's/^/train   default model on cuda: /'
    grep -a "^generate \|^recompute cuda" "$results/train.log" | sed 's/^/train   /'
    grep -a -A8 "profile of 1b" "$results/bench.err" | sed 's/^moe-bench train: *//'
    python3 - "$results/gemm.jsonl" "$results/layer.jsonl" "$results/train.jsonl" "$results/gate.jsonl" \
        "$results/attention.jsonl" <<'EOF'
import json, sys
def rows(path):
    out = []
    try:
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                out.append(json.loads(line))
    except (OSError, ValueError):
        pass
    return out
def gemm_section():
    gemm = rows(sys.argv[1])
    if not gemm:
        print("gemm: no results")
        return
    algos = ["mma", "wgmma", "wgmma-tma", "cublaslt-loop", "cublas-grouped", "dense"]
    print(f"{'shape':8} {'routing':9} {'gemm':5} " + " ".join(f"{a:>14}" for a in algos) +
          f" {'mma/dense':>9} {'wgmma/dense':>11} {'tma/dense':>9} {'tma/cublas':>10} {'max_err':>8}")
    keys = []
    for r in gemm:
        k = (r["shape"], r["routing"], r["gemm"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        by = {r["algo"]: r for r in gemm if (r["shape"], r["routing"], r["gemm"]) == k}
        f = lambda v, w, p: f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"
        cells = " ".join(f(by.get(a, {}).get("rate"), 14, 1) for a in algos)
        errs = [r["max_err"] for r in by.values() if isinstance(r.get("max_err"), (int, float))]
        # The two steps ran the cuBLAS baselines and Hopper's kernels apart,
        # each with its own dense GEMM: every ratio is against its step's.
        rate = lambda a: by.get(a, {}).get("rate") if isinstance(by.get(a, {}).get("rate"), (int, float)) else None
        vs_dense = lambda a: by.get(a, {}).get("vs_dense")
        cublas = [r for r in (rate("cublaslt-loop"), rate("cublas-grouped")) if r]
        t_cublas = rate("wgmma-tma") / max(cublas) if cublas and rate("wgmma-tma") else None
        print(f"{k[0]:8} {k[1]:9} {k[2]:5} {cells} {f(vs_dense('mma'), 9, 3)} "
              f"{f(vs_dense('wgmma'), 11, 3)} {f(vs_dense('wgmma-tma'), 9, 3)} "
              f"{f(t_cublas, 10, 3)} {f(max(errs) if errs else None, 8, 4)}")
    print("(rates in TFLOP/s, bf16 storage, fp32 accumulation; the dense column is the second\n"
          " step's: each x/dense ratio is against the dense GEMM of its own step)")
def layer_section():
    for r in rows(sys.argv[2]):
        if r.get("phase") in ("layer.fwd+bwd", "experts.fwd+bwd"):
            print(f"layer   {r['shape']:8} {r['routing']:9} {r['phase']:16} {r['gflops']:8.1f} GFLOP/s "
                  f"= {r['ratio']:.3f} x the same GPU's fp32 GEMM")
def gate_section():
    for r in rows(sys.argv[4]):
        print(f"gate    {r['gate']:13} T {r['T']} E {r['E']} k {r['k']}: {r['gbps']:7.1f} GB/s "
              f"= {r['ratio']:.3f} x a copy ({r['copy_gbps']:.1f} GB/s)")
def attention_section():
    for r in rows(sys.argv[5]):
        sp = f" = {r['speedup']:.2f}x the batched path" if r.get('speedup') is not None else ""
        print(f"attention {r['path']:8} B {r['B']} T {r['T']} Hq {r['Hq']} Hkv {r['Hkv']} hd {r['hd']}: "
              f"fwd {r['fwd_ms']:.3f} ms bwd {r['bwd_ms']:.3f} ms, {r['gflops'] / 1e3:.1f} TFLOP/s "
              f"= {r['vs_gemm']:.3f} x the {r['gemm_math']} GEMM{sp}")
def train_section():
    for r in rows(sys.argv[3]):
        recomputed = " (recomputed)" if r.get('recompute') else ""
        print(f"train   {r['model']:8} {r['gemm_math']} GEMMs{recomputed}, {r['params_m']:8.1f}M params, "
              f"{r['tokens_per_s']:9.0f} tokens/s, {r['gflops'] / 1e3:6.1f} TFLOP/s = MFU {r['mfu']:.3f} "
              f"of the measured {r['gemm_math']} GEMM rate {r['gemm_gflops'] / 1e3:.1f} TFLOP/s, "
              f"activations {r['activation_mb'] / 1e3:.2f} GB")
        if r.get('mfu_bf16') is not None:
            print(f"train   {r['model']:8} {'':4} = MFU {r['mfu_bf16']:.3f} of a GEMM on bf16 operands, "
                  f"{r['bf16_gemm_gflops'] / 1e3:.1f} TFLOP/s")
# A section that cannot be read does not take the others with it.
for name, section in (("gemm", gemm_section), ("layer", layer_section), ("gate", gate_section),
                      ("attention", attention_section), ("train", train_section)):
    try:
        section()
    except Exception as e:
        print(f"{name}: could not summarise ({type(e).__name__}: {e})")
EOF
    echo "=================================================================================="
}

case "${1:-}" in
pack) pack ;;
run) run ;;
all) pack && run ;;
*)
    sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
