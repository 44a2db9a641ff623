"""Pieces shared by pagoda-quant's configs and methods."""

from __future__ import annotations

import logging
from typing import Any

import torch
from pagoda.errors import ConfigError, ModelLoadError
from pagoda.interfaces import QuantConfig, QuantMethod
from pagoda.kernels import get_op
from pagoda.layers import set_weight_attrs
from torch import nn

from pagoda_quant.layer_match import is_listed, layer_kind

logger = logging.getLogger("pagoda")


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, **attrs: Any) -> nn.Parameter:
    """Register an empty parameter (on the current default device) with loader attributes."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, **attrs)
    layer.register_parameter(name, param)
    return param


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Swap a parameter for its processed form (or drop it with None), freeing the old one."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


def layer_name(layer: nn.Module) -> str:
    return getattr(layer, "prefix", "") or type(layer).__name__


class QuantizedLinearMethod(QuantMethod):
    """Base of pagoda-quant's linear methods; ``dequantize`` serves ``pagoda quant-sim``."""

    method_name = ""

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The weight this layer computes with, as float32 [N, K] (after loading)."""
        raise NotImplementedError

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n != "bias") \
            + sum(b.numel() * b.element_size() for b in layer.buffers(recurse=False))


class FullPrecisionWeights(QuantizedLinearMethod):
    """Online methods load the checkpoint's full-precision weight first, then quantize it in
    ``process_weights_after_loading``."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        self.check_shape(layer, input_size, output_sizes)
        add_param(layer, "weight", (sum(output_sizes), input_size), params_dtype, output_dim=0, input_dim=1)

    def check_shape(self, layer, input_size: int, output_sizes: list[int]) -> None:
        pass


def declared_kv_cache_dtype(cfg: dict) -> str | None:
    """The KV cache a checkpoint's ``quantization_config`` declares, as a ``kv_cache_dtype``
    value: "fp8" for ``kv_cache_scheme: {num_bits: 8, type: float, ...}`` (compressed-tensors,
    ModelOpt), ``kv_cache_scheme: static`` (AutoFP8: fp8 with k/v scale tensors) or
    ``kv_cache_quant_algo: FP8`` (ModelOpt); None when it declares none. A cache type pagoda
    cannot store (int8, fp4) is logged and left to the model dtype: the weights still load."""
    scheme = cfg.get("kv_cache_scheme")
    algo = cfg.get("kv_cache_quant_algo")
    if scheme is None and algo is None:
        return None
    if isinstance(scheme, dict):
        fp8 = scheme.get("num_bits") == 8 and str(scheme.get("type", "")).lower() == "float"
    else:
        fp8 = str(scheme if scheme is not None else algo).lower() in ("static", "fp8", "fp8_e4m3", "float8_e4m3fn")
    if fp8:
        return "fp8"
    key, value = ("kv_cache_scheme", scheme) if scheme is not None else ("kv_cache_quant_algo", algo)
    logger.warning("config.json quantization_config.%s=%r: pagoda stores fp8 KV caches only; the cache stays in "
                   "the model dtype", key, value)
    return None


class PolicyConfig(QuantConfig):
    """A QuantConfig that keeps routers and listed modules in full precision and hands every
    other linear layer ``linear_method(layer, prefix)``. ``kv_cache``: the KV cache dtype a
    checkpoint declares (``declared_kv_cache_dtype``), used when the user's is ``auto``."""

    kv_cache: str | None = None

    def __init__(self, skip_modules: list[str] | None = None, skip_key: str = "modules_to_not_convert"):
        self.skip_modules = list(skip_modules or [])
        self.skip_key = skip_key

    def kv_cache_dtype(self) -> str | None:
        return self.kv_cache

    def keeps_full_precision(self, prefix: str) -> bool:
        return layer_kind(prefix) == "router" or is_listed(prefix, self.skip_modules, self.skip_key)

    def get_method(self, layer, prefix):
        if self.keeps_full_precision(prefix):
            return None
        return self.linear_method(layer, prefix)

    def get_moe_method(self, layer, prefix):
        if self.keeps_full_precision(prefix):
            return None
        return self.moe_method(layer, prefix)

    def linear_method(self, layer, prefix: str) -> QuantMethod:
        raise NotImplementedError

    def moe_method(self, layer, prefix: str):
        return None

    def describe(self) -> str:
        return self.name


def options_of(options: dict, allowed: dict[str, Any], what: str) -> dict:
    """Validate a user option mapping against ``allowed`` (name -> default); unknown keys are an
    error naming ``what`` (e.g. "quantization")."""
    unknown = sorted(set(options) - set(allowed) - {"method"})
    if unknown:
        raise ConfigError(f"{what}: unknown option(s) {', '.join(unknown)} (valid: "
                          f"{', '.join(sorted(allowed)) or 'none'})")
    return {k: options.get(k, v) for k, v in allowed.items()}


def positive_int(value: Any, what: str, allow_minus_one: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and not (allow_minus_one and value == -1)):
        raise ConfigError(f"{what} must be a positive integer{' or -1' if allow_minus_one else ''}, got {value!r}")
    return value


def checkpoint_error(key: str, message: str) -> ModelLoadError:
    return ModelLoadError(f"config.json quantization_config.{key}: {message}")


def op(name: str):
    """The selected implementation of a kernel op (highest priority for this platform)."""
    return get_op(name)


AUTO_GROUP_SIZES = (128, 64, 32)


def check_group_size(layer, input_size: int, group_size: int | None, what: str) -> int:
    """The effective group size (-1: the whole row; None: the largest of 128, 64, 32 that
    divides the input size), or an error naming the layer."""
    if group_size is None:
        group_size = next((g for g in AUTO_GROUP_SIZES if input_size % g == 0), AUTO_GROUP_SIZES[0])
    g = input_size if group_size == -1 else group_size
    if input_size % 8 or input_size % g:
        raise ModelLoadError(f"{what}: layer {layer_name(layer)} has {input_size} inputs per rank, not a multiple "
                             f"of group_size {g} (and of 8); choose a group_size that divides it")
    return g
