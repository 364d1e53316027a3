#!/usr/bin/env bash
# What only a GPU machine can check: run it once on any new cluster or driver/torch stack.
#   bash scripts/gpu_selftest.sh            (uses every visible GPU, up to 8; PYTHON=...)
#   SUBSET=one_gpu bash scripts/gpu_selftest.sh   the one-GPU part only (3-5 min on an H200)
# One GPU: the CUDA kernels against the portable math (grouped GEMM backends, fused Adam
# (apex's when its extensions load), norms, flash attention), host syncs per MoE layer,
# whole bf16 training steps under torch.cuda.set_sync_debug_mode("error") (only the
# sanctioned reads let through, counted: tools/selftest_syncs.py), fp32 training on the
# GPU equal to the CPU's, a tiny Mixtral learning in bf16 (grouped GEMM, flash attention)
# with its tokens/s and MFU, the MoE layer benchmark in bf16, the shared-expert overlap,
# FP8 per recipe the GPU has (its kernel against the reference GEMM, not the fallback; the
# tiny Mixtral in FP8 within 2% of its bf16 loss, tokens/s ratio; blockwise in E4M3 on
# the kernel in all three GEMMs).
# Two or more: every layout of tools/selftest_layouts.py under NCCL, in bf16 with the
# grouped GEMM and flash attention, against the one-GPU bf16 run of the same model within
# bf16_rtol (tools/selftest_compare.py: c * 2**-8 * k at iteration k); 2: TP2+SP (and its
# comm overlap), EP2 all-to-all / all-gather, PP2 1F1B and interleaved, DP2 distributed
# optimizer (overlapped), CP2 p2p and a2a, EP2 shared-expert overlap, a TP2 checkpoint
# resumed on one GPU, sync-debug steps at EP2 all-to-all and PP2; 4: TP2xEP2, TP2xPP2;
# 8: EP4xEDP2 with the distributed optimizer and async save, its checkpoint loaded at
# TP2xEP2xPP2, PP4 interleaved, TP2xEP2xPP2, TP2 comm overlap x EP4, EP4 all-to-all
# overlap, adaptive parallelism, MTP, full recompute (EP2xPP2).
# Prints one line per check (PASS/FAIL name, then its JSON); exits 0 when all pass, 1 when
# any fails, 2 (one line, nothing run) when no CUDA GPU is visible or a setting is wrong.
# Do not source env.sh first: it installs the CPU torch wheel; use the cluster's CUDA torch.
# Settings (environment):
#   SUBSET=all|one_gpu   one_gpu: the one-GPU checks only, even with more GPUs
#   DRYRUN=1             every run's flags through megamoe's rules (--dry-run), no training
#   DETERMINISTIC=1      also Megatron's --deterministic-mode: two runs give the same bits
#                        (NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG=:4096:8, no flash attention)
#   WORK=DIR             logs, results, checkpoints and NCCL flight-recorder dumps
#   ONLY=REGEX           only the multi-GPU runs whose name matches (and what they compare
#                        with), e.g. ONLY='^ep4' to rerun a failed layout
#   DIST_TIMEOUT=MIN     --distributed-timeout-minutes of the multi-GPU runs (default 5):
#                        a hang then dumps NCCL's flight recorder to $WORK/nccl_trace/
# REHEARSAL=N runs the same steps on the CPU as if N GPUs were there (gloo, shorter bf16
# run, no CUDA-only checks), so the script itself is tested where there is no GPU
# (tests/scripts/test_gpu_selftest.py: REHEARSAL=2, and REHEARSAL=8 DRYRUN=1).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
REHEARSAL=${REHEARSAL:-0}
SUBSET=${SUBSET:-all}
DRYRUN=${DRYRUN:-0}
DETERMINISTIC=${DETERMINISTIC:-0}
DIST_TIMEOUT=${DIST_TIMEOUT:-5}
ONLY=${ONLY:-}
case "$SUBSET" in all|one_gpu) ;; *)
  echo "gpu_selftest.sh: SUBSET must be all or one_gpu, got '$SUBSET'" >&2; exit 2;; esac
for v in REHEARSAL DRYRUN DETERMINISTIC DIST_TIMEOUT; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "gpu_selftest.sh: $v must be a whole number, got '${!v}'" >&2; exit 2; }
done
[ "$DIST_TIMEOUT" -ge 1 ] || { echo "gpu_selftest.sh: DIST_TIMEOUT must be at least 1 (minutes)" >&2; exit 2; }
NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
[ "$REHEARSAL" != 0 ] && NGPU=$REHEARSAL
if [ "$NGPU" = "0" ]; then
  echo "gpu_selftest.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); nothing tested" >&2
  exit 2
fi
[ "$NGPU" -gt 8 ] && NGPU=8
[ "$SUBSET" = one_gpu ] && NGPU=1
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK/nccl_trace"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# NCCL's flight recorder: the last collectives of every rank, dumped when the watchdog
# times a collective out (a hang), one file per rank under $WORK/nccl_trace/.
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$WORK/nccl_trace/rank_}
# CUDA_DEVICE_MAX_CONNECTIONS=1 is set per run, only where TP communication overlaps GEMMs
# (--tp-comm-overlap: Megatron's requirement); elsewhere CUDA keeps its default queues.
unset CUDA_DEVICE_MAX_CONNECTIONS
FAILED=0

check() {  # check NAME COMMAND...: run, print PASS/FAIL with the command's last line
  local name=$1 out rc
  shift
  out=$("$@" 2>"$WORK/$name.err")
  rc=$?
  if [ $rc -eq 0 ]; then echo "PASS $name"; else echo "FAIL $name (exit $rc, log $WORK/$name.err)"; FAILED=1; fi
  [ -n "$out" ] && echo "  $(echo "$out" | tail -n 1)"
  [ $rc -ne 0 ] && tail -n 5 "$WORK/$name.err" | sed 's/^/  | /'
  return 0
}

RUN_ENV=""  # VAR=VALUE words for the next launch only (a row's env)
launch() {  # launch NPROC TOOL-ARGS...: the tool in one process or under torchrun
  local nproc=$1
  shift
  # shellcheck disable=SC2086
  if [ "$nproc" = 1 ]; then
    env $RUN_ENV $PY tools/gpu_selftest.py "$@"
  else
    env $RUN_ENV $PY -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
      tools/gpu_selftest.py "$@"
  fi
}
history() {  # history OUT NPROC FLAGS...
  local out=$1 nproc=$2
  shift 2
  launch "$nproc" history "$out" -- "$@"
}
selected() { [ -z "$ONLY" ] || [[ $1 =~ $ONLY ]]; }
rows() {  # the runs of tools/selftest_layouts.py, as name|nproc|ref|resumed_at|env|flags
  $PY tools/selftest_layouts.py --gpus "$NGPU" --work "$WORK" --only "$ONLY"
}

echo "== environment"
$PY tools/gpu_selftest.py env

if [ "$DRYRUN" != 0 ]; then
  echo "== dry runs: every run's flags through megamoe's rules ($NGPU GPU(s))"
  $PY tools/gpu_selftest.py dryrun --gpus "$NGPU" --work "$WORK" || FAILED=1
  echo "== $( [ $FAILED = 0 ] && echo "all dry runs passed" || echo "SOME DRY RUNS FAILED" ) ($NGPU GPU(s))"
  exit $FAILED
fi

TINY=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention
      --num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --normalization RMSNorm
      --position-embedding-type rope --swiglu --disable-bias-linear
      --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0
      --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 96 --moe-grouped-gemm
      --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3
      --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0
      --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 1
      --lr-decay-style cosine --log-interval 1 --eval-interval 1000 --eval-iters 0
      --seed 7 --clip-grad 0.05)
ITERS=(--train-iters 6)
BF16=(--config configs/tiny-mixtral-cpu.yaml --bf16 --use-flash-attn --mock-data
      --tokenizer-type NullTokenizer --vocab-size 256 --num-workers 0 --micro-batch-size 16
      --global-batch-size 32 --train-iters 150 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10
      --lr-decay-style cosine --log-interval 10 --eval-iters 0 --eval-interval 1000
      --log-throughput --seed 1234)
RATIO=0.5
if [ "$REHEARSAL" != 0 ]; then
  BF16=("${TINY[@]}" --bf16 --use-flash-attn --train-iters 10 --lr 1e-2 --log-throughput)
  RATIO=1.0
fi
# The tiny model in bf16 with flash attention and the fp32 router (tools/selftest_layouts.py)
read -r -a TINY_BF16 <<< "$($PY tools/selftest_layouts.py --gpus 2 --work "$WORK" | awk -F'|' '$1 == "ref_bf16" {print $6}')"

echo "== one GPU"
[ "$REHEARSAL" = 0 ] && check kernels $PY tools/gpu_selftest.py kernels
# --transformer-impl transformer_engine against local (skipped, and says so, without TE)
[ "$REHEARSAL" = 0 ] && check transformer_engine $PY tools/gpu_selftest.py te
check fp32_gpu_run history "$WORK/ref.json" 1 "${TINY[@]}" "${ITERS[@]}"
check fp32_cpu_run env CUDA_VISIBLE_DEVICES= $PY tools/gpu_selftest.py history "$WORK/cpu.json" -- "${TINY[@]}" "${ITERS[@]}"
check gpu_equals_cpu_fp32 $PY tools/selftest_compare.py compare "$WORK/cpu.json" "$WORK/ref.json"
# --moe-shared-expert-overlap: the shared expert on its side CUDA stream gives the plain
# layer's losses (docs/shared-expert-overlap.md)
SHARED=(--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate
        --moe-token-dispatcher-type alltoall)
check shared_run history "$WORK/shared.json" 1 "${TINY[@]}" "${ITERS[@]}" "${SHARED[@]}"
check shared_overlap_run history "$WORK/shared_overlap.json" 1 "${TINY[@]}" "${ITERS[@]}" \
  "${SHARED[@]}" --moe-shared-expert-overlap
check shared_overlap_equals_plain $PY tools/selftest_compare.py compare "$WORK/shared.json" \
  "$WORK/shared_overlap.json"
# Steps 2..6 under the sync debug mode "error": 4 MoE layers x 4 micro-batches of dropless
# dispatch counts and the verdict a step; the logging iterations' batched read
check syncs_1gpu launch 1 syncs "$WORK/syncs_1gpu.json" permute.py=16,nonfinite.py=1 -- \
  "${TINY_BF16[@]}"
check bf16_run history "$WORK/bf16.json" 1 "${BF16[@]}"
check bf16_learns $PY tools/selftest_compare.py learns "$WORK/bf16.json" --ratio $RATIO
if [ "$REHEARSAL" = 0 ]; then
  # FP8 (issue 32): each recipe this GPU has (sm89+ tensorwise/rowwise, sm90 blockwise,
  # sm100 mxfp8) on its kernel, equal to the reference GEMM; the bf16 run again in FP8
  # ends within 2% of its loss (tokens/s ratio reported)
  check fp8_kernels $PY tools/gpu_selftest.py fp8
  for r in $($PY tools/gpu_selftest.py fp8-recipes); do
    check "fp8_${r}_run" history "$WORK/fp8_$r.json" 1 "${BF16[@]}" --fp8-format hybrid \
      --fp8-recipe "$r"
    check "fp8_${r}_near_bf16" $PY tools/selftest_compare.py near "$WORK/bf16.json" \
      "$WORK/fp8_$r.json" --rel 0.02
    # blockwise in E4M3 throughout (DeepSeek-V3's choice): torch's block-scaled kernel
    # takes no E5M2 operand, so only then do dgrad and wgrad run on it too; it must learn
    # and no kernel may fall back. (Its loss is not held to 2% of bf16: on an H200 its
    # last-5 mean was 2.5% above, inside the run's own iteration-to-iteration noise.)
    # --fp8-param-gather: the weights live in FP8 in the distributed optimizer (on one GPU
    # too) and the GEMMs read them as cast; its loss stays near the recipe's own run
    if [ "$r" = tensorwise ] || [ "$r" = blockwise ]; then
      check "fp8_${r}_param_gather_run" history "$WORK/fp8_pg_$r.json" 1 "${BF16[@]}" \
        --fp8-format hybrid --fp8-recipe "$r" --use-distributed-optimizer --fp8-param-gather
      check "fp8_${r}_param_gather_near" $PY tools/selftest_compare.py near \
        "$WORK/fp8_$r.json" "$WORK/fp8_pg_$r.json" --rel 0.02
    fi
    if [ "$r" = blockwise ]; then
      check fp8_blockwise_e4m3_run history "$WORK/fp8_bw_e4m3.json" 1 "${BF16[@]}" \
        --fp8-format e4m3 --fp8-recipe blockwise
      check fp8_blockwise_e4m3_learns $PY tools/selftest_compare.py learns \
        "$WORK/fp8_bw_e4m3.json" --ratio $RATIO
      check fp8_blockwise_e4m3_on_kernels bash -c \
        "! grep 'failed its probe' '$WORK/fp8_blockwise_e4m3_run.err'"
    fi
  done
fi
[ "$REHEARSAL" = 0 ] && check moe_layer_bench_bf16 $PY tools/bench_moe_layer.py --device cuda --dtypes bf16 --json --repeats 10
if [ "$DETERMINISTIC" != 0 ]; then
  # Megatron's --deterministic-mode (no flash attention there): two runs, the same bits
  DET=()
  for w in "${TINY_BF16[@]}"; do [ "$w" != --use-flash-attn ] && DET+=("$w"); done
  DET+=(--deterministic-mode)
  for i in 1 2; do
    check "deterministic_run$i" env NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8 \
      $PY tools/gpu_selftest.py history "$WORK/det$i.json" -- "${DET[@]}"
  done
  check deterministic_same_bits $PY tools/selftest_compare.py compare "$WORK/det1.json" \
    "$WORK/det2.json" --rtol-loss 0 --rtol-grad 0
fi

if [ "$NGPU" -ge 2 ]; then
  echo "== $NGPU GPUs, NCCL, bf16 (grouped GEMM, flash attention) against one-GPU bf16"
  while IFS='|' read -r -u 3 name nproc ref resumed envs flags; do
    # shellcheck disable=SC2086  # envs and flags are word lists (no spaces inside a word)
    RUN_ENV=$envs
    check "${name}_run" history "$WORK/$name.json" "$nproc" $flags \
      --distributed-timeout-minutes "$DIST_TIMEOUT"
    RUN_ENV=""
    [ "$ref" = - ] && continue
    if [ "$resumed" != 0 ]; then
      check "${name}_equals_${ref}" $PY tools/selftest_compare.py compare "$WORK/$ref.json" \
        "$WORK/$name.json" --bf16 --resumed-at "$resumed"
    else
      check "${name}_equals_${ref}" $PY tools/selftest_compare.py compare "$WORK/$ref.json" \
        "$WORK/$name.json" --bf16
    fi
  done 3< <(rows)
  echo "== sync debug mode over whole steps, two GPUs"
  # EP2 all-to-all: DP 2, 2 micro-batches a rank: 8 dispatch counts and 8 split sizes
  selected syncs_ep2_alltoall && check syncs_ep2_alltoall launch 2 syncs "$WORK/syncs_ep2.json" \
    permute.py=8,alltoall.py=8,nonfinite.py=1 -- "${TINY_BF16[@]}" \
    --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
  # PP2: each stage 2 MoE layers x 4 micro-batches
  selected syncs_pp2 && check syncs_pp2 launch 2 syncs "$WORK/syncs_pp2.json" permute.py=8,nonfinite.py=1 -- \
    "${TINY_BF16[@]}" --pipeline-model-parallel-size 2
  if [ "$DETERMINISTIC" != 0 ]; then
    DET2=("${DET[@]}" --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall)
    for i in 1 2; do
      check "deterministic_ep2_run$i" env NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8 \
        $PY -m torch.distributed.run --standalone --nproc-per-node 2 tools/gpu_selftest.py \
        history "$WORK/det_ep2_$i.json" -- "${DET2[@]}"
    done
    check deterministic_ep2_same_bits $PY tools/selftest_compare.py compare \
      "$WORK/det_ep2_1.json" "$WORK/det_ep2_2.json" --rtol-loss 0 --rtol-grad 0
  fi
fi
TRACES=$(find "$WORK/nccl_trace" -type f | wc -l)
[ "$TRACES" != 0 ] && echo "NCCL flight-recorder dumps ($TRACES): $WORK/nccl_trace/"
echo "== $( [ $FAILED = 0 ] && echo "all checks passed" || echo "SOME CHECKS FAILED" ) ($NGPU GPU(s), logs in $WORK)"
exit $FAILED
