"""CLI flags generated from EngineConfig's fields, so flags and config keys never drift."""

from __future__ import annotations

import argparse
import typing

import yaml

from pagoda.config import EngineConfig, load_engine_config


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _yaml_value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine (every key of EngineConfig; flags override --config)")
    group.add_argument("--config", dest="config_file", metavar="FILE",
                       help="YAML file with EngineConfig keys (or an 'engine:' section)")
    for name, field in EngineConfig.model_fields.items():
        if name in skip:
            continue
        help_text = (field.description or "").replace("%", "%%")
        annotation = field.annotation
        origin_args = typing.get_args(annotation)
        if annotation is bool or annotation == (bool | None):
            group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif annotation is int or (int in origin_args and str not in origin_args):
            group.add_argument(_flag(name), dest=name, type=int, default=None, help=help_text)
        elif annotation is float or (float in origin_args and str not in origin_args):
            group.add_argument(_flag(name), dest=name, type=float, default=None, help=help_text)
        elif annotation is dict or dict in origin_args:
            group.add_argument(_flag(name), dest=name, type=_yaml_value, default=None, help=help_text)
        else:
            group.add_argument(_flag(name), dest=name, default=None, help=help_text)
    if "gpu_memory_utilization" not in skip:
        group.add_argument("--gpu-memory-utilization", dest="memory_utilization", type=float, default=None,
                           help=argparse.SUPPRESS)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of ``--prompt`` (repeatable) and ``--prompts-file`` (one per non-empty line)."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts


def engine_config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    values = {name: getattr(args, name, None) for name in EngineConfig.model_fields}
    values.update({k: v for k, v in extra.items() if v is not None})
    return load_engine_config(getattr(args, "config_file", None), **values)
