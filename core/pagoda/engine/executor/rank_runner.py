"""Building one rank's ModelRunner: its device, the seed, its shard of the model."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.distributed.process_group import RankInfo, rank_device
from pagoda.interfaces import Platform


def build_rank_runner(config: EngineConfig, source: Any, hf_config: Any, platform: Platform, dtype: str,
                      info: RankInfo) -> Any:
    """The runner of this rank (the parallel state must already be set: the layers read it)."""
    from pagoda.engine.model_runner import ModelRunner

    device = rank_device(platform, info)
    torch.manual_seed(config.seed)
    runner = ModelRunner(config, source, hf_config, platform, dtype, device)
    if config.pipeline_parallel_size > 1 and not getattr(getattr(runner.model, "model", None),
                                                         "supports_pipeline_parallel", False):
        from pagoda.errors import ConfigError

        raise ConfigError(f"pipeline_parallel_size={config.pipeline_parallel_size}: {type(runner.model).__name__} "
                          f"cannot be split into pipeline stages (only models built on the Llama decoder stack can; "
                          f"docs/distributed.md); use tensor_parallel_size instead")
    return runner
