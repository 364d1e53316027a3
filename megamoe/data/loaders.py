"""Datasets -> this data-parallel rank's micro-batches, and the tokenizer a DataConfig
names."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from megamoe.config import DataConfig, RunConfig
from megamoe.data.errors import DataError
from megamoe.data.samplers import PretrainingSampler, RandomPretrainingSampler
from megamoe.data.tokenizers import build_tokenizer


def tokenizer_for(config: DataConfig):
    """The tokenizer of --tokenizer-type and its files (--mock-data alone: a null
    tokenizer of --vocab-size, default 1024)."""
    if config.tokenizer_type is None:
        return build_tokenizer("NullTokenizer", vocab_size=config.vocab_size or 1024,
                               null_eod_id=config.null_tokenizer_eod_id)
    return build_tokenizer(config.tokenizer_type, tokenizer_model=config.tokenizer_model,
                           vocab_file=config.vocab_file, merge_file=config.merge_file,
                           vocab_size=config.vocab_size, null_eod_id=config.null_tokenizer_eod_id,
                           trust_remote_code=config.trust_remote_code)


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def to_device(batch: dict[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
    """A batch on `device`; asynchronous from pinned host memory on a GPU."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def make_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                  dp_size: int, num_workers: int, device: Optional[torch.device] = None,
                  dataloader_type: str = "single", data_sharding: bool = True
                  ) -> Optional[Iterator]:
    """Micro-batches for data-parallel rank `dp_rank`, resuming after `consumed_samples`, on
    `device` (default: left on the host). Loaded into pinned memory when `device` is a GPU,
    so the copy overlaps. None without a dataset.

    --dataloader-type single: the samples in order, the same global batches in any layout;
    ends with the dataset. cyclic: a new permutation every epoch, without end (Megatron's
    cyclic_iter over MegatronPretrainingRandomSampler; samplers.py)."""
    if dataset is None:
        return None
    if dataloader_type not in ("single", "cyclic"):
        raise ValueError(f"--dataloader-type must be single or cyclic, got {dataloader_type!r}")
    if dataloader_type == "cyclic":
        sampler = RandomPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                           dp_rank, dp_size, data_sharding)
    else:
        sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                     dp_rank, dp_size)
    pin = device is not None and device.type == "cuda"
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                         num_workers=num_workers, pin_memory=pin,
                                         persistent_workers=num_workers > 0)
    batches = iter(loader)  # now: it draws its base seed from the caller's RNG state
    if dataloader_type == "cyclic":
        batches = _cyclic(loader, batches)
    if device is None:
        return batches
    return (to_device(batch, device) for batch in batches)


def run_iterator(run: RunConfig, dataset, consumed_samples: int, dp_rank: int, dp_size: int,
                 device: Optional[torch.device] = None,
                 num_workers: Optional[int] = None) -> Optional[Iterator]:
    """`make_iterator` with a run's micro-batch, workers (--num-workers unless given) and
    sampler: what pretrain_gpt.py reads from, and what tools/bench_data_loader.py times
    (one definition, so the benchmark cannot drift from the training loader)."""
    workers = run.data.num_workers if num_workers is None else num_workers
    return make_iterator(dataset, consumed_samples, run.train.micro_batch_size, dp_rank,
                         dp_size, workers, device=device,
                         dataloader_type=run.data.dataloader_type,
                         data_sharding=run.data.data_sharding)


def _cyclic(loader: torch.utils.data.DataLoader, first: Iterator) -> Iterator:
    """`first`, then the loader again and again: each pass is the sampler's next epoch."""
    batches = first
    while True:
        count = 0
        for batch in batches:
            count += 1
            yield batch
        if count == 0:
            raise DataError("--dataloader-type cyclic: the dataset has fewer samples than "
                            "one micro-batch per data-parallel rank")
        batches = iter(loader)
