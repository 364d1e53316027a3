"""Megatron-LM's pipeline split flags, known answers: the --pipeline-model-parallel-layout
parser against the layouts Megatron documents and tests (d98e8a64:
tests/unit_tests/transformer/test_transformer_block.py::test_parsing_layout_from_str,
docs/user-guide/features/pipeline_parallel_layout.md and multi_token_prediction.md, the
DeepSeek-V3 proxy functional tests), and --account-for-embedding/loss-in-pipeline-split
and --decoder-first/last-pipeline-num-layers against a line-by-line transcription of
Megatron's get_num_layers_to_build / get_transformer_layer_offset."""

from __future__ import annotations

import itertools
from typing import Optional

import pytest

from megamoe.config import ConfigError, PipelineSplit
from megamoe.config.pipeline_layout import PipelineLayout, parse_layout

NAMES = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}


def _chars(stages: list[list[str]]) -> list[list[str]]:
    return [[NAMES[x] for x in s] for s in stages]


# Megatron's test_parsing_layout_from_str: (pp, string, the list it must equal).
MEGATRON_PARSE_CASES = [
    (2, "Et|t*4|t|tL", [["embedding", "decoder"], ["decoder"] * 4, ["decoder"],
                        ["decoder", "loss"]]),
    (2, "E|t*6|t|L", [["embedding"], ["decoder"] * 6, ["decoder"], ["loss"]]),
    (4, "E|t|t*2|t||(t|)*2,t*2,L", [["embedding"], ["decoder"], ["decoder"] * 2, ["decoder"],
                                    [], ["decoder"], ["decoder"], ["decoder"] * 2 + ["loss"]]),
    (8, "Et*3|(tt|)*29,m|L", [["embedding"] + ["decoder"] * 3] + [["decoder"] * 2] * 29
     + [["mtp"], ["loss"]]),
    (16, "Et*2|(tt|)*29,t|mL", [["embedding"] + ["decoder"] * 2] + [["decoder"] * 2] * 29
     + [["decoder"]] + [["mtp", "loss"]]),
]


@pytest.mark.parametrize("pp, text, expected", MEGATRON_PARSE_CASES)
def test_parse_equals_megatrons_known_lists(pp, text, expected):
    assert parse_layout(text) == _chars(expected)
    layout = PipelineLayout.from_str(text, pp)
    assert layout.vpp == len(expected) // pp


def test_grammar_edge_cases():
    """Megatron's parse_str_to_list comments: group unrolling, commas, empty stages."""
    assert parse_layout("tt(t|)*2,L") == [["t", "t", "t"], ["t"], ["L"]]
    assert parse_layout("(|t)*2,tL") == [[], ["t"], ["t", "t", "L"]]
    assert parse_layout("E||t|L") == [["E"], [], ["t"], ["L"]]
    assert parse_layout("Et*0|L") == [["E"], ["L"]]
    assert parse_layout("E,t,t|t,L") == [["E", "t", "t"], ["t", "L"]]


def test_deepseek_v3_documented_layout_table():
    """pipeline_parallel_layout.md's PP16 x VPP2 table for "Et*3|(tt|)*29,m|L"."""
    layout = PipelineLayout.from_str("Et*3|(tt|)*29,m|L", 16)
    assert layout.vpp == 2
    assert layout.stage(0, 0) == ("E", "t", "t", "t") and layout.stage(0, 1) == ("t", "t")
    for r in range(1, 14):
        assert layout.stage(r, 0) == layout.stage(r, 1) == ("t", "t")
    assert layout.stage(14, 1) == ("m",) and layout.stage(15, 1) == ("L",)
    assert layout.stage(14, 0) == layout.stage(15, 0) == ("t", "t")


def test_deepseek_v3_layout_with_mtp_on_the_last_stage_splits_61_layers():
    """Megatron's "Et*2|(tt|)*29,t|mL" at PP16: 61 layers, VPP2, MTP with the loss."""
    split = PipelineSplit(16, layout="Et*2|(tt|)*29,t|mL")
    counts = split.counts(61, 1)
    assert counts[0] == [2, 2] and counts[14] == [2, 1] and counts[15] == [2, 0]
    assert all(c == [2, 2] for c in counts[1:14])
    ranges = split.ranges(61, 1)
    assert ranges[0] == [(0, 2), (32, 34)] and ranges[15] == [(30, 32), (61, 61)]


# Megatron's DeepSeek-V3 proxy and MoE functional tests: (pp, layout, layers, MTP depth).
FUNCTIONAL_LAYOUTS = [
    (4, "Et*2|(tt|)*5t|tmL", 14, 1), (2, "Et*7|t*7mL", 14, 1),
    (2, "Et*3|(tt|)*6tmL", 16, 1), (2, "Et*3|(tt|)*6mL", 15, 1),
    (2, "Et*3|(tt|)*6L", 15, 0), (2, "Et|(tt|)*6mL", 13, 1),
    (4, "E|t*3|(t|)*5mL", 8, 1),  # multi_token_prediction.md: MTP in the last stage
]


@pytest.mark.parametrize("pp, text, layers, mtp", FUNCTIONAL_LAYOUTS)
def test_megatron_functional_layouts_are_accepted(pp, text, layers, mtp):
    ranges = PipelineSplit(pp, layout=text).ranges(layers, mtp)
    flat = sorted(r for rank in ranges for r in rank)
    assert flat[0][0] == 0 and flat[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))  # consecutive, complete


@pytest.mark.parametrize("pp, text, layers, mtp, says", [
    # Megatron's standalone MTP stages (multi_token_prediction.md): not built in megamoe.
    (16, "Et*3|(tt|)*29,m|L", 61, 1, "not supported yet: --pipeline-model-parallel-layout"),
    (8, "Et*3|(tt|)*29,m|L", 61, 1, "not supported yet: --pipeline-model-parallel-layout"),
    (4, "E|t*3|(t|)*4tm|L", 8, 1, "not supported yet"),
    (4, "E|t*3|(t|)*3tt|m|L", 8, 1, "not supported yet"),
    # Megatron's own validate_layer_layout rules
    (2, "tE|tL", 2, 0, "the first layer must be the embedding"),
    (2, "Et|Lt", 2, 0, "the last layer must be the loss"),
    (2, "EEt|tL", 2, 0, "exactly once"),
    (2, "Et|ttL", 2, 0, "3 transformer layers 't', but --num-layers is 2"),
    (2, "Et|tmL", 2, 0, "1 MTP layers 'm', but --mtp-num-layers is 0"),
    (2, "Et|mtL", 2, 1, "must come before the MTP layers"),
    (2, "Et|tm|m|L", 2, 2, "last virtual stage"),
    (2, "Et|t|m|mL", 2, 2, "in one stage"),
    # megamoe's placements: the embedding on the first stage, the loss on the last
    (2, "|Et|t|L", 2, 0, "'E' must be in the first stage"),
    (2, "Et|t|L|", 2, 0, "'L' must be in the last stage"),
    (2, "Et|tL||", 2, 0, "'L' must be in the last stage"),
    (3, "Et||tL", 2, 0, "not supported yet: --pipeline-model-parallel-layout giving "
                        "pipeline rank 1 no layer"),
    (2, "Et|t|X", 2, 0, "invalid layer character 'X'"),
    (2, "Et|t|tL", 3, 0, "number of stages (3) must be divisible"),
])
def test_refused_layouts_name_the_flag(pp, text, layers, mtp, says):
    with pytest.raises(ConfigError) as e:
        PipelineSplit(pp, layout=text).ranges(layers, mtp)
    assert says in str(e.value) and "--pipeline-model-parallel-layout" in str(e.value)


@pytest.mark.parametrize("kwargs, says", [
    (dict(layout="Et|tL", first=1), "cannot be combined with --decoder-first/last"),
    (dict(layout="Et|tL", account_for_loss=True), "cannot be combined"),
    (dict(layout="Et|tL", layers_per_virtual_stage=1), "cannot be combined with --num-layers"),
    (dict(first=1, account_for_embedding=True), "cannot be combined with --account-for"),
    (dict(last=1, layers_per_virtual_stage=1), "cannot be combined"),
])
def test_megatrons_exclusive_flags(kwargs, says):
    with pytest.raises(ConfigError) as e:
        PipelineSplit(2, **kwargs).check_flags()
    assert says in str(e.value)


def test_layout_with_virtual_stages_needs_pipeline_parallelism():
    PipelineSplit(1, layout="Et*2L").check_flags()
    with pytest.raises(ConfigError, match="needs --pipeline-model-parallel-size > 1"):
        PipelineSplit(1, layout="Et|tL").check_flags()


def _megatron_counts(num_layers: int, pp: int, vp: Optional[int], first: Optional[int],
                     last: Optional[int], emb: bool, loss: bool) -> list[list[tuple[int, int]]]:
    """megatron/core/transformer/transformer_block.py::get_num_layers_to_build and
    transformer_layer.py::get_transformer_layer_offset (no layout), transcribed; vp is
    virtual_pipeline_model_parallel_size (None without interleaving)."""
    out = []
    for pp_rank in range(pp):
        row = []
        for vp_stage in range(vp or 1):
            first_vp, last_vp = vp_stage == 0, vp_stage == (vp or 1) - 1
            if first is not None or last is not None:
                rest, stages = num_layers, pp
                if first is not None:
                    rest, stages = rest - first, stages - 1
                if last is not None:
                    rest, stages = rest - last, stages - 1
                per_rank = rest // stages if stages > 0 else 0
                if pp_rank == 0 and first is not None:
                    per_rank = first
                if pp_rank == pp - 1 and last is not None:
                    per_rank = last
            else:
                total = num_layers + int(emb) + int(loss)
                per_rank = total // pp
            build = per_rank // vp if vp else per_rank
            if emb and first_vp and pp_rank == 0:
                build -= 1
            if loss and last_vp and pp_rank == pp - 1:
                build -= 1
            # get_transformer_layer_offset
            if first is not None or last is not None:
                middle = pp - (first is not None) - (last is not None)
                f, lst = first or 0, last or 0
                middle_layers = num_layers - f - lst
                mid_rank = pp_rank if first is None else pp_rank - 1
                if vp:
                    f_chunk, l_chunk, m_chunk = f // vp, lst // vp, middle_layers // vp
                    chunks = f_chunk + m_chunk + l_chunk
                    offset = vp_stage * chunks if pp_rank == 0 else (
                        vp_stage * chunks + f_chunk + mid_rank * (m_chunk // middle))
                else:
                    per_middle = middle_layers // middle if middle > 0 else 0
                    offset = 0 if pp_rank == 0 else mid_rank * per_middle + f
            else:
                total = num_layers + int(emb) + int(loss)
                per_rank = total // pp
                if vp:
                    offset = vp_stage * (total // vp) + pp_rank * (per_rank // vp)
                else:
                    offset = pp_rank * per_rank
                if emb and not (first_vp and pp_rank == 0):
                    offset -= 1
            row.append((offset, offset + build))
        out.append(row)
    return out


def test_virtual_stages_per_rank_equal_megatrons_formulas():
    """--num-virtual-stages-per-pipeline-rank V: even, accounted and uneven first / last
    splits in V chunks per rank, wherever Megatron's divisibility rules accept them."""
    checked = 0
    for num_layers, pp, vp in itertools.product(range(1, 17), range(2, 5), range(2, 5)):
        for emb, loss in itertools.product((False, True), repeat=2):
            total = num_layers + emb + loss
            if total % pp or (total // pp) % vp:
                continue
            want = _megatron_counts(num_layers, pp, vp, None, None, emb, loss)
            if any(b < a for row in want for a, b in row):
                continue
            split = PipelineSplit(pp, virtual_stages=vp, account_for_embedding=emb,
                                  account_for_loss=loss)
            assert split.ranges(num_layers) == want, (num_layers, pp, vp, emb, loss)
            checked += 1
        for first, last in itertools.product([None, *range(vp, num_layers, vp)], repeat=2):
            middle = num_layers - (first or 0) - (last or 0)
            stages = pp - (first is not None) - (last is not None)
            if (first is None and last is None) or middle < 0 or \
                    bool(middle) != bool(stages) or (stages and (middle % stages or
                                                                 (middle // stages) % vp)):
                continue
            if stages == 0:  # PP2 with both flags: Megatron's offset divides by zero
                continue     # middle stages (megamoe: consecutive in virtual-stage order)
            split = PipelineSplit(pp, first=first, last=last, virtual_stages=vp)
            assert split.ranges(num_layers) == _megatron_counts(
                num_layers, pp, vp, first, last, False, False), (num_layers, pp, vp, first,
                                                                  last)
            checked += 1
    assert checked > 100
    with pytest.raises(ConfigError, match="first pipeline rank .3. must be divisible by "
                                          "--num-virtual-stages-per-pipeline-rank .2."):
        PipelineSplit(3, first=3, virtual_stages=2).ranges(7)
    with pytest.raises(ConfigError, match="cannot be combined with --num-virtual-stages"):
        PipelineSplit(2, layers_per_virtual_stage=1, virtual_stages=2).check_flags()


def test_split_flags_equal_megatrons_formulas():
    """Every split Megatron accepts for up to 12 layers and PP <= 4 (with and without
    interleaving, the embedding / loss counted or not, and uneven first / last stages)."""
    checked = 0
    for num_layers, pp in itertools.product(range(1, 13), range(2, 5)):
        for emb, loss in itertools.product((False, True), repeat=2):
            total = num_layers + emb + loss
            if total % pp:
                continue
            for n in [None] + [d for d in range(1, total // pp + 1) if (total // pp) % d == 0]:
                vp = None if n is None or n == total // pp else total // pp // n
                split = PipelineSplit(pp, n, account_for_embedding=emb, account_for_loss=loss)
                want = _megatron_counts(num_layers, pp, vp, None, None, emb, loss)
                if any(b < a for row in want for a, b in row):
                    continue  # Megatron's "Not enough layers" assert
                assert split.ranges(num_layers) == want, (num_layers, pp, n, emb, loss)
                checked += 1
        for first, last in itertools.product([None, *range(1, num_layers)], repeat=2):
            if first is None and last is None:
                continue
            middle = num_layers - (first or 0) - (last or 0)
            stages = pp - (first is not None) - (last is not None)
            if middle < 0 or bool(middle) != bool(stages) or (stages and middle % stages):
                continue  # Megatron's TransformerConfig refuses these
            split = PipelineSplit(pp, first=first, last=last)
            assert split.ranges(num_layers) == _megatron_counts(
                num_layers, pp, None, first, last, False, False), (num_layers, pp, first, last)
            checked += 1
    assert checked > 200
