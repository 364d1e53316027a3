"""The optimizer state of Megatron-LM torch_dist checkpoints, against real megatron-core
(0.19.2, megatron_peer/peer_optim.py: its own optimizer, two real Adam steps, its own save)
as the oracle:

- a megamoe run resumed (`pretrain_gpt.py --load`, one iteration, then --save) from the
  converted checkpoint makes exactly the AdamW update computed by hand, in Megatron's
  layout, from the moments, main parameters and step count megatron-core saved: the
  resumed run's exp_avg gives the gradient it used (g = (m1 - b1 m0) / (1 - b1)); with it
  exp_avg_sq must be b2 v0 + (1 - b2) g^2 and the parameters p0 (1 - lr wd) - lr m1_hat /
  (sqrt(v1_hat) + eps), bias-corrected at step 3. Tolerances: 1e-5 of each exp_avg_sq's
  largest value (the gradient comes from a difference of moments, which cancels digits
  of fp32; measured <= 2.6e-7) and 1e-3 of lr on the update (fp32 rounding of the
  parameters and of torch's fused AdamW kernel; measured <= 2.0e-4 of lr).
  The run's states are mapped back with to_megatron, the raw Megatron ones are read
  straight from DCP: a moment that lands on another parameter, another row (a skipped
  qkv interleave) or in the other state, or a lost step count, fails;
- the distributed optimizer's fully_reshardable layout the same (slow set); its default
  dp_reshardable layout: test_convert_megatron_dp_reshard.py;
- bad optimizer state (a missing moment, a negative exp_avg_sq, an odd step): one line,
  exit 1, nothing written.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megamoe.cli.main import main as pretrain_main
from megamoe.config import ModelConfig, OptimizerConfig
from megamoe.model import megatron_mapping
from megamoe.model.gpt_model import GPTModel
from megamoe.training.checkpoint import load_dist_checkpoint, read_common
from megamoe.training.optim.mixed_precision import MixedPrecisionOptimizer
from tests.tools.megatron_peer.mcore_venv import PEER, run_peer
from tools.checkpoint.convert import main as convert

megatron_format = importlib.import_module("megatron_format")
megatron_optim = importlib.import_module("megatron_optim")

PEER_OPTIM = os.path.join(os.path.dirname(PEER), "peer_optim.py")
LR, B1, B2, EPS, WD = 3e-4, 0.9, 0.95, 1e-8, 0.1  # peer_optim.py's
VOCAB = 100  # the peer's real vocabulary (padded to 128 x TP rows by Megatron)
RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
       "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--train-iters", "3", "--lr", str(LR), "--min-lr", str(LR),
       "--lr-decay-style", "constant", "--weight-decay", str(WD), "--adam-beta1", str(B1),
       "--adam-beta2", str(B2), "--adam-eps", str(EPS), "--clip-grad", "1.0",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--use-checkpoint-args",
       "--ckpt-format", "torch_dist", "--log-interval", "1"]


@pytest.fixture(scope="module")
def optim_saves(tmp_path_factory, mcore_python):
    """(optimizer, sharding) -> a Megatron-LM save after two Adam steps (made on demand)."""
    root, made = tmp_path_factory.mktemp("megatron_optim"), {}

    def get(optimizer: str = "fp32", sharding: str = "fully_reshardable", *extra: str
            ) -> str:
        if (optimizer, sharding, extra) not in made:
            out = str(root / f"{optimizer}-{sharding}{''.join(extra)}")
            run_peer(["--optimizer", optimizer, "--sharding", sharding, "--out", out, *extra],
                     python=mcore_python, script=PEER_OPTIM)
            made[(optimizer, sharding, extra)] = out
        return made[(optimizer, sharding, extra)]
    return get


def _raw(it_dir: str) -> tuple[dict, dict]:
    """(megatron weights, {state: {megatron key: tensor}}) read straight from DCP."""
    _, weights = megatron_format.read_megatron(it_dir)
    meta = megatron_format.read_dcp_metadata(os.path.join(it_dir, ".metadata"))
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items() if k.startswith("optimizer.state.")}
    dcp.load(want, checkpoint_id=it_dir, no_dist=True)
    states: dict[str, dict] = {}
    for k, t in want.items():
        name, key = k[len("optimizer.state."):].split(".", 1)
        states.setdefault(name, {})[key] = t
    return weights, states


def _resumed(ckpt: str, bf16: bool | None = None, spec: str = "local"
             ) -> tuple[dict, dict, ModelConfig, float]:
    """(fp32 main params, {exp_avg, exp_avg_sq}, config, step) of a megamoe torch_dist
    checkpoint, loaded through megamoe's own --load path (bf16 weights: as its args say,
    unless `bf16` says), each mapped to Megatron's names (`spec`'s: "te" names a MoE
    layer's pre-MLP norm pre_mlp_layernorm.weight)."""
    common = read_common(ckpt)
    config = ModelConfig.from_dict(common["model_config"])
    bf16 = common["args"]["bf16"] if bf16 is None else bf16
    model = GPTModel(config).to(torch.bfloat16 if bf16 else torch.float32)
    opt = MixedPrecisionOptimizer(model, OptimizerConfig(lr=LR, weight_decay=WD))
    load_dist_checkpoint(ckpt, model, opt, None, None, single=True, load_rng=False)
    names = {id(p): n for n, p in model.named_parameters()}
    states, step, _ = opt.param_states()
    per = {s: {names[id(p)]: st[s] for p, st in zip(opt.model_params, states)}
           for s in ("exp_avg", "exp_avg_sq")}
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if opt.separate_main:  # bf16 weights: the update is checked on the fp32 main copy
        sd.update({names[id(p)]: st["main"] for p, st in zip(opt.model_params, states)})
    to = {s: megatron_mapping.to_megatron(d, config, spec) for s, d in per.items()}
    return megatron_mapping.to_megatron(sd, config, spec), to, config, float(step)


def _resume_one_iteration(converted: str, out: str, *extra: str) -> str:
    assert pretrain_main(RUN + ["--load", converted, "--save", out, *extra]) == 0
    return os.path.join(out, "iter_0000003")


def check_adamw_step(save: str, resumed_dir: str, spec: str = "local"
                     ) -> tuple[float, float]:
    """The resumed run's one update equals AdamW by hand from Megatron's saved state;
    returns the worst exp_avg_sq error (of its tensor's largest value) and the worst
    update error (of lr), for the record."""
    p0, s0 = _raw(os.path.join(save, "iter_0000002"))
    p1, s1, _, step = _resumed(resumed_dir, spec=spec)
    assert step == 3.0
    main0 = s0.get("param") or s0.get("fp32_param") or p0
    bc1, bc2 = 1 - B1 ** 3, 1 - B2 ** 3
    worst = [0.0, 0.0]
    for key, m1 in s1["exp_avg"].items():
        m0, v0, v1 = s0["exp_avg"][key], s0["exp_avg_sq"][key], s1["exp_avg_sq"][key]
        w0, w1 = main0[key], p1[key]
        if m0.shape != m1.shape:  # TP > 1: Megatron's vocabulary padding is 128 x TP rows
            assert key in ("embedding.word_embeddings.weight", "output_layer.weight"), key
            m0, v0, w0 = m0[:VOCAB], v0[:VOCAB], w0[:VOCAB]  # the real rows only
            m1, v1, w1 = m1[:VOCAB], v1[:VOCAB], w1[:VOCAB]
        assert m0.abs().max() > 0 and v0.abs().max() > 0, key  # real moments, not zeros
        g = (m1 - B1 * m0) / (1 - B1)
        torch.testing.assert_close(v1, B2 * v0 + (1 - B2) * g * g, rtol=1e-5,
                                   atol=1e-5 * v1.abs().max().item(), msg=key)
        wd = 0.0 if "norm" in key else WD
        update = -LR * wd * w0 - LR * (m1 / bc1) / ((v1 / bc2).sqrt() + EPS)
        torch.testing.assert_close(w1 - w0, update, rtol=1e-3, atol=1e-3 * LR, msg=key)
        pred = B2 * v0 + (1 - B2) * g * g
        worst[0] = max(worst[0], ((v1 - pred).abs().max() / v1.abs().max()).item())
        worst[1] = max(worst[1], ((w1 - w0 - update).abs().max() / LR).item())
    return worst[0], worst[1]


def test_resumed_run_makes_the_adamw_step_of_the_imported_state(optim_saves, tmp_path,
                                                               capsys):
    save = optim_saves("fp32")
    conv = str(tmp_path / "conv")
    assert convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 0
    assert "Adam state of the non-distributed optimizer at step 2" in capsys.readouterr().out
    args = read_common(os.path.join(conv, "iter_0000002"))["args"]
    assert (args["adam_beta1"], args["adam_beta2"], args["adam_eps"]) == (B1, B2, EPS)
    print("worst errors (exp_avg_sq, update / lr):",
          check_adamw_step(save, _resume_one_iteration(conv, str(tmp_path / "run"))))


@pytest.mark.slow
def test_bf16_float16_optimizer_main_params(optim_saves, tmp_path):
    """--bf16 (Float16OptimizerWithFloat16Params): the fp32 main parameters travel, not
    the bf16 weights upcast (their rounding, ~1e-4 here, is 300x the update tolerance)."""
    save = optim_saves("fp32", "fully_reshardable", "--bf16")
    conv = str(tmp_path / "conv")
    assert convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 0
    print("worst errors (exp_avg_sq, update / lr):", check_adamw_step(
        save, _resume_one_iteration(conv, str(tmp_path / "run"), "--bf16")))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, extra, says", [
    ("distrib", (), "the distributed optimizer (fully_reshardable)"),
    # EP2 (2 gloo ranks, DP 2): megatron-core's ChainedOptimizer of the dense and the
    # expert optimizers, experts saved from both EP ranks
    ("fp32", ("--ep", "2"), "the non-distributed optimizer"),
    ("distrib", ("--ep", "2"), "the distributed optimizer (fully_reshardable)"),
    # a dense first layer, gated shared experts, sigmoid router with expert bias (a
    # buffer: no moments); MLA + two MTP depths (DeepSeek-V3's shape)
    ("fp32", ("--variant", "shared_dense"), "the non-distributed optimizer"),
    ("fp32", ("--variant", "mla_mtp"), "the non-distributed optimizer"),
])
def test_other_optimizers_and_layouts(optim_saves, tmp_path, capsys, optimizer, extra, says):
    save = optim_saves(optimizer, "fully_reshardable", *extra)
    conv = str(tmp_path / "conv")
    assert convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 0
    assert f"Adam state of {says} at step 2" in capsys.readouterr().out
    with capsys.disabled():
        print("worst errors (exp_avg_sq, update / lr):", check_adamw_step(
            save, _resume_one_iteration(conv, str(tmp_path / "run"))))


@pytest.mark.slow
def test_swapped_moments_are_refused(optim_saves, tmp_path, monkeypatch, capsys):
    """exp_avg imported as exp_avg_sq (and back) cannot pass: the converter refuses a
    negative exp_avg_sq, with one line, and writes nothing."""
    monkeypatch.setitem(megatron_optim.NAMES, "exp_avg", "exp_avg_sq")
    monkeypatch.setitem(megatron_optim.NAMES, "exp_avg_sq", "exp_avg")
    conv = str(tmp_path / "conv")
    assert convert(["megatron-to-megamoe", "--input", optim_saves("fp32"), "--output",
                    conv]) == 1
    assert "optimizer state exp_avg_sq of" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(conv, "latest_checkpointed_iteration.txt"))


def _skip_qkv_interleave(monkeypatch) -> None:
    """Moments mapped without the per-query-group qkv interleave (weights untouched)."""
    mapped = megatron_format.to_megamoe_states

    def skipped(*args):
        with monkeypatch.context() as m:
            m.setattr(megatron_mapping, "qkv_to_megamoe", lambda w, config: w)
            return mapped(*args)
    monkeypatch.setattr(megatron_format, "to_megamoe_states", skipped)


def _lose_the_step(monkeypatch) -> None:
    monkeypatch.setattr(megatron_optim, "_step", lambda common, where: 1)


@pytest.mark.slow
@pytest.mark.parametrize("breakage", [_skip_qkv_interleave, _lose_the_step])
def test_broken_imports_fail_the_check(optim_saves, tmp_path, monkeypatch, breakage):
    """The check can fail: a mapping that skips the qkv interleave for the moments, or a
    step count that is not carried, each makes the resumed update differ."""
    save, conv = optim_saves("fp32"), str(tmp_path / "conv")
    breakage(monkeypatch)
    assert convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 0
    monkeypatch.undo()
    resumed = _resume_one_iteration(conv, str(tmp_path / "run"))
    with pytest.raises(AssertionError) as e:
        check_adamw_step(save, resumed)
    print(f"{breakage.__name__}: {str(e.value).splitlines()[0][:200]}")


@pytest.mark.slow
def test_dp_reshardable_at_dp1_imports(optim_saves, tmp_path, capsys):
    """Megatron-LM's default layout (test_convert_megatron_dp_reshard.py: DP 2, EP 2)."""
    conv = str(tmp_path / "conv")
    save = optim_saves("distrib", "dp_reshardable")
    assert convert(["megatron-to-megamoe", "--input", save, "--output", conv]) == 0
    assert ("Adam state of the distributed optimizer (dp_reshardable) at step 2"
            in capsys.readouterr().out)


def _edit(save: str, dst: str, edit) -> str:
    """A Megatron checkpoint like `save` whose optimizer tensors went through `edit`
    (rewritten as valid DCP with its common state: only the values are wrong)."""
    it_dir = os.path.join(save, "iter_0000002")
    common, weights = megatron_format.read_megatron(it_dir)
    meta = megatron_format.read_dcp_metadata(os.path.join(it_dir, ".metadata"))
    optim = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items() if k.startswith("optimizer.")}
    dcp.load(optim, checkpoint_id=it_dir, no_dist=True)
    edit(optim)
    megatron_format.write_megatron(dst, 2, {**weights, **optim}, common, [])
    return dst


@pytest.mark.parametrize("edit, says", [
    (lambda sd: sd["optimizer.state.exp_avg_sq.output_layer.weight"].fill_(-1.0),
     "optimizer state exp_avg_sq of output_layer.weight: not a finite tensor"),
    (lambda sd: sd["optimizer.state.exp_avg.decoder.final_layernorm.weight"].fill_(
        float("nan")), "optimizer state exp_avg of decoder.final_layernorm.weight"),
    (lambda sd: sd.pop("optimizer.state.exp_avg.output_layer.weight"),
     "optimizer state exp_avg misses output_layer.weight"),
    (lambda sd: sd.__setitem__("optimizer.state.exp_avg_sq.output_layer.weight",
                               torch.zeros(128, 32)),
     "optimizer.state.exp_avg_sq.output_layer.weight is not a float tensor shaped [128, 64]"),
])
def test_bad_optimizer_state_is_one_line_and_writes_nothing(optim_saves, tmp_path, capsys,
                                                            edit, says):
    """A rewritten (valid DCP) checkpoint whose moments cannot be Adam's: exit 1."""
    bad = _edit(optim_saves("fp32"), str(tmp_path / "bad"), edit)
    out = str(tmp_path / "out")
    assert convert(["megatron-to-megamoe", "--input", bad, "--output", out]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not os.path.exists(out) or not os.listdir(out)


def test_find_optimizer_checks_the_step_and_the_states():
    """Untrusted common-state fields (no peer needed): the step count's type and range,
    one shared step, both moments present."""
    class Meta:
        state_dict_metadata = {"optimizer.state.exp_avg.w": None,
                               "optimizer.state.exp_avg_sq.w": None}

    def common(step):
        return {"optimizer": {"state": {"common_step": step}, "param_groups": []}}

    assert megatron_optim.find_optimizer(common(torch.tensor(4.0)), Meta, "x")[0].step == 4
    for bad in (-1, 2.5, float("nan"), "3", True, 2**41, torch.tensor([1.0, 2.0])):
        with pytest.raises(megatron_optim.ConvertError, match="step count"):
            megatron_optim.find_optimizer(common(bad), Meta, "x")
    chained = {"optimizer": {0: common(3)["optimizer"], 1: common(4)["optimizer"]}}
    with pytest.raises(megatron_optim.ConvertError, match=r"\[3, 4\]"):
        megatron_optim.find_optimizer(chained, Meta, "x")
    Meta.state_dict_metadata = {"optimizer.state.exp_avg.w": None}
    with pytest.raises(megatron_optim.ConvertError, match="expected exp_avg and exp_avg_sq"):
        megatron_optim.find_optimizer(common(3), Meta, "x")
    assert megatron_optim.find_optimizer({"optimizer": None}, Meta, "x")[0] is None
    Meta.state_dict_metadata = {"optimizer.distributed.dp_group_idx_0.param_state": None}
    for sharding in ("dp_reshardable", "fully_sharded_model_space"):
        found, why = megatron_optim.find_optimizer(
            {**common(3), "content_metadata": {"distrib_optim_sharding_type": sharding}},
            Meta, "x")
        assert found is None and f"'{sharding}' layout is not read" in why


def test_adam_hyperparameters_travel_with_the_args_and_are_checked():
    """args.adam_beta1 / adam_beta2 / adam_eps / clip_grad become the flags of the
    converted run; a value out of range is one line naming the field."""
    import argparse

    from megamoe.cli.megatron_args import MegatronArgsError, flags_from_args

    flags = flags_from_args(argparse.Namespace(adam_beta1=0.8, adam_beta2=0.95,
                                               adam_eps=1e-6, clip_grad=0.5))
    assert " ".join(flags) == ("--adam-beta1 0.8 --adam-beta2 0.95 --adam-eps 1e-06 "
                               "--clip-grad 0.5 --disable-bias-linear")
    for field, value in (("adam_beta1", 1.5), ("adam_beta2", -0.1), ("adam_eps", "1e-8"),
                         ("clip_grad", float("nan"))):
        with pytest.raises(MegatronArgsError, match=f"args.{field} = "):
            flags_from_args(argparse.Namespace(**{field: value}))
