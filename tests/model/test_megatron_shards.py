"""megatron_shards.merge_legacy against a naive sharding written here, for what the
megatron-core peer cannot produce on this machine (Transformer Engine's TEGroupedMLP
names `linear_fc1.weight{i}`) and, in the default set, expert TP = TP with SwiGLU halves
and interleaved stages without starting megatron-core (the peer tests in
tests/tools/test_convert_megatron_legacy.py are the real-peer proof)."""

from __future__ import annotations

import pytest
import torch

from megamoe.model.megatron_shards import LegacyLayout, merge_legacy

H, F, FE, E, L, V = 8, 12, 6, 4, 4, 32


def _full(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A megatron-core-named whole model (per-layer, per-expert names)."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    sd = {"embedding.word_embeddings.weight": r(V, H), "output_layer.weight": r(V, H),
          "decoder.final_layernorm.weight": r(H)}
    for i in range(L):
        p = f"decoder.layers.{i}."
        sd.update({p + "input_layernorm.weight": r(H), p + "pre_mlp_layernorm.weight": r(H),
                   p + "self_attention.linear_qkv.weight": r(4 * H, H),
                   p + "self_attention.linear_proj.weight": r(H, 2 * H),
                   p + "mlp.router.weight": r(E, H),
                   p + "mlp.shared_experts.linear_fc1.weight": r(2 * F, H),
                   p + "mlp.shared_experts.linear_fc2.weight": r(H, F)})
        for e in range(E):
            sd[p + f"mlp.experts.experts.{e}.linear_fc1.weight"] = r(2 * FE, H)
            sd[p + f"mlp.experts.experts.{e}.linear_fc2.weight"] = r(H, FE)
    return sd


def _shard(t: torch.Tensor, kind: str, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s piece, as megatron-core's parallel linears hold it."""
    if kind == "col":
        return t.chunk(n, 0)[rank]
    if kind == "row":
        return t.chunk(n, 1)[rank]
    if kind == "glu":
        gate, up = t.chunk(2, 0)
        return torch.cat([gate.chunk(n, 0)[rank], up.chunk(n, 0)[rank]])
    return t


def _kind(name: str) -> str:
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
        return "col"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "glu" if name.endswith("linear_fc1.weight") else "rep"


def _files(full: dict, lay: LegacyLayout, te_names: bool) -> dict:
    """(tp, pp, ep) -> [chunk state dicts] with local layer and expert numbers."""
    per, local_e = lay.layers_per_chunk, E // lay.ep
    files = {}
    for t in range(lay.tp):
        for p in range(lay.pp):
            for e in range(lay.ep):
                chunks = []
                for v in range(lay.chunks):
                    first = v * (L // lay.chunks) + p * per
                    sd = {}
                    if p == 0 and v == 0:
                        sd["embedding.word_embeddings.weight"] = _shard(
                            full["embedding.word_embeddings.weight"], "col", t, lay.tp)
                    if p == lay.pp - 1 and v == lay.chunks - 1:
                        sd["output_layer.weight"] = _shard(full["output_layer.weight"], "col",
                                                           t, lay.tp)
                        sd["decoder.final_layernorm.weight"] = full[
                            "decoder.final_layernorm.weight"]
                    for j in range(per):
                        g = f"decoder.layers.{first + j}."
                        for name, x in full.items():
                            if not name.startswith(g):
                                continue
                            rest = name[len(g):]
                            if ".experts.experts." not in rest:
                                sd[f"decoder.layers.{j}.{rest}"] = _shard(x, _kind(rest), t,
                                                                          lay.tp)
                                sd[f"decoder.layers.{j}.{rest}._extra_state"] = None
                                continue
                            ge, fc = int(rest.split(".")[3]), rest.split(".")[4]
                            if ge // local_e != e:
                                continue
                            i = ge % local_e
                            key = (f"mlp.experts.{fc}.weight{i}" if te_names else
                                   f"mlp.experts.local_experts.{i}.{fc}.weight")
                            sd[f"decoder.layers.{j}.{key}"] = _shard(
                                x, _kind(rest), t if lay.etp > 1 else 0, lay.etp)
                    chunks.append(sd)
                files[(t, p, e)] = chunks
    return files


@pytest.mark.parametrize("tp,pp,ep,etp,vpp,te", [
    (2, 2, 2, 2, None, True),   # TEGroupedMLP names, expert TP = TP
    (2, 1, 2, 2, None, False),  # SequentialMLP, expert SwiGLU halves over TP
    (1, 2, 2, 1, 2, False),     # interleaved: offsets v * L/V + p * L/(PP*V)
])
def test_merge_legacy_undoes_a_naive_sharding(tp, pp, ep, etp, vpp, te):
    full = _full(torch.Generator().manual_seed(0))
    lay = LegacyLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, num_layers=L, num_experts=E,
                       swiglu=True, tied=False)
    got = merge_legacy(_files(full, lay, te), lay)
    assert sorted(got) == sorted(full)
    for name, t in full.items():
        assert torch.equal(got[name], t), name


def test_unknown_tensor_is_an_error_not_a_guess():
    full = _full(torch.Generator().manual_seed(0))
    lay = LegacyLayout(tp=2, pp=1, ep=1, etp=2, vpp=None, num_layers=L, num_experts=E,
                       swiglu=True, tied=False)
    files = _files(full, lay, False)
    for t in (0, 1):
        files[(t, 0, 0)][0]["decoder.layers.0.mlp.new_thing.weight"] = torch.ones(2)
    with pytest.raises(ValueError, match="new_thing.weight: no known tensor-parallel layout"):
        merge_legacy(files, lay)


def test_expert_tp_ranks_must_hold_the_same_experts():
    full = _full(torch.Generator().manual_seed(0))
    lay = LegacyLayout(tp=2, pp=1, ep=1, etp=2, vpp=None, num_layers=L, num_experts=E,
                       swiglu=True, tied=False)
    files = _files(full, lay, False)
    del files[(1, 0, 0)][0]["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"]
    with pytest.raises(ValueError, match="expert TP rank 1 holds other experts"):
        merge_legacy(files, lay)


def test_mla_down_projections_split_or_duplicated():
    """MLA's down projections: the local spec splits them over TP (ColumnParallelLinear),
    the TE spec keeps them whole on every rank (TELinear duplicated, not producible by
    the CPU peer); the saved args' sizes tell which, anything else is an error."""
    from megamoe.model.megatron_shards import _merge_tp

    w = torch.randn(28, H)
    name = "self_attention.linear_kv_down_proj.weight"
    assert torch.equal(_merge_tp(name, list(w.chunk(2)), True, (24, 28)), w)
    assert torch.equal(_merge_tp(name, [w, w.clone()], True, (24, 28)), w)
    with pytest.raises(ValueError, match="neither whole nor a split of 28"):
        _merge_tp(name, [w[:10], w[:10]], True, (24, 28))
    with pytest.raises(ValueError, match="neither whole nor a split"):
        _merge_tp(name, list(w.chunk(2)), True, None)  # no MLA sizes in the args
