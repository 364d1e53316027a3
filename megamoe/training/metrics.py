"""Console line, TensorBoard and Weights & Biases, and what the dashboards show for MoE.

The console line follows Megatron-LM's format so existing log parsers keep working.
TensorBoard and W&B are optional: each is used only when asked for, and W&B runs offline
when no API key is configured (no network needed). `TrainingObserver` turns one training
step into scalars: per-layer expert load (max/mean, coefficient of variation, dropped
fraction, summed over data-parallel ranks), MFU against --peak-tflops (or a measured
matmul peak), memory, and an expert-load heatmap (MoE layers x experts, share of routed
tokens; drawn by heatmap.py) per --log-interval, because a heatmap shows a collapsing
router faster than a table.
"""

from __future__ import annotations

import os
import resource
import time
import warnings
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megamoe.config import RunConfig
from megamoe.model.flops import flops_per_token
from megamoe.moe.dispatchers import PARALLEL_MODES
from megamoe.moe.stats import mode_counts, routing_counts
from megamoe.training.heatmap import expert_load_heatmap, routed_shares, write_png
from megamoe.training.host_read import read_all
from megamoe.training.log_targets import wandb_dir

_WARNED: set[str] = set()  # optional features already reported missing in this process


def format_log_line(*, iteration: int, train_iters: int, consumed_samples: int,
                    elapsed_ms_per_iter: float, tokens_per_sec: float, learning_rate: float,
                    global_batch_size: int, losses: dict[str, float], loss_scale: float,
                    grad_norm: Optional[float], skipped_iters: int, nan_iters: int,
                    tflops_per_gpu: Optional[float] = None, num_zeros: Optional[int] = None,
                    params_norm: Optional[float] = None, extras: Sequence[str] = ()) -> str:
    """Megatron's iteration line; "grad norm" (None: no step of the interval updated),
    "num zeros" (--log-num-zeros-in-grad) and "params norm" (--log-params-norm) only when
    given, after the grad norm, as Megatron prints them; `extras` (the console's ETA,
    memory, MFU: training/console.py) after all of Megatron's fields, so its fields keep
    their order."""
    parts = [
        f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms_per_iter:.1f}",
        *([f"throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f}"]
          if tflops_per_gpu is not None else []),
        f"throughput (tokens/s): {tokens_per_sec:.1f}",
        f"learning rate: {learning_rate:.6E}",
        f"global batch size: {global_batch_size:5d}",
        *(f"{name}: {value:.6E}" for name, value in losses.items()),
        f"loss scale: {loss_scale:.1f}",
        *([f"grad norm: {grad_norm:.3f}"] if grad_norm is not None else []),
        *([f"num zeros: {num_zeros}"] if num_zeros is not None else []),
        *([f"params norm: {params_norm:.3f}"] if params_norm is not None else []),
        f"number of skipped iterations: {skipped_iters:3d}",
        f"number of nan iterations: {nan_iters:3d}",
        *extras,
    ]
    return " | ".join(parts) + " |"


class MetricsLogger:
    """Scalars and images to TensorBoard (--tensorboard-dir) and/or W&B (--wandb-project)."""

    def __init__(self, tensorboard_dir: Optional[str], wandb_project: Optional[str],
                 wandb_exp_name: Optional[str], wandb_save_dir: Optional[str],
                 config_dict: Optional[dict] = None, wandb_entity: Optional[str] = None) -> None:
        self.tb = None
        self.wandb = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        if wandb_project:
            import wandb

            if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
                os.environ["WANDB_MODE"] = "offline"
            save_dir = wandb_dir(wandb_save_dir, tensorboard_dir)
            os.makedirs(save_dir, exist_ok=True)
            entity = {"entity": wandb_entity} if wandb_entity else {}  # (as Megatron)
            self.wandb = wandb.init(project=wandb_project, name=wandb_exp_name, dir=save_dir,
                                    config=config_dict or {}, **entity)

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_image(self, name: str, image_HW3: np.ndarray, step: int) -> None:
        """An RGB uint8 image [H, W, 3]."""
        if self.tb is not None:
            self.tb.add_image(name, image_HW3, step, dataformats="HWC")
        if self.wandb is not None:
            import wandb

            self.wandb.log({name: wandb.Image(image_HW3)}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# ---------------------------------------------------------------------------- expert load
def reduced_routing_stats(model: torch.nn.Module, group: Optional[dist.ProcessGroup],
                          device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: kept [E], routed [E] assignment counts} of this step, summed over `group`
    (the data-parallel ranks see different tokens; the sum runs on `device`, the mesh's),
    as float64 device tensors: nothing is read back here (host_read.py reads them with the
    rest on a logging iteration). Resets the layers' counters. Every rank of `group` must
    call it (it is a collective)."""
    layers, both_L2E = routing_counts(model, reset=True)
    if both_L2E is None:
        return {}
    both_L2E = both_L2E.to(device)
    if group is not None:
        dist.all_reduce(both_L2E, group=group)
    return {layer: {"kept": both_L2E[j, 0], "routed": both_L2E[j, 1]}
            for j, layer in enumerate(layers)}


def _tensor(counts) -> torch.Tensor:
    """Counts as a tensor where they are (the device's); host values (lists, arrays from a
    log) stay on the host."""
    if isinstance(counts, torch.Tensor):
        return counts
    # host metadata: counts read back from a log, reduced on the host and never collected
    return torch.as_tensor(counts, device="cpu")


def expert_load_scalars(stats: dict[int, dict], per_layer: bool) -> dict[str, torch.Tensor]:
    """max/mean load (1 = balanced), coefficient of variation (population std / mean) of
    the per-expert token counts and dropped fraction of routed assignments, as 0-d float64
    tensors on the counts' device: the mean over the layers that routed tokens, and per
    layer when --moe-per-layer-logging. Computed on the device, without a host read."""
    out: dict[str, torch.Tensor] = {}
    rows = []
    for layer, s in sorted(stats.items()):
        kept, routed = (_tensor(s[k]).to(torch.float64) for k in ("kept", "routed"))
        mean, routed_sum = kept.mean(), routed.sum()
        safe_mean = torch.where(mean > 0, mean, torch.ones_like(mean))
        safe_routed = torch.where(routed_sum > 0, routed_sum, torch.ones_like(routed_sum))
        zero = torch.zeros_like(mean)
        std = (kept - mean).square().mean().sqrt()  # numpy's std (ddof=0)
        row = {
            "max_over_mean_load": torch.where(mean > 0, kept.max() / safe_mean, zero),
            "load_cv": torch.where(mean > 0, std / safe_mean, zero),
            "dropped_fraction": torch.where(routed_sum > 0,
                                            1.0 - kept.sum() / safe_routed, zero),
        }
        rows.append((row, (routed_sum > 0).to(torch.float64)))
        if per_layer:
            out.update({f"moe/layer_{layer:02d}/{k}": v for k, v in row.items()})
    if rows:
        routed_L = torch.stack([present for _, present in rows])
        count = routed_L.sum().clamp(min=1.0)
        for key in ("max_over_mean_load", "load_cv", "dropped_fraction"):
            out[f"moe/{key}"] = (torch.stack([r[key] for r, _ in rows]) * routed_L).sum() / count
    return out


# ------------------------------------------------------------------------- MFU and memory
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) of the GPUs MFU is usually quoted
# for, by the name torch.cuda.get_device_name() reports; the first match wins.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
    ("GH200", 989.0), ("B200", 2250.0), ("GB200", 2500.0), ("A100", 312.0),
    ("A800", 312.0), ("H800", 989.0), ("L40S", 362.0),
)


def peak_tflops(device: torch.device, given: Optional[float]) -> Optional[float]:
    """The peak MFU is quoted against: --peak-tflops, else the bf16 dense peak of a known
    GPU (PEAK_BF16_TFLOPS), else None (no MFU: a CPU or an unknown GPU has no meaningful
    datasheet peak, and a measured matmul is not one)."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def memory_scalars(device: torch.device) -> dict[str, float]:
    """Peak CUDA allocation on GPU; resident set size of this process on CPU (GiB)."""
    if device.type == "cuda":
        return {"memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "memory/allocated_gib": torch.cuda.memory_allocated(device) / 2**30}
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return {"memory/rss_gib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30}
    except OSError:
        return {"memory/rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class TrainingObserver:
    """Per-step and per-interval observability scalars for the training loop.

    `after_step` is a collective over the data-parallel group (every rank calls it);
    `interval_scalars` and `write_heatmap` only compute on the rank that logs.
    """

    def __init__(self, run: RunConfig, model: torch.nn.Module,
                 dp_group: Optional[dist.ProcessGroup], world_size: int) -> None:
        self.run = run
        self.model = model
        self.dp_group = dp_group
        self.world_size = world_size
        self.per_layer = bool(run.model.moe and run.moe_training.per_layer_logging)
        self.flops_per_token = flops_per_token(run.model)
        self.device = next(model.parameters()).device
        self.peak_tflops = peak_tflops(self.device, run.logging.peak_tflops)
        # {layer: routed assignments [E]} of the interval: device tensors until the logging
        # iteration's batched read (host_read.py) makes them numpy arrays
        self._routed_LE: dict[int, Any] = {}

    def after_step(self) -> dict[str, Any]:
        stats = reduced_routing_stats(self.model, self.dp_group, self.device)
        for layer, s in stats.items():
            self._routed_LE[layer] = self._routed_LE.get(layer, 0.0) + s["routed"]
        out = expert_load_scalars(stats, self.per_layer)
        if self.run.model.moe is not None and self.run.moe_execution.adaptive_parallelism:
            counts = mode_counts(self.model)  # MoE layer calls this step, per mode
            out.update({f"moe_mode/{m}_calls": float(counts[m]) for m in PARALLEL_MODES})
        return out

    def interval_scalars(self, ms_per_iter: float, tokens_per_iter: int) -> dict[str, float]:
        tokens_per_sec = tokens_per_iter / (ms_per_iter / 1000.0)
        tflops = self.flops_per_token * tokens_per_sec / self.world_size / 1e12
        out = {"iteration_time_ms": ms_per_iter, "throughput_tokens_per_sec": tokens_per_sec,
               "throughput_tflops_per_gpu": tflops, **memory_scalars(self.device)}
        if self.peak_tflops is not None:  # MFU only against a known peak
            out.update(mfu=tflops / self.peak_tflops, peak_tflops=self.peak_tflops)
        return out

    def write_heatmap(self, logger: Optional[MetricsLogger], step: int,
                      png_dir: Optional[str] = None) -> Optional[np.ndarray]:
        """Each expert's share of its layer's routed assignments over the interval
        [MoE layers, experts] (see heatmap.routed_shares), drawn to `logger` as the
        labelled heatmap, its rows labelled with the layers' own numbers (the keys of the
        routing statistics, as in moe_layer_numbers); None when no MoE layer routed
        anything. The router's choice
        (before capacity), not the kept assignments: those are clipped at the capacity, so
        an overloaded expert would look capped exactly where it matters (dropless: equal).
        With `png_dir`, the same image is also written there as iter_NNNNNNN.png.
        Without matplotlib the image is skipped, with one warning per process."""
        if not self._routed_LE:
            return None
        read_all([self._routed_LE])  # (a no-op when the loop's batched read made it host)
        layers = sorted(self._routed_LE)
        share_LE = routed_shares(np.stack([self._routed_LE[i] for i in layers]))
        self._routed_LE = {}
        if (logger is not None or png_dir is not None) and "matplotlib" not in _WARNED:
            try:
                img = expert_load_heatmap(share_LE, layers, step)
            except ImportError as e:  # matplotlib is optional, like the logging itself
                _WARNED.add("matplotlib")
                warnings.warn(f"expert-load heatmap not logged: {e} (pip install matplotlib)",
                              stacklevel=2)
            else:
                if logger is not None:
                    logger.log_image("moe/expert_load_heatmap", img, step)
                if png_dir is not None:
                    self._write_png(img, png_dir, step)
        return share_LE

    @staticmethod
    def _write_png(img: np.ndarray, png_dir: str, step: int) -> None:
        """The PNG copy of the heatmap; a disk that refuses it (full, read-only) costs the
        picture, with one warning per process, not the run: the checkpoint save reports
        its own failure where it matters."""
        try:
            write_png(img, png_dir, step)
        except OSError as e:
            if "png" not in _WARNED:
                _WARNED.add("png")
                warnings.warn(f"expert-load heatmap PNG not written to {png_dir}: "
                              f"{e.strerror or e}", stacklevel=3)


def moe_layer_numbers(model: torch.nn.Module) -> list[int]:
    """Layer numbers of the model's MoE layers (those keeping a `tokens_per_expert` buffer),
    in order: the names of per-layer scalars."""
    return sorted(m.layer_number for m in model.modules()
                  if hasattr(m, "tokens_per_expert") and hasattr(m, "layer_number"))
