"""Multi-token prediction against a hand-written reference from the same weights.

The reference re-derives DeepSeek-V3's MTP without rolling: depth d (1-based) runs on the
first S - d positions (causal attention: the tail the model zero-fills cannot change them),
looks up tokens[:, d:], predicts labels[:, d:] under loss_mask[:, d:], with RMSNorm,
concatenation (embedding first), eh_proj, the MTP transformer layer, its final norm and the
shared output table written out in plain torch (the cross entropy in fp32, as the model's).
Forward losses and every parameter's gradient (LM loss + factor / D x sum of depth losses)
must match the model's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.config import ModelConfig, MoEConfig
from megamoe.model.flops import (
    _layer_params,
    active_matmul_parameters,
    flops_per_token,
    num_parameters,
)
from megamoe.model.gpt_model import GPTModel, rotary_for
from megamoe.model.mtp import MTPLossTracker, shifted
from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale
from megamoe.parallel.cp_layout import split_for_cp
from megamoe.training.loss import masked_lm_loss
from tests.distributed import run_distributed

S, B, V = 12, 2, 97


def _config(tied: bool, moe: bool, depths: int) -> ModelConfig:
    return ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
        seq_length=S, max_position_embeddings=S, vocab_size=V, normalization="RMSNorm",
        position_embedding_type="rope", swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=not tied, hidden_dropout=0.0,
        attention_dropout=0.0, mtp_num_layers=depths, mtp_loss_scaling_factor=0.3,
        moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=24) if moe else None,
        moe_layer_pattern=[0, 1] if moe else None)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(model: GPTModel, tokens, labels, mask) -> tuple[torch.Tensor, list]:
    """(LM loss + scaled MTP loss, [MTP loss per depth]) by hand."""
    cfg, eps = model.config, model.config.norm_epsilon
    word = model.embedding.word_embeddings.weight
    out_w = word if model.output_layer is None else model.output_layer.weight
    h = model.decoder(model.embedding(tokens), rotary_for(cfg, tokens, None))  # [S, B, H]
    logits = h.transpose(0, 1) @ out_w[:V].t()
    lm = masked_lm_loss(F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1),
                                        reduction="none").view(B, S), mask)
    depth_losses = []
    for d, layer in enumerate(model.mtp.layers, start=1):
        n = S - d
        h = h[:n]
        e = F.embedding(tokens[:, d:], word).transpose(0, 1)  # [n, B, H]
        x = torch.cat([_rms(e, layer.enorm.weight, eps), _rms(h, layer.hnorm.weight, eps)], -1)
        x = x @ layer.eh_proj.weight.t()
        x = layer.transformer_layer(x, rotary_for(cfg, tokens[:, :n], None))
        h = _rms(x, layer.final_layernorm.weight, eps)
        logits = h.transpose(0, 1) @ out_w[:V].t()  # [B, n, V]
        ce = F.cross_entropy(logits.float().reshape(-1, V), labels[:, d:].reshape(-1),
                             reduction="none").view(B, n)
        m = mask[:, d:]
        depth_losses.append((ce * m).sum() / m.sum())
    scale = cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers
    return lm + scale * sum(depth_losses), depth_losses


@pytest.mark.parametrize("tied, moe, depths", [
    (False, False, 1), (True, False, 2), (False, True, 2)],
    ids=["untied-dense-D1", "tied-dense-D2", "untied-moe-D2"])
def test_mtp_loss_and_gradients_equal_a_hand_written_reference(tied, moe, depths):
    torch.manual_seed(0)
    model = GPTModel(_config(tied, moe, depths)).double()
    tokens = torch.randint(0, V, (B, S))
    labels = torch.roll(tokens, -1, dims=1)
    mask = torch.ones(B, S, dtype=torch.float64)
    mask[0, 3] = mask[1, 7] = mask[1, 10] = 0.0  # --eod-mask-loss style holes
    set_aux_loss_backward_scale(1.0)
    MoELossTracker.clear()
    MTPLossTracker.take()

    loss_BS = model(tokens, labels=labels, loss_mask=mask)
    masked_lm_loss(loss_BS, mask).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    recorded = {k: v.item() for k, v in MTPLossTracker.means(1).items()}

    model.zero_grad()
    # The MoE aux losses attach to the layer outputs in both runs; the router's own graph
    # is the model's, so the reference's gradients include them the same way.
    total, depth_losses = _reference(model, tokens, labels, mask)
    total.backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    assert list(recorded) == [f"mtp_{k + 1} loss" for k in range(depths)]
    for k, value in enumerate(depth_losses):
        assert recorded[f"mtp_{k + 1} loss"] == pytest.approx(value.item(), rel=1e-6)  # fp32 log
    assert set(got) == set(want)
    assert any("mtp" in n for n in got) and "embedding.word_embeddings.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)


def test_mtp_is_off_in_evaluation_and_without_labels():
    """Evaluation and logits never run the MTP depths (nothing recorded, same output)."""
    torch.manual_seed(0)
    model = GPTModel(_config(False, False, 1)).eval()
    tokens = torch.randint(0, V, (B, S))
    MTPLossTracker.take()
    model(tokens, labels=tokens)
    model(tokens)
    assert MTPLossTracker.take() is None


def test_mtp_layer_of_a_moe_decoder_is_moe_and_logged_after_the_decoder():
    model = GPTModel(_config(False, True, 2))
    layers = [layer.transformer_layer for layer in model.mtp.layers]
    assert [layer.layer_index for layer in layers] == [2, 3] and all(x.is_moe for x in layers)
    assert layers[0].mlp.router.num_layers == 4


@pytest.mark.parametrize("tied, moe, depths", [(True, False, 1), (False, True, 2)])
def test_parameter_and_flop_counts_include_the_mtp_modules(tied, moe, depths):
    """num_parameters equals the module's count; each depth adds eh_proj (2H x H), one
    layer's matmuls and attention core, and one more pass through the output layer."""
    config = _config(tied, moe, depths)
    with torch.device("meta"):
        model = GPTModel(config)
    assert num_parameters(config)[0] == sum(p.numel() for p in model.parameters())
    plain = _config(tied, moe, None)
    h = config.hidden_size
    per_layer = [_layer_params(plain, i)[2] for i in range(plain.num_layers)]
    assert sum(per_layer) + V * h == active_matmul_parameters(plain)
    core = 12 * S * config.num_attention_heads * config.kv_channels
    extra = depths * (6 * (2 * h * h + per_layer[-1] + V * h) + core)
    assert flops_per_token(config) - flops_per_token(plain) == extra



def test_shift_without_cp_is_megatrons_roll_applied_k_times():
    x_XBS = torch.arange(1, 1 + 3 * 2 * 16).view(3, 2, 16)
    rolled = x_XBS
    for k, got in enumerate(shifted(x_XBS, 3)):
        rolled = torch.roll(rolled, -1, dims=-1)
        rolled[..., -1] = 0
        assert torch.equal(got, rolled), k


def _shift_worker(rank: int, world_size: int, x_XBS: torch.Tensor, num_shifts: int):
    import torch.distributed as dist

    local = split_for_cp(x_XBS, rank, world_size, dim=-1)
    return shifted(local, num_shifts, (dist.group.WORLD, rank, world_size))


@pytest.mark.slow  # (the default set's MTP CP2 parity run covers the CP2 shift)
@pytest.mark.parametrize("cp, num_shifts", [(2, 3), (4, 2)])
def test_shift_under_cp_is_this_ranks_part_of_the_whole_sequences_shift(cp, num_shifts):
    """Each cp rank's shifted load-balanced part (one all-gather of the chunk heads) equals
    its part of the whole sequence shifted: the tails come from the right chunks."""
    x_XBS = torch.arange(1, 1 + 3 * 2 * 16).view(3, 2, 16)  # non-zero: the zero tail shows
    whole = shifted(x_XBS, num_shifts)
    for rank, parts in enumerate(run_distributed(_shift_worker, cp, 60, x_XBS, num_shifts)):
        for s in range(num_shifts):
            assert torch.equal(parts[s], split_for_cp(whole[s], rank, cp, dim=-1)), (rank, s)
