"""Mixed policies: a default method plus per-layer rules, first match wins.

    quantization:
      default: fp8                    # method for layers no rule matches (none: full precision)
      rules:
        - kind: experts               # attention | mlp | experts | shared_experts | other
          method: int4
          group_size: 64              # any other key is an option of that rule's method
        - match: "layers\\.0\\."        # a regular expression searched in the layer name
          method: none
      keep: ["o_proj"]                # regular expressions of layers kept in full precision

Every method is looked up in the quantizer registry, so third-party methods work in rules.
MoE routers, norms, embeddings and the LM head are never quantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagoda.errors import ConfigError
from pagoda.interfaces import QuantConfig

from pagoda_quant.layer_match import KINDS, layer_kind
from pagoda_quant.methods.base import PolicyConfig

RULE_KEYS = ("match", "kind", "method")
NONE = ("none", "None", None, "bf16", "full")


@dataclass
class Rule:
    where: str  # "quantization.rules[i]" for messages
    pattern: re.Pattern | None
    kind: str | None
    config: QuantConfig | None  # None: full precision
    method: str
    hits: list[str] = field(default_factory=list)

    def matches(self, prefix: str, kind: str) -> bool:
        if self.kind is not None and self.kind != kind:
            return False
        return self.pattern is None or self.pattern.search(prefix) is not None


def _method_config(method: Any, options: dict, where: str) -> tuple[QuantConfig | None, str]:
    from pagoda.selection import get_quantizer

    if isinstance(method, dict):
        options = {**method, **options}
        method = options.pop("method", None)
    if method in NONE:
        if options:
            raise ConfigError(f"{where}: method none takes no options (got {', '.join(sorted(options))})")
        return None, "none"
    if not isinstance(method, str):
        raise ConfigError(f"{where}.method must be a method name (fp8, int4, none, ...), got {method!r}")
    if method == "mixed":
        raise ConfigError(f"{where}.method: a policy cannot nest another policy")
    try:
        return get_quantizer(method).from_user(dict(options)), method
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _compile(pattern: Any, where: str) -> re.Pattern:
    if not isinstance(pattern, str):
        raise ConfigError(f"{where} must be a regular expression string, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"{where}: {pattern!r} is not a valid regular expression: {exc}") from None


def parse_rule(raw: Any, where: str) -> Rule:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with 'method' and 'match' and/or 'kind', got {raw!r}")
    if "method" not in raw:
        raise ConfigError(f"{where} has no 'method' (e.g. method: int4)")
    if "match" not in raw and "kind" not in raw:
        raise ConfigError(f"{where} needs 'match' (a regular expression) and/or 'kind' ({', '.join(KINDS[:-2])}, "
                          f"other)")
    kind = raw.get("kind")
    if kind is not None and (kind not in KINDS or kind == "router"):
        raise ConfigError(f"{where}.kind must be one of attention, mlp, experts, shared_experts, other; got {kind!r}")
    pattern = _compile(raw["match"], f"{where}.match") if "match" in raw else None
    options = {k: v for k, v in raw.items() if k not in RULE_KEYS}
    config, method = _method_config(raw["method"], options, where)
    return Rule(where, pattern, kind, config, method)


class MixedConfig(PolicyConfig):
    name = "mixed"

    def __init__(self, policy: dict):
        super().__init__()
        unknown = sorted(set(policy) - {"default", "rules", "keep", "method"})
        if unknown:
            raise ConfigError(f"quantization: unknown policy key(s) {', '.join(unknown)} (valid: default, rules, "
                              f"keep)")
        self.default, self.default_name = _method_config(policy.get("default", "none"), {}, "quantization.default")
        rules = policy.get("rules") or []
        if not isinstance(rules, list):
            raise ConfigError("quantization.rules must be a list of rules")
        self.rules = [parse_rule(r, f"quantization.rules[{i}]") for i, r in enumerate(rules)]
        keep = policy.get("keep") or []
        if not isinstance(keep, list):
            raise ConfigError("quantization.keep must be a list of regular expressions")
        self.keep = [_compile(p, f"quantization.keep[{i}]") for i, p in enumerate(keep)]
        self.assignments: dict[str, str] = {}  # layer prefix -> method name (for reports)

    def _choose(self, prefix: str) -> tuple[QuantConfig | None, str]:
        kind = layer_kind(prefix)
        if kind == "router" or any(p.search(prefix) for p in self.keep):
            return None, "none"
        for rule in self.rules:
            if rule.matches(prefix, kind):
                rule.hits.append(prefix)
                return rule.config, rule.method
        return self.default, self.default_name

    def get_method(self, layer, prefix):
        config, name = self._choose(prefix)
        self.assignments[prefix] = name
        return config.get_method(layer, prefix) if config is not None else None

    def get_moe_method(self, layer, prefix):
        config, name = self._choose(prefix)
        self.assignments[prefix] = name
        return config.get_moe_method(layer, prefix) if config is not None else None

    def unused_rules(self) -> list[str]:
        return [r.where for r in self.rules if not r.hits]

    def describe(self) -> str:
        parts = [f"default {self.default_name}"]
        for rule in self.rules:
            what = " ".join(x for x in (f"kind={rule.kind}" if rule.kind else "",
                                        f"match={rule.pattern.pattern!r}" if rule.pattern else "") if x)
            parts.append(f"{what} -> {rule.method}")
        return "mixed: " + "; ".join(parts)
