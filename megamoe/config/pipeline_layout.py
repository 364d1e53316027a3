"""Megatron-LM's --pipeline-model-parallel-layout string: which layers each (virtual)
pipeline stage holds, e.g. "Et*3|(tt|)*29,m|L" (DeepSeek-V3's 61 layers and one MTP layer
over PP16 x VPP2).

The grammar is Megatron's (megatron/core/transformer/pipeline_parallel_layer_layout.py,
parse_str_to_list): commas are cosmetic and dropped; "(...)*n" is unrolled first (one
level, the first ")" closes the group), then "x*n" repeats the single character before
it; "|" separates stages; E = embedding, t = transformer (decoder) layer, m = MTP layer,
L = loss. Stage i of the list is virtual stage i // PP of pipeline rank i % PP, so the
list in order is the model's layer order. Empty stages are allowed ("E||t|L").

megamoe reads the same string with the same meaning, then checks Megatron's rules
(validate_layer_layout) and the placements megamoe can build: the embedding lives on the
first stage and the output layer, loss and MTP depths on the last (model/pipeline_stage.py),
so an "E", "L" or "m" elsewhere is refused in one line naming the flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megamoe.config.fields import require

FLAG = "--pipeline-model-parallel-layout"
LAYER_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
# Bound on the unrolled string: a layout names each of at most 65,536 decoder layers
# (config/model.py's --num-layers bound) plus MTP depths and stage separators; a larger
# expansion is a typo or hostile input, refused before it is built in memory.
MAX_UNROLLED = 1 << 20
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_SINGLE = re.compile(r"(.)\*(\d+)")


def _unroll(pattern: re.Pattern, text: str) -> str:
    """One of Megatron's two substitutions, with the result's length checked first."""
    size = len(text)
    for m in pattern.finditer(text):
        digits = m.group(2).lstrip("0") or "0"
        require(len(digits) <= 7, f"{FLAG}: repeat count {m.group(2)} is too large")
        size += len(m.group(1)) * int(digits) - len(m.group(0))
    require(size <= MAX_UNROLLED,
            f"{FLAG}: the layout unrolls to {size} characters (at most {MAX_UNROLLED})")
    return pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)


def parse_layout(text: str) -> list[list[str]]:
    """Layout string -> stages, each a list of "E"/"t"/"m"/"L" in layer order (Megatron's
    parse_str_to_list, with one-line errors naming the flag)."""
    require(isinstance(text, str) and len(text) <= MAX_UNROLLED,
            f"{FLAG} must be a string of at most {MAX_UNROLLED} characters")
    text = text.replace(",", "")
    text = _unroll(_GROUP, text)
    text = _unroll(_SINGLE, text)
    stages = []
    for stage in text.split("|"):
        for ch in stage:
            require(ch in LAYER_CHARS,
                    f"{FLAG}: invalid layer character {ch!r} in stage {stage!r} (known: E "
                    f"embedding, t transformer layer, m MTP layer, L loss; '|' separates "
                    f"stages, '(..)*n' and 'x*n' repeat, ',' is cosmetic)")
        stages.append(list(stage))
    return stages


@dataclass(frozen=True)
class PipelineLayout:
    """A parsed layout over `pp` pipeline ranks: `stages[v]` is virtual stage v, held by
    rank v % pp as its chunk v // pp."""

    stages: tuple[tuple[str, ...], ...]
    pp: int

    @classmethod
    def from_str(cls, text: str, pp: int) -> PipelineLayout:
        """Parse; the stage count must be a multiple of PP (Megatron's arguments.py)."""
        stages = parse_layout(text)
        require(len(stages) % pp == 0,
                f"{FLAG}: the number of stages ({len(stages)}) must be divisible by "
                f"--pipeline-model-parallel-size ({pp})")
        return cls(tuple(tuple(s) for s in stages), pp)

    @property
    def vpp(self) -> int:
        """Virtual stages per pipeline rank (Megatron's virtual_pipeline_model_parallel_size;
        1 means no interleaving)."""
        return len(self.stages) // self.pp

    def stage(self, rank: int, chunk: int) -> tuple[str, ...]:
        return self.stages[chunk * self.pp + rank]

    def decoder_counts(self) -> list[list[int]]:
        """[rank][chunk] -> the decoder layers it builds (get_num_layers_to_build)."""
        return [[self.stage(r, c).count("t") for c in range(self.vpp)]
                for r in range(self.pp)]

    def validate(self, num_layers: int, mtp_num_layers: int) -> None:
        """Megatron's validate_layer_layout, then megamoe's placements (see module doc)."""
        flat = [x for s in self.stages for x in s]
        require(bool(flat) and flat[0] == "E",
                f"{FLAG}: the first layer must be the embedding 'E'")
        require(flat[-1] == "L", f"{FLAG}: the last layer must be the loss 'L'")
        require(flat.count("E") == 1, f"{FLAG}: the embedding 'E' must appear exactly once")
        require(flat.count("L") == 1, f"{FLAG}: the loss 'L' must appear exactly once")
        require(flat.count("t") == num_layers,
                f"{FLAG}: {flat.count('t')} transformer layers 't', but --num-layers is "
                f"{num_layers}")
        require(flat.count("m") == mtp_num_layers,
                f"{FLAG}: {flat.count('m')} MTP layers 'm', but --mtp-num-layers is "
                f"{mtp_num_layers}")
        require("m" not in flat or "t" not in flat[flat.index("m"):],
                f"{FLAG}: every transformer layer 't' must come before the MTP layers 'm'")
        for r in range(self.pp):
            require(all("m" not in self.stage(r, c) for c in range(self.vpp - 1)),
                    f"{FLAG}: MTP layers 'm' must be in a pipeline rank's last virtual stage")
        for r in range(self.pp):
            last = self.stage(r, self.vpp - 1)
            require("m" not in last or last.count("m") == mtp_num_layers,
                    f"{FLAG}: all MTP layers 'm' must be in one stage")
        require("E" in self.stages[0],
                f"{FLAG}: the embedding 'E' must be in the first stage (pipeline rank 0's "
                f"first virtual stage), where megamoe builds it")
        require("L" in self.stages[-1],
                f"{FLAG}: the loss 'L' must be in the last stage (the last pipeline rank's "
                f"last virtual stage), where megamoe builds the output layer")
        for r in range(self.pp):
            require(any(self.stage(r, c) for c in range(self.vpp)),
                    f"not supported yet: {FLAG} giving pipeline rank {r} no layer in any of "
                    f"its stages (a rank without parameters)")
        require(mtp_num_layers == 0 or "m" in self.stages[-1],
                f"not supported yet: {FLAG} with the MTP layers 'm' outside the last stage "
                f"(megamoe runs MTP with the loss 'L' on the last pipeline stage; Megatron's "
                f"standalone MTP stage is not built)")

