"""A checkpoint cannot run code: crafted pickles in the single-file format, in a torch_dist
checkpoint's common.pt and in its DCP .metadata are refused with one line naming the
file, by every reader (pretrain_gpt.py --load / --finetune, megamoe.from_checkpoint,
tools/checkpoint/convert.py), and the payload never runs."""

from __future__ import annotations

import io
import os
import pickle
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megamoe.training.checkpoint.safe_load import (
    CheckpointError,
    TensorOnlyLoadPlanner,
    load_torch_file,
    read_dcp_metadata,
)
from tests.training.test_pretrain import ROOT, TINY_MOE


class Payload:
    """Unpickling this creates `marker`: any code a loader lets run would do the same."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _craft_torch_file(path: str, marker: str) -> None:
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own test file
    state["args"] = dict(state["args"], trap=Payload(marker))
    torch.save(state, path)


def _craft_metadata(path: str, marker: str) -> None:
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own test file
    metadata.planner_data = {"trap": Payload(marker)}
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def _crafted(checkpoints, tmp_path, where: str) -> tuple[str, str, str]:
    """(save root, the crafted file, marker path) for `where` in single/common/metadata."""
    marker = str(tmp_path / "payload-ran")
    src = checkpoints["torch" if where == "single" else "torch_dist"]
    root = str(tmp_path / where)
    shutil.copytree(src, root)
    it = os.path.join(root, "iter_0000001")
    if where == "single":
        target = os.path.join(it, "model_optim_rng.pt")
        _craft_torch_file(target, marker)
    elif where == "common":
        target = os.path.join(it, "common.pt")
        _craft_torch_file(target, marker)
    else:
        target = os.path.join(it, ".metadata")
        _craft_metadata(target, marker)
    return root, target, marker


def _one_line_refusal(code: int, err: str, target: str) -> None:
    assert code != 0
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert target in err and "refused" in err and "could run code" in err, err


@pytest.mark.parametrize("where", ["single", "common", "metadata"])
def test_crafted_checkpoint_is_refused_by_every_reader(checkpoints, tmp_path, capsys, where):
    from megamoe import from_checkpoint
    from megamoe.cli.main import main

    root, target, marker = _crafted(checkpoints, tmp_path, where)
    for extra in ("", "--finetune"):
        capsys.readouterr()
        code = main(shlex.split(f"{TINY_MOE} --train-iters 2 --load {root} {extra}"))
        _one_line_refusal(code, capsys.readouterr().err, target)
    with pytest.raises(CheckpointError, match="refused") as e:
        from_checkpoint(root)
    assert target in str(e.value)
    convert = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
         "megamoe-to-hf", "--input", root, "--output", str(tmp_path / "hf")],
        capture_output=True, text=True, cwd=ROOT)
    _one_line_refusal(convert.returncode, convert.stderr, target)
    assert not os.path.exists(tmp_path / "hf")
    assert not os.path.exists(marker)  # nothing ran


def test_real_checkpoints_still_load(checkpoints):
    """What megamoe writes passes the allow-lists (RNG states with numpy arrays included)."""
    single = load_torch_file(os.path.join(checkpoints["torch"], "iter_0000001",
                                          "model_optim_rng.pt"))
    assert single["rng"]["numpy"][0] == "MT19937" and single["optimizer"] is not None
    common = load_torch_file(os.path.join(checkpoints["torch_dist"], "iter_0000001",
                                          "common.pt"))
    assert common["format"] == "torch_dist" and common["rng"]
    meta = read_dcp_metadata(os.path.join(checkpoints["torch_dist"], "iter_0000001",
                                          ".metadata"))
    assert "model.embedding.word_embeddings.weight" in meta.state_dict_metadata


def test_dcp_byte_items_are_never_unpickled(tmp_path):
    """DCP stores non-tensor values as pickles and its default planner would load them with
    torch.load(weights_only=False); megamoe's planner refuses them."""
    marker = str(tmp_path / "payload-ran")
    ckpt = str(tmp_path / "bytes")
    dcp.save({"w": torch.ones(3), "obj": Payload(marker)}, checkpoint_id=ckpt, no_dist=True)
    assert not os.path.exists(marker)  # saving does not unpickle
    with pytest.raises(BaseException) as e:  # DCP wraps it in a CheckpointException
        dcp.load({"obj": io.BytesIO()}, checkpoint_id=ckpt, no_dist=True,
                 planner=TensorOnlyLoadPlanner())
    assert "refused a pickled" in repr(getattr(e.value, "failures", e.value))
    assert not os.path.exists(marker)
    from megamoe.training.checkpoint import read_dist_tensors

    assert list(read_dist_tensors(ckpt)) == ["w"]  # tensors only, the pickle is not read
    assert not os.path.exists(marker)


def _edit_torch_file(path: str, edit) -> None:
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own test file
    edit(state)
    torch.save(state, path)


def _pop(key):
    return lambda s: s.pop(key)


def _set(key, value):
    return lambda s: s.__setitem__(key, value)


# (format, field named in the message, the edit)
BAD_FIELDS = [
    ("torch_dist", "'iteration'", _set("iteration", "abc")),
    ("torch_dist", "'iteration'", _set("iteration", -3)),
    ("torch_dist", "'iteration'", _pop("iteration")),
    ("torch_dist", "'consumed_train_samples'", _set("consumed_train_samples", -8)),
    ("torch_dist", "'scheduler'", _set("scheduler", "cosine")),
    ("torch_dist", "'scheduler.num_steps'", _set("scheduler", {"num_steps": 1.5})),
    ("torch_dist", "'rng'", _set("rng", [])),
    ("torch_dist", "'rng[0].numpy'", lambda s: s["rng"][0].__setitem__("numpy", (1, 2))),
    ("torch_dist", "'optimizer.step'", lambda s: s["optimizer"].__setitem__(
        "step", torch.tensor(float("nan")))),
    ("torch", "'iteration'", _set("iteration", True)),
    ("torch", "'consumed_train_samples'", _pop("consumed_train_samples")),
    ("torch", "'rng.torch'", lambda s: s["rng"].__setitem__("torch", torch.zeros(3))),
    # a fractional Adam step count (bias correction would divide by 1 - beta^2.5)
    ("torch", "'optimizer.optimizer.state[0].step'", lambda s: s["optimizer"]["optimizer"][
        "state"][0].__setitem__("step", torch.tensor(2.5))),
]


def test_bad_fields_are_one_line_naming_the_file_and_field(checkpoints, tmp_path, capsys):
    """common.pt / the single file with a field of the wrong type or range: one line
    naming the file and the field (not its content), exit 1, before anything loads."""
    from megamoe.cli.main import main

    for i, (fmt, field, edit) in enumerate(BAD_FIELDS):
        root = str(tmp_path / str(i))
        shutil.copytree(checkpoints[fmt], root)
        name = "common.pt" if fmt == "torch_dist" else "model_optim_rng.pt"
        target = os.path.join(root, "iter_0000001", name)
        _edit_torch_file(target, edit)
        capsys.readouterr()
        code = main(shlex.split(f"{TINY_MOE} --train-iters 2 --load {root}"))
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, (field, err)
        assert target in err and f"field {field}" in err and "abc" not in err, (field, err)


def test_dcp_storage_entries_stay_inside_the_checkpoint(checkpoints, tmp_path):
    """A .metadata entry naming ../x, an absolute path, or a shard that is a symlink out
    of the directory is refused before any file is read."""
    from megamoe.training.checkpoint import read_dist_tensors

    for i, rename in enumerate(["../outside.distcp", "/tmp/outside.distcp", "link.distcp"]):
        root = str(tmp_path / str(i))
        shutil.copytree(checkpoints["torch_dist"], root)
        it = os.path.join(root, "iter_0000001")
        shard = next(f for f in os.listdir(it) if f.endswith(".distcp"))
        shutil.copy(os.path.join(it, shard), tmp_path / "outside.distcp")
        if rename == "link.distcp":
            os.symlink(tmp_path / "outside.distcp", os.path.join(it, rename))
        with open(os.path.join(it, ".metadata"), "rb") as f:
            metadata = pickle.load(f)  # our own test file
        for info in metadata.storage_data.values():
            if info.relative_path == shard:
                info.relative_path = rename
        with open(os.path.join(it, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
        with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
            read_dist_tensors(it)


def test_a_pointer_symlink_is_not_quoted(checkpoints, tmp_path, capsys):
    """latest_checkpointed_iteration.txt made a symlink to another file: the error names
    the pointer, never prints what the other file holds."""
    from megamoe.cli.main import main

    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-TOKEN-1234\n")
    root = str(tmp_path / "ck")
    shutil.copytree(checkpoints["torch_dist"], root)
    pointer = os.path.join(root, "latest_checkpointed_iteration.txt")
    os.remove(pointer)
    os.symlink(secret, pointer)
    capsys.readouterr()
    code = main(shlex.split(f"{TINY_MOE} --train-iters 2 --load {root}"))
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and pointer in err, err
    assert "SECRET" not in err
def _megatron_blob(obj) -> bytes:
    buf = io.BytesIO()
    torch.save([obj], buf)  # how megatron-core packs its common state
    return buf.getvalue()


def test_megatron_common_state_admits_args_only(tmp_path):
    """A Megatron-LM common state is unpickled admitting argparse.Namespace, dtypes and
    tensors; Megatron's own enums become inert records (never imported); anything else,
    such as a crafted payload inside `args`, is refused before it runs."""
    import argparse

    from megamoe.training.checkpoint.megatron_common import ForeignValue, load_megatron_pickle

    marker = str(tmp_path / "payload-ran")
    fine = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, rng=torch.arange(3))
    got = load_megatron_pickle(_megatron_blob({"args": fine, "iteration": 3}), "x")[0]
    assert got["args"].params_dtype is torch.bfloat16 and got["iteration"] == 3
    assert torch.equal(got["args"].rng, torch.arange(3))

    enum_pickle = (b"\x80\x02cmegatron.core.transformer.enums\nAttnBackend\nK\x05\x85R.")
    value = load_megatron_pickle(enum_pickle, "x")
    assert isinstance(value, ForeignValue) and value.args == (5,)
    assert value.qualname == "megatron.core.transformer.enums.AttnBackend"

    crafted = argparse.Namespace(num_layers=2, trap=Payload(marker))
    with pytest.raises(CheckpointError, match="refused.*io.open") as e:
        load_megatron_pickle(_megatron_blob({"args": crafted}), "iter_0000003/__0_0.distcp")
    assert "iter_0000003/__0_0.distcp" in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("trap", ["args", "rng", "model", "eval"])
def test_megatron_legacy_rank_file_admits_its_types_only(tmp_path, trap):
    """A legacy `model_optim_rng.pt` (torch.save, protocol 2) is read with its args
    Namespace, tensors, the numpy RNG state (numpy's array reconstruction and
    `_codecs.encode`) and a Transformer Engine `_extra_state` BytesIO (inert); a payload
    hidden in the args, the RNG state or the weights is refused before it runs."""
    import argparse

    import numpy as np

    from megamoe.training.checkpoint.megatron_common import (
        ForeignValue,
        load_megatron_torch_file,
    )

    marker, path = str(tmp_path / "payload-ran"), str(tmp_path / "model_optim_rng.pt")
    state = {"args": argparse.Namespace(num_layers=2, params_dtype=torch.float32),
             "iteration": 5, "checkpoint_version": 3.0,
             "model": {"w": torch.ones(2, 3), "lin._extra_state": io.BytesIO(b"te")},
             "rng_state": [{"np_rng_state": np.random.RandomState(3).get_state(),
                            "torch_rng_state": torch.get_rng_state()}]}
    torch.save(state, path)
    got = load_megatron_torch_file(path)
    assert got["iteration"] == 5 and torch.equal(got["model"]["w"], torch.ones(2, 3))
    assert isinstance(got["model"]["lin._extra_state"], ForeignValue)
    np_state = got["rng_state"][0]["np_rng_state"]
    assert np.array_equal(np_state[1], np.random.RandomState(3).get_state()[1])
    if trap == "args":
        state["args"].trap = Payload(marker)
    elif trap == "rng":
        state["rng_state"][0]["random_rng_state"] = Payload(marker)
    elif trap == "model":
        state["model"]["w2"] = Payload(marker)
    else:  # a builtin that runs code: refused like any other global
        state["model"]["x"] = _Eval(marker)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="refused") as e:
        load_megatron_torch_file(path)
    assert path in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(marker)


class _Eval:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w')",))


class _OtherRebuild:
    """A pickle that asks _rebuild_from_type_v2 to call another admitted global."""

    def __reduce__(self):
        import codecs

        return torch._tensor._rebuild_from_type_v2, (codecs.encode, torch.Tensor,
                                                     ("x", "utf-8"), {"a": 1})


def test_megatron_tensor_with_attributes_loads_as_a_plain_tensor(tmp_path):
    """Float16's fp32 main parameters carry megatron-core's Python attributes
    (`tensor_model_parallel`, ...) and pickle through torch._tensor._rebuild_from_type_v2:
    read as the plain tensor, the attributes dropped; that rebuild asked to call anything
    but the plain tensor rebuild is refused."""
    from megamoe.training.checkpoint.megatron_common import load_megatron_torch_file

    main = torch.arange(6.0).view(2, 3)
    main.tensor_model_parallel, main.partition_dim = True, 0
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"optimizer": {"fp32_from_fp16_params": [[main]]}}, path)
    got = load_megatron_torch_file(path)["optimizer"]["fp32_from_fp16_params"][0]
    assert torch.equal(got[0], main)
    assert type(got[0]) is torch.Tensor and not hasattr(got[0], "tensor_model_parallel")
    torch.save({"x": _OtherRebuild()}, path)
    with pytest.raises(CheckpointError, match="refused") as e:
        load_megatron_torch_file(path)
    assert path in str(e.value) and "\n" not in str(e.value)
