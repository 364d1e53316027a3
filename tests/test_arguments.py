"""Command-line parsing: Megatron flags parse, each cross-flag rule fails in one line."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.cli.rules import NOT_SUPPORTED_YET, parse_layer_freq
from tests.flags import parse_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data")
MOE = "--num-experts 8 --moe-router-topk 2"


def parse(extra: str = "", world_size: int = 1, base: str = BASE):
    return parse_args(shlex.split(f"{base} {extra}"), world_size=world_size)


def fails(capsys, extra: str, world_size: int = 1, base: str = BASE) -> str:
    return parse_error(capsys, f"{base} {extra}", world_size)


def test_megatron_defaults():
    a = parse()
    assert a.num_query_groups == 4 and a.kv_channels == 16
    assert a.ffn_hidden_size == 256 and a.max_position_embeddings == 32
    assert a.hidden_dropout == 0.1 and a.init_method_std == 0.02
    assert a.num_experts is None and a.lr_decay_iters == 3


def test_swiglu_ffn_default_and_moe_config():
    a = parse(f"--swiglu {MOE} --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
              "--disable-bias-linear")
    assert a.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64
    run = run_config_from_args(a, vocab_size=100)
    assert run.model.moe.num_experts == 8 and run.model.moe.topk == 2
    assert run.model.moe.aux_loss_coeff("aux_loss") == pytest.approx(1e-2)
    assert run.model.moe.ffn_hidden_size == a.ffn_hidden_size
    assert run.model.add_bias_linear is False and run.model.padded_vocab_size == 128
    assert run.model.moe_layer_pattern == [1, 1, 1, 1]


def test_moe_layer_freq():
    assert parse_layer_freq("2", 4) == [1, 0, 1, 0]
    assert parse_layer_freq("([0]+[1]*3)", 4) == [0, 1, 1, 1]
    assert parse_layer_freq("[0,1,0,1]", 4) == [0, 1, 0, 1]


def test_num_experts_zero_means_dense():
    assert parse("--num-experts 0").num_experts is None


@pytest.mark.parametrize("extra,world,message", [
    ("--tensor-model-parallel-size 3", 4, "world size 4 is not divisible by"),
    ("--pipeline-model-parallel-size 2", 3, "world size 3 is not divisible by"),
    ("--num-experts 6 --expert-model-parallel-size 4", 4,
     "--num-experts (6) must be divisible by --expert-model-parallel-size (4)"),
    ("--num-experts 4 --moe-router-topk 5", 1, "--moe-router-topk (5) must be between 1 and"),
    ("--global-batch-size 7", 1, "--global-batch-size (7) must be divisible by"),
    ("--global-batch-size 6", 2, "--global-batch-size (6) must be divisible by"),
    ("--num-attention-heads 5", 1, "--hidden-size (64) must be divisible by --num-attention-heads"),
    ("--group-query-attention --num-query-groups 3", 1,
     "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
    (f"{MOE} --tensor-model-parallel-size 2", 2,
     "MoE with --tensor-model-parallel-size > 1 requires --sequence-parallel"),
    ("--fp16 --bf16", 1, "--fp16 and --bf16 are mutually exclusive"),
    ("--seq-length 64 --max-position-embeddings 32", 1, "exceeds --max-position-embeddings"),
    (f"{MOE} --moe-layer-freq [1,0]", 1, "--moe-layer-freq pattern has 2 entries"),
    (f"{MOE} --moe-router-load-balancing-type aux_loss none --moe-aux-loss-coeff 1 2 3", 1,
     "--moe-aux-loss-coeff has 3 values"),
    (f"{MOE} --moe-router-num-groups 3 --moe-router-group-topk 1", 1,
     "must be divisible by --moe-router-num-groups"),
    ("--no-such-flag", 1, "unrecognized arguments: --no-such-flag"),
])
def test_cross_flag_rules(capsys, extra, world, message):
    assert message in fails(capsys, extra, world)


def test_required_flags(capsys):
    assert "--num-layers is required" in fails(capsys, "", base="--hidden-size 8")
    base_no_lr = BASE.replace("--lr 1e-3", "")
    assert "--lr is required" in fails(capsys, "", base=base_no_lr)
    base_no_data = BASE.replace("--mock-data", "")
    assert "--data-path" in fails(capsys, "", base=base_no_data)


def test_files_must_exist(capsys, tmp_path):
    base = BASE.replace("--mock-data", "")
    err = fails(capsys, f"--data-path {tmp_path}/nope --tokenizer-type NullTokenizer "
                        "--vocab-size 100", base=base)
    assert f"--data-path: file not found: {tmp_path}/nope.bin" in err
    err = fails(capsys, f"--data-path {tmp_path}/x --tokenizer-type SentencePieceTokenizer "
                        f"--tokenizer-model {tmp_path}/tok.model", base=base)
    assert f"--tokenizer-model: file not found: {tmp_path}/tok.model" in err
    err = fails(capsys, f"--data-path {tmp_path}/x --tokenizer-type GPT2BPETokenizer", base=base)
    assert "--tokenizer-type GPT2BPETokenizer needs --vocab-file" in err


def test_unknown_flag_names_the_closest_known_one(capsys):
    err = fails(capsys, "--hiden-size 5")
    assert err.endswith("unrecognized arguments: --hiden-size 5 (did you mean --hidden-size?)\n")
    err = fails(capsys, "--moe-router-topk=2 --num-expert 8 --zzz")
    assert "(did you mean --num-expert -> --num-experts?)" in err  # --moe-router-topk=2 is known
    assert "did you mean" not in fails(capsys, "--no-such-flag")


def test_data_path_with_the_bin_suffix_names_the_prefix(capsys, tmp_path):
    for suffix in (".bin", ".idx"):
        (tmp_path / f"c_text_document{suffix}").write_bytes(b"")
    base = BASE.replace("--mock-data", "--tokenizer-type NullTokenizer --vocab-size 100")
    err = fails(capsys, f"--data-path {tmp_path}/c_text_document.bin", base=base)
    assert err.endswith(f"file not found: {tmp_path}/c_text_document.bin.bin (give the prefix "
                        f"without .bin/.idx: {tmp_path}/c_text_document)\n")
    assert "give the prefix" not in fails(capsys, f"--data-path {tmp_path}/nope", base=base)


def test_load_of_a_hugging_face_folder_names_the_converter(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    err = fails(capsys, f"--load {tmp_path}")
    assert f"--load {tmp_path}: a Hugging Face model" in err
    assert f"python tools/checkpoint/convert.py hf-to-megamoe --input {tmp_path}" in err
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")  # a megamoe checkpoint
    assert parse(f"--load {tmp_path}").load == str(tmp_path)


@pytest.mark.parametrize("flag", [
    "--expert-tensor-parallel-size 2",
    "--use-megatron-fsdp",
])
def test_not_supported_yet(capsys, flag):
    world = 2 if "parallel-size 2" in flag else 1
    err = fails(capsys, f"{MOE} {flag}", world)
    assert f"not supported yet: {flag.split()[0]}" in err


def test_not_supported_table_names_real_flags():
    from megamoe.cli.arguments import build_parser
    known = {opt for a in build_parser()._actions for opt in a.option_strings}
    assert set(NOT_SUPPORTED_YET) <= known


def test_sequence_parallel_and_distopt_accepted_on_one_rank():
    a = parse(f"{MOE} --sequence-parallel --use-distributed-optimizer")
    assert a.sequence_parallel is False  # Megatron turns SP off when TP == 1


MIXTRAL_SCRIPT = """
--use-mcore-models --disable-bias-linear --seq-length 64 --max-position-embeddings 256
--num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 8
--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
--position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 2 --no-masked-softmax-fusion --no-position-embedding
--num-experts 8 --expert-model-parallel-size 1 --moe-router-load-balancing-type aux_loss
--moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
--tokenizer-type NullTokenizer --vocab-size 300 --mock-data --split 99990,8,2
--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 3 --lr-decay-iters 3
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0
--bf16 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--log-interval 1 --eval-interval 1000 --eval-iters 1
--no-load-optim --no-load-rng
"""


def test_mixtral_script_flags_parse():
    a = parse_args(MIXTRAL_SCRIPT.split(), world_size=1)
    run = run_config_from_args(a, vocab_size=300)
    assert run.model.position_embedding_type == "rope"
    assert run.model.num_query_groups == 2 and run.moe_execution.grouped_gemm


def test_cli_bad_flag_is_one_line_no_traceback():
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *shlex.split(BASE),
           "--num-experts", "6", "--expert-model-parallel-size", "4"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, WORLD_SIZE="4"))
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --num-experts (6) must be divisible by "
        "--expert-model-parallel-size (4)"]


def test_config_file_and_override(tmp_path, capsys):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("num-layers: 2\nhidden_size: 64\nnum-attention-heads: 4\nswiglu: true\n"
                   "disable-bias-linear: false\nmoe-aux-loss-coeff: [0.01]\n")
    a = parse_args(["--config", str(cfg), "--num-layers", "3", "--seq-length", "16",
                    "--train-iters", "1", "--lr", "1", "--mock-data"], world_size=1)
    assert a.num_layers == 3 and a.hidden_size == 64 and a.swiglu and a.add_bias_linear
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    assert "--config: file not found" in capsys.readouterr().err


def test_bundled_config_parses():
    a = parse_args(["--config", os.path.join(ROOT, "configs", "tiny-mixtral-cpu.yaml"),
                    "--train-iters", "1", "--lr", "1", "--mock-data"], world_size=1)
    assert a.num_experts == 8 and a.swiglu and a.normalization == "RMSNorm"


def test_checkpoint_retention_and_async_save_flags(capsys):
    a = parse("--save ckpt --ckpt-keep-last 3 --async-save --ckpt-format torch")
    assert a.ckpt_keep_last == 3 and a.async_save
    assert parse("--save ckpt --async-save").ckpt_format == "torch_dist"
    assert "--ckpt-keep-last must be positive, got 0" in fails(
        capsys, "--save ckpt --ckpt-keep-last 0")
    assert "--ckpt-keep-last needs --save" in fails(capsys, "--ckpt-keep-last 2")
    assert "--async-save needs --save" in fails(capsys, "--async-save")


def test_single_file_checkpoints_only_where_rank_0_holds_everything(capsys):
    for flags, world in (("--tensor-model-parallel-size 2 --sequence-parallel", 2),
                         ("--use-distributed-optimizer", 2)):
        err = fails(capsys, f"{MOE} {flags} --save ckpt --ckpt-format torch", world)
        assert "--ckpt-format torch (single file) cannot save with" in err, err
        assert parse(f"{MOE} {flags} --save ckpt --load ckpt", world).save == "ckpt"


@pytest.mark.parametrize("weight", ["nan", "inf", "1e400", "-1", "0"])
def test_data_path_weights_are_finite_and_positive(capsys, tmp_path, weight):
    """A blend weight of nan or 1e400 (inf) trained silently before (issue 26, item 6)."""
    base = BASE.replace("--mock-data", "--tokenizer-type NullTokenizer --vocab-size 100")
    err = fails(capsys, f"--data-path {weight} {tmp_path}/c", base=base)
    assert "--data-path" in err and "weights must be finite, non-negative" in err, err
