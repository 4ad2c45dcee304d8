"""Run configuration: typed sections, YAML loading and command-line overrides."""

from __future__ import annotations

from loongforge.config.loader import config_to_dict, load_config
from loongforge.config.schema import (
    CheckpointConfig,
    DataConfig,
    DPOConfig,
    EvaluationConfig,
    GRPOConfig,
    LoggingConfig,
    LoongForgeConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    SchedulerConfig,
    TrainingConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DPOConfig",
    "GRPOConfig",
    "EvaluationConfig",
    "LoggingConfig",
    "LoongForgeConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RunConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "config_to_dict",
    "load_config",
]
