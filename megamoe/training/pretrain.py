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

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import RunConfig, to_dict
from megamoe.data import DataError, PretrainingSampler, build_gpt_datasets, build_tokenizer
from megamoe.model.flops import num_parameters
from megamoe.model.gpt_model import GPTModel
from megamoe.model.pipeline_stage import build_pipeline_model
from megamoe.moe.experts import use_grouped_gemm
from megamoe.parallel.mesh import Mesh, destroy_mesh, init_mesh
from megamoe.parallel.rng import MODEL_PARALLEL_SEED_OFFSET, PIPELINE_SEED_STRIDE, RNGTracker
from megamoe.parallel.tensor_parallel import TensorParallel
from megamoe.planning.memory import Layout, activation_bytes, model_bytes
from megamoe.training.checkpoint.dist import (
    AsyncDistSaver,
    load_dist_checkpoint,
    reseed,
    save_dist_checkpoint,
)
from megamoe.training.checkpoint.single_file import (
    AsyncCheckpointWriter,
    CheckpointError,
    build_state,
    checkpoint_file,
    is_dist_checkpoint,
    load_checkpoint,
    write_checkpoint,
)
from megamoe.training.loop import TrainState, evaluate, report_validation, train
from megamoe.training.metrics import MetricsLogger
from megamoe.training.optim.mixed_precision import build_optimizer
from megamoe.training.schedules.lr import LRScheduler

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


def build_model(run: RunConfig, bf16: bool, mesh: Optional[Mesh] = None) -> torch.nn.Module:
    """Weights depend on the seed and the config only: TP shards are slices of them."""
    set_seed(run.train.seed)
    tp = None
    parallel = mesh is not None and (mesh.tp_size > 1 or mesh.pp_size > 1)
    if mesh is not None and mesh.tp_size > 1:
        tp = TensorParallel(mesh.tp_group, run.parallel.sequence_parallel,
                            RNGTracker(run.train.seed + MODEL_PARALLEL_SEED_OFFSET
                                       + mesh.tp_rank))
    if mesh is not None and mesh.pp_size > 1:
        p = run.parallel
        model = build_pipeline_model(
            run.model, tp, mesh.pp_rank, mesh.pp_size, mesh.pp_group, mesh.group_ranks["pp"],
            p.num_layers_per_virtual_pipeline_stage, p.decoder_first_pipeline_num_layers,
            p.decoder_last_pipeline_num_layers)
    else:
        model = GPTModel(run.model, tp)
    if parallel:  # dropout stream of this pipeline stage (same on every TP rank)
        torch.manual_seed(run.train.seed + PIPELINE_SEED_STRIDE * mesh.pp_rank)
    if run.model.moe is not None and run.moe_training.use_upcycling:
        # --moe-use-upcycling: every expert starts as this seed's dense MLP (moefy.py).
        import dataclasses

        from megamoe.moe.moefy import upcycle_model

        set_seed(run.train.seed)
        dense_cfg = dataclasses.replace(run.model, moe=None, moe_layer_pattern=None)
        upcycle_model(GPTModel(dense_cfg, tp), model)
    if run.model.moe is not None:  # routed experts: mark them; with EP keep this rank's
        from megamoe.moe.dispatcher import apply_expert_parallel  # slice, add a dispatcher

        use_grouped_gemm(model, run.moe_execution.grouped_gemm)
        apply_expert_parallel(model, None if mesh is None else mesh.group("ep"),
                              run.moe_execution.token_dispatcher_type,
                              tp_group=None if mesh is None else mesh.group("tp"),
                              etp_group=None if mesh is None else mesh.group("etp"),
                              overlap_degree=run.moe_execution.a2a_overlap_degree)
        if mesh is not None and mesh.dp_size * mesh.cp_size > 1:
            _set_balancing_group(model, mesh)
    if bf16:
        model = model.to(torch.bfloat16)
    if run.model.moe is not None and run.moe_execution.adaptive_parallelism:
        from megamoe.moe.adaptive import enable_adaptive_parallelism  # times the ep links

        enable_adaptive_parallelism(model, mesh.group("ep"))
    return model


def _set_balancing_group(model: torch.nn.Module, mesh: Mesh) -> None:
    """global_aux_loss sums token counts over the data-parallel ranks (dp x cp). TP ranks
    are left out: with sequence parallelism every TP rank routes the same gathered tokens.
    Gradients are averaged over dp x cp, which the loss compensates for."""
    from megamoe.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.balancing_group = mesh.group("dp_cp")
            module.grad_average_size = mesh.dp_size * mesh.cp_size


def dry_run(run: RunConfig, print_fn=print) -> None:
    """Build the model's shapes on the meta device; report its size and the memory one rank
    of this launch's layout needs (megamoe.planning.memory, largest pipeline stage,
    layers split evenly over the stages)."""
    with torch.device("meta"):
        model = GPTModel(run.model)
    actual = sum(p.numel() for p in model.parameters())
    total, active = num_parameters(run.model)
    par = run.parallel
    vpp = 1
    if par.num_layers_per_virtual_pipeline_stage:
        vpp = run.model.num_layers // (par.pipeline_model_parallel_size
                                       * par.num_layers_per_virtual_pipeline_stage)
    layout = Layout(tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                    vpp=vpp, ep=par.expert_model_parallel_size,
                    etp=par.expert_tensor_parallel_size or par.tensor_model_parallel_size,
                    dp=par.data_parallel_size, cp=par.context_parallel_size,
                    distributed_optimizer=par.use_distributed_optimizer, recompute="none",
                    micro_batch_size=run.train.micro_batch_size)
    bytes_per = 2 if run.optim.bf16 else 4
    static = model_bytes(run.model, layout, bytes_per)
    activations = activation_bytes(run.model, layout, run.model.seq_length, bytes_per)
    memory = {k: int(static[k]) for k in ("weights", "gradients", "optimizer")}
    memory["activations"] = int(activations)
    memory["total"] = sum(memory.values())
    print_fn(json.dumps({"parameters": actual, "parameters_formula": total,
                         "active_parameters_per_token": active,
                         "per_rank_memory_bytes": memory,
                         "per_rank_memory_gib": round(memory["total"] / 2**30, 3)}))


def _dry_run_vocab_size(args: argparse.Namespace) -> int:
    """The tokenizer's vocabulary. Under --dry-run, --vocab-size stands in for a tokenizer
    file that exists only on the cluster, so a launch script can be checked anywhere."""
    if args.vocab_size and args.tokenizer_model and not os.path.exists(args.tokenizer_model):
        return args.vocab_size
    return build_tokenizer_from_args(args).vocab_size


def pretrain(args: argparse.Namespace, print_fn=print) -> TrainState:
    if args.dry_run:  # shapes and sizes only: no process group, no data
        dry_run(run_config_from_args(args, _dry_run_vocab_size(args)), print_fn)
        return TrainState()
    mesh = init_mesh(run_config_from_args(args, args.vocab_size or 1).parallel)
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
    run = run_config_from_args(args, tokenizer.vocab_size)

    model = build_model(run, args.bf16, mesh)
    total, active = num_parameters(run.model)
    if run.model.moe is not None and run.moe_execution.adaptive_parallelism:
        from megamoe.moe.adaptive import describe_choice

        tokens = run.train.micro_batch_size * run.model.seq_length // mesh.tp_size
        log(f"> adaptive expert parallelism, {tokens} tokens per rank and layer call: "
            f"{describe_choice(model, tokens)}")
    log(f"> number of parameters: {total:,} (active per token: {active:,}); "
        f"world size {mesh.world_size}, tensor-parallel size {mesh.tp_size}, "
        f"pipeline-parallel size {mesh.pp_size}, data-parallel size {mesh.dp_size}, "
        f"expert-parallel size {mesh.ep_size}")
    optimizer = build_optimizer(model, run.optim, mesh=mesh,
                                distributed=run.parallel.use_distributed_optimizer)
    scheduler = LRScheduler(optimizer, run.optim, run.train.train_iters)
    state = TrainState()
    c = run.checkpoint
    if c.load is not None:
        if c.load != c.save and (not os.path.exists(c.load) or checkpoint_file(c.load) is None):
            raise CheckpointError(f"--load {c.load}: no checkpoint found")
        iteration, consumed = _load(run, mesh, model, optimizer, scheduler, log)
        state.iteration, state.consumed_train_samples = iteration, consumed
        if iteration:
            log(f"> loaded checkpoint from {c.load} at iteration {iteration}")

    t = run.train
    gbs = t.global_batch_size
    eval_runs = t.train_iters // t.eval_interval + 1
    num_samples = (t.train_iters * gbs, eval_runs * t.eval_iters * gbs, t.eval_iters * gbs)
    # DataLoader iterators draw their base seed from the global torch RNG: keep that draw
    # out of the training RNG stream, so a resumed run (RNG restored from the checkpoint)
    # continues with exactly the dropout masks of a run that never stopped.
    with torch.random.fork_rng(devices=[]):
        train_ds, valid_ds, test_ds = build_gpt_datasets(
            run.data, tokenizer, num_samples, seq_length=run.model.seq_length, seed=t.seed)
        workers = run.data.num_workers
        train_iter = make_iterator(train_ds, state.consumed_train_samples, run, mesh, workers)
        # validation resumes where the uninterrupted run's would be (one eval_iters
        # window per --eval-interval)
        valid_consumed = (state.iteration // t.eval_interval) * t.eval_iters * gbs
        valid_iter = make_iterator(valid_ds, valid_consumed, run, mesh, workers)

    logger = None
    lg = run.logging
    if mesh.is_logging_rank and (lg.tensorboard_dir or lg.wandb_project):
        logger = MetricsLogger(lg.tensorboard_dir, lg.wandb_project, lg.wandb_exp_name,
                               lg.wandb_save_dir, config_dict=run.command_line)

    dist_format = c.ckpt_format == "torch_dist"
    writer = None
    if c.async_save and dist_format:
        writer = AsyncDistSaver()  # every rank writes its shards in the background
    elif c.async_save and mesh.rank == 0:
        writer = AsyncCheckpointWriter()

    def save(st: TrainState) -> None:
        if dist_format:  # every rank writes its shards
            save_fn = writer.save if writer is not None else save_dist_checkpoint
            save_fn(c.save, st.iteration, model, optimizer, scheduler, mesh,
                    st.consumed_train_samples, run.command_line,
                    model_config=to_dict(run.model), save_optim=not c.no_save_optim,
                    save_rng=not c.no_save_rng, keep_last=c.ckpt_keep_last)
            how = "saving (in the background)" if writer is not None else "saved"
            log(f"> {how} checkpoint at iteration {st.iteration} to {c.save}")
            return
        if mesh.rank == 0:
            ckpt = build_state(st.iteration, model, optimizer, scheduler,
                               st.consumed_train_samples, run.command_line,
                               save_optim=not c.no_save_optim, save_rng=not c.no_save_rng,
                               model_config=to_dict(run.model))
            if writer is not None:  # snapshot now, write in the background
                writer.save(c.save, st.iteration, ckpt, c.ckpt_keep_last)
            else:
                write_checkpoint(c.save, st.iteration, ckpt, c.ckpt_keep_last)
            log(f"> saved checkpoint at iteration {st.iteration} to {c.save}")
        mesh.barrier()

    start = time.time()
    try:
        if not t.skip_train and state.iteration < t.train_iters:
            if train_iter is None:
                raise DataError("the training split is empty: check --split / --data-path")
            state = train(run, mesh, model, optimizer, scheduler, train_iter, valid_iter,
                          logger, state, save_fn=save if c.save else None, print_fn=print_fn)
            if c.save and (not c.save_interval or state.iteration % c.save_interval):
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
        if writer is not None:
            writer.finalize()  # the last save is complete before pretrain() returns
        if logger is not None:
            logger.close()
    return state


def _load(run: RunConfig, mesh: Mesh, model: torch.nn.Module, optimizer, scheduler,
          log) -> tuple[int, int]:
    """--load: either format, detected from the directory. Returns (iteration, consumed)."""
    t = run.checkpoint
    found = checkpoint_file(t.load) if os.path.exists(t.load) else None
    if found is None:
        return 0, 0
    if not is_dist_checkpoint(found):
        sharded = mesh.tp_size > 1 or mesh.pp_size > 1 or mesh.ep_size > 1 or (
            run.parallel.use_distributed_optimizer and mesh.dp_size * mesh.edp_size > 1)
        if sharded:
            raise CheckpointError(f"{found}: a single-file (--ckpt-format torch) checkpoint "
                                  "loads only without tensor/pipeline/expert parallelism and "
                                  "the distributed optimizer; save it with torch_dist")
        return load_checkpoint(t.load, model, optimizer, scheduler,
                               load_optim=not t.no_load_optim, load_rng=not t.no_load_rng,
                               finetune=t.finetune)
    common = load_dist_checkpoint(found, model, optimizer, scheduler, mesh,
                                  load_optim=not t.no_load_optim, load_rng=not t.no_load_rng,
                                  finetune=t.finetune)
    if t.finetune:
        return 0, 0
    iteration = int(common["iteration"])
    if not t.no_load_rng and common.get("rng") and not common["rng_restored"]:
        log(f"> checkpoint saved under another layout ({common.get('layout')}): RNG states "
            f"reseeded from --seed {run.train.seed} and the iteration")
        reseed(run.train.seed, iteration, PIPELINE_SEED_STRIDE * mesh.pp_rank)
    return iteration, int(common["consumed_train_samples"])


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
