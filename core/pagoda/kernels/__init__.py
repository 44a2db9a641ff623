"""Named kernel ops, dispatched to the highest-priority implementation for the platform.

``activate(platform_name)`` is called by the engine before the model is built; layers then
call ``get_op("rms_norm")(...)``. Signatures are documented in ``pagoda.kernels.reference``,
the torch implementations every platform falls back to (the floor, priority 0).
"""

from __future__ import annotations

from collections.abc import Callable

_platform = "cpu"
_selected: dict[str, Callable] = {}
_providers: dict[str, str] = {}


def activate(platform_name: str) -> None:
    global _platform
    _platform = platform_name
    _selected.clear()
    _providers.clear()


def active_platform() -> str:
    return _platform


def get_op(name: str) -> Callable:
    fn = _selected.get(name)
    if fn is None:
        fn, provider = _kernel_registry().select(name, _platform)
        _selected[name] = fn
        _providers[name] = provider
    return fn


def selected_providers() -> dict[str, str]:
    """op -> distribution of every op resolved so far (for ``pagoda plugins`` and logs)."""
    return dict(_providers)


def describe_selection(platform_name: str) -> dict[str, str]:
    """op -> 'provider (priority)' that would be chosen on a platform, without importing."""
    reg = _kernel_registry()
    out = {}
    for op in reg.ops():
        cands = reg.candidates(op, platform_name)
        if cands:
            plat, prio, _, provider = cands[0]
            out[op] = f"{provider} [{plat}, priority {prio}]"
    return out


def _kernel_registry():
    # Imported when first needed, not with this module: the plugins' modules (the built-in plugin's
    # attention backends, layers) import this one, so a module-level import would close a circle.
    from pagoda.plugins import get_registry

    return get_registry().kernels
