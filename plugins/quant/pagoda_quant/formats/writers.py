"""Writing pre-quantized checkpoints in the on-disk formats pagoda reads.

Round-to-nearest only (no GPTQ/AWQ calibration): the point is the exact tensor names,
dtypes, shapes, packing and ``quantization_config`` keys of each format, so a checkpoint
written here loads wherever the format does. Each ``*_tensors`` function takes one
full-precision weight W [N, K] and returns (the tensors stored under the layer's prefix,
the dequantized weight those tensors mean, float32 [N, K]).

  fp8-block  ``weight`` e4m3 + ``weight_scale_inv`` f32 [N/bn, K/bk]  (DeepSeek-V3)
  fp8        ``weight`` e4m3 + ``weight_scale`` f32 [] (+ ``input_scale`` f32 [] when static)
  gptq       ``qweight`` i32 [K/8, N], ``qzeros`` i32 [K/G, N/8], ``scales`` f16 [K/G, N], ``g_idx`` i32 [K]
  awq        ``qweight`` i32 [K, N/8], ``qzeros`` i32 [K/G, N/8] (AWQ order), ``scales`` f16 [K/G, N]

``quantize_checkpoint(src, dst, fmt)`` converts a whole safetensors checkpoint directory.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from pagoda_quant.formats import fp8 as f8
from pagoda_quant.formats import int4 as i4
from pagoda_quant.layer_match import layer_kind

FORMATS = ("fp8-block", "fp8", "gptq", "awq")


def fp8_block_tensors(w: torch.Tensor, block: tuple[int, int]) -> tuple[dict, torch.Tensor]:
    q, scale_inv = f8.quantize_blockwise(w, block)
    return {"weight": q, "weight_scale_inv": scale_inv}, f8.dequantize_blockwise(q, scale_inv, block)


def fp8_tensor_tensors(w: torch.Tensor, input_amax: float | None = None) -> tuple[dict, torch.Tensor]:
    q, scale = f8.quantize_per_tensor(w)
    out = {"weight": q, "weight_scale": scale.reshape(())}
    if input_amax is not None:
        out["input_scale"] = f8.scale_for(torch.tensor(float(input_amax))).reshape(())
    return out, q.float() * scale


def _group_quantize(w: torch.Tensor, group: int, symmetric: bool, columns: torch.Tensor, min_zero: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize W [N, K] with groups made of ``columns`` (a permutation of range(K)) taken
    ``group`` at a time. Returns q [N, K] (original column order), scales and zeros [K/G, N];
    the scales are rounded to float16 (as stored) before q is computed with them."""
    wp = w.float()[:, columns]
    _, scales, zeros = i4.quantize_groups(wp, group, symmetric)
    scales = scales.half().float()
    zeros = zeros.clamp(min=min_zero)
    s = scales.repeat_interleave(group, dim=1)
    z = zeros.repeat_interleave(group, dim=1)
    qp = torch.round(wp / s + z).clamp_(0, i4.MAXQ)
    q = torch.empty_like(qp)
    q[:, columns] = qp
    return q.to(torch.uint8), scales.t().contiguous(), zeros.t().contiguous()


def _dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_of: torch.Tensor) -> torch.Tensor:
    """q [N, K], scales/zeros [K/G, N], group_of [K] -> float32 [N, K]."""
    return (q.float() - zeros.t()[:, group_of]) * scales.t()[:, group_of]


def gptq_tensors(w: torch.Tensor, group_size: int = 128, symmetric: bool = True, desc_act: bool = False,
                 v2: bool = False, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """GPTQ's layout. ``desc_act`` quantizes the input columns in a (random, seeded) act order:
    group g holds the columns order[g*G:(g+1)*G] and ``g_idx[c]`` names each column's group.
    The original format (``v2`` false) stores zero - 1, so its zero points start at 1."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)
    q, scales, zeros = _group_quantize(w, g, symmetric, order, min_zero=0 if v2 else 1)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    stored_zeros = zeros if v2 else zeros - 1
    tensors = {"qweight": i4.pack_rows(q.t().contiguous()), "qzeros": i4.pack_cols(stored_zeros.to(torch.int64)),
               "scales": scales.half(), "g_idx": g_idx}
    return tensors, _dequantize(q, scales, zeros, g_idx.long())


def awq_tensors(w: torch.Tensor, group_size: int = 128) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    g = k if group_size == -1 else group_size
    q, scales, zeros = _group_quantize(w, g, False, torch.arange(k))
    tensors = {"qweight": i4.pack_cols(q.t().contiguous(), i4.AWQ_ORDER),
               "qzeros": i4.pack_cols(zeros.to(torch.int64), i4.AWQ_ORDER), "scales": scales.half()}
    return tensors, _dequantize(q, scales, zeros, torch.arange(k) // g)


_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _input_seed(module: str) -> int:
    """GPTQ's act order comes from the layer input's statistics, so projections of one input
    (q/k/v, gate/up) share it: derive the order's seed from the input, not the module."""
    parent, _, leaf = module.rpartition(".")
    return zlib.crc32(f"{parent}.{_SHARED_INPUT.get(leaf, leaf)}".encode())


def quantization_config(fmt: str, **opts) -> dict:
    """The ``quantization_config`` a checkpoint of ``fmt`` carries in config.json."""
    skip = opts.get("skip") or None
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(opts.get("block", (128, 128))), "modules_to_not_convert": skip}
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if opts.get("input_amax") else "dynamic",
                "ignored_layers": skip or []}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": opts.get("group_size", 128),
                "desc_act": opts.get("desc_act", False), "sym": opts.get("symmetric", True),
                "checkpoint_format": "gptq_v2" if opts.get("v2") else "gptq", "damp_percent": 0.01,
                "true_sequential": True, "static_groups": False, "modules_to_not_convert": skip}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": opts.get("group_size", 128), "zero_point": True,
                "version": "gemm", "modules_to_not_convert": skip}
    raise ValueError(f"unknown format {fmt!r} (formats: {', '.join(FORMATS)})")


def quantizes(name: str, tensor: torch.Tensor, skip: list[str]) -> bool:
    """Whether a checkpoint tensor is a linear weight that the format stores quantized."""
    if not name.endswith(".weight") or tensor.dim() != 2:
        return False
    module = name[: -len(".weight")]
    if layer_kind(module) in ("router", "other") or any(s in module for s in skip):
        return False
    return True


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, skip: list[str] | None = None,
                        input_amax: dict[str, float] | None = None,
                        extra: Callable[[str], dict] | None = None, **opts) -> dict[str, torch.Tensor]:
    """Write ``src`` (a safetensors checkpoint directory) quantized as ``fmt`` into ``dst``.

    ``skip``: module name fragments left in full precision (listed in the config too);
    ``input_amax``: module -> activation amax (fp8 static; modules it lacks take its largest
    value). Returns the state dict with every
    quantized weight replaced by what it dequantizes to (the reference to compare against).
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    skip = list(skip or [])
    state: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(path)))
    out, reference = {}, {}
    for name, tensor in state.items():
        if not quantizes(name, tensor, skip):
            out[name] = reference[name] = tensor
            continue
        module = name[: -len(".weight")]
        if fmt == "fp8-block":
            tensors, deq = fp8_block_tensors(tensor, tuple(opts.get("block", (128, 128))))
        elif fmt == "fp8":
            # static: every layer needs an input scale; one missing from the calibration (e.g. an
            # expert no calibration token reached) takes the largest calibrated amax
            amax = None if not input_amax else input_amax.get(module, max(input_amax.values()))
            tensors, deq = fp8_tensor_tensors(tensor, amax)
        elif fmt == "gptq":
            tensors, deq = gptq_tensors(tensor, opts.get("group_size", 128), opts.get("symmetric", True),
                                        opts.get("desc_act", False), opts.get("v2", False), seed=_input_seed(module))
        elif fmt == "awq":
            tensors, deq = awq_tensors(tensor, opts.get("group_size", 128))
        else:
            raise ValueError(f"unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
        out.update({f"{module}.{k}": v.contiguous() for k, v in tensors.items()})
        reference[name] = deq.to(tensor.dtype)
    if extra is not None:
        out.update(extra(fmt))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, skip=skip, input_amax=input_amax, **opts)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra_file in src.iterdir():
        if extra_file.suffix != ".safetensors" and extra_file.name != "config.json" and extra_file.is_file():
            shutil.copy(extra_file, dst / extra_file.name)
    return reference
