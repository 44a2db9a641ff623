"""Registries of what plugins provide, and selection by platform and priority.

Selection never falls back silently: an explicit request for something that is not
registered or not usable is a ``PluginError`` naming what is missing, which distribution
would provide it, and any plugin that failed to load.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

from pagoda.errors import PluginError

# Where the project's own distributions provide things, for error messages only.
KNOWN_PROVIDERS = {
    ("platform", "cuda"): "pagoda-cuda",
    ("platform", "mlu"): "pagoda-mlu",
    ("attention_backend", "triton"): "pagoda-cuda",
    ("attention_backend", "triton_mla"): "pagoda-cuda",
    ("attention_backend", "mlu_chunked"): "pagoda-mlu",
    ("quantizer", "fp8"): "pagoda-quant",
    ("quantizer", "int4"): "pagoda-quant",
    ("quantizer", "gptq"): "pagoda-quant",
    ("quantizer", "awq"): "pagoda-quant",
    ("quantizer", "mixed"): "pagoda-quant",
}
MODELS_DISTRIBUTION = "pagoda-models"
# register_models name of a fallback: a class with ``supports(architecture, hf_config) -> reason | None``
# that runs architectures no class is registered for by name (the core's runs transformers' code)
MODEL_FALLBACK = "*"
logger = logging.getLogger("pagoda")


@dataclass
class Entry:
    name: str
    obj: Any
    provider: str  # distribution name, or "pagoda-core"
    priority: int = 0


@dataclass
class PluginInfo:
    """One plugin (entry point) as discovered: what it registered, or why it failed."""

    name: str
    distribution: str
    version: str
    registered: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None


def resolve_lazy(obj: Any) -> Any:
    """Import a ``"module:attr"`` string; return anything else unchanged."""
    if isinstance(obj, str) and ":" in obj:
        module, _, attr = obj.partition(":")
        value: Any = importlib.import_module(module)
        for part in attr.split("."):
            value = getattr(value, part)
        return value
    return obj


class Registry:
    """Name → entry, rejecting a name registered twice."""

    def __init__(self, kind: str):
        self.kind = kind
        self.entries: dict[str, Entry] = {}

    def add(self, name: str, obj: Any, provider: str, priority: int = 0) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"{provider} registered a {self.kind} without a name: {obj!r}")
        if name in self.entries:
            first = self.entries[name].provider
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by {first} and by {provider}; "
                f"uninstall one of them or restrict plugins with PAGODA_PLUGINS"
            )
        self.entries[name] = Entry(name, obj, provider, priority)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> Any:
        return self.entries[name].obj


class KernelRegistry:
    """(op, platform) → implementations by priority; platform "*" applies everywhere."""

    def __init__(self) -> None:
        self.impls: dict[str, list[tuple[str, int, Any, str]]] = {}  # op -> [(platform, prio, impl, provider)]

    def add(self, op: str, platform: str, impl: Any, priority: int, provider: str) -> None:
        for plat, prio, _, prov in self.impls.get(op, []):
            if plat == platform and prio == priority:
                raise PluginError(
                    f"kernel {op!r} for platform {platform!r} at priority {priority} is registered twice: "
                    f"by {prov} and by {provider}; give one a different priority"
                )
        self.impls.setdefault(op, []).append((platform, priority, impl, provider))

    def ops(self) -> list[str]:
        return sorted(self.impls)

    def candidates(self, op: str, platform: str) -> list[tuple[str, int, Any, str]]:
        found = [c for c in self.impls.get(op, []) if c[0] in (platform, "*")]
        return sorted(found, key=lambda c: -c[1])

    def select(self, op: str, platform: str) -> tuple[Any, str]:
        """(callable, provider) of the highest-priority implementation that imports."""
        errors = []
        for plat, prio, impl, provider in self.candidates(op, platform):
            try:
                found = resolve_lazy(impl)
            except Exception as exc:  # a lazy import that fails: say so, then try the next one
                errors.append(f"{provider} ({plat}, priority {prio}): {type(exc).__name__}: {exc}")
                logger.warning("kernel %r from %s failed to import, using a lower priority one: %s",
                               op, provider, exc)
                continue
            return found, provider
        detail = "; ".join(errors) if errors else "no implementation is registered"
        raise PluginError(f"kernel op {op!r} is unavailable on platform {platform!r}: {detail}")
