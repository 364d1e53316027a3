"""The runs of scripts/gpu_selftest.sh, as data: one table the script loops over, the
default test suite dry-runs (tests/scripts/test_gpu_selftest.py) and docs/gpu-path.md
describes, so the 8-GPU layouts are checked against megamoe's rules before a GPU ever
sees them.

Every multi-GPU run trains in bf16 with the grouped GEMM (--moe-grouped-gemm: the torch
grouped-mm kernel on sm90) and flash attention (--use-flash-attn: SDPA's flash kernel)
under NCCL, and is compared with a ONE-GPU bf16 run of the same model (its `ref`) within
the bf16 tolerance of tools/selftest_compare.py (`bf16_rtol`). The router runs in fp32
(--moe-router-dtype fp32, Megatron's flag) so that the only routing differences between
layouts are true near-ties of the bf16 hidden states; the tolerance allows a few of them
(see bf16_rtol).

    python tools/selftest_layouts.py --gpus 8 --work DIR [--dry-run] [--only RE]   the rows:
        name|nproc|ref|resumed_at|env|flags   (ref "-": a reference, compared with nothing)
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass

TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 --seq-length 64 --max-position-embeddings 64 "
        "--normalization RMSNorm --position-embedding-type rope --swiglu "
        "--disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0.0 "
        "--attention-dropout 0.0 --num-experts 4 --moe-router-topk 2 "
        "--moe-ffn-hidden-size 96 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2 "
        "--moe-z-loss-coeff 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--num-workers 0 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
        "--lr-warmup-iters 1 --lr-decay-style cosine --log-interval 1 --eval-interval 1000 "
        "--eval-iters 0 --seed 7 --clip-grad 0.05 --train-iters 6")
BF16 = "--bf16 --use-flash-attn --moe-router-dtype fp32"
# Eight layers (PP4 with two virtual stages each) and 16 samples of one (DP8 at EP4).
TINY8 = (TINY.replace("--num-layers 4", "--num-layers 8")
         .replace("--micro-batch-size 2 --global-batch-size 8",
                  "--micro-batch-size 1 --global-batch-size 16"))
SHARED = ("--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate "
          "--moe-token-dispatcher-type alltoall")
MTP = "--mtp-num-layers 1"
TP2_SP = "--tensor-model-parallel-size 2 --sequence-parallel"
EP_A2A = "--moe-token-dispatcher-type alltoall --expert-model-parallel-size"
DISTOPT_SAVE = ("--use-distributed-optimizer --ckpt-format torch_dist --async-save "
                "--save {work}/ckpt8 --save-interval 3")
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"
# Megatron's requirement for its TP comm overlap (kernel issue order across streams); set
# only for the runs that overlap TP communication with GEMMs (--tp-comm-overlap).
TP_OVERLAP_ENV = "CUDA_DEVICE_MAX_CONNECTIONS=1"


@dataclass(frozen=True)
class Row:
    name: str
    gpus: int  # processes (and the least number of GPUs the script runs it with)
    ref: str  # the run it is compared with ("-": none, it is a reference)
    flags: str
    resumed_at: int = 0  # >0: resumes the ref's checkpoint; compared from this iteration

    @property
    def env(self) -> str:
        return TP_OVERLAP_ENV if "--tp-comm-overlap" in self.flags.split() else ""


def _rows() -> list[Row]:
    b, b8 = f"{TINY} {BF16}", f"{TINY8} {BF16}"
    return [
        # one GPU: the references
        Row("ref_bf16", 1, "-", b), Row("shared_bf16", 1, "-", f"{b} {SHARED}"),
        Row("ref8_bf16", 1, "-", b8), Row("mtp8_bf16", 1, "-", f"{b8} {MTP}"),
        # two GPUs
        Row("tp2_sp", 2, "ref_bf16", f"{b} {TP2_SP}"),
        Row("tp2_sp_comm_overlap", 2, "ref_bf16", f"{b} {TP2_SP} --tp-comm-overlap"),
        Row("ep2_alltoall", 2, "ref_bf16", f"{b} {EP_A2A} 2"),
        Row("ep2_allgather", 2, "ref_bf16",
            f"{b} --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"),
        Row("pp2_1f1b", 2, "ref_bf16", f"{b} --pipeline-model-parallel-size 2"),
        Row("pp2_interleaved", 2, "ref_bf16", f"{b} --pipeline-model-parallel-size 2 "
            "--num-layers-per-virtual-pipeline-stage 1"),
        Row("dp2_distopt", 2, "ref_bf16", f"{b} --use-distributed-optimizer"),
        Row("dp2_distopt_overlap", 2, "ref_bf16", f"{b} --use-distributed-optimizer "
            "--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 20000"),
        Row("cp2_p2p", 2, "ref_bf16", f"{b} --context-parallel-size 2"),
        Row("cp2_a2a", 2, "ref_bf16", f"{b} --context-parallel-size 2 --cp-comm-type a2a"),
        Row("ep2_shared_overlap", 2, "shared_bf16",
            f"{b} {SHARED} --moe-shared-expert-overlap --expert-model-parallel-size 2"),
        Row("tp2_save", 2, "ref_bf16", f"{b} {TP2_SP} --save {{work}}/ckpt_tp2 "
            "--save-interval 3"),
        Row("tp2_resume_1gpu", 1, "tp2_save", f"{b} --load {{work}}/ckpt_tp2 --ckpt-step 3",
            resumed_at=4),
        # four GPUs
        Row("tp2_ep2", 4, "ref_bf16", f"{b} {TP2_SP} --expert-model-parallel-size 2"),
        Row("tp2_pp2", 4, "ref_bf16", f"{b} {TP2_SP} --pipeline-model-parallel-size 2"),
        # eight GPUs (EP4 x EDP2: DP 8, expert-data-parallel 2)
        Row("ep4_edp2_distopt_async_save", 8, "ref8_bf16", f"{b8} {EP_A2A} 4 {DISTOPT_SAVE}"),
        Row("pp4_interleaved", 8, "ref8_bf16", f"{b8} --pipeline-model-parallel-size 4 "
            "--num-layers-per-virtual-pipeline-stage 1"),
        Row("tp2_ep2_pp2", 8, "ref8_bf16", f"{b8} {TP2_SP} --expert-model-parallel-size 2 "
            "--pipeline-model-parallel-size 2 --use-distributed-optimizer"),
        # the EP4 x EDP2 distributed-optimizer checkpoint (iteration 3) at TP2 x EP2 x PP2
        Row("tp2_ep2_pp2_loads_ep4", 8, "ep4_edp2_distopt_async_save",
            f"{b8} {TP2_SP} --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 "
            "--use-distributed-optimizer --ckpt-format torch_dist --load {work}/ckpt8 "
            "--ckpt-step 3", resumed_at=4),
        Row("tp2_comm_overlap_ep4", 8, "ref8_bf16",
            f"{b8} {TP2_SP} --tp-comm-overlap --expert-model-parallel-size 4"),
        Row("ep4_a2a_overlap", 8, "ref8_bf16", f"{b8} {EP_A2A} 4 --moe-a2a-overlap-degree 2"),
        Row("ep4_adaptive", 8, "ref8_bf16", f"{b8} {EP_A2A} 4 --moe-adaptive-parallelism"),
        Row("ep4_mtp", 8, "mtp8_bf16", f"{b8} {MTP} {EP_A2A} 4"),
        Row("ep2_pp2_recompute", 8, "ref8_bf16", f"{b8} {EP_A2A} 2 "
            f"--pipeline-model-parallel-size 2 {RECOMPUTE}"),
    ]


ROWS = _rows()


def rows_for(gpus: int, only: str = "") -> list[Row]:
    """The runs for a machine with `gpus` GPUs, in table order (each after the run it is
    compared with): a run fits when its processes do and its ref is in; a reference is
    in when a run needs it (the 8-GPU family's references only where there are 8).
    `only` (a regular expression) keeps the runs whose name it matches, with the runs
    they are compared with."""
    by_name = {r.name: r for r in ROWS}
    runs: set[str] = set()
    for r in ROWS:
        if r.ref != "-" and r.gpus <= gpus and (by_name[r.ref].ref == "-" or r.ref in runs):
            runs.add(r.name)
    if only:
        wanted = {n for n in runs if re.search(only, n)}
        while True:
            more = {by_name[n].ref for n in wanted if by_name[n].ref in runs} - wanted
            if not more:
                break
            wanted |= more
        runs = wanted
    needed = runs | {by_name[n].ref for n in runs}
    return [r for r in ROWS if r.name in needed]


def argv(row: Row, work: str, dry_run: bool = False) -> list[str]:
    """The row's pretrain_gpt.py flags; a dry run drops what only training needs (the
    checkpoint to load does not exist yet)."""
    words = shlex.split(row.flags.format(work=work))
    if dry_run:
        for flag in ("--load", "--ckpt-step"):
            if flag in words:
                i = words.index(flag)
                del words[i:i + 2]
        words.append("--dry-run")
    return words


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--only", default="", help="regular expression: these runs only")
    opts = p.parse_args()
    for r in rows_for(opts.gpus, opts.only):
        flags = shlex.join(argv(r, opts.work, opts.dry_run))
        print(f"{r.name}|{r.gpus}|{r.ref}|{r.resumed_at}|{r.env}|{flags}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
