"""--apply-wd-to-qk-layernorm and --decoupled-lr / --decoupled-min-lr against Megatron-LM's
rules written out here (megatron/core/optimizer/__init__.py get_standard_config_overrides
and _get_param_groups; optimizer_param_scheduler.py get_lr(param_group))."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.config import ModelConfig, OptimizerConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.training.optim.common import is_embedding_or_output, param_groups
from megamoe.training.schedules.lr import LRScheduler


def _model(**kw) -> GPTModel:
    cfg = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
               vocab_size=64, seq_length=8, max_position_embeddings=8, qk_layernorm=True,
               normalization="LayerNorm", add_bias_linear=True)
    return GPTModel(ModelConfig(**{**cfg, **kw}))


def megatron_no_wd(name: str, param: torch.Tensor, apply_wd_to_qk_layernorm: bool) -> bool:
    """Megatron's two ParamKeys for wd_mult 0, verbatim."""
    if apply_wd_to_qk_layernorm:
        return (len(param.shape) == 1 or name.endswith(".bias")) and not (
            "q_layernorm." in name or "k_layernorm." in name)
    return name.endswith(".bias") or len(param.shape) == 1


@pytest.mark.parametrize("flag", [False, True])
def test_weight_decay_groups_follow_megatrons_rule(flag):
    """Every parameter decays or not as Megatron decides; the scheduler gives the q/k
    layernorm weights and biases --weight-decay only with the flag."""
    model = _model()
    opt_cfg = OptimizerConfig(weight_decay=0.1, apply_wd_to_qk_layernorm=flag)
    groups = param_groups(model, opt_cfg)
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    LRScheduler(optimizer, opt_cfg, train_iters=4)
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert any("q_layernorm.bias" in n for n in names)  # (LayerNorm: weight and bias)
    for name, p in names.items():
        want = 0.0 if megatron_no_wd(name, p, flag) else 0.1
        assert decay_of[id(p)] == want, name
    qk = [n for n in names if "q_layernorm." in n or "k_layernorm." in n]
    assert len(qk) == 8 and all((decay_of[id(names[n])] == 0.1) == flag for n in qk)


def megatron_lr(n: float, max_lr: float, min_lr: float, init: float, warmup: float,
                decay: float) -> float:
    """OptimizerParamScheduler.get_lr(param_group) for cosine decay."""
    if warmup > 0 and n <= warmup:
        return init + (max_lr - init) * n / warmup
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


@pytest.mark.parametrize("decoupled_min_lr", [1e-4, None])
def test_decoupled_lr_schedules_the_embedding_and_output_layer(decoupled_min_lr):
    """The word embedding and the untied output layer (no other parameter) follow the
    schedule between --decoupled-lr and --decoupled-min-lr (default --min-lr); the rest
    between --lr and --min-lr; the log line shows the run's --lr schedule."""
    model = _model(untie_embeddings_and_output_weights=True)
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_warmup_init=1e-6, lr_warmup_iters=2,
                          lr_decay_iters=8, lr_decay_style="cosine", decoupled_lr=5e-3,
                          decoupled_min_lr=decoupled_min_lr)
    groups = param_groups(model, cfg)
    decoupled = [g for g in groups if "max_lr" in g]
    own = {id(p) for g in decoupled for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in own}
    assert names == {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert all(g["wd_mult"] == 1.0 for g in decoupled)  # (2-D weights: they decay)
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    scheduler = LRScheduler(optimizer, cfg, train_iters=10)
    dmin = 1e-5 if decoupled_min_lr is None else decoupled_min_lr
    for n in range(11):
        for g in optimizer.param_groups:
            bounds = (5e-3, dmin) if "max_lr" in g else (1e-3, 1e-5)
            assert g["lr"] == pytest.approx(megatron_lr(n, *bounds, 1e-6, 2, 8), rel=1e-12)
        assert scheduler.last_lr == pytest.approx(megatron_lr(n, 1e-3, 1e-5, 1e-6, 2, 8))
        scheduler.step(1)


def test_decoupled_bounds_are_this_runs_after_a_checkpoint_load():
    """A loaded optimizer state carries its groups' max_lr / min_lr; the schedule keeps
    this run's --decoupled-lr (as --lr)."""
    model = _model(untie_embeddings_and_output_weights=True)
    old = OptimizerConfig(lr=1e-3, decoupled_lr=9e-3, lr_decay_style="constant")
    new = OptimizerConfig(lr=1e-3, decoupled_lr=2e-3, lr_decay_style="constant")
    saved = torch.optim.AdamW(param_groups(model, old), lr=1e-3).state_dict()
    optimizer = torch.optim.AdamW(param_groups(model, new), lr=1e-3)
    scheduler = LRScheduler(optimizer, new, train_iters=4)
    optimizer.load_state_dict(saved)
    scheduler.step(increment=0)
    assert sorted(g["lr"] for g in optimizer.param_groups) == [1e-3, 1e-3, 2e-3]


def test_tied_embedding_and_pipeline_copy_are_decoupled():
    """Tied: the word embedding only; a last pipeline stage's copy of it
    (shared_output_weight) too, as Megatron marks its output_layer.weight."""
    model = _model()
    cfg = OptimizerConfig(decoupled_lr=5e-3)
    own = [p for g in param_groups(model, cfg) if "max_lr" in g for p in g["params"]]
    assert len(own) == 1 and own[0] is model.embedding.word_embeddings.weight
    assert is_embedding_or_output("module.shared_output_weight")
    assert is_embedding_or_output("decoder.output_layer.weight")
    assert not is_embedding_or_output("embedding.position_embeddings.weight")
    assert not is_embedding_or_output("mtp.layers.0.eh_proj.weight")


@pytest.mark.slow  # (two gloo ranks and two single-process runs: ~1 min)
def test_dp2_distributed_optimizer_keeps_the_groups_schedules():
    """DP=2 with the distributed optimizer (each rank's shard builds its groups from the
    same rule) trains to the single-process losses and weights with both flags on, and
    the flags change the training (so the comparison is not vacuous)."""
    from tests.training.test_pretrain_expert_parallel import _check, _run, _single

    flags = ("--decoupled-lr 3e-3 --decoupled-min-lr 1e-4 --qk-layernorm "
             "--apply-wd-to-qk-layernorm --weight-decay 0.1")
    _check(_run(f"--use-distributed-optimizer {flags}", 2), 1, lambda r: 0,
           extra_single=flags)
    with_flags, without = _single(flags)[0], _single("--qk-layernorm --weight-decay 0.1")[0]
    assert abs(with_flags[-1]["lm loss"] - without[-1]["lm loss"]) > 1e-4 * abs(
        without[-1]["lm loss"])
    # the logged learning rate is the run's --lr schedule, not the decoupled one
    assert [h["lr"] for h in with_flags] == [h["lr"] for h in without]


def test_deprecated_spelling():
    """--no-weight-decay-cond-type apply_wd_to_qk_layernorm is --apply-wd-to-qk-layernorm
    (Megatron's validate_args)."""
    import shlex

    from megamoe.cli.arguments import parse_args
    from megamoe.cli.mapping import run_config_from_args

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
            "--train-iters 1 --lr 1e-3 --mock-data")
    optim = lambda extra: run_config_from_args(parse_args(shlex.split(f"{base} {extra}")),
                                               97).optim
    assert not optim("").apply_wd_to_qk_layernorm
    assert optim("--no-weight-decay-cond-type apply_wd_to_qk_layernorm").apply_wd_to_qk_layernorm
