"""The training loop: steps, evaluation, logging and checkpoint cadence.

Everything it needs is passed in (mesh, model, optimizer, scheduler, data, logger), so the
same loop serves pretrain_gpt.py and the tests.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megamoe.config import RunConfig
from megamoe.model.mtp import MTPLossTracker
from megamoe.moe.global_batch import update_expert_biases
from megamoe.moe.losses import MoELossTracker
from megamoe.parallel.mesh import Mesh
from megamoe.training.console import StepClock, console_fields, log_early, peak_memory
from megamoe.training.exits import ExitConditions
from megamoe.training.heatmap import heatmap_png_dir
from megamoe.training.host_read import read_all
from megamoe.training.loss import PerTokenLoss
from megamoe.training.manual_gc import ManualGC
from megamoe.training.memory_history import dump_memory_snapshot
from megamoe.training.metrics import (
    MetricsLogger,
    TrainingObserver,
    format_log_line,
    moe_layer_numbers,
)
from megamoe.training.nonfinite import NonFiniteCheck, Riders
from megamoe.training.profiling import Profiler
from megamoe.training.schedules import Batch, forward_backward
from megamoe.training.spiky_loss import LocalLosses, SpikyLossCheck
from megamoe.training.timers import Timers, format_timers, tensorboard_scalars
from megamoe.training.weight_hash import check_weight_hashes


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    history: list[dict] = field(default_factory=list)  # one entry per iteration (rank-local)
    exit_reason: Optional[str] = None  # why training stopped before --train-iters


def num_microbatches(run: RunConfig, mesh: Mesh, global_batch_size: Optional[int] = None) -> int:
    """Micro-batches per step for `global_batch_size` (default --global-batch-size: the
    size after any --rampup-batch-size, which evaluation always uses, as Megatron)."""
    gbs = global_batch_size or run.train.global_batch_size
    return gbs // (run.train.micro_batch_size * mesh.dp_size)


def per_token_loss(run: RunConfig, mesh: Mesh) -> Optional[PerTokenLoss]:
    """--calculate-per-token-loss over the group that averages dense gradients (dp x cp)."""
    if not run.train.calculate_per_token_loss:
        return None
    size = mesh.dp_size * mesh.cp_size
    group = None if size == 1 else mesh.group("dp_cp") if mesh.cp_size > 1 else mesh.dp_group
    return PerTokenLoss(group, size, run.model.num_mtp_layers)


def _dp_mean_on_device(values: list[torch.Tensor], mesh: Mesh) -> torch.Tensor:
    """Average logged scalars over data-parallel x context-parallel ranks (logging only,
    never gradients): the LM loss is already the whole sequence's on every cp rank, the
    MoE losses are per cp rank's tokens, and their mean over cp is the sequence's. Returns
    [len(values)] float64 on the mesh's device, not read back (host_read.py reads it)."""
    t = torch.stack([v.detach().reshape(()).to(device=mesh.device, dtype=torch.float64)
                     for v in values])
    group = mesh.group("dp_cp") if mesh.cp_size > 1 else mesh.dp_group
    if group is None:
        return t
    dist.all_reduce(t, group=group)
    return t / (mesh.dp_size * mesh.cp_size)


def _moe_scalars(report: dict[str, torch.Tensor],
                 layer_numbers: Optional[list[int]] = None) -> dict[str, torch.Tensor]:
    """Per-layer MoE loss values -> the mean over layers (console line), and with
    `layer_numbers` (--moe-per-layer-logging) also "name/layer_NN" per MoE layer; 0-d
    device tensors (read on logging iterations only: host_read.py)."""
    out = {name: v.float().mean() for name, v in report.items() if v.numel()}
    for name, v in report.items():
        if layer_numbers is not None and len(layer_numbers) == v.numel():
            out.update({f"{name}/layer_{i:02d}": x for i, x in zip(layer_numbers, v.unbind())})
    return out


def _nonfinite_check(run: RunConfig, mesh: Mesh, lm_loss: torch.Tensor,
                     iteration: int) -> Optional[NonFiniteCheck]:
    """--check-for-nan-in-loss-and-grad: this rank's loss (the last pipeline stage holds
    the loss; the schedule hands the other stages its all-reduced copy) and, through the
    optimizer, its local gradients (training/nonfinite.py)."""
    if not run.train.check_for_nan_in_loss_and_grad:
        return None
    own_loss = lm_loss if mesh.pp_rank == mesh.pp_size - 1 else None
    return NonFiniteCheck(iteration, mesh.rank, mesh.world_size, own_loss, mesh.device)


def train_step(run: RunConfig, mesh: Mesh, model: torch.nn.Module, optimizer, scheduler,
               data_iter: Iterator[Batch], iteration: int,
               global_batch_size: Optional[int] = None,
               timers: Optional[Timers] = None,
               spiky: Optional[SpikyLossCheck] = None, read: bool = True) -> dict:
    """One iteration (`iteration`: its number, for messages) of `global_batch_size` samples
    (default --global-batch-size). With the NaN/Inf check on, a non-finite loss or gradient
    on any rank raises NonFiniteError on every rank before the optimizer step: weights,
    optimizer state and the schedule stay as they were. Under loss scaling (--fp16) the
    backward is scaled by the optimizer's loss scale; an overflow skips the step
    ("skipped": 1; the iteration and its samples still count, as Megatron's).
    `spiky`: --check-for-spiky-loss, fed this rank's micro-batch losses. The losses stay
    device tensors with `read=False` (the training loop reads them on logging iterations
    only, host_read.py); by default they come back as floats, in one batched read."""
    model.train()
    optimizer.zero_grad()
    MoELossTracker.clear()  # losses a forward outside this step recorded are not its own
    MTPLossTracker.take()
    n_micro = num_microbatches(run, mesh, global_batch_size)
    timers = timers or Timers(0, mesh.device)
    with timers.timer("forward-backward", 1), \
            LocalLosses.recording(spiky is not None) as local_losses:
        lm_loss = forward_backward(model, data_iter, n_micro,
                                   grad_sync=getattr(optimizer, "grad_sync", None),
                                   per_token=per_token_loss(run, mesh),
                                   loss_scale=optimizer.get_loss_scale())
    fp8_state = getattr(model, "fp8_state", None)
    if fp8_state is not None:  # delayed scaling: reduce this step's amaxes, new scales
        fp8_state.update()
    empty_unused_memory(run, 1)
    check = _nonfinite_check(run, mesh, lm_loss, iteration)
    lg = run.logging
    # --check-for-spiky-loss: the micro-batch losses ride along the verdict's read
    riders = Riders(torch.stack(local_losses)) if spiky is not None and local_losses else None
    with timers.timer("optimizer", 1):
        success, grad_norm, num_zeros = optimizer.step(
            check, count_zeros=lg.log_num_zeros_in_grad, riders=riders)
    if spiky is not None:
        spiky.see_step(riders.values if riders is not None else [], iteration)
    update_expert_biases(model, mesh.group("tp_dp_cp"))  # aux-loss-free balancing, per step
    if success:  # as Megatron: the schedule advances by the samples of the step
        scheduler.step(increment=n_micro * run.train.micro_batch_size * mesh.dp_size)
    empty_unused_memory(run, 2)
    per_layer = run.model.moe is not None and run.moe_training.per_layer_logging
    moe = _moe_scalars(MoELossTracker.report(n_micro),
                       moe_layer_numbers(model) if per_layer else None)
    # {"mtp_1 loss": ...}, not part of the lm loss; per-token, each micro-batch recorded
    # its share of the step's per-token mean (model/mtp.py), so the shares add up
    mtp = MTPLossTracker.means(1 if run.train.calculate_per_token_loss else n_micro)
    names = ["lm loss", *mtp.keys(), *moe.keys()]
    values = _dp_mean_on_device([lm_loss, *mtp.values(), *moe.values()], mesh)
    out: dict = dict(zip(names, values.unbind()))
    if grad_norm is not None:  # None: a loss-scale overflow skipped the step before it
        out["grad norm"] = float(grad_norm)
    if num_zeros is not None:  # --log-num-zeros-in-grad (a device tensor, read when logged)
        out["num zeros"] = num_zeros.to(torch.float64)
    if lg.log_params_norm:  # after the update, as Megatron's calc_params_l2_norm
        out["params norm"] = optimizer.params_norm().to(torch.float64)
    out["skipped"] = 0.0 if success else 1.0
    if read:
        read_all([out])
    return out


def empty_unused_memory(run: RunConfig, level: int) -> None:
    """--empty-unused-memory-level: Megatron calls torch.cuda.empty_cache() after the
    forward-backward of each step and evaluation batch (level >= 1) and after each
    optimizer step (level >= 2). (A no-op without CUDA.)"""
    if run.train.empty_unused_memory_level >= level:
        torch.cuda.empty_cache()


def evaluate(run: RunConfig, mesh: Mesh, model: torch.nn.Module,
             data_iter: Iterator[Batch]) -> float:
    """Mean LM loss over --eval-iters global batches (dropout off, no gradients); with
    --calculate-per-token-loss the mean over all their unmasked tokens (as Megatron)."""
    model.eval()
    n_micro = num_microbatches(run, mesh)
    per_token = per_token_loss(run, mesh)
    total, weight = 0.0, 0.0
    for _ in range(run.train.eval_iters):
        loss = float(forward_backward(model, data_iter, n_micro, forward_only=True,
                                      per_token=per_token))
        w = 1.0 if per_token is None else float(per_token.num_tokens)  # same on every rank
        total, weight = total + loss * w, weight + w
        empty_unused_memory(run, 1)
    MoELossTracker.report(n_micro)  # evaluation does not feed the training statistics
    MTPLossTracker.take()
    model.train()
    mean = torch.tensor(total / max(weight, 1.0), dtype=torch.float64, device=mesh.device)
    return float(_dp_mean_on_device([mean], mesh)[0])


# Per-step metrics that are not losses (shown after the losses in the console line).
NOT_LOSSES = ("grad norm", "num zeros", "params norm")


class _Interval:
    """The metrics of the iterations since the last console line (--log-interval), and
    that line (with the console's fields: training/console.py). As Megatron's
    training_log, the losses (and here the grad norm) average over the iterations that
    updated the model: a skipped step's (an fp16 overflow) would pull the mean toward a loss
    no update followed."""

    def __init__(self, run: RunConfig, mesh: Mesh, observer: TrainingObserver,
                 print_fn: Callable[[str], None]) -> None:
        self.run, self.mesh, self.observer, self.print_fn = run, mesh, observer, print_fn
        self.timers = Timers(run.logging.timing_log_level, mesh.device)
        self.clock = StepClock()
        self.png_dir = heatmap_png_dir(run.checkpoint.save, run.logging.tensorboard_dir)
        self.sums: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.iters, self.samples, self.batch_size, self.tick = 0, 0, 0, time.time()
        self.advanced = 0  # iterations that updated the model
        self.pending: list[dict] = []  # history entries not read to the host yet
        self.nan_losses: list = []  # the lm loss of each skipped step not read yet

    def read(self, state: TrainState, heatmap: bool) -> None:
        """A logging iteration's one batched host read (host_read.py): every step's logged
        values since the last read (their history entries, the interval's sums, the last
        step's), the LM losses of skipped steps (Megatron's nan-iteration count: a skipped
        step whose loss is NaN/Inf) and, with `heatmap`, the interval's expert-load
        counts."""
        nan = dict(enumerate(self.nan_losses))
        containers = [*self.pending, self.sums, self.last, nan]
        if heatmap:
            containers.append(self.observer._routed_LE)
        read_all(containers)
        state.nan_iters += sum(not math.isfinite(v) for v in nan.values())
        self.pending, self.nan_losses = [], []

    def add(self, metrics: dict[str, float], global_batch_size: int, skipped: bool) -> None:
        self.clock.step_done()
        for k, v in metrics.items():
            if skipped and _advanced_only(k):
                continue
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.last = metrics
        self.iters += 1
        self.advanced += not skipped
        self.samples += global_batch_size
        self.batch_size = global_batch_size  # the last step's, as Megatron's log line

    def report(self, state: TrainState, optimizer, logger: Optional[MetricsLogger]) -> None:
        """Console line (logging rank), throughput/MFU/memory scalars and the expert-load
        heatmap (logger: TensorBoard or W&B; the same image as a PNG under --save, else
        --tensorboard-dir); then a new interval starts."""
        run, mesh = self.run, self.mesh
        ms_per_iter = 1000.0 * (time.time() - self.tick) / self.iters
        tokens_per_iter = self.samples * run.model.seq_length / self.iters
        means = {k: v / (max(1, self.advanced) if _advanced_only(k) else self.iters)
                 for k, v in self.sums.items()}
        extra = {}
        if mesh.is_logging_rank:
            extra = self.observer.interval_scalars(ms_per_iter, tokens_per_iter)
            self.print_fn(self._line(state, optimizer, ms_per_iter, tokens_per_iter, means,
                                     extra))
        self._report_timers(state.iteration, ms_per_iter, logger)
        if logger is not None:  # (the logging rank's): scalars, the heatmap and its PNG
            logger.log_scalars(extra, state.iteration)
            self.observer.write_heatmap(logger, state.iteration, self.png_dir)
        self.sums, self.iters, self.samples, self.tick = {}, 0, 0, time.time()
        self.advanced = 0

    def report_early(self, state: TrainState, optimizer, step_ms: float) -> None:
        """The line of one of the first iterations (--log-first-iterations): that step's
        own values; the interval's sums go on to the --log-interval line."""
        if self.mesh.is_logging_rank:
            tokens = self.batch_size * self.run.model.seq_length
            extra = self.observer.interval_scalars(step_ms, tokens)
            self.print_fn(self._line(state, optimizer, step_ms, tokens, self.last, extra))

    def _line(self, state: TrainState, optimizer, ms_per_iter: float, tokens_per_iter: float,
              values: dict[str, float], extra: dict[str, float]) -> str:
        """Megatron's line of `values` (means or one step's), then the console's fields."""
        run, lg = self.run, self.run.logging
        tflops = extra["throughput_tflops_per_gpu"]
        extras = console_fields(
            eta_s=self.clock.eta_s(run.train.train_iters - state.iteration),
            memory=peak_memory(self.observer.device),
            tflops_per_gpu=None if lg.log_throughput else tflops, mfu=extra.get("mfu"))
        return format_log_line(
            iteration=state.iteration, train_iters=run.train.train_iters,
            consumed_samples=state.consumed_train_samples, elapsed_ms_per_iter=ms_per_iter,
            tokens_per_sec=tokens_per_iter / (ms_per_iter / 1000.0),
            learning_rate=state.history[-1]["lr"], global_batch_size=self.batch_size,
            losses={k: v for k, v in values.items() if k not in NOT_LOSSES and "/" not in k},
            loss_scale=optimizer.get_loss_scale(), grad_norm=values.get("grad norm"),
            skipped_iters=state.skipped_iters, nan_iters=state.nan_iters,
            tflops_per_gpu=tflops if lg.log_throughput else None,
            num_zeros=int(self.last["num zeros"]) if "num zeros" in self.last else None,
            params_norm=self.last.get("params norm"),  # (this iteration's, as Megatron)
            extras=extras)

    def _report_timers(self, iteration: int, ms_per_iter: float,
                       logger: Optional[MetricsLogger]) -> None:
        """Megatron's timers block (level 1, every rank takes part in the reduction) and,
        with --log-timers-to-tensorboard, their scalars (logging rank)."""
        mesh = self.mesh
        times = self.timers.per_rank(self.iters, distributed=mesh.world_size > 1
                                     and dist.is_initialized())
        if times and mesh.is_logging_rank:
            self.print_fn(format_timers(times, self.run.logging.timing_log_option))
        if logger is not None and self.run.logging.log_timers_to_tensorboard:
            logger.log_scalars(tensorboard_scalars(times, ms_per_iter / 1000.0), iteration)


def _advanced_only(key: str) -> bool:
    """Whether the interval averages metric `key` over its updating iterations only."""
    return key == "grad norm" or key not in NOT_LOSSES and not key.startswith("moe/")


def _record(state: TrainState, metrics: dict, global_batch_size: int, lr: float,
            interval: _Interval) -> bool:
    """Count the iteration (a skipped one too: its samples were read, as Megatron's);
    a nan iteration is a skipped one whose loss is NaN/Inf (Megatron's training_log),
    counted when the interval reads the loss. Returns whether the step was skipped (the
    optimizer's verdict, already on the host)."""
    state.iteration += 1
    state.consumed_train_samples += global_batch_size
    skipped = bool(metrics.pop("skipped"))
    state.skipped_iters += skipped
    if skipped:
        interval.nan_losses.append(metrics["lm loss"])
    state.history.append({"iteration": state.iteration, "lr": lr, **metrics})
    interval.pending.append(state.history[-1])
    return skipped


def train(run: RunConfig, mesh: Mesh, model: torch.nn.Module, optimizer, scheduler,
          train_iter: Iterator[Batch], valid_iter: Optional[Iterator[Batch]],
          logger: Optional[MetricsLogger], state: TrainState,
          save_fn: Optional[Callable[[TrainState], None]] = None,
          print_fn: Callable[[str], None] = print,
          exits: Optional[ExitConditions] = None) -> TrainState:
    """Train from state.iteration to --train-iters (with --train-samples: the iterations
    that consume them), or until `exits` (--exit-interval, --exit-duration-in-mins,
    --exit-signal-handler) stops it after a step, which it records in state.exit_reason;
    returns the final state. Each step's global batch size follows the samples consumed
    (--rampup-batch-size); as in Megatron, a checkpoint is saved before it changes."""
    t = run.train
    exits = exits or ExitConditions(t, mesh, time.time())
    observer = TrainingObserver(run, model, mesh.dp_group, mesh.world_size)
    interval = _Interval(run, mesh, observer, print_fn)
    batch_size, saved_at = t.global_batch_size_at(state.consumed_train_samples), state.iteration
    check_replicas(run, mesh, model, optimizer, state.iteration, print_fn, at_start=True)
    with ManualGC(t) as collector, Profiler(run.logging, mesh.rank) as profiler:
        _train_loop(run, mesh, model, optimizer, scheduler, train_iter, valid_iter, logger,
                    state, save_fn, print_fn, exits, observer, interval,
                    (collector, profiler), batch_size, saved_at)
    interval.read(state, heatmap=False)  # the steps since the last logging iteration
    optimizer.wait_param_gather()  # whatever runs next reads the trained parameters
    return state


def check_replicas(run: RunConfig, mesh: Mesh, model, optimizer, iteration: int,
                   print_fn: Callable[[str], None], at_start: bool = False) -> None:
    """--check-weight-hash-across-dp-replicas-interval: at the start of training and after
    every N-th iteration (Megatron's train and post-step), the parameters' hashes are
    compared over the data-parallel replicas (training/weight_hash.py)."""
    interval = run.train.check_weight_hash_across_dp_replicas_interval
    if interval is None or not (at_start or iteration % interval == 0):
        return
    optimizer.wait_param_gather()  # (--overlap-param-gather) the parameters up to date
    if check_weight_hashes(model, mesh, iteration) and mesh.is_logging_rank:
        print_fn(f">>> Weight hashes match after {iteration} iterations...")


def _train_loop(run: RunConfig, mesh: Mesh, model, optimizer, scheduler, train_iter,
                valid_iter, logger, state: TrainState, save_fn, print_fn, exits,
                observer: TrainingObserver, interval: _Interval,
                hooks: tuple[ManualGC, Profiler], batch_size: int, saved_at: int) -> None:
    t, lg, save_interval = run.train, run.logging, run.checkpoint.save_interval
    collector, profiler = hooks
    spiky = SpikyLossCheck(mesh.rank, mesh.device) if t.check_for_spiky_loss else None
    while state.iteration < t.train_iters:
        gbs = t.global_batch_size_at(state.consumed_train_samples)
        if gbs != batch_size and save_fn is not None and saved_at != state.iteration:
            optimizer.wait_param_gather()
            save_fn(state)
        batch_size = gbs
        step_start = time.time()
        profiler.before_step(state.iteration)
        metrics = train_step(run, mesh, model, optimizer, scheduler, train_iter,
                             state.iteration + 1, gbs, interval.timers, spiky, read=False)
        step_ms = 1000.0 * (time.time() - step_start)
        first_step = interval.clock.steps == 0
        if first_step and mesh.is_logging_rank:  # a startup stage
            print_fn(f"> first step done: iteration {state.iteration + 1} took "
                     f"{step_ms / 1000.0:.1f} s")
            if t.compile and not state.history:  # compile time apart
                print_fn(f"> --compile: the first iteration took {step_ms / 1000.0:.1f} s "
                         f"(it compiles the layers; later iterations run the compiled code)")
        metrics.update(observer.after_step())  # expert load, summed over data parallel
        lr = scheduler.last_lr  # the run's --lr schedule (not a --decoupled-lr group's)
        skipped = _record(state, metrics, gbs, lr, interval)
        interval.add(metrics, gbs, skipped)
        console = state.iteration % lg.log_interval == 0
        early = not console and log_early(interval.clock.steps, state.iteration,
                                          lg.log_first_iterations, lg.log_interval)
        to_logger = logger is not None and state.iteration % lg.tensorboard_log_interval == 0
        if console or early or to_logger:  # a logging iteration: its one batched read
            interval.read(state, heatmap=console and logger is not None)
        if to_logger:
            logger.log_scalars({**{k.replace(" ", "_"): v for k, v in metrics.items()},
                                "learning_rate": lr, "loss-scale": optimizer.get_loss_scale(),
                                "consumed_samples": state.consumed_train_samples,
                                "global_batch_size": gbs}, state.iteration)
        collector.after_step(state.iteration)
        profiler.after_step(state.iteration)
        dump_memory_snapshot(lg, mesh.rank, state.iteration, first_step)
        if console:
            interval.report(state, optimizer, logger)
        elif early:
            interval.report_early(state, optimizer, step_ms)
        check_replicas(run, mesh, model, optimizer, state.iteration, print_fn)
        if valid_iter is not None and t.eval_iters > 0 and t.eval_interval \
                and state.iteration % t.eval_interval == 0:
            optimizer.wait_param_gather()  # (--overlap-param-gather) parameters up to date
            collector.before_eval()
            loss = evaluate(run, mesh, model, valid_iter)
            collector.after_eval()
            report_validation(state.iteration, loss, logger, mesh, print_fn)
            state.history[-1]["valid lm loss"] = loss
        if save_fn is not None and save_interval and state.iteration % save_interval == 0:
            optimizer.wait_param_gather()
            save_fn(state)
            saved_at = state.iteration
        state.exit_reason = exits.reason(state.iteration)
        if state.exit_reason is not None:
            break


def report_validation(iteration: int, loss: float, logger: Optional[MetricsLogger],
                      mesh: Mesh, print_fn: Callable[[str], None] = print,
                      split: str = "validation") -> None:
    ppl = math.exp(min(20.0, loss))
    if mesh.is_logging_rank:
        line = (f" {split} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {ppl:.6E} |")
        print_fn("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    if logger is not None:
        prefix = "valid" if split == "validation" else split
        logger.log_scalars({f"{prefix}_lm_loss": loss, f"{prefix}_lm_loss_ppl": ppl}, iteration)
