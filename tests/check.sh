# check.sh: what the shell tests share, sourced by each: a scratch
# directory $out, removed at the exit; one thread, as the tests' runs are
# small; PASS/FAIL lines, their count, the summary whose status is the
# test's; and a model small enough for moe-train to take a step in a
# millisecond.
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMP_NUM_THREADS=1
passed=0 failed=0

check() { # name, condition status (0: pass)
    if [ "$2" -eq 0 ]; then echo "PASS: $1"; passed=$((passed + 1)); else echo "FAIL: $1"; failed=$((failed + 1)); fi
}

# Waits (at most 30 s) for file $1 to be written: a run has logged a step.
logged() {
    for _ in $(seq 300); do
        [ -s "$1" ] && return
        sleep 0.1
    done
}

# Runs program (a path) with flags and passes when it exits with status
# want and its stderr holds 'NAME: ' (the program's file name) and then
# text (a grep pattern), and, where quiet is 1, nothing reached stdout.
expect_exit() { # program, quiet (1 or 0), check's name, want, text, flags...
    local program=$1 quiet=$2 name=$3 want=$4 text=$5
    shift 5
    "$program" "$@" >"$out/stdout" 2>"$out/stderr"
    local rc=$?
    local ok=0
    [ "$rc" -eq "$want" ] || ok=1
    grep -q "^$(basename "$program"): .*$text" "$out/stderr" || ok=1
    [ "$quiet" -eq 1 ] && [ -s "$out/stdout" ] && ok=1
    check "$name (exit $rc: $(head -c 200 "$out/stderr"))" "$ok"
}

summary() {
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ]
}

tiny_config() { # path: a config.json of the synthetic corpus's 54 tokens, one layer
    cat >"$1" <<'EOF'
{"vocab_size": 54, "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_local_experts": 4,
 "num_experts_per_tok": 2, "max_position_embeddings": 64}
EOF
}
