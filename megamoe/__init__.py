"""megamoe: Megatron-style Mixture-of-Experts GPT pretraining in PyTorch."""

__version__ = "0.1.0"
