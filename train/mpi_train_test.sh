#!/usr/bin/env bash
# The trainer under mpirun (FSDP, and the ring of experts) against one rank
# without mpirun:
#   mpi_train_test.sh RANKS FP8MOE MPIEXEC [MPIEXEC FLAGS...]
# FP8MOE_MPI_TEST_PARTS=errors runs part 6 alone (ctest's variant under
# load), =all (the default) every part, part 6 first.
# 1. f32 mode, 20 steps, the same global batch (per_device_batch_size=12 on
#    one rank, 12 / RANKS on RANKS): every step's loss within 1e-5 relative
#    of the 1-rank run;
# 2. the default QAT mode (native FP8): within 2e-3. The ranks sum the
#    weight gradients in another order (f32 mode: 1e-8 apart) and a master
#    weight that moves by an ulp can round to another fp8 code, so 20 steps
#    amplify the difference; measured 3.0e-5..1.9e-4 on AVX2 and 1.2e-4..
#    6.7e-4 on AVX-512 with BF16 dot products, 2 and 4 ranks, FSDP and
#    expert-parallel (train_dist_test states the one-step bounds of every
#    mode);
# 3. a checkpoint written by RANKS ranks resumes on one rank and on RANKS
#    ranks and ends within 1e-5 of the uninterrupted run;
# 4. expert parallelism: ici_expert_parallelism=RANKS (and 2 x 2 on 4 ranks)
#    in f32 within 1e-5 and native FP8 within 2e-3 of one rank; with a
#    static buffer (ragged_buffer_factor=1) that overflows on some steps (the
#    ranks rerun dropless together) still within 1e-5; a checkpoint of the
#    expert-parallel run resumes on one rank within 1e-5; with
#    num_moe_token_chunks=3 within 1e-5;
# 5. memory: rank 0's peak on RANKS expert-parallel ranks (and 2 x 2) is at
#    most a stated fraction of one rank's, and within its per-rank memory
#    plan; a memory cap that refuses the model on one rank lets it train on
#    RANKS;
# 6. a layout that does not fit the job, experts that do not divide over
#    ici_expert_parallelism, flags that differ across ranks, a save that
#    fails on rank 0, a run directory another job holds, and ranks that see
#    different checkpoints (or none) are errors on every rank, exit 2; a
#    rank that hangs ends the job within FP8MOE_COMM_TIMEOUT seconds.
set -euo pipefail
ranks=$1 fp8moe=$2 mpiexec=$3
shift 3
parts=${FP8MOE_MPI_TEST_PARTS:-all}
if [ "$parts" != all ] && [ "$parts" != errors ]; then
  echo "FP8MOE_MPI_TEST_PARTS=$parts: write all or errors"
  exit 2
fi
mpi=("$mpiexec" -np "$ranks" "$@")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
tiny=(base_output_directory="$dir" base_emb_dim=16 base_num_decoder_layers=2
      base_num_query_heads=2 head_dim=8 base_moe_mlp_dim=16 max_target_length=16
      vocab_size=40 synthetic_alphabet_size=8 steps=20
      eval_interval=10 eval_steps=2 log_period=5 checkpoint_period=8
      warmup_steps_fraction=0 cosine_learning_rate_final_fraction=1)
# The same global batch of 12 on one rank and on RANKS ranks:
# per_device_batch_size counts one rank's sequences (MaxText's meaning).
one=(per_device_batch_size=12)
many=(per_device_batch_size=$(( 12 / ranks )))
# (A constant learning rate: the resume test's first part runs steps=8 and
# the schedule must not depend on `steps`.)
f32=(fp8_moe_fake_quant=false fp8_fake_quant_hoist= fp8_moe_native_fwd=false
     fp8_moe_native_bwd_dlhs=false dtype=float32)
# An expert-heavy model (experts 97% of its 1.6M parameters), 2 steps and a
# checkpoint (the memory test, and a save that fails).
big=(base_output_directory="$dir" base_emb_dim=64 base_num_decoder_layers=2
     base_num_query_heads=2 head_dim=32 base_moe_mlp_dim=512 num_experts=8 vocab_size=64
     max_target_length=16 steps=2 checkpoint_period=2
     eval_interval=0 log_period=1)
big_one=(per_device_batch_size=4)
big_many=(per_device_batch_size=$(( 4 / ranks )))
export OMP_NUM_THREADS=1

# compare RUN_A RUN_B BOUND [FIRST_STEP]: losses of metrics.jsonl
compare() {
  python3 - "$dir/$1/metrics.jsonl" "$dir/$2/metrics.jsonl" "$3" "${4:-1}" <<'EOF'
import json, sys
a = {j["step"]: j for j in map(json.loads, open(sys.argv[1]))}
b = {j["step"]: j for j in map(json.loads, open(sys.argv[2]))}
bound, first = float(sys.argv[3]), int(sys.argv[4])
steps = [s for s in sorted(a) if s >= first]
assert steps and steps == [s for s in sorted(b) if s >= first], (sorted(a), sorted(b))
worst = max(abs(a[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"]) for s in steps)
ev = [s for s in steps if "eval_loss" in a[s]]
worst_eval = max(abs(a[s]["eval_loss"] - b[s]["eval_loss"]) / b[s]["eval_loss"] for s in ev)
print(f"  {sys.argv[1].split('/')[-2]} vs {sys.argv[2].split('/')[-2]}: {len(steps)} steps, "
      f"max relative loss difference {worst:.3g}, eval {worst_eval:.3g} (bound {bound:g})")
sys.exit(0 if worst < bound and worst_eval < bound else 1)
EOF
}

# expect_error WHAT GREP COMMAND...: a non-zero exit and the message from every rank
expect_error() {
  local what=$1 pattern=$2
  shift 2
  set +e
  "${mpi[@]}" "$@" > "$dir/out" 2> "$dir/err"
  local rc=$?
  set -e
  local n
  n=$(grep -c "error: .*$pattern" "$dir/err" || true)
  echo "  $what: exit $rc, the message on $n of $ranks ranks"
  if [ "$rc" -eq 0 ] || [ "$n" -ne "$ranks" ]; then
    cat "$dir/err"
    exit 1
  fi
}
echo "== errors on every rank"
expect_error "ici_fsdp_parallelism=$((ranks + 1))" "ici_fsdp_parallelism" \
  "$fp8moe" train "${tiny[@]}" "${many[@]}" run_name=bad ici_fsdp_parallelism=$((ranks + 1))
expect_error "num_experts=3, ici_expert_parallelism=$ranks" \
  "num_experts=3 does not divide over ici_expert_parallelism=$ranks" \
  "$fp8moe" train "${tiny[@]}" "${many[@]}" run_name=bad ici_expert_parallelism=$ranks num_experts=3
# Each rank its own learning rate (Open MPI names the rank in the environment).
expect_error "flags that differ across ranks" "config fingerprint.*first flag that differs is 'learning_rate'" \
  bash -c 'exec "$0" train "$@" learning_rate=$((OMPI_COMM_WORLD_RANK + 1))e-3' \
  "$fp8moe" "${tiny[@]}" "${many[@]}" run_name=bad
# More token chunks than a rank's 12/N x S tokens (fine on one rank): refused
# before any work, not at the first step.
expect_error "num_moe_token_chunks past a rank's tokens" \
  "num_moe_token_chunks=$(( 12 / ranks * 16 + 1 )) exceeds the $(( 12 / ranks * 16 )) tokens" \
  "$fp8moe" train "${tiny[@]}" "${many[@]}" run_name=bad num_moe_token_chunks=$(( 12 / ranks * 16 + 1 ))
# A save that fails on rank 0 part way through the file (an 8 MiB file-size
# limit on rank 0 alone, the checkpoint is 19 MB; not less, or Open MPI's
# own 4 MiB shared-memory segment (btl_vader_segment_size) fails to be made
# and its warning can swallow a rank's message): rank 0 keeps gathering
# the remaining tensors with the others, every rank exits 2 naming the save,
# and no checkpoint or temporary file is left.
expect_error "a save that fails on rank 0" "save the checkpoint of step 2" \
  bash -c 'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then trap "" XFSZ; ulimit -f 8192; fi
           exec "$0" train "$@"' "$fp8moe" "${big[@]}" "${big_many[@]}" run_name=save_fails
test -z "$(ls -A "$dir/save_fails/checkpoints")"
# A run directory that another job holds (here this script holds its lock, on
# fd 9: the trainer's own open of the file is another description, so its
# flock fails): refused on every rank, and no rank touches the directory: the
# temporary file of the other job's save in progress stays (rank 1 of a
# refused job used to delete it, ending the other job's save).
mkdir -p "$dir/locked/checkpoints"
touch "$dir/locked/checkpoints/step_00000004.safetensors.tmp.1.1"
exec 9> "$dir/locked/train.lock"
flock 9
expect_error "a run directory another job holds" "run directory '$dir/locked'" \
  "$fp8moe" train "${tiny[@]}" "${many[@]}" run_name=locked
exec 9>&-
test -e "$dir/locked/checkpoints/step_00000004.safetensors.tmp.1.1"
# Ranks that see different run directories (each its own working directory,
# the same relative base_output_directory): rank 0 names the checkpoint, and
# ranks that read other bits there, or no file, stop on every rank before a
# step (they used to train from different weights until an MPI error).
for r in $(seq 0 $((ranks - 1))); do
  mkdir -p "$dir/wd$r"
  (cd "$dir/wd$r" && "$fp8moe" train "${tiny[@]}" "${one[@]}" "${f32[@]}" base_output_directory=runs \
     run_name=split steps=4 checkpoint_period=4 data_shuffle_seed=$(( r == 0 ? 1 : 2 )) \
     > /dev/null)
done
expect_error "ranks that read different checkpoints" "read different files" \
  bash -c 'cd "$0/wd$OMPI_COMM_WORLD_RANK" && exec "$1" train "${@:2}"' "$dir" "$fp8moe" \
  "${tiny[@]}" "${many[@]}" "${f32[@]}" base_output_directory=runs run_name=split data_shuffle_seed=1
rm -rf "$dir/wd$((ranks - 1))/runs"
expect_error "a rank without the checkpoint" "could not resume from\|cannot resume" \
  bash -c 'cd "$0/wd$OMPI_COMM_WORLD_RANK" && exec "$1" train "${@:2}"' "$dir" "$fp8moe" \
  "${tiny[@]}" "${many[@]}" "${f32[@]}" base_output_directory=runs run_name=split data_shuffle_seed=1
# A rank that hangs (SIGSTOP after 2 s): FP8MOE_COMM_TIMEOUT=2 ends the job
# within seconds, rank 0 naming the collective (the default waits 600 s).
start=$(date +%s)
set +e
FP8MOE_COMM_TIMEOUT=2 timeout 120 "${mpi[@]}" bash -c \
  'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then (sleep 2; kill -STOP $$) & fi; exec "$0" train "$@"' \
  "$fp8moe" "${tiny[@]}" "${many[@]}" run_name=hang steps=1000000 enable_checkpointing=false \
  > /dev/null 2> "$dir/err"
rc=$?
set -e
took=$(( $(date +%s) - start ))
echo "  a rank stopped with FP8MOE_COMM_TIMEOUT=2: exit $rc after ${took} s"
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$took" -gt 60 ] ||
   ! grep -q "rank 0/$ranks: .* did not finish within 2 s (a peer rank died or hangs)" "$dir/err"; then
  cat "$dir/err"
  exit 1
fi
if [ "$parts" = errors ]; then
  echo "ok"
  exit 0
fi

echo "== f32: $ranks ranks vs 1"
"$fp8moe" train "${tiny[@]}" "${one[@]}" "${f32[@]}" run_name=f32_one > /dev/null
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${f32[@]}" run_name=f32_many > /dev/null
compare f32_many f32_one 1e-5

echo "== native FP8 QAT: $ranks ranks vs 1"
"$fp8moe" train "${tiny[@]}" "${one[@]}" run_name=qat_one > /dev/null
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" run_name=qat_many > /dev/null
compare qat_many qat_one 2e-3

echo "== resume: a checkpoint of $ranks ranks (step 8) on 1 and on $ranks ranks"
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${f32[@]}" run_name=resume_a steps=8 > /dev/null
cp -r "$dir/resume_a" "$dir/resume_b"
"$fp8moe" train "${tiny[@]}" "${one[@]}" "${f32[@]}" run_name=resume_a > /dev/null
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${f32[@]}" run_name=resume_b > /dev/null
compare resume_a f32_one 1e-5 9
compare resume_b f32_one 1e-5 9
test "$(ls "$dir/resume_b/checkpoints")" = "$(printf 'step_00000016.safetensors\nstep_00000020.safetensors')"

echo "== expert parallelism: ici_expert_parallelism=$ranks vs 1 rank"
ep=(ici_fsdp_parallelism=1 ici_expert_parallelism=$ranks)
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${f32[@]}" "${ep[@]}" run_name=ep_f32 > /dev/null
compare ep_f32 f32_one 1e-5
if [ "$ranks" -eq 4 ]; then
  "${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${f32[@]}" ici_fsdp_parallelism=2 \
    ici_expert_parallelism=2 run_name=ep_f2p2 > /dev/null
  compare ep_f2p2 f32_one 1e-5
fi
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${ep[@]}" run_name=ep_qat > /dev/null
compare ep_qat qat_one 2e-3
# A static buffer of 1 x the balanced share: on some steps some rank's
# experts get more pairs, and every rank reruns dropless; the losses do not
# change.
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${f32[@]}" "${ep[@]}" ragged_buffer_factor=1 \
  run_name=ep_overflow > /dev/null
compare ep_overflow f32_one 1e-5
python3 - "$dir/ep_overflow/metrics.jsonl" "$ranks" <<'EOF'
import json, sys
r = [j.get("dropless_reruns", 0) for j in map(json.loads, open(sys.argv[1])) if "loss" in j]
print(f"  ragged_buffer_factor=1: dropless reruns per logged step {r}")
assert sum(r) > 0 and all(x % int(sys.argv[2]) == 0 for x in r), r
EOF
# num_moe_token_chunks: the next chunk's dispatch on a helper thread (MPI
# from two threads of a rank, one at a time) while this chunk's GMMs run.
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${f32[@]}" "${ep[@]}" num_moe_token_chunks=3 \
  run_name=ep_chunks > /dev/null
compare ep_chunks f32_one 1e-5
"${mpi[@]}" "$fp8moe" train "${tiny[@]}" "${many[@]}" "${f32[@]}" "${ep[@]}" run_name=ep_resume steps=8 > /dev/null
"$fp8moe" train "${tiny[@]}" "${one[@]}" "${f32[@]}" run_name=ep_resume > /dev/null
compare ep_resume f32_one 1e-5 9

echo "== memory: rank 0 holds its share of the model"
# The expert-heavy model (big, above); rank 0's peak_bytes (the allocations it tracks after setup,
# the save included) against one rank's. Measured on 2 ranks (P = 2) 0.55,
# on 4 (P = 4) 0.31 and 2 x 2 0.41; before the masters, moments and
# expert tensors were kept per rank (and checkpoints streamed) 0.81, 0.70 and
# 0.74.
"$fp8moe" train "${big[@]}" "${big_one[@]}" run_name=mem_one > /dev/null
"${mpi[@]}" "$fp8moe" train "${big[@]}" "${big_many[@]}" "${ep[@]}" run_name=mem_ep > /dev/null
layouts="mem_ep"
if [ "$ranks" -eq 4 ]; then
  "${mpi[@]}" "$fp8moe" train "${big[@]}" "${big_many[@]}" ici_fsdp_parallelism=2 ici_expert_parallelism=2 \
    run_name=mem_f2p2 > /dev/null
  layouts="mem_ep mem_f2p2"
fi
python3 - "$dir" "$ranks" $layouts <<'EOF'
import json, sys
get = lambda run, key: json.load(open(f"{sys.argv[1]}/{run}/summary.json"))[key]
one, ranks = get("mem_one", "peak_bytes"), int(sys.argv[2])
bound = {"mem_ep": 0.65 if ranks == 2 else 0.45, "mem_f2p2": 0.5}
for run in ["mem_one"] + sys.argv[3:]:
    peak, plan = get(run, "peak_bytes"), get(run, "memory_plan_bytes")
    r = peak / one
    print(f"  {run}: peak {peak} bytes, {r:.3f} of one rank's (bound {bound.get(run, 1)}); "
          f"the rank's memory plan {plan} bytes ({plan / peak:.2f}x the peak)")
    assert r <= bound.get(run, 1) and peak <= plan <= 8 * peak, run
EOF
# The plan is per rank: a memory cap between the N-rank plan and the
# 1-rank one refuses the run on one rank (exit 2, before any work) and
# lets it run on N.
read -r plan_one plan_many <<< "$(python3 -c 'import json, sys
print(*(json.load(open(f"{sys.argv[1]}/{r}/summary.json"))["memory_plan_bytes"]
        for r in ("mem_one", "mem_ep")))' "$dir")"
cap=$(( (plan_one + plan_many) / 2 ))
set +e
FP8MOE_MEMORY_CAP=$cap "$fp8moe" train "${big[@]}" "${big_one[@]}" run_name=mem_cap_one > /dev/null 2> "$dir/err"
rc=$?
set -e
echo "  FP8MOE_MEMORY_CAP=$cap: one rank exits $rc"
test "$rc" -eq 2 && grep -q "memory cap" "$dir/err"
FP8MOE_MEMORY_CAP=$cap "${mpi[@]}" "$fp8moe" train "${big[@]}" "${big_many[@]}" "${ep[@]}" \
  run_name=mem_cap_many > /dev/null
echo "  FP8MOE_MEMORY_CAP=$cap: $ranks expert-parallel ranks train"

echo "ok"
