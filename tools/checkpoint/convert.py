"""Convert between Hugging Face MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE),
Megatron-LM checkpoints (torch_dist both ways; the legacy per-rank torch format read) and
megamoe checkpoints.

    python tools/checkpoint/convert.py hf-to-megamoe --input HF_DIR --output CKPT_DIR
    python tools/checkpoint/convert.py megamoe-to-hf --input CKPT_DIR --output HF_DIR
    python tools/checkpoint/convert.py megatron-to-megamoe --input MEGATRON_SAVE_DIR \
        --output CKPT_DIR [pretrain_gpt.py flags overriding the saved args]
    python tools/checkpoint/convert.py megamoe-to-megatron --input CKPT_DIR \
        --output MEGATRON_SAVE_DIR [--megatron-spec te|local]

Megatron-LM side: megatron_format.py and docs/megatron-checkpoints.md.

HF side: MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or OlmoeForCausalLM
(the family is read from config.json's `architectures`, else `model_type`; exporting
picks the one family the megamoe model fits: megamoe/model/hf_families.py), config.json +
safetensors (one file or sharded with model.safetensors.index.json), experts per expert
as transformers writes them to disk (Mixtral: `block_sparse_moe.experts.{e}.w1/w2/w3`, the
others: `mlp.experts.{e}.gate_proj/up_proj/down_proj`); the fused
`mlp.experts.gate_up_proj/down_proj` layout is read too. megamoe side: a --save style
directory (`iter_0000000/`, pointer file) whose arguments and model config rebuild the
model, so it feeds `pretrain_gpt.py --load` (training resumes from iteration 0 with fresh
optimizer state), `--finetune`, and `megamoe.from_checkpoint`. Bad input prints one line
naming the file or flag and exits 1; nothing is written until every weight is read,
mapped and shape-checked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 2)))
sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))  # checks, megatron_format

import torch  # noqa: E402
from checks import ConvertError, build_args, check_shapes, read_megamoe_checkpoint  # noqa: E402
from megatron_format import (  # noqa: E402
    check_megatron_output,
    megamoe_to_megatron,
    megatron_to_megamoe,
)
from tqdm import tqdm  # noqa: E402

from megamoe.cli.mapping import run_config_from_args  # noqa: E402
from megamoe.config import ModelConfig, to_dict  # noqa: E402
from megamoe.config.fields import ConfigError  # noqa: E402
from megamoe.model.gpt_model import GPTModel  # noqa: E402
from megamoe.model.hf_config_check import config_field_error  # noqa: E402
from megamoe.model.hf_families import (  # noqa: E402
    HFFamily,
    family_of_config,
    family_of_model,
)
from megamoe.training.checkpoint import (  # noqa: E402
    TRACKER,
    CheckpointError,
    save_dist_checkpoint,  # noqa: E402
    write_checkpoint,
)

SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------- Hugging Face -> megamoe

def _read_hf_config(hf_dir: str) -> tuple[dict, HFFamily]:
    """config.json and its family (from `architectures`, else `model_type`)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{path}: not found (--input must be a Hugging Face model folder)")
    try:
        cfg = json.load(open(path, encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: not valid JSON ({e.__class__.__name__})") from None
    why = config_field_error(cfg)
    if why is not None:
        raise ConvertError(f"{path}: {why}")
    try:
        family = family_of_config(cfg)
        why = family.config_error(cfg)
    except KeyError as e:
        raise ConvertError(f"{path}: {e.args[0]}") from None
    if why is not None:
        raise ConvertError(f"{path}: {why}")
    return cfg, family


def hf_model_flags(cfg: dict) -> list[str]:
    """pretrain_gpt.py model flags that build the same network as a config.json."""
    return family_of_config(cfg).flags(cfg)


def read_safetensors(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, with a progress bar."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            files = sorted(set(json.load(open(index, encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError):
            raise ConvertError(f"{index}: not a safetensors index (no weight_map)") from None
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConvertError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, torch.Tensor] = {}
    for name in tqdm(files, desc="reading safetensors", unit="file", disable=None):
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            raise ConvertError(f"{path}: missing (named by {index})")
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ConvertError(f"{path}: cannot be read ({str(e).splitlines()[0][:120]})") from None
    return out


def hf_to_megamoe_checkpoint(hf_dir: str, out_dir: str, ckpt_format: str = "torch_dist",
                             target: Optional[dict[str, int]] = None) -> str:
    """Convert; returns the published iteration directory. `target` ({"tensor": N, ...}):
    the layout the user means to train with, recorded in the saved arguments (a torch_dist
    checkpoint loads under any layout)."""
    cfg, family = _read_hf_config(hf_dir)
    config_path = os.path.join(hf_dir, "config.json")
    hf_sd = read_safetensors(hf_dir)
    try:
        cfg = family.config_for_weights(cfg, hf_sd.keys())
        args = build_args(family.flags(cfg), config_path)
        config = run_config_from_args(args, cfg["vocab_size"]).model
    except KeyError as e:
        raise ConvertError(f"{config_path}: missing field {e}") from None
    except ConfigError as e:
        raise ConvertError(f"{config_path}: {e}") from None
    try:
        sd = family.weights.to_megamoe(hf_sd, config)
    except (KeyError, ValueError, RuntimeError) as e:
        msg = e.args[0] if e.args else str(e)
        raise ConvertError(f"{hf_dir}: weights do not fit config.json ({msg})") from None
    check_shapes(sd, config, hf_dir)
    args.skip_train = False  # (the saved flags are those of a training launch)
    saved_args = {k: v for k, v in vars(args).items()
                  if isinstance(v, (int, float, str, bool, list, type(None)))}
    for kind, size in (target or {}).items():
        saved_args[f"{kind}_model_parallel_size"] = size
    saved_args["ckpt_format"] = ckpt_format
    with tqdm(total=1, desc="writing megamoe checkpoint", disable=None) as bar:
        if ckpt_format == "torch_dist":
            with torch.device("meta"):
                model = GPTModel(config)
            model.load_state_dict(sd, strict=True, assign=True)
            final = save_dist_checkpoint(out_dir, 0, model, None, None, None, 0, saved_args,
                                         model_config=to_dict(config), save_optim=False,
                                         save_rng=False, single=True)
        else:
            state = {"iteration": 0, "consumed_train_samples": 0, "args": saved_args,
                     "model_config": to_dict(config), "model": sd,
                     "optimizer": None, "scheduler": None, "rng": None}
            final = write_checkpoint(out_dir, 0, state)
        bar.update(1)
    return final


# ---------------------------------------------------------------- megamoe -> Hugging Face

def _import_transformers():
    """transformers writes config.json on export; without it, one line naming the extra."""
    try:
        import transformers
    except ImportError:
        raise ConvertError("megamoe-to-hf needs transformers (it writes the config.json): "
                           "pip install -e .[hf]") from None
    return transformers


def hf_config(config: ModelConfig, dtype: torch.dtype, family: HFFamily):
    """The transformers config object of `family`'s model of `config`."""
    transformers = _import_transformers()
    fields = family.config_fields(config)
    return transformers.AutoConfig.for_model(
        family.model_type, **fields, architectures=[family.architecture],
        dtype=str(dtype).replace("torch.", ""))


def write_safetensors(sd: dict[str, torch.Tensor], out_dir: str,
                      shard_bytes: int = SHARD_BYTES) -> list[str]:
    """transformers' file layout: model.safetensors, or shards plus an index."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous().clone() if t.untyped_storage().nbytes() != nbytes \
            else t.contiguous()
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else \
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, shard in tqdm(list(zip(names, shards)), desc="writing safetensors",
                            unit="file", disable=None):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in sd.values())},
                 "weight_map": {k: name for name, s in zip(names, shards) for k in s}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return names


def mtp_note(config: ModelConfig, family: HFFamily) -> Optional[str]:
    """What transformers does with exported MTP layers: DeepseekV3ForCausalLM builds
    num_hidden_layers decoder layers and no MTP module, so model.layers.{N..} are unused."""
    depths = config.mtp_num_layers or 0
    if not depths:
        return None
    n = config.num_layers
    layers = f"model.layers.{n}" if depths == 1 else f"model.layers.{n}..{n + depths - 1}"
    return (f"note: the {depths} MTP depth(s) are written as {layers} (DeepSeek's layout); "
            f"transformers' {family.architecture} builds {n} decoder layers and no MTP module, "
            "so it does not load them (unused weights); DeepSeek's inference code and "
            "hf-to-megamoe do")


def megamoe_to_hf_checkpoint(ckpt: str, out_dir: str,
                             shard_bytes: int = SHARD_BYTES) -> Optional[str]:
    """Write `ckpt` as a Hugging Face folder; returns a note for the user, or None."""
    _import_transformers()
    state, config = read_megamoe_checkpoint(ckpt)
    file = state["_file"]
    try:
        family = family_of_model(config)
    except ValueError as e:
        raise ConvertError(f"{file}: fits no Hugging Face family ({e})") from None
    try:
        hf_sd = family.weights.to_hf(state["model"], config)
    except (KeyError, RuntimeError) as e:
        msg = e.args[0] if e.args else str(e)
        raise ConvertError(f"{file}: weights do not fit the saved model config ({msg})") from None
    dtype = state["model"]["embedding.word_embeddings.weight"].dtype
    tmp = f"{out_dir.rstrip(os.sep)}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        hf_config(config, dtype, family).save_pretrained(tmp)
        write_safetensors(hf_sd, tmp, shard_bytes)
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(tmp):  # publish file by file; config.json last
            if name != "config.json":
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.replace(os.path.join(tmp, "config.json"), os.path.join(out_dir, "config.json"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return mtp_note(config, family)


# ---------------------------------------------------------------- command line

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True)
    to_mm = sub.add_parser("hf-to-megamoe", help="Hugging Face MoE model -> megamoe checkpoint")
    to_hf = sub.add_parser("megamoe-to-hf", help="megamoe checkpoint -> Hugging Face MoE model")
    from_mg = sub.add_parser("megatron-to-megamoe",
                             help="Megatron-LM checkpoint (torch_dist, or the legacy torch "
                                  "format's mp_rank_* files) -> megamoe checkpoint")
    to_mg = sub.add_parser("megamoe-to-megatron",
                           help="megamoe checkpoint -> Megatron-LM torch_dist checkpoint")
    to_mg.add_argument("--megatron-spec", default="te", choices=["te", "local"],
                       help="the layer spec of the Megatron model that will load it: "
                            "transformer_engine (te, Megatron-LM's default) or local")
    for s in (to_mm, to_hf, from_mg, to_mg):
        s.add_argument("--input", required=True)
        s.add_argument("--output", required=True)
    for kind in ("tensor", "pipeline", "expert"):
        to_mm.add_argument(f"--target-{kind}-parallel-size", type=int, default=1,
                           help="recorded as the intended layout (torch_dist checkpoints "
                                "load under any layout)")
    to_mm.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                       help="torch_dist (default, sharded, any layout) or torch (one file)")
    args, rest = p.parse_known_args(argv)
    if rest and args.direction != "megatron-to-megamoe":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = rest
    return args


def _check_output(args: argparse.Namespace) -> None:
    out = args.output
    if args.direction == "hf-to-megamoe":
        for kind in ("tensor", "pipeline", "expert"):
            value = getattr(args, f"target_{kind}_parallel_size")
            if value < 1:
                raise ConvertError(f"--target-{kind}-parallel-size must be >= 1, got {value}")
            if value != 1 and args.ckpt_format == "torch":
                raise ConvertError(f"--target-{kind}-parallel-size {value} needs --ckpt-format "
                                   "torch_dist (a single-file checkpoint loads only into one "
                                   "process or data parallelism)")
        if os.path.exists(os.path.join(out, TRACKER)):
            raise ConvertError(f"--output {out}: already holds a checkpoint (choose a new folder)")
    elif args.direction in ("megatron-to-megamoe", "megamoe-to-megatron"):
        why = check_megatron_output(out)
        if why is not None:
            raise ConvertError(why)
    elif os.path.exists(os.path.join(out, "config.json")):
        raise ConvertError(f"--output {out}: already holds a model (choose a new folder)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConvertError(f"--output {out}: is a file")
    if not os.path.exists(args.input):
        raise ConvertError(f"--input {args.input}: not found")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        _check_output(args)
        if args.direction == "hf-to-megamoe":
            target = {kind: getattr(args, f"target_{kind}_parallel_size")
                      for kind in ("tensor", "pipeline", "expert")}
            final = hf_to_megamoe_checkpoint(args.input, args.output, args.ckpt_format, target)
            print(f"wrote {final}")
        elif args.direction == "megatron-to-megamoe":
            final, note = megatron_to_megamoe(args.input, args.output, args.overrides)
            print(f"wrote {final}: {note}")
        elif args.direction == "megamoe-to-megatron":
            final = megamoe_to_megatron(args.input, args.output, args.megatron_spec)
            print(f"wrote {final}")
        else:
            note = megamoe_to_hf_checkpoint(args.input, args.output)
            print(f"wrote {args.output}")
            if note:
                print(note)
    except (ConvertError, CheckpointError) as e:
        sys.stderr.write(f"convert.py: error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
