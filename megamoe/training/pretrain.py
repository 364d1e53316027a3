"""pretrain_gpt.py's body: flags -> mesh -> tokenizer -> model -> data -> train loop.

Errors a user can cause (bad flags, missing or corrupt data, unusable checkpoints) end as
one line on stderr and a non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from megamoe.argument_rules import args_to_configs
from megamoe.arguments import parse_args
from megamoe.config import RunConfig
from megamoe.data import DataError, PretrainingSampler, build_gpt_datasets, build_tokenizer
from megamoe.model.flops import num_parameters
from megamoe.model.gpt_model import GPTModel
from megamoe.parallel.data_parallel import allreduce_gradients
from megamoe.parallel.mesh import Mesh, destroy_mesh, init_mesh
from megamoe.parallel.optimizer import build_optimizer
from megamoe.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megamoe.training.logging import MetricsLogger
from megamoe.training.loop import TrainState, evaluate, report_validation, train
from megamoe.training.lr_schedule import LRScheduler

USER_ERRORS = (DataError, CheckpointError, FileNotFoundError)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def make_iterator(dataset, consumed_samples: int, run: RunConfig, mesh: Mesh,
                  num_workers: int) -> Optional[Iterator]:
    """Micro-batches for this data-parallel rank; the same global batches in any layout."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                 micro_batch_size=run.train.micro_batch_size,
                                 data_parallel_rank=mesh.dp_rank,
                                 data_parallel_size=mesh.dp_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=_collate,
                                         num_workers=num_workers,
                                         persistent_workers=num_workers > 0)
    return iter(loader)


def build_tokenizer_from_args(args: argparse.Namespace):
    if args.tokenizer_type is None:  # --mock-data without a tokenizer
        return build_tokenizer("NullTokenizer", vocab_size=args.vocab_size or 1024)
    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                           vocab_file=args.vocab_file, merge_file=args.merge_file,
                           vocab_size=args.vocab_size)


def build_model(run: RunConfig, bf16: bool) -> torch.nn.Module:
    set_seed(run.train.seed)  # weights depend on the seed and the config only
    model = GPTModel(run.model)
    if bf16:
        model = model.to(torch.bfloat16)
    return model


def dry_run(run: RunConfig, print_fn=print) -> None:
    """Build the model's shapes on the meta device and report its size."""
    with torch.device("meta"):
        model = GPTModel(run.model)
    actual = sum(p.numel() for p in model.parameters())
    total, active = num_parameters(run.model)
    bytes_per = 2 if run.optim.bf16 else 4
    # params + grads in model dtype, fp32 main params + 2 Adam states (+ fp32 main grads).
    state = actual * (2 * bytes_per + (16 if run.optim.bf16 else 8))
    print_fn(json.dumps({"parameters": actual, "parameters_formula": total,
                         "active_parameters_per_token": active,
                         "weights_grads_optimizer_gib": round(state / 2**30, 3)}))


def pretrain(args: argparse.Namespace, print_fn=print) -> TrainState:
    mesh = init_mesh(args.distributed_backend, args.distributed_timeout_minutes)
    try:
        return _pretrain(args, mesh, print_fn)
    finally:
        destroy_mesh(mesh)


def _pretrain(args: argparse.Namespace, mesh: Mesh, print_fn) -> TrainState:
    def log(msg: str) -> None:
        if mesh.rank == 0:
            print_fn(msg)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = build_tokenizer_from_args(args)
    run = args_to_configs(args, tokenizer.vocab_size)
    if args.dry_run:
        if mesh.rank == 0:
            dry_run(run, print_fn)
        return TrainState()

    model = build_model(run, args.bf16)
    total, active = num_parameters(run.model)
    log(f"> number of parameters: {total:,} (active per token: {active:,}); "
        f"world size {mesh.world_size}, data-parallel size {mesh.dp_size}")
    optimizer = build_optimizer(
        model, run.optim,
        reduce_grads_fn=lambda grads: allreduce_gradients(grads, mesh.dp_group))
    scheduler = LRScheduler(optimizer, run.optim, run.train.train_iters)
    state = TrainState()
    if run.train.load is not None:
        iteration, consumed = load_checkpoint(
            run.train.load, model, optimizer, scheduler,
            load_optim=not run.train.no_load_optim, load_rng=not run.train.no_load_rng,
            finetune=run.train.finetune)
        state.iteration, state.consumed_train_samples = iteration, consumed
        if iteration:
            log(f"> loaded checkpoint from {run.train.load} at iteration {iteration}")

    t = run.train
    gbs = t.global_batch_size
    eval_runs = t.train_iters // t.eval_interval + 1
    num_samples = (t.train_iters * gbs, eval_runs * t.eval_iters * gbs, t.eval_iters * gbs)
    train_ds, valid_ds, test_ds = build_gpt_datasets(run.data, tokenizer, num_samples)
    workers = run.data.num_workers
    train_iter = make_iterator(train_ds, state.consumed_train_samples, run, mesh, workers)
    valid_iter = make_iterator(valid_ds, 0, run, mesh, workers)

    logger = None
    if mesh.is_logging_rank and (t.tensorboard_dir or t.wandb_project):
        logger = MetricsLogger(t.tensorboard_dir, t.wandb_project, t.wandb_exp_name,
                               t.wandb_save_dir, config_dict=vars(args))

    def save(st: TrainState) -> None:
        if mesh.rank == 0:
            save_checkpoint(t.save, st.iteration, model, optimizer, scheduler,
                            st.consumed_train_samples, _jsonable(vars(args)),
                            save_optim=not t.no_save_optim, save_rng=not t.no_save_rng)
            log(f"> saved checkpoint at iteration {st.iteration} to {t.save}")
        mesh.barrier()

    start = time.time()
    try:
        if not t.skip_train and state.iteration < t.train_iters:
            if train_iter is None:
                raise DataError("the training split is empty: check --split / --data-path")
            state = train(run, mesh, model, optimizer, scheduler, train_iter, valid_iter,
                          logger, state, save_fn=save if t.save else None, print_fn=print_fn)
            if t.save and (not t.save_interval or state.iteration % t.save_interval):
                save(state)
        log(f"> training done: {state.iteration} iterations in {time.time() - start:.1f} s")
        evaluated_last = bool(state.history) and "valid lm loss" in state.history[-1]
        for split, ds in (("validation", valid_ds), ("test", test_ds)):
            if ds is None or t.eval_iters == 0 or (split == "validation" and evaluated_last):
                continue
            it = valid_iter if split == "validation" else make_iterator(ds, 0, run, mesh, 0)
            loss = evaluate(run, mesh, model, it)
            report_validation(state.iteration, loss, logger, mesh, print_fn, split=split)
    finally:
        if logger is not None:
            logger.close()
    return state


def _jsonable(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, list, type(None)))}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        pretrain(args)
    except USER_ERRORS as e:
        sys.stderr.write(f"pretrain_gpt.py: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("pretrain_gpt.py: interrupted\n")
        return 130
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    sys.exit(main())
