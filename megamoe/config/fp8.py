"""FP8 training (Megatron-LM's --fp8-* flags, megatron/core/transformer/transformer_config.py
at d98e8a64: `fp8`, `fp8_recipe`, `fp8_margin`, `fp8_amax_history_len`,
`fp8_amax_compute_algo`, `tp_only_amax_red`).

`format` None means no FP8 (Megatron's default). Built here: `tensorwise` (Transformer
Engine's Float8CurrentScaling: each tensor scaled by its own amax when it is quantised),
`delayed` (TE's DelayedScaling: the scale comes from an amax history updated after use),
`blockwise` (TE's Float8BlockScaling, DeepSeek-V3's 1x128 / 128x128 tiles), `mxfp8` (TE's
MXFP8BlockScaling, 1x32 tiles with E8M0 scales) and megamoe's extension `rowwise` (one
scale per row along the contraction dimension, torchao's row-wise recipe; not a Megatron
choice). The GEMMs: megamoe/model/fp8/. Megatron passes the margin, history length and
compute algorithm only to DelayedScaling; under another recipe they would be ignored, so a
non-default value there is refused.

`first_last_layers_bf16` (Megatron's --first-last-layers-bf16, with
--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16, defaults 1 / 1) keeps the first
and last N decoder layers out of FP8, counted by global layer number as Megatron's
is_first_last_bf16_layer (fp8_utils.py), so pipeline stages agree; MTP layers stay in FP8
(Megatron runs them under the global FP8 context). Megatron refuses it with delayed scaling
(a per-layer autocast breaks TE's amax reduction) and bounds each N by num_layers // PP
(config/run.py checks that bound: it needs the model and parallel sizes).

`fp8_wgrad` False (--no-fp8-wgrad / --disable-fp8-wgrad) runs the weight-gradient GEMMs in
high precision while forward and dgrad stay FP8 (TE's override_linear_precision (False,
False, True)); Megatron gives it to DelayedScaling only, so another recipe refuses it.
`router_padding` (--moe-router-padding-for-quantization, alias --moe-router-padding-for-fp8):
moe/quantization_padding.py. `output_proj` (--fp8-output-proj) runs the output layer's
GEMMs (the LM head, and the MTP heads through it) in MXFP8 too; Megatron requires
--fp8-format and --fp8-recipe mxfp8 for it (model/fp8/policy.py, docs/fp8.md).

`param_gather` (--fp8-param-gather, Megatron's "keep the compute param in fp8 and perform
the param all-gather in fp8"): the FP8 GEMMs' weights live in FP8 in the distributed
optimizer's parameter buffer, quantised from the fp32 main shards after each step
(model/fp8/params.py, training/optim/fp8_shards.py). Built for tensorwise, delayed and
blockwise (whose 128x128 weight blocks serve forward and dgrad alike); Megatron requires
the distributed optimizer (config/run.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import flag, require

FORMATS = ("e4m3", "hybrid")
# Megatron-LM's choices, then megamoe's extension (rowwise: torchao's row-wise recipe)
RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom", "rowwise")
BUILT_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "rowwise")
# --fp8-param-gather: one scale per weight (per expert), or per 128x128 weight block
PARAM_GATHER_RECIPES = ("tensorwise", "delayed", "blockwise")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
MAX_AMAX_HISTORY_LEN = 1 << 16  # TE keeps one fp32 per entry per tensor: bounded


@dataclass
class Fp8Config:
    format: Optional[str] = flag("--fp8-format", None, dest="fp8_format")
    recipe: str = flag("--fp8-recipe", "delayed")
    margin: int = flag("--fp8-margin", 0)
    amax_history_len: int = flag("--fp8-amax-history-len", 1)
    amax_compute_algo: str = flag("--fp8-amax-compute-algo", "most_recent")
    tp_only_amax_red: bool = flag("--tp-only-amax-red", False)
    fp8_wgrad: bool = flag("--no-fp8-wgrad", True, dest="fp8_wgrad")
    router_padding: bool = flag("--moe-router-padding-for-quantization", False,
                                dest="moe_router_padding_for_quantization")
    first_last_layers_bf16: bool = flag("--first-last-layers-bf16", False)
    num_layers_at_start_in_bf16: int = flag("--num-layers-at-start-in-bf16", 1)
    num_layers_at_end_in_bf16: int = flag("--num-layers-at-end-in-bf16", 1)
    param_gather: bool = flag("--fp8-param-gather", False)
    output_proj: bool = flag("--fp8-output-proj", False, dest="fp8_output_proj")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def enabled(self) -> bool:
        return self.format is not None

    def validate(self) -> None:
        require(self.format in (None, *FORMATS),
                f"--fp8-format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        require(self.recipe in RECIPES,
                f"--fp8-recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        require(self.amax_compute_algo in AMAX_COMPUTE_ALGOS,
                f"--fp8-amax-compute-algo must be most_recent or max, got "
                f"{self.amax_compute_algo!r}")
        require(isinstance(self.margin, int) and 0 <= self.margin <= 64,
                f"--fp8-margin must be an integer in [0, 64], got {self.margin!r}")
        require(isinstance(self.amax_history_len, int)
                and 1 <= self.amax_history_len <= MAX_AMAX_HISTORY_LEN,
                f"--fp8-amax-history-len must be an integer in [1, {MAX_AMAX_HISTORY_LEN}], "
                f"got {self.amax_history_len!r}")
        for name, value in (("--num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
                            ("--num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16)):
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                    f"{name} must be an integer >= 0, got {value!r}")
        require(not (self.router_padding and self.format is None),
                "--moe-router-padding-for-quantization needs --fp8-format (Megatron-LM: "
                "fp8/fp4 must be specified)")
        require(not (self.param_gather and self.format is None),
                "--fp8-param-gather must be used together with --fp8-format (Megatron-LM: "
                "fp8_param must be used together with fp8 mode)")
        # Megatron's TransformerConfig.__post_init__ rules for fp8_output_proj
        require(not (self.output_proj and self.format is None),
                "--fp8-output-proj must be used together with --fp8-format (Megatron-LM: "
                "fp8_output_proj must be used together with fp8 mode)")
        if self.format is None:
            return
        require(not self.output_proj or self.recipe == "mxfp8",
                f"--fp8-output-proj requires --fp8-recipe mxfp8, got {self.recipe!r} "
                "(Megatron-LM)")
        require(not self.param_gather or self.recipe in PARAM_GATHER_RECIPES
                or self.recipe not in BUILT_RECIPES,
                f"not supported yet: --fp8-param-gather with --fp8-recipe {self.recipe} "
                f"(built: {', '.join(PARAM_GATHER_RECIPES)})")
        require(self.fp8_wgrad or self.recipe == "delayed",
                f"--no-fp8-wgrad applies to --fp8-recipe delayed only (Megatron passes it "
                f"to Transformer Engine's DelayedScaling only), got {self.recipe}")
        require(not (self.first_last_layers_bf16 and self.recipe == "delayed"),
                "--first-last-layers-bf16: delayed scaling does not support first / last "
                "layer in BF16 (Megatron-LM; use --fp8-recipe tensorwise, blockwise or mxfp8)")
        require(self.recipe in BUILT_RECIPES,
                f"not supported yet: --fp8-recipe {self.recipe} (built: "
                f"{', '.join(BUILT_RECIPES)})")
        if self.recipe != "delayed":
            for name, value, default in (("--fp8-margin", self.margin, 0),
                                         ("--fp8-amax-history-len", self.amax_history_len, 1),
                                         ("--fp8-amax-compute-algo", self.amax_compute_algo,
                                          "most_recent")):
                require(value == default,
                        f"{name} applies to --fp8-recipe delayed only (Transformer Engine's "
                        f"{self.recipe} scaling has no such setting), got {value}")

