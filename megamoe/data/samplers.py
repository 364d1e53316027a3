"""Megatron's samplers. PretrainingSampler (--dataloader-type single, Megatron's
MegatronPretrainingSampler): the global sample order is layout-independent.

Samples are taken in order from `consumed_samples`, in chunks of one micro-batch per
data-parallel rank (micro_batch_size * dp). Rank r gets slice [r * mbs, (r + 1) * mbs) of
each chunk, so the union over ranks of one step is the same samples for any dp size, and a
run resumed from `consumed_samples` continues exactly where it stopped. (Shuffling
happens once, inside the dataset's shuffle index, never here.) RandomPretrainingSampler
(--dataloader-type cyclic): a new random order every epoch (see its docstring).
"""

from __future__ import annotations

from typing import Iterator

import torch


class PretrainingSampler:
    """Batch sampler (for DataLoader's `batch_sampler`) yielding this rank's index lists.

    A trailing chunk smaller than micro_batch_size * data_parallel_size is dropped, so
    every rank yields the same number of micro-batches. Resuming at or past the end
    yields nothing.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        if total_samples < 0:
            raise ValueError(f"total_samples must be >= 0, got {total_samples}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not in "
                             f"[0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    @property
    def _chunk(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        return max(0, self.total_samples - self.consumed_samples) // self._chunk

    def __iter__(self) -> Iterator[list[int]]:
        begin = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for i in range(len(self)):
            start = begin + i * self._chunk
            yield list(range(start, start + self.micro_batch_size))


class RandomPretrainingSampler(PretrainingSampler):
    """Megatron's MegatronPretrainingRandomSampler (--dataloader-type cyclic): each epoch of
    the dataset is a new permutation, seeded by the epoch number alone.

    One iteration yields the rest of the current epoch (where `consumed_samples` says it
    is) and advances `consumed_samples`, so iterating again (the cyclic iterator of
    loaders.py does) starts the next epoch; a run resumed from `consumed_samples` continues
    exactly where it stopped, also mid-epoch. An epoch has `total_samples` rounded down to
    whole micro_batch_size x dp chunks.

    With `data_sharding` (Megatron's default; --no-data-sharding turns it off) rank r
    shuffles within its own bucket, samples [r * B, (r + 1) * B) with B = epoch / dp; so
    the global batches depend on the data-parallel size. Without it the ranks take turns
    through one permutation of the whole dataset. (Megatron's unsharded path can give one
    rank a micro-batch more than the others at the end of an epoch; every rank here stops
    at the same count, the one `consumed_samples` advances by.)
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int,
                 data_sharding: bool = True) -> None:
        super().__init__(total_samples, consumed_samples, micro_batch_size,
                         data_parallel_rank, data_parallel_size)
        self.data_sharding = data_sharding
        self.epoch_samples = total_samples - total_samples % self._chunk

    def __len__(self) -> int:
        """Micro-batches left in the current epoch."""
        if not self.epoch_samples:
            return 0
        return (self.epoch_samples - self.consumed_samples % self.epoch_samples) // self._chunk

    def __iter__(self) -> Iterator[list[int]]:
        if not self.epoch_samples:
            return
        epoch, offset = divmod(self.consumed_samples, self.epoch_samples)
        if offset % self._chunk:
            raise ValueError(f"consumed_samples {self.consumed_samples} is not a whole number "
                             f"of micro_batch_size x data_parallel_size chunks")
        g = torch.Generator(device="cpu")  # host: sample indices, never on a device
        g.manual_seed(epoch)
        mbs, rank, dp = self.micro_batch_size, self.data_parallel_rank, self.data_parallel_size
        if self.data_sharding:
            bucket = self.epoch_samples // dp
            perm = torch.randperm(bucket, generator=g, device="cpu").tolist()  # host indices
            order = [rank * bucket + i for i in perm]
            order = order[offset // dp:]
        else:
            whole = (self.total_samples // mbs) * mbs
            perm = torch.randperm(whole, generator=g, device="cpu").tolist()  # host indices
            order = perm[offset:][rank::dp]
        for i in range(len(self)):
            self.consumed_samples += self._chunk
            yield order[i * mbs:(i + 1) * mbs]
