"""GPT decoder (dense or Mixtral-style MoE) and its parameter/FLOP counts."""

from megamoe.model.flops import flops_per_token, num_parameters
from megamoe.model.gpt_model import GPTModel

__all__ = ["GPTModel", "flops_per_token", "num_parameters"]
