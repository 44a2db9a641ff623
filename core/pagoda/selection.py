"""Choosing the platform, attention backend, model class, allocator, quantizer, and the
tool parser, reasoning parser and logits processors named by the user.

Every ``select_*`` either returns what was asked for or raises ``PluginError`` naming what
is missing, which distribution would provide it, and any plugin that failed to load.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pagoda.errors import ModelLoadError, PluginError
from pagoda.interfaces import AttentionBackend, AttentionSpec, KVAllocator, Platform, Quantizer
from pagoda.plugins import PluginRegistry, get_registry
from pagoda.registry import KNOWN_PROVIDERS, MODEL_FALLBACK, MODELS_DISTRIBUTION, resolve_lazy

logger = logging.getLogger("pagoda")


def _hint(kind: str, name: str) -> str:
    dist = KNOWN_PROVIDERS.get((kind, name))
    return f" It is provided by {dist} (pip install {dist})." if dist else ""


ENV_SWITCH_PREFIX = "PAGODA_USE_"  # Platform.env_switch names should start with this
_SWITCH_ON = ("1", "true", "yes", "on")
_SWITCH_OFF = ("", "0", "false", "no", "off")


def env_switched_platform(reg: PluginRegistry | None = None) -> Platform | None:
    """The platform a ``PAGODA_USE_*`` environment variable turns on, if any.

    Every ``PAGODA_USE_*`` variable set to a true value must be some registered platform's
    ``env_switch``: a switch no installed plugin declares is an error, so that a missing
    plugin never turns into a silent run on another device."""
    reg = reg or get_registry()
    declared = {e.obj.env_switch: e.obj for e in reg.platforms.entries.values() if e.obj.env_switch}
    chosen: list[tuple[str, Platform]] = []
    for var in sorted(v for v in os.environ if v.startswith(ENV_SWITCH_PREFIX) or v in declared):
        value = os.environ[var].strip().lower()
        if value in _SWITCH_OFF:
            continue
        if value not in _SWITCH_ON:
            raise PluginError(f"environment variable {var}={os.environ[var]!r} is not a switch value: "
                              f"use 1 to turn it on or 0 to turn it off")
        if var not in declared:
            known = ", ".join(f"{v} ({p.name})" for v, p in sorted(declared.items())) or "none"
            raise PluginError(f"environment variable {var}=1 asks for a platform, but no installed plugin "
                              f"declares that switch (platform switches: {known}); install the plugin "
                              f"that provides it or unset {var}" + reg.failure_note())
        chosen.append((var, declared[var]))
    if len(chosen) > 1:
        raise PluginError("environment variables " + " and ".join(f"{v}=1 ({p.name})" for v, p in chosen)
                          + " select different platforms; set only one")
    return chosen[0][1] if chosen else None


def select_platform(device: str, reg: PluginRegistry | None = None, source: str | None = None) -> Platform:
    """The platform for ``device`` ("auto" or a name). ``source`` says where an explicit
    device came from (e.g. "dtype 'cuda-bfloat16'") for error messages."""
    reg = reg or get_registry()
    switched = env_switched_platform(reg)
    if switched is not None:
        var = switched.env_switch
        if device not in ("auto", switched.name):
            raise PluginError(f"{var}=1 selects device {switched.name!r} but device {device!r} was requested"
                              f"{f' by {source}' if source else ''}; unset {var} or change the device")
        device, source = switched.name, f"{var}=1" + (f" and {source}" if source else "")
    if device == "auto":
        ranked = sorted(reg.platforms.entries.values(), key=lambda e: -e.obj.priority)
        for entry in ranked:
            if entry.obj.is_available():
                return entry.obj
        raise PluginError("no platform is available (not even cpu?)" + reg.failure_note())
    via = f" (by {source})" if source else ""
    if device not in reg.platforms:
        raise PluginError(f"device {device!r}{via} is not a registered platform (registered: "
                          f"{', '.join(reg.platforms.names())}).{_hint('platform', device)}"
                          + reg.failure_note())
    platform = reg.platforms.get(device)
    reason = platform.unavailable_reason()
    if reason is not None:
        raise PluginError(f"device {device!r} was requested{via} but is unavailable: {reason} "
                          f"(provided by {reg.platforms.entries[device].provider}; pagoda never falls "
                          f"back to another device silently)")
    return platform


def platform_of(device) -> Platform:
    """The registered platform whose ``device_type`` is ``device``'s type (a torch.device or its type
    string), for code that holds a device rather than the engine's platform (host uploads)."""
    device_type = getattr(device, "type", device)
    for entry in get_registry().platforms.entries.values():
        if entry.obj.device_type == device_type:
            return entry.obj
    raise PluginError(f"no registered platform has device type {device_type!r} (registered: "
                      f"{', '.join(get_registry().platforms.names())})")


def select_attention_backend(name: str, platform: Platform, dtype: str, spec: AttentionSpec,
                             reg: PluginRegistry | None = None) -> AttentionBackend:
    reg = reg or get_registry()
    if name != "auto":
        if name not in reg.attention_backends:
            raise PluginError(f"attention_backend {name!r} is not registered (registered: "
                              f"{', '.join(reg.attention_backends.names())})."
                              f"{_hint('attention_backend', name)}" + reg.failure_note())
        backend = reg.attention_backends.get(name)
        if spec.kind in backend.kinds:
            why = backend.supports(platform.name, dtype, spec)
            if why is not None:
                raise PluginError(f"attention_backend {name!r} cannot run this model: {why}")
            return backend
        # The named backend does not implement this kind at all (e.g. an MHA backend named for a
        # model with MLA layers): that kind is chosen as with "auto".
        chosen = select_attention_backend("auto", platform, dtype, spec, reg)
        logger.info("attention_backend %r has no %s attention; using %r for those layers", name, spec.kind,
                    chosen.name)
        return chosen
    ranked = sorted(reg.attention_backends.entries.values(), key=lambda e: -e.obj.priority)
    reasons = []
    for entry in ranked:
        why = entry.obj.supports(platform.name, dtype, spec)
        if why is None and not entry.obj.auto_selectable(platform.name):
            why = f"chosen on {platform.name} only when named (attention_backend: {entry.name})"
        if why is None:
            return entry.obj
        reasons.append(f"{entry.name}: {why}")
    raise PluginError(f"no attention backend supports {spec.kind} attention with head size "
                      f"{spec.head_size} in {dtype} on {platform.name} ({'; '.join(reasons)})"
                      + reg.failure_note())


MODEL_IMPLS = ("auto", "pagoda", "transformers")


def resolve_model_class(architectures: list[str], source: str, reg: PluginRegistry | None = None,
                        model_impl: str = "auto", hf_config: Any = None) -> Any:
    """The model class for a checkpoint's ``architectures``.

    ``model_impl``: ``pagoda`` takes only a class registered under the architecture's name (a native
    implementation), ``transformers`` only a fallback registered as ``"*"`` (the core's runs
    transformers' modeling code), ``auto`` the native class when there is one, else the fallback
    (refused when a plugin failed to load: it might have been the native one)."""
    reg = reg or get_registry()
    if model_impl not in MODEL_IMPLS:
        raise ModelLoadError(f"model_impl {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    if model_impl != "transformers":
        for arch in architectures:
            if arch in reg.models and arch != MODEL_FALLBACK:
                entry = reg.models.entries[arch]
                try:
                    return resolve_lazy(entry.obj)
                except Exception as exc:
                    raise PluginError(f"architecture {arch} is registered by {entry.provider} but its "
                                      f"model class failed to import: {type(exc).__name__}: {exc}") from exc
    native = ", ".join(n for n in reg.models.names() if n != MODEL_FALLBACK) or \
        f"none: is {MODELS_DISTRIBUTION} installed?"
    named = ", ".join(architectures) or "(none given)"
    if model_impl == "pagoda":
        raise ModelLoadError(f"{source}: architecture {named} has no native pagoda implementation (model_impl: "
                             f"pagoda; native architectures: {native}); model_impl auto or transformers runs it "
                             f"through transformers' modeling code" + reg.failure_note())
    if model_impl == "auto" and reg.failed():
        raise ModelLoadError(f"{source}: architecture {named} is not registered (native architectures: {native})."
                             + reg.failure_note() + " One of them may provide it: fix it, or set model_impl: "
                             "transformers to run the model through transformers' modeling code")
    fallback, reason = _fallback_class(architectures, reg, hf_config)
    if fallback is not None:
        if model_impl == "auto":
            logger.info("architecture %s has no native pagoda implementation: running it through transformers' "
                        "modeling code (%s)", named, reg.models.entries[MODEL_FALLBACK].provider)
        return fallback
    raise ModelLoadError(
        f"{source}: architecture {named} is not supported (native architectures: {native}; "
        f"the transformers fallback: {reason}). Model plugins such as {MODELS_DISTRIBUTION} add architectures."
        + reg.failure_note())


def _fallback_class(architectures: list[str], reg: PluginRegistry, hf_config: Any) -> tuple[Any, str]:
    """The class registered as ``"*"`` when it supports one of ``architectures``, else (None, why not)."""
    entry = reg.models.entries.get(MODEL_FALLBACK)
    if entry is None:
        return None, "none is registered"
    try:
        cls = resolve_lazy(entry.obj)
    except Exception as exc:
        raise PluginError(f"the model fallback registered by {entry.provider} failed to import: "
                          f"{type(exc).__name__}: {exc}") from exc
    reasons = []
    for arch in architectures:
        why = cls.supports(arch, hf_config)
        if why is None:
            return cls, ""
        reasons.append(why)
    return None, "; ".join(reasons) or "the checkpoint names no architecture"


def select_allocator(platform: Platform, reg: PluginRegistry | None = None) -> KVAllocator:
    reg = reg or get_registry()
    fits = [e.obj for e in reg.allocators.entries.values()
            if platform.name in e.obj.platforms or "*" in e.obj.platforms]
    if not fits:
        raise PluginError(f"no KV allocator is registered for platform {platform.name}" + reg.failure_note())
    return max(fits, key=lambda a: (a.priority, platform.name in a.platforms))


def get_quantizer(name: str, reg: PluginRegistry | None = None) -> Quantizer:
    reg = reg or get_registry()
    if name not in reg.quantizers:
        raise PluginError(f"quantization method {name!r} is not registered (registered: "
                          f"{', '.join(reg.quantizers.names()) or 'none'}).{_hint('quantizer', name)}"
                          + reg.failure_note())
    return reg.quantizers.get(name)


TOOL_PARSER_SOURCE = "tool_call_parser (--tool-call-parser)"
REASONING_PARSER_SOURCE = "reasoning_parser (--reasoning-parser)"
LOGITS_PROCESSOR_SOURCE = "logits_processors (--logits-processors)"


def _by_name(registry, name: str, source: str, reg: PluginRegistry) -> Any:
    """The class registered as ``name``, imported; errors name ``source`` (the key and flag)."""
    if name not in registry:
        raise PluginError(f"{source}: {registry.kind} {name!r} is not registered (registered: "
                          f"{', '.join(registry.names()) or 'none'})" + reg.failure_note())
    entry = registry.entries[name]
    try:
        return resolve_lazy(entry.obj)
    except Exception as exc:
        raise PluginError(f"{source}: {registry.kind} {name!r} is registered by {entry.provider} but failed "
                          f"to import: {type(exc).__name__}: {exc}") from exc


def get_tool_parser(name: str, reg: PluginRegistry | None = None, source: str = TOOL_PARSER_SOURCE) -> Any:
    """The ``pagoda.parsers.ToolParser`` subclass registered as ``name``."""
    reg = reg or get_registry()
    return _by_name(reg.tool_parsers, name, source, reg)


def get_reasoning_parser(name: str, reg: PluginRegistry | None = None,
                         source: str = REASONING_PARSER_SOURCE) -> Any:
    """The ``pagoda.parsers.ReasoningParser`` subclass registered as ``name``."""
    reg = reg or get_registry()
    return _by_name(reg.reasoning_parsers, name, source, reg)


def get_logits_processor(name: str, reg: PluginRegistry | None = None,
                         source: str = LOGITS_PROCESSOR_SOURCE) -> Any:
    """The ``pagoda.interfaces.LogitsProcessor`` subclass registered as ``name``."""
    reg = reg or get_registry()
    return _by_name(reg.logits_processors, name, source, reg)


def select_tool_parser(name: str | None, chat_template: str | None = None, reg: PluginRegistry | None = None,
                       source: str = TOOL_PARSER_SOURCE) -> Any:
    """The tool parser class for a ``tool_call_parser`` setting: None or "none" for no
    parser, "auto" for the one the chat template names unambiguously (None if it does not),
    otherwise the registered name."""
    from pagoda.parsers.infer import infer_tool_parser

    if name in (None, "", "none"):
        return None
    if name == "auto":
        name = infer_tool_parser(chat_template)
        if name is None:
            return None
    return get_tool_parser(name, reg, source)


def select_reasoning_parser(name: str | None, chat_template: str | None = None,
                            reg: PluginRegistry | None = None, source: str = REASONING_PARSER_SOURCE) -> Any:
    """As ``select_tool_parser``, for ``reasoning_parser``."""
    from pagoda.parsers.infer import infer_reasoning_parser

    if name in (None, "", "none"):
        return None
    if name == "auto":
        name = infer_reasoning_parser(chat_template)
        if name is None:
            return None
    return get_reasoning_parser(name, reg, source)
