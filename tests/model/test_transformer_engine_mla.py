"""--transformer-impl transformer_engine with --multi-latent-attention (DeepSeek-V3-style
Megatron scripts set both), wired against the TE stand-in (tests/te_stand_in): Megatron's
MLA TE spec (model/te/mla.py) on MLASelfAttention's own parameters gives the local path's
logits and gradients, with and without --q-lora-rank and the latent norms, under FP8
recipes every MLA GEMM and the core attention run in TE's autocast, a checkpoint moves
between local and TE runs, and what is not built is named in one line."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli import main as cli_main
from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import ConfigError
from megamoe.model.te.linears import TeLinearGemm, TeNormLinearGemm
from megamoe.model.te.support import check_run
from megamoe.training.build import build_model
from tests.te_stand_in import installed
from tests.training.test_pretrain import TINY_MOE

# A dense layer then an MoE layer; q + pe head dim 12, v head dim 6 (TE's kv_channels pair),
# YaRN with mscale-all-dim: MLA's softmax scale is not TE's default 1/sqrt(12).
MLA = (TINY_MOE.replace("--group-query-attention ", "")
       + " --multi-latent-attention --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
         "--v-head-dim 6 --rotary-scaling-factor 4 --mscale 0.9 --mscale-all-dim 0.8 "
         "--moe-layer-freq ([0]+[1]*1)")
TE = "--transformer-impl transformer_engine"
Q_LORA = "--q-lora-rank 16"


def _run(extra: str):
    return run_config_from_args(parse_args(shlex.split(f"{MLA} --train-iters 1 {extra}"),
                                           world_size=1), 97)


def _loss_and_grads(model, tokens, labels):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    model(tokens, labels=labels).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_placement(model, extra: str) -> None:
    """Megatron's MLA TE spec, module for module, on the attention's own parameters."""
    for layer in model.decoder.layers:
        attn = layer.self_attention
        assert not layer.fused_input_norm  # MLA's spec keeps input_layernorm apart
        assert attn.fused_latent_norms
        for sub, norm in (("linear_q_up_proj", attn.q_layernorm),
                          ("linear_kv_up_proj", attn.kv_layernorm)):
            linear = getattr(attn, sub)
            if linear is None:
                continue
            engine = linear.fp8
            assert isinstance(engine, TeNormLinearGemm if norm is not None else TeLinearGemm)
            assert engine.module.weight is linear.weight
            if norm is not None:
                assert engine.module.layer_norm_weight is norm.weight
        for sub in ("linear_q_proj", "linear_q_down_proj", "linear_kv_down_proj",
                    "linear_proj"):
            linear = getattr(attn, sub)
            if linear is not None:
                assert type(linear.fp8) is TeLinearGemm and linear.fp8.module.weight is \
                    linear.weight, sub
        assert (attn.linear_q_proj is None) == (Q_LORA in extra)
        dpa = attn.te_core_attention.module
        assert (dpa.dim_k, dpa.dim_v, dpa.heads, dpa.groups) == (12, 6, 4, 4)
        assert dpa.scale == attn.softmax_scale != 12 ** -0.5


@pytest.mark.parametrize("extra", [
    pytest.param(f"{Q_LORA} --qk-layernorm", id="q_lora-latent_norms"),
    pytest.param("--qk-layernorm --normalization LayerNorm --mtp-num-layers 1 "
                 "--no-disable-bias-linear", id="no_q_lora-kv_norm-layernorm-mtp"),
    pytest.param(f"{Q_LORA} --recompute-granularity selective --recompute-modules "
                 "mla_up_proj core_attn", id="no_norms-recompute", marks=pytest.mark.slow),
])
def test_te_mla_gives_the_local_models_logits_and_grads(extra):
    """Same seed, same weights: logits and every gradient agree to fp32 rounding (the
    stand-in runs the same formulas; rtol as tests/model/test_transformer_engine.py, the
    experts' per-group loop may sum in another order; measured on this CPU: equal). The
    latent norms fused into the up projections (RMSNorm; LayerNorm's layer_norm_bias too),
    without --q-lora-rank (linear_q_proj) with an MTP depth (an MLA layer too) and linear
    biases; slow: no latent norms, with the up projections and core attention recomputed."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 97, (2, 16))
    labels = torch.randint(0, 97, (2, 16))
    local = build_model(_run(extra))
    with installed() as te:
        model = build_model(_run(f"{TE} {extra}"))
        assert list(model.state_dict()) == list(local.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     local.state_dict().values()))
        _check_placement(model, extra)
        te.CALLS.clear()
        logits, grads = _loss_and_grads(model, tokens, labels)
        ran = {c for c, _ in te.CALLS}
    ref_logits, ref_grads = _loss_and_grads(local, tokens, labels)
    want = {"Linear", "GroupedLinear", "DotProductAttention", "LayerNormLinear"}
    assert ran == want, ran  # (LayerNormLinear: the dense MLP's fc1 at least)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7,
                                   msg=name)


def test_fp8_runs_every_mla_module_under_tes_recipe_and_keeps_its_state():
    """Delayed scaling: every TE call (the MLA projections and core attention too) runs
    under the recipe, and each MLA module's extra state (its amax history) is kept under
    Megatron's TE-spec name and restores into another TE model."""
    flags = f"{TE} {Q_LORA} --qk-layernorm --fp8-format hybrid --fp8-recipe delayed " \
            "--fp8-amax-history-len 4"
    with installed() as te:
        a, b = build_model(_run(flags)), build_model(_run(flags))
        te.CALLS.clear()
        a(torch.randint(0, 97, (2, 16)))
        recipes = [type(r).__name__ for _, r in te.CALLS]
        saved = a.te_state.state_dict()
        b.te_state.load_state_dict(saved)
        restored = {n: m.fp8_state for n, m in b.te_state.modules.items()}
    assert recipes and set(recipes) == {"DelayedScaling"}, recipes
    attn = "decoder.layers.1.self_attention"
    names = {f"{attn}.{m}" for m in ("linear_q_down_proj", "linear_q_up_proj",
                                     "linear_kv_down_proj", "linear_kv_up_proj",
                                     "linear_proj", "core_attention")}
    assert names <= set(saved)
    for name in names:
        assert saved[name].numel() and restored[name]["steps"] == 1, name


@pytest.mark.parametrize("flags,says", [  # (MLA at TP > 1: test_transformer_engine_parallel)
    ("--fp8-format e4m3 --recompute-granularity selective --recompute-modules mla_up_proj",
     "--recompute-modules mla_up_proj with --fp8-format"),
])
def test_what_te_mla_does_not_build_yet_is_named(flags, says):
    run = run_config_from_args(parse_args(shlex.split(f"{MLA} --train-iters 1 {TE} {flags}"),
                                          world_size=2), 97)
    with pytest.raises(ConfigError, match=f"not supported yet: {says}"):
        check_run(run)
    check_run(_run(f"{TE} --recompute-granularity selective --recompute-modules "
                   "mla_up_proj"))  # without FP8 the replay computes as the forward


def test_cli_names_mla_up_proj_recompute_under_fp8_in_one_line(capsys):
    with installed():
        rc = cli_main.main(shlex.split(
            f"{MLA} --train-iters 1 {TE} --fp8-format e4m3 --recompute-granularity "
            "selective --recompute-modules mla_up_proj"))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "not supported yet: --recompute-modules mla_up_proj" in err, err


def _losses(extra: str) -> list[float]:
    args = parse_args(shlex.split(f"{MLA} {Q_LORA} --qk-layernorm {extra}"), world_size=1)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


def test_an_mla_checkpoint_moves_between_local_and_transformer_engine(tmp_path):
    """3 local steps straight; 2 local steps saved, then the third on TE from that
    checkpoint; 2 TE steps saved, then the third local: the same losses (fp32 rounding,
    1e-5 as the dense TE checkpoint test; measured on this CPU: equal)."""
    straight = _losses("--train-iters 3")
    local_ckpt, te_ckpt = tmp_path / "local", tmp_path / "te"
    _losses(f"--train-iters 2 --save {local_ckpt} --save-interval 2")
    with installed():
        te_resumed = _losses(f"--train-iters 3 {TE} --load {local_ckpt}")
        te_first = _losses(f"--train-iters 2 {TE} --save {te_ckpt} --save-interval 2")
    local_resumed = _losses(f"--train-iters 3 --load {te_ckpt}")
    for got, want in ((te_first, straight[:2]), (te_resumed, straight[2:]),
                      (local_resumed, straight[2:])):
        assert len(got) == len(want) and all(
            abs(x - y) <= 1e-5 * abs(y) for x, y in zip(got, want)), (got, straight)


@pytest.mark.slow
def test_the_tiny_deepseek_v3_recipe_trains_alike_on_te():
    """configs/tiny-deepseek-v3-cpu.yaml (MLA with both latents and their norms, YaRN,
    sigmoid group-limited routing, a shared expert, an MTP depth): 3 steps on TE (the
    stand-in) give the local run's losses (1e-5, as the checkpoint test)."""
    flags = ("--config configs/tiny-deepseek-v3-cpu.yaml --mock-data --tokenizer-type "
             "NullTokenizer --vocab-size 256 --num-workers 0 --seq-length 32 "
             "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
             "--lr 3e-3 --train-iters 3")

    def losses(extra: str) -> list[float]:
        args = parse_args(shlex.split(f"{flags} {extra}"), world_size=1)
        return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]

    local = losses("")
    with installed():
        te = losses(TE)
    assert len(te) == len(local) == 3
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(te, local)), (te, local)
