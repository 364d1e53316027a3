"""FP8 flags with Megatron-LM's names, choices and defaults (generated there from
megatron-core's TransformerConfig fp8 fields, plus --fp8-param-gather and the MXFP8 /
FSDP buffer flags; Megatron-LM d98e8a64). What they do: config/fp8.py and model/fp8/.

Built: --fp8-format, --fp8-recipe tensorwise / delayed / blockwise / mxfp8 (and rowwise, a
megamoe extension that is not one of Megatron's choices), --fp8-margin,
--fp8-amax-history-len, --fp8-amax-compute-algo, --first-last-layers-bf16 with
--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16, --no-fp8-wgrad (alias
--disable-fp8-wgrad), --moe-router-padding-for-quantization (alias
--moe-router-padding-for-fp8), --fp8-param-gather (tensorwise, delayed, blockwise),
--fp8-output-proj (the output layer in MXFP8), and
--tp-only-amax-red (megatron-core's TransformerConfig.tp_only_amax_red, which Megatron-LM's
parser does not expose: a megamoe extension). Every other FP8 flag of Megatron's parser is
parsed so that a Megatron script gets "not supported yet: --flag" (config/unsupported.py),
not "unrecognized arguments".
"""

from __future__ import annotations

import argparse

from megamoe.config import ConfigError
from megamoe.config.fp8 import AMAX_COMPUTE_ALGOS, FORMATS, RECIPES


def add_fp8_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("FP8 (Megatron-LM's)")
    g.add_argument("--fp8-format", default=None, choices=FORMATS,
                   help="FP8 GEMMs for the transformer layers' linears and experts: e4m3 "
                        "everywhere, or hybrid (e4m3 inputs and weights, e5m2 gradients)")
    g.add_argument("--fp8-recipe", default="delayed", choices=RECIPES,
                   help="tensorwise (per-tensor current scaling), delayed (scales from an "
                        "amax history), blockwise (1x128 / 128x128 tiles), mxfp8 (1x32 tiles, "
                        "E8M0 scales), rowwise (megamoe's extension: one scale per row); "
                        "custom: not supported yet")
    g.add_argument("--fp8-margin", type=int, default=0,
                   help="delayed scaling: scale = fp8_max / amax / 2^margin")
    g.add_argument("--fp8-interval", type=int, default=1,
                   help="deprecated (Transformer Engine >= 1.8 ignores it); only 1 accepted")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="delayed scaling: steps of amax history per tensor")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent",
                   choices=AMAX_COMPUTE_ALGOS,
                   help="delayed scaling: the amax of the scale, the history's max or the "
                        "most recent")
    g.add_argument("--tp-only-amax-red", action="store_true",
                   help="reduce delayed scaling's amaxes over TP x CP only (default: "
                        "TP x DP x CP, as Megatron)")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="run the first and last decoder layers (by global layer number) "
                        "without FP8; not with --fp8-recipe delayed")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="with --first-last-layers-bf16: how many first layers")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="with --first-last-layers-bf16: how many last layers")
    g.add_argument("--no-fp8-wgrad", "--disable-fp8-wgrad", dest="fp8_wgrad",
                   action="store_false",
                   help="delayed scaling: the weight-gradient GEMMs in high precision "
                        "(forward and dgrad stay FP8)")
    g.add_argument("--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8",
                   dest="moe_router_padding_for_quantization", action="store_true",
                   help="pad each expert's token count to a multiple of 16 (32 under "
                        "mxfp8) with probability-0 assignments")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="keep the FP8 GEMMs' weights in FP8 (1 byte per value) and all-gather "
                        "them in FP8 from the distributed optimizer (tensorwise, delayed, "
                        "blockwise)")
    g.add_argument("--fp8-output-proj", action="store_true",
                   help="the output layer's GEMMs (LM head, MTP heads) in MXFP8 too; needs "
                        "--fp8-format and --fp8-recipe mxfp8")
    for flag in ("--keep-fp8-transpose-cache",
                 "--reuse-grad-buf-for-mxfp8-param-ag"):
        g.add_argument(flag, action="store_true", help="not supported yet")
    g.add_argument("--fp8-quantizer-factory", default=None, help="not supported yet")


def check_fp8_args(args: argparse.Namespace) -> None:
    """The FP8 rules only the command line sees (config/fp8.py checks the rest)."""
    if args.fp8_interval != 1:
        raise ConfigError("--fp8-interval is deprecated and ignored by Transformer Engine "
                          f">= 1.8 (Megatron-LM); megamoe accepts only 1, got "
                          f"{args.fp8_interval}")
    if args.fp8_format is None:
        return
    if args.fp16:
        # TE runs FP8 GEMMs under fp16 too, but megamoe's dynamic loss scaler does not see
        # FP8 overflows (saturation hides them): not combined yet
        raise ConfigError("not supported yet: --fp8-format with --fp16 (use --bf16 or fp32)")
    if getattr(args, "compile", False):
        raise ConfigError("not supported yet: --fp8-format with --compile")
