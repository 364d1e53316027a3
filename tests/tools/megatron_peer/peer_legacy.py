"""The megatron-core side of the legacy `--ckpt-format torch` tests. Runs in the peer venv
(mcore_venv.py), never imports megamoe.

    python peer_legacy.py --variant mixtral --tp 2 --pp 2 --ep 2 [--etp 1] [--vpp 2] \
        --out SAVE_DIR [--iteration 7] [--release]

forks TP x PP x DP gloo processes (DP as small as the expert layout allows), each builds
its pipeline chunk(s) of the variant's megatron-core GPTModel and

- writes what Megatron-LM's save_checkpoint writes for `--ckpt-format torch`: on every
  rank whose data-parallel or expert-data-parallel rank is 0, `iter_0000007/
  mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt` (get_checkpoint_name), a
  torch.save'd dict of args, checkpoint_version, iteration, `model` or `model0..` (each
  chunk's state_dict_for_save_checkpoint: per-stage layer numbers, local expert numbers),
  optimizer, opt_param_scheduler, rng_state, num_floating_point_operations_so_far; then
  the tracker file;
- saves the same chunks with dist_checkpointing.save (torch_dist) beside it.

Then the parent process builds the TP1/PP1/EP1 model, has megatron-core itself load the
torch_dist copy (its own resharding: independent of megamoe's merge of the legacy files)
and writes its logits of TOKENS to SAVE_DIR/reference_logits.pt (with MTP, also each
depth's logits to SAVE_DIR/reference_mtp_logits.pt, as peer.py save).

Replicated parameters are made equal across the ranks that hold them (a mean over the
tensor- and data-parallel groups), as training's gradient all-reduce keeps them.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (patches torch.cuda for the CPU)

# megatron-core's tied-embedding setup moves the last stage's copy with `.cuda()` before
# all-reducing it with the first stage's embeddings: on the CPU it stays where it is
torch.Tensor.cuda = lambda self, *a, **k: self

TRACKER = "latest_checkpointed_iteration.txt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout(a) -> dict:
    return dict(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp,
                virtual_pipeline_model_parallel_size=a.vpp,
                pipeline_dtype=torch.float32)


def padded_vocab(tp: int) -> int:
    """Megatron-LM's padding: a multiple of make_vocab_size_divisible_by (128) x TP."""
    m = 128 * tp
    return -(-100 // m) * m


def _equalize_replicas(chunks) -> None:
    from megatron.core import parallel_state as ps

    groups = [(ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()),
              (ps.get_data_parallel_group(with_context_parallel=True),
               ps.get_data_parallel_world_size(with_context_parallel=True))]
    for chunk in chunks:
        tensors = [p for p in chunk.parameters()
                   if not getattr(p, "tensor_model_parallel", False)
                   and getattr(p, "allreduce", True)]
        tensors += [b for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
        with torch.no_grad():
            for t in tensors:
                for group, size in groups:
                    if size > 1:
                        torch.distributed.all_reduce(t.data, group=group)
                        t.data.div_(size)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": get_cuda_rng_tracker().get_states()}


def _optimizer_state(chunks) -> dict:
    """The FP32 optimizer's state_dict (Megatron-LM's FP32Optimizer.state_dict is the
    torch optimizer's) after one step, so the file holds Adam moments as a real one does."""
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.Adam(params, lr=1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    saved = [p.detach().clone() for p in params]
    opt.step()
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    return opt.state_dict()


def _checkpoint_name(a, it_dir: str) -> str:
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if a.pp > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if a.ep > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return os.path.join(it_dir, name, "model_optim_rng.pt")


def _args(a):
    ns = peer.megatron_args(a.variant, a.iteration)
    ns.padded_vocab_size = padded_vocab(a.tp)
    ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size = a.tp, a.pp
    ns.expert_model_parallel_size, ns.expert_tensor_parallel_size = a.ep, a.etp
    ns.virtual_pipeline_model_parallel_size = a.vpp
    ns.sequence_parallel = False
    ns.ckpt_format, ns.use_dist_ckpt = "torch", False
    ns.data_parallel_size = a.world // (a.tp * a.pp)
    return ns


def worker(rank: int, a) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.distributed.init_process_group("gloo", rank=rank, world_size=a.world)
    ps.initialize_model_parallel(a.tp, a.pp, a.vpp, expert_model_parallel_size=a.ep,
                                 expert_tensor_parallel_size=a.etp)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    pp_rank, stages = ps.get_pipeline_model_parallel_rank(), a.vpp or 1
    chunks = [peer.build_model(a.variant, padded_vocab(a.tp), _layout(a), dict(
        vp_stage=v if a.vpp else None, pp_rank=pp_rank,
        pre_process=pp_rank == 0 and v == 0,
        post_process=pp_rank == a.pp - 1 and v == stages - 1)) for v in range(stages)]
    _equalize_replicas(chunks)
    args = _args(a)
    it_dir = os.path.join(a.out, "release" if a.release else f"iter_{a.iteration:07d}")
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        state = {"args": args, "checkpoint_version": 3.0, "iteration": a.iteration}
        for v, chunk in enumerate(chunks):
            state["model" if stages == 1 else f"model{v}"] = chunk.state_dict_for_save_checkpoint()
        state["optimizer"] = _optimizer_state(chunks)
        state["opt_param_scheduler"] = peer.scheduler_state(args)
        state["rng_state"] = [_rng_state()]
        state["num_floating_point_operations_so_far"] = 1.5e12
        path = _checkpoint_name(a, it_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    sharded = {"model" if stages == 1 else f"model{v}": c.sharded_state_dict()
               for v, c in enumerate(chunks)}
    dist_dir = os.path.join(a.out, "torch_dist")
    # megatron-core's writer makes its results queue's Manager with 'spawn', which starts a
    # fresh interpreter per rank (seconds of imports each); a forked one serves the same
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
    if rank == 0:
        os.makedirs(dist_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sharded, dist_dir)
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(a.out, TRACKER), "w") as f:
            f.write("release" if a.release else str(a.iteration))
    torch.distributed.destroy_process_group()


def reference(a) -> None:
    """megatron-core's TP1/PP1/EP1 model loading the torch_dist copy: its logits."""
    from megatron.core import dist_checkpointing

    os.environ["MASTER_PORT"] = str(_free_port())
    peer.init_process_group()
    model = peer.build_model(a.variant, padded_vocab(a.tp))
    with torch.no_grad():
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and torch.is_floating_point(t):
                t.fill_(float("nan"))
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                     os.path.join(a.out, "torch_dist"))
    model.load_state_dict(loaded["model"], strict=False)
    out = peer.logits(model)
    assert not torch.isnan(out).any(), "the torch_dist copy left weights unloaded"
    torch.save(out, os.path.join(a.out, "reference_logits.pt"))
    if model.config.mtp_num_layers:
        torch.save(peer.mtp_logits(model), os.path.join(a.out, "reference_mtp_logits.pt"))
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=sorted(peer.VARIANTS), default="mixtral")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None, help="expert TP (default: TP)")
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--iteration", type=int, default=7)
    p.add_argument("--release", action="store_true")
    a = p.parse_args()
    etp = a.tp if a.etp is None else a.etp
    a.etp = etp
    # world = TP*PP*DP = ETP*EP*EDP*PP with the smallest DP
    dp = 1
    while (a.tp * dp) % (etp * a.ep):
        dp += 1
    a.world = a.tp * a.pp * dp
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    torch.manual_seed(0)
    # imported once here, inherited by the forked ranks (each would import it again)
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    mp.start_processes(worker, args=(a,), nprocs=a.world, start_method="fork")
    reference(a)


if __name__ == "__main__":
    sys.exit(main())
