"""megamoe: Megatron-style Mixture-of-Experts GPT pretraining in PyTorch."""

__version__ = "0.1.0"

from megamoe.config import MoEConfig  # noqa: E402
from megamoe.inference import from_checkpoint  # noqa: E402
from megamoe.moe.layer import MoELayer  # noqa: E402
from megamoe.moe.moefy import moefy, upcycle_model  # noqa: E402
from megamoe.moe.stats import routing_stats  # noqa: E402

__all__ = ["MoEConfig", "MoELayer", "from_checkpoint", "moefy", "routing_stats",
           "upcycle_model"]
