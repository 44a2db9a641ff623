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
    return ModelRunner(config, source, hf_config, platform, dtype, device)
