"""Megatron-LM torch_dist checkpoints of multi-latent attention (MLA) and multi-token
prediction (MTP) models in and out, against real megatron-core (0.19.2, the peer venv of
megatron_peer/mcore_venv.py) as the oracle.

The peer builds megatron-core's own MLASelfAttention (local spec: q/kv latents and their
norms, YaRN with a softmax mscale; or plain RoPE without a query latent) and its
MultiTokenPredictionBlock; only core attention is the peer's (megatron-core's local
DotProductAttention has no separate v head dim: peer.py MLACoreAttention).

- megatron-to-megamoe: megamoe's logits on the converted checkpoint equal megatron-core's
  on the same tokens (fp32; max abs diff <= 1e-5 of the logits' scale: the same fp32 math
  in another order, on this CPU in this run), and each MTP depth's loss equals the loss
  of megatron-core's MTP logits for that depth (relative 1e-5, same reason; computed over
  the real vocabulary, which megamoe's softmax covers: padding rows are masked);
- megamoe-to-megatron: the round trip is bitwise on every tensor, the extra-state items
  are the ones megatron-core saved, the args carry the MLA / MTP fields under Megatron's
  names, and (slow set) megatron-core's own dist_checkpointing.load of it gives the same
  logits and MTP logits, bitwise.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.nn.functional as F

from megamoe.cli.megatron_args import (
    MLA_FIELDS,
    MTP_FIELDS,
    MegatronArgsError,
    flags_from_args,
    megatron_cannot_express,
)
from megamoe.config import ModelConfig
from megamoe.model.megatron_mla import mla_to_megamoe
from megamoe.model.mtp import MTPLossTracker
from megamoe.training.checkpoint import build_single_process_model
from megamoe.training.checkpoint.safe_load import read_dcp_metadata
from tests.tools.megatron_peer.mcore_venv import run_peer
from tests.tools.test_convert_megatron import (
    _assert_close,
    _fails_cleanly,
    _rewrite_common,
    _tensors,
    _to_megamoe,
    megatron_format,
)
from tools.checkpoint.convert import main as convert

TOKENS = [[(7 * i + 3 * b + 1) % 100 for i in range(16)] for b in range(2)]
LABELS = [[(7 * i + 3 * b + 8) % 100 for i in range(16)] for b in range(2)]  # peer.py's
VOCAB = 100
IT = "iter_0000007"


def _model(ckpt_root: str):
    return build_single_process_model(os.path.join(ckpt_root, IT))[0]


def _mtp_losses(model) -> torch.Tensor:
    """[D] each depth's loss of megamoe's MTP on TOKENS / LABELS (training mode: MTP runs
    only there; no dropout in these models)."""
    MTPLossTracker.take()
    with torch.no_grad():
        model.train()(torch.tensor(TOKENS), labels=torch.tensor(LABELS))
    model.eval()
    return MTPLossTracker.take()


def _reference_mtp_losses(mtp_logits_DSBV: torch.Tensor) -> torch.Tensor:
    """Each depth's masked mean cross-entropy from megatron-core's MTP logits, with its
    process_mtp_loss's rolled labels and loss mask (shift left, zero filled)."""
    labels, mask = torch.tensor(LABELS), torch.ones(2, 16)
    out = []
    for logits_SBV in mtp_logits_DSBV[..., :VOCAB]:
        labels = torch.cat([labels[:, 1:], torch.zeros_like(labels[:, :1])], dim=1)
        mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
        ce_BS = F.cross_entropy(logits_SBV.transpose(0, 1).reshape(-1, VOCAB),
                                labels.reshape(-1), reduction="none").view_as(mask)
        out.append((ce_BS * mask).sum() / mask.sum())
    return torch.stack(out)


def _extra_state(it_dir: str) -> set[str]:
    meta = read_dcp_metadata(os.path.join(it_dir, ".metadata"))
    return {k for k in meta.state_dict_metadata if "_extra_state" in k}


def test_mla_mtp_both_ways(saves, tmp_path):
    """DeepSeek-V3's shape (MLA with latents, YaRN, dense first layer, shared experts,
    two MTP depths): logits and MTP losses equal megatron-core's; written back, every
    tensor is bitwise the saved one under the spec's names."""
    save = saves("mla_mtp")
    mm, back = str(tmp_path / "mm"), str(tmp_path / "back")
    _to_megamoe(save, mm)
    model = _model(mm)
    with torch.no_grad():
        logits = model.eval()(torch.tensor(TOKENS))
    _assert_close(logits, torch.load(os.path.join(save, "reference_logits.pt")))
    got = _mtp_losses(model)
    want = _reference_mtp_losses(torch.load(os.path.join(save, "reference_mtp_logits.pt")))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    saved_args = megatron_format.read_megatron(f"{save}/{IT}")[0]["args"]
    for spec in ("local", "te"):
        out = f"{back}-{spec}"
        assert convert(["megamoe-to-megatron", "--input", mm, "--output", out,
                        "--megatron-spec", spec]) == 0
        got_t, want_t = _tensors(f"{out}/{IT}"), _tensors(f"{save}/{IT}")
        if spec == "te":  # latent norms fused into the up projections; dense layer 0's
            # pre-MLP norm into its fc1 (megatron_mla.py)
            want_t = {k.replace("self_attention.q_layernorm.weight",
                                "self_attention.linear_q_up_proj.layer_norm_weight")
                      .replace("self_attention.kv_layernorm.weight",
                               "self_attention.linear_kv_up_proj.layer_norm_weight")
                      .replace("layers.0.pre_mlp_layernorm.weight",
                               "layers.0.mlp.linear_fc1.layer_norm_weight"): v
                      for k, v in want_t.items()}
        assert sorted(got_t) == sorted(want_t)
        assert all(torch.equal(got_t[k], want_t[k]) for k in want_t)
        assert _extra_state(f"{out}/{IT}") == _extra_state(f"{save}/{IT}")
        args = megatron_format.read_megatron(f"{out}/{IT}")[0]["args"]
        for name in (*MLA_FIELDS, *MTP_FIELDS, "qk_layernorm", "moe_layer_freq"):
            assert getattr(args, name) == getattr(saved_args, name), name


def test_bad_mla_field_in_a_real_save(saves, tmp_path, capsys):
    """A saved MLA field of the wrong type: one line naming it, exit 1, nothing written."""
    bad, out = str(tmp_path / "bad"), str(tmp_path / "out")

    def edit(common):
        common["args"].kv_lora_rank = "20"
        return common
    _rewrite_common(saves("mla_mtp"), bad, edit)
    _fails_cleanly(capsys, ["megatron-to-megamoe", "--input", bad, "--output", out], out,
                   "args.kv_lora_rank = '20'")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mla_mtp", "mla_rope"])
def test_mla_variant_loads_back_into_megatron_core(saves, mcore_python, tmp_path, variant):
    """Converted in, out (local spec), and loaded by megatron-core's own
    dist_checkpointing.load: the same logits (and MTP logits) as the model that was
    saved, bitwise. mla_rope: plain RoPE, no query latent, no latent norms, tied
    embeddings, all layers MoE (stacked layer keys)."""
    save = saves(variant)
    ref = torch.load(os.path.join(save, "reference_logits.pt"))
    mm, back = str(tmp_path / "mm"), str(tmp_path / "back")
    _to_megamoe(save, mm)
    with torch.no_grad():
        _assert_close(_model(mm).eval()(torch.tensor(TOKENS)), ref)
    assert convert(["megamoe-to-megatron", "--input", mm, "--output", back,
                    "--megatron-spec", "local"]) == 0
    assert _tensors(f"{back}/{IT}").keys() == _tensors(f"{save}/{IT}").keys()
    got = str(tmp_path / "logits.pt")
    run_peer(["load", "--variant", variant, "--ckpt", back, "--out", got], python=mcore_python)
    assert torch.equal(torch.load(got), ref)
    if variant == "mla_mtp":
        assert torch.equal(torch.load(got + ".mtp"),
                           torch.load(os.path.join(save, "reference_mtp_logits.pt")))


# ---------------------------------------------------------------- the saved args

def _mla_args(**over) -> argparse.Namespace:
    """A Megatron-LM Namespace of an MLA + MTP model (the fields the conversion reads)."""
    fields = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                  group_query_attention=False, seq_length=16, max_position_embeddings=16,
                  normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                  add_bias_linear=False, multi_latent_attention=True, q_lora_rank=24,
                  kv_lora_rank=20, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10,
                  rope_type=None, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                  qk_layernorm=True, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    fields.update(over)
    return argparse.Namespace(**fields)


def test_mla_mtp_args_read_with_their_flags():
    flags = flags_from_args(_mla_args())
    for flag, value in (("--q-lora-rank", "24"), ("--kv-lora-rank", "20"),
                        ("--qk-head-dim", "12"), ("--qk-pos-emb-head-dim", "8"),
                        ("--v-head-dim", "10"), ("--rotary-scaling-factor", "4.0"),
                        ("--mscale-all-dim", "1.0"), ("--mtp-num-layers", "2"),
                        ("--mtp-loss-scaling-factor", "0.3")):
        assert flags[flags.index(flag) + 1] == value, flag
    assert "--multi-latent-attention" in flags and "--rope-type" not in flags  # None: yarn
    # without MLA / MTP, Megatron's saved defaults of their fields are not read
    plain = flags_from_args(_mla_args(multi_latent_attention=False, mtp_num_layers=None))
    assert not {"--kv-lora-rank", "--multi-latent-attention", "--mtp-loss-scaling-factor"
                } & set(plain)


@pytest.mark.parametrize("field, value, needle", [
    ("q_lora_rank", "24", "expected an integer"),
    ("kv_lora_rank", 0, "expected an integer >= 1"),
    ("qk_head_dim", True, "expected an integer"),
    ("v_head_dim", 2.5, "expected an integer"),
    ("qk_pos_emb_head_dim", 2**41, "expected an integer"),
    ("rope_type", "ntk", "expected one of"),
    ("rotary_scaling_factor", float("nan"), "expected a number"),
    ("rotary_scaling_factor", 0.0, "expected a number"),
    ("mscale", float("inf"), "expected a number"),
    ("mscale_all_dim", -1.0, "expected a number"),
    ("mtp_num_layers", 1.0, "expected an integer"),
    ("mtp_loss_scaling_factor", "0.1", "expected a number"),
    ("multi_latent_attention", 1, "expected True or False"),
    ("rotary_interleaved", 1, "expected True or False"),
    ("mla_down_proj_fusion", True, "not supported yet"),
    ("mtp_use_repeated_layer", True, "not supported yet"),
    ("mtp_detach_heads", True, "not supported yet"),
    ("experimental_attention_variant", "dsa", "not supported yet"),
])
def test_mla_mtp_args_checked(field, value, needle):
    with pytest.raises(MegatronArgsError) as e:
        flags_from_args(_mla_args(**{field: value}))
    assert f"args.{field}" in str(e.value) and needle in str(e.value)


def test_mla_norm_megamoe_cannot_hold_is_refused_both_ways():
    """--qk-layernorm without --q-lora-rank (DeepSeek-V2-Lite): megatron-core before
    July 2026 (Megatron-LM 4464d1c) built the kv latent norm only (megamoe's MLA);
    since then its TE spec also norms the hidden states inside linear_q_proj (its local
    spec refuses to build). Read: the args convert, the extra norm's tensor is refused;
    written: refused (the Megatron of today would build that norm)."""
    assert "--qk-layernorm" in flags_from_args(_mla_args(q_lora_rank=None))
    att = "decoder.layers.0.self_attention"
    src = {f"{att}.linear_q_proj.weight": torch.zeros(80, 64),
           f"{att}.linear_q_proj.layer_norm_weight": torch.ones(64)}
    with pytest.raises(ValueError, match="linear_q_proj.layer_norm_weight.*not supported"):
        mla_to_megamoe(src, att, att)
    mla = dict(multi_latent_attention=True, num_attention_heads=4, hidden_size=64,
               kv_lora_rank=20, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10)
    assert "linear_q_proj" in megatron_cannot_express(ModelConfig(**mla, qk_layernorm=True))
    assert megatron_cannot_express(ModelConfig(**mla, q_lora_rank=24, qk_layernorm=True)) is None
    why = megatron_cannot_express(ModelConfig(**mla, original_max_position_embeddings=8192))
    assert "original_max_position_embeddings" in why


@pytest.mark.slow
def test_mla_mtp_legacy_torch_format(mcore_python, tmp_path):
    """Megatron-LM's legacy `--ckpt-format torch` of the MLA + MTP model over TP2 x PP2 x
    EP2 (peer_legacy.py): the local spec's column-parallel down projections are merged,
    the MTP depths (last stage, `mtp_model_layer` in megatron-core 0.19's state_dict) and
    their experts renumbered, the last stage's embedding copy dropped; logits and MTP
    losses equal megatron-core's TP1 model that loaded the torch_dist copy."""
    from tests.tools.megatron_peer.mcore_venv import PEER_LEGACY

    save, mm = str(tmp_path / "legacy"), str(tmp_path / "mm")
    run_peer(["--variant", "mla_mtp", "--tp", "2", "--pp", "2", "--ep", "2", "--out", save],
             python=mcore_python, script=PEER_LEGACY)
    _to_megamoe(save, mm)
    model = _model(mm)
    with torch.no_grad():
        _assert_close(model.eval()(torch.tensor(TOKENS)),
                      torch.load(os.path.join(save, "reference_logits.pt")))
    want = _reference_mtp_losses(torch.load(os.path.join(save, "reference_mtp_logits.pt")))
    torch.testing.assert_close(_mtp_losses(model), want, rtol=1e-5, atol=0)
