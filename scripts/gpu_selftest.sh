#!/usr/bin/env bash
# What only a GPU machine can check: run it once on any new cluster or driver/torch stack.
#   bash scripts/gpu_selftest.sh            (uses every visible GPU; PYTHON=... to pick one)
# One GPU: the CUDA kernels against the portable math (grouped GEMM backends, fused Adam,
# norms, flash attention), host syncs per MoE layer, fp32 training on the GPU equal to the
# CPU's, a tiny Mixtral learning in bf16 with its tokens/s and MFU, the MoE layer
# benchmark in bf16, the shared-expert overlap (side stream) against the plain layer. Two
# or more: every layout under NCCL (TP2+SP, EP2 all-to-all, PP2 1F1B
# and interleaved, DP2 distributed optimizer, CP2 p2p ring and a2a; TP2xEP2 and TP2xPP2 on
# four; EP2 with the shared-expert overlap) gives the one-GPU fp32 losses and grad norms,
# and a TP2 checkpoint resumes on one GPU.
# Prints one line per check (PASS/FAIL name, then its JSON); exits 0 when all pass, 1 when
# any fails, 2 (one line, nothing run) when no CUDA GPU is visible. Do not source env.sh
# first: it installs the CPU torch wheel; use the cluster's CUDA torch.
# REHEARSAL=N runs the same steps on the CPU as if N GPUs were there (gloo, shorter bf16
# run, no CUDA-only checks), so the script itself is tested where there is no GPU
# (tests/scripts/test_gpu_selftest.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
REHEARSAL=${REHEARSAL:-0}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
[ "$REHEARSAL" != 0 ] && NGPU=$REHEARSAL
if [ "$NGPU" = "0" ]; then
  echo "gpu_selftest.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); nothing tested" >&2
  exit 2
fi
WORK=${WORK:-$(mktemp -d)}
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
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
history() {  # history OUT NPROC FLAGS...
  local out=$1 nproc=$2
  shift 2
  if [ "$nproc" = 1 ]; then
    $PY tools/gpu_selftest.py history "$out" -- "$@"
  else
    $PY -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
      tools/gpu_selftest.py history "$out" -- "$@"
  fi
}

echo "== environment"
$PY tools/gpu_selftest.py env
BF16=(--config configs/tiny-mixtral-cpu.yaml --bf16 --mock-data --tokenizer-type NullTokenizer
      --vocab-size 256 --num-workers 0 --micro-batch-size 16 --global-batch-size 32
      --train-iters 150 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine
      --log-interval 10 --eval-iters 0 --eval-interval 1000 --log-throughput --seed 1234)
RATIO=0.5
if [ "$REHEARSAL" != 0 ]; then
  BF16=("${TINY[@]}" --bf16 --train-iters 10 --lr 1e-2 --log-throughput)
  RATIO=1.0
fi

echo "== one GPU"
[ "$REHEARSAL" = 0 ] && check kernels $PY tools/gpu_selftest.py kernels
# --transformer-impl transformer_engine against local (skipped, and says so, without TE)
[ "$REHEARSAL" = 0 ] && check transformer_engine $PY tools/gpu_selftest.py te
check fp32_gpu_run history "$WORK/ref.json" 1 "${TINY[@]}" "${ITERS[@]}"
check fp32_cpu_run env CUDA_VISIBLE_DEVICES= $PY tools/gpu_selftest.py history "$WORK/cpu.json" -- "${TINY[@]}" "${ITERS[@]}"
check gpu_equals_cpu_fp32 $PY tools/gpu_selftest.py compare "$WORK/cpu.json" "$WORK/ref.json"
# --moe-shared-expert-overlap: the shared expert on its side CUDA stream gives the plain
# layer's losses (docs/shared-expert-overlap.md)
SHARED=(--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate
        --moe-token-dispatcher-type alltoall)
check shared_run history "$WORK/shared.json" 1 "${TINY[@]}" "${ITERS[@]}" "${SHARED[@]}"
check shared_overlap_run history "$WORK/shared_overlap.json" 1 "${TINY[@]}" "${ITERS[@]}" \
  "${SHARED[@]}" --moe-shared-expert-overlap
check shared_overlap_equals_plain $PY tools/gpu_selftest.py compare "$WORK/shared.json" \
  "$WORK/shared_overlap.json"
check bf16_run history "$WORK/bf16.json" 1 "${BF16[@]}"
check bf16_learns $PY tools/gpu_selftest.py learns "$WORK/bf16.json" --ratio $RATIO
[ "$REHEARSAL" = 0 ] && check moe_layer_bench_bf16 $PY tools/bench_moe_layer.py --device cuda --dtypes bf16 --json --repeats 10

if [ "$NGPU" -ge 2 ]; then
  echo "== two GPUs, NCCL, against the one-GPU fp32 run"
  for layout in "tp2_sp:--tensor-model-parallel-size 2 --sequence-parallel" \
                "ep2_alltoall:--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
                "ep2_allgather:--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather" \
                "pp2_1f1b:--pipeline-model-parallel-size 2" \
                "pp2_interleaved:--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1" \
                "dp2_distopt:--use-distributed-optimizer" \
                "dp2_distopt_overlap:--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 20000" \
                "cp2_p2p:--context-parallel-size 2" \
                "cp2_a2a:--context-parallel-size 2 --cp-comm-type a2a"; do
    name=${layout%%:*}
    # shellcheck disable=SC2086
    check "${name}_run" history "$WORK/$name.json" 2 "${TINY[@]}" "${ITERS[@]}" ${layout#*:}
    check "${name}_equals_1gpu" $PY tools/gpu_selftest.py compare "$WORK/ref.json" "$WORK/$name.json"
  done
  check ep2_shared_overlap_run history "$WORK/ep2_shared_overlap.json" 2 "${TINY[@]}" \
    "${ITERS[@]}" "${SHARED[@]}" --moe-shared-expert-overlap --expert-model-parallel-size 2
  check ep2_shared_overlap_equals_1gpu $PY tools/gpu_selftest.py compare "$WORK/shared.json" \
    "$WORK/ep2_shared_overlap.json"
  echo "== TP2 checkpoint resumed on one GPU"
  CKPT="$WORK/ckpt_tp2"
  check tp2_save history "$WORK/tp2_save.json" 2 "${TINY[@]}" "${ITERS[@]}" \
    --tensor-model-parallel-size 2 --sequence-parallel --save "$CKPT" --save-interval 3
  rm -rf "$CKPT/iter_0000006"
  echo 3 > "$CKPT/latest_checkpointed_iteration.txt"
  check tp2_resume_1gpu history "$WORK/tp2_resume.json" 1 "${TINY[@]}" "${ITERS[@]}" --load "$CKPT"
  check tp2_resume_equals $PY tools/gpu_selftest.py compare "$WORK/tp2_save.json" \
    "$WORK/tp2_resume.json" --resumed-at 4
fi
if [ "$NGPU" -ge 4 ]; then
  echo "== four GPUs"
  for layout in "tp2_ep2:--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2" \
                "tp2_pp2:--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"; do
    name=${layout%%:*}
    # shellcheck disable=SC2086
    check "${name}_run" history "$WORK/$name.json" 4 "${TINY[@]}" "${ITERS[@]}" ${layout#*:}
    check "${name}_equals_1gpu" $PY tools/gpu_selftest.py compare "$WORK/ref.json" "$WORK/$name.json"
  done
fi
echo "== $( [ $FAILED = 0 ] && echo "all checks passed" || echo "SOME CHECKS FAILED" ) ($NGPU GPU(s), logs in $WORK)"
exit $FAILED
