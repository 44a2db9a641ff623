"""``pagoda serve``: the OpenAI- and Ollama-compatible HTTP server.

    pagoda serve                                  # the embedded default model on 127.0.0.1:8000
    pagoda serve Qwen/Qwen3-8B                    # a Hugging Face Hub repo id (downloaded once, then cached)
    pagoda serve --config serve.yaml --port 9000  # flags override the file's engine:/server: keys
"""

from __future__ import annotations

import argparse
import sys
import typing

from pagoda.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.server.config import ServerConfig, load_server_config

# ServerConfig keys whose flag another group already defines (the engine's --served-model-name)
SHARED_WITH_ENGINE = ("served_model_name",)
SERVE_STEP_TOKENS = 8192


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server (every key of ServerConfig; flags override --config)")
    for name, field in ServerConfig.model_fields.items():
        if name in SHARED_WITH_ENGINE:
            continue
        help_text = (field.description or "").replace("%", "%%")
        args = typing.get_args(field.annotation)
        if field.annotation is bool or field.annotation == (bool | None):
            group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif name == "lora_modules":  # vLLM's form: --lora-modules a=PATH b=PATH (repeatable too)
            group.add_argument(_flag(name), dest=name, nargs="+", action="extend", default=None, metavar="NAME=PATH",
                               help=help_text)
        elif typing.get_origin(field.annotation) is list:
            group.add_argument(_flag(name), dest=name, action="append", default=None,
                               help=help_text + " (repeat the flag for several)")
        elif field.annotation is int or int in args:
            group.add_argument(_flag(name), dest=name, type=int, default=None, help=help_text)
        elif field.annotation is float or float in args:
            group.add_argument(_flag(name), dest=name, type=float, default=None, help=help_text)
        else:
            group.add_argument(_flag(name), dest=name, default=None, help=help_text)
    group.add_argument("--api-key", dest="api_keys", action="append", help="same as --api-keys")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI- and Ollama-compatible HTTP server "
                       "(default model: SmolLM2-135M-Instruct)",
                       description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, "
                       "/api/generate, /api/chat, /api/tags, /health, /metrics. See docs/serving.md.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model: a hub repo id ORG/NAME (ORG/NAME:FILE.gguf), a directory or a .gguf file "
                        "(same as --model)")
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=run)


def serve_engine_config(args: argparse.Namespace):
    """The engine config of ``pagoda serve [MODEL] [flags]``."""
    from pagoda.errors import ConfigError

    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and flag is not None and tag != flag:
        raise ConfigError(f"pagoda serve was given two models: {tag!r} and --model {flag!r}; give one")
    if tag is not None:
        args.model = tag
    config = engine_config_from_args(args)
    if config.max_num_batched_tokens is None and not _on_cpu(config):
        # a server keeps decode steps short while prompts arrive (the CPU platform bounds them itself)
        config.max_num_batched_tokens = SERVE_STEP_TOKENS
    return config


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {name: getattr(args, name, None) for name in ServerConfig.model_fields
              if name not in SHARED_WITH_ENGINE}
    return load_server_config(getattr(args, "config_file", None), **values)



def _on_cpu(engine_config) -> bool:
    from pagoda.selection import select_platform

    device, _ = engine_config.resolved_device_and_dtype()
    return select_platform(device).name == "cpu"


def cpu_choices(engine) -> str:
    """What the engine chose on the CPU: threads, step budget, weights (docs/cpu.md)."""
    platform, budget = engine.platform, engine.step_budget
    quant = getattr(engine.runner.model, "quant_config", None) if hasattr(engine.runner, "model") else None
    idle = f" ({budget.idle_tokens} when none decodes)" if budget.idle_tokens else ""
    return (f"pagoda: cpu: {platform.threads} threads ({platform.threads_reason}); step budget {budget.tokens} "
            f"tokens while sequences decode{idle}: {budget.reason}; weights: "
            f"{quant.describe() if quant is not None and hasattr(quant, 'describe') else 'the model dtype'}")


def run(args) -> int:
    from pagoda.server.runner import bind, build_app, run_server

    server_config = server_config_from_args(args)  # checks the file's sections first
    engine_config = serve_engine_config(args)
    from pagoda.distributed.process_group import launcher_env

    launched = launcher_env()
    if launched is not None and launched.rank > 0:
        build_app(engine_config, server_config)  # torchrun ranks > 0 serve rank 0's engine, then exit
        return 0
    sock = bind(server_config.host, server_config.port)  # a busy port fails now, not after loading the model
    try:
        app = build_app(engine_config, server_config)
    except BaseException:
        sock.close()
        raise
    from pagoda.engine.gc_freeze import freeze_startup_objects

    freeze_startup_objects()  # this process keeps the engine for its whole life
    fe = app.state.frontend
    engine = app.state.async_engine.engine

    def announce(url: str) -> None:
        replicas = getattr(engine, "replicas", None)  # the engines run in their own processes
        if engine.platform.name == "cpu":
            choices = {r.choices for r in replicas} if replicas else {cpu_choices(engine)}
            for line in sorted(c for c in choices if c):
                print(line, file=sys.stderr, flush=True)
        where = f", engine process{'es' if len(replicas) > 1 else ''} " + ", ".join(
            str(r.proc.pid) for r in replicas) if replicas else ""
        print(f"pagoda: serving {fe.model_name} ({engine.platform.name}/{engine.dtype}, max_model_len "
              f"{fe.max_model_len}{where}) on {url}{' (API keys required)' if server_config.api_keys else ''}",
              file=sys.stderr, flush=True)

    return run_server(app, server_config, announce=announce, sock=sock)
