"""The objects plugins register: platforms, attention backends, KV allocators, quantizers,
logits processors. (Tool-call and reasoning parsers are in ``pagoda.parsers``.)

This module imports no torch at import time so that plugin discovery stays cheap; the
methods that need torch import it inside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------- platforms
class Platform:
    """A kind of device. Subclass and override what differs from the defaults."""

    name: str = ""  # registry key and the value of EngineConfig.device ("cpu", "cuda", ...)
    device_type: str = ""  # torch device type string
    priority: int = 0  # device "auto" picks the available platform of highest priority
    dist_backend: str = "gloo"  # torch.distributed backend for this device
    default_dtype: str = "float32"
    supports_graphs: bool = False  # whether capture_graph works
    # An environment variable (named PAGODA_USE_<SOMETHING>) that, set to 1/true/yes/on while
    # device is auto, selects this platform; if the platform is unavailable that is an error
    # carrying unavailable_reason(), never a fallback to another device. None: no switch.
    env_switch: str | None = None
    # Whether the engine may launch a step before the previous step's sampled tokens reach the host
    # (pagoda.engine.pipeline): the device queues work, copies without waiting, and record_event works.
    supports_async_steps: bool = False
    # The environment variable that limits a process to some of the devices ("CUDA_VISIBLE_DEVICES"): each
    # data-parallel replica gets its own through it. None: replicas share the device (the CPU).
    visible_devices_env: str | None = None
    # A cap on the KV cache when the config sizes it from free memory (kv_cache_memory_gb and num_kv_blocks
    # unset): the CPU's 1 GiB keeps a laptop's memory for the rest; None: no cap.
    max_default_kv_cache_bytes: int | None = None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """None when usable here; otherwise why not, naming the missing library or device."""
        return None

    def dtype_unsupported_reason(self, dtype: str) -> str | None:
        """None if this device computes in ``dtype`` ("float16", ...); otherwise why not."""
        return None

    def device(self, index: int = 0) -> torch.device:
        import torch

        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device memory."""
        raise NotImplementedError

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def capture_graph(self, fn: Callable[[], Any], pool: Any = None) -> CapturedGraph:
        """Capture ``fn`` once; ``replay()`` reruns it on the same static buffers."""
        raise NotImplementedError(f"platform {self.name!r} has no graph capture")

    def default_max_num_batched_tokens(self) -> int:
        """The step token budget when the config leaves ``max_num_batched_tokens`` unset."""
        return 8192

    def step_token_budget(self, flops_per_token: float) -> int | None:
        """A smaller budget for steps while sequences decode, that bounds their stall given the model's
        FLOPs per token (``pagoda.engine.step_budget``); None: no bound (the default budget)."""
        return None

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor the device copies from and to without waiting (page-locked memory on
        devices that have it; plain memory by default)."""
        import torch

        return torch.zeros(shape, dtype=dtype)

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` in memory the device copies from without waiting (``host`` itself by default)."""
        return host

    def pin_in_place(self, host: torch.Tensor) -> Callable[[], None] | None:
        """Page-lock ``host``'s memory where it lies (e.g. memory mapped from a file another process writes), so
        that the device copies from it without waiting and without a copy through ``pin``; returns the undo, to
        call before that memory is unmapped, or None where the platform does not (the CPU: nothing to pin) or
        could not."""
        return None

    def record_event(self, timing: bool = False) -> Any:
        """A mark of the work queued so far on the current stream, with ``synchronize()`` (and, with
        ``timing``, ``elapsed_time(later_mark)`` in ms); None on devices whose work is done when queued
        (the CPU), where callers use the host clock."""
        return None

    def graph_pool(self) -> Any:
        """A new memory pool for the graphs one engine captures (None: the platform's default)."""
        return None

    def describe(self) -> str:
        return self.name


class CapturedGraph:
    """What ``Platform.capture_graph`` returns: ``output`` is fn's result, in static buffers."""

    output: Any = None

    def replay(self) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer needs from a backend and from the KV cache.

    kind "mha" (multi-head, grouped-query included): the cache holds K and V for
    ``num_kv_heads`` heads of ``head_size``. ``sinks``: each query head has a learned sink
    logit (``layer.sinks`` [num_heads] float32, GPT-OSS) that joins the softmax's denominator.
    kind "mla": the cache holds one latent vector of ``kv_lora_rank + qk_rope_head_dim`` per
    token; ``extra`` carries the MLA dims. kind "mla_sparse" (DeepSeek-V3.2): the latent followed
    by the indexer's key, ``head_size`` values per token (``pagoda.layers.sparse_mla``).
    """

    kind: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


class AttentionBackend:
    """Attention over the paged KV cache for a flattened batch of prefill chunks and decodes.

    The runner orders each batch with decode sequences (one new token each) first, then
    prefill chunks, and describes it with ``pagoda.forward_context.AttentionMetadata``.
    """

    name: str = ""
    priority: int = 0
    platforms: tuple[str, ...] = ("*",)  # platform names, "*" for any
    # Platforms where ``attention_backend: auto`` may choose this backend; on the other
    # platforms it runs only when named (e.g. a device-tuned backend that also runs on cpu).
    auto_platforms: tuple[str, ...] = ("*",)
    kinds: tuple[str, ...] = ("mha",)
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    # Whether forward() may be captured in a graph for decode-only batches.
    supports_graphs: bool = False
    # Whether forward() may be captured for batches that mix prefill chunks with decodes
    # (``pagoda.engine.mixed_graphs``): their metadata has ``mixed_graph`` set, ``num_tokens`` and
    # ``num_seqs`` are capacities (padding sequences have no tokens, padding tokens slot -1) and the
    # number of decodes is known only on the device; ``prepare`` makes the static state the graph reads
    # and ``fill_mixed_graph`` writes each step's values into it.
    supports_mixed_graphs: bool = False
    # Whether forward() applies ``layer.sinks`` (AttentionSpec.sinks); a backend that does not
    # is never selected for such layers.
    supports_sinks: bool = False

    def supports(self, platform: str, dtype: str, spec: AttentionSpec) -> str | None:
        """None if this backend can run ``spec`` on ``platform`` in ``dtype``; else the reason."""
        if "*" not in self.platforms and platform not in self.platforms:
            return f"runs on {', '.join(self.platforms)}, not {platform}"
        if spec.kind not in self.kinds:
            return f"does not implement attention kind {spec.kind!r}"
        if dtype not in self.dtypes:
            return f"does not support dtype {dtype}"
        if spec.sinks and not self.supports_sinks:
            return "does not implement attention sinks"
        return None

    def auto_selectable(self, platform: str) -> bool:
        """Whether ``attention_backend: auto`` may pick this backend on ``platform``."""
        return "*" in self.auto_platforms or platform in self.auto_platforms

    def configure(self, options: dict) -> AttentionBackend:
        """The backend to use for one engine, given ``EngineConfig.attention_options``.

        Backends with options return a configured copy (never mutate the registered
        instance: several engines may share it); this default accepts no options."""
        if options:
            from pagoda.errors import ConfigError

            raise ConfigError(f"attention_options: attention backend {self.name!r} takes no options "
                              f"(got {', '.join(sorted(options))})")
        return self

    def kv_cache_shape(self, spec: AttentionSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""
        if spec.kind == "mla":
            return (num_blocks, block_size, spec.latent_dim)
        if spec.kind == "mla_sparse":  # [latent | k_pe | index_k] per token (pagoda.layers.sparse_mla)
            return (num_blocks, block_size, spec.head_size)
        return (2, num_blocks, block_size, spec.num_kv_heads, spec.head_size)

    def prepare(self, meta: Any) -> Any:
        """Called once per step before the model runs; the result is ``meta.backend_data``."""
        return None

    def fill_mixed_graph(self, data: Any, query_start_loc: Any, num_decodes: int) -> None:
        """(``supports_mixed_graphs``) Before a mixed batch's graph replays: write the step's sequences
        (``query_start_loc``, numpy [B+1], the first ``num_decodes`` of them decoding) into ``data``, what
        ``prepare`` returned for the capture; host-to-device copies are queued, never waited for."""
        raise NotImplementedError(f"attention backend {self.name!r} does not capture mixed batches")

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """MHA: q [T, num_heads*head_size], k/v [T, num_kv_heads*head_size] for the new
        tokens; stores k/v at ``meta.slot_mapping`` then returns [T, num_heads*head_size].
        ``layer.spec`` is the AttentionSpec. MLA backends define ``forward_mla`` instead."""
        raise NotImplementedError(f"attention backend {self.name!r} has no multi-head attention (kinds: "
                                  f"{', '.join(self.kinds)})")

    def forward_mla(self, layer: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor,
                    k_pe: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """MLA (kind "mla"; ``pagoda.layers.mla``): q_nope [T, N, P], q_pe [T, N, R], kv_c_normed [T, L],
        k_pe [T, R]; stores [latent | k_pe] at ``meta.slot_mapping`` in kv_cache [B, block, L + R], then
        returns [T, N, V]."""
        raise NotImplementedError(f"attention backend {self.name!r} has no MLA (kinds: {', '.join(self.kinds)})")

    def forward_sparse_mla(self, layer: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor,
                           k_pe: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
                           index_weights: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """Sparse MLA (kind "mla_sparse", DeepSeek-V3.2; ``pagoda.layers.sparse_mla`` documents the
        arguments): the indexer picks each query's top-k cached tokens, MLA attends over them."""
        raise NotImplementedError(f"attention backend {self.name!r} has no sparse MLA (kinds: "
                                  f"{', '.join(self.kinds)})")


class MLABackend(AttentionBackend):
    """Base of the backends that run only MLA layers: they implement ``forward_mla``."""

    kinds: tuple[str, ...] = ("mla",)


# ---------------------------------------------------------------------------- KV allocator
class KVAllocator:
    """Decides how many KV blocks fit and allocates the per-layer cache tensors."""

    name: str = ""
    priority: int = 0
    platforms: tuple[str, ...] = ("*",)

    def num_blocks(self, platform: Platform, bytes_per_block: int, config: Any) -> int:
        raise NotImplementedError

    def allocate(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device) -> list[torch.Tensor]:
        raise NotImplementedError


# ---------------------------------------------------------------------------- quantization
class QuantMethod:
    """How one layer holds and applies its (possibly quantized) weights."""

    def create_weights(self, layer: Any, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register parameters on ``layer`` for a [sum(output_sizes), input_size] weight
        (sizes already divided per tensor-parallel rank). Each parameter carries
        ``output_dim`` / ``input_dim`` attributes used by the weight loaders."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Any) -> None:
        pass

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    # Optional: ``native_parts(layer) -> list[pagoda.kernels.cpu_decoder.NativeLinearPart] | None``: C
    # functions that compute the layer's output columns (float32 rows in and out, on the CPU), which the
    # fused CPU decode calls instead of ``apply``; None where this layer's weights have none.
    native_parts: Any = None


class QuantConfig:
    """A parsed quantization setting; hands every layer its method (None: full precision)."""

    name: str = ""

    def get_method(self, layer: Any, prefix: str) -> QuantMethod | None:
        return None

    def get_moe_method(self, layer: Any, prefix: str) -> Any:
        return None

    def kv_cache_dtype(self) -> str | None:
        return None

    # Optional: ``gguf_keeps_raw(name, ggml_type) -> bool``. Where it says True, the GGUF loader
    # passes tensor ``name`` (HF naming) as its raw block rows, uint8 [rows, bytes per row],
    # instead of dequantizing it (a method that computes on the file's own blocks).
    gguf_keeps_raw: Any = None
    # Optional: ``prepare_model(model)`` after the model is built, before its weights load (e.g. to give
    # the embedding and LM head a quant_method); ``begin_loading(source)`` with the ModelSource about to
    # load; ``finish_loading(model)`` after every layer processed its weights (e.g. a cache's write).
    prepare_model: Any = None
    begin_loading: Any = None
    finish_loading: Any = None


class Quantizer:
    """Registered through ``register_quantizers``; parses settings into a QuantConfig."""

    name: str = ""
    description: str = ""

    def from_checkpoint(self, quantization_config: dict) -> QuantConfig:
        """From a checkpoint's ``quantization_config`` whose ``quant_method`` is ``name``."""
        raise NotImplementedError

    def from_user(self, options: dict) -> QuantConfig:
        """From the user's ``quantization:`` setting (online quantization at load)."""
        raise NotImplementedError


# ---------------------------------------------------------------------------- logits processors
class LogitsProcessor:
    """Registered through ``register_logits_processors``; selected by name (``logits_processors``).

    The engine constructs each selected processor once, with the model's vocabulary size
    (the logits' width, which may exceed the tokenizer's) and its tokenizer (None when the
    engine runs without one). Before sampling, every request's row of logits passes
    through ``__call__`` with the tokens that request has generated so far; the result
    replaces the row. Keep per-request state out of the instance, or key it by
    something in ``output_token_ids``: one instance serves every request.
    """

    def __init__(self, vocab_size: int, tokenizer: Any) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits``: float [vocab_size] for one request (the device's dtype); return a
        tensor of the same shape (modifying ``logits`` in place and returning it is fine)."""
        raise NotImplementedError


# ---------------------------------------------------------------------------- multimodal models
@dataclass
class ImageInput:
    """One image after its model's processor: what the encoder needs and how many prompt tokens it
    fills. ``pixel_values`` and ``grid`` are the model's own (Qwen2.5-VL: [patches, C*T*P*P] and
    (t, h, w) in patches); ``num_tokens`` placeholder tokens stand for it in the prompt."""

    pixel_values: Any  # torch.Tensor, on the CPU
    grid: tuple[int, ...]
    num_tokens: int


class SupportsMultiModal:
    """The contract of a model that embeds images (mix it into the model class).

    The engine expands each image's single ``placeholder_token_id`` in a prompt to
    ``ImageInput.num_tokens`` copies, runs ``encode_images`` for the images a step reaches (batched
    across requests; the outputs are cached per image content, ``pagoda.multimodal``) and calls
    ``forward(input_ids, positions, image_embeds=(rows, embeds))``: the model embeds the tokens,
    then writes ``embeds`` [R, hidden] over the rows ``rows`` [R] (int64) of the step.
    ``mrope_positions`` gives 3-D positions (M-RoPE); a model with 1-D rotary returns None and
    receives the usual [T] positions.
    """

    supports_multimodal = True
    placeholder_token_id: int = -1  # the prompt token one image is written as (before expansion)
    placeholder_text: str = ""  # what a chat template's text gets for an image part (e.g. "<|image_pad|>")

    def create_image_processor(self, model_dir: str | None, options: dict) -> Callable[[list[Any]], list[ImageInput]]:
        """A callable from PIL images to ImageInputs, run on the CPU off the engine loop.
        ``options``: the user's ``mm_processor_kwargs`` (e.g. ``max_pixels``)."""
        raise NotImplementedError

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The language-model embeddings of each image, [num_tokens, hidden] each, in one batch."""
        raise NotImplementedError

    def mrope_positions(self, token_ids: list[int], placements: list[tuple[int, ImageInput]]) -> Any:
        """None (1-D positions), or (positions int64 [3, len(token_ids)], delta): the 3-D positions of the
        prompt, whose images start at the given offsets; a token after the prompt at index p has
        position p + delta in all three rows."""
        return None


def supports_multimodal(model: Any) -> bool:
    return bool(getattr(model, "supports_multimodal", False))
