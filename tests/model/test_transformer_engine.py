"""--transformer-impl transformer_engine, wired against the TE stand-in (tests/te_stand_in:
TE v2.18's recorded signatures, megamoe's fp32 math): the TE-path model gives the local
model's logits and gradients with the same weights, every GEMM and the core attention run
on TE's modules with the layer's own parameters, the --fp8-* flags reach TE's recipe
objects and autocast, and a model without TE ends with one line."""

from __future__ import annotations

import json
import os
import pickle
import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import ConfigError
from megamoe.model.te.attention import backend_environment, environment_conflict
from megamoe.model.te.loader import TransformerEngineMissing, load_transformer_engine
from megamoe.model.te.support import check_run
from megamoe.training.build import build_model
from tests.te_stand_in import installed
from tests.training.test_pretrain import TINY_MOE

# Layer 0 dense (LayerNormLinear fc1), layer 1 MoE with shared experts; qkv bias, GQA.
SHAPE = ("--moe-layer-freq ([0]+[1]*1) --moe-shared-expert-intermediate-size 32 "
         "--add-qkv-bias --ffn-hidden-size 40 --train-iters 1")
TE = "--transformer-impl transformer_engine"
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures",
                       "te_signatures.json")


def _run(extra: str = ""):
    return run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} {SHAPE} {extra}"),
                                           world_size=1), 97)


def _loss_and_grads(model, tokens, labels):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fixture_is_tes_source_at_the_pinned_tag():
    data = json.load(open(FIXTURE))
    assert data["source"]["commit"] == "27486e03cfc1fa41f6932dcecdc47c71c47eac3e"
    assert data["source"]["rev"] == "v2.18"
    names = {p["name"] for p in
             data["callables"]["transformer_engine.pytorch.LayerNormLinear.__init__"]["params"]}
    assert {"normalization", "eps", "params_dtype", "init_method"} <= names


@pytest.mark.parametrize("extra", ["", "--normalization LayerNorm --mtp-num-layers 1 "
                                   "--qk-layernorm --no-disable-bias-linear"])
def test_te_path_gives_the_local_models_logits_and_grads(extra):
    """Same seed, same weights (the TE modules compute with the layers' own parameters):
    logits and every gradient agree to fp32 rounding (the stand-in runs the same
    formulas, the experts as a per-group loop: a summation order that may differ from
    the grouped GEMM's; measured on this CPU: equal). RMSNorm; and LayerNorm
    (layer_norm_bias) with an MTP depth (eh_proj on TE's Linear), q/k norms and linear
    biases (row-parallel biases added by megamoe after TE's GEMM, experts' per row)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 97, (2, 16))
    labels = torch.randint(0, 97, (2, 16))
    local = build_model(_run(extra))
    with installed() as te:
        model = build_model(_run(f"{TE} {extra}"))
        assert list(model.state_dict()) == list(local.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     local.state_dict().values()))
        te.CALLS.clear()
        logits, grads = _loss_and_grads(model, tokens, labels)
        ran = {c for c, _ in te.CALLS}
    ref_logits, ref_grads = _loss_and_grads(local, tokens, labels)
    assert ran == {"LayerNormLinear", "Linear", "GroupedLinear", "DotProductAttention"}, ran
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7,
                                   msg=name)


def test_te_modules_hold_the_layers_parameters():
    with installed():
        model = build_model(_run(TE))
    dense, moe = model.decoder.layers
    qkv = dense.self_attention.linear_qkv
    assert qkv.fp8.module.layer_norm_weight is dense.input_layernorm.weight
    assert qkv.fp8.module.weight is qkv.weight and qkv.fp8.module.bias is qkv.bias
    assert dense.mlp.linear_fc1.fp8.module.layer_norm_weight is dense.pre_mlp_layernorm.weight
    assert dense.fused_input_norm and dense.fused_pre_mlp_norm
    assert moe.fused_input_norm and not moe.fused_pre_mlp_norm  # MoE: the norm stays apart
    assert set(model.te_state.modules) == {
        *(f"decoder.layers.0.{m}" for m in ("self_attention.linear_qkv",
                                            "self_attention.core_attention",
                                            "self_attention.linear_proj",
                                            "mlp.linear_fc1", "mlp.linear_fc2")),
        *(f"decoder.layers.1.{m}" for m in ("self_attention.linear_qkv",
                                            "self_attention.core_attention",
                                            "self_attention.linear_proj",
                                            "mlp.experts.linear_fc1", "mlp.experts.linear_fc2",
                                            "mlp.shared_experts.linear_fc1",
                                            "mlp.shared_experts.linear_fc2"))}
    model.eval()  # the TE modules sit outside the tree: each call copies the mode
    with installed():
        model(torch.randint(0, 97, (1, 16)))
    assert not qkv.fp8.module.training
    assert not dense.self_attention.te_core_attention.module.training
    experts = moe.mlp.experts.fp8.fc1.module
    assert not list(experts.parameters())  # weight{e}: views made per call, then dropped
    assert not any(k.startswith("weight") for k in vars(experts))


@pytest.mark.parametrize("flags,recipe,fields", [
    ("--fp8-format hybrid --fp8-recipe delayed --fp8-margin 2 --fp8-amax-history-len 16 "
     "--fp8-amax-compute-algo max", "DelayedScaling",
     {"margin": 2, "amax_history_len": 16, "amax_compute_algo": "max",
      "fp8_format": "HYBRID"}),
    ("--fp8-format e4m3 --fp8-recipe tensorwise", "Float8CurrentScaling",
     {"fp8_format": "E4M3"}),
])
def test_fp8_flags_reach_tes_recipe_and_autocast(flags, recipe, fields):
    torch.manual_seed(0)
    tokens = torch.randint(0, 97, (2, 16))
    with installed() as te:
        model = build_model(_run(f"{TE} {flags}"))
        te.CALLS.clear()
        model(tokens)
        recipes = [r for _, r in te.CALLS]
    assert recipes and all(type(r).__name__ == recipe for r in recipes), recipes
    r = recipes[0]
    for name, value in fields.items():
        got = getattr(r, name)
        assert (got.name if name == "fp8_format" else got) == value, (name, got)


def test_delayed_scalings_extra_state_round_trips():
    """TE's per-module extra state (the stand-in's amax histories) is collected under
    Megatron's module names and restores into another TE model exactly; bad input is
    named."""
    tokens = torch.randint(0, 97, (2, 16))
    flags = f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4"
    with installed():
        a, b = build_model(_run(flags)), build_model(_run(flags))
        a(tokens)
        saved = a.te_state.state_dict()
        assert all(v.dtype == torch.uint8 and v.numel() for v in saved.values())
        b.te_state.load_state_dict(saved)
        for name, module in b.te_state.modules.items():  # what TE would hold again
            want = pickle.loads(saved[name].numpy().tobytes())
            assert torch.equal(module.fp8_state["amax_history"], want["amax_history"]), name
            assert module.fp8_state["steps"] == want["steps"] == 1
        with pytest.raises(ValueError, match="1-D uint8"):
            b.te_state.load_state_dict({**saved, next(iter(saved)): torch.zeros(2)})
        with pytest.raises(ValueError, match="modules differ"):
            b.te_state.load_state_dict({"x": saved[next(iter(saved))]})


def test_without_te_the_run_ends_with_one_line_naming_the_package():
    with pytest.raises(TransformerEngineMissing) as e:
        load_transformer_engine()
    msg = str(e.value)
    assert "transformer_engine" in msg and "\n" not in msg


def test_te_without_its_compiled_extension_is_missing():
    """The Python package alone (PyPI's meta package, a core_cu* wheel) cannot run: the
    probe imports the torch extension first and names it."""
    import sys

    with installed():  # (its exit removes every transformer_engine* entry again)
        sys.modules["transformer_engine_torch"] = None  # the next import of it fails
        with pytest.raises(TransformerEngineMissing, match="transformer_engine_torch"):
            load_transformer_engine()


@pytest.mark.parametrize("flags,says", [
    ("--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap",
     "--tp-comm-overlap"),
    ("--recompute-granularity selective --recompute-modules layernorm",
     "--recompute-modules layernorm"),
    ("--fp8-format e4m3 --recompute-granularity selective --recompute-modules moe",
     "--recompute-modules moe"),
    ("--fp8-format e4m3 --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 1", "--recompute-granularity full"),
])
def test_what_te_does_not_build_yet_is_named(flags, says):
    run = run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {TE} "
                                                      f"{flags}"), world_size=2), 97)
    with pytest.raises(ConfigError, match=f"not supported yet: {says}"):
        check_run(run)


@pytest.mark.parametrize("layout", [
    "--tensor-model-parallel-size 2 --sequence-parallel",
    "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1",
    "--context-parallel-size 2", "--context-parallel-size 2 --cp-comm-type a2a"])
def test_te_takes_tensor_and_context_parallel_layouts(layout):
    """TP (+ SP, any ETP) and CP are built under TE (test_transformer_engine_parallel.py,
    tests/training/test_transformer_engine_training.py): the run's checks let them pass."""
    check_run(run_config_from_args(parse_args(shlex.split(
        f"{TINY_MOE} --train-iters 1 {TE} {layout}"), world_size=2), 97))


def test_model_config_names_a_bad_transformer_impl():
    from megamoe.config import ModelConfig

    with pytest.raises(ConfigError, match="--transformer-impl must be local or "
                                          "transformer_engine"):
        ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4,
                    max_position_embeddings=4, vocab_size=16, transformer_impl="te")


def test_attention_backend_sets_tes_switches_as_megatron():
    """Megatron-Core's LanguageModule._set_attention_backend: the chosen switch 1, the
    others 0, all 1 for auto; a preset switch with another value is named."""
    assert backend_environment("auto") == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1",
                                           "NVTE_UNFUSED_ATTN": "1"}
    assert environment_conflict("flash", environ={"NVTE_FLASH_ATTN": "1"}) is None
    says = environment_conflict("flash", environ={"NVTE_FUSED_ATTN": "1"})
    assert says.startswith("NVTE_FUSED_ATTN=1 in the environment, but --attention-backend "
                           "flash sets it to 0")
    assert backend_environment("flash") == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0",
                                            "NVTE_UNFUSED_ATTN": "0"}
    assert backend_environment("unfused")["NVTE_UNFUSED_ATTN"] == "1"
    assert backend_environment("auto", use_flash_attn=True)["NVTE_FLASH_ATTN"] == "1"


def test_dry_run_counts_tes_amax_histories():
    """TE keeps 3 forward + 2 backward delayed-scaling states per GEMM where megamoe's own
    FP8 keeps 3 operands': the dry run's amax bytes are 5/3 of the local count. SHAPE's
    GEMMs: layer 0 (dense) qkv, proj, fc1, fc2; layer 1 qkv, proj, shared fc1, fc2, and
    2 expert GEMMs x 4 experts: 16 tensors' states, each (history 4 + scale) x 4 bytes."""
    from megamoe.planning.fp8_memory import fp8_report

    flags = "--fp8-format hybrid --fp8-amax-history-len 4"
    model = build_model(_run(flags))
    gemms = 4 + 4 + 2 * 4
    local = fp8_report(_run(flags), model)["amax_history_bytes_per_rank"]
    te = fp8_report(_run(f"{flags} {TE}"), model)["amax_history_bytes_per_rank"]
    assert local == gemms * 3 * (4 + 1) * 4 and te == gemms * 5 * (4 + 1) * 4


def test_a_recipe_te_has_no_class_for_is_named():
    """(megamoe's rowwise extension, once built, has no TE recipe: refused, not dropped.)"""
    run = _run(f"{TE} --fp8-format e4m3 --fp8-recipe tensorwise")
    run.fp8.recipe = "rowwise"  # (a value config/fp8.py's checks may accept)
    with pytest.raises(ConfigError, match="not supported yet: --fp8-recipe rowwise with "
                                          "--transformer-impl transformer_engine"):
        check_run(run)


def test_megamoes_default_stays_local():
    """A deliberate difference from Megatron-LM (whose default is transformer_engine, README
    and docs/transformer-engine.md say why): TE needs a CUDA build, the CPU path must run."""
    assert _run().model.transformer_impl == "local"
