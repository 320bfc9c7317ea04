#!/usr/bin/env bash
# A rank killed in the middle of a run (MOE_FAULT_KILL) must end the whole
# job with a non-zero exit that names the rank, well within --comm-timeout,
# and leave the last checkpoint on disk loadable. A rank that stops (SIGSTOP)
# under a launcher that keeps the job alive when a process exits non-zero
# must end the job too, the survivor naming the cause (Open MPI only: its
# orte_abort_on_non_zero_status 0 stands for Slurm's default), whether the
# ranks are data-parallel or pipeline stages. Ranks that
# disagree (other checkpoints, other moe-bench a2a flags) and faults that
# cannot happen are refused with an error, not run.
# Usage: fault_kill.sh BINDIR MPIEXEC [MPIEXEC FLAGS...]
set -u
bin=$1
shift
launcher=("$@")
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

start=$(date +%s)
MOE_FAULT_KILL=1:3 timeout 120 "${launcher[@]}" -np 2 "$bin/moe-train" \
    --steps 6 --save-every 1 --eval-every 0 --comm-timeout 30 --out "$out/run" >"$out/log" 2>&1
rc=$?
elapsed=$(($(date +%s) - start))
check "the job exits non-zero (exit $rc)" "$([ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; echo $?)"
check "it ends within the timeout (${elapsed}s)" "$([ "$elapsed" -lt 60 ]; echo $?)"
# By the launcher or a survivor; not the injector's own line about it.
check "the dead rank is named" "$(grep -v MOE_FAULT_KILL "$out/log" | grep -q 'rank 1'; echo $?)"
check "the last checkpoint before the fault is complete" "$([ -f "$out/run/step-000002/model.safetensors" ]; echo $?)"
"$bin/moe-train" --eval-only --init-from "$out/run/step-000002" --eval-batches 2 >"$out/eval" 2>&1
check "the last checkpoint loads" "$(tail -n 1 "$out/eval" | grep -q '^val_loss [0-9]'; echo $?)"
if [ "$failed" -ne 0 ]; then
    echo "--- log of the killed run:"
    grep -v '^step' "$out/log" | tail -n 20
fi

# Ranks on different checkpoints would evaluate a mixture of them.
timeout 120 "${launcher[@]}" -np 1 "$bin/moe-train" --eval-only --init-from "$out/run/step-000001" \
    --eval-batches 2 : -np 1 "$bin/moe-train" --eval-only --init-from "$out/run/step-000002" \
    --eval-batches 2 >"$out/mixed" 2>&1
rc=$?
check "ranks on different --init-from are refused (exit $rc)" \
    "$([ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q 'disagrees with rank 0 on --init-from' "$out/mixed"; echo $?)"

# Ranks that take the exchange's sources apart or together would sum their
# gradients apart: refused, as every option that shapes the run.
ep=(--steps 2 --seq-len 32 --eval-every 0 --eval-batches 1 --threads 1 --batch-size 2 --ep 2 --comm-timeout 30)
timeout 60 "${launcher[@]}" -np 1 "$bin/moe-train" "${ep[@]}" --out "$out/ov" : \
    -np 1 "$bin/moe-train" "${ep[@]}" --out "$out/ov" --overlap >"$out/overlap" 2>&1
rc=$?
check "ranks on different --overlap are refused (exit $rc)" \
    "$([ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q 'disagrees with rank 0 on --overlap' "$out/overlap"; echo $?)"

# moe-bench a2a with other flags on each rank would wait in other collectives.
timeout 60 "${launcher[@]}" -np 1 "$bin/moe-bench" a2a -b 1K -e 4K -n 1 -w 0 : \
    -np 1 "$bin/moe-bench" a2a -b 1K -e 4K -n 3 -w 0 >"$out/a2a" 2>&1
rc=$?
check "moe-bench a2a refuses ranks with other flags (exit $rc)" \
    "$([ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q 'disagrees with rank 0 on --iters' "$out/a2a"; echo $?)"

# A fault that cannot happen is refused, so that this test cannot pass without one.
for fault in 2:3 1:3x 1:99; do
    MOE_FAULT_KILL=$fault timeout 60 "${launcher[@]}" -np 2 "$bin/moe-train" --steps 6 --eval-every 0 \
        --eval-batches 1 --out "$out/nofault" >"$out/nofault.log" 2>&1
    rc=$?
    check "MOE_FAULT_KILL=$fault is refused before anything is written (exit $rc)" \
        "$([ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q 'MOE_FAULT_KILL' "$out/nofault.log" &&
            [ ! -e "$out/nofault" ]; echo $?)"
done

if "${launcher[0]}" --version 2>/dev/null | grep -Eq "Open MPI|OpenRTE"; then
    # Each rank's pid, so that the test can stop rank 1.
    printf '#!/usr/bin/env bash\necho $$ > "%s/pid.$OMPI_COMM_WORLD_RANK"\nexec "%s/moe-train" "$@"\n' \
        "$out" "$bin" >"$out/rank.sh"
    chmod +x "$out/rank.sh"
    # stop_case WHAT WANT ARGS...: rank 1 of a run with ARGS stops; rank 0's
    # first error (not a later op's refusal on the failed communicator)
    # must match WANT.
    stop_case() {
        local what=$1 want=$2 log="$out/stop.$1.log"
        shift 2
        rm -f "$out"/pid.*
        timeout 60 "${launcher[@]}" --mca orte_abort_on_non_zero_status 0 -np 2 "$out/rank.sh" \
            --steps 400 --eval-every 0 --comm-timeout 3 --out "$out/stop.$what" "$@" >"$log" 2>&1 &
        local job=$!
        # Not '^step': mpirun gives the ranks a terminal, so a progress bar comes first.
        for _ in $(seq 600); do
            grep -q 'step     3/' "$log" 2>/dev/null && [ -s "$out/pid.1" ] && break
            sleep 0.1
        done
        kill -STOP "$(cat "$out/pid.1" 2>/dev/null)" 2>/dev/null
        check "$what: rank 1 is stopped in the run" "$?"
        local start=$(date +%s)
        wait "$job"
        local rc=$?
        local elapsed=$(($(date +%s) - start))
        check "$what: the job with a stopped rank exits non-zero (exit $rc)" \
            "$([ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; echo $?)"
        check "$what: it ends within the timeout (${elapsed}s)" "$([ "$elapsed" -lt 30 ]; echo $?)"
        check "$what: rank 0 names the cause" \
            "$(grep 'moe-train: rank 0: ' "$log" | grep -v refused | grep -Eq "$want"; echo $?)"
        # A rank left running (the job did not end) must not outlive the test;
        # a pid no longer moe-train's (reaped, perhaps reused) is left alone.
        for f in "$out"/pid.*; do
            local pid=$(cat "$f")
            if grep -q moe-train "/proc/$pid/cmdline" 2>/dev/null; then
                kill -KILL "$pid" 2>/dev/null
            fi
        done
        if [ "$failed" -ne 0 ]; then
            echo "--- log of the run with a stopped rank ($what):"
            grep -v '^step' "$log" | tail -n 20
        fi
    }
    stop_case data-parallel 'not complete after 3 s'
    # Stage 0 waits for stage 1's gradients, or in the step's collectives.
    stop_case pipeline 'peer 1 \(world 1\).* after 3 s|not complete after 3 s' --pp 2 --grad-accum 2
else
    echo "SKIP: a stopped rank under a launcher that keeps the job alive: not Open MPI's mpirun"
fi

# SIGUSR1 to one rank (as Slurm's --signal sends before a time limit)
# stops every rank after the same step, checkpointed, with exit 3, and
# --resume latest finishes the run.
timeout 120 "${launcher[@]}" -np 2 "$bin/moe-train" --steps 100000 --eval-every 0 --out "$out/sig" \
    >"$out/sig.log" 2>&1 &
job=$!
logged "$out/sig/metrics.jsonl"
rank_pid=$(pgrep -n -f -- "moe-train --steps 100000 --eval-every 0 --out $out/sig")
kill -USR1 "$rank_pid" 2>/dev/null
wait "$job"
rc=$?
check "SIGUSR1 to a rank ends the job with exit 3 (exit $rc)" "$([ "$rc" -eq 3 ]; echo $?)"
last=$(ls -d "$out"/sig/step-* 2>/dev/null | tail -n 1)
check "every rank stopped after the step checkpointed ($last)" \
    "$([ -f "$last/model.safetensors" ] && grep -q "stopped after step $((10#${last##*-}))" "$out/sig.log"; echo $?)"
if [ -n "$last" ]; then
    steps=$((10#${last##*-} + 2))
    timeout 120 "${launcher[@]}" -np 2 "$bin/moe-train" --steps "$steps" --eval-every 0 --out "$out/sig" \
        --resume latest >"$out/sig2.log" 2>&1
    rc=$?
    check "--resume latest finishes it (exit $rc)" \
        "$([ "$rc" -eq 0 ] && [ -f "$out/sig/step-$(printf %06d "$steps")/model.safetensors" ]; echo $?)"
fi
if [ "$failed" -ne 0 ]; then
    echo "--- log of the signalled run:"
    grep -v '^step' "$out/sig.log" | tail -n 20
fi
summary
