"""The quantizers pagoda-quant registers: settings in, QuantConfig out.

This module imports no torch: the configs and methods load on first use.
"""

from __future__ import annotations

from pagoda.errors import ConfigError, ModelLoadError
from pagoda.interfaces import QuantConfig, Quantizer

FP8_USER_OPTIONS = {"weight_scale": "channel", "weight_block_size": None, "skip": None}
INT4_USER_OPTIONS = {"group_size": None, "symmetric": False, "skip": None}


def _block_size(value, where: str, error=ConfigError) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise error(f"{where} must be two positive integers [block_n, block_k], got {value!r}")
    return int(value[0]), int(value[1])


def _skip_list(value, where: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of module names, got {value!r}")
    return value


class Fp8Quantizer(Quantizer):
    name = "fp8"
    description = ("FP8 e4m3 W8A8: online (per-channel or per-tensor weight scales, per-token activations) or "
                   "pre-quantized per-tensor / block-scaled (DeepSeek-V3) checkpoints")

    def from_checkpoint(self, cfg: dict) -> QuantConfig:
        from pagoda_quant.methods.base import declared_kv_cache_dtype
        from pagoda_quant.methods.fp8 import Fp8Config

        scheme = str(cfg.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ModelLoadError(f"config.json quantization_config.activation_scheme={scheme!r} is not supported "
                                 f"(dynamic, static)")
        if str(cfg.get("scale_fmt", "float")) != "float":
            raise ModelLoadError(f"config.json quantization_config.scale_fmt={cfg['scale_fmt']!r} is not supported "
                                 f"(float32 block scales only)")
        block = _block_size(cfg.get("weight_block_size"), "config.json quantization_config.weight_block_size",
                            ModelLoadError)
        if block is not None and scheme == "static":
            raise ModelLoadError("config.json quantization_config: block-scaled FP8 (weight_block_size) with "
                                 "activation_scheme static is not supported (block FP8 quantizes activations "
                                 "dynamically)")
        key = "ignored_layers" if "ignored_layers" in cfg else "modules_to_not_convert"
        config = Fp8Config(checkpoint=True, block=block, static_activations=scheme == "static",
                           skip_modules=cfg.get(key), skip_key=key)
        config.kv_cache = declared_kv_cache_dtype(cfg)
        return config

    def from_user(self, options: dict) -> QuantConfig:
        from pagoda_quant.methods.base import options_of
        from pagoda_quant.methods.fp8 import Fp8Config

        opts = options_of(options, FP8_USER_OPTIONS, "quantization (fp8)")
        if opts["weight_scale"] not in ("channel", "tensor"):
            raise ConfigError(f"quantization.weight_scale must be 'channel' or 'tensor', got {opts['weight_scale']!r}")
        block = _block_size(opts["weight_block_size"], "quantization.weight_block_size")
        return Fp8Config(checkpoint=False, block=block, per_channel=opts["weight_scale"] == "channel",
                         skip_modules=_skip_list(opts["skip"], "quantization.skip"))


class Int4Quantizer(Quantizer):
    name = "int4"
    description = "INT4 weight-only (W4A16), group-wise round-to-nearest of a full-precision checkpoint at load"

    def from_checkpoint(self, cfg: dict) -> QuantConfig:
        raise ModelLoadError("config.json quantization_config.quant_method 'int4' is not a checkpoint format; "
                             "pre-quantized INT4 checkpoints use quant_method gptq or awq")

    def from_user(self, options: dict) -> QuantConfig:
        from pagoda_quant.methods.base import options_of, positive_int
        from pagoda_quant.methods.int4 import Int4Config

        opts = options_of(options, INT4_USER_OPTIONS, "quantization (int4)")
        group = opts["group_size"]
        if group is not None:
            group = positive_int(group, "quantization.group_size", allow_minus_one=True)
        if not isinstance(opts["symmetric"], bool):
            raise ConfigError(f"quantization.symmetric must be true or false, got {opts['symmetric']!r}")
        return Int4Config(group, opts["symmetric"], _skip_list(opts["skip"], "quantization.skip"))


class _CheckpointOnly(Quantizer):
    def from_user(self, options: dict) -> QuantConfig:
        raise ConfigError(f"quantization: {self.name!r} reads checkpoints already quantized with "
                          f"{self.name.upper()} (their config.json says quant_method: {self.name}); to quantize a "
                          f"full-precision model at load use 'int4' (or 'fp8')")


class GptqQuantizer(_CheckpointOnly):
    name = "gptq"
    description = "GPTQ 4-bit checkpoints (qweight/qzeros/scales/g_idx; gptq and gptq_v2 formats, act order)"

    def from_checkpoint(self, cfg: dict) -> QuantConfig:
        from pagoda_quant.methods.int4_checkpoints import GptqConfig

        return GptqConfig(cfg)


class AwqQuantizer(_CheckpointOnly):
    name = "awq"
    description = "AWQ 4-bit checkpoints (GEMM layout, zero points)"

    def from_checkpoint(self, cfg: dict) -> QuantConfig:
        from pagoda_quant.methods.int4_checkpoints import AwqConfig

        return AwqConfig(cfg)


class MixedQuantizer(Quantizer):
    name = "mixed"
    description = "per-layer policy: {default: METHOD, rules: [{match: REGEX, kind: KIND, method: METHOD}], keep: []}"

    def from_checkpoint(self, cfg: dict) -> QuantConfig:
        raise ModelLoadError("config.json quantization_config.quant_method 'mixed' is a user policy, not a "
                             "checkpoint format")

    def from_user(self, options: dict) -> QuantConfig:
        from pagoda_quant.methods.mixed import MixedConfig

        return MixedConfig(options)


class GgufQuantizer(Quantizer):
    name = "gguf"
    description = "a GGUF file's Q4_1 linear weights computed as INT4 (group 32, its own scales), not dequantized"

    def from_checkpoint(self, cfg: dict) -> QuantConfig:
        raise ModelLoadError("config.json quantization_config.quant_method 'gguf' is not a checkpoint format; "
                             "quantization: gguf applies to .gguf files")

    def from_user(self, options: dict) -> QuantConfig:
        from pagoda_quant.methods.base import options_of
        from pagoda_quant.methods.gguf import GgufConfig

        options_of(options, {}, "quantization (gguf)")
        return GgufConfig()


class Mxfp4Config(QuantConfig):
    """MXFP4 checkpoints (GPT-OSS): linear layers are stored in full precision
    (``modules_to_not_convert``) and the experts as MXFP4 blocks, which the model dequantizes at
    load (``pagoda.loader.mxfp4``) into unquantized experts: no method per layer."""

    name = "mxfp4"


class Mxfp4Quantizer(_CheckpointOnly):
    name = "mxfp4"
    description = ("MXFP4 expert weights of GPT-OSS checkpoints, dequantized to the model dtype at load (no MXFP4 "
                   "kernel yet: they take bf16 memory)")

    def from_checkpoint(self, cfg: dict) -> QuantConfig:
        return Mxfp4Config()


QUANTIZERS = (Fp8Quantizer, Int4Quantizer, GptqQuantizer, AwqQuantizer, MixedQuantizer, GgufQuantizer,
              Mxfp4Quantizer)
