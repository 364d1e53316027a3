"""Megatron MoE flags -> MoEConfig -> pretrain_gpt.py trains with every router option."""

from __future__ import annotations

import math
import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.cli.mapping import run_config_from_args
from megamoe.moe.layer import MoELayer
from megamoe.moe.router import TopKRouter, sinkhorn

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


OPTIONS = {  # options whose effect is a logged balancing loss
    "seq_aux": ("--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-2",
                "seq_load_balancing_loss"),
    "global_aux": ("--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2",
                   "global_load_balancing_loss"),
    "several": ("--moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss "
                "--moe-aux-loss-coeff 1e-2 1e-3 1e-3 --moe-z-loss-coeff 1e-3",
                "global_load_balancing_loss"),
    "capacity": ("--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity "
                 "--moe-token-drop-policy position --moe-aux-loss-coeff 1e-2",
                 "load_balancing_loss"),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_pretrain_trains_with_router_option(name):
    extra, logged = OPTIONS[name]
    hist = pretrain(_args(f"{extra} --train-iters 2"), print_fn=lambda _m: None).history
    assert len(hist) == 2
    assert all(torch.isfinite(torch.tensor(h["lm loss"])) for h in hist)
    assert hist[0][logged] > 0


def _recorded(monkeypatch, cls, name: str) -> list:
    """Calls of cls.name during the test: (instance, training, args, result)."""
    calls: list = []
    orig = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        calls.append((self, self.training, args, out))
        return out

    monkeypatch.setattr(cls, name, wrapper)
    return calls


def _train(extra: str) -> list[dict]:
    return pretrain(_args(extra), print_fn=lambda _m: None).history


ITERS, MICRO, LAYERS = 2, 2, 2  # --global-batch-size 4 / --micro-batch-size 2


def test_sinkhorn_routes_by_sinkhorn_in_training(monkeypatch):
    """Every training routing map is the top-k of sinkhorn(logits), which is not plain top-k
    of the same logits; no balancing loss is recorded."""
    calls = _recorded(monkeypatch, TopKRouter, "routing")
    hist = _train("--moe-router-load-balancing-type sinkhorn --train-iters 2")
    train = [(args[0].detach(), out[1]) for _, training, args, out in calls if training]
    assert len(train) == ITERS * MICRO * LAYERS
    differs = 0
    for logits, rmap in train:
        by_sinkhorn = sinkhorn(logits.float()).topk(2, dim=1).indices
        assert torch.equal(rmap, torch.zeros_like(rmap).scatter(1, by_sinkhorn, True))
        plain = torch.zeros_like(rmap).scatter(1, logits.topk(2, dim=1).indices, True)
        differs += int(not torch.equal(rmap, plain))
    assert differs > 0
    assert not any("load_balancing" in key for h in hist for key in h)


@pytest.mark.parametrize("kind", ["none", "aux_loss"])
def test_balancing_type_none_uses_no_balancing_loss(monkeypatch, kind):
    """With the same coefficient, aux_loss records and attaches its loss; none (Megatron:
    no load balancing; the coefficient belongs to no loss) records and attaches nothing."""
    calls = _recorded(monkeypatch, TopKRouter, "route")
    hist = _train(f"--moe-router-load-balancing-type {kind} --moe-aux-loss-coeff 1e-2 "
                  "--train-iters 2")
    losses = [out.aux_loss for _, training, _, out in calls if training]
    assert len(losses) == ITERS * MICRO * LAYERS
    if kind == "none":
        assert all(loss is None for loss in losses)
        assert not any("load_balancing" in key for h in hist for key in h)
    else:
        assert all(loss is not None and loss > 0 for loss in losses)
        assert all(h["load_balancing_loss"] > 0 for h in hist)


@pytest.mark.parametrize("dropping", [True, False])
def test_token_dropping_drops_beyond_capacity_and_counts_it(monkeypatch, dropping):
    """--moe-token-dropping (capacity factor 1): each expert keeps min(routed, C) of its
    assignments per micro-batch, C = ceil(T * k / E); some are dropped, and the logged
    dropped fraction is what was dropped. Without it nothing is dropped."""
    calls = _recorded(monkeypatch, MoELayer, "apply_capacity")
    hist = _train(("--moe-token-dropping " if dropping else "") + "--train-iters 2")
    train = [(layer.layer_number, args[1], out[1]) for layer, training, args, out in calls
             if training]
    assert len(train) == ITERS * MICRO * LAYERS
    dropped = {}  # (iteration, layer) -> [dropped, routed]
    for i, (layer, routed_TE, kept_TE) in enumerate(train):
        capacity = math.ceil(routed_TE.shape[0] * 2 / 4) if dropping else routed_TE.shape[0]
        routed_E, kept_E = routed_TE.sum(0), kept_TE.sum(0)
        assert torch.equal(kept_E, routed_E.clamp(max=capacity))
        d = dropped.setdefault((i // (MICRO * LAYERS), layer), [0, 0])
        d[0] += int(routed_E.sum() - kept_E.sum())
        d[1] += int(routed_E.sum())
    total = sum(d for d, _ in dropped.values())
    assert (total > 0) == dropping
    for it, h in enumerate(hist):
        want = sum(d / r for (i, _), (d, r) in dropped.items() if i == it) / LAYERS
        assert h["moe/dropped_fraction"] == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("eps", [0.01, None])
def test_input_jitter_perturbs_router_input_in_training_only(monkeypatch, eps):
    """--moe-input-jitter-eps: the router's gate sees its input times noise in
    [1 - eps, 1 + eps] in training, the input itself in evaluation."""
    routes = _recorded(monkeypatch, TopKRouter, "route")
    gates = _recorded(monkeypatch, TopKRouter, "gating")
    flag = f"--moe-input-jitter-eps {eps} " if eps else ""
    _train(f"{flag}--train-iters 2 --eval-interval 1 --eval-iters 1")
    assert len(routes) == len(gates) > ITERS * MICRO * LAYERS  # evaluation routed too
    for (_, training, (x, *_), _), (_, _, (seen,), _) in zip(routes, gates):
        if training and eps:
            ratio = seen / x
            assert (ratio - 1).abs().max() <= eps * (1 + 1e-5)
            assert (ratio - 1).abs().max() > eps / 2
        else:
            assert torch.equal(seen, x)
    assert any(not training for _, training, _, _ in routes)


def test_shared_expert_with_gate_is_built_and_trained(monkeypatch):
    layers = _recorded(monkeypatch, MoELayer, "apply_capacity")
    _train("--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate --train-iters 1")
    built = {id(layer): layer for layer, *_ in layers}
    assert len(built) == LAYERS
    for layer in built.values():
        shared = layer.shared_experts
        assert shared is not None and shared.linear_fc2.weight.shape == (32, 32)
        assert shared.gate_weight is not None and shared.gate_weight.grad.abs().max() > 0


def test_top1_needs_pre_softmax_unless_it_is_trainable_anyway():
    for ok in ("--moe-router-pre-softmax", "--moe-router-score-function sigmoid",
               "--moe-router-load-balancing-type sinkhorn"):
        assert _args(f"--moe-router-topk 1 {ok} --train-iters 1").moe_router_topk == 1
    # Nothing trains under --skip-train: a converted top-1 Mixtral (weight 1.0, as in HF)
    # can be evaluated.
    assert _args("--moe-router-topk 1 --skip-train").moe_router_topk == 1


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
    ("--moe-router-topk 1", "--moe-router-topk 1 with --moe-router-score-function softmax "
                            "needs --moe-router-pre-softmax"),
    ("--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 1e-2",
     "--moe-aux-loss-coeff must be 0 with --moe-router-load-balancing-type sinkhorn"),
    ("--moe-router-load-balancing-type sinkhorn --moe-expert-capacity-factor 1.0",
     "--moe-expert-capacity-factor does not work with --moe-router-load-balancing-type "
     "sinkhorn"),
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
