"""How the decoder layers are divided among the pipeline's (virtual) stages, with
Megatron-LM's meaning for every flag that shapes it:

* even: --num-layers / PP per rank, split again into chunks of
  --num-layers-per-virtual-pipeline-stage when interleaving;
* --decoder-first/last-pipeline-num-layers: the first / last rank take that many layers,
  the middle ranks share the rest evenly; interleaved with
  --num-virtual-stages-per-pipeline-rank V, each rank's layers split into V equal chunks
  (Megatron refuses --num-layers-per-virtual-pipeline-stage with these);
* --num-virtual-stages-per-pipeline-rank V: V chunks per rank, each rank's layers (by
  whichever rule above) divided equally among them;
* --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the
  embedding / the loss count as one layer each when dividing (num_layers + 1 or + 2 over
  PP, then over the virtual stages); the stage holding it builds one decoder layer fewer
  (get_num_layers_to_build / get_transformer_layer_offset in megatron/core/transformer);
* --pipeline-model-parallel-layout: the explicit string (config/pipeline_layout.py).

Virtual stage v = chunk x PP + rank holds consecutive layers in v order, so a split is
fully described by its per-stage counts. Every rule is checked from the flags alone
(ConfigError naming the flag), before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import ConfigError, require
from megamoe.config.pipeline_layout import FLAG as LAYOUT_FLAG
from megamoe.config.pipeline_layout import PipelineLayout

FIRST_LAST = "--decoder-first/last-pipeline-num-layers"
ACCOUNT = "--account-for-embedding/loss-in-pipeline-split"
VIRTUAL = "--num-layers-per-virtual-pipeline-stage"
STAGES = "--num-virtual-stages-per-pipeline-rank"


@dataclass(frozen=True)
class PipelineSplit:
    """The flags that split the layers (Megatron's names in the field comments)."""

    pp: int  # --pipeline-model-parallel-size
    layers_per_virtual_stage: Optional[int] = None  # --num-layers-per-virtual-pipeline-stage
    first: Optional[int] = None  # --decoder-first-pipeline-num-layers
    last: Optional[int] = None  # --decoder-last-pipeline-num-layers
    account_for_embedding: bool = False  # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False  # --account-for-loss-in-pipeline-split
    layout: Optional[str] = None  # --pipeline-model-parallel-layout
    virtual_stages: Optional[int] = None  # --num-virtual-stages-per-pipeline-rank

    def check_flags(self) -> None:
        """Megatron's rules between the flags that need no layer count (arguments.py and
        TransformerConfig.__post_init__)."""
        uneven = self.first is not None or self.last is not None
        account = self.account_for_embedding or self.account_for_loss
        require(self.layers_per_virtual_stage is None or self.virtual_stages is None,
                f"{VIRTUAL} cannot be combined with {STAGES}")
        require(self.layout is None or self.virtual_stages is None,
                f"{LAYOUT_FLAG} cannot be combined with {STAGES} (the layout's stage count "
                f"sets the virtual stages)")
        require(self.pp > 1 or self.virtual_stages in (None, 1),
                f"{STAGES} needs --pipeline-model-parallel-size > 1")
        if self.layout is not None:
            require(self.layers_per_virtual_stage is None,
                    f"{LAYOUT_FLAG} cannot be combined with {VIRTUAL} (the layout's stage "
                    f"count sets the virtual stages)")
            require(not uneven and not account,
                    f"{LAYOUT_FLAG} cannot be combined with {FIRST_LAST} or {ACCOUNT} "
                    f"(the layout places every layer itself)")
            layout = PipelineLayout.from_str(self.layout, self.pp)
            require(self.pp > 1 or layout.vpp == 1,
                    f"{LAYOUT_FLAG} with {len(layout.stages)} stages needs "
                    f"--pipeline-model-parallel-size > 1 (interleaved virtual stages)")
        require(not (uneven and account),
                f"{FIRST_LAST} cannot be combined with {ACCOUNT} (Megatron-LM: a standalone "
                f"embedding or loss stage is not supported with uneven stages)")
        require(not (uneven and self.layers_per_virtual_stage is not None),
                f"{VIRTUAL} cannot be combined with {FIRST_LAST} (use {STAGES})")
        require(self.pp > 1 or not uneven,
                f"{FIRST_LAST} need --pipeline-model-parallel-size > 1")

    def counts(self, num_layers: int, mtp_num_layers: int = 0) -> list[list[int]]:
        """[rank][chunk] -> decoder layers built there. Raises ConfigError naming the
        flags on a split Megatron-LM (or megamoe) would refuse."""
        self.check_flags()
        if self.layout is not None:
            layout = PipelineLayout.from_str(self.layout, self.pp)
            layout.validate(num_layers, mtp_num_layers)
            return layout.decoder_counts()
        if self.account_for_embedding or self.account_for_loss:
            return self._accounted_counts(num_layers)
        if self.layers_per_virtual_stage is not None:
            n, pp = self.layers_per_virtual_stage, self.pp
            require(n >= 1 and num_layers % (pp * n) == 0,
                    f"--num-layers ({num_layers}) must be divisible by --pipeline-model-"
                    f"parallel-size ({pp}) x {VIRTUAL} ({n})")
            return [[n] * (num_layers // (pp * n)) for _ in range(pp)]
        return [self._chunked(c, r) for r, c in enumerate(self._rank_counts(num_layers))]

    def _chunked(self, rank_layers: int, rank: int) -> list[int]:
        """A rank's layers in --num-virtual-stages-per-pipeline-rank equal chunks."""
        v = self.virtual_stages or 1
        uneven = self.first is not None or self.last is not None
        which = "the first" if rank == 0 and self.first is not None else \
            "the last" if rank == self.pp - 1 and self.last is not None else \
            "each middle" if uneven else "each"
        require(rank_layers % v == 0,
                f"the layers of {which} pipeline rank ({rank_layers}) must be divisible "
                f"by {STAGES} ({v})")
        return [rank_layers // v] * v

    def _rank_counts(self, num_layers: int) -> list[int]:
        """One chunk per rank: even, or the uneven first/last stages."""
        pp, first, last = self.pp, self.first, self.last
        counts: list[Optional[int]] = [None] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        fixed = sum(c for c in counts if c is not None)
        free = [i for i, c in enumerate(counts) if c is None]
        rest = num_layers - fixed
        if any(c is not None and c < 1 for c in counts) or rest < 0 or (
                free and (rest % len(free) or rest // len(free) < 1)) or (not free and rest):
            raise ConfigError(
                f"--num-layers ({num_layers}) cannot be split over --pipeline-model-parallel-"
                f"size ({pp}) stages (first stage {first}, last stage {last}): every stage "
                "needs at least one layer and the other stages an equal share")
        return [rest // len(free) if c is None else c for c in counts]

    def _accounted_counts(self, num_layers: int) -> list[list[int]]:
        """The embedding and/or loss counted as a layer: (num_layers + 1|2) / PP per rank,
        / VPP per chunk, less one on the first / last virtual stage."""
        pp, n = self.pp, self.layers_per_virtual_stage
        total = num_layers + int(self.account_for_embedding) + int(self.account_for_loss)
        require(total % pp == 0,
                f"--num-layers ({num_layers}) + 1 for each of {ACCOUNT} ({total}) must be "
                f"divisible by --pipeline-model-parallel-size ({pp})")
        per_rank = total // pp
        if n is not None:
            require(per_rank % n == 0,
                    f"the layers per pipeline rank ({per_rank}, counting {ACCOUNT}) must be "
                    f"divisible by {VIRTUAL} ({n})")
        v = self.virtual_stages or 1
        require(per_rank % v == 0,
                f"the layers per pipeline rank ({per_rank}, counting {ACCOUNT}) must be "
                f"divisible by {STAGES} ({v})")
        per_chunk = per_rank // v if n is None else n
        counts = [[per_chunk] * (per_rank // per_chunk) for _ in range(pp)]
        if self.account_for_embedding:
            counts[0][0] -= 1
        if self.account_for_loss:
            counts[-1][-1] -= 1
        return counts

    def ranges(self, num_layers: int, mtp_num_layers: int = 0) -> list[list[tuple[int, int]]]:
        """[rank][chunk] -> (first layer, end layer): consecutive layers in virtual-stage
        order (v = chunk x PP + rank)."""
        counts = self.counts(num_layers, mtp_num_layers)
        pp, chunks = len(counts), len(counts[0])
        out: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
        start = 0
        for v in range(pp * chunks):
            n = counts[v % pp][v // pp]
            out[v % pp].append((start, start + n))
            start += n
        return out


def pipeline_layer_ranges(num_layers: int, pp: int, layers_per_virtual_stage: Optional[int] = None,
                          first: Optional[int] = None, last: Optional[int] = None
                          ) -> list[list[tuple[int, int]]]:
    """[rank][chunk] -> (first layer, end layer) of the even / interleaved / uneven
    first-last split (PipelineSplit.ranges, for callers without the other flags)."""
    return PipelineSplit(pp, layers_per_virtual_stage, first, last).ranges(num_layers)
