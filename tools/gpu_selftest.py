#!/usr/bin/env python
"""The pieces of scripts/gpu_selftest.sh: checks that only a CUDA GPU can make.

    python tools/gpu_selftest.py env                 versions, GPUs, optional kernels (JSON)
    python tools/gpu_selftest.py kernels             GPU kernels against the portable math
    python tools/gpu_selftest.py te                  Transformer Engine's path against local
    python tools/gpu_selftest.py fp8                 each FP8 recipe's kernel this GPU has
                                                     against the reference (selftest_fp8.py)
    python tools/gpu_selftest.py fp8-recipes         those recipes' names, one line
    python tools/gpu_selftest.py history OUT -- FLAGS  run pretrain_gpt.py FLAGS (under
                                                     torchrun too); rank 0 writes the
                                                     per-iteration metrics and log to OUT
    python tools/gpu_selftest.py compare REF RUN ...   tools/selftest_compare.py's (the
    python tools/gpu_selftest.py learns RUN ...        script calls that one: no torch)
    python tools/gpu_selftest.py syncs OUT FILE=N[,FILE=N] -- FLAGS
                                             whole training steps under CUDA's sync debug
                                             mode "error" (tools/selftest_syncs.py)
    python tools/gpu_selftest.py dryrun --gpus N --work DIR  every run of an N-GPU machine
                                             (tools/selftest_layouts.py) through the
                                             rules and --dry-run, without training

Every command prints one JSON line and exits 0 (pass), 1 (fail) or 2 (no CUDA GPU where one
is needed). The CPU runs of the test suite prove the same parities on gloo; this proves
them under NCCL, CUDA kernels and their real synchronisation.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/selftest_*.py

import selftest_fp8  # noqa: E402
import selftest_layouts  # noqa: E402
import torch  # noqa: E402
from selftest_compare import COMMANDS, add_commands, bf16_rtol  # noqa: E402,F401 (tests)
from selftest_syncs import SANCTIONED, SanctionedReads, verdict  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from megamoe.cli.arguments import parse_args  # noqa: E402
from megamoe.cli.main import pretrain  # noqa: E402
from megamoe.config import ModelConfig, MoEConfig, OptimizerConfig  # noqa: E402
from megamoe.model.apex_kernels import apex_kernels  # noqa: E402
from megamoe.model.attention import SelfAttention  # noqa: E402
from megamoe.model.norms import RMSNorm  # noqa: E402
from megamoe.model.rope import rotary_cos_sin  # noqa: E402
from megamoe.moe.grouped_gemm import (  # noqa: E402
    available_backends,
    grouped_mm,
    resolve_backend,
)
from megamoe.moe.layer import MoELayer  # noqa: E402
from megamoe.training.optim.common import build_inner_optimizer  # noqa: E402

# Host syncs of one MoE layer forward + backward on one GPU (tests/moe/test_host_syncs.py
# counts the same on the CPU): the permutation's nonzero, plus one host copy of the group
# sizes for the backends that take them on the host. At least one: a count of zero means
# the counter saw nothing (the nonzero always syncs), not a sync-free layer.
EXPECTED_SYNCS = {"torch": 1, "loop": 2, "grouped_gemm": 2}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(REPO, "megamoe") + os.sep


def _emit(report: dict, ok: bool) -> int:
    print(json.dumps({**report, "ok": ok}))
    return 0 if ok else 1


def _need_gpu() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA GPU visible"}))
        sys.exit(2)


def cmd_env(_: argparse.Namespace) -> int:
    """What the checks ran on (for the note)."""
    report = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
              "nccl": ".".join(map(str, torch.cuda.nccl.version()))
              if torch.cuda.is_available() else None,
              "optional": {m: importlib.util.find_spec(m) is not None
                           for m in ("apex", "grouped_gemm", "transformer_engine")},
              "grouped_backends": available_backends()}
    if torch.cuda.is_available():  # what a bf16 --moe-grouped-gemm run gets on this GPU
        x = torch.zeros(64, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(4, 256, 128, device="cuda", dtype=torch.bfloat16)
        report["grouped_backend_bf16"] = resolve_backend(x, w)
        kernels = apex_kernels()
        report["apex"] = {"fused_adam": kernels.fused_adam is not None,
                          "fused_norms": kernels.fused_rms_norm_affine is not None,
                          "problems": list(kernels.problems)}
    return _emit(report, True)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _check_grouped_gemm(device: torch.device) -> dict:
    """Every backend's bf16 forward and gradients against the fp32 per-expert loop."""
    g = torch.Generator(device="cpu").manual_seed(0)
    sizes = torch.tensor([96, 0, 160, 32, 224, 0, 64, 192], device="cpu")  # host sizes
    x = torch.randn(int(sizes.sum()), 256, generator=g).to(device)
    w = (torch.randn(8, 256, 384, generator=g) * 0.05).to(device)
    ref_x, ref_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    grouped_mm(ref_x, ref_w, sizes.to(device), "loop").square().sum().backward()
    out = {}
    for backend in available_backends():
        xb = x.bfloat16().requires_grad_(True)
        wb = w.bfloat16().requires_grad_(True)
        y = grouped_mm(xb, wb, sizes.to(device), backend)
        y.float().square().sum().backward()
        y_ref = grouped_mm(x, w, sizes.to(device), "loop")
        out[backend] = {"y": _max_rel(y, y_ref), "dx": _max_rel(xb.grad, ref_x.grad),
                        "dw": _max_rel(wb.grad, ref_w.grad)}
    return out


def _count_syncs(fn) -> tuple[int, list[str]]:
    """Synchronising CUDA calls fn makes (torch's sync debug mode warns on each), and
    where: the innermost megamoe (or this file's) frame of each, so a count over the
    expected one names its source. Only warnings raised while fn runs count: on an H200
    with torch 2.11, switching the mode on warned once by itself (seen, 2026-11-26)."""
    torch.cuda.synchronize()
    sites, running = [], [False]

    def record(message, category, filename, lineno, file=None, line=None):
        if running[0] and "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if f.filename.startswith(PACKAGE_DIR) or f.filename == __file__]
            where = frames[-1] if frames else None
            sites.append(f"{os.path.relpath(where.filename, REPO)}:{where.lineno} "
                         f"{where.line}" if where else f"{filename}:{lineno}")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            running[0] = True
            fn()
        finally:
            running[0] = False
            torch.cuda.set_sync_debug_mode("default")
    return len(sites), sites


def _moe_syncs(device: torch.device) -> dict:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, topk=2, ffn_hidden_size=512)
    layer = MoELayer(cfg, 256, init_method_std=0.02, swiglu=True, grouped_gemm=True)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    x = torch.randn(1024, 256, device=device, dtype=torch.bfloat16)
    counts, sites = {}, {}
    for backend in available_backends():
        layer.experts.backend = backend

        def step() -> None:
            y = layer(x.detach().requires_grad_(True))
            y = y[0] if isinstance(y, tuple) else y
            y.float().square().mean().backward()
        step()  # warm-up: first calls may synchronise for allocation
        counts[backend], sites[backend] = _count_syncs(step)
    return counts, sites


def _flash_attention(device: torch.device) -> float:
    """--use-flash-attn against SDPA's math kernel, bf16, forward, grouped-query heads."""
    cfg = ModelConfig(num_layers=1, hidden_size=256, num_attention_heads=4,
                      num_query_groups=2, seq_length=128, max_position_embeddings=128,
                      attention_dropout=0.0, position_embedding_type="rope",
                      use_flash_attn=True)
    torch.manual_seed(0)
    attn = SelfAttention(cfg).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(128, 2, 256, device=device, dtype=torch.bfloat16)
    cos, sin = (t.to(device) for t in rotary_cos_sin(128, 64, 10000.0))
    flash = attn(x, (cos, sin))
    attn.use_flash_attn = False
    with sdpa_kernel(SDPBackend.MATH):
        return _max_rel(flash, attn(x, (cos, sin)))


def _fused_optimizer(device: torch.device) -> float:
    """The fused Adam (apex or torch fused) against torch's for-loop AdamW, 3 steps."""
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    g = torch.Generator(device="cpu").manual_seed(0)
    init = torch.randn(1000, generator=g).to(device)
    grads = [torch.randn(1000, generator=g).to(device) for _ in range(3)]
    a, b = init.clone().requires_grad_(True), init.clone().requires_grad_(True)
    fused = build_inner_optimizer([{"params": [a], "weight_decay": 0.1}], cfg)
    plain = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, foreach=False,
                              betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    for grad in grads:
        a.grad, b.grad = grad.clone(), grad.clone()
        fused.step()
        plain.step()
    return _max_rel(a.detach(), b.detach())


def cmd_kernels(_: argparse.Namespace) -> int:
    _need_gpu()
    device = torch.device("cuda", torch.cuda.current_device())
    gg = _check_grouped_gemm(device)
    syncs, sync_sites = _moe_syncs(device)
    norm = RMSNorm(256).to(device)
    x = torch.randn(64, 256, device=device)
    portable = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    report = {"grouped_gemm_bf16_vs_fp32_loop": gg, "moe_layer_host_syncs": syncs,
              "moe_layer_sync_sites": sync_sites,
              "rmsnorm_vs_portable": _max_rel(norm(x), portable),
              "flash_attention_vs_sdpa": _flash_attention(device),
              "fused_adam_vs_adamw": _fused_optimizer(device)}
    ok = (all(v < 2e-2 for r in gg.values() for v in r.values())
          and all(1 <= syncs[b] <= EXPECTED_SYNCS[b] for b in syncs)
          and report["rmsnorm_vs_portable"] < 1e-5
          and report["flash_attention_vs_sdpa"] < 2e-2
          and report["fused_adam_vs_adamw"] < 1e-5)
    return _emit(report, ok)


# A one-GPU model for the TE check: the dense layer 0 runs LayerNormLinear's fc1, layer 1
# the experts' GroupedLinear and the shared experts; widths multiples of 16 (FP8 GEMMs).
TE_MODEL = ("--num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 8 "
            "--group-query-attention --num-query-groups 4 --seq-length 128 "
            "--max-position-embeddings 128 --normalization RMSNorm --position-embedding-type "
            "rope --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
            "--attention-dropout 0.0 --hidden-dropout 0.0 --num-experts 8 --moe-router-topk 2 "
            "--moe-ffn-hidden-size 256 --moe-grouped-gemm --moe-layer-freq ([0]+[1]*1) "
            "--moe-shared-expert-intermediate-size 256 --mock-data --tokenizer-type "
            "NullTokenizer --vocab-size 256 --micro-batch-size 4 --global-batch-size 4 "
            "--train-iters 1 --lr 1e-3 --seed 5")
# The same with DeepSeek-V3's attention (MLA's TE spec: latent norms fused into the up
# projections, DotProductAttention with q/k head dim 48 and v head dim 32).
TE_MLA_MODEL = (TE_MODEL.replace("--group-query-attention --num-query-groups 4 ", "")
                + " --multi-latent-attention --q-lora-rank 128 --kv-lora-rank 64 "
                  "--qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --qk-layernorm")


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def te_parity(device: torch.device, flags: str, te_flags: str = "",
              model_flags: str = TE_MODEL) -> dict:
    """One forward and backward of `model_flags` + `flags`, local against --transformer-impl
    transformer_engine + `te_flags` (the same seed: the same weights): the norm-wise
    relative difference of the logits and the largest of the gradients'."""
    from megamoe.cli.mapping import run_config_from_args
    from megamoe.parallel.mesh import single_process_mesh
    from megamoe.training.build import build_model

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 128), generator=gen).to(device)
    labels = torch.randint(0, 256, (4, 128), generator=gen).to(device)
    out = []
    for impl in ("", f"--transformer-impl transformer_engine {te_flags}"):
        args = parse_args(f"{model_flags} {flags} {impl}".split(), world_size=1)
        model = build_model(run_config_from_args(args, 256), single_process_mesh(device))
        logits = model(tokens).detach()
        model(tokens, labels=labels).float().mean().backward()
        out.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (local, g_local), (te, g_te) = out
    return {"logits": _rel_norm(te, local),
            "grads": max(_rel_norm(g_te[n], g_local[n]) for n in g_local)}


def cmd_te(_: argparse.Namespace) -> int:
    """Transformer Engine's path against the local path on this GPU: bf16, also with MLA
    (both round to
    bf16: within 2e-2 norm-wise, not yet calibrated on hardware) and, on sm89+, TE's
    tensor-wise FP8 against local bf16 within 0.25 (2u of E4M3's 2^-3 spacing, as
    docs/fp8.md's bound for megamoe's own FP8)."""
    _need_gpu()
    from megamoe.model.te.loader import TransformerEngineMissing, load_transformer_engine
    try:
        load_transformer_engine()
    except TransformerEngineMissing as e:
        return _emit({"skipped": str(e)}, True)
    device = torch.device("cuda", torch.cuda.current_device())
    report = {"bf16": te_parity(device, "--bf16"),
              "bf16_mla": te_parity(device, "--bf16", model_flags=TE_MLA_MODEL)}
    ok = all(report[k]["logits"] < 2e-2 and report[k]["grads"] < 2e-2
             for k in ("bf16", "bf16_mla"))
    if torch.cuda.get_device_capability(device) >= (8, 9):
        report["fp8_tensorwise"] = te_parity(device, "--bf16",
                                             "--fp8-format hybrid --fp8-recipe tensorwise")
        ok = ok and report["fp8_tensorwise"]["logits"] < 0.25
    return _emit(report, ok)


def cmd_history(opts: argparse.Namespace) -> int:
    lines: list[str] = []
    state = pretrain(parse_args(opts.flags), print_fn=lines.append)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(opts.out, "w") as f:
            json.dump({"history": state.history, "log": lines}, f)
    return 0


def _per_step(words: list[str]) -> dict[str, int]:
    """FILE=N words; FILE may be a sanctioned file's last part (permute.py)."""
    out = {}
    for word in words:
        name, _, n = word.partition("=")
        sites = [s for s in SANCTIONED if s == name or s.endswith("/" + name)]
        if len(sites) != 1 or not n.isdigit():
            raise SystemExit(f"syncs: {word!r}: expected FILE=N, FILE one of "
                             f"{', '.join(SANCTIONED)}")
        out[sites[0]] = int(n)
    return out


def cmd_syncs(opts: argparse.Namespace) -> int:
    """Train under the sync debug mode "error" from the second step on; the sanctioned
    reads are let through and counted (tools/selftest_syncs.py)."""
    per_step = _per_step(opts.per_step.split(","))
    lines: list[str] = []
    with SanctionedReads() as reads:
        state = pretrain(parse_args(opts.flags), print_fn=lines.append)
    problems = verdict(dict(reads.counts), reads.steps, per_step)
    report = {"counts": dict(reads.counts), "steps": reads.steps, "per_step": per_step,
              "sync_debug_mode": "error" if reads.cuda else "off (no CUDA: counted only)",
              "problems": problems}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(opts.out, "w") as f:
            json.dump({"history": state.history, "log": lines, "syncs": report}, f)
    return _emit(report, not problems)


def dry_run_row(row: selftest_layouts.Row, work: str) -> str:
    """The row's flags through pretrain_gpt.py's parser, rules and --dry-run at its
    world size, in this process: "" when they pass, else the one line they print."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(selftest_layouts.argv(row, work, dry_run=True),
                              world_size=row.gpus)
            pretrain(args, print_fn=lambda _: None)
    except SystemExit as e:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() \
            else f"exit {e.code}"
    except Exception as e:  # a rule raised past the parser: still one line, the row's
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return ""


def cmd_dryrun(opts: argparse.Namespace) -> int:
    """Every run of a machine with --gpus GPUs, dry (no process group, no training): one
    PASS/FAIL line each, the way the script prints its checks."""
    failed = 0
    for row in selftest_layouts.rows_for(opts.gpus):
        problem = dry_run_row(row, opts.work)
        print(f"{'FAIL' if problem else 'PASS'} dry_{row.name} ({row.gpus} GPU(s))"
              + (f": {problem}" if problem else ""))
        failed |= bool(problem)
    return int(failed)


def cmd_fp8(_: argparse.Namespace) -> int:
    """Every FP8 recipe this GPU supports: its kernel chosen (no fallback to the
    reference) and equal to the reference GEMM to bf16 rounding (tools/selftest_fp8.py)."""
    _need_gpu()
    device = torch.device("cuda", torch.cuda.current_device())
    recipes = selftest_fp8.supported_recipes(torch.cuda.get_device_capability(device))
    if not recipes:
        return _emit({"skipped": "no FP8 tensor cores before sm89"}, True)
    report, ok = selftest_fp8.fp8_kernel_report(device, recipes)
    return _emit(report, ok)


def cmd_fp8_recipes(_: argparse.Namespace) -> int:
    """The recipes for the script's FP8 training runs (none without a GPU)."""
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(torch.cuda.current_device())
        print(" ".join(selftest_fp8.supported_recipes(cap)))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env")
    sub.add_parser("kernels")
    sub.add_parser("te")
    sub.add_parser("fp8")
    sub.add_parser("fp8-recipes")
    h = sub.add_parser("history")
    h.add_argument("out")
    h.add_argument("flags", nargs=argparse.REMAINDER)
    add_commands(sub)
    y = sub.add_parser("syncs")
    y.add_argument("out")
    y.add_argument("per_step", metavar="FILE=N[,FILE=N...]")
    y.add_argument("flags", nargs=argparse.REMAINDER)
    d = sub.add_parser("dryrun")
    d.add_argument("--gpus", type=int, required=True)
    d.add_argument("--work", required=True)
    opts = p.parse_args(argv)
    if opts.cmd in ("history", "syncs") and opts.flags[:1] == ["--"]:
        opts.flags = opts.flags[1:]
    return {**COMMANDS, "env": cmd_env, "kernels": cmd_kernels, "te": cmd_te,
            "fp8": cmd_fp8, "fp8-recipes": cmd_fp8_recipes, "history": cmd_history,
            "syncs": cmd_syncs, "dryrun": cmd_dryrun}[opts.cmd](opts)


if __name__ == "__main__":
    sys.exit(main())
