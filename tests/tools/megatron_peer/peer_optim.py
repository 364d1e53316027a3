"""The megatron-core side of the optimizer-state import tests. Runs in the peer venv
(mcore_venv.py), never imports megamoe.

    python peer_optim.py --variant mixtral --optimizer {fp32,distrib} \
        [--sharding fully_reshardable] [--bf16] [--tp 2] [--ep 2] [--dp 2] [--cp 2] \
        [--overlap-grad-reduce] [--bucket-size N] [--pad-buckets] [--moe-grouped-gemm] \
        [--te-spec] \
        [--vpp 2] [--layout-json PATH [--layout-only]] [--reference-out DIR] \
        [--legacy-out DIR] --out SAVE_DIR [--steps 2]

builds the variant's tiny GPTModel (peer.py), wraps it in megatron-core's
DistributedDataParallel, builds its optimizer with `get_megatron_optimizer` (Adam with
decoupled weight decay, as Megatron-LM's `--optimizer adam`: the non-distributed
FP32Optimizer, with --bf16 Float16OptimizerWithFloat16Params and its fp32 main
parameters, or the DistributedOptimizer with one data-parallel rank), takes `--steps`
real optimizer steps on TOKENS / LABELS (so the moments and the step count are not
zero), then saves what Megatron-LM's save_checkpoint saves for `--ckpt-format
torch_dist`: the model's and the optimizer's sharded state dicts (the optimizer's
`sharded_state_dict(model_sd, metadata=...)` with Megatron-LM's content metadata:
`distrib_optim_sharding_type`, `chained_optim_avoid_prefix`) and the common state
(args, iteration = steps, LR scheduler). --reference-out saves the same state again in
the model-shaped fully_reshardable layout (the oracle for dp_reshardable imports);
--layout-json dumps megatron-core's own buffer layout (dump_layout), --layout-only then
stops (--overlap-grad-reduce's gradient hooks ask for CUDA streams: they build but do not
train on the CPU). --dp N forks N data-parallel gloo ranks that train on the same tokens (so their
gradients are equal without megatron-core's gradient sync, which is not called).
--cp N: megatron-core's parallel state with N context-parallel ranks, so its DDP and
distributed optimizer shard the buffers over the DP x CP group as Megatron-LM's do; the
model's attention stays whole on every CP rank (megatron-core's local attention refuses
CP and context parallelism changes no parameter): its rotary embedding gets a one-rank
CP group and each CP rank runs the whole sequence, in eval mode (no aux-loss reduction
over the CP group), so the CP replicas' gradients are equal too.
--pp N [--vpp V]: each rank builds its V model chunks as Megatron-LM's get_model does
(each with its vp_stage, its own DDP, bucketing only in the first), one optimizer over
them, and runs one micro-batch through the pipeline by hand (_forward_backward: the
interleaved order over megatron-core's send / recv ring), then megatron-core's own
word-embedding gradient all-reduce (tied embeddings, MTP's copy). --legacy-out also writes
the same state as `--ckpt-format torch` (one run for both formats' tests).

On CPU: megatron-core's optimizers make a few tensors with device='cuda' and check
`param.type()` for CUDA type names; those factories are sent to the CPU and CPU tensors
answer with the CUDA names. Its gradient sync (a no-op with one data-parallel rank, which
reads the current CUDA stream) is not called.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (patches torch.cuda for the CPU)
import peer_legacy  # noqa: E402  (its layout helpers for the TP / EP runs)


def _on_cpu(fn):
    @functools.wraps(fn)
    def made(*a, **k):
        if k.get("device") is not None and "cuda" in str(k["device"]):
            k["device"] = "cpu"
        return fn(*a, **k)
    return made


for _name in ("tensor", "zeros", "ones", "empty", "full", "arange"):
    setattr(torch, _name, _on_cpu(getattr(torch, _name)))

_type = torch.Tensor.type


def _cuda_type_name(self, *a, **k):
    """megatron-core checks `param.type() == 'torch.cuda.FloatTensor'`: on the CPU a tensor
    answers with the CUDA name of its dtype (conversions, with arguments, are torch's)."""
    if a or k:
        return _type(self, *a, **k)
    return _type(self).replace("torch.", "torch.cuda.", 1)


torch.Tensor.type = _cuda_type_name
torch.Tensor.cuda = lambda self, *a, **k: self  # the dp-zero gather's `.cuda()` copies

LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


def build(variant: str, distributed: bool, bf16: bool, vocab: int = peer.VOCAB,
          layout: dict | None = None, ddp: dict | None = None, stages: list | None = None,
          cp_whole: bool = False, te_spec: bool = False):
    """(the model chunks, their DDP wrappers, the optimizer over all of them): one chunk
    per virtual stage (`stages`: each chunk's vp_stage, pp_rank, pre_process,
    post_process; None: the whole model), each wrapped in megatron-core's DDP as
    Megatron-LM's get_model does (bucketing only in the first chunk), one optimizer.
    te_spec: megatron-core's TE spec on the TE stand-in (peer.build_model)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    models, ddps = [], []
    for v, stage in enumerate(stages or [None]):
        model = peer.build_model(variant, vocab, layout={**(layout or {}), **dtype},
                                 stage=stage, te_spec=te_spec)
        # TP > 1 runs in eval mode: megatron-core's MoE layer refuses to train with TP but
        # without sequence parallelism, which its torch norms refuse; eval mode changes
        # nothing else here (no dropout, no aux loss) and the gradients are the loss's own
        model.train((layout or {}).get("tensor_model_parallel_size", 1) == 1 and not cp_whole)
        if cp_whole:
            _whole_sequence_on_cp_ranks(model)
        if bf16:  # Megatron-LM's Float16Module: every parameter bf16
            model = model.to(torch.bfloat16)
        models.append(model)
        ddps.append(DistributedDataParallel(
            model.config, DistributedDataParallelConfig(
                use_distributed_optimizer=distributed, grad_reduce_in_fp32=True,
                **(ddp or {})), model, disable_bucketing=v > 0))
    config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD,
                             adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
                             use_distributed_optimizer=distributed, clip_grad=1.0,
                             **dtype)
    return models, ddps, get_megatron_optimizer(config, ddps)


def _whole_sequence_on_cp_ranks(model) -> None:
    """Every module's context-parallel group (the rotary embedding's slice of the positions
    per CP rank) replaced by this rank's one-rank group: the whole sequence on each rank."""
    from megatron.core import parallel_state as ps

    world = torch.distributed.get_world_size()
    # (new_group is collective: every rank makes every one-rank group, in the same order)
    alone = [torch.distributed.new_group([r], backend="gloo") for r in range(world)]
    mine = alone[torch.distributed.get_rank()]
    cp = ps.get_context_parallel_group()
    replaced = 0
    for module in model.modules():
        if getattr(module, "cp_group", None) is cp:
            module.cp_group, replaced = mine, replaced + 1
    assert replaced, "no module holds the context-parallel group"


def dump_layout(optimizer, models, path: str) -> None:
    """megatron-core's own buffer layout as facts for the converter's layout test: per
    chained optimizer, its dp_group_idx and for each buffer (gbuf_idx) its dtype key,
    model chunk and buckets, each with its padded and unpadded numel and every
    parameter's [start, end) inside the bucket (`{path}.rank{R}.json`)."""
    import json

    names = {p: n for m in models for n, p in m.named_parameters()}
    chunk_of = {p: v for v, m in enumerate(models) for p in m.parameters()}
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        bufs = []
        for buf in opt.buffers:
            buckets = [{"numel": b.grad_data.numel(), "numel_unpadded": b.numel_unpadded,
                        "offset": b.offset, "params": {}} for b in buf.buckets]
            for p, (start, end, bucket) in buf.param_index_map.items():
                off = buf.buckets[bucket].offset
                buckets[bucket]["params"][names[p]] = [start - off, end - off]
            bufs.append({"dtype": str((buf.param_dtype, buf.grad_dtype)),
                         "chunk": chunk_of[buf.params[0]],
                         "dp_size": buf.data_parallel_group.size(), "buckets": buckets})
        out.append({"dp_group_idx": opt.data_parallel_group_idx, "buffers": bufs,
                    "ranks": _ranks()})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.rank{torch.distributed.get_rank()}.json", "w") as f:
        json.dump(out, f, indent=1)


def _ranks() -> dict:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "cp": ps.get_context_parallel_rank()}


def _forward_backward(models, ddps, tokens, pos, mask) -> None:
    """One micro-batch through the pipeline, by hand (no megatron-core schedule on gloo):
    the chunks in pipeline order, virtual stage by virtual stage (v = 0 on every PP rank,
    then v = 1, ...: the interleaved order, megatron-core's send/recv ring, the next rank
    after the last PP rank being the first). A chunk receives its input activations from
    the previous chunk, sends its output to the next; then backward in reverse order,
    each chunk getting its output's gradient back and sending its input's gradient back;
    the last chunk's loss is the mean token loss. One chunk on one stage: plain backward.
    Then megatron-core's own all-reduce of the word embeddings' gradients between the
    first and the last stage (finalize_model_grads: tied embeddings, MTP's copy)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_word_embedding_grads,
    )

    p, pp, chunks = (ps.get_pipeline_model_parallel_rank(),
                     ps.get_pipeline_model_parallel_world_size(), len(models))
    prev, nxt = (ps.get_pipeline_model_parallel_prev_rank(),
                 ps.get_pipeline_model_parallel_next_rank())
    inputs, outputs = [], []
    for v, (model, ddp) in enumerate(zip(models, ddps)):
        first, last = p == 0 and v == 0, p == pp - 1 and v == chunks - 1
        x = None
        if not first:
            x = torch.empty(peer.SEQ, tokens.shape[0], model.config.hidden_size,
                            dtype=next(model.parameters()).dtype)
            torch.distributed.recv(x, src=prev)
            x.requires_grad_()
            model.set_input_tensor(x)
        out = ddp(tokens, pos, mask, labels=torch.tensor(peer.LABELS) if last else None)
        if not last:
            torch.distributed.send(out.detach().contiguous(), dst=nxt)
        inputs.append(x)
        outputs.append(out)
    for v in reversed(range(chunks)):
        out, x = outputs[v], inputs[v]
        if p == pp - 1 and v == chunks - 1:
            out.float().mean().backward()
        else:
            grad = torch.empty_like(out)
            torch.distributed.recv(grad, src=nxt)
            out.backward(grad)
        if x is not None:
            torch.distributed.send(x.grad.contiguous(), dst=prev)
    if pp > 1:
        _allreduce_word_embedding_grads(ddps, models[0].config)


def train(models, ddps, optimizer, steps: int) -> None:
    tokens = torch.tensor(peer.TOKENS)
    pos = torch.arange(peer.SEQ)[None].expand_as(tokens)
    mask = torch.triu(torch.ones(peer.SEQ, peer.SEQ, dtype=torch.bool), diagonal=1)[None, None]
    for _ in range(steps):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        optimizer.zero_grad()
        _forward_backward(models, ddps, tokens, pos, mask)
        ok, _, _ = optimizer.step()
        assert ok, "the peer's optimizer step was skipped"


def save(a) -> None:
    """One rank's part (all of it with one process): train, then the collective save."""

    sharded = a.tp * a.pp * a.ep * a.dp * a.cp > 1
    layout = peer_legacy._layout(a) if sharded else None
    vocab = peer_legacy.padded_vocab(a.tp)
    ddp_args = {"overlap_grad_reduce": a.overlap_grad_reduce, "bucket_size": a.bucket_size,
                "pad_buckets_for_high_nccl_busbw": a.pad_buckets}
    if a.moe_grouped_gemm:  # TEGroupedMLP experts: megatron-core's TE spec builds them
        layout = {**(layout or {}), "moe_grouped_gemm": True}
    stages = None
    if a.pp > 1:  # each virtual stage's chunk, as Megatron-LM's get_model builds them
        from megatron.core import parallel_state as ps

        p, chunks = ps.get_pipeline_model_parallel_rank(), a.vpp or 1
        stages = [dict(vp_stage=v if a.vpp else None, pp_rank=p,
                       pre_process=p == 0 and v == 0,
                       post_process=p == a.pp - 1 and v == chunks - 1)
                  for v in range(chunks)]
    models, ddps, optimizer = build(a.variant, a.optimizer == "distrib", a.bf16, vocab,
                                    layout, ddp_args, stages, cp_whole=a.cp > 1,
                                    te_spec=a.te_spec or a.moe_grouped_gemm)
    if a.layout_json and a.optimizer == "distrib":  # (flat buffers only there)
        dump_layout(optimizer, models, a.layout_json)
    if a.layout_only:
        return
    if sharded:
        peer_legacy._equalize_replicas(models)
    train(models, ddps, optimizer, a.steps)
    args = peer_legacy._args(a) if sharded else peer.megatron_args(a.variant, a.steps)
    args.ckpt_format, args.iteration = "torch_dist", a.steps
    args.sequence_parallel = False
    args.consumed_train_samples = a.steps * args.global_batch_size
    args.use_distributed_optimizer = a.optimizer == "distrib"
    args.optimizer, args.adam_beta1, args.adam_beta2, args.adam_eps = "adam", *BETAS, EPS
    args.clip_grad, args.lr, args.lr_decay_style, args.lr_warmup_iters = 1.0, LR, "constant", 0
    args.weight_decay = WD
    # Megatron-LM's DDP flags (their argparse defaults unless given)
    args.overlap_grad_reduce, args.ddp_bucket_size = a.overlap_grad_reduce, a.bucket_size
    args.ddp_pad_buckets_for_high_nccl_busbw = a.pad_buckets
    args.context_parallel_size = a.cp
    args.data_parallel_size = torch.distributed.get_world_size() // (a.tp * a.pp * a.cp)
    args.overlap_param_gather_with_optimizer_step = False
    args.num_distributed_optimizer_instances = 1
    if a.moe_grouped_gemm:  # what Megatron-LM's args say for TEGroupedMLP experts
        args.moe_grouped_gemm, args.transformer_impl = True, "transformer_engine"
    if a.te_spec:  # the whole TE spec: what Megatron-LM's default --transformer-impl says
        args.transformer_impl = "transformer_engine"
    if a.bf16:
        args.bf16, args.params_dtype = True, torch.bfloat16
    if a.format == "torch":
        _save_legacy(a, a.out, args, models, optimizer)
    else:
        _save_as(a.sharding, a.out, args, models, optimizer)
    if a.legacy_out:  # the same state in the legacy --ckpt-format torch files too
        _save_legacy(a, a.legacy_out, copy.copy(args), models, optimizer)
    if a.reference_out:  # the same state in megatron-core's own model-shaped layout
        _save_as("fully_reshardable", a.reference_out, args, models, optimizer)


def _model_keys(models: list) -> list[str]:
    """Megatron-LM's state-dict keys of the chunks: `model`, or `model0`, `model1`, ...
    with virtual stages."""
    return ["model"] if len(models) == 1 else [f"model{v}" for v in range(len(models))]


def _save_as(sharding: str, out: str, args, models, optimizer) -> None:
    # Megatron-LM's _build_sharded_state_dict_metadata (megatron/training/checkpointing.py)
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = sharding
    from megatron.core import dist_checkpointing

    model_sd = {k: m.sharded_state_dict(metadata=metadata)
                for k, m in zip(_model_keys(models), models)}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": args.iteration, **model_sd,
             "optimizer": optimizer.sharded_state_dict(dict(model_sd), metadata=metadata),
             "opt_param_scheduler": peer.scheduler_state(args),
             "num_floating_point_operations_so_far": 1.5e12}
    it_dir = os.path.join(out, f"iter_{args.iteration:07d}")
    os.makedirs(it_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, it_dir, content_metadata=metadata)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(args.iteration))


def _save_legacy(a, out: str, args, models, optimizer) -> None:
    """What Megatron-LM's save_checkpoint writes for `--ckpt-format torch`
    (megatron/training/checkpointing.py): on every rank whose data-parallel or
    expert-data-parallel rank is 0, `mp_rank_*/model_optim_rng.pt` (args, the chunk's
    state_dict_for_save_checkpoint, `optimizer.state_dict()`, scheduler, RNG); with the
    distributed optimizer, every rank calls `optimizer.save_parameter_state` on
    `distrib_optim.pt` beside it (megatron-core gathers each buffer on its DP rank 0,
    which writes it)."""
    from megatron.core import parallel_state as ps

    args.ckpt_format, args.use_dist_ckpt = "torch", False
    it_dir = os.path.join(out, f"iter_{args.iteration:07d}")
    path = peer_legacy._checkpoint_name(a, it_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if (ps.get_data_parallel_rank(with_context_parallel=True) == 0
            or ps.get_expert_data_parallel_rank() == 0):
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": args.iteration,
                    **{k: m.state_dict_for_save_checkpoint()
                       for k, m in zip(_model_keys(models), models)},
                    "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": peer.scheduler_state(args),
                    "rng_state": [peer_legacy._rng_state()],
                    "num_floating_point_operations_so_far": 1.5e12}, path)
    if args.use_distributed_optimizer:
        optimizer.save_parameter_state(os.path.join(os.path.dirname(path), "distrib_optim.pt"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(args.iteration))


def worker(rank: int, a) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.distributed.init_process_group("gloo", rank=rank, world_size=a.world)
    ps.initialize_model_parallel(a.tp, a.pp, a.vpp, context_parallel_size=a.cp,
                                 expert_model_parallel_size=a.ep,
                                 expert_tensor_parallel_size=a.etp)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    # (peer_legacy.py: a forked results-queue Manager instead of a spawned interpreter)
    filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
    save(a)
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=sorted(peer.VARIANTS), default="mixtral")
    p.add_argument("--optimizer", choices=["fp32", "distrib"], default="fp32")
    p.add_argument("--sharding", default="fully_reshardable")
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="--ckpt-format of the save (--reference-out is torch_dist)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="bf16 weights, fp32 main params")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--ep", type=int, default=1, help="expert parallel")
    p.add_argument("--etp", type=int, default=None, help="expert TP (default: 1 with EP > 1, "
                   "else TP: Megatron-LM's default)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (at least)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual stages per PP rank")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--bucket-size", type=int, default=None)
    p.add_argument("--pad-buckets", action="store_true",
                   help="--ddp-pad-buckets-for-high-nccl-busbw")
    p.add_argument("--moe-grouped-gemm", action="store_true", help="TEGroupedMLP experts, "
                   "so the whole TE spec (needs the TE stand-in: run_peer(te_stand_in=True))")
    p.add_argument("--te-spec", action="store_true", help="megatron-core's whole TE spec "
                   "(needs the TE stand-in: run_peer(te_stand_in=True))")
    p.add_argument("--layout-json", default=None, help="dump the buffer layout here")
    p.add_argument("--layout-only", action="store_true", help="dump it, no training/save")
    p.add_argument("--reference-out", default=None,
                   help="also save the same state as fully_reshardable here")
    p.add_argument("--legacy-out", default=None,
                   help="also save the same state as --ckpt-format torch here")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.tp * a.pp * a.ep * a.dp * a.cp == 1:
        peer.init_process_group()
        save(a)
        torch.distributed.destroy_process_group()
        return
    # TP x PP x EP ranks, the smallest data-parallel size that holds them; every rank
    # trains on the same tokens (data-parallel replicas stay equal without a sync)
    a.iteration = a.steps
    a.etp = a.etp or (1 if a.ep > 1 else a.tp)
    dp = max(a.etp * a.ep // math.gcd(a.tp, a.etp * a.ep), a.dp)
    a.world = a.tp * a.pp * a.cp * dp
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(peer_legacy._free_port())
    import megatron.core.dist_checkpointing  # noqa: F401  (once, before the fork)
    mp.start_processes(worker, args=(a,), nprocs=a.world, start_method="fork")


if __name__ == "__main__":
    sys.exit(main())
