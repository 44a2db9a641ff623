"""``pagoda plugins``: what every plugin registered, what is selected here, what failed."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list plugins, what they register and what is selected here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def collect() -> dict:
    from pagoda.kernels import describe_selection
    from pagoda.plugins import get_registry
    from pagoda.selection import select_allocator, select_platform

    reg = get_registry()
    plugins = [{"name": p.name, "distribution": p.distribution, "version": p.version,
                "registered": p.registered, "error": p.error} for p in reg.plugins]
    platforms = []
    for entry in sorted(reg.platforms.entries.values(), key=lambda e: -e.obj.priority):
        reason = entry.obj.unavailable_reason()
        platforms.append({"name": entry.name, "provider": entry.provider, "priority": entry.obj.priority,
                          "available": reason is None, "reason": reason})
    selected: dict = {}
    try:
        platform = select_platform("auto", reg)
        selected["platform"] = platform.name
        selected["allocator"] = select_allocator(platform, reg).name
        backends = sorted(reg.attention_backends.entries.values(), key=lambda e: -e.obj.priority)
        for kind in ("mha", "mla"):
            for entry in backends:
                b = entry.obj
                if kind in b.kinds and ("*" in b.platforms or platform.name in b.platforms) \
                        and b.auto_selectable(platform.name):
                    selected[f"attention ({kind})"] = f"{entry.name} [{entry.provider}]"
                    break
        selected["kernels"] = describe_selection(platform.name)
    except Exception as exc:  # report, do not crash the listing
        selected["error"] = str(exc)
    return {"plugins": plugins, "platforms": platforms, "selected": selected,
            "models": {n: reg.models.entries[n].provider for n in reg.models.names()},
            "quantizers": {n: reg.quantizers.entries[n].provider for n in reg.quantizers.names()},
            **{kind: {n: registry.entries[n].provider for n in registry.names()}
               for kind, registry in (("tool_parsers", reg.tool_parsers),
                                      ("reasoning_parsers", reg.reasoning_parsers),
                                      ("logits_processors", reg.logits_processors))}}


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("Plugins (entry point group 'pagoda'):")
    for p in info["plugins"]:
        status = "FAILED" if p["error"] else "ok"
        print(f"  {p['name']:<10} {p['distribution']} {p['version']}  [{status}]")
        if p["error"]:
            print(f"      error: {p['error']}")
        for hook, names in p["registered"].items():
            if names:
                print(f"      {hook}: {', '.join(names)}")
    print("Platforms:")
    for plat in info["platforms"]:
        state = "available" if plat["available"] else f"unavailable: {plat['reason']}"
        print(f"  {plat['name']:<6} priority {plat['priority']:<3} {plat['provider']}: {state}")
    print("Selected on this machine:")
    for key, value in info["selected"].items():
        if key == "kernels":
            print("  kernels:")
            for op, who in value.items():
                print(f"    {op:<22} {who}")
        else:
            print(f"  {key}: {value}")
    print("Chosen by name (tool_call_parser, reasoning_parser, logits_processors):")
    for kind in ("tool_parsers", "reasoning_parsers", "logits_processors"):
        names = [f"{n} [{who}]" if who != "pagoda-core" else n for n, who in info[kind].items()]
        print(f"  {kind.replace('_', ' ')}: {', '.join(names) or 'none'}")
    return 0
