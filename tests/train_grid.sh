#!/usr/bin/env bash
# moe-train on a grid of ranks (expert-parallel, data-parallel, ZeRO-1,
# pipeline stages under 1F1B and GPipe) follows the loss curve of one rank
# reading the same global batches, evaluates to the same validation losses
# and per-kind report, and a checkpoint written on a grid resumes on one
# rank (and one rank's on a pipeline) on the same curve. Grids the model or
# the ranks cannot take are refused with an error naming the flag.
# Tolerance: 1e-5 relative per step, as float summation order allows; the
# per-kind report as printed, to its last digit.
# Usage: train_grid.sh BINDIR MPIEXEC [MPIEXEC FLAGS...]
set -u
bin=$1
shift
launcher=("$@")
common=(--steps 12 --eval-every 6 --eval-batches 2 --seq-len 32)
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

# The values of a key in a run's metrics.jsonl, one per line: "loss" for
# the steps, "val_loss" for the evaluations.
values() { grep -o "\"$1\":[^,}]*" "$2/metrics.jsonl" | cut -d: -f2; }
same_curve() { # name, file of values A, file of values B
    paste "$2" "$3" | awk 'BEGIN { bad = 0; n = 0 }
        { n++; d = $1 - $2; if (d < 0) d = -d; s = $2 < 0 ? -$2 : $2; if (d > 1e-5 * s) { bad = 1; print "  line " n ": " $1 " vs " $2 } }
        END { exit bad || n == 0 }'
    check "$1" "$?"
}
# The numbers of the per-kind report that ends a log (tokens, losses,
# floors, routing percentages), one per line; the greedy answers are
# measured on one process only.
kind_numbers() { sed -n '/^per kind/,/^(shade/p' "$1" | grep -v '^greedy' | grep -o '[0-9][0-9.]*'; }
same_kinds() { # name, log A, log B: equal up to one unit of the last digit printed
    paste <(kind_numbers "$2") <(kind_numbers "$3") | awk 'BEGIN { bad = 0; n = 0 }
        { n++; p = index($2, "."); tol = 1.5 * 10 ^ -(p ? length($2) - p : 0); d = $1 - $2; if (d < 0) d = -d
          if (NF != 2 || d > tol) { bad = 1; print "  number " n ": " $1 " vs " $2 } }
        END { exit bad || n == 0 }'
    check "$1" "$?"
}
run_ok() { # name, log, command...
    local name=$1 log=$2
    shift 2
    timeout 120 "$@" >"$log" 2>&1 || { echo "FAIL: $name did not run"; tail "$log"; exit 1; }
}
# A grid run into OUT/DIR, compared with a one-rank run of the same global
# batches.
grid_matches() { # name, dir, one-rank run, np, flags...
    local name=$1 dir="$out/$2" one=$3 np=$4
    shift 4
    run_ok "$name" "$dir.log" "${launcher[@]}" -np "$np" "$bin/moe-train" "${common[@]}" "$@" --out "$dir"
    same_curve "$name: the loss curve of 1 rank" <(values loss "$dir") <(values loss "$one")
    same_curve "$name: the validation losses of 1 rank" <(values val_loss "$dir") <(values val_loss "$one")
}

run_ok "one rank" "$out/one.log" "$bin/moe-train" "${common[@]}" --batch-size 8 --save-every 6 --out "$out/one"
# An eval file in llm.c's format (mc_eval.h): 40 examples, each a context
# of 3 tokens and completions of 1 and 2, written little-endian.
le16() { printf "\\$(printf %03o $(($1 & 255)))\\$(printf %03o $(($1 >> 8 & 255)))"; }
le32() { le16 $(($1 & 65535)); le16 $(($1 >> 16)); }
{
    le32 20240522; le32 1; le32 40; le32 28
    for _ in $(seq 4 255); do le32 0; done
    for e in $(seq 0 39); do
        for w in 65535 28 "$e" $((e % 2)) 2 3 $((e % 50 + 1)) 7 8 1 $((e % 30 + 10)) 2 5 $((e % 40 + 6)); do le16 "$w"; done
    done
} >"$out/mc.bin"
run_ok "one rank, 3 micro-batches" "$out/one3.log" "$bin/moe-train" "${common[@]}" --batch-size 8 --grad-accum 3 \
    --save-every 6 --eval-mc "$out/mc.bin" --out "$out/one3"
# The multiple-choice scores of a grid: those of 1 rank.
same_mc() { # name, run
    [ -n "$(values mc_correct "$2")" ] && cmp -s <(values mc_correct "$2") <(values mc_correct "$out/one3")
    check "$1: the --eval-mc scores of 1 rank" $?
}

grid_matches "2 ranks, --ep 2 --zero 1" ep "$out/one" 2 --batch-size 4 --ep 2 --zero 1 --save-every 6
run_ok "the resume" "$out/resumed.log" "$bin/moe-train" "${common[@]}" --batch-size 8 \
    --resume "$out/ep/step-000006" --out "$out/resumed"
# The resumed run logs steps 7..12.
same_curve "a 2-rank checkpoint resumed on 1 rank" <(values loss "$out/resumed") <(values loss "$out/one" | tail -n +7)

# Three micro-batches, more than the stages: the schedules differ.
pp=(--grad-accum 3 --pp 2)
grid_matches "--pp 2 on 2 ranks, 1f1b" pp "$out/one3" 2 --batch-size 8 "${pp[@]}" --save-every 6 \
    --eval-mc "$out/mc.bin"
same_mc "--pp 2 on 2 ranks" "$out/pp"
same_kinds "--pp 2 on 2 ranks: the per-kind report of 1 rank" "$out/pp.log" "$out/one3.log"
grid_matches "--pp 2 on 2 ranks, gpipe" pp_gpipe "$out/one3" 2 --batch-size 8 "${pp[@]}" --pp-schedule gpipe
grid_matches "--pp 2 --ep 1 on 4 ranks (PP 2 x DP 2), 1f1b" pp_dp "$out/one3" 4 --batch-size 4 "${pp[@]}" --ep 1
same_kinds "PP 2 x DP 2: the per-kind report of 1 rank" "$out/pp_dp.log" "$out/one3.log"
grid_matches "--pp 2 --ep 1 on 4 ranks (PP 2 x DP 2), gpipe" pp_dp_gpipe "$out/one3" 4 --batch-size 4 "${pp[@]}" \
    --ep 1 --pp-schedule gpipe
grid_matches "--pp 2 --ep 2 --zero 1 on 4 ranks, 1f1b" pp_ep "$out/one3" 4 --batch-size 4 "${pp[@]}" --ep 2 --zero 1 \
    --eval-mc "$out/mc.bin"
same_mc "--pp 2 --ep 2 on 4 ranks" "$out/pp_ep"
grid_matches "--pp 2 --ep 2 --recompute on 4 ranks, 1f1b" pp_ep_recompute "$out/one3" 4 --batch-size 4 "${pp[@]}" \
    --ep 2 --recompute
grid_matches "--pp 2 --pp-balance measured on 2 ranks" pp_measured "$out/one3" 2 --batch-size 8 "${pp[@]}" \
    --pp-balance measured --save-every 6
grep -q "stages hold layers 0 | 1 (measured: an MoE layer [0-9.]* ms, the head [0-9.]* ms)" "$out/pp_measured.log"
check "--pp-balance measured says the costs it measured" $?
# Its resume cuts by the costs the checkpoint recorded, and so continues it
# bit for bit.
run_ok "the resume of a measured pipeline" "$out/pp_measured_resumed.log" "${launcher[@]}" -np 2 "$bin/moe-train" \
    "${common[@]}" --batch-size 8 "${pp[@]}" --pp-balance measured --resume "$out/pp_measured/step-000006" \
    --out "$out/pp_measured_resumed"
costs() { grep -o "an MoE layer [0-9.]* ms, .*the head [0-9.]* ms" "$1"; }
[ -n "$(costs "$out/pp_measured.log")" ] && [ "$(costs "$out/pp_measured.log")" = "$(costs "$out/pp_measured_resumed.log")" ] &&
    grep -q "(measured by the run --resume continues: " "$out/pp_measured_resumed.log"
check "the resume of a measured pipeline takes the checkpoint's costs" $?
cmp -s <(values loss "$out/pp_measured_resumed") <(values loss "$out/pp_measured" | tail -n +7)
check "the resume of a measured pipeline continues it bit for bit" $?
# Layer 0 a dense MLP layer, under jitter noise: timed apart from the MoE
# layer, and its time travels in the checkpoint too; stage 0, of the dense
# layer alone, counts no noise, and the checkpoint takes stage 1's count.
sed -e '1s/{/{"moe_dense_layers": [0],/' -e 's/"router_jitter_noise": [0-9.e-]*/"router_jitter_noise": 0.05/' \
    "$out/one/config.json" >"$out/dense.json"
run_ok "one rank, a dense layer" "$out/one_dense.log" "$bin/moe-train" "${common[@]}" --config "$out/dense.json" \
    --batch-size 8 --grad-accum 3 --out "$out/one_dense"
grid_matches "--pp 2 --pp-balance measured, a dense layer" pp_dense "$out/one_dense" 2 --config "$out/dense.json" \
    --batch-size 8 "${pp[@]}" --pp-balance measured --save-every 6
grep -q "stages hold layers 0 | 1 (measured: an MoE layer [0-9.]* ms, a dense MLP layer [0-9.]* ms, the head" \
    "$out/pp_dense.log"
check "--pp-balance measured times a dense MLP layer apart" $?
run_ok "the resume of a measured pipeline with a dense layer" "$out/pp_dense_resumed.log" "${launcher[@]}" -np 2 \
    "$bin/moe-train" "${common[@]}" --config "$out/dense.json" --batch-size 8 "${pp[@]}" --pp-balance measured \
    --resume "$out/pp_dense/step-000006" --out "$out/pp_dense_resumed"
[ "$(costs "$out/pp_dense.log")" = "$(costs "$out/pp_dense_resumed.log")" ] &&
    grep -q "(measured by the run --resume continues: an MoE layer [0-9.]* ms, a dense MLP layer" \
        "$out/pp_dense_resumed.log"
check "the resume takes the dense layer's measured cost from the checkpoint" $?
cmp -s <(values loss "$out/pp_dense_resumed") <(values loss "$out/pp_dense" | tail -n +7)
check "the resume of a pipeline whose first stage is a dense layer continues its jitter noise bit for bit" $?
# A model of dense layers only: its --ep ranks are data-parallel ones,
# whose count need divide no number of experts.
sed -e '1s/{/{"moe_dense_layers": [0, 1],/' "$out/one/config.json" >"$out/all_dense.json"
run_ok "one rank, dense layers only" "$out/one_all_dense.log" "$bin/moe-train" "${common[@]}" \
    --config "$out/all_dense.json" --batch-size 6 --out "$out/one_all_dense"
grid_matches "--ep 3 --zero 1 on 3 ranks, dense layers only" ep_all_dense "$out/one_all_dense" 3 \
    --config "$out/all_dense.json" --batch-size 2 --ep 3 --zero 1

run_ok "the resume of a pipeline" "$out/pp_resumed.log" "$bin/moe-train" "${common[@]}" --batch-size 8 \
    --grad-accum 3 --resume "$out/pp/step-000006" --out "$out/pp_resumed"
same_curve "a --pp 2 checkpoint resumed on 1 rank" <(values loss "$out/pp_resumed") \
    <(values loss "$out/one3" | tail -n +7)
run_ok "the resume on a pipeline" "$out/to_pp.log" "${launcher[@]}" -np 2 "$bin/moe-train" "${common[@]}" \
    --batch-size 8 "${pp[@]}" --resume "$out/one3/step-000006" --out "$out/to_pp"
same_curve "a 1-rank checkpoint resumed under --pp 2" <(values loss "$out/to_pp") \
    <(values loss "$out/one3" | tail -n +7)

# Interleaved 1F1B: 2 stages of 2 chunks of a layer each, and its
# checkpoint resumed on one rank.
sed 's/"num_hidden_layers": *[0-9]*/"num_hidden_layers": 4/' "$out/one/config.json" >"$out/four_layers.json"
four=(--config "$out/four_layers.json" --grad-accum 2)
run_ok "one rank, 4 layers, 2 micro-batches" "$out/one4.log" "$bin/moe-train" "${common[@]}" "${four[@]}" \
    --batch-size 8 --out "$out/one4"
grid_matches "--pp 2 --pp-chunks 2 on 2 ranks" pp_chunks "$out/one4" 2 "${four[@]}" --batch-size 8 --pp 2 \
    --pp-chunks 2 --save-every 6
grep -q "interleaved 1f1b, 2 chunks, stages hold layers 0,2 | 1,3" "$out/pp_chunks.log"
check "--pp-chunks 2 says which layers each stage holds" $?
same_kinds "--pp 2 --pp-chunks 2: the per-kind report of 1 rank" "$out/pp_chunks.log" "$out/one4.log"
run_ok "the resume of an interleaved pipeline" "$out/pp_chunks_resumed.log" "$bin/moe-train" "${common[@]}" \
    --grad-accum 2 --batch-size 8 --resume "$out/pp_chunks/step-000006" --out "$out/pp_chunks_resumed"
same_curve "a --pp 2 --pp-chunks 2 checkpoint resumed on 1 rank" <(values loss "$out/pp_chunks_resumed") \
    <(values loss "$out/one4" | tail -n +7)
# An evaluation takes no micro-batches: the default --grad-accum does.
eval_of() { grep -o "val_loss [0-9.]*" "$1"; }
run_ok "--eval-only on an interleaved pipeline" "$out/pp_chunks_eval.log" "${launcher[@]}" -np 2 "$bin/moe-train" \
    --eval-only --init-from "$out/pp_chunks/step-000006" --eval-batches 2 --seq-len 32 --batch-size 8 --pp 2 \
    --pp-chunks 2
run_ok "--eval-only on 1 rank" "$out/one4_eval.log" "$bin/moe-train" --eval-only --init-from \
    "$out/pp_chunks/step-000006" --eval-batches 2 --seq-len 32 --batch-size 8
[ -n "$(eval_of "$out/one4_eval.log")" ] && [ "$(eval_of "$out/pp_chunks_eval.log")" = "$(eval_of "$out/one4_eval.log")" ]
check "--eval-only on an interleaved pipeline gives one rank's val_loss" $?

# Refused before anything is written, naming the flag.
refused() { # name, expected text, np, flags...
    local name=$1 text=$2 np=$3 dir="$out/bad$((++bad))"
    shift 3
    timeout 60 "${launcher[@]}" -np "$np" "$bin/moe-train" "${common[@]}" "$@" --out "$dir" >"$dir.log" 2>&1
    local rc=$?
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -qF -- "$text" "$dir.log" && [ ! -e "$dir" ]
    local status=$?
    check "$name is refused (exit $rc)" "$status"
    [ "$status" -eq 0 ] || tail -n 5 "$dir.log"
}
bad=0
sed 's/"num_hidden_layers": *[0-9]*/"num_hidden_layers": 1/' "$out/one/config.json" >"$out/one_layer.json"
refused "--pp 3 on 2 ranks" "--pp 3 must divide the number of ranks, 2" 2 --pp 3
refused "--pp 2 on a model of 1 layer" "--pp 2: a pipeline needs a layer per stage, and the model has 1 layers" 2 \
    --pp 2 --config "$out/one_layer.json"
refused "--pp 4 on a model of 2 layers" "--pp 4: a pipeline needs a layer per stage, and the model has 2 layers" 4 \
    --pp 4
refused "--pp-schedule foo" "--pp-schedule 'foo': expected 1f1b or gpipe" 1 --pp-schedule foo
refused "--pp 0" "--pp 0 must be positive" 1 --pp 0
refused "--pp-schedule gpipe without --pp" "--pp-schedule gpipe needs --pp > 1" 1 --pp-schedule gpipe
refused "--pp-balance measured without --pp" "--pp-balance measured needs --pp > 1" 1 --pp-balance measured
refused "--pp-balance foo" "--pp-balance 'foo': expected flops or measured" 1 --pp-balance foo
refused "--pp-chunks 2 without --pp" "--pp-chunks 2 needs --pp > 1" 1 --pp-chunks 2
refused "--pp-chunks 2 under gpipe" "--pp-chunks 2 interleaves 1F1B: not with --pp-schedule gpipe" 2 --pp 2 \
    --pp-chunks 2 --grad-accum 2 --pp-schedule gpipe
refused "--pp-chunks 2 with 3 micro-batches on 2 stages" "--grad-accum 3: an interleaved pipeline (--pp-chunks 2) takes" \
    2 --pp 2 --pp-chunks 2 --grad-accum 3
refused "--pp 2 --pp-chunks 2 on a model of 2 layers" "--pp 2 x --pp-chunks 2: each chunk needs a layer, and the model has 2" \
    2 --pp 2 --pp-chunks 2 --grad-accum 2
refused "--pp-chunks 0" "--pp-chunks 0: 1 to 64" 1 --pp-chunks 0

summary
