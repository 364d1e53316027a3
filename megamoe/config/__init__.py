"""Small per-feature config dataclasses, each validating itself.

The command line (megamoe/cli) maps Megatron-LM flags onto these through the flag each
field declares (fields.py); library users build them directly and get the same checks
and messages. A layer receives only its own config, never the whole run.
"""

from megamoe.config.data import DataConfig
from megamoe.config.fields import ConfigError, to_dict
from megamoe.config.fp8 import Fp8Config
from megamoe.config.model import ModelConfig
from megamoe.config.moe import MoEConfig, MoEExecutionConfig, MoETrainingConfig
from megamoe.config.optim import OptimizerConfig
from megamoe.config.parallel import ParallelConfig
from megamoe.config.pipeline_split import PipelineSplit, pipeline_layer_ranges
from megamoe.config.recompute import RecomputeConfig
from megamoe.config.run import RunConfig
from megamoe.config.train import CheckpointConfig, LoggingConfig, TrainConfig

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "Fp8Config", "LoggingConfig", "ModelConfig",
    "MoEConfig", "MoEExecutionConfig", "MoETrainingConfig", "OptimizerConfig",
    "ParallelConfig", "PipelineSplit", "RecomputeConfig", "RunConfig", "TrainConfig",
    "pipeline_layer_ranges", "to_dict",
]
