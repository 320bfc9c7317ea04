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
