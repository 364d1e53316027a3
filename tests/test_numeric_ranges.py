"""Every numeric flag has its range: a value outside it stops the launch with one line naming
the flag (exit 2, no traceback from torch.optim, numpy or a division), and the edge values
Megatron-LM accepts are accepted."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import build_parser, parse_args
from megamoe.cli.unbuilt_args import UNBUILT_DEST
from megamoe.cli.value_types import finite_float
from tests.flags import parse_error

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data")
MOE = "--num-experts 8 --moe-router-topk 2"
PP2 = "--pipeline-model-parallel-size 2"

# (flag, bad value, extra flags it needs, world size, what the message says about it)
BAD = [
    # model
    ("--num-layers", "0", "", 1, "must be positive"),
    ("--hidden-size", "-64", "", 1, "must be positive"),
    ("--ffn-hidden-size", "0", "", 1, "must be positive"),
    ("--num-attention-heads", "0", "", 1, "must be positive"),
    ("--kv-channels", "0", "", 1, "must be positive"),
    ("--num-query-groups", "0", "--group-query-attention", 1, "must be positive"),
    ("--seq-length", "0", "", 1, "must be positive"),
    ("--max-position-embeddings", "-1", "", 1, "must be positive"),
    ("--rotary-base", "0", "--position-embedding-type rope", 1, "must be > 0"),
    ("--rotary-percent", "0", "--position-embedding-type rope", 1, "must be in (0, 1]"),
    ("--rotary-percent", "1.5", "--position-embedding-type rope", 1, "must be in (0, 1]"),
    ("--norm-epsilon", "-1e-5", "", 1, "must be >= 0"),
    ("--mtp-num-layers", "0", "", 1, "must be positive"),
    ("--q-lora-rank", "0", "--multi-latent-attention", 1, "must be positive"),
    ("--kv-lora-rank", "0", "--multi-latent-attention", 1, "must be positive"),
    ("--qk-head-dim", "0", "--multi-latent-attention", 1, "must be positive"),
    ("--qk-pos-emb-head-dim", "0", "--multi-latent-attention", 1, "must be positive"),
    ("--v-head-dim", "-1", "--multi-latent-attention", 1, "must be positive"),
    ("--rotary-scaling-factor", "0", "--multi-latent-attention", 1, "must be > 0"),
    ("--mscale", "-1", "--multi-latent-attention", 1, "must be >= 0"),
    ("--mscale-all-dim", "-0.5", "--multi-latent-attention", 1, "must be >= 0"),
    ("--mtp-loss-scaling-factor", "-0.1", "--mtp-num-layers 1", 1, "must be >= 0"),
    ("--hidden-dropout", "1.0", "", 1, "must be in [0, 1)"),
    ("--hidden-dropout", "-0.1", "", 1, "must be in [0, 1)"),
    ("--attention-dropout", "1.5", "", 1, "must be in [0, 1)"),
    ("--init-method-std", "-0.02", "", 1, "must be >= 0"),
    ("--make-vocab-size-divisible-by", "0", "", 1, "must be positive"),
    ("--rope-scaling-factor", "0", "--position-embedding-type rope --use-rope-scaling", 1,
     "must be > 0"),
    # mixture of experts
    ("--num-experts", "-4", "", 1, "must be positive"),
    ("--expert-model-parallel-size", "0", MOE, 1, "must be positive"),
    ("--expert-tensor-parallel-size", "0", MOE, 1, "must be positive"),
    ("--moe-ffn-hidden-size", "0", MOE, 1, "must be positive"),
    ("--moe-router-topk", "0", MOE, 1, "must be between 1 and --num-experts"),
    ("--moe-router-topk-scaling-factor", "0", MOE, 1, "must be > 0"),
    ("--moe-router-num-groups", "0", f"{MOE} --moe-router-group-topk 1", 1,
     "must be divisible by --moe-router-num-groups"),
    ("--moe-router-group-topk", "0", f"{MOE} --moe-router-num-groups 2", 1,
     "must be between 1 and --moe-router-num-groups"),
    ("--moe-router-bias-update-rate", "-1e-3", MOE, 1, "must be >= 0"),
    ("--moe-aux-loss-coeff", "-1e-2", MOE, 1, "must be >= 0"),
    ("--moe-z-loss-coeff", "-1e-3", MOE, 1, "must be >= 0"),
    ("--moe-input-jitter-eps", "1.0", MOE, 1, "must be in [0, 1)"),
    ("--moe-input-jitter-eps", "-0.1", MOE, 1, "must be in [0, 1)"),
    ("--moe-expert-capacity-factor", "0", MOE, 1, "a factor > 0, or a negative one"),
    ("--moe-shared-expert-intermediate-size", "0", MOE, 1, "must be positive"),
    ("--moe-a2a-overlap-degree", "0", MOE, 1, "must be >= 1"),
    # data
    ("--vocab-size", "0", "", 1, "must be positive"),
    ("--null-tokenizer-eod-id", "-1", "", 1, "must be >= 0"),
    ("--null-tokenizer-eod-id", "100", "--vocab-size 100", 1, "must be in [0, --vocab-size"),
    ("--num-workers", "-1", "", 1, "must be >= 0"),
    # checked when the flags are parsed, not after the model is built (issue 26, item 7)
    ("--split", "1,2,3,4", "", 1, "expected up to 3 non-negative numbers"),
    ("--split", "a,b", "", 1, "expected up to 3 numbers"),
    ("--split", "0,0,0", "", 1, "not all 0"),
    ("--split", "nan,1", "", 1, "non-negative numbers"),
    # as Megatron, for every position embedding type (RoPE too)
    ("--max-position-embeddings", "16", "--position-embedding-type rope", 1,
     "--seq-length (32) exceeds"),
    # training
    ("--micro-batch-size", "0", "", 1, "must be positive"),
    ("--global-batch-size", "0", "", 1, "must be positive"),
    ("--train-iters", "-1", "", 1, "must be >= 0"),
    ("--seed", "-1", "", 1, "must be in [0, 4.29497e+09)"),
    ("--eval-interval", "0", "", 1, "must be positive"),
    ("--eval-iters", "-1", "", 1, "must be >= 0"),
    ("--exit-interval", "0", "", 1, "must be positive"),
    ("--exit-duration-in-mins", "0", "", 1, "must be positive"),
    ("--initial-loss-scale", "0", "--fp16", 1, "must be in (0, 3.40282e+38]"),
    ("--loss-scale", "-1", "--fp16", 1, "must be in [0, 3.40282e+38]"),
    ("--min-loss-scale", "0", "--fp16", 1, "must be in (0, 3.40282e+38]"),
    ("--initial-loss-scale", "1e39", "--fp16", 1, "must be in (0, 3.40282e+38]"),
    ("--loss-scale", "1e39", "--fp16", 1, "must be in [0, 3.40282e+38]"),
    ("--min-loss-scale", "8", "--fp16 --initial-loss-scale 4", 1, "must not exceed"),
    ("--loss-scale-window", "0", "--fp16", 1, "must be >= 1"),
    ("--loss-scale-window", "2.5", "--fp16", 1, "must be a whole number"),
    ("--hysteresis", "0", "--fp16", 1, "must be >= 1"),
    ("--distributed-timeout-minutes", "0", "", 1, "must be positive"),
    ("--empty-unused-memory-level", "3", "", 1, "invalid choice"),
    # optimizer and learning rate
    ("--lr", "-1", "", 1, "must be >= 0"),
    ("--min-lr", "-1e-5", "", 1, "must be >= 0"),
    ("--min-lr", "1e-2", "", 1, "must not exceed --lr"),
    ("--lr-decay-iters", "0", "", 1, "must be positive"),
    ("--lr-warmup-iters", "-1", "", 1, "must be >= 0"),
    ("--lr-warmup-fraction", "1.0", "", 1, "must be in [0, 1)"),
    ("--lr-warmup-fraction", "0.1", "--lr-warmup-iters 1", 1, "are mutually exclusive"),
    ("--lr-warmup-init", "-1e-3", "", 1, "must be >= 0"),
    ("--lr-warmup-init", "1e-2", "", 1, "must not exceed --lr"),
    ("--lr-wsd-decay-iters", "0", "", 1, "must be positive"),
    ("--decoupled-lr", "-1e-3", "", 1, "must be >= 0"),
    ("--decoupled-min-lr", "-1e-5", "--decoupled-lr 1e-3", 1, "must be >= 0"),
    ("--decoupled-min-lr", "1e-2", "--decoupled-lr 1e-3", 1, "must not exceed --decoupled-lr"),
    ("--decoupled-min-lr", "1e-5", "", 1, "needs --decoupled-lr"),
    ("--weight-decay", "-0.1", "", 1, "must be >= 0"),
    ("--adam-beta1", "1.0", "", 1, "must be in [0, 1)"),
    ("--adam-beta2", "-0.5", "", 1, "must be in [0, 1)"),
    ("--adam-eps", "0", "", 1, "must be > 0"),
    ("--sgd-momentum", "-0.9", "--optimizer sgd", 1, "must be >= 0"),
    ("--clip-grad", "-1", "", 1, "must be >= 0"),
    # parallelism
    ("--tensor-model-parallel-size", "0", "", 1, "must be positive"),
    ("--padded-vocab-size", "0", "", 1, "must be positive"),
    ("--padded-vocab-size", "1042", "--tensor-model-parallel-size 4 --sequence-parallel", 4,
     "must be divisible by --tensor-model-parallel-size"),
    ("--pipeline-model-parallel-size", "-1", "", 1, "must be positive"),
    ("--context-parallel-size", "0", "", 1, "must be positive"),
    ("--num-layers-per-virtual-pipeline-stage", "0", PP2, 2, "must be positive"),
    ("--decoder-first-pipeline-num-layers", "0", PP2, 2, "must be positive"),
    ("--decoder-last-pipeline-num-layers", "-1", PP2, 2, "must be positive"),
    ("--num-virtual-stages-per-pipeline-rank", "0", PP2, 2, "must be positive"),
    ("--num-virtual-stages-per-pipeline-rank", "3", PP2, 2,
     "layers of each pipeline rank (2) must be divisible"),
    ("--pipeline-model-parallel-layout", "Et|tX", PP2, 2, "invalid layer character 'X'"),
    ("--pipeline-model-parallel-layout", "Et|t*99999999L", PP2, 2, "repeat count"),
    ("--pipeline-model-parallel-layout", "(Et|t*999999L)*999", PP2, 2, "unrolls to"),
    ("--pipeline-model-parallel-layout", "Et|t*4L", PP2, 2, "5 transformer layers 't'"),
    ("--pipeline-model-parallel-layout", "Et|t|tL", PP2, 2, "number of stages (3)"),
    # checkpointing and logging
    ("--save-interval", "0", "--save /tmp/megamoe-never-written", 1, "must be positive"),
    ("--ckpt-keep-last", "0", "--save /tmp/megamoe-never-written", 1, "must be positive"),
    ("--save-retain-interval", "0", "--save /tmp/megamoe-never-written --save-interval 1", 1,
     "must be positive"),
    ("--save-retain-interval", "3", "--save /tmp/megamoe-never-written --save-interval 2", 1,
     "must be a multiple of --save-interval (2)"),
    ("--ckpt-step", "0", "--load /tmp/megamoe-never-written", 1, "must be positive"),
    # every float flag is finite (a bad example of each kind)
    ("--lr", "inf", "", 1, "must be a finite number"),
    ("--min-lr", "nan", "", 1, "must be a finite number"),
    ("--clip-grad", "Infinity", "", 1, "must be a finite number"),
    ("--moe-aux-loss-coeff", "-inf", MOE, 1, "must be a finite number"),
    ("--moe-z-loss-coeff", "nan", MOE, 1, "must be a finite number"),
    ("--ckpt-step", "3", "", 1, "needs --load"),
    ("--log-interval", "0", "", 1, "must be positive"),
    ("--tensorboard-log-interval", "0", "", 1, "must be positive"),
    ("--log-first-iterations", "-1", "", 1, "must be >= 0"),
    ("--peak-tflops", "-1", "", 1, "must be positive"),
    ("--timing-log-level", "2", "", 1, "not supported yet"),
    ("--logging-level", "-1", "", 1, "must be >= 0"),
    ("--local-rank", "-1", "", 1, "--local-rank must be >= 0"),
    ("--profile-step-start", "-1", "", 1, "must be >= 0"),
    ("--profile-step-end", "10", "--profile-step-start 10", 1, "must be greater than"),
    ("--profile-ranks", "-1", "", 1, "must be >= 0"),
    ("--start-weight-decay", "-0.1",
     "--weight-decay-incr-style linear --end-weight-decay 0.1", 1, "must be >= 0"),
    ("--end-weight-decay", "-0.1",
     "--weight-decay-incr-style linear --start-weight-decay 0.1", 1, "must be >= 0"),
    ("--manual-gc-interval", "-1", "--manual-gc", 1, "must be >= 0"),
    ("--ddp-bucket-size", "0", "--overlap-grad-reduce", 1, "must be positive"),
    ("--recompute-num-layers", "0", "--recompute-granularity full --recompute-method uniform",
     1, "must be >= 1"),
    # FP8
    ("--fp8-margin", "-1", "--fp8-format hybrid", 1, "must be an integer in [0, 64]"),
    ("--fp8-margin", "65", "--fp8-format hybrid", 1, "must be an integer in [0, 64]"),
    ("--fp8-amax-history-len", "0", "--fp8-format hybrid", 1,
     "must be an integer in [1, 65536]"),
    ("--fp8-amax-history-len", "65537", "--fp8-format hybrid", 1,
     "must be an integer in [1, 65536]"),
    ("--fp8-interval", "0", "", 1, "megamoe accepts only 1"),
    ("--num-layers-at-start-in-bf16", "-1", "", 1, "must be an integer >= 0"),
    ("--num-layers-at-end-in-bf16", "-1", "", 1, "must be an integer >= 0"),
    ("--num-layers-at-start-in-bf16", "5",
     "--fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16", 1,
     "number of layers per pipeline stage (4)"),
    ("--num-layers-at-end-in-bf16", "3",
     f"{PP2} --fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16", 2,
     "number of layers per pipeline stage (2)"),
    # run health (Megatron takes the iteration modulo it)
    ("--check-weight-hash-across-dp-replicas-interval", "0", "", 1, "must be positive"),
    ("--check-weight-hash-across-dp-replicas-interval", "-2", "", 1, "must be positive"),
]

# Flags whose range another rule covers (not supported yet whatever the value), or that are
# not numeric ranges at all.
COVERED_ELSEWHERE = {
    # refused with "not supported yet" for any value (config/unsupported.py)
    "--error-injection-rate",
    "--rotary-seq-len-interpolation-factor", "--null-tokenizer-pad-id",
    # sample-based training: its own rules (tests/training/test_train_samples.py::
    # test_refused_in_one_line)
    "--train-samples", "--rampup-batch-size", "--lr-decay-samples", "--lr-warmup-samples",
    "--lr-wsd-decay-samples",
}


@pytest.mark.parametrize("flag,value,extra,world,says", BAD,
                         ids=[f"{f}={v}" for f, v, *_ in BAD])
def test_out_of_range_value_is_one_line_naming_the_flag(capsys, flag, value, extra, world,
                                                        says):
    err = parse_error(capsys, f"{BASE} {extra} {flag}={value}", world)
    assert flag in err and says in err, err


def test_every_float_flag_is_finite(capsys):
    """inf / nan of every float flag: one line naming the flag, exit 2."""
    floats = [a.option_strings[0] for a in build_parser()._actions if a.type is finite_float]
    assert len(floats) > 25
    for flag in floats:
        for bad in ("inf", "-inf", "nan"):
            err = parse_error(capsys, f"{BASE} {MOE} {flag}={bad}", 1)
            assert flag in err and "must be a finite number" in err, err


def test_every_numeric_flag_has_a_range_case():
    numeric = {a.option_strings[0] for a in build_parser()._actions  # (refused ones: none)
               if a.type in (int, finite_float) and not a.dest.startswith(UNBUILT_DEST)}
    missing = numeric - {f for f, *_ in BAD} - COVERED_ELSEWHERE
    assert not missing, f"numeric flags without a bad-value case: {sorted(missing)}"


# Edge values Megatron-LM accepts (and what they mean there): accepted here too.
GOOD = [
    "--clip-grad 0",  # no clipping
    "--weight-decay 0", "--hidden-dropout 0 --attention-dropout 0", "--init-method-std 0",
    "--adam-beta1 0 --adam-beta2 0", "--lr 0", "--min-lr 1e-3", "--lr-warmup-init 1e-3",
    "--lr-warmup-fraction 0", "--decoupled-lr 0 --decoupled-min-lr 0", "--seed 0",
    "--num-workers 0", "--eval-iters 0",
    "--train-iters 0", "--norm-epsilon 0",
    "--position-embedding-type rope --rotary-percent 1.0",
    f"{MOE} --moe-aux-loss-coeff 0 --moe-z-loss-coeff 0 --moe-input-jitter-eps 0 "
    "--moe-router-bias-update-rate 0",
    f"{MOE} --moe-expert-capacity-factor 0.5",
    "--optimizer sgd --sgd-momentum 0",
    "--vocab-size 100 --null-tokenizer-eod-id 0", "--vocab-size 100 --null-tokenizer-eod-id 99",
    "--fp8-format e4m3 --fp8-margin 0 --fp8-amax-history-len 1",
]


@pytest.mark.parametrize("extra", GOOD)
def test_megatron_edge_values_are_accepted(extra):
    parse_args(shlex.split(f"{BASE} {extra}"), world_size=1)


def test_negative_capacity_factor_means_dropless_as_in_megatron():
    """Megatron's TransformerConfig turns a negative --moe-expert-capacity-factor into None
    (no capacity: nothing dropped)."""
    args = parse_args(shlex.split(f"{BASE} {MOE} --moe-expert-capacity-factor -1"),
                      world_size=1)
    assert args.moe_expert_capacity_factor is None
