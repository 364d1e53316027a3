"""Megatron's MegatronPretrainingSampler: the global sample order is layout-independent.

Samples are taken in order from `consumed_samples`, in chunks of one micro-batch per
data-parallel rank (micro_batch_size * dp). Rank r gets slice [r * mbs, (r + 1) * mbs) of
each chunk, so the union over ranks of one step is the same samples for any dp size, and a
run resumed from `consumed_samples` continues exactly where it stopped. (Shuffling
happens once, inside the dataset's shuffle index, never here.)
"""

from __future__ import annotations

from typing import Iterator


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
