"""Plugin discovery through the entry-point group ``pagoda`` and the filled registries.

The core's own hook implementations (``pagoda.builtin_plugin``) are always loaded. A
plugin that fails to import, or raises inside a hook, is recorded with its error and
skipped; ``pagoda plugins`` shows it, and a later request for what it would have provided
names it. ``PAGODA_PLUGINS=cuda,models`` loads only the named entry points.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from pagoda import hookspecs
from pagoda.errors import PluginError
from pagoda.registry import MODEL_FALLBACK, KernelRegistry, PluginInfo, Registry

ENTRY_POINT_GROUP = "pagoda"
CORE_DISTRIBUTION = "pagoda-core"
HOOKS = (
    "register_platforms",
    "register_attention_backends",
    "register_models",
    "register_quantizers",
    "register_allocators",
    "register_kernels",
    "register_tool_parsers",
    "register_reasoning_parsers",
    "register_logits_processors",
)


@dataclass
class PluginRegistry:
    """Everything the loaded plugins registered, plus the record of each plugin."""

    platforms: Registry = field(default_factory=lambda: Registry("platform"))
    attention_backends: Registry = field(default_factory=lambda: Registry("attention backend"))
    models: Registry = field(default_factory=lambda: Registry("model architecture"))
    quantizers: Registry = field(default_factory=lambda: Registry("quantizer"))
    allocators: Registry = field(default_factory=lambda: Registry("KV allocator"))
    kernels: KernelRegistry = field(default_factory=KernelRegistry)
    tool_parsers: Registry = field(default_factory=lambda: Registry("tool parser"))
    reasoning_parsers: Registry = field(default_factory=lambda: Registry("reasoning parser"))
    logits_processors: Registry = field(default_factory=lambda: Registry("logits processor"))
    plugins: list[PluginInfo] = field(default_factory=list)

    def failed(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error]

    def failure_note(self) -> str:
        """A sentence naming plugins that failed to load, for 'not found' errors."""
        bad = self.failed()
        if not bad:
            return ""
        parts = [f"{p.name} ({p.distribution}): {p.error.splitlines()[-1]}" for p in bad]
        return " Plugins that failed to load: " + "; ".join(parts) + "."


def _allowlist() -> set[str] | None:
    raw = os.environ.get("PAGODA_PLUGINS")
    if raw is None or raw.strip() in ("", "all", "*"):
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _entry_points() -> list[metadata.EntryPoint]:
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    unique = {}
    for ep in eps:  # the same distribution can be seen twice on sys.path (editable installs)
        unique.setdefault(ep.name, ep)
    return [unique[k] for k in sorted(unique)]


def _make_register(hook: str, reg: PluginRegistry, provider: str, info: PluginInfo):
    names = info.registered.setdefault(hook, [])

    def register_platform(platform) -> None:
        reg.platforms.add(platform.name, platform, provider, platform.priority)
        names.append(platform.name)

    def register_backend(backend) -> None:
        reg.attention_backends.add(backend.name, backend, provider, backend.priority)
        names.append(backend.name)

    def register_model(architecture: str, model) -> None:
        reg.models.add(architecture, model, provider)
        names.append(architecture if architecture != MODEL_FALLBACK else
                     f"{MODEL_FALLBACK} (the fallback for architectures no class is registered for)")

    def register_quantizer(quantizer) -> None:
        reg.quantizers.add(quantizer.name, quantizer, provider)
        names.append(quantizer.name)

    def register_allocator(allocator) -> None:
        reg.allocators.add(allocator.name, allocator, provider, allocator.priority)
        names.append(allocator.name)

    def register_kernel(op: str, platform: str, impl, priority: int = 0) -> None:
        reg.kernels.add(op, platform, impl, priority, provider)
        names.append(f"{op}@{platform}")

    def by_name(registry: Registry):
        def register_class(name: str, cls) -> None:
            if not (isinstance(cls, type) or (isinstance(cls, str) and ":" in cls)):
                raise PluginError(f"{provider} registered {registry.kind} {name!r} as {cls!r}: register a "
                                  f"class or a lazy 'module:Class' string")
            registry.add(name, cls, provider)
            names.append(name)

        return register_class

    if hook == "register_tool_parsers":
        return by_name(reg.tool_parsers)
    if hook == "register_reasoning_parsers":
        return by_name(reg.reasoning_parsers)
    if hook == "register_logits_processors":
        return by_name(reg.logits_processors)
    return {
        "register_platforms": register_platform,
        "register_attention_backends": register_backend,
        "register_models": register_model,
        "register_quantizers": register_quantizer,
        "register_allocators": register_allocator,
        "register_kernels": register_kernel,
    }[hook]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def load_plugins() -> PluginRegistry:
    """Discover, import and call every plugin; never raises for a broken third-party plugin."""
    from pagoda import builtin_plugin

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    reg = PluginRegistry()
    modules = [("core", CORE_DISTRIBUTION, builtin_plugin)]
    allow = _allowlist()
    for ep in _entry_points():
        if allow is not None and ep.name not in allow:
            continue
        dist = ep.dist.name if ep.dist is not None else ep.value.split(":")[0]
        try:
            modules.append((ep.name, dist, ep.load()))
        except Exception as exc:
            reg.plugins.append(PluginInfo(ep.name, dist, _version(dist), error=_describe(exc)))
    if allow is not None:
        found = {ep.name for ep in _entry_points()}
        for missing in sorted(allow - found):
            reg.plugins.append(PluginInfo(missing, "?", "", error=(
                f"PAGODA_PLUGINS names {missing!r} but no installed distribution has an entry point "
                f"of that name in group {ENTRY_POINT_GROUP!r}")))
    for name, dist, module in modules:
        info = PluginInfo(name, dist, _version(dist))
        reg.plugins.append(info)
        try:
            pm.register(module, name=name)
        except Exception as exc:  # e.g. a hookimpl with a misspelled hook name or argument
            info.error = _describe(exc)
            continue
        for hook in HOOKS:
            impls = [i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin_name == name]
            for impl in impls:
                try:
                    impl.function(register=_make_register(hook, reg, dist, info))
                except PluginError as exc:
                    if "registered twice" in str(exc):
                        raise
                    info.error = _describe(exc)
                except Exception as exc:
                    info.error = f"{hook}: {_describe(exc)}"
    reg.plugins.sort(key=lambda p: (p.name != "core", p.name))
    return reg


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


_REGISTRY: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = load_plugins()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the loaded plugins (tests; after changing PAGODA_PLUGINS)."""
    global _REGISTRY
    _REGISTRY = None
