"""TP-aware dropout RNG: forked streams are per-rank, the default stream is untouched."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.config import ModelConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.parallel.rng import RNGTracker
from megamoe.parallel.tensor_parallel import TensorParallel
from megamoe.parallelize import apply_tensor_parallel
from tests.distributed import run_distributed


def test_fork_does_not_move_the_default_stream_and_is_reproducible():
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    a, b = RNGTracker(5), RNGTracker(5)
    with a.fork():
        first = torch.rand(3)
    with a.fork():
        second = torch.rand(3)
    assert torch.equal(torch.rand(4), expected)
    with b.fork():
        assert torch.equal(torch.rand(3), first)  # same seed, same stream
    assert not torch.equal(first, second)  # the tracker's state advances
    with RNGTracker(6).fork():
        assert not torch.equal(torch.rand(3), first)


def _dropout_worker(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    config = ModelConfig(num_layers=2, hidden_size=16, ffn_hidden_size=32,
                         num_attention_heads=4, seq_length=8, max_position_embeddings=8,
                         vocab_size=32, make_vocab_size_divisible_by=8, hidden_dropout=0.3,
                         attention_dropout=0.3)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def run(sp: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(3)
        tp = TensorParallel(group, sp, RNGTracker(100 + rank))
        model = apply_tensor_parallel(GPTModel(config), tp).train()
        torch.manual_seed(4)
        h = model.decoder(model.embedding(tokens))
        return h.detach(), model(tokens, labels=tokens).detach()

    for sp in (False, True):
        h1, loss1 = run(sp)
        h2, loss2 = run(sp)
        assert torch.equal(h1, h2) and torch.equal(loss1, loss2)  # reproducible per layout
        parts = [torch.empty_like(h1) for _ in range(world_size)]
        dist.all_gather(parts, h1, group=group)
        if not sp:  # replicated residual stream: the replicas must stay identical
            assert torch.equal(parts[0], parts[1])
    # Split activations draw from per-rank streams: different masks on the two ranks.
    with TensorParallel(group, True, RNGTracker(100 + rank)).dropout_rng(split=True):
        mask = F.dropout(torch.ones(64), 0.5)
    masks = [torch.empty_like(mask) for _ in range(world_size)]
    dist.all_gather(masks, mask, group=group)
    assert not torch.equal(masks[0], masks[1])


def test_tp_dropout_reproducible_and_replicas_consistent():
    run_distributed(_dropout_worker, 2, 90)
