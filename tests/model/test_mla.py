"""Multi-latent attention: output and gradients equal transformers' DeepseekV3Attention
(given the same weights, fp32), with and without query compression, with YaRN scaling
(concentration and softmax mscale != 1); a naive reference; the HF name mapping round
trip; parameter counts; and tensor (+ sequence) parallelism equal to one process."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.config import ModelConfig, MoEConfig
from megamoe.model.flops import num_parameters
from megamoe.model.gpt_model import GPTModel
from megamoe.model.hf_mla import mla_from_hf, mla_to_hf
from megamoe.model.mla import MLASelfAttention, mla_cos_sin
from megamoe.parallelize import apply_recompute
from tests.distributed import run_distributed
from tests.model.test_tensor_parallel_model import _cases_worker

transformers = pytest.importorskip("transformers")

H, HEADS, QK, PE, V, KV_RANK, S, B = 48, 4, 12, 8, 10, 16, 12, 2
FACTOR, MSCALE, MSCALE_ALL, ORIG = 4.0, 0.8, 0.6, 6


def _config(q_lora_rank, yarn: bool = True, **kw) -> ModelConfig:
    yarn_kw = dict(rotary_scaling_factor=FACTOR, mscale=MSCALE, mscale_all_dim=MSCALE_ALL,
                   original_max_position_embeddings=ORIG) if yarn else {}
    kw = dict(dict(qk_layernorm=True), **kw)
    return ModelConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
        max_position_embeddings=64, vocab_size=64, normalization="RMSNorm", norm_epsilon=1e-6,
        multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK,
        qk_head_dim=QK, qk_pos_emb_head_dim=PE, v_head_dim=V,
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        position_embedding_type="rope", **yarn_kw, **kw)


def _hf_attention(q_lora_rank, yarn: bool):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=FACTOR, mscale=MSCALE,
                mscale_all_dim=MSCALE_ALL, original_max_position_embeddings=ORIG,
                beta_fast=32.0, beta_slow=1.0) if yarn else \
        dict(rope_type="default", rope_theta=10000.0)
    cfg = ds.DeepseekV3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK, qk_nope_head_dim=QK,
        qk_rope_head_dim=PE, v_head_dim=V, rms_norm_eps=1e-6, attention_bias=False,
        max_position_embeddings=64, rope_parameters=rope, rope_interleave=True,
        attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    attn = ds.DeepseekV3Attention(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.3 * torch.randn_like(p))
    return attn, ds.DeepseekV3RotaryEmbedding(cfg)


def _hf_forward(attn, rotary, x_BSH):
    pos = torch.arange(x_BSH.shape[1])[None].expand(x_BSH.shape[0], -1)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None].expand(B, 1, S, S)
    out, _ = attn(x_BSH, rotary(x_BSH, pos), mask)
    return out


def _ours_from_hf(attn, config: ModelConfig) -> MLASelfAttention:
    ours = MLASelfAttention(config).eval()
    src = {f"attn.{k}": v.detach().clone() for k, v in attn.state_dict().items()}
    mapped = mla_from_hf(src, "attn", "mla")
    assert not src, f"unmapped HF keys: {sorted(src)}"
    ours.load_state_dict({k[len("mla."):]: v for k, v in mapped.items()}, strict=True)
    return ours


@pytest.mark.parametrize("q_lora_rank,yarn", [(20, True), (None, True), (20, False)])
def test_mla_equals_transformers_deepseek_v3_attention(q_lora_rank, yarn):
    attn, rotary = _hf_attention(q_lora_rank, yarn)
    config = _config(q_lora_rank, yarn)
    ours = _ours_from_hf(attn, config)
    if yarn:  # the test exercises YaRN's temperature terms, not just plain RoPE
        assert abs(ours.softmax_scale * math.sqrt(QK + PE) - 1.0) > 0.01
        assert abs(mla_cos_sin(config, 1)[0].max().item() - 1.0) > 0.01
    x_BSH = torch.randn(B, S, H, generator=torch.Generator().manual_seed(0))
    x_hf = x_BSH.clone().requires_grad_(True)
    want = _hf_forward(attn, rotary, x_hf)
    x_ours = x_BSH.transpose(0, 1).contiguous().requires_grad_(True)
    got = ours(x_ours).transpose(0, 1)
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    g = torch.randn_like(want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    torch.testing.assert_close(x_ours.grad.transpose(0, 1), x_hf.grad, rtol=1e-4, atol=1e-5)
    hf_grads = {f"attn.{k}": p.grad for k, p in attn.named_parameters()}
    for k, g_hf in mla_from_hf(hf_grads, "attn", "mla").items():
        torch.testing.assert_close(dict(ours.named_parameters())[k[4:]].grad, g_hf,
                                   rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def _naive_mla(m: MLASelfAttention, config: ModelConfig, x_SBH: torch.Tensor) -> torch.Tensor:
    """The DeepSeek-V2 paper's equations, written out per head with explicit loops."""
    cos, sin = mla_cos_sin(config, x_SBH.shape[0])
    cos, sin = cos[:, 0, 0], sin[:, 0, 0]  # [S, P]

    def rope(t_SP):  # interleaved pairs (x0, x1) rotated by one angle, output de-interleaved
        a, b = t_SP[:, 0::2], t_SP[:, 1::2]
        c, s_ = cos[:, : PE // 2], sin[:, : PE // 2]
        return torch.cat((a * c - b * s_, b * c + a * s_), dim=-1)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    out = []
    for b in range(x_SBH.shape[1]):
        x = x_SBH[:, b]
        c_q = rms(x @ m.linear_q_down_proj.weight.t(), m.q_layernorm.weight)
        q = (c_q @ m.linear_q_up_proj.weight.t()).view(S, HEADS, QK + PE)
        kv = x @ m.linear_kv_down_proj.weight.t()
        c_kv = rms(kv[:, :KV_RANK], m.kv_layernorm.weight)
        k_pe = rope(kv[:, KV_RANK:])
        kv_up = (c_kv @ m.linear_kv_up_proj.weight.t()).view(S, HEADS, QK + V)
        heads = []
        for n in range(HEADS):
            qn = torch.cat((q[:, n, :QK], rope(q[:, n, QK:])), dim=-1)
            kn = torch.cat((kv_up[:, n, :QK], k_pe), dim=-1)
            scores = qn @ kn.t() * m.softmax_scale
            scores = scores.masked_fill(torch.ones(S, S).triu(1).bool(), float("-inf"))
            heads.append(scores.softmax(-1) @ kv_up[:, n, QK:])
        out.append(torch.cat(heads, dim=-1) @ m.linear_proj.weight.t())
    return torch.stack(out, dim=1)


def test_mla_equals_a_naive_reference_and_recompute_keeps_gradients():
    config = _config(20)
    torch.manual_seed(0)
    m = MLASelfAttention(config)
    x = torch.randn(S, B, H, requires_grad=True)
    got = m(x)
    torch.testing.assert_close(got, _naive_mla(m, config, x), rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    ref = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    from megamoe.config import RecomputeConfig
    for modules in (["mla_up_proj"], ["mla_up_proj", "core_attn"]):
        apply_recompute(m, RecomputeConfig(granularity="selective", modules=modules))
        assert m.recompute_up_proj
        m.zero_grad()
        x.grad = None
        m(x).square().sum().backward()
        for a, b in zip([p.grad for p in m.parameters()] + [x.grad], ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_mla_hf_names_round_trip_and_parameter_counts():
    for rank, norms in ((20, True), (None, True), (None, False)):
        config = _config(rank, qk_layernorm=norms)
        model = GPTModel(config)
        sd = {k: v for k, v in model.state_dict().items()}
        assert num_parameters(config)[0] == sum(p.numel() for p in model.parameters())
        attn = {k: v for k, v in sd.items() if ".self_attention." in k}
        hf = {}
        for i in range(config.num_layers):
            hf.update(mla_to_hf(attn, f"decoder.layers.{i}.self_attention",
                                f"model.layers.{i}.self_attn"))
        assert not attn
        assert ("model.layers.0.self_attn.q_proj.weight" in hf) == (rank is None)
        back = {}
        for i in range(config.num_layers):
            back.update(mla_from_hf(hf, f"model.layers.{i}.self_attn",
                                    f"decoder.layers.{i}.self_attention"))
        assert not hf
        for k, v in back.items():
            assert torch.equal(v, sd[k])
        assert len(back) == sum(".self_attention." in k for k in sd)


MLA_TINY = dict(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4,
                seq_length=8, max_position_embeddings=8, vocab_size=37,
                make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                init_method_std=0.2, normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, multi_latent_attention=True, q_lora_rank=12,
                kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5,
                qk_layernorm=True, rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.7,
                original_max_position_embeddings=4, position_embedding_type="rope",
                moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=12), moe_layer_pattern=[0, 1])


def test_mla_gpt_tp2_with_and_without_sequence_parallel():
    """Init shards, loss, every reduced gradient and the grad norm of a tiny MLA GPT under
    TP=2 equal one process: MoE with q compression and SP; dense without q compression,
    SP (MoE under TP needs SP) but with biases."""
    no_q = dict(MLA_TINY, q_lora_rank=None, add_bias_linear=True, swiglu=False, moe=None,
                moe_layer_pattern=None)
    run_distributed(_cases_worker, 2, 180, [(MLA_TINY, True), (no_q, False)])


def test_planner_counts_mla_parameters_per_tp_rank():
    """The memory model's per-rank parameters under TP=2: MLA's up projections and
    linear_proj split, its down projections and latent norms whole (as parallelize does)."""
    from megamoe.parallel.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from megamoe.planning.memory import Layout, stage_parameters

    for kw in (dict(), dict(q_lora_rank=None, add_bias_linear=True)):
        config = ModelConfig(**dict(MLA_TINY, **kw))
        model = GPTModel(config)
        split = whole = 0
        for name, p in model.named_parameters():
            if ".experts." in name:
                continue
            module = model.get_submodule(name.rsplit(".", 1)[0])
            sharded = isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or (
                isinstance(module, RowParallelLinear) and name.endswith("weight"))
            split, whole = split + sharded * p.numel(), whole + (not sharded) * p.numel()
        lay = Layout(tp=2, pp=1, vpp=1, ep=1, etp=1, dp=1, cp=1, distributed_optimizer=False,
                     recompute="none", micro_batch_size=1)
        dense, _ = stage_parameters(config, lay, 0)
        assert dense == split / 2 + whole


def test_mla_with_flash_attention_pads_v_and_equals_the_default_kernel():
    """--use-flash-attn: SDPA's flash kernel needs v as wide as q and k; MLA pads v with
    zeros and trims the output, so the result equals the default kernel's."""
    config = _config(20)
    torch.manual_seed(0)
    plain = MLASelfAttention(config)
    flash = MLASelfAttention(_config(20, use_flash_attn=True))
    flash.load_state_dict(plain.state_dict())
    x = torch.randn(S, B, H)
    torch.testing.assert_close(flash(x), plain(x), rtol=1e-5, atol=1e-6)
