"""Datasets -> this data-parallel rank's micro-batches, and the tokenizer a DataConfig
names."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from megamoe.config import DataConfig
from megamoe.data.samplers import PretrainingSampler
from megamoe.data.tokenizers import build_tokenizer


def tokenizer_for(config: DataConfig):
    """The tokenizer of --tokenizer-type and its files (--mock-data alone: a null
    tokenizer of --vocab-size, default 1024)."""
    if config.tokenizer_type is None:
        return build_tokenizer("NullTokenizer", vocab_size=config.vocab_size or 1024)
    return build_tokenizer(config.tokenizer_type, tokenizer_model=config.tokenizer_model,
                           vocab_file=config.vocab_file, merge_file=config.merge_file,
                           vocab_size=config.vocab_size)


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def to_device(batch: dict[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
    """A batch on `device`; asynchronous from pinned host memory on a GPU."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def make_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                  dp_size: int, num_workers: int,
                  device: Optional[torch.device] = None) -> Optional[Iterator]:
    """Micro-batches for data-parallel rank `dp_rank`, resuming after `consumed_samples`:
    the same global batches in any layout (samplers.py), on `device` (default: left on
    the host). Loaded into pinned memory when `device` is a GPU, so the copy overlaps.
    None without a dataset."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                 micro_batch_size=micro_batch_size,
                                 data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    pin = device is not None and device.type == "cuda"
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                         num_workers=num_workers, pin_memory=pin,
                                         persistent_workers=num_workers > 0)
    batches = iter(loader)  # now: it draws its base seed from the caller's RNG state
    if device is None:
        return batches
    return (to_device(batch, device) for batch in batches)
