"""--multi-latent-attention's flags: read into ModelConfig, and bad combinations fail in one
line naming the flag (exit code 2)."""

from __future__ import annotations

import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from tests.flags import parse_error
from tests.training.test_pretrain import TINY_MOE

BASE = TINY_MOE.replace("--group-query-attention ", "") + " --train-iters 1"
MLA = f"{BASE} --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 " \
      "--qk-pos-emb-head-dim 4 --v-head-dim 6"


def test_mla_flags_reach_the_model_config():
    m = run_config_from_args(parse_args(shlex.split(
        f"{MLA} --rotary-scaling-factor 40 --mscale 1 --mscale-all-dim 1 --qk-layernorm"),
        world_size=1), 97).model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim,
            m.qk_pos_emb_head_dim, m.v_head_dim) == (True, 16, 8, 8, 4, 6)
    assert (m.rotary_scaling_factor, m.mscale, m.mscale_all_dim) == (40.0, 1.0, 1.0)
    assert m.mla_rope_type == "yarn" and m.original_max_position_embeddings == 4096


def test_mla_with_context_parallelism_is_accepted():
    """MLA runs under CP (its core attention is the cp ring's; the parity is in
    tests/training/test_pretrain_mla.py)."""
    run = run_config_from_args(parse_args(shlex.split(
        f"{MLA} --context-parallel-size 2 --cp-comm-type allgather "
        "--moe-router-load-balancing-type global_aux_loss"), world_size=2), 97)
    assert run.model.multi_latent_attention
    assert (run.parallel.context_parallel_size, run.parallel.cp_comm_type) == (2, ["allgather"])


@pytest.mark.parametrize("flags,world,message", [
    (f"{BASE} --q-lora-rank 16", 1, "--q-lora-rank needs --multi-latent-attention"),
    (f"{BASE} --kv-lora-rank 16", 1, "--kv-lora-rank needs --multi-latent-attention"),
    (f"{BASE} --mscale 0.5", 1, "--mscale needs --multi-latent-attention"),
    (f"{BASE} --rope-type yarn", 1, "--rope-type yarn needs --multi-latent-attention"),
    (f"{MLA} --group-query-attention --num-query-groups 2", 1,
     "--multi-latent-attention cannot be combined with --group-query-attention"),
    (f"{MLA} --add-qkv-bias", 1, "--add-qkv-bias cannot be combined with"),
    (f"{MLA} --qk-pos-emb-head-dim 3", 1, "MLA rotary dim 3"),
    (f"{MLA} --kv-lora-rank 0", 1, "--kv-lora-rank must be positive"),
    (f"{MLA} --rotary-scaling-factor 0", 1, "--rotary-scaling-factor must be > 0"),
    (f"{MLA} --hidden-size 48 --num-attention-heads 6 --tensor-model-parallel-size 4 "
     "--sequence-parallel", 4, "--num-attention-heads (6) must be divisible by "
                               "--tensor-model-parallel-size (4)"),
    (f"{BASE} --recompute-granularity selective --recompute-modules mla_up_proj", 1,
     "--recompute-modules mla_up_proj needs multi-latent attention"),
])
def test_bad_mla_flags_fail_in_one_line(capsys, flags, world, message):
    assert message in parse_error(capsys, flags, world)
