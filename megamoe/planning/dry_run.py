"""`pretrain_gpt.py --dry-run`: the model's size and the memory one rank of the launch's
own layout needs, from the memory model the planner uses (memory.py), without a process
group or data."""

from __future__ import annotations

import json
from typing import Callable

import torch

from megamoe.config import ConfigError, OptimizerConfig, RunConfig
from megamoe.model.flops import num_parameters
from megamoe.model.gpt_model import GPTModel
from megamoe.planning.activations import recompute_name
from megamoe.planning.fp8_memory import fp8_report
from megamoe.planning.memory import Layout, StateBytes, activation_bytes, model_bytes
from megamoe.planning.optimizer_memory import largest_stage_transients
from megamoe.planning.planner import Hardware, step_time


def launch_layout(run: RunConfig) -> Layout:
    """The memory model's Layout of a run's flags."""
    par, pp = run.parallel, run.parallel.pipeline_model_parallel_size
    ranges = par.layer_ranges(run.model.num_layers, run.model.num_mtp_layers)
    vpp = len(ranges[0])
    # decoder layers per virtual stage v = chunk x PP + rank; None when even
    split = tuple(end - start for c in range(vpp) for start, end in
                  (ranges[r][c] for r in range(pp)))
    return Layout(tp=par.tensor_model_parallel_size, pp=pp,
                  vpp=vpp, ep=par.expert_model_parallel_size, etp=par.etp,
                  dp=par.data_parallel_size, cp=par.context_parallel_size,
                  distributed_optimizer=par.use_distributed_optimizer,
                  recompute=recompute_name(run.recompute),
                  micro_batch_size=run.train.micro_batch_size,
                  split=None if len(set(split)) == 1 else split)


def state_bytes(optim: OptimizerConfig) -> StateBytes:
    """The memory model's bytes per main-gradient and moment element of a run's flags."""
    if not optim.use_precision_aware_optimizer:
        return StateBytes()
    size = {"fp32": 4, "bf16": 2, "fp16": 2}
    return StateBytes(size[optim.main_grads_dtype], size[optim.exp_avg_dtype],
                      size[optim.exp_avg_sq_dtype])


MAX_META_LAYERS = 1024  # 16x DeepSeek-V3's 61


def param_bytes(run: RunConfig) -> int:
    """Bytes per parameter value of the run's model dtype (fp16 sized as bf16)."""
    return 2 if run.optim.bf16 or run.optim.fp16 else 4


def per_rank_memory(run: RunConfig) -> tuple[dict, dict]:
    """(device bytes one rank of this layout needs, by part and "total"; the memory
    model's transients) for the largest pipeline stage, from shapes alone."""
    layout = launch_layout(run)
    bytes_per = param_bytes(run)
    states = state_bytes(run.optim)
    static = model_bytes(run.model, layout, bytes_per, states)
    memory = {k: int(static[k]) for k in ("weights", "gradients", "optimizer")}
    memory["activations"] = int(activation_bytes(run.model, layout, run.model.seq_length,
                                                 bytes_per))
    transient = largest_stage_transients(run.model, layout, bytes_per, states)
    memory["optimizer_step_transient"] = int(transient["step"])
    memory["checkpoint_save_transient"] = int(transient["save_device"])
    # Activations are freed before the optimizer steps and a checkpoint is saved.
    memory["total"] = sum(memory[k] for k in ("weights", "gradients", "optimizer")) + max(
        memory["activations"], memory["optimizer_step_transient"],
        memory["checkpoint_save_transient"])
    return memory, transient


def fp8_step_times(run: RunConfig) -> dict:
    """{"fp8", "bf16", "gpu"}: the planner's modelled seconds per global batch of this
    launch's layout with its FP8 flags and without, on the planner's default hardware
    (H100 SXM peaks, 8 GPUs a node: a dry run need not run on the GPU it sizes)."""
    hw = Hardware(gpus=run.parallel.world_size, gpu_memory_gb=80)
    layout, seq = launch_layout(run), run.model.seq_length
    gbs = run.train.global_batch_size
    return {"fp8": step_time(run.model, layout, hw, seq, gbs, run.fp8)["total"],
            "bf16": step_time(run.model, layout, hw, seq, gbs)["total"], "gpu": hw.gpu}


def _add_fp8_memory(memory: dict, fp8: dict, run: RunConfig) -> None:
    """The FP8 copies autograd keeps are activations: added to them and to the total.
    --fp8-param-gather: its weights take 1 byte per value, not the model dtype's; in an
    fp32 model they get an fp32 main slice (1/DP x CP of them; experts' 1/EDP taken as
    that: an upper bound)."""
    memory["activations"] += fp8["fp8_copy_bytes_per_rank"]
    held = fp8["fp8_primary_weight_values_per_rank"]
    bytes_per = param_bytes(run)
    memory["weights"] -= (bytes_per - 1) * held
    if bytes_per == 4:
        memory["optimizer"] += 4 * held // (run.parallel.data_parallel_size
                                            * run.parallel.context_parallel_size)
    memory["total"] = sum(memory[k] for k in ("weights", "gradients", "optimizer")) + max(
        memory["activations"], memory["optimizer_step_transient"],
        memory["checkpoint_save_transient"])


MEMORY_ROWS = (("weights", "weights"), ("gradients", "gradients"),
               ("optimizer", "optimizer states"), ("activations", "activations"),
               ("optimizer_step_transient", "optimizer step transient"),
               ("checkpoint_save_transient", "checkpoint save transient"),
               ("total", "total (static + largest of the last three)"))


def format_bytes(n: int) -> str:
    """GiB from 1 GiB up (2 decimals), MiB below (1 decimal), so a tiny model is not 0."""
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def format_seconds(t: float) -> str:
    """s from 1 s up, ms from 1 ms, us below (3 significant digits): a tiny model's step
    is microseconds."""
    if t >= 1:
        return f"{t:.3g} s"
    return f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} us"


def format_table(report: dict, run: RunConfig) -> list[str]:
    """The dry run's report as aligned text (what a person reads; --json for tools)."""
    layout = launch_layout(run)
    rows = [("parameters", f"{report['parameters']:,}"),
            ("active parameters per token", f"{report['active_parameters_per_token']:,}"),
            ("layout", f"TP{layout.tp} PP{layout.pp} VPP{layout.vpp} EP{layout.ep} "
                       f"ETP{layout.etp} DP{layout.dp} CP{layout.cp}, micro-batch "
                       f"{layout.micro_batch_size}, recompute {layout.recompute}, "
                       f"distributed optimizer {'on' if layout.distributed_optimizer else 'off'}"),
            *((f"per-rank {label}", format_bytes(report["per_rank_memory_bytes"][key]))
              for key, label in MEMORY_ROWS),
            ("per-rank checkpoint host copy",
             format_bytes(report["per_rank_checkpoint_host_bytes"]))]
    if "fp8" in report:
        f = report["fp8"]
        rows.append(("FP8", f"{f['format']} {f['recipe']}, {f['gemms']} GEMMs, amax "
                            f"histories {format_bytes(f['amax_history_bytes_per_rank'])}, "
                            f"FP8 copies {format_bytes(f['fp8_copy_bytes_per_rank'])} "
                            "(in activations)"))
        t = f["step_time_s"]
        rows.append(("FP8 step time", f"{format_seconds(t['fp8'])} (bf16 "
                                      f"{format_seconds(t['bf16'])}), modelled on {t['gpu']} "
                                      "SXM peaks (docs/planner-calibration.md)"))
    width = max(len(name) for name, _ in rows)
    return (["dry run: the model and one rank of this layout (largest pipeline stage)"]
            + [f"  {name:<{width}}  {value}" for name, value in rows])


def dry_run(run: RunConfig, print_fn: Callable[[str], None] = print,
            as_json: bool = False) -> dict:
    """Build the model's shapes on the meta device; report (a table, or with `as_json`
    (--json) one JSON line) its size and the
    memory one rank of this layout needs (the largest pipeline stage): static bytes plus
    the largest of the activations, the distributed optimizer's step transient and its
    checkpoint-save transient (device memory; the save's host copies apart).

    Past MAX_META_LAYERS layers the meta model is not built (its Python objects cost about
    a millisecond and some memory per layer, so an absurd --num-layers would hang here):
    "parameters" is then the formula's count, which equals the built model's for every
    model the tests build (tests/model/test_flops.py)."""
    total, active = num_parameters(run.model)
    if total >= 2**62:  # some weight would have more elements than a tensor can index
        raise ConfigError(f"the model's sizes give {total:.3g} parameters: more than a tensor "
                          f"can index (check --hidden-size, --ffn-hidden-size, --num-layers, "
                          f"--num-experts, --vocab-size)")
    actual, model = total, None
    if run.model.num_layers <= MAX_META_LAYERS:
        with torch.device("meta"):
            model = GPTModel(run.model)
        actual = sum(p.numel() for p in model.parameters())
    memory, transient = per_rank_memory(run)
    report = {"parameters": actual, "parameters_formula": total,
              "active_parameters_per_token": active, "per_rank_memory_bytes": memory,
              "per_rank_memory_gib": round(memory["total"] / 2**30, 3),
              "per_rank_checkpoint_host_bytes": int(transient["save_host"])}
    if run.fp8.enabled:  # amax histories and FP8 copies (planning/fp8_memory.py)
        report["fp8"] = fp8_report(run, model)
        _add_fp8_memory(memory, report["fp8"], run)
        report["fp8"]["step_time_s"] = fp8_step_times(run)
        report["per_rank_memory_gib"] = round(memory["total"] / 2**30, 3)
    if as_json:
        print_fn(json.dumps(report))
    else:
        for line in format_table(report, run):
            print_fn(line)
    return report
