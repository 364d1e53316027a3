"""A rebuilt flat-buffer layout proven by the saved state itself: megatron-core's
distributed optimizer copies its fp32 main parameters into the model's parameters at the
end of every step (`_copy_main_params_to_model_params`), so in a dp_reshardable save each
parameter's `param` slice, cast to the weight's dtype, IS the saved weight, bit for bit.
A layout that puts any parameter at another's range (the same bucket lengths, other
offsets: a registration order the converter does not know, such as a Transformer
Engine layer whose fused norm sits elsewhere) reads another tensor's numbers there, so
the import is refused instead of handing Adam's moments to the wrong parameters."""

from __future__ import annotations

from typing import Optional

import torch


def main_params_differ(main: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]
                       ) -> Optional[str]:
    """None if every main parameter cast to its weight's dtype equals that weight exactly
    (both by the same name: megamoe's, after the same mapping); else the first name that
    does not, with how far off it is."""
    for key in sorted(main):
        weight = weights.get(key)
        if weight is None or tuple(weight.shape) != tuple(main[key].shape):
            return f"{key}: no saved weight of the main parameter's shape"
        if not torch.equal(main[key].to(weight.dtype), weight):
            diff = (main[key].float() - weight.float()).abs().max().item()
            return (f"{key}: the main parameters read from the buffers are not the saved "
                    f"weights (max difference {diff:.3g}): the layout read is not the one "
                    "saved")
    return None
