#!/usr/bin/env python
"""Parallel-layout planner: which (TP, PP, VPP, EP, ETP, DP, CP, distributed optimizer,
recompute, micro batch) fits a model on N GPUs, and how fast it should run.

    python tools/plan_parallel.py --config configs/mixtral-8x7b.yaml --gpus 64 \
        --gpu-memory-gb 80 [--gpus-per-node 8 --intra-node-gbps 450 --inter-node-gbps 50
        --gpu H100 --peak-tflops 989 --peak-fp8-tflops 1979 --gemm-efficiency 0.64
        --comm-efficiency 1.0 --global-batch-size 256 --json] [-- --fp8-format e4m3 ...]

Flags after `--` are pretrain_gpt.py flags added to the preset's (FP8's: --fp8-format,
--fp8-recipe, --first-last-layers-bf16, ...): with FP8 on, the GEMMs it converts count at
the GPU's FP8 peak and each layout also shows its bf16 step time
(megamoe/planning/fp8_time.py).

Times and TFLOP/s are modelled, not measured: the efficiency constants are fitted to
published Megatron-Core H100 runs (docs/planner-calibration.md; held-out error there).

Memory per GPU = weights + gradients + optimizer states + activations of the micro-batches
in flight (1F1B keeps PP of them on the first stage) including the MoE dispatch buffers.
The static part follows megamoe's actual layout (stage_parameters / stage_bytes), checked
tensor by tensor against runs of configs/tiny.yaml under DP, ZeRO-1, TP+SP, PP, EP and
combinations (tests/tools/test_plan_parallel.py: exact to the byte): shared experts are
split over TP like the dense MLP; norms, routers, row-parallel biases and the shared-expert
gate are replicated over TP; routed experts are split
over EP and their matrices over ETP; a tied embedding has a copy on the last stage; fp32
gradients are full size on every rank; the distributed optimizer keeps two fp32 Adam
moments per owned element (8 bytes; a bf16 model adds its fp32 main slice: 12) over DP for
dense and expert-DP for expert parameters (the fp32 main and reduced-gradient slices are
views of the parameter and gradient buffers), and the step's and a checkpoint save's
transients count too (megamoe/planning/optimizer_memory.py). Activations are checked
against autograd's saved tensors of one tiny fp32 forward (within 25%; measured -16%).
Step time = GEMM FLOPs at peak x efficiency + TP/SP collectives + EP all-to-all, stretched
by the pipeline bubble, + the gradient all-reduce and pipeline p2p. Link speeds are GB/s
per GPU; a group stays on NVLink when it fits in one node. Layouts the argument rules
would reject are never generated (divisibility of heads, query groups, layers, experts,
world size and global batch).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megamoe.cli.arguments import OneLineArgumentParser, config_file_to_argv, parse_args  # noqa: E402
from megamoe.cli.mapping import run_config_from_args  # noqa: E402
from megamoe.config import ModelConfig, RunConfig  # noqa: E402
from megamoe.planning.gpu_peaks import GPU_PEAKS, no_fp8_message  # noqa: E402
from megamoe.planning.memory import (  # noqa: E402
    Layout,
    activation_bytes,
    model_bytes,
    stage_bytes,
    stage_parameters,
)
from megamoe.planning.planner import Hardware, layout_flags, legal_layouts, plan  # noqa: E402

__all__ = ["Hardware", "Layout", "activation_bytes", "layout_flags", "legal_layouts",
           "model_bytes", "plan", "stage_bytes", "stage_parameters"]


def load_model(config_path: str, vocab_size: int, seq_length: int | None) -> ModelConfig:
    return load_run(config_path, vocab_size, seq_length).model


def load_run(config_path: str, vocab_size: int, seq_length: int | None,
             extra: list[str] | None = None) -> RunConfig:
    """The preset's run config, with `extra` pretrain_gpt.py flags after its own."""
    argv = config_file_to_argv(config_path) + list(extra or []) + ["--dry-run"]
    if seq_length:
        argv += ["--seq-length", str(seq_length)]
    # The planner chooses the layout: drop flags the rules would reject only because the
    # feature is not built yet, so a preset can be planned before megamoe can run it.
    args = parse_args(argv, world_size=1, prog="plan_parallel.py")
    return run_config_from_args(args, vocab_size)


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(prog="plan_parallel.py", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a preset, e.g. configs/mixtral-8x7b.yaml")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-memory-gb", type=float, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU")
    p.add_argument("--gpu", choices=sorted(GPU_PEAKS), default="H100",
                   help="the GPU whose dense bf16 and FP8 peaks the step time uses "
                   "(megamoe/planning/gpu_peaks.py)")
    p.add_argument("--peak-tflops", type=float, default=None, help="default: --gpu's bf16")
    p.add_argument("--peak-fp8-tflops", type=float, default=None,
                   help="default: --gpu's FP8 peak (none on a GPU without FP8 tensor cores)")
    p.add_argument("--gemm-efficiency", type=float, default=Hardware.gemm_efficiency,
                   help="fraction of peak GEMMs reach (default: fitted to published H100 "
                   "runs, docs/planner-calibration.md)")
    p.add_argument("--comm-efficiency", type=float, default=Hardware.comm_efficiency,
                   help="fraction of link bandwidth collectives reach (default: fitted)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("run_flags", nargs="*", metavar="-- PRETRAIN_FLAGS",
                   help="pretrain_gpt.py flags added to the preset's (e.g. --fp8-format e4m3)")
    a = p.parse_args(argv)
    for name in ("gpus", "gpu_memory_gb", "gpus_per_node", "global_batch_size", "top"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("peak_tflops", "peak_fp8_tflops"):
        if getattr(a, name) is not None and not getattr(a, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("gemm_efficiency", "comm_efficiency"):
        if not 0 < getattr(a, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in (0, 1]")
    if not os.path.isfile(a.config):
        p.error(f"--config: file not found: {a.config}")
    run = load_run(a.config, a.vocab_size, a.seq_length, a.run_flags)
    model, peaks = run.model, GPU_PEAKS[a.gpu]
    hw = Hardware(a.gpus, a.gpu_memory_gb, a.gpus_per_node, a.intra_node_gbps,
                  a.inter_node_gbps, a.peak_tflops or peaks.bf16_tflops, a.gemm_efficiency,
                  a.comm_efficiency, a.peak_fp8_tflops or peaks.fp8_tflops, a.gpu)
    if run.fp8.enabled and hw.peak_fp8_tflops is None:
        p.error(no_fp8_message(a.gpu))
    results = plan(model, hw, model.seq_length, a.global_batch_size, a.top, fp8=run.fp8)
    if a.json:
        print(json.dumps({"config": a.config, "gpus": a.gpus, "layouts": results}, indent=1))
    elif not results:
        print(f"no layout fits {a.gpus} x {a.gpu_memory_gb:.0f} GB")
    else:
        for i, r in enumerate(results, 1):
            print(f"{i}. {r['explanation']}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
