"""--use-precision-aware-optimizer: Adam's moments stored in bf16 / fp16 between steps,
updated in fp32 (training/optim/state_precision.py), main gradients in bf16.

- One Adam step with bf16 (or TE-scaled fp16) moments equals a hand-written reference that
  upcasts the stored moments, runs the same fp32 update and rounds them back: bitwise, one
  process, the same kernel.
- A few-iteration training run with bf16 moments and bf16 main gradients stays within a
  stated bound of the fp32 run.
- Checkpoints keep the states in their dtype and load into a run with other dtypes; bf16
  moments survive two resumes bitwise under either Adam kernel.
- The distributed optimizer's state bytes and the planner's count shrink by the dtype's
  factor; the step adds no host sync; unbuilt and invalid combinations are one line.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.config import OptimizerConfig
from megamoe.training.optim.common import build_inner_optimizer
from megamoe.training.optim.distributed import DistributedOptimizer
from tests.distributed import run_distributed
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

AWARE = dict(lr=1e-2, weight_decay=0.1, adam_beta2=0.95, use_precision_aware_optimizer=True)


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _round_fp16_scaled(x: torch.Tensor) -> torch.Tensor:
    """Transformer Engine's FusedAdam._apply_scale then get_unscaled_state, written out:
    scale = absmax / (65504 / 2), stored fp16(x / scale), read back as stored x scale."""
    absmax = x.abs().max().reshape(1)
    scale = absmax / 32752.0
    rscale = 1.0 / scale if float(scale) > 0 else torch.zeros(1)
    return (x * rscale).to(torch.float16).float() * scale


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 11, generator=g), torch.randn(129, generator=g)]


@pytest.mark.parametrize("dtype, round_fn", [("bf16", _round_bf16),
                                             ("fp16", _round_fp16_scaled)])
def test_adam_step_equals_upcast_update_round(dtype, round_fn):
    """Three steps (the first creates the moments): parameters and stored moments bitwise
    equal to torch's fused AdamW on fp32 moments that are rounded by hand after each
    update; and not equal to the fp32-moment run (the rounding did happen)."""
    cfg = OptimizerConfig(**AWARE, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    ours = [p.clone() for p in _params(0)]
    ref = [p.clone() for p in _params(0)]
    plain = [p.clone() for p in _params(0)]
    opt = build_inner_optimizer([{"params": ours, "weight_decay": 0.1}], cfg)
    ref_opt = torch.optim.AdamW([{"params": ref, "weight_decay": 0.1}], lr=cfg.lr,
                                betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                fused=True)
    plain_opt = build_inner_optimizer([{"params": plain, "weight_decay": 0.1}],
                                      OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95))
    for step in range(3):
        grads = _params(10 + step)
        for tensors in (ours, ref, plain):
            for p, g in zip(tensors, grads):
                p.grad = g.clone()
        opt.step()
        ref_opt.step()
        plain_opt.step()
        for p in ref:  # round the fp32 moments as the storage must
            for name in ("exp_avg", "exp_avg_sq"):
                ref_opt.state[p][name].copy_(round_fn(ref_opt.state[p][name]))
        for p, q in zip(ours, ref):
            assert torch.equal(p, q), f"step {step + 1}: parameters differ"
            for name in ("exp_avg", "exp_avg_sq"):
                stored = opt.state[p][name]
                assert stored.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
                assert torch.equal(opt.unscaled(p, name), ref_opt.state[q][name]), name
    assert not all(torch.equal(p, q) for p, q in zip(ours, plain))


def test_state_bytes_shrink_by_the_dtype_factor():
    """The distributed optimizer's measured state bytes (fp32 model: the main slice is the
    parameter's own) with bf16 moments are half the fp32 moments', and the planner counts
    the same factor for the optimizer states of a launch (--dry-run)."""
    torch.manual_seed(0)

    def measured(**dtypes) -> int:
        model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8))
        opt = DistributedOptimizer(model, OptimizerConfig(**AWARE, **dtypes), tp_group=None,
                                   dp_group=None)
        model(torch.randn(3, 16)).sum().backward()
        opt.step()
        return opt.state_bytes()

    fp32 = measured()
    assert measured(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16") * 2 == fp32
    assert measured(exp_avg_dtype="fp16") * 4 == fp32 * 3

    def planned(extra: str) -> dict:
        out: list[str] = []
        args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 1 --dry-run --json --bf16 "
                                      f"--use-distributed-optimizer {extra}"), world_size=1)
        pretrain(args, print_fn=out.append)
        return json.loads(out[-1])["per_rank_memory_bytes"]

    base = planned("")
    low = planned("--use-precision-aware-optimizer --exp-avg-dtype bf16 "
                  "--exp-avg-sq-dtype bf16 --main-grads-dtype bf16")
    # bf16 model: fp32 main (4) + two moments (4 + 4) -> 4 + 2 + 2 bytes per element
    assert low["optimizer"] * 12 == base["optimizer"] * 8
    assert low["gradients"] * 2 == base["gradients"]  # fp32 -> bf16 main gradients
    assert low["weights"] == base["weights"]


def _train(extra: str, iters: int = 6) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters {iters} --bf16 "
                                  f"--use-distributed-optimizer {extra}"), world_size=1)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


def test_training_with_bf16_moments_and_grads_stays_near_fp32():
    """Six iterations of the tiny MoE (bf16 model): bf16 moments and bf16 main gradients
    against fp32 ones. Each stored moment carries a relative rounding of at most 2^-9 per
    step, and bf16 gradient accumulation over 4 micro-batches a few 2^-9 more; at lr 1e-3
    the weights move by ~1e-3 per step, so the loss may differ by a few 1e-4 relative after
    six steps. Bound: 2e-4 relative (measured 8.4e-6 here; 25x margin for another CPU's
    kernels). The runs must differ (the storage is real)."""
    fp32 = _train("")
    low = _train("--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 "
                 "--main-grads-dtype bf16")
    assert low != fp32
    worst = max(abs(a - b) / abs(b) for a, b in zip(low, fp32))
    print(f"largest relative loss difference over {len(fp32)} iterations: {worst:.2e}")
    assert worst < 2e-4, (low, fp32)


def _saved_dtypes(ckpt) -> dict[str, torch.dtype]:
    """{state name: dtype} of the optimizer tensors in a torch_dist checkpoint's metadata
    (every parameter's state of one name has one dtype)."""
    import torch.distributed.checkpoint as dcp

    (folder,) = [p for p in ckpt.iterdir() if p.name.startswith("iter_")]
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    out: dict[str, set] = {}
    for key, item in meta.items():
        if key.startswith("optimizer.") and hasattr(item, "properties"):
            out.setdefault(key.rsplit(".", 1)[1], set()).add(item.properties.dtype)
    assert all(len(v) == 1 for v in out.values()), out
    return {k: v.pop() for k, v in out.items()}


BF16_MOMENTS = "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"


def test_checkpoint_keeps_state_dtypes_and_loads_into_other_dtypes(tmp_path):
    """torch_dist: bf16 moments are saved as bf16 (fp16 ones as their fp32 values, TE's
    state_dict rule), a resume with the same dtypes continues exactly, and a checkpoint
    loads into a run whose moments have another dtype (cast on load)."""
    straight = _train(BF16_MOMENTS, 4)
    ckpt = tmp_path / "bf16"
    _train(f"{BF16_MOMENTS} --exit-interval 2 --save {ckpt} --save-interval 2", 4)
    assert _saved_dtypes(ckpt) == {"main": torch.float32, "exp_avg": torch.bfloat16,
                                   "exp_avg_sq": torch.bfloat16}
    assert _train(f"{BF16_MOMENTS} --load {ckpt}", 4) == straight[2:]
    as_fp32 = _train(f"--load {ckpt}", 4)  # fp32 moments from bf16 ones: exact upcast
    assert max(abs(a - b) / b for a, b in zip(as_fp32, straight[2:])) < 2e-4

    # --ckpt-format torch keeps the optimizer's state_dict: fp16 states as fp32 values,
    # scaled again on load (the scale may move by an ulp: 1e-6 relative)
    single, mixed = tmp_path / "single_file", f"{BF16_MOMENTS} --exp-avg-sq-dtype fp16"
    straight_mixed = _train(mixed, 4)
    _train(f"{mixed} --ckpt-format torch --exit-interval 2 --save {single} --save-interval 2",
           4)
    resumed = _train(f"{mixed} --ckpt-format torch --load {single}", 4)
    assert max(abs(a - b) / b for a, b in zip(resumed, straight_mixed[2:])) < 1e-6

    fp16 = tmp_path / "fp16"
    _train(f"--use-precision-aware-optimizer --exp-avg-dtype fp16 --exit-interval 2 "
           f"--save {fp16} --save-interval 2", 4)
    assert _saved_dtypes(fp16)["exp_avg"] == torch.float32  # unscaled: layout-free
    as_bf16 = _train(f"{BF16_MOMENTS} --load {fp16}", 4)
    assert max(abs(a - b) / b for a, b in zip(as_bf16, straight[2:])) < 2e-4


def _dp_worker(rank: int, world: int, extra: str) -> list[float]:
    args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 --bf16 "
                                  f"--use-distributed-optimizer {extra}"), world_size=world)
    return [h["lm loss"] for h in pretrain(args, print_fn=lambda _m: None).history]


@pytest.mark.slow  # 33 s here (the single-rank distributed optimizer: the bytes test)
def test_dp2_sharded_bf16_states_and_grads_match_single_process():
    """DP = 2: the distributed optimizer's shard pieces hold bf16 moments and bf16 grad
    buffers (reduce-scattered in bf16). Losses match one process within 2e-4 relative:
    the two reductions round the bf16 gradient sums in different orders (2^-9 relative
    each), which reaches the loss through the next updates only."""
    flags = f"{BF16_MOMENTS} --main-grads-dtype bf16"
    single = _dp_worker(0, 1, flags)
    per_rank = run_distributed(_dp_worker, 2, 300, flags)
    assert per_rank[0] == per_rank[1]
    worst = max(abs(a - b) / b for a, b in zip(per_rank[0], single))
    print(f"DP2 vs single process, largest relative loss difference: {worst:.2e}")
    assert worst < 2e-4, (per_rank[0], single)


@pytest.mark.parametrize("flags, world, says", [
    ("--exp-avg-dtype bf16", 1, "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    ("--main-params-dtype fp16", 1, "--main-params-dtype fp16 needs "
                                    "--use-precision-aware-optimizer"),
    (f"{BF16_MOMENTS}", 1, "--use-precision-aware-optimizer only supported with "
                           "--use-distributed-optimizer"),
    (f"{BF16_MOMENTS} --use-distributed-optimizer --optimizer sgd", 1,
     "--use-precision-aware-optimizer only supported with --optimizer adam"),
    (f"{BF16_MOMENTS} --use-distributed-optimizer --exp-avg-sq-dtype fp8", 1,
     "not supported yet: --exp-avg-sq-dtype fp8"),
    (f"{BF16_MOMENTS} --use-distributed-optimizer --main-params-dtype fp16", 1,
     "not supported yet: --main-params-dtype fp16"),
    (f"{BF16_MOMENTS} --use-distributed-optimizer --main-grads-dtype bf16", 1,
     "--main-grads-dtype bf16 needs --bf16"),
    (f"{BF16_MOMENTS} --use-distributed-optimizer --main-grads-dtype bf16 --bf16 "
     "--accumulate-allreduce-grads-in-fp32", 1,
     "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32"),
])
def test_unbuilt_and_invalid_combinations_are_one_line(capsys, flags, world, says):
    """Megatron's rules (OptimizerConfig.__post_init__, get_megatron_optimizer,
    validate_args) and what is not built yet: one line naming the flag, exit 2."""
    err = parse_error(capsys, f"{TINY_MOE} --train-iters 1 {flags}", world)
    assert says in err, err


def test_precision_aware_step_adds_no_host_sync():
    """A training step of the distributed optimizer (one rank) with fp16-scaled and bf16
    moments and bf16 grad buffers makes exactly the host syncs of the plain one: scales,
    upcasts and rounding stay on the device."""
    from megamoe.cli.mapping import run_config_from_args
    from megamoe.parallel.mesh import single_process_mesh
    from megamoe.training.build import build_model
    from megamoe.training.loop import train_step
    from megamoe.training.schedules.lr import LRScheduler
    from tests.moe.test_host_syncs import HostSyncCounter
    from tests.training.test_nan_check import _batches

    counts = {}
    for flags in ("", "--use-precision-aware-optimizer --exp-avg-dtype fp16 "
                      "--exp-avg-sq-dtype bf16 --main-grads-dtype bf16"):
        args = parse_args(shlex.split(f"{TINY_MOE} --train-iters 4 --bf16 "
                                      f"--use-distributed-optimizer {flags}"), world_size=1)
        run = run_config_from_args(args, 97)
        mesh = single_process_mesh(torch.device("cpu"))
        model = build_model(run, mesh)
        opt = DistributedOptimizer(model, run.optim, tp_group=None, dp_group=None)
        scheduler = LRScheduler(opt, run.optim, run.train.train_iters)
        data = _batches(0)
        train_step(run, mesh, model, opt, scheduler, data, 1)
        with HostSyncCounter() as counter:
            train_step(run, mesh, model, opt, scheduler, data, 2)
        counts[flags] = counter.by_op
    plain, aware = counts.values()
    assert aware == plain


@pytest.mark.parametrize("which", ["plain", "distributed"])
@pytest.mark.parametrize("kind", ["torch-fused", "apex"])
def test_bf16_moments_survive_two_resumes_bitwise(monkeypatch, kind, which):
    """tests/parallel/test_adam_step_resume.py's check with bf16 moments: saved at 3 and 5
    (in bf16), resumed, and at 7 bitwise the run that never stopped, under torch's fused
    AdamW (a step per parameter) and apex's FusedAdam (a step per group: the stand-in)."""
    from megamoe.training.optim.state_precision import StoredStates
    from tests.parallel import test_adam_step_resume as resume

    monkeypatch.setattr(resume, "CONFIG", OptimizerConfig(**AWARE, exp_avg_dtype="bf16",
                                                          exp_avg_sq_dtype="bf16"))
    resume._use(kind, monkeypatch)
    model = resume._model()
    opt = resume._build(which, model)
    assert isinstance(opt.optimizer, StoredStates)
    straight = {}
    for stop in (3, 5, 7):
        resume._train(model, opt, range(stop - 2 if stop > 3 else 0, stop))
        straight[stop] = resume._snapshot(model, opt)
    assert straight[7]["states"][0]["exp_avg"].dtype == torch.bfloat16
    model, opt = resume._resume(which, resume._init_then_train(which, 3))
    resume._train(model, opt, range(3, 5))
    at5 = resume._snapshot(model, opt)
    resume._assert_same(at5, straight[5], "saved at 5")
    model, opt = resume._resume(which, at5)
    resume._train(model, opt, range(5, 7))
    resume._assert_same(resume._snapshot(model, opt), straight[7], "after the second resume")
