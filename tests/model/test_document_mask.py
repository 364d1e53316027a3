"""--reset-attention-mask: attention inside documents equals running each document alone
(forward and gradients), for the attention op and the whole model (dense and MoE)."""

from __future__ import annotations

import pytest
import torch

from megamoe.config import ModelConfig, MoEConfig
from megamoe.data.gpt_dataset import document_ids, make_sample
from megamoe.model import GPTModel
from megamoe.model.attention import DocumentMask, SelfAttention
from megamoe.model.rope import rotary_cos_sin

EOD = 0
LENGTHS = (5, 1, 7, 3)  # documents packed into one 16-token sequence


def _packed_tokens(seed: int, b: int = 2) -> torch.Tensor:
    """[B, 16]: documents of LENGTHS, each ending in EOD (the last one cut short)."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, 97, (b, sum(LENGTHS)), generator=g)
    end = 0
    for n in LENGTHS:
        end += n
        toks[:, end - 1] = EOD
    return toks


def _pieces(t: torch.Tensor, dim: int):
    return t.split(list(LENGTHS), dim=dim)


def test_document_ids_follow_megatron_eod_rule():
    toks = torch.tensor([5, 0, 3, 4, 0, 0, 7])
    # the eod ends its document; the next token starts a new one
    assert document_ids(toks, 0).tolist() == [0, 0, 1, 1, 1, 2, 3]
    s = make_sample(torch.tensor([5, 0, 3, 4, 0, 0, 7, 9]).numpy(), 0, False, True, True)
    assert s["document_ids"].tolist() == [0, 0, 1, 1, 1, 2, 3]
    assert "document_ids" not in make_sample(torch.arange(8).numpy(), 0, False, False)


@pytest.mark.parametrize("rope", [False, True])
def test_attention_equals_documents_run_alone(rope):
    torch.manual_seed(0)
    c = ModelConfig(hidden_size=16, num_attention_heads=4, num_query_groups=2,
                    attention_dropout=0.0, add_bias_linear=False)
    attn = SelfAttention(c).double()
    toks_BS = _packed_tokens(1)
    ids_BS = document_ids(toks_BS[0], EOD).expand_as(toks_BS)
    s, b = toks_BS.shape[1], toks_BS.shape[0]
    x_SBH = torch.randn(s, b, 16, dtype=torch.float64, requires_grad=True)
    pos_BS = torch.cat([torch.arange(n) for n in LENGTHS]).expand(b, s)
    rot = rotary_cos_sin(s, 4, 10000.0, position_ids_BS=pos_BS) if rope else None
    out = attn(x_SBH, rot, DocumentMask(ids_BS))
    gy = torch.randn_like(out)
    gx, *gw = torch.autograd.grad(out, [x_SBH, *attn.parameters()], gy)

    xs = [p.detach().requires_grad_() for p in _pieces(x_SBH, 0)]
    outs = [attn(x, rotary_cos_sin(x.shape[0], 4, 10000.0) if rope else None) for x in xs]
    ref = torch.cat(outs)
    ref_g = torch.autograd.grad(ref, [*xs, *attn.parameters()], gy)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, torch.cat(ref_g[:len(xs)]), rtol=1e-12, atol=1e-12)
    for a, r in zip(gw, ref_g[len(xs):]):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    # and the mask matters: plain causal attention differs
    assert not torch.allclose(attn(x_SBH, rot), ref)


@pytest.mark.parametrize("moe", [False, True])
def test_model_loss_equals_documents_run_alone(moe):
    torch.manual_seed(0)
    kw = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
              seq_length=16, max_position_embeddings=16, vocab_size=97, hidden_dropout=0.0,
              attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm")
    if moe:  # no token dropping: routing is per token, so documents stay independent.
        # The router in fp64 too: its default fp32 scores round differently for a packed
        # batch and for a piece (other matmul blocking), and the combine weights carry that
        # 1e-7 into every gradient, so fp64 tolerances would hold only on some CPUs.
        kw["moe"] = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=24, router_dtype="fp64")
    model = GPTModel(ModelConfig(**kw)).double()
    toks_BS = _packed_tokens(2)
    labels_BS = torch.roll(toks_BS, -1, 1)
    s = make_sample(torch.cat([toks_BS[0], toks_BS[0, :1]]).numpy(), EOD, False, True, True)
    pos_BS, ids_BS = s["position_ids"].expand_as(toks_BS), s["document_ids"].expand_as(toks_BS)
    loss_BS = model(toks_BS, pos_BS, labels_BS, document_ids=ids_BS)
    g = torch.autograd.grad(loss_BS.sum(), list(model.parameters()))
    pieces = [model(t, None, lab) for t, lab in zip(_pieces(toks_BS, 1), _pieces(labels_BS, 1))]
    ref = torch.cat(pieces, dim=1)
    ref_g = torch.autograd.grad(ref.sum(), list(model.parameters()))
    torch.testing.assert_close(loss_BS, ref, rtol=1e-10, atol=1e-12)
    for (name, _), a, r in zip(model.named_parameters(), g, ref_g):
        # all fp64: ~1e-16 roundoff per op, so 1e-8 is far above any CPU's rounding and far
        # below a token attending across a document boundary (O(1) relative change)
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-11, msg=name)
