"""``speculative_config``: which proposer drafts tokens and how many (vLLM's names).

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}``,
``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}``, ``{"method": "mtp",
"num_speculative_tokens": k}`` (DeepSeek-V3's MTP layer), ``{"method": "eagle3", "model": PATH,
"num_speculative_tokens": k}`` (an EAGLE-3 head).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagoda.errors import ConfigError

METHODS = ("ngram", "draft_model", "mtp", "eagle3")
NOT_YET: dict[str, str] = {}  # method -> why it is refused


class SpeculativeConfig(BaseModel):
    """One engine's speculative decoding settings (the ``speculative_config`` key)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["ngram", "draft_model", "mtp", "eagle3"] = Field(
        ..., description="ngram (prompt lookup), draft_model (a smaller model, same tokenizer), mtp, eagle3")
    num_speculative_tokens: int = Field(3, gt=0, le=16, description="tokens drafted per sequence and step")
    prompt_lookup_max: int = Field(3, gt=0, description="ngram: longest suffix looked up in the context")
    prompt_lookup_min: int = Field(1, gt=0, description="ngram: shortest suffix looked up")
    model: str | None = Field(None, description="draft_model/eagle3: the draft's directory or hub repo id")
    revision: str | None = Field(None, description="draft_model: branch, tag or commit of a hub draft")
    quantization: str | None = Field(None, description="draft_model: the draft's quantization method")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("method") in ("draft", "draft_model_lookup"):
            data = {**data, "method": "draft_model"}
        if isinstance(data, dict) and "method" not in data and data.get("model"):
            data = {**data, "method": "draft_model"}  # vLLM: a model and no method means a draft model
        return data

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"method {self.method!r} needs 'model' (the draft's directory or hub repo id)")
        return self


def parse_speculative_config(value: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The engine key's value, validated; errors name ``speculative_config`` and the field."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a mapping such as {{\"method\": \"ngram\", "
                          f"\"num_speculative_tokens\": 3}}, not {type(value).__name__}")
    try:
        config = SpeculativeConfig(**value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'speculative_config'}: {e['msg']}"
                             for e in exc.errors())
        raise ConfigError(f"speculative_config: {problems} (methods: {', '.join(METHODS)})") from None
    if config.method in NOT_YET:
        raise ConfigError(f"speculative_config: {NOT_YET[config.method]}")
    return config
