"""A pretraining run of a RunConfig: mesh -> model -> optimizer -> checkpoint -> data ->
train loop -> final evaluation. (The command line, megamoe/cli, turns flags into the
RunConfig and the tokenizer; nothing here sees an argument namespace.)"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from megamoe.config import RunConfig
from megamoe.config.batch_schedule import schedule_text
from megamoe.data import DataError, build_gpt_datasets
from megamoe.data.loaders import run_iterator
from megamoe.model.flops import num_parameters
from megamoe.moe.stats import describe_choice
from megamoe.parallel.failures import explain
from megamoe.parallel.mesh import Mesh, destroy_mesh, init_mesh
from megamoe.training.build import build_model
from megamoe.training.checkpoint.manager import CheckpointManager
from megamoe.training.checkpoint.safe_load import CheckpointError
from megamoe.training.checkpoint.vocab_padding import keep_checkpoint_vocab_padding
from megamoe.training.exits import ExitConditions
from megamoe.training.loop import TrainState, evaluate, report_validation, train
from megamoe.training.memory_history import start_memory_history
from megamoe.training.metrics import MetricsLogger
from megamoe.training.optim import build_optimizer
from megamoe.training.optim.overlap import OverlapOptions, bucket_numel
from megamoe.training.run_record import save_resolved_config
from megamoe.training.schedules.lr import LRScheduler

Log = Callable[[str], None]


def pretrain(run: RunConfig, tokenizer, print_fn: Log = print,
             resolved_config: Optional[str] = None) -> TrainState:
    """Train `run` on this rank (torchrun starts one process per rank). `resolved_config`
    (the YAML of the flags, cli/resolved_config.py) goes into --save once setup succeeded.

    A collective that times out or loses a peer (or a process group that cannot be created)
    ends this rank with a DistributedFailure: one line naming the operation, the group and
    the caller. The process group is then left as it is (tearing down a broken NCCL
    communicator can itself hang); the process is about to exit.
    """
    started = time.time()  # --exit-duration-in-mins counts from here, as Megatron's start
    mesh: Optional[Mesh] = None
    try:
        mesh = init_mesh(run.parallel)
        state = _pretrain(run, tokenizer, mesh, print_fn, started, resolved_config)
    except Exception as e:
        rank = None if mesh is not None else int(os.environ.get("RANK", "0"))
        failure = explain(e, mesh, run.parallel.distributed_timeout_minutes, rank=rank)
        if failure is not None:
            raise failure from e
        if mesh is not None:
            destroy_mesh(mesh)
        raise
    destroy_mesh(mesh)
    return state


def _pretrain(run: RunConfig, tokenizer, mesh: Mesh, print_fn: Log, started: float,
              resolved_config: Optional[str]) -> TrainState:
    def log(msg: str) -> None:
        if mesh.rank == 0:
            print_fn(msg)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    if run.train.rampup_batch_size is not None:
        log(rampup_note(run))
    c = run.checkpoint
    keep_checkpoint_vocab_padding(run.model, c.load, run.parallel.tensor_model_parallel_size, log)
    start_memory_history(run.logging, mesh.rank, mesh.device, log)
    stage = time.time()
    model = build_model(run, mesh)
    log(f"> model built in {time.time() - stage:.1f} s")
    _log_model(run, mesh, model, log)
    optimizer = build_optimizer(model, run.optim, mesh=mesh,
                                distributed=run.parallel.use_distributed_optimizer,
                                overlap=_overlap(run, mesh))
    t = run.train
    scheduler = LRScheduler(optimizer, run.optim, t.train_iters, t.global_batch_size,
                            t.train_samples)
    checkpoints = CheckpointManager(run, mesh, model, optimizer, scheduler, log)
    state = TrainState()
    state.iteration, state.consumed_train_samples = checkpoints.load()
    stage = time.time()
    data = _Data.build(run, tokenizer, mesh, state)
    log(f"> data indices built in {time.time() - stage:.1f} s: {data.describe()}")
    if resolved_config is not None and c.save and mesh.rank == 0:  # setup succeeded
        log(f"> resolved configuration saved to "
            f"{save_resolved_config(resolved_config, c.save)}")
    logger = None
    lg = run.logging
    if mesh.is_logging_rank and (lg.tensorboard_dir or lg.wandb_project):
        logger = MetricsLogger(lg.tensorboard_dir, lg.wandb_project, lg.wandb_exp_name,
                               lg.wandb_save_dir, config_dict=run.command_line,
                               wandb_entity=lg.wandb_entity)
    with ExitConditions(run.train, mesh, started) as exits:  # until the last save is out
        try:
            return _train_evaluate_publish(run, mesh, model, optimizer, scheduler, data,
                                           logger, state, checkpoints, print_fn, exits, log)
        except CheckpointError as e:
            if exits.signal_received:  # preempted, and nothing to resume from: say so
                raise exits.unsaved(e) from None
            raise


def _train_evaluate_publish(run: RunConfig, mesh: Mesh, model, optimizer, scheduler,
                            data: _Data, logger, state: TrainState,
                            checkpoints: CheckpointManager, print_fn: Log,
                            exits: ExitConditions, log: Log) -> TrainState:
    """Training, the final evaluation, and the wait until the last checkpoint is
    published; the caller keeps the SIGTERM handler installed throughout (exits.py)."""
    start = time.time()
    try:
        state = _train(run, mesh, model, optimizer, scheduler, data, logger, state,
                       checkpoints, print_fn, exits)
        if state.exit_reason is not None:  # as Megatron: saved, no final evaluation
            log(f"> exiting after iteration {state.iteration}: {state.exit_reason}")
            return state
        log(f"> training done: {state.iteration} iterations in {time.time() - start:.1f} s")
        _final_evaluation(run, mesh, model, data, logger, state, print_fn)
    finally:
        checkpoints.finalize()  # the last save is complete before pretrain() returns
        if logger is not None:
            logger.close()
    if exits.signal_received:
        log(f"> received SIGTERM after training: the checkpoint of iteration "
            f"{state.iteration} is published; exiting")
    return state


def rampup_note(run: RunConfig) -> str:
    """The one line a --rampup-batch-size run logs: Megatron ignores the flag now."""
    text = schedule_text(run.train.batch_size_schedule, run.model.seq_length)
    return (f"> --rampup-batch-size: Megatron-LM ignores this flag (deprecated for "
            f"--step-batch-size-schedule); megamoe runs it as --step-batch-size-schedule "
            f"\"{text}\"")


def _overlap(run: RunConfig, mesh: Mesh) -> Optional[OverlapOptions]:
    """--overlap-grad-reduce (--ddp-bucket-size, --overlap-param-gather)."""
    p = run.parallel
    if not p.overlap_grad_reduce:
        return None
    return OverlapOptions(bucket_numel(p.ddp_bucket_size, mesh.dp_size),
                          check_nan=run.train.check_for_nan_in_loss_and_grad,
                          param_gather=p.overlap_param_gather)


def _log_model(run: RunConfig, mesh: Mesh, model: torch.nn.Module, log: Log) -> None:
    total, active = num_parameters(run.model)
    if run.model.moe is not None and run.moe_execution.adaptive_parallelism:
        tokens = run.train.micro_batch_size * run.model.seq_length // mesh.tp_size
        log(f"> adaptive expert parallelism, {tokens} tokens per rank and layer call: "
            f"{describe_choice(model, tokens)}")
    log(f"> number of parameters: {total:,} (active per token: {active:,}); "
        f"world size {mesh.world_size}, tensor-parallel size {mesh.tp_size}, "
        f"pipeline-parallel size {mesh.pp_size}, data-parallel size {mesh.dp_size}, "
        f"expert-parallel size {mesh.ep_size}")


def split_num_samples(run: RunConfig) -> tuple[int, int, int]:
    """Samples the run reads from (train, valid, test): what its dataset indices cover."""
    t = run.train
    gbs = t.global_batch_size
    # one eval_iters window per --eval-interval, plus the one after training (Megatron's
    # count; without --eval-interval, Megatron's `train_iters // None` raises where its
    # documentation promises validation after training only: that is what runs here)
    eval_runs = t.evaluations_by(t.train_iters) + 1
    # as Megatron: --train-samples, or --train-iters global batches (and never fewer
    # than the iterations take: the last step of a ramp-up may pass --train-samples)
    train_samples = max(t.train_samples or 0, t.samples_for_iters(t.train_iters))
    return train_samples, eval_runs * t.eval_iters * gbs, t.eval_iters * gbs


@dataclass
class _Data:
    """The run's datasets and this rank's iterators over them."""

    valid_ds: object
    test_ds: object
    train_iter: Optional[Iterator]
    valid_iter: Optional[Iterator]
    train_ds: object = None

    def describe(self) -> str:
        """Samples per split (the startup line): "train 48, valid 0, test none"."""
        return ", ".join(f"{name} {len(ds) if ds is not None else 'none'}" for name, ds in
                         (("train", self.train_ds), ("valid", self.valid_ds),
                          ("test", self.test_ds)))

    @classmethod
    def build(cls, run: RunConfig, tokenizer, mesh: Mesh, state: TrainState) -> _Data:
        t = run.train
        gbs = t.global_batch_size
        num_samples = split_num_samples(run)
        # DataLoader iterators draw their base seed from the global torch RNG: keep that
        # draw out of the training RNG stream, so a resumed run (RNG restored from the
        # checkpoint) continues with exactly the dropout masks of a run that never stopped.
        with torch.random.fork_rng(devices=[]):
            train_ds, valid_ds, test_ds = build_gpt_datasets(
                run.data, tokenizer, num_samples, seq_length=run.model.seq_length, seed=t.seed,
                wait_timeout_s=60 * run.parallel.distributed_timeout_minutes)
            # validation resumes where the uninterrupted run's would be (one eval_iters
            # window per --eval-interval)
            valid_consumed = t.evaluations_by(state.iteration) * t.eval_iters * gbs
            train_iter, valid_iter = (
                run_iterator(run, ds, consumed, mesh.dp_rank, mesh.dp_size, mesh.device)
                for ds, consumed in ((train_ds, state.consumed_train_samples),
                                     (valid_ds, valid_consumed)))
        return cls(valid_ds, test_ds, train_iter, valid_iter, train_ds)


def _train(run: RunConfig, mesh: Mesh, model, optimizer, scheduler, data: _Data, logger,
           state: TrainState, checkpoints: CheckpointManager, print_fn: Log,
           exits: ExitConditions) -> TrainState:
    """The training loop, then a save of the last iteration unless the loop just saved
    it (also when an exit condition stopped it early)."""
    t, c = run.train, run.checkpoint
    if t.skip_train or state.iteration >= t.train_iters:
        return state
    if data.train_iter is None:
        raise DataError("the training split is empty: check --split / --data-path")

    def save(st: TrainState) -> None:
        checkpoints.save(st.iteration, st.consumed_train_samples)

    state = train(run, mesh, model, optimizer, scheduler, data.train_iter, data.valid_iter,
                  logger, state, save_fn=save if c.save else None, print_fn=print_fn,
                  exits=exits)
    if c.save and (not c.save_interval or state.iteration % c.save_interval):
        save(state)
    return state


def _final_evaluation(run: RunConfig, mesh: Mesh, model, data: _Data, logger,
                      state: TrainState, print_fn: Log) -> None:
    """Validation (unless the last iteration just ran it) and test loss."""
    evaluated_last = bool(state.history) and "valid lm loss" in state.history[-1]
    for split, ds in (("validation", data.valid_ds), ("test", data.test_ds)):
        if ds is None or run.train.eval_iters == 0 or (split == "validation"
                                                       and evaluated_last):
            continue
        it = data.valid_iter if split == "validation" else run_iterator(
            run, ds, 0, mesh.dp_rank, mesh.dp_size, mesh.device, num_workers=0)
        loss = evaluate(run, mesh, model, it)
        report_validation(state.iteration, loss, logger, mesh, print_fn, split=split)
