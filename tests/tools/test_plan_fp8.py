"""The planner's FP8 FLOP rate (megamoe/planning/fp8_time.py): FP8 off is today's model,
FP8 on moves exactly the FP8 policy's GEMM FLOPs to the FP8 peak (checked against a walk
of the policy's own modules on the meta model), bf16-kept layers stay at the bf16 peak,
a GPU without FP8 is refused in one line, and the layout search and --dry-run use it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megamoe.config import ConfigError, Fp8Config, ModelConfig, MoEConfig
from megamoe.model.flops import flops_per_token
from megamoe.model.fp8.policy import fp8_gemm_modules
from megamoe.model.gpt_model import GPTModel
from megamoe.moe.experts import GroupedExperts
from megamoe.planning.fp8_memory import fp8_copy_bytes
from megamoe.planning.memory import Layout
from megamoe.planning.planner import Hardware, layout_run, plan, step_time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP8 = Fp8Config(format="e4m3", recipe="tensorwise")
BF16_ENDS = Fp8Config(format="e4m3", recipe="tensorwise", first_last_layers_bf16=True)


def _model() -> ModelConfig:
    """Dense and MoE layers, shared experts with their gate, one MTP layer: every kind of
    GEMM the FP8 policy converts or keeps."""
    return ModelConfig(
        num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
        num_query_groups=2, vocab_size=512, seq_length=64, max_position_embeddings=64,
        swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        add_bias_linear=False, mtp_num_layers=1, moe_layer_pattern=[0, 1, 1, 1],
        moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=64,
                      shared_expert_intermediate_size=64, shared_expert_gate=True))


def _layout(recompute: str) -> Layout:
    return Layout(tp=2, pp=2, vpp=1, ep=2, etp=1, dp=2, cp=1, distributed_optimizer=True,
                  recompute=recompute, micro_batch_size=1)


# step_time of _model() / _layout(r) on Hardware(8, 80), seq 64, global batch 32, printed
# by main's planner before FP8 was counted (commit 9c94212). Tolerance 1e-12 relative:
# the same float expressions, but another CPU's libm may round log2 differently.
TODAY = {
    "none": {"total": 1.8779528009893516e-05, "compute": 2.2665216326965037e-06,
             "tp_comm": 3.2039822222222223e-06, "all_to_all": 1.7476266666666666e-06,
             "cp_comm": 0.0, "bubble": 5.933975953532134e-07,
             "dp_comm": 3.4488888888888887e-06, "p2p": 5.24288e-06},
    "full": {"total": 2.0900625460661243e-05, "compute": 2.9104247778191686e-06,
             "tp_comm": 3.2039822222222223e-06, "all_to_all": 2.62144e-06, "cp_comm": 0.0,
             "bubble": 7.18168033633668e-07, "dp_comm": 3.4488888888888887e-06,
             "p2p": 5.24288e-06},
}


def _policy_weights_per_token(model: ModelConfig, fp8: Fp8Config) -> float:
    """Reference: matmul weights one token passes through in the GEMMs the FP8 policy
    converts, from the modules themselves (routed experts: topk of E)."""
    with torch.device("meta"):
        gpt = GPTModel(model)
    total = 0.0
    for _, m in fp8_gemm_modules(gpt, fp8, model.num_layers):
        if isinstance(m, GroupedExperts):
            e = m.fc1_weight.shape[0]
            total += (m.fc1_weight.numel() + m.fc2_weight.numel()) * model.moe.topk / e
        else:
            total += m.weight.numel()
    return total


def test_fp8_off_is_todays_step_time():
    """No FP8 config, or one without a format, gives main's numbers (break: price the FP8
    share whenever an Fp8Config is passed -> the disabled one fails)."""
    model, hw = _model(), Hardware(gpus=8, gpu_memory_gb=80)
    for recompute, want in TODAY.items():
        for fp8 in (None, Fp8Config()):
            got = step_time(model, _layout(recompute), hw, 64, 32, fp8)
            assert got == pytest.approx(want, rel=1e-12), (recompute, fp8)


@pytest.mark.parametrize("fp8", [FP8, BF16_ENDS, Fp8Config(format="hybrid", recipe="delayed",
                                                            fp8_wgrad=False)],
                         ids=["all", "first_last_bf16", "no_fp8_wgrad"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fp8_moves_the_policys_flops_to_the_fp8_peak(fp8, recompute):
    """compute(FP8) = compute(bf16) x (1 - s + s x bf16 peak / FP8 peak), s the FP8 share
    of the step's GEMM FLOPs from the policy's modules: 6 FLOPs a weight (4 with
    --no-fp8-wgrad) plus 2 for full recompute's replay; the attention core, output layer,
    router and shared gate stay bf16. Every other component is unchanged. (Break: count
    the router in FP8, or drop the first_last_layers_bf16 test in fp8_time -> fails.)"""
    model, hw = _model(), Hardware(gpus=8, gpu_memory_gb=80)
    lay = _layout(recompute)
    bf16 = step_time(model, lay, hw, 64, 32)
    got = step_time(model, lay, hw, 64, 32, fp8)
    per_weight = (6 if fp8.fp8_wgrad else 4) + (2 if recompute == "full" else 0)
    fp8_flops = per_weight * _policy_weights_per_token(model, fp8)
    # full recompute also replays the bf16 attention core: 2 S x width per layer
    from megamoe.model.flops import attention_core_width, recompute_flops_per_token
    from megamoe.planning.activations import recompute_config
    all_flops = flops_per_token(model) + recompute_flops_per_token(
        model, recompute_config(recompute))
    share = fp8_flops / all_flops
    assert 0.3 < share < 0.9 and attention_core_width(model) > 0
    ratio = 1 - share + share * hw.peak_tflops / hw.peak_fp8_tflops
    assert got["compute"] == pytest.approx(bf16["compute"] * ratio, rel=1e-9)
    for key in ("tp_comm", "all_to_all", "cp_comm", "dp_comm", "p2p"):
        assert got[key] == bf16[key]


def test_bf16_kept_layers_are_not_counted_in_fp8():
    """--first-last-layers-bf16 (1 and 1 of 4 layers) leaves layers 0 and 3 at the bf16
    peak: FP8 then saves exactly the time of the middle layers and the MTP layer, less
    than with every layer in FP8; their FP8 copies go too (break: ignore the config in
    fp8_time's in_fp8 -> the saving equals the all-layers one and this fails)."""
    model, hw = _model(), Hardware(gpus=8, gpu_memory_gb=80)
    lay = _layout("none")
    bf16 = step_time(model, lay, hw, 64, 32)["compute"]
    saved_all = bf16 - step_time(model, lay, hw, 64, 32, FP8)["compute"]
    saved_mid = bf16 - step_time(model, lay, hw, 64, 32, BF16_ENDS)["compute"]
    kept = _policy_weights_per_token(model, FP8) - _policy_weights_per_token(model, BF16_ENDS)
    assert kept > 0
    share_kept = 6 * kept / flops_per_token(model)
    per_flop_saving = bf16 * (1 - hw.peak_tflops / hw.peak_fp8_tflops)
    assert saved_all - saved_mid == pytest.approx(per_flop_saving * share_kept, rel=1e-9)
    with torch.device("meta"):
        gpt = GPTModel(model)
    run_all = layout_run(model, lay, 8, 32, FP8)
    run_mid = layout_run(model, lay, 8, 32, BF16_ENDS)
    assert 0 < fp8_copy_bytes(run_mid, gpt) < fp8_copy_bytes(run_all, gpt)


def test_gpu_without_fp8_says_one_line(capsys):
    """A GPU with no FP8 peak (A100) and FP8 on: the library raises one line, the tool
    exits 2 with it; without FP8 the same GPU plans (break: default a missing FP8 peak
    to the bf16 one -> no error, fails)."""
    model = _model()
    a100 = Hardware(gpus=8, gpu_memory_gb=80, peak_tflops=312.0, peak_fp8_tflops=None,
                    gpu="A100")
    step_time(model, _layout("none"), a100, 64, 32)  # bf16: fine
    with pytest.raises(ConfigError, match="A100 has no FP8 tensor cores"):
        step_time(model, _layout("none"), a100, 64, 32, FP8)
    from tools.plan_parallel import main
    with pytest.raises(SystemExit) as e:
        main(["--config", "configs/tiny.yaml", "--gpus", "1", "--gpu-memory-gb", "80",
              "--gpu", "A100", "--", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "A100 has no FP8" in err


def test_layout_search_and_dry_run_use_fp8(capsys):
    """The search ranks by the FP8 step time, shows the bf16 one next to it and counts the
    FP8 copies in each layout's activations (break: drop the copies from plan() -> the
    activations equal the bf16 plan's and this fails); --dry-run prints both times."""
    model = _model()
    hw = Hardware(gpus=2, gpu_memory_gb=80)
    kw = dict(seq_length=64, global_batch_size=8, top=100)
    bf16 = {json.dumps(r["layout"]): r for r in plan(model, hw, **kw)}
    fp8 = plan(model, hw, fp8=FP8, **kw)
    assert fp8 and len(fp8) == len(bf16)
    times = [r["step_time_s"]["total"] for r in fp8]
    assert times == sorted(times)
    with torch.device("meta"):
        gpt = GPTModel(model)
    for r in fp8:
        lay = Layout(**r["layout"])
        b = bf16[json.dumps(r["layout"])]
        assert r["step_time_bf16_s"] == b["step_time_s"]["total"] > r["step_time_s"]["total"]
        copies = fp8_copy_bytes(layout_run(model, lay, 2, 8, FP8), gpt) / 1e9
        assert r["memory_gb"]["activations"] == pytest.approx(
            b["memory_gb"]["activations"] + copies, rel=1e-12)
        assert "in FP8 (bf16 " in r["explanation"] and "step_time_bf16_s" not in b
    from megamoe.cli.arguments import config_file_to_argv, parse_args
    from megamoe.cli.mapping import run_config_from_args
    from megamoe.planning.dry_run import dry_run
    argv = config_file_to_argv(os.path.join(ROOT, "configs", "tiny.yaml")) + [
        "--dry-run", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
    run = run_config_from_args(parse_args(argv, world_size=1), 255)
    lines: list[str] = []
    report = dry_run(run, print_fn=lines.append)
    t = report["fp8"]["step_time_s"]
    assert t["fp8"] < t["bf16"] and t["gpu"] == "H100"
    assert any(line.strip().startswith("FP8 step time") and "(bf16 " in line for line in lines)


def test_calibration_table_fp8_peak_may_be_null(tmp_path):
    """The planner's GPU table in tools/planner_calibration.json has the FP8 column: H100's
    is the datasheet's dense 1979, and null (a GPU without FP8) is accepted; a bad value
    is refused in tests/tools/test_calibrate_planner.py."""
    from megamoe.planning.calibration_table import load_table
    path = os.path.join(ROOT, "tools", "planner_calibration.json")
    table = json.load(open(path, encoding="utf-8"))
    assert table["hardware"]["H100"]["peak_fp8_tflops"] == 1979.0
    table["hardware"]["H100"]["peak_fp8_tflops"] = None
    (tmp_path / "t.json").write_text(json.dumps(table))
    assert load_table(str(tmp_path / "t.json"))["hardware"]["H100"]["peak_fp8_tflops"] is None


def test_docs_hold_the_modelled_fp8_gain():
    """docs/planner-calibration.md#fp8 states the planner's FP8 / bf16 step-time ratio for
    the calibration row's layout: it is what the planner computes (rounded as printed)."""
    from tools import calibrate_planner as cal
    from tools.plan_parallel import load_model
    table = json.load(open(os.path.join(ROOT, "tools", "planner_calibration.json")))
    row = next(r for r in table["rows"] if r["id"] == "mz-235b-h100-tp2-pp8-vp4-ep32")
    model = load_model(os.path.join(ROOT, "configs", "qwen3-235b-a22b.yaml"), 151936,
                       row["seq_length"])
    hw = Hardware(row["gpus"], **table["hardware"]["H100"])
    lay = cal.row_layout(model, row)
    args = (model, lay, hw, row["seq_length"], row["global_batch_size"])
    bf16, fp8 = step_time(*args), step_time(*args, FP8)
    doc = open(os.path.join(ROOT, "docs", "planner-calibration.md"), encoding="utf-8").read()
    assert (f"models {bf16['total'] / fp8['total']:.2f}x in FP8 ({fp8['total']:.1f} s "
            f"against {bf16['total']:.1f} s") in doc.replace("\n", " ")
    assert f"falls {bf16['compute'] / fp8['compute']:.2f}x" in doc.replace("\n", " ")


def test_fp8_param_gather_plans_distributed_optimizer_layouts_with_fp8_weights():
    """--fp8-param-gather: only distributed-optimizer layouts (Megatron's rule), each with
    its FP8 weights at 1 byte per value and no FP8 weight copies in the activations
    (break: skip the weights' adjustment in plan() -> the weights equal the plain FP8
    plan's and this fails)."""
    from megamoe.planning.fp8_memory import fp8_primary_values

    model = _model()
    hw = Hardware(gpus=2, gpu_memory_gb=80)
    kw = dict(seq_length=64, global_batch_size=8, top=100)
    pg = Fp8Config(format="e4m3", recipe="tensorwise", param_gather=True)
    plain = {json.dumps(r["layout"]): r for r in plan(model, hw, fp8=FP8, **{**kw, "top": 1000})}
    held = plan(model, hw, fp8=pg, **kw)
    assert held and all(r["layout"]["distributed_optimizer"] for r in held)
    with torch.device("meta"):
        gpt = GPTModel(model)
    for r in held:
        lay = Layout(**r["layout"])
        p = plain[json.dumps(r["layout"])]
        values = fp8_primary_values(layout_run(model, lay, 2, 8, pg), gpt)
        assert values > 0
        assert r["memory_gb"]["weights"] == pytest.approx(
            p["memory_gb"]["weights"] - values / 1e9, rel=1e-12)
        assert r["memory_gb"]["activations"] < p["memory_gb"]["activations"]
