#!/usr/bin/env bash
# moe-tokenize from text to training: its shards train moe-train (--data
# and --val-data, --tokenizer) and the checkpoint, which keeps the
# tokenizer.json, generates text through it; a bad flag or input that can never encode exits 2, a file
# that cannot be read exits 1, each with 'moe-tokenize: ' on stderr naming
# the flag or file, and shards already there stay as they were; a closed
# stdout is a failure (exit 1); --input - reads standard input.
# Usage: tokenize_cli.sh BINDIR (holding moe-tokenize, moe-train, moe-generate) DATADIR (tests/data)
set -u
bin=$1
data=$2
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"
tok=$data/tokenizer_qwen2.json

mkdir -p "$out/text"
for i in $(seq 1 40); do
    printf '{"text": "moe trains Mixture-of-Experts transformers from C, line %d: routers, experts, all-to-all."}\n' "$i"
    printf '{"text": "def f(x):\\n    return x * %d  # a comment\\n"}\n' "$i"
done >"$out/text/a.jsonl"
printf 'Ünïcödé täkes twö bytes, 漢字 three, and 🙂 four.\nTabs\tand new lines too.\n' >"$out/text/b.txt"

"$bin/moe-tokenize" --tokenizer "$tok" --input "$out/text/*" --out "$out/shards/tok" --shard-tokens 1000 \
    --val-tokens 300 >"$out/tokenize.log" 2>&1
check "moe-tokenize encodes the corpus (exit $?)" "$(grep -q '^done .* 81 documents (0 empty)' "$out/tokenize.log"; echo $?)"
check "a validation shard, then training shards" \
    "$([ -f "$out/shards/tok_val_000000.bin" ] && [ -f "$out/shards/tok_train_000001.bin" ]; echo $?)"
check "it prints the moe-train command" \
    "$(grep -qF "moe-train --data '$out/shards/tok_train_*.bin' --val-data '$out/shards/tok_val_*.bin' --tokenizer '$tok'" \
        "$out/tokenize.log"; echo $?)"

cat >"$out/config.json" <<'EOF'
{"model_type": "qwen3_moe", "vocab_size": 384, "hidden_size": 16, "intermediate_size": 32,
 "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
 "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
EOF
"$bin/moe-train" --config "$out/config.json" --data "$out/shards/tok_train_*.bin" \
    --val-data "$out/shards/tok_val_*.bin" --tokenizer "$tok" --steps 3 --batch-size 2 --seq-len 32 \
    --eval-batches 1 --peak-gflops 1 --device cpu --out "$out/run" >"$out/train.log" 2>&1
check "moe-train trains on the shards (exit $?)" "$(grep -q '^val_loss ' "$out/train.log"; echo $?)"
check "the checkpoint keeps the tokenizer" "$(cmp -s "$tok" "$out/run/step-000003/tokenizer.json"; echo $?)"
"$bin/moe-generate" --init-from "$out/run/step-000003" --prompt 'moe trains' --max-new-tokens 4 --device cpu \
    >"$out/generate.log" 2>&1
check "moe-generate encodes the prompt with the same tokenizer (exit $?)" \
    "$(grep -q '^sample 0: moe trains|' "$out/generate.log"; echo $?)"

# name, expected exit status, text stderr must hold, flags... (a failure
# after the input is open follows the header lines on stdout)
expect_fail() { expect_exit "$bin/moe-tokenize" 0 "$@"; }
before=$(cat "$out"/shards/* | md5sum)
p=(--tokenizer "$tok" --input "$out/text/*" --out "$out/shards/tok")
expect_fail "no --tokenizer" 2 "--tokenizer is required" --input "$out/text/*"
expect_fail "an unknown flag" 2 "--bogus" "${p[@]}" --bogus
expect_fail "--shard-tokens 0" 2 "--shard-tokens 0" "${p[@]}" --shard-tokens 0
expect_fail "shards there already" 2 "tok_val_000000.bin is there" "${p[@]}"
expect_fail "a missing tokenizer" 1 "missing.json" "${p[@]}" --tokenizer "$out/missing.json" --overwrite
expect_fail "no input" 1 "no file matches" "${p[@]}" --input "$out/none*" --overwrite
printf '{"text": "fine"}\n{"text": 5}\n' >"$out/text/c.jsonl"
expect_fail "a line without text" 2 "c.jsonl:2: \"text\" is a number" "${p[@]}" --overwrite
rm "$out/text/c.jsonl"
check "the shards stay as they were" "$([ "$(cat "$out"/shards/* | md5sum)" = "$before" ]; echo $?)"
check "no staging folder stays" "$(ls -d "$out"/shards/*partial* >/dev/null 2>&1; [ $? -ne 0 ]; echo $?)"

"$bin/moe-tokenize" --tokenizer "$tok" --input "$out/text/a.jsonl" --out "$out/file/tok" >/dev/null 2>&1
"$bin/moe-tokenize" --tokenizer "$tok" --input - --out "$out/stdin/tok" <"$out/text/a.jsonl" >"$out/stdin.log" 2>&1
check "--input - reads standard input as a .jsonl file" \
    "$(cmp -s "$out/file/tok_train_000000.bin" "$out/stdin/tok_train_000000.bin"; echo $?)"
printf '{"text": "fine"}\n{"txt": "x"}\n' | "$bin/moe-tokenize" --tokenizer "$tok" --input - --out "$out/stdin/bad" \
    >/dev/null 2>"$out/stderr"
check "a bad line of standard input names it" "$(grep -qF 'stdin:2: no "text"' "$out/stderr"; echo $?)"
"$bin/moe-tokenize" "${p[@]}" --overwrite --shard-tokens 100000 >"$out/again.log" 2>&1
check "--overwrite replaces the shards with one" "$([ "$(ls "$out/shards")" = tok_train_000000.bin ]; echo $?)"
"$bin/moe-tokenize" --help | head -1 >/dev/null
rc=${PIPESTATUS[0]}
check "--help read in part is no failure (exit $rc)" "$rc"
rm -r "$out/shards"
if [ -w /dev/full ]; then
    "$bin/moe-tokenize" "${p[@]}" >/dev/full 2>"$out/stderr"
    rc=$?
    check "a full stdout exits 1 (exit $rc)" "$([ $rc -eq 1 ] && grep -q 'moe-tokenize: ' "$out/stderr"; echo $?)"
fi
summary
