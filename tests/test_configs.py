"""configs/: every preset parses (or stops with exactly one "not supported yet" line naming
a key of the preset), has the published size, and the tiny one trains."""

from __future__ import annotations

import glob
import json
import os
import shlex

import pytest
import yaml

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
# (vocabulary, total parameters) as published by the model authors.
PUBLISHED = {
    "mixtral-8x7b.yaml": (32000, 46_702_792_704),
    "mixtral-8x22b.yaml": (32768, 140_630_071_296),
}


def test_all_presets_present():
    names = {os.path.basename(p) for p in PRESETS}
    assert {"mixtral-8x7b.yaml", "mixtral-8x22b.yaml", "deepseek-moe-16b.yaml", "tiny.yaml",
            "tiny-mixtral-cpu.yaml", "qwen3-30b-a3b.yaml", "qwen3-235b-a22b.yaml",
            "olmoe-1b-7b.yaml", "deepseek-v3.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_preset_parses_or_names_unbuilt_flag(path, capsys):
    try:
        args = parse_args(["--config", path, "--dry-run"], world_size=1)
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("pretrain_gpt.py: error: not supported yet: --")
        flag = err[0].split("not supported yet: --")[1].split()[0]
        keys = yaml.safe_load(open(path))
        assert flag in keys or flag.replace("-", "_") in keys, err
        return
    assert args.num_experts is not None and args.num_layers > 0


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_published_size(name, capsys):
    vocab, params = PUBLISHED[name]
    args = parse_args(["--config", os.path.join(ROOT, "configs", name), "--dry-run", "--json",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)],
                      world_size=1)  # NullTokenizer: --vocab-size ids (EOD among them)
    pretrain(args, print_fn=print)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Hugging Face's count has no vocabulary padding; ours pads to a multiple of 128.
    assert abs(out["parameters"] - params) / params < 1e-3, out


def test_deepseek_preset_without_shared_experts_parses(capsys):
    """The one unbuilt feature in the DeepSeek preset is the shared expert; everything else
    (64 fine-grained experts, top-6, first layer dense) validates today."""
    path = os.path.join(ROOT, "configs", "deepseek-moe-16b.yaml")
    keys = yaml.safe_load(open(path))
    keys.pop("moe-shared-expert-intermediate-size")
    args = parse_args([*_to_argv(keys), "--dry-run"], world_size=1)
    assert args.moe_layer_pattern == [0] + [1] * 27 and args.moe_router_topk == 6


def _to_argv(keys: dict) -> list[str]:
    argv: list[str] = []
    for k, v in keys.items():
        if v is True:
            argv.append(f"--{k}")
        elif isinstance(v, list):
            argv += [f"--{k}", *map(str, v)]
        else:
            argv += [f"--{k}", str(v)]
    return argv


def test_tiny_preset_trains_and_flags_override():
    argv = shlex.split(
        f"--config {os.path.join(ROOT, 'configs', 'tiny.yaml')} --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 255 --num-workers 0 --micro-batch-size 2 "
        "--global-batch-size 4 --train-iters 2 --lr 1e-3 --eval-iters 0 --num-layers 1")
    args = parse_args(argv, world_size=1)
    assert args.num_layers == 1  # the command line overrides the preset
    hist = pretrain(args, print_fn=lambda _m: None).history
    assert len(hist) == 2 and all(h["lm loss"] == h["lm loss"] for h in hist)


# Presets of published Hugging Face models: preset -> that model's config.json (as
# published on the Hub; tests/fixtures/hf_configs/).
HF_PRESETS = {"qwen3-30b-a3b.yaml": "qwen3-30b-a3b.json",
              "qwen3-235b-a22b.yaml": "qwen3-235b-a22b.json",
              "olmoe-1b-7b.yaml": "olmoe-1b-7b.json"}
HF_CONFIGS = os.path.join(ROOT, "tests", "fixtures", "hf_configs")


def _hf_config(name: str) -> dict:
    return json.load(open(os.path.join(HF_CONFIGS, HF_PRESETS[name])))


def _model_config(argv: list[str], vocab: int):
    from megamoe.cli.mapping import run_config_from_args

    args = parse_args([*argv, "--dry-run", "--json", "--tokenizer-type", "NullTokenizer",
                       "--vocab-size", str(vocab)], world_size=1)
    return args, run_config_from_args(args, vocab).model


@pytest.mark.parametrize("name", sorted(HF_PRESETS))
def test_hf_preset_has_the_published_models_parameter_count(name, capsys):
    """total and active parameters equal those computed from the published config.json,
    and the converter's flags for that config.json build the same network."""
    from megamoe.config import to_dict
    from megamoe.model import num_parameters
    from megamoe.model.hf_counts import hf_num_parameters
    from megamoe.model.hf_families import family_of_config

    cfg = _hf_config(name)
    args, model = _model_config(["--config", os.path.join(ROOT, "configs", name)],
                                cfg["vocab_size"])
    assert model.padded_vocab_size == cfg["vocab_size"]  # no padding rows to count
    assert num_parameters(model) == hf_num_parameters(cfg)
    _, converted = _model_config(family_of_config(cfg).flags(cfg), cfg["vocab_size"])
    mine, theirs = to_dict(model), to_dict(converted)
    mine["moe"].pop("z_loss_coeff"), theirs["moe"].pop("z_loss_coeff")  # a training choice
    assert mine == theirs
    pretrain(args, print_fn=print)  # --dry-run: the memory/size report
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["parameters"] == hf_num_parameters(cfg)[0], out


TINY_HF = {  # small configs of each family with every option the count depends on
    "Qwen3MoeForCausalLM": dict(head_dim=12, mlp_only_layers=[1], intermediate_size=40,
                                moe_intermediate_size=24, num_experts=6),
    "Qwen2MoeForCausalLM": dict(shared_expert_intermediate_size=36, decoder_sparse_step=2,
                                intermediate_size=40, moe_intermediate_size=24,
                                num_experts=6, tie_word_embeddings=True),
    "OlmoeForCausalLM": dict(intermediate_size=24, num_experts=6, rms_norm_eps=1e-6),
    "MixtralForCausalLM": dict(intermediate_size=24, num_local_experts=6),
    "DeepseekV3ForCausalLM": dict(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                                  qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=6,
                                  n_shared_experts=2, moe_intermediate_size=12,
                                  intermediate_size=40, first_k_dense_replace=1, n_group=2,
                                  topk_group=1),
}


@pytest.mark.parametrize("arch", sorted(TINY_HF))
def test_hf_count_equals_transformers(arch):
    import torch
    import transformers

    from megamoe.model.hf_counts import hf_num_parameters

    cfg = dict(vocab_size=98, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=3, num_experts_per_tok=2, max_position_embeddings=64,
               **TINY_HF[arch])
    cls = getattr(transformers, arch)
    model = cls(cls.config_class(**cfg))
    cfg["architectures"] = [arch]
    assert hf_num_parameters(cfg)[0] == sum(p.numel() for p in model.parameters())
    for name in sorted(HF_PRESETS):  # and for the published configs (built on meta)
        published = _hf_config(name)
        if published["architectures"] == [arch]:
            with torch.device("meta"):
                big = cls(cls.config_class.from_dict(published))
            assert hf_num_parameters(published)[0] == sum(p.numel() for p in big.parameters())


def test_deepseek_v3_preset_has_the_published_models_parameter_count(capsys):
    """configs/deepseek-v3.yaml: megamoe's count (with its one MTP depth) equals the count
    computed from DeepSeek-V3's config.json (671,026,404,352 without MTP, which is
    transformers' own count of that config, built on the meta device; plus the MTP
    module's own 11,610,067,968), and --dry-run reports it."""
    import torch
    import transformers

    from megamoe.model import num_parameters
    from megamoe.model.hf_counts import deepseek_v3_mtp_parameters, hf_num_parameters

    cfg = json.load(open(os.path.join(HF_CONFIGS, "deepseek-v3.json")))
    total, active = hf_num_parameters(cfg)
    mtp_total, mtp_active, mtp_in_files = deepseek_v3_mtp_parameters(cfg)
    assert (total, active) == (671_026_404_352, 37_552_282_624)
    assert total + mtp_in_files == 684_489_830_400  # the model card's "685B"
    args, model = _model_config(["--config", os.path.join(ROOT, "configs",
                                                          "deepseek-v3.yaml")],
                                cfg["vocab_size"])
    assert model.padded_vocab_size == cfg["vocab_size"]
    assert num_parameters(model) == (total + mtp_total, active + mtp_active)
    published = {k: v for k, v in cfg.items() if k != "rope_scaling"}  # counts only
    with torch.device("meta"):
        big = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**published))
    assert sum(p.numel() for p in big.parameters()) == total
    # the converter's flags for that config.json build the same network (the balancing
    # losses and the init std are training choices config.json does not record)
    from megamoe.config import to_dict
    from megamoe.model.hf_families import family_of_config

    _, converted = _model_config(family_of_config(cfg).flags(cfg), cfg["vocab_size"])
    mine, theirs = to_dict(model), to_dict(converted)
    for d in (mine, theirs):
        d.pop("init_method_std")
        for k in ("load_balancing_types", "aux_loss_coeffs", "z_loss_coeff"):
            d["moe"].pop(k)
    assert mine == theirs
    pretrain(args, print_fn=print)  # --dry-run: the memory/size report
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["parameters"] == total + mtp_total, out
