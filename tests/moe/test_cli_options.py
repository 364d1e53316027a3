"""Megatron MoE flags -> MoEConfig -> pretrain_gpt.py trains with every router option."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.moe.router import TopKRouter

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --normalization RMSNorm --position-embedding-type rope "
    "--swiglu --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-grouped-gemm "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 97 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --seed 7"
)


def _args(extra: str):
    return parse_args(shlex.split(f"{BASE} {extra}"), world_size=1)


OPTIONS = {
    "seq_aux": ("--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-2",
                "seq_load_balancing_loss"),
    "global_aux": ("--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2",
                   "global_load_balancing_loss"),
    "several": ("--moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss "
                "--moe-aux-loss-coeff 1e-2 1e-3 1e-3 --moe-z-loss-coeff 1e-3",
                "global_load_balancing_loss"),
    "sinkhorn": ("--moe-router-load-balancing-type sinkhorn", None),
    "none": ("--moe-router-load-balancing-type none", None),
    "sigmoid_bias": ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                     "--moe-router-bias-update-rate 1e-2 --moe-router-load-balancing-type none",
                     None),
    "capacity": ("--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity "
                 "--moe-token-drop-policy position --moe-aux-loss-coeff 1e-2",
                 "load_balancing_loss"),
    "token_dropping": ("--moe-token-dropping", None),
    "shared_jitter": ("--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate "
                      "--moe-input-jitter-eps 0.01", None),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_pretrain_trains_with_router_option(name):
    extra, logged = OPTIONS[name]
    hist = pretrain(_args(f"{extra} --train-iters 2"), print_fn=lambda _m: None).history
    assert len(hist) == 2
    assert all(torch.isfinite(torch.tensor(h["lm loss"])) for h in hist)
    if logged:
        assert hist[0][logged] > 0


def test_flags_map_to_config():
    run = run_config_from_args(_args(
        "--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.1 0.2 "
        "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.5 "
        "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity "
        "--moe-token-drop-policy position --moe-input-jitter-eps 0.02 "
        "--moe-shared-expert-intermediate-size 16 --moe-shared-expert-gate "
        "--ffn-hidden-size 48 --moe-use-upcycling --moe-capacity-over-tp-gathered-sequence "
        "--moe-expert-bias-counts-before-capacity --train-iters 1"), 97)
    moe = run.model.moe
    assert moe.capacity_over_tp_gathered_sequence and moe.expert_bias_counts_before_capacity
    assert moe.load_balancing_types == ["aux_loss", "seq_aux_loss"]
    assert moe.aux_loss_coeff("seq_aux_loss") == 0.2
    assert moe.enable_expert_bias and moe.bias_update_rate == 0.5
    assert (moe.capacity_factor, moe.pad_to_capacity, moe.token_drop_policy) == \
        (1.5, True, "position")
    assert moe.input_jitter_eps == 0.02 and run.moe_training.use_upcycling
    assert (moe.shared_expert_intermediate_size, moe.shared_expert_gate) == (16, True)
    old = run_config_from_args(_args("--moe-token-dropping --train-iters 1"), 97).model.moe
    assert old.capacity_factor == 1.0  # the old spelling means capacity factor 1


@pytest.mark.parametrize("extra,message", [
    ("--moe-pad-expert-input-to-capacity", "--moe-pad-expert-input-to-capacity needs"),
    ("--moe-shared-expert-gate", "--moe-shared-expert-gate needs"),
    ("--moe-router-load-balancing-type sinkhorn --moe-router-enable-expert-bias",
     "sinkhorn cannot be combined"),
    ("--moe-input-jitter-eps 1.5", "--moe-input-jitter-eps must be in [0, 1)"),
    ("--moe-capacity-over-tp-gathered-sequence",
     "--moe-capacity-over-tp-gathered-sequence needs --moe-expert-capacity-factor"),
    ("--moe-expert-bias-counts-before-capacity",
     "--moe-expert-bias-counts-before-capacity needs --moe-router-enable-expert-bias"),
    ("--moe-use-upcycling", "--moe-ffn-hidden-size (48) must equal --ffn-hidden-size"),
])
def test_bad_combinations_one_line(capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        _args(f"{extra} --train-iters 1")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_expert_bias_updated_once_per_step_in_training(monkeypatch):
    import megamoe.training.pretrain as pt

    args = _args("--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                 "--moe-router-bias-update-rate 0.25 --moe-router-load-balancing-type none "
                 "--train-iters 3")
    built = []
    orig = pt.build_model
    monkeypatch.setattr(pt, "build_model", lambda *a, **kw: built.append(orig(*a, **kw))
                        or built[-1])
    pretrain(args, print_fn=lambda _m: None)
    routers = [m for m in built[0].modules() if isinstance(m, TopKRouter)]
    assert routers
    for r in routers:
        # three updates of +-0.25 (or 0): every entry is a multiple of 0.25, at most 0.75
        steps = r.expert_bias / 0.25
        assert torch.allclose(steps, steps.round()) and steps.abs().max() <= 3
        assert steps.abs().max() > 0
        assert float(r.local_tokens_per_expert.abs().sum()) == 0
