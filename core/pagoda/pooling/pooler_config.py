"""Which pooler and normalization a model uses: the engine keys ``pooling_type`` / ``normalize`` when
set, else the model's sentence-transformers files (``modules.json``, ``1_Pooling/config.json``), else
LAST with normalization (what decoder embedding models such as Qwen3-Embedding use)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pagoda.errors import ConfigError

logger = logging.getLogger("pagoda")

# 1_Pooling/config.json flags -> pagoda's pooling types (the others have no pagoda pooler)
ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str
    normalize: bool
    source: str  # where it came from, for the log and errors


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it as JSON: {exc}") from None


def sentence_transformers_defaults(model_dir: Path, need_type: bool = True) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers model directory; (None, None) if none.
    ``need_type`` False: the pooling type is set elsewhere, so a pooling mode pagoda lacks is no error."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ConfigError(f"{modules_file}: expected a list of modules")
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules if isinstance(m, dict))
    pooling_type = None
    for module in modules:
        if need_type and isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            config_file = model_dir / str(module.get("path") or "1_Pooling") / "config.json"
            if not config_file.is_file():
                raise ConfigError(f"{modules_file} names a Pooling module but {config_file} does not exist")
            config = _read_json(config_file)
            chosen = [mode for flag, mode in ST_MODES.items() if config.get(flag)]
            other = [flag for flag in ST_UNSUPPORTED if config.get(flag)]
            if other or len(chosen) > 1:
                raise ConfigError(f"{config_file}: pooling {', '.join(other + chosen)} is not supported (one of "
                                  f"{', '.join(ST_MODES)}); set pooling_type to override it")
            pooling_type = chosen[0] if chosen else None
    return pooling_type, normalize


def resolve_pooler_config(model_path: Path, pooling_type: str | None, normalize: bool | None,
                          is_classifier: bool) -> PoolerConfig:
    """Engine keys win over the model's files; a classifier (score head) never normalizes by default."""
    st_type, st_normalize = (None, None)
    if model_path.is_dir():
        st_type, st_normalize = sentence_transformers_defaults(model_path, need_type=pooling_type is None)
    source = []
    if pooling_type is None:
        pooling_type = st_type or "LAST"
        source.append("pooling_type from 1_Pooling/config.json" if st_type else "pooling_type default LAST")
    if normalize is None:
        normalize = st_normalize if st_normalize is not None else not is_classifier
        source.append("normalize from modules.json" if st_normalize is not None else f"normalize default {normalize}")
    return PoolerConfig(pooling_type, bool(normalize), "; ".join(source) or "engine keys")
