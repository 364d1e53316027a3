"""Layout-free checkpoint keys: a single-process model's parts are its own state_dict
names (fused tensors split into q/k/v and gate/up parts that concatenate back), and every
pipeline stage names its tensors as the single-process model does (global layer index)."""

from __future__ import annotations

import dataclasses
import shlex

import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import pipeline_layer_ranges
from megamoe.model.gpt_model import GPTModel
from megamoe.model.pipeline_stage import split_pipeline
from megamoe.training.checkpoint.sharded_state import model_entries
from tests.training.test_pretrain import TINY_MOE


def _config(extra: str = ""):
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 {extra}"), world_size=1)
    return run_config_from_args(args, 98).model


def _parts_by_name(model) -> dict[str, list]:
    return {e.name: e.parts for e in model_entries(model)}


def test_single_process_keys_are_state_dict_names_with_fused_parts():
    torch.manual_seed(0)
    model = GPTModel(_config("--num-layers 3"))
    parts = _parts_by_name(model)
    sd = model.state_dict()
    assert parts.keys() == sd.keys()
    for name, tensor in sd.items():
        keys = [p.key for p in parts[name]]
        if name.endswith("linear_qkv.weight"):
            assert keys == [f"{name}.{s}" for s in "qkv"]
        elif name.endswith("experts.fc1_weight"):
            assert keys == [f"{name}.gate", f"{name}.up"]
        else:
            assert keys == [name], name
        whole = torch.cat([p.local(tensor) for p in parts[name]],
                          dim=parts[name][0].dim or 0)
        assert torch.equal(whole, tensor), name
        for p in parts[name]:
            assert tuple(p.local(tensor).shape) == p.global_shape


def test_pipeline_stages_use_the_single_process_names():
    untied = _config("--num-layers 4")
    tied = dataclasses.replace(untied, untie_embeddings_and_output_weights=False)
    # (config, layers per virtual stage): tied embeddings put a copy on the last stage
    # that loads from the embedding's key and is not saved twice
    for config, per_virtual_stage in ((tied, None), (untied, 1)):
        torch.manual_seed(0)
        single = {p.key: p for e in model_entries(GPTModel(config)) for p in e.parts}
        saved, loaded = set(), set()
        for rank in range(2):
            torch.manual_seed(0)
            ranges = pipeline_layer_ranges(config.num_layers, 2, per_virtual_stage)
            stage = split_pipeline(GPTModel(config), ranges, rank, None, [0, 1])
            for e in model_entries(stage):
                for p in e.parts:
                    assert p.global_shape == single[p.key].global_shape, p.key
                    (saved if e.save else loaded).add(p.key)
        assert saved == set(single)
        assert loaded == ({"embedding.word_embeddings.weight"} if config is tied else set())
