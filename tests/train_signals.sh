#!/usr/bin/env bash
# moe-train's signals in one process (fault_kill.sh has them under a
# launcher): SIGHUP stops a run after its step, checkpointed, with exit 3,
# as SIGTERM does, unless it was ignored on entry (nohup); a stdout whose
# reader has gone does not kill the run by SIGPIPE without a word: it
# trains on to its last checkpoint and exits 1 saying why.
# Usage: train_signals.sh BINDIR (holding moe-train)
set -u
bin=$1
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

tiny_config "$out/tiny.json"
run=(--config "$out/tiny.json" --batch-size 2 --seq-len 16 --warmup 1 --eval-every 0 --eval-batches 1
    --peak-gflops 1 --device cpu --threads 1)
# The signals at their default action, whatever the shell running the test
# was given (a SIGPIPE ignored on entry would hide the fault this tests).
dfl=()
env --default-signal=PIPE,HUP true 2>/dev/null && dfl=(env --default-signal=PIPE,HUP)

# The exit status of the run in the background as pid $1, killed when it
# has not ended within 30 s.
ended() {
    for _ in $(seq 300); do
        kill -0 "$1" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$1" 2>/dev/null
    wait "$1"
}

"${dfl[@]}" "$bin/moe-train" "${run[@]}" --steps 100000 --out "$out/hup" >"$out/hup.log" 2>&1 &
pid=$!
logged "$out/hup/metrics.jsonl"
kill -HUP "$pid"
ended "$pid"
rc=$?
last=$(ls -d "$out"/hup/step-* 2>/dev/null | tail -n 1)
check "SIGHUP stops the run with exit 3 (exit $rc)" "$([ "$rc" -eq 3 ]; echo $?)"
check "after the step in progress, checkpointed ($last)" \
    "$([ -n "$last" ] && [ -f "$last/model.safetensors" ] &&
        grep -q "stopped after step $((10#${last##*-})) by SIGHUP" "$out/hup.log"; echo $?)"

# Under nohup SIGHUP stays ignored; SIGTERM then stops the run.
env --ignore-signal=HUP true 2>/dev/null && nohup=(env --ignore-signal=HUP) || nohup=(nohup)
"${nohup[@]}" "$bin/moe-train" "${run[@]}" --steps 100000 --out "$out/nohup" >"$out/nohup.log" 2>&1 &
pid=$!
logged "$out/nohup/metrics.jsonl"
kill -HUP "$pid"
sleep 1
kill -0 "$pid" 2>/dev/null
check "a SIGHUP ignored on entry (nohup) leaves the run going" $?
kill -TERM "$pid"
ended "$pid"
rc=$?
check "SIGTERM then stops it (exit $rc)" "$([ "$rc" -eq 3 ] && grep -q "by SIGTERM" "$out/nohup.log"; echo $?)"

# The reader is gone before the run writes its first line.
(
    sleep 0.5
    exec "${dfl[@]}" "$bin/moe-train" "${run[@]}" --steps 20 --save-every 10 --out "$out/pipe" 2>"$out/pipe.err"
) | true
rc=${PIPESTATUS[0]}
check "a closed stdout pipe exits 1, saying so (exit $rc: $(head -c 200 "$out/pipe.err"))" \
    "$([ "$rc" -eq 1 ] && grep -q '^moe-train: writing to stdout failed' "$out/pipe.err"; echo $?)"
check "the run went on to its last checkpoint" "$([ -f "$out/pipe/step-000020/model.safetensors" ]; echo $?)"
# Help read in part is no failure.
(
    sleep 0.5
    exec "${dfl[@]}" "$bin/moe-train" --help 2>"$out/help.err"
) | true
rc=${PIPESTATUS[0]}
check "--help into a closed pipe exits 0, silent (exit $rc: $(head -c 200 "$out/help.err"))" \
    "$([ "$rc" -eq 0 ] && [ ! -s "$out/help.err" ]; echo $?)"
if [ "$failed" -ne 0 ]; then
    echo "--- logs:"
    tail -n 5 "$out/hup.log" "$out/nohup.log" "$out/pipe.err"
fi
summary
