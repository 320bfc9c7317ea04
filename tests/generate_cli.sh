#!/usr/bin/env bash
# moe-generate's flags and output, on the checkpoint that two steps of
# moe-train leave: every bad flag, and every setting the generation refuses
# (a prompt outside the vocabulary, too many positions), exits 2 naming
# itself, a generation that cannot start (a missing checkpoint) exits 1,
# both with 'moe-generate: ' on stderr and nothing on stdout (one that
# fails once started has printed its header line); a good run prints the
# header line and one line per sample, and exits 1 when stdout cannot take
# them (a full disk, a pipe whose reader has gone). With --tokenizer a
# sample prints as the text of the ids it prints without.
# Usage: generate_cli.sh BINDIR (holding moe-train and moe-generate)
set -u
bin=$1
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

tiny_config "$out/tiny.json"
"$bin/moe-train" --config "$out/tiny.json" --steps 2 --batch-size 2 --seq-len 16 --eval-batches 1 \
    --peak-gflops 1 --device cpu --out "$out/run" >"$out/train.log" 2>&1
check "moe-train leaves a checkpoint" "$([ -f "$out/run/step-000002/model.safetensors" ]; echo $?)"
ckpt=$out/run/step-000002

# llm.c's tokenizer file for 40 of the model's 54 ids: 0 .. 37 the bytes
# '0' .. 'U', 38 "\n\t", 39 "<|endoftext|>", its end-of-text (version 2);
# texts holds what a sample prints for each.
texts=()
{
    printf '\xc8\xd7\x34\x01\x02\x00\x00\x00\x28\x00\x00\x00\x27\x00\x00\x00' # magic, version, count, eot
    head -c 1008 /dev/zero
    for i in $(seq 0 37); do
        texts[i]=$(printf "\\$(printf %03o $((48 + i)))")
        printf '\x01%s' "${texts[i]}"
    done
    printf '\x02\n\t\x0d<|endoftext|>'
} >"$out/tok.bin"
texts[38]='\n\t'
texts[39]='<\x7cendoftext\x7c>'
head -c 1000 "$out/tok.bin" >"$out/cut.bin"

# The text of comma-separated ids, as --tokenizer tok.bin prints it.
decode() {
    local id s=""
    for id in ${1//,/ }; do
        if [ "$id" -lt 40 ]; then s+=${texts[id]}; else s+="\\<id $id>"; fi
    done
    printf '%s' "$s"
}

# name, expected exit status, text stderr must hold, flags...
expect_fail() { expect_exit "$bin/moe-generate" 1 "$@"; }
p=(--init-from "$ckpt" --prompt '<arithmetic>3+4=' --device cpu)
expect_fail "--init-from is required" 2 "--init-from DIR is required" --prompt 1
expect_fail "--prompt is required" 2 "--prompt TEXT is required" --init-from "$ckpt"
expect_fail "a flag without its value" 2 "--prompt needs a value" --init-from "$ckpt" --prompt
expect_fail "an unknown flag" 2 "unknown option '--sample'" "${p[@]}" --sample 2
expect_fail "--samples with trailing garbage" 2 "--samples '2x'" "${p[@]}" --samples 2x
expect_fail "--samples 0" 2 "--samples 0 must be positive" "${p[@]}" --samples 0
expect_fail "--max-new-tokens negative" 2 "--max-new-tokens -1 must be positive" "${p[@]}" --max-new-tokens -1
expect_fail "--max-new-tokens past int64" 2 "--max-new-tokens '99999999999999999999'" "${p[@]}" \
    --max-new-tokens 99999999999999999999
expect_fail "--temperature not finite" 2 "--temperature 'nan'" "${p[@]}" --temperature nan
# A value a double cannot hold is quoted as typed, not as the 0 it rounds to.
expect_fail "--temperature rounding to 0" 2 "--temperature '1e-400': out of range: a double rounds it to 0" \
    "${p[@]}" --temperature 1e-400
expect_fail "--top-p past the largest double" 2 "--top-p '-2e308': out of range: a double rounds it to infinity" \
    "${p[@]}" --top-p -2e308
expect_fail "--temperature negative" 2 "--temperature -0.5 must be" "${p[@]}" --temperature -0.5
# Integers and reals alike: no sign but '-', no leading space.
expect_fail "--samples with a '+'" 2 "--samples '+2'" "${p[@]}" --samples +2
expect_fail "--temperature with a '+'" 2 "--temperature '+0.5'" "${p[@]}" --temperature +0.5
expect_fail "--temperature with a leading space" 2 "--temperature ' 0.5'" "${p[@]}" --temperature ' 0.5'
expect_fail "--samples of greedy decoding" 2 "--samples 3 of greedy decoding (--temperature 0) would be 3 copies" \
    "${p[@]}" --samples 3
expect_fail "--samples at --top-k 1" 2 "(--top-k 1) would be 2 copies of one: give --top-k 0 or above 1" \
    "${p[@]}" --samples 2 --temperature 1 --top-k 1
expect_fail "--top-k negative" 2 "--top-k -3 must be" "${p[@]}" --top-k=-3
expect_fail "--seed negative" 2 "--seed '-1'" "${p[@]}" --seed -1
expect_fail "--threads negative" 2 "--threads -1" "${p[@]}" --threads -1
expect_fail "--tokens unknown" 2 "--tokens 'words'" "${p[@]}" --tokens words
expect_fail "--device unknown" 2 "--device 'gpu'" "${p[@]}" --device gpu
expect_fail "a missing checkpoint" 1 "--init-from $out/absent: " --init-from "$out/absent" --prompt 1
expect_fail "a character outside the vocabulary" 2 "--prompt: byte 4: 'x'" "${p[@]}" --prompt '3+4=x'
expect_fail "an empty prompt" 2 "<arithmetic>" "${p[@]}" --prompt ''
expect_fail "more positions than the model has" 2 "max_position_embeddings 64" "${p[@]}" --max-new-tokens 60
expect_fail "a stop of two tokens" 2 "--stop ';;' holds 2 tokens" "${p[@]}" --stop ';;'
expect_fail "--tokenizer with --tokens synthetic" 2 "--tokenizer $out/tok.bin prints .*--tokens synthetic" \
    "${p[@]}" --tokenizer "$out/tok.bin" --tokens synthetic
expect_fail "--tokenizer with --tokens bytes" 2 "--tokenizer .*--tokens bytes" "${p[@]}" --prompt 1 \
    --tokenizer "$out/tok.bin" --tokens bytes
expect_fail "--tokenizer takes ids" 2 "--prompt: byte 0: '<'" "${p[@]}" --tokenizer "$out/tok.bin"
# Ids that were given as ids get no word on ids: the message ends at the fault.
expect_fail "--tokenizer and an id past the vocabulary" 2 "token id 999 is not below the checkpoint's vocab_size 54$" \
    "${p[@]}" --prompt 1,999 --tokenizer "$out/tok.bin"
expect_fail "a tokenizer file cut short" 1 "--tokenizer: $out/cut.bin: 1000 bytes, shorter than" "${p[@]}" \
    --prompt 1 --tokenizer "$out/cut.bin"

"$bin/moe-generate" --help >"$out/help" 2>&1
rc=$?
missing=""
for f in --init-from --prompt --samples --max-new-tokens --temperature --top-k --seed --stop --tokens --tokenizer \
    --device --threads; do
    grep -q -- "$f" "$out/help" || missing="$missing $f"
done
check "--help exits 0 and names every flag (missing:${missing:- none})" "$([ "$rc" -eq 0 ] && [ -z "$missing" ]; echo $?)"

"$bin/moe-generate" "${p[@]}" --samples 2 --max-new-tokens 5 --temperature 0.8 --top-k 4 --seed 9 --threads 1 \
    >"$out/gen" 2>"$out/gen.err"
rc=$?
check "a run exits 0 (exit $rc: $(head -c 200 "$out/gen.err"))" "$rc"
check "the header names checkpoint, device and token kind" \
    "$(head -n 1 "$out/gen" | grep -qxF "checkpoint $ckpt | device cpu, 1 threads | tokens synthetic (from vocab_size 54)"; echo $?)"
check "one line per sample, the prompt before '|'" \
    "$([ "$(grep -c '^sample [01]: <arithmetic>3+4=|.' "$out/gen")" -eq 2 ] && [ "$(wc -l <"$out/gen")" -eq 3 ]; echo $?)"
"$bin/moe-generate" "${p[@]}" --prompt '4,15' --tokens ids --max-new-tokens 3 --threads 1 >"$out/ids" 2>&1
if [ -w /dev/full ]; then
    "$bin/moe-generate" "${p[@]}" --max-new-tokens 3 --threads 1 >/dev/full 2>"$out/full.err"
    rc=$?
    check "samples stdout cannot take exit 1 (exit $rc: $(head -c 200 "$out/full.err"))" \
        "$([ "$rc" -eq 1 ] && grep -q '^moe-generate: writing to stdout failed' "$out/full.err"; echo $?)"
fi
# A reader gone before the first line (| head): the writes fail, and the
# program says so with exit 1 instead of dying of SIGPIPE without a word
# (at its default action here, whatever the test's shell was given).
dfl=()
env --default-signal=PIPE true 2>/dev/null && dfl=(env --default-signal=PIPE)
(
    sleep 0.5
    exec "${dfl[@]}" "$bin/moe-generate" "${p[@]}" --max-new-tokens 3 --threads 1 2>"$out/pipe.err"
) | true
rc=${PIPESTATUS[0]}
check "samples into a closed pipe exit 1 (exit $rc: $(head -c 200 "$out/pipe.err"))" \
    "$([ "$rc" -eq 1 ] && grep -q '^moe-generate: writing to stdout failed' "$out/pipe.err"; echo $?)"
check "ids are comma-separated (--tokens)" \
    "$(grep -qx 'sample 0: 4,15|[0-9]\{1,2\},[0-9]\{1,2\},[0-9]\{1,2\}' "$out/ids" && grep -q 'tokens ids (--tokens)' "$out/ids"; echo $?)"

# The same draws without the tokenizer, told to stop where its end-of-text stops them.
t=(--init-from "$ckpt" --prompt '4,38,45' --device cpu --samples 3 --max-new-tokens 12 --temperature 1 --seed 9
    --threads 1)
"$bin/moe-generate" "${t[@]}" --tokens ids --stop 39 >"$out/plain" 2>&1
"$bin/moe-generate" "${t[@]}" --tokenizer "$out/tok.bin" >"$out/text" 2>"$out/text.err"
rc=$?
check "a run with --tokenizer exits 0 (exit $rc: $(head -c 200 "$out/text.err"))" "$rc"
check "its header names the tokenizer and its end-of-text" \
    "$(head -n 1 "$out/text" | grep -qxF "checkpoint $ckpt | device cpu, 1 threads | tokens ids, printed as text by \
--tokenizer $out/tok.bin (40 tokens; its end-of-text 39 ends a sample)"; echo $?)"
tail -n +2 "$out/plain" | while IFS= read -r line; do
    ids=${line#*: }
    printf '%s: %s|%s\n' "${line%%: *}" "$(decode "${ids%|*}")" "$(decode "${ids#*|}")"
done >"$out/want"
check "each sample is the text of the ids it prints without --tokenizer" \
    "$([ "$(wc -l <"$out/want")" -eq 3 ] && tail -n +2 "$out/text" | cmp -s - "$out/want"; echo $?)"
check "ids past the tokenizer print as \\<id N>" "$(grep -qF 'sample 0: 4\n\t\<id 45>|' "$out/text" && \
    grep -q '|.*\\<id [0-9]*>' "$out/text"; echo $?)"
if [ "$failed" -ne 0 ]; then
    echo "--- outputs:"
    tail -n 5 "$out/train.log" "$out/gen" "$out/gen.err" "$out/ids" "$out/plain" "$out/text" "$out/want"
fi
summary
