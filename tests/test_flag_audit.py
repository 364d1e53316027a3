"""The flag audit: every flag pretrain_gpt.py accepts is
  (a) read: a named test fails when megamoe stops reading it,
  (b) refused with "not supported yet" (any value but the default), or
  (c) a deliberate no-op, listed here with the reason.
A flag added to the parser without one of the three fails `test_every_flag_is_classified`.

For (a), the flags that set a config field are read by cli/mapping.py, and
`test_flag_reaches_its_config_field[FLAG]` is their named test; `test_every_config_field_is_
used` checks that each such field is used by megamoe outside config/ (a field nobody reads
would be a flag accepted and ignored). The few flags the command line handles itself name
their own tests in CLI_READ. `tools/audit_flags.py` stubs each flag's read (the parsed value
goes back to the default, tests/audit/sitecustomize.py) and runs its named test, which must
fail; the closing note of issue 16 records that run.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shlex

import pytest

from megamoe import config as C
from megamoe.cli.arguments import build_parser, parse_args
from megamoe.cli.compat_args import EQUIVALENTS
from megamoe.cli.extensions import NegationAction
from megamoe.cli.mapping import run_config_from_args
from megamoe.cli.rules import NOT_SUPPORTED_YET
from megamoe.config.unsupported import MEGATRON_UNBUILT
from tests.training.test_pretrain import ROOT, TINY_MOE

CONFIGS = (C.ModelConfig, C.MoEConfig, C.ParallelConfig, C.DataConfig, C.OptimizerConfig,
           C.TrainConfig, C.CheckpointConfig, C.LoggingConfig, C.MoEExecutionConfig,
           C.MoETrainingConfig, C.RecomputeConfig, C.Fp8Config)
SECTION = {C.ModelConfig: "model", C.MoEConfig: "model.moe", C.ParallelConfig: "parallel",
           C.DataConfig: "data", C.OptimizerConfig: "optim", C.TrainConfig: "train",
           C.CheckpointConfig: "checkpoint", C.LoggingConfig: "logging",
           C.MoEExecutionConfig: "moe_execution", C.MoETrainingConfig: "moe_training",
           C.RecomputeConfig: "recompute", C.Fp8Config: "fp8"}

MLA = "--multi-latent-attention"  # (TINY_MOE's --group-query-attention is dropped with it)
AWARE = "--use-precision-aware-optimizer --use-distributed-optimizer"
TPO = "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"
FP8_TW = "--fp8-format e4m3 --fp8-recipe tensorwise"  # --first-last-layers-bf16 refuses delayed
CP_OK = "--moe-router-load-balancing-type global_aux_loss"  # aux_loss is refused with CP
FUSION = "selects a fused kernel megamoe does not have; the unfused path always runs"
NO_OP = {
    "--help": "argparse's help",
    "--use-mcore-models": "megamoe has one model implementation (Megatron-Core's)",
    "--no-masked-softmax-fusion": FUSION,
    "--no-bias-swiglu-fusion": FUSION,
    "--no-bias-dropout-fusion": FUSION,
    "--no-rope-fusion": FUSION,
    "--no-gradient-accumulation-fusion": FUSION,
    "--no-persist-layer-norm": FUSION,
    "--attention-softmax-in-fp32": "attention softmax always runs in fp32 (SDPA)",
    "--no-create-attention-mask-in-dataloader":
        "megamoe never builds masks in the data loader: the batch carries document ids "
        "(--reset-attention-mask) and the model builds the mask on the device",
    "--accumulate-allreduce-grads-in-fp32":
        "with --bf16 gradients always accumulate and are reduced in fp32",
    "--init-model-with-meta-device": "megamoe always builds the model on the meta device",
    "--log-memory-to-tensorboard": "memory scalars are always written to TensorBoard",
    "--openai-gelu": "Megatron-LM parses it and reads it nowhere (megatron-core's MLP never "
                     "looks at it; tests/model/test_megatron_variants.py::"
                     "test_flags_reach_the_model_and_megatrons_sizes)",
    "--log-validation-ppl-to-tensorboard":
        "validation perplexity is always written to TensorBoard",
    # torch_dist checkpointing already behaves as these ask (docs/megatron-checkpoints.md)
    "--ckpt-fully-parallel-save": "deprecated in Megatron-LM, where it has no effect either "
                                  "(fully parallel saving is the default)",
    "--dist-ckpt-optim-fully-reshardable":
        "optimizer states are always saved per parameter under layout-free keys and load "
        "under any TP/PP/EP/DP (tests/training/test_dist_checkpoint.py::"
        "test_expert_parallel_checkpoint_loads_in_one_process)",
    "--use-persistent-ckpt-worker": "--async-save writes on a thread of the training process "
                                    "(DCP async_save); no worker process is started per save",
    **dict.fromkeys(("--override-opt-param-scheduler", "--override-opt_param-scheduler"),
                    "the learning-rate schedule always comes from the command line; a "
                    "checkpoint restores only its step count (tests/training/"
                    "test_megatron_log_flags.py::test_schedule_comes_from_the_command_line)"),
}

# Declared equivalents (cli/compat_args.py): a fused or vendor kernel choice; accepted, and
# the run prints one line saying what runs instead
# (tests/scripts/test_megatron_flags.py::test_declared_equivalents_print_what_runs).
EQUIVALENT = {
    **{f: r for f, r in EQUIVALENTS.items() if " " not in f},
    "--cross-entropy-fusion-impl": "which fused cross entropy --cross-entropy-loss-fusion "
                                   "picks; megamoe's own runs",
    "--moe-flex-dispatcher-backend": "the flex dispatcher's DeepEP/HybridEP/NCCL-EP kernels; with "
                                     "--moe-token-dispatcher-type flex the alltoall "
                                     "dispatcher runs",
}

# Refused for any non-default value, besides NOT_SUPPORTED_YET (cli/rules.py) and the
# Megatron flags megamoe lacks, MEGATRON_UNBUILT (config/megatron_unbuilt.txt; their one test:
# tests/test_megatron_unbuilt.py::test_every_unbuilt_flag_parses_with_its_shape_and_is_refused).
REFUSED_VALUES = {
    "--main-params-dtype": "fp16 (Transformer Engine's scaled fp16 main parameters) is not "
                           "built; fp32 main parameters are what runs "
                           "(tests/parallel/test_precision_aware_optimizer.py::"
                           "test_unbuilt_and_invalid_combinations_are_one_line)",
    "--fp8-interval": "deprecated in Megatron-LM (Transformer Engine >= 1.8 ignores it); "
                      "1 is what runs, another value is one line "
                      "(tests/training/test_fp8_training.py::test_fp8_refusals_are_one_line)",
    "--rerun-mode": "only disabled (megamoe's default) is built; validate_results and "
                    "report_stats are one line (tests/training/test_run_health.py::"
                    "test_unbuilt_rerun_machinery_is_refused_in_one_line)",
}

# Flags the command line reads itself (no config field): flag -> named test.
CLI_READ = {
    "--group-query-attention": "tests/test_flag_audit.py::test_group_query_attention_flag",
    "--no-position-embedding": "tests/test_flag_audit.py::test_no_position_embedding_flag",
    "--moe-layer-freq": "tests/test_flag_audit.py::test_moe_layer_freq_flag",
    "--moe-token-dropping": "tests/moe/test_cli_options.py::test_flags_map_to_config",
    "--dry-run":
        "tests/training/test_pretrain.py::test_dry_run_reports_per_rank_memory_of_the_layout",
    "--config": "tests/test_arguments.py::test_config_file_and_override",
    "--recompute-activations":
        "tests/training/test_recompute_flags.py::test_recompute_activations_is_selective",
    "--moe-layer-recompute":
        "tests/training/test_recompute_flags.py::test_moe_layer_recompute_adds_moe",
    "--logging-level": "tests/scripts/test_megatron_flags.py::test_logging_level",
    "--local-rank": "tests/scripts/test_megatron_flags.py::test_local_rank_must_be_local_rank",
    "--no-weight-decay-cond-type":  # Megatron's deprecated spelling
        "tests/training/test_param_group_flags.py::test_deprecated_spelling",
    "--use-rotary-position-embeddings":
        "tests/scripts/test_megatron_flags.py::test_use_rotary_position_embeddings",
    "--use-checkpoint-args":
        "tests/tools/test_convert_megatron.py::test_use_checkpoint_args_takes_the_saved_shape",
    "--json": "tests/training/test_console.py::test_dry_run_prints_a_table_or_json",
    "--deterministic-mode":
        "tests/test_deterministic_mode.py::test_training_runs_with_deterministic_algorithms",
    "--moe-router-padding-for-fp8":  # Megatron's older name of the same setting
        "tests/moe/test_router_padding.py::"
        "test_both_names_set_the_recipes_alignment_on_every_moe_layer",
    "--disable-fp8-wgrad":  # Megatron's second spelling of --no-fp8-wgrad (the same dest)
        "tests/model/test_fp8_wgrad.py::test_both_names_reach_every_gemm_of_the_policy",
    # Megatron's second spelling of the --disable-tp-comm-* fields (the same dest)
    **{f"--no-tp-comm-{name}": "tests/training/test_tp_comm_overlap.py::"
                               "test_flags_map_to_the_overlap_and_bad_combinations_are_one_line"
       for name in ("overlap-ag", "overlap-rs", "bulk-wgrad", "bulk-dgrad")},
}


def parser_flags() -> dict[str, object]:
    return {s: a for a in build_parser()._actions for s in a.option_strings
            if s.startswith("--")}


def config_flags() -> dict[str, tuple[type, dataclasses.Field]]:
    return {f.metadata["flag"]: (cls, f) for cls in CONFIGS for f in dataclasses.fields(cls)
            if "flag" in f.metadata}


def negation_flags() -> set[str]:
    """The generated --no-X / --X counterparts of on/off flags (cli/extensions.py); their
    named test: tests/test_extension_flags.py::test_negations_undo_their_flag."""
    return {f for f, a in parser_flags().items() if isinstance(a, NegationAction)}


def test_every_flag_is_classified():
    classes = {"config": set(config_flags()) - set(NOT_SUPPORTED_YET) - set(REFUSED_VALUES),
               "cli": set(CLI_READ),
               "refused": set(NOT_SUPPORTED_YET) | set(REFUSED_VALUES) | MEGATRON_UNBUILT,
               "no-op": set(NO_OP), "negation": negation_flags(),
               "equivalent": set(EQUIVALENT)}
    names = list(classes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not classes[a] & classes[b], (a, b, classes[a] & classes[b])
    classified = set().union(*classes.values())
    assert set(parser_flags()) - classified == set(), "flags nobody audited"
    assert classified - set(parser_flags()) == set(), "audited flags the parser lacks"


def test_named_tests_exist():
    for flag, node in CLI_READ.items():
        path, name = node.split("::")
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, \
            (flag, node)


def test_no_ops_change_nothing():
    base = run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1")), 97)
    flags = " ".join(f for f, a in parser_flags().items()
                     if f in NO_OP and f != "--help" and not a.option_strings[0] != f)
    other = run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 "
                                                        f"{flags}")), 97)
    strip = lambda rc: dataclasses.replace(rc, command_line={})
    assert strip(base) == strip(other)


def _used_names() -> set[str]:
    """Attribute names megamoe reads (a field's declaration is not an attribute access;
    `getattr(x, "name")` strings count)."""
    names: set[str] = set()
    pkg = os.path.join(ROOT, "megamoe")
    for dirpath, _, files in os.walk(pkg):
        for fn in files:
            if fn.endswith(".py"):
                with open(os.path.join(dirpath, fn), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
                names |= {n.value for n in ast.walk(tree)
                          if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return names


def test_every_config_field_is_used():
    used = _used_names()
    unused = [flag for flag, (_cls, f) in config_flags().items()
              if f.name not in used and flag not in NOT_SUPPORTED_YET]
    assert unused == [], f"config fields no code reads: {unused}"


# flag -> (extra flags, world size, expected field value), the value never the parser's
# default (else the stub could not show); "{tmp}" is a temporary directory holding empty
# .bin/.idx files and a tokenizer file.
SAMPLES: dict[str, tuple[str, int, object]] = {
    "--num-layers": ("--num-layers 4", 1, 4),
    "--transformer-impl": ("--transformer-impl transformer_engine", 1, "transformer_engine"),
    "--hidden-size": ("--hidden-size 64", 1, 64),
    "--ffn-hidden-size": ("--ffn-hidden-size 40", 1, 40),
    "--num-attention-heads": ("--num-attention-heads 8", 1, 8),
    "--num-query-groups": ("--num-query-groups 4", 1, 4),
    "--kv-channels": ("--kv-channels 16", 1, 16),
    "--seq-length": ("--seq-length 8", 1, 8),
    "--max-position-embeddings": ("--max-position-embeddings 64", 1, 64),
    "--make-vocab-size-divisible-by": ("--make-vocab-size-divisible-by 64", 1, 64),
    "--padded-vocab-size": ("--padded-vocab-size 256", 1, 256),
    "--normalization": ("--normalization RMSNorm", 1, "RMSNorm"),
    "--norm-epsilon": ("--norm-epsilon 1e-3", 1, 1e-3),
    "--position-embedding-type": ("--position-embedding-type none", 1, "none"),
    "--rotary-base": ("--rotary-base 500000", 1, 500000.0),
    "--rotary-percent": ("--rotary-percent 0.5", 1, 0.5),
    "--hidden-dropout": ("--hidden-dropout 0.2", 1, 0.2),
    "--attention-dropout": ("--attention-dropout 0.2", 1, 0.2),
    "--init-method-std": ("--init-method-std 0.05", 1, 0.05),
    "--swiglu": ("", 1, True),
    "--squared-relu": ("--squared-relu", 1, True),  # (sample_argv drops TINY_MOE's --swiglu)
    "--quick-geglu": ("--quick-geglu", 1, True),
    "--rotary-interleaved": ("--rotary-interleaved", 1, True),
    "--use-rope-scaling": ("--use-rope-scaling", 1, True),
    "--rope-scaling-factor": ("--use-rope-scaling --rope-scaling-factor 32", 1, 32.0),
    "--apply-wd-to-qk-layernorm": ("--apply-wd-to-qk-layernorm", 1, True),
    "--decoupled-lr": ("--decoupled-lr 5e-3", 1, 5e-3),
    "--decoupled-min-lr": ("--decoupled-lr 5e-3 --decoupled-min-lr 1e-4", 1, 1e-4),
    "--disable-bias-linear": ("", 1, False),
    "--no-bias-gelu-fusion": ("--no-bias-gelu-fusion", 1, False),
    "--untie-embeddings-and-output-weights": ("", 1, True),
    "--use-flash-attn": ("--use-flash-attn", 1, True),
    "--num-experts": ("--num-experts 8", 1, 8),
    "--moe-router-topk": ("--moe-router-topk 3", 1, 3),
    "--moe-ffn-hidden-size": ("--moe-ffn-hidden-size 24", 1, 24),
    "--moe-shared-expert-intermediate-size":
        ("--moe-shared-expert-intermediate-size 32", 1, 32),
    "--moe-shared-expert-gate":
        ("--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate", 1, True),
    "--trust-remote-code": ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model "
                            "{tmp}/tok --trust-remote-code", 1, True),
    "--moe-shared-expert-overlap":
        ("--moe-shared-expert-intermediate-size 32 --moe-token-dispatcher-type alltoall "
         "--moe-shared-expert-overlap", 1, True),
    "--moe-router-score-function": ("--moe-router-score-function sigmoid", 1, "sigmoid"),
    "--moe-router-pre-softmax": ("--moe-router-pre-softmax", 1, True),
    "--moe-router-topk-scaling-factor": ("--moe-router-topk-scaling-factor 2.5", 1, 2.5),
    "--moe-router-num-groups": ("--moe-router-num-groups 2 --moe-router-group-topk 1", 1, 2),
    "--moe-router-group-topk": ("--moe-router-num-groups 4 --moe-router-group-topk 2", 1, 2),
    "--moe-router-dtype": ("--moe-router-dtype fp64", 1, "fp64"),
    "--moe-router-enable-expert-bias":
        ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias", 1, True),
    "--moe-router-bias-update-rate": ("--moe-router-bias-update-rate 0.01", 1, 0.01),
    "--moe-router-load-balancing-type":
        ("--moe-router-load-balancing-type seq_aux_loss", 1, ["seq_aux_loss"]),
    "--moe-aux-loss-coeff": ("--moe-aux-loss-coeff 0.5", 1, [0.5]),
    "--moe-z-loss-coeff": ("--moe-z-loss-coeff 0.25", 1, 0.25),
    "--moe-input-jitter-eps": ("--moe-input-jitter-eps 0.01", 1, 0.01),
    "--moe-expert-capacity-factor": ("--moe-expert-capacity-factor 1.5", 1, 1.5),
    "--moe-pad-expert-input-to-capacity":
        ("--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity", 1, True),
    "--moe-token-drop-policy": ("--moe-expert-capacity-factor 1.5 "
                                "--moe-token-drop-policy position", 1, "position"),
    "--moe-grouped-gemm": ("", 1, True),
    "--moe-capacity-over-tp-gathered-sequence": (
        "--moe-expert-capacity-factor 1.5 --moe-capacity-over-tp-gathered-sequence", 1, True),
    "--moe-expert-bias-counts-before-capacity": (
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-expert-bias-counts-before-capacity", 1, True),
    "--moe-use-upcycling": ("--moe-ffn-hidden-size 64 --moe-use-upcycling", 1, True),
    "--moe-per-layer-logging": ("--moe-per-layer-logging", 1, True),
    "--moe-adaptive-parallelism": ("--expert-model-parallel-size 2 --moe-token-dispatcher-"
                                   "type alltoall --moe-adaptive-parallelism", 2, True),
    "--moe-token-dispatcher-type": ("--moe-token-dispatcher-type alltoall", 1, "alltoall"),
    "--moe-a2a-overlap-degree": ("--expert-model-parallel-size 2 --moe-token-dispatcher-type "
                                 "alltoall --moe-a2a-overlap-degree 2", 2, 2),
    "--tensor-model-parallel-size": ("--tensor-model-parallel-size 2 --sequence-parallel",
                                     2, 2),
    "--sequence-parallel": ("--tensor-model-parallel-size 2 --sequence-parallel", 2, True),
    "--context-parallel-size": (f"--context-parallel-size 2 {CP_OK}", 2, 2),
    "--cp-comm-type": (f"--context-parallel-size 2 --cp-comm-type allgather {CP_OK}", 2,
                       ["allgather"]),
    "--pipeline-model-parallel-size": ("--pipeline-model-parallel-size 2", 2, 2),
    "--expert-model-parallel-size": ("--expert-model-parallel-size 2", 2, 2),
    "--expert-tensor-parallel-size": ("--tensor-model-parallel-size 2 --sequence-parallel "
                                      "--expert-tensor-parallel-size 1", 2, 1),
    "--num-layers-per-virtual-pipeline-stage":
        ("--num-layers 4 --pipeline-model-parallel-size 2 "
         "--num-layers-per-virtual-pipeline-stage 1", 2, 1),
    "--decoder-first-pipeline-num-layers":
        ("--num-layers 4 --pipeline-model-parallel-size 2 "
         "--decoder-first-pipeline-num-layers 1", 2, 1),
    "--decoder-last-pipeline-num-layers":
        ("--num-layers 4 --pipeline-model-parallel-size 2 "
         "--decoder-last-pipeline-num-layers 1", 2, 1),
    "--account-for-embedding-in-pipeline-split":
        ("--num-layers 3 --pipeline-model-parallel-size 2 "
         "--account-for-embedding-in-pipeline-split", 2, True),
    "--account-for-loss-in-pipeline-split":
        ("--num-layers 3 --pipeline-model-parallel-size 2 "
         "--account-for-loss-in-pipeline-split", 2, True),
    "--num-virtual-stages-per-pipeline-rank":
        ("--num-layers 4 --pipeline-model-parallel-size 2 "
         "--num-virtual-stages-per-pipeline-rank 2", 2, 2),
    "--pipeline-model-parallel-layout":
        ("--num-layers 3 --pipeline-model-parallel-size 2 "
         "--pipeline-model-parallel-layout Et|ttL", 2, "Et|ttL"),
    "--use-distributed-optimizer": ("--use-distributed-optimizer", 2, True),
    "--overlap-grad-reduce": ("--overlap-grad-reduce", 2, True),
    "--overlap-param-gather": ("--use-distributed-optimizer --overlap-grad-reduce "
                               "--overlap-param-gather", 2, True),
    "--ddp-bucket-size": ("--overlap-grad-reduce --ddp-bucket-size 1000", 2, 1000),
    "--use-cpu-initialization": ("--use-cpu-initialization", 1, True),
    "--distributed-backend": ("--distributed-backend gloo", 1, "gloo"),
    "--distributed-timeout-minutes": ("--distributed-timeout-minutes 3", 1, 3.0),
    "--data-path": ("--data-path {tmp}/a", 1, ["{tmp}/a"]),
    "--train-data-path": ("--train-data-path {tmp}/a", 1, ["{tmp}/a"]),
    "--valid-data-path": ("--train-data-path {tmp}/a --valid-data-path {tmp}/a", 1,
                          ["{tmp}/a"]),
    "--test-data-path": ("--train-data-path {tmp}/a --test-data-path {tmp}/a", 1,
                         ["{tmp}/a"]),
    "--data-args-path": ("--data-args-path {tmp}/tok", 1, "{tmp}/tok"),
    "--per-split-data-args-path": ("--per-split-data-args-path {tmp}/tok", 1, "{tmp}/tok"),
    "--mock-data": ("", 1, True),
    "--split": ("--split 90,5,5", 1, "90,5,5"),
    "--data-cache-path": ("--data-cache-path {tmp}/cache", 1, "{tmp}/cache"),
    "--tokenizer-type": ("--tokenizer-type GPT2BPETokenizer --vocab-file {tmp}/tok "
                         "--merge-file {tmp}/tok", 1, "GPT2BPETokenizer"),
    "--tokenizer-model": ("--tokenizer-type SentencePieceTokenizer --tokenizer-model "
                          "{tmp}/tok", 1, "{tmp}/tok"),
    "--vocab-file": ("--tokenizer-type GPT2BPETokenizer --vocab-file {tmp}/tok "
                     "--merge-file {tmp}/tok", 1, "{tmp}/tok"),
    "--merge-file": ("--tokenizer-type GPT2BPETokenizer --vocab-file {tmp}/tok "
                     "--merge-file {tmp}/tok", 1, "{tmp}/tok"),
    "--vocab-size": ("--vocab-size 200", 1, 200),
    "--null-tokenizer-eod-id": ("--null-tokenizer-eod-id 3", 1, 3),
    "--num-workers": ("--num-workers 1", 1, 1),
    "--dataloader-type": ("--dataloader-type cyclic", 1, "cyclic"),
    "--no-data-sharding": ("--no-data-sharding", 1, False),
    "--reset-position-ids": ("--reset-position-ids", 1, True),
    "--reset-attention-mask": ("--reset-attention-mask", 1, True),
    "--eod-mask-loss": ("--eod-mask-loss", 1, True),
    "--optimizer": ("--optimizer sgd", 1, "sgd"),
    "--lr": ("--lr 0.25", 1, 0.25),
    "--min-lr": ("--min-lr 1e-5", 1, 1e-5),
    "--weight-decay": ("--weight-decay 0.3", 1, 0.3),
    "--weight-decay-incr-style": ("--weight-decay-incr-style cosine --start-weight-decay 0 "
                                  "--end-weight-decay 0.1", 1, "cosine"),
    "--start-weight-decay": ("--weight-decay-incr-style linear --start-weight-decay 0.02 "
                             "--end-weight-decay 0.1", 1, 0.02),
    "--end-weight-decay": ("--weight-decay-incr-style linear --start-weight-decay 0.02 "
                           "--end-weight-decay 0.1", 1, 0.1),
    "--adam-beta1": ("--adam-beta1 0.8", 1, 0.8),
    "--adam-beta2": ("--adam-beta2 0.95", 1, 0.95),
    "--adam-eps": ("--adam-eps 1e-5", 1, 1e-5),
    "--sgd-momentum": ("--sgd-momentum 0.5", 1, 0.5),
    "--clip-grad": ("--clip-grad 0.5", 1, 0.5),
    "--lr-warmup-iters": ("--lr-warmup-iters 3", 1, 3),
    "--lr-warmup-fraction": ("--lr-warmup-iters 0 --lr-warmup-fraction 0.1", 1, 0.1),
    "--lr-warmup-init": ("--lr-warmup-init 1e-4", 1, 1e-4),
    "--lr-decay-iters": ("--lr-decay-iters 7", 1, 7),
    "--lr-decay-style": ("--lr-decay-style constant", 1, "constant"),
    "--lr-wsd-decay-iters": ("--lr-decay-style WSD --lr-wsd-decay-iters 2", 1, 2),
    "--lr-wsd-decay-style": ("--lr-decay-style WSD --lr-wsd-decay-iters 2 "
                             "--lr-wsd-decay-style cosine", 1, "cosine"),
    "--bf16": ("--bf16", 1, True),
    "--fp16": ("--fp16", 1, True),
    "--loss-scale": ("--fp16 --loss-scale 1024", 1, 1024.0),
    "--initial-loss-scale": ("--fp16 --initial-loss-scale 65536", 1, 65536.0),
    "--min-loss-scale": ("--fp16 --min-loss-scale 4", 1, 4.0),
    "--loss-scale-window": ("--fp16 --loss-scale-window 50", 1, 50.0),
    "--hysteresis": ("--fp16 --hysteresis 3", 1, 3),
    "--micro-batch-size": ("--micro-batch-size 4", 1, 4),
    "--global-batch-size": ("--global-batch-size 16", 1, 16),
    "--train-iters": ("--train-iters 5", 1, 5),
    "--train-samples": ("--train-samples 48", 1, 48),
    "--rampup-batch-size": ("--train-samples 48 --rampup-batch-size 2 2 16", 1, [2, 2, 16]),
    "--step-batch-size-schedule": ("--step-batch-size-schedule 0:4,1K:8", 1, "0:4,1K:8"),
    "--lr-warmup-samples": ("--train-samples 48 --lr-warmup-samples 8", 1, 8),
    "--lr-decay-samples": ("--train-samples 48 --lr-decay-samples 40", 1, 40),
    "--lr-wsd-decay-samples": ("--train-samples 48 --lr-decay-style WSD "
                               "--lr-wsd-decay-samples 16", 1, 16),
    "--seed": ("--seed 99", 1, 99),
    "--eval-interval": ("--eval-interval 3", 1, 3),
    "--eval-iters": ("--eval-iters 2", 1, 2),
    "--skip-train": ("--skip-train", 1, True),
    "--exit-interval": ("--exit-interval 2", 1, 2),
    "--exit-duration-in-mins": ("--exit-duration-in-mins 5", 1, 5.0),
    "--exit-signal-handler": ("--exit-signal-handler", 1, True),
    "--empty-unused-memory-level": ("--empty-unused-memory-level 2", 1, 2),
    "--no-check-for-nan-in-loss-and-grad": ("--no-check-for-nan-in-loss-and-grad", 1, False),
    "--check-for-spiky-loss": ("--check-for-spiky-loss", 1, True),
    "--check-weight-hash-across-dp-replicas-interval": (
        "--check-weight-hash-across-dp-replicas-interval 5", 1, 5),
    "--save": ("--save {tmp}/ck", 1, "{tmp}/ck"),
    "--load": ("--load {tmp}/ck", 1, "{tmp}/ck"),
    "--save-interval": ("--save {tmp}/ck --save-interval 3", 1, 3),
    "--no-load-optim": ("--no-load-optim", 1, True),
    "--no-load-rng": ("--no-load-rng", 1, True),
    "--no-save-optim": ("--no-save-optim", 1, True),
    "--no-save-rng": ("--no-save-rng", 1, True),
    "--finetune": ("--finetune", 1, True),
    "--async-save": ("--save {tmp}/ck --async-save", 1, True),
    "--ckpt-keep-last": ("--save {tmp}/ck --ckpt-keep-last 2", 1, 2),
    "--save-retain-interval": ("--save {tmp}/ck --save-interval 2 --save-retain-interval 4",
                               1, 4),
    "--ckpt-format": ("--ckpt-format torch", 1, "torch"),
    "--ckpt-step": ("--load {tmp}/ck --ckpt-step 3", 1, 3),
    "--exit-on-missing-checkpoint": ("--exit-on-missing-checkpoint", 1, True),
    "--log-interval": ("--log-interval 7", 1, 7),
    "--tensorboard-dir": ("--tensorboard-dir {tmp}/tb", 1, "{tmp}/tb"),
    "--tensorboard-log-interval": ("--tensorboard-log-interval 5", 1, 5),
    "--wandb-project": ("--wandb-project p", 1, "p"),
    "--wandb-exp-name": ("--wandb-exp-name e", 1, "e"),
    "--wandb-save-dir": ("--wandb-save-dir {tmp}/wb", 1, "{tmp}/wb"),
    "--wandb-entity": ("--wandb-project p --wandb-entity team", 1, "team"),
    "--timing-log-option": ("--timing-log-option all", 1, "all"),
    "--no-ckpt-fully-parallel-save": ("--no-ckpt-fully-parallel-save", 1, False),
    "--ckpt-assume-constant-structure": ("--ckpt-assume-constant-structure", 1, True),
    "--log-throughput": ("--log-throughput", 1, True),
    "--log-params-norm": ("--log-params-norm", 1, True),
    "--log-num-zeros-in-grad": ("--log-num-zeros-in-grad", 1, True),
    "--log-first-iterations": ("--log-first-iterations 5", 1, 5),
    "--peak-tflops": ("--peak-tflops 123", 1, 123.0),
    "--compile": ("--compile", 1, True),
    "--calculate-per-token-loss": ("--calculate-per-token-loss", 1, True),
    "--qk-layernorm": ("--qk-layernorm", 1, True),
    "--qk-layernorm-scope": ("--qk-layernorm --qk-layernorm-scope projection", 1, "projection"),
    "--add-qkv-bias": ("--add-qkv-bias", 1, True),
    "--multi-latent-attention": (MLA, 1, True),
    "--q-lora-rank": (f"{MLA} --q-lora-rank 16", 1, 16),
    "--kv-lora-rank": (f"{MLA} --kv-lora-rank 12", 1, 12),
    "--qk-head-dim": (f"{MLA} --qk-head-dim 10", 1, 10),
    "--qk-pos-emb-head-dim": (f"{MLA} --qk-pos-emb-head-dim 6", 1, 6),
    "--v-head-dim": (f"{MLA} --v-head-dim 7", 1, 7),
    "--rope-type": (f"{MLA} --rope-type rope", 1, "rope"),
    "--rotary-scaling-factor": (f"{MLA} --rotary-scaling-factor 40", 1, 40.0),
    "--mscale": (f"{MLA} --mscale 0.5", 1, 0.5),
    "--mscale-all-dim": (f"{MLA} --mscale-all-dim 1", 1, 1.0),
    "--mtp-num-layers": ("--mtp-num-layers 2", 1, 2),
    "--mtp-loss-scaling-factor": ("--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3", 1, 0.3),
    "--manual-gc": ("--manual-gc", 1, True),
    "--manual-gc-interval": ("--manual-gc --manual-gc-interval 10", 1, 10),
    "--no-manual-gc-eval": ("--manual-gc --no-manual-gc-eval", 1, False),
    "--no-mmap-bin-files": ("--no-mmap-bin-files", 1, False),
    "--attention-backend": ("--attention-backend unfused", 1, "unfused"),
    "--auto-detect-ckpt-format": ("--auto-detect-ckpt-format", 1, True),
    "--dist-ckpt-strictness": ("--dist-ckpt-strictness log_all", 1, "log_all"),
    "--moe-router-force-load-balancing": ("--moe-router-force-load-balancing", 1, True),
    "--timing-log-level": ("--timing-log-level 1", 1, 1),
    "--profile": ("--profile --use-pytorch-profiler --tensorboard-dir {tmp}/tb", 1, True),
    "--use-pytorch-profiler": ("--profile --use-pytorch-profiler --tensorboard-dir {tmp}/tb",
                               1, True),
    "--profile-step-start": ("--profile-step-start 3", 1, 3),
    "--profile-step-end": ("--profile-step-start 2 --profile-step-end 4", 1, 4),
    "--profile-ranks": ("--profile-ranks 1 2", 1, [1, 2]),
    "--record-memory-history": ("--record-memory-history", 1, True),
    "--memory-snapshot-path": ("--memory-snapshot-path {tmp}/m.pickle", 1, "{tmp}/m.pickle"),
    "--log-timers-to-tensorboard": ("--log-timers-to-tensorboard", 1, True),
    "--recompute-granularity": ("--recompute-granularity selective", 1, "selective"),
    "--recompute-method": ("--recompute-granularity full --recompute-method block "
                           "--recompute-num-layers 1", 1, "block"),
    "--recompute-num-layers": ("--recompute-granularity full --recompute-method uniform "
                               "--recompute-num-layers 2", 1, 2),
    "--recompute-modules": ("--recompute-granularity selective --recompute-modules moe "
                            "layernorm", 1, ["moe", "layernorm"]),
    "--use-precision-aware-optimizer": (AWARE, 1, True),
    "--main-grads-dtype": (f"{AWARE} --bf16 --main-grads-dtype bf16", 1, "bf16"),
    "--exp-avg-dtype": (f"{AWARE} --exp-avg-dtype fp16", 1, "fp16"),
    "--exp-avg-sq-dtype": (f"{AWARE} --exp-avg-sq-dtype bf16", 1, "bf16"),
    "--fp8-format": ("--fp8-format hybrid", 1, "hybrid"),
    "--fp8-recipe": ("--fp8-format e4m3 --fp8-recipe blockwise", 1, "blockwise"),
    "--fp8-margin": ("--fp8-format e4m3 --fp8-margin 2", 1, 2),
    "--fp8-amax-history-len": ("--fp8-format e4m3 --fp8-amax-history-len 8", 1, 8),
    "--fp8-amax-compute-algo": ("--fp8-format e4m3 --fp8-amax-compute-algo max", 1, "max"),
    "--tp-only-amax-red": ("--fp8-format e4m3 --tp-only-amax-red", 1, True),
    "--no-fp8-wgrad": ("--fp8-format hybrid --no-fp8-wgrad", 1, False),
    "--fp8-param-gather": ("--fp8-format e4m3 --fp8-param-gather --use-distributed-optimizer",
                           1, True),
    "--moe-router-padding-for-quantization": (
        "--fp8-format e4m3 --moe-router-padding-for-quantization", 1, True),
    "--fp8-output-proj": ("--fp8-format e4m3 --fp8-recipe mxfp8 --fp8-output-proj", 1, True),
    "--first-last-layers-bf16": (f"{FP8_TW} --first-last-layers-bf16", 1, True),
    "--num-layers-at-start-in-bf16": (f"{FP8_TW} --first-last-layers-bf16 "
                                      "--num-layers-at-start-in-bf16 2", 1, 2),
    "--num-layers-at-end-in-bf16": (f"{FP8_TW} --first-last-layers-bf16 "
                                    "--num-layers-at-end-in-bf16 0", 1, 0),
    "--tp-comm-overlap": (f"{TPO}", 2, True),
    "--disable-tp-comm-overlap-ag": (f"{TPO} --disable-tp-comm-overlap-ag", 2, False),
    "--disable-tp-comm-overlap-rs": (f"{TPO} --disable-tp-comm-overlap-rs", 2, False),
    "--tp-comm-overlap-rs-dgrad": (f"{TPO} --tp-comm-overlap-rs-dgrad", 2, True),
    "--disable-tp-comm-bulk-wgrad": (f"{TPO} --disable-tp-comm-bulk-wgrad", 2, False),
    "--disable-tp-comm-bulk-dgrad": (f"{TPO} --disable-tp-comm-bulk-dgrad", 2, False),
}


def _field(run, flag: str):
    cls, f = config_flags()[flag]
    obj = run
    for part in SECTION[cls].split("."):
        obj = getattr(obj, part)
    return getattr(obj, f.name)


def test_samples_differ_from_the_parser_default():
    """A sample equal to the default would pass with the flag unread."""
    actions = parser_flags()
    same = [f for f, (_, _, value) in SAMPLES.items() if value == actions[f].default
            or (isinstance(value, list) and len(value) == 1 and value[0] == actions[f].default)]
    assert same == []


def test_every_config_flag_has_a_sample():
    missing = sorted(set(config_flags()) - set(NOT_SUPPORTED_YET) - set(REFUSED_VALUES)
                     - set(SAMPLES))
    assert missing == []


def sample_argv(flag: str, tmp_path) -> list[str]:
    """TINY_MOE with SAMPLES[flag] (data and tokenizer files it names made empty in
    `tmp_path`), adjusted so the sample is valid."""
    extra, world, expected = SAMPLES[flag]
    tmp = str(tmp_path)
    for name in ("a.bin", "a.idx", "tok"):
        (tmp_path / name).write_text("")
    base = TINY_MOE
    data = r"--(data-path|train-data-path|data-args-path|per-split-data-args-path)"
    if re.search(data + "|--(tokenizer-type|tokenizer-model)", extra):
        base = base.replace("--mock-data ", "").replace("--tokenizer-type NullTokenizer ", "")
        base += "" if "tokenizer-type" in extra else " --tokenizer-type NullTokenizer"
        base += "" if re.search(data, extra) else " --mock-data"
    if re.search("--squared-relu|--quick-geglu", extra):  # another MLP activation
        base = base.replace("--swiglu ", "")
    if "--step-batch-size-schedule" in extra:  # it replaces --global-batch-size
        base = base.replace("--global-batch-size 8 ", "")
    if MLA in extra:  # MLA has no query groups (as Megatron)
        base = base.replace("--group-query-attention ", "")
    length = "--train-iters 10"
    if "--train-samples" in extra:  # training by samples: no iteration-based lengths
        length, base = "", base.replace("--lr-warmup-iters 1 ", "")
    return shlex.split(f"{base} {length} {extra.replace('{tmp}', tmp)}")


@pytest.mark.parametrize("flag", sorted(SAMPLES))
def test_flag_reaches_its_config_field(flag, tmp_path, monkeypatch):
    """The flag, given with a value that is neither the default nor the tiny model's, sets
    its config field (a flag given only in TINY_MOE is checked with TINY_MOE's value)."""
    extra, world, expected = SAMPLES[flag]
    tmp = str(tmp_path)
    sub = lambda v: v.replace("{tmp}", tmp) if isinstance(v, str) else v
    expected = [sub(e) for e in expected] if isinstance(expected, list) else sub(expected)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parse_args(sample_argv(flag, tmp_path), world_size=world)
    run = run_config_from_args(args, 97)
    assert _field(run, flag) == expected


def _model(extra: str):
    return run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}")),
                                97).model


def test_group_query_attention_flag():
    """--num-query-groups counts only with --group-query-attention (as in Megatron)."""
    assert _model("").num_query_groups == 2  # TINY_MOE: --group-query-attention, 2 groups
    plain = TINY_MOE.replace("--group-query-attention ", "")
    args = parse_args(shlex.split(f"{plain} --train-iters 1"))
    assert run_config_from_args(args, 97).model.num_query_groups == 4


def test_moe_layer_freq_flag():
    assert _model("--num-layers 4 --moe-layer-freq 2").moe_layer_pattern == [1, 0, 1, 0]
    assert _model("--num-layers 4").moe_layer_pattern == [1, 1, 1, 1]


def test_no_position_embedding_flag():
    model = _model("--position-embedding-type learned_absolute --no-position-embedding")
    assert model.position_embedding_type == "none"
    assert _model("--position-embedding-type learned_absolute").position_embedding_type == \
        "learned_absolute"
