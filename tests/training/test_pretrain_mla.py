"""pretrain_gpt.py-level parity for multi-latent attention: a tiny DeepSeek-V3-like model
(MLA with q compression, latent norms and YaRN, a dense first layer then MoE) trains with
the single-process losses and grad norms (fp32, rel 1e-5) under TP=2+SP, PP=2 and EP=2 x
TP=2+SP with the distributed optimizer, and under context parallelism with document
masking (CP=2 p2p; slow set: allgather, CP=2 x TP=2+SP, recompute, the DeepSeek-V3
recipe with and without MTP); --recompute-modules mla_up_proj changes nothing; an MLA
checkpoint saved at TP=2 resumes at TP=1 and one saved at TP=1 resumes at TP=2 with the
losses of a run that never changed layout."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.main import pretrain
from megamoe.training.checkpoint import checkpoint_file, read_dist_tensors
from tests.distributed import run_distributed
from tests.training.test_pretrain import TINY_MOE

MLA = (TINY_MOE.replace("--group-query-attention ", "")
       + " --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 "
         "--qk-pos-emb-head-dim 4 --v-head-dim 6 --qk-layernorm --rotary-scaling-factor 4 "
         "--mscale 0.9 --mscale-all-dim 0.8 --moe-layer-freq ([0]+[1]*1)")
KEYS = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")


def _history(extra: str, world_size: int) -> list[dict]:
    args = parse_args(shlex.split(f"{MLA} --train-iters 4 --clip-grad 0.05 {extra}"),
                      world_size=world_size)
    return pretrain(args, print_fn=lambda _msg: None).history


def _worker(rank: int, world_size: int, extra: str) -> list[dict]:
    return _history(extra, world_size)


_SINGLE: list[list[dict]] = []


def _single() -> list[dict]:
    if not _SINGLE:
        _SINGLE.append(_history("", 1))
    return _SINGLE[0]


def _same(single: list[dict], hist: list[dict], keys=KEYS) -> None:
    assert len(hist) == len(single)
    for a, b in zip(single, hist):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, single, hist)


def _check(extra: str, world_size: int) -> None:
    single = _single()
    assert all(h["grad norm"] > 0.05 for h in single)  # clipping active every step
    for hist in run_distributed(_worker, world_size, 300, extra):
        _same(single, hist)


@pytest.mark.slow
def test_mla_tp2_sp():
    _check("--tensor-model-parallel-size 2 --sequence-parallel", 2)


@pytest.mark.slow
def test_mla_pp2():
    _check("--pipeline-model-parallel-size 2", 2)


@pytest.mark.slow
def test_mla_ep2_x_tp2_sp_distributed_optimizer():
    _check("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
           "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer", 4)


def test_mla_up_proj_recompute_keeps_the_losses():
    _same(_single(), _history("--recompute-granularity selective --recompute-modules "
                              "mla_up_proj core_attn", 1))


def _losses_worker(rank: int, world_size: int, extra: str) -> list[float]:
    return [h["lm loss"] for h in _history(extra, world_size)]


@pytest.mark.slow
def test_mla_checkpoint_reshards_between_tp2_and_tp1(tmp_path):
    reference = [h["lm loss"] for h in _single()]
    tp2 = "--tensor-model-parallel-size 2 --sequence-parallel"
    save = "--exit-interval 2 --save-interval 2 --ckpt-format torch_dist --save"
    src = str(tmp_path / "tp2")
    for losses in run_distributed(_losses_worker, 2, 300, f"{tp2} {save} {src}"):
        assert losses == pytest.approx(reference[:2], rel=1e-5)
    keys = read_dist_tensors(checkpoint_file(src), "model.").keys()
    assert "model.decoder.layers.0.self_attention.linear_kv_up_proj.weight" in keys
    resumed = _losses_worker(0, 1, f"--ckpt-format torch_dist --load {src}")
    assert resumed == pytest.approx(reference[2:], rel=1e-5)
    src1 = str(tmp_path / "tp1")
    assert _losses_worker(0, 1, f"{save} {src1}") == pytest.approx(reference[:2], rel=1e-5)
    for losses in run_distributed(_losses_worker, 2, 300,
                                  f"{tp2} --ckpt-format torch_dist --load {src1}"):
        assert losses == pytest.approx(reference[2:], rel=1e-5)


# The whole DeepSeek-V3 recipe at tiny size: MLA (above), sigmoid scores with
# group-limited top-k, a scaling factor and the aux-loss-free expert bias, a shared
# expert, the sequence aux loss, a dense first layer and one MTP depth.
DSV3 = ("--moe-router-score-function sigmoid --moe-router-num-groups 2 "
        "--moe-router-group-topk 1 --moe-router-enable-expert-bias "
        "--moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 24 "
        "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 "
        "--mtp-num-layers 1")
DSV3_KEYS = ("lm loss", "seq_load_balancing_loss", "z_loss", "mtp_1 loss", "grad norm")
_SINGLE_DSV3: list[list[dict]] = []


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [
    ("--tensor-model-parallel-size 2 --sequence-parallel", 2),
    ("--pipeline-model-parallel-size 2", 2),
    ("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall", 2),
    ("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
     "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer", 4),
], ids=["tp2sp", "pp2", "ep2", "ep2-tp2sp-distopt"])
def test_deepseek_v3_recipe_matches_single_process(layout, world):
    """MLA + MTP + DeepSeek-V3 routing: every layout trains with the single-process lm
    loss, MTP loss, balancing losses and grad norms (fp32, rel 1e-5)."""
    if not _SINGLE_DSV3:
        _SINGLE_DSV3.append(_history(DSV3, 1))
    single = _SINGLE_DSV3[0]
    assert all(h["mtp_1 loss"] > 0 for h in single)
    for hist in run_distributed(_worker, world, 300, f"{DSV3} {layout}"):
        _same(single, hist, DSV3_KEYS)


# Context parallelism: MLA's core attention runs the cp ring (K at qk + pe, V at v head
# dims, MLA's softmax scale), RoPE sees each token's place in its document. The larger
# init makes the attention scores matter: at std 0.02 they are so small that even a wrong
# softmax scale moves the losses by < 1e-6.
DOCS = "--reset-attention-mask --reset-position-ids --eod-mask-loss --init-method-std 0.2"
_SINGLE_BY_FLAGS: dict[str, list[dict]] = {}


def _check_cp(flags: str, layout: str, world: int, keys=KEYS) -> None:
    """`flags` + `layout` on `world` ranks equals `flags` in one process."""
    if flags not in _SINGLE_BY_FLAGS:
        _SINGLE_BY_FLAGS[flags] = _history(flags, 1)
    single = _SINGLE_BY_FLAGS[flags]
    assert all(h["grad norm"] > 0.05 for h in single)  # clipping active every step
    for hist in run_distributed(_worker, world, 300, f"{flags} {layout}"):
        _same(single, hist, keys)


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_mla_cp2_with_documents_matches_single_process():
    _check_cp(DOCS, "--context-parallel-size 2", 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [
    ("--context-parallel-size 2 --cp-comm-type allgather", 2),
    ("--context-parallel-size 2 --cp-comm-type a2a", 2),
    ("--context-parallel-size 2 --cp-comm-type a2a --tensor-model-parallel-size 2 "
     "--sequence-parallel", 4),
    ("--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel", 4),
    ("--context-parallel-size 2 --recompute-granularity selective --recompute-modules "
     "mla_up_proj core_attn", 2),
], ids=["cp2-allgather", "cp2-a2a", "cp2-a2a-tp2sp", "cp2-tp2sp", "cp2-recompute"])
def test_mla_cp_layouts_match_single_process(layout, world):
    _check_cp(DOCS, layout, world)


@pytest.mark.slow
@pytest.mark.parametrize("mtp", [False, True], ids=["no-mtp", "mtp"])
def test_deepseek_v3_recipe_at_cp2_matches_single_process(mtp):
    """The DeepSeek-V3 recipe (above), with and without its MTP depth, under CP=2 with
    documents: lm loss, MTP loss, the sequence aux loss (its token counts summed over
    cp), z-loss and grad norms."""
    flags = f"{DSV3 if mtp else DSV3.replace('--mtp-num-layers 1', '')} {DOCS}"
    assert ("--mtp-num-layers" in flags) == mtp
    _check_cp(flags, "--context-parallel-size 2", 2,
              tuple(k for k in DSV3_KEYS if mtp or k != "mtp_1 loss"))
