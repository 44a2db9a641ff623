"""The ModelRunner owns device state: the model, the KV cache, static buffers and graphs.

It turns each step's plan (``pagoda.engine.step_plan``: plain data, the same on every rank) into tensors,
runs ``model.forward(input_ids, positions)`` inside a ForwardContext, computes logits for the sampling rows
and chooses their tokens (rank 0, from the plan's sequences). A step is ``launch(plan) -> PendingStep``, then
``collect(pending) -> StepResult``; the tensor-parallel executor has the same two methods.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pagoda import kernels
from pagoda.config import EngineConfig
from pagoda.engine.inputs import StepInputs, build_step_inputs
from pagoda.engine.kv_groups import KVCacheLayout, plan_kv_layout
from pagoda.engine.sampler import Sampler, StepResult, fail_blocked, row_argmax
from pagoda.engine.step_plan import ARGMAX, ON_DEVICE, ON_HOST, StepPlan
from pagoda.errors import ConfigError
from pagoda.forward_context import ForwardContext, prepared_context, set_forward_context
from pagoda.interfaces import AttentionBackend, AttentionSpec, Platform, supports_multimodal
from pagoda.layers.attention import Attention
from pagoda.loader.model_loader import build_model
from pagoda.loader.source import ModelSource
from pagoda.selection import select_allocator, select_attention_backend

logger = logging.getLogger("pagoda")


@dataclass
class PendingStep:
    """A launched step (``ModelRunner.launch``); ``collect`` waits for it and returns its ``StepResult``."""

    how: str  # ARGMAX, ON_DEVICE or ON_HOST
    num_seqs: int  # rows that sample
    rows: list  # ON_HOST: their SamplingRows, in row order (rank 0's; empty on the other ranks and otherwise)
    logits: torch.Tensor | None = None  # [num_seqs, vocab] on the device, until the tokens are chosen
    tokens: torch.Tensor | None = None  # [num_seqs] int64 on the device, once chosen there
    host: torch.Tensor | None = None  # pinned, [>= num_seqs + len(grammar_rows)]: the tokens, then the flags
    event: object | None = None  # Platform.record_event() after the copy (None where copies are synchronous)
    grammar_rows: list[int] = field(default_factory=list)  # rows whose "no token allowed" flag follows the tokens
    failed: dict[int, BaseException] = field(default_factory=dict)  # rows that could not be sampled
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # computed in the forward (ON_HOST steps)

    @property
    def waits_for_choice(self) -> bool:
        """An ON_DEVICE step whose tokens are not chosen yet (``ModelRunner.choose_on_device``)."""
        return self.how == ON_DEVICE and self.tokens is None


PROMPT_LOGITS_ROWS = 512  # prompt positions whose logits are computed at once (prompt_logprobs)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    if TORCH_DTYPES.get(kv_cache_dtype) == model_dtype:  # the model dtype by name: a full-precision cache
        return model_dtype
    model = next((n for n, d in TORCH_DTYPES.items() if d == model_dtype), str(model_dtype))
    raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported (auto, fp8, or the model dtype {model})")


def resolve_kv_cache_dtype(setting: str, quant_config, model_dtype: torch.dtype) -> str:
    """The user's ``kv_cache_dtype``, except that ``auto`` takes the cache a quantization
    config declares (``QuantConfig.kv_cache_dtype()``, e.g. a checkpoint's fp8 KV cache scheme)."""
    declared = quant_config.kv_cache_dtype() if setting == "auto" and quant_config is not None else None
    if not declared:
        return setting
    try:
        kv_cache_torch_dtype(declared, model_dtype)
    except ConfigError as e:
        raise ConfigError(f"quantization {quant_config.name!r} declares KV cache dtype {declared!r}: {e}; set "
                          f"kv_cache_dtype explicitly") from None
    logger.info("kv cache: %s, as the quantization config declares (kv_cache_dtype: auto)", declared)
    return declared


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config, platform: Platform,
                 dtype: str, device: torch.device):
        self.config = config
        self.platform = platform
        self.device = device
        self.dtype = TORCH_DTYPES[dtype]
        self.dtype_name = dtype
        kernels.activate(platform.name)
        t0 = time.perf_counter()
        self.model = build_model(config, source, hf_config, self.dtype, device)
        self.load_seconds = time.perf_counter() - t0
        self.kv_cache_setting = resolve_kv_cache_dtype(config.kv_cache_dtype, getattr(self.model, "quant_config", None),
                                                       self.dtype)
        self.attn_layers: list[Attention] = [m for m in self.model.modules() if isinstance(m, Attention)]
        for i, layer in enumerate(self.attn_layers):
            layer.layer_index = i
        self.backends: dict[str, AttentionBackend] = {}
        for layer in self.attn_layers:
            if layer.spec.kind not in self.backends:
                backend = select_attention_backend(config.attention_backend, platform, dtype, layer.spec)
                # attention_options belong to the named backend (or to whatever auto picks), not
                # to a backend auto-picked for a kind the named one does not implement.
                named = config.attention_backend in ("auto", backend.name)
                self.backends[layer.spec.kind] = backend.configure(config.attention_options if named else {})
        self.kv_layout = self._plan_kv_layout()
        self.sampler = Sampler(device, config.seed)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.graphs = None  # pagoda.engine.graphs.DecodeGraphs when captured
        self.mixed_graphs = None  # pagoda.engine.mixed_graphs.MixedGraphs: steps with prefill chunks, when captured
        self._token_hosts: list[torch.Tensor] | None = None  # page-locked token buffers of launched steps
        self._token_turn = 0
        self.device_wait_seconds = 0.0  # host time collect spent waiting for launched steps' tokens (get_stats)
        self.expert_counts: dict[str, torch.Tensor] = {}
        self.multimodal = None  # pagoda.multimodal.encoder.MultiModalStep of a model that embeds images
        if supports_multimodal(self.model):
            from pagoda.multimodal.encoder import MultiModalStep

            self.multimodal = MultiModalStep(self.model, device)
        self.lora = None  # pagoda.lora.manager.LoRAManager with enable_lora
        if config.enable_lora:
            from pagoda.lora.engine_support import create_lora_manager

            self.lora = create_lora_manager(self.model, config, self.dtype, device)

    # ------------------------------------------------------------------ KV cache
    def kv_cache_dtype(self) -> torch.dtype:
        return kv_cache_torch_dtype(self.kv_cache_setting, self.dtype)

    def _layer_shape(self, layer: Attention, num_blocks: int) -> tuple[int, ...]:
        return self.backends[layer.spec.kind].kv_cache_shape(layer.spec, num_blocks, self.config.block_size)

    def _plan_kv_layout(self) -> KVCacheLayout:
        """KV cache groups (``pagoda.engine.kv_groups``): window layers that give back the blocks
        that left their windows; each layer learns its group (which block tables it reads)."""
        windows = [layer.spec.sliding_window or None for layer in self.attn_layers]
        layout = plan_kv_layout(windows, [(layer.spec.kind, self._layer_shape(layer, 1)) for layer in self.attn_layers])
        for layer, group in zip(self.attn_layers, layout.layer_group):
            layer.kv_group = group
        if layout.note:
            logger.info("kv cache: %s", layout.note)
        elif layout.num_groups > 1:
            logger.info("kv cache: %d groups of %d layers (windows %s): window layers keep only their windows' "
                        "blocks", layout.num_groups, layout.num_slots, list(layout.windows))
        return layout

    def _slot_layers(self) -> list[Attention]:
        """One attention layer per cache tensor (the first that uses it): its shape is the tensor's."""
        first: dict[int, Attention] = {}
        for layer, slot in zip(self.attn_layers, self.kv_layout.layer_slot):
            first.setdefault(slot, layer)
        return [first[slot] for slot in range(self.kv_layout.num_slots)]

    def _page_bytes(self, layer: Attention) -> int:
        numel = 1
        for d in self._layer_shape(layer, 1):
            numel *= d
        return numel * torch.empty((), dtype=self.kv_cache_dtype()).element_size()

    def bytes_per_block(self) -> int:
        """Bytes one block id takes: a page in every cache tensor."""
        return sum(self._page_bytes(layer) for layer in self._slot_layers())

    def kv_layer_bytes(self) -> list[tuple[float, int | None]]:
        """(cache bytes per token, window or None) of each attention layer (roofline)."""
        return [(self._page_bytes(layer) / self.config.block_size, layer.spec.sliding_window or None)
                for layer in self.attn_layers]

    def kv_bytes_per_token(self) -> float:
        """Bytes one token takes in every layer's cache (the cost at full context; window layers
        stop paying it past their window)."""
        return sum(self._page_bytes(layer) for layer in self.attn_layers) / self.config.block_size

    def available_kv_blocks(self) -> int:
        """How many KV blocks the allocator fits in this device's budget. With KV cache groups a
        block id holds fewer layers than the model has: ``num_kv_blocks`` keeps meaning the memory
        of that many blocks in every layer, so it gives proportionally more ids."""
        self.platform.synchronize()
        per_block = max(1, self.bytes_per_block())
        blocks = select_allocator(self.platform).num_blocks(self.platform, per_block, self.config)
        if self.config.num_kv_blocks and self.kv_layout.num_groups > 1:
            blocks = int(blocks * self.kv_bytes_per_token() * self.config.block_size) // per_block
        return blocks

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate ``num_blocks`` per layer (default: what fits; tensor-parallel ranks pass the
        least any of them fits)."""
        allocator = select_allocator(self.platform)
        self.num_blocks = self.available_kv_blocks() if num_blocks is None else num_blocks
        shapes = [self._layer_shape(layer, self.num_blocks) for layer in self._slot_layers()]
        self.kv_caches = allocator.allocate(shapes, self.kv_cache_dtype(), self.device)
        for layer, slot in zip(self.attn_layers, self.kv_layout.layer_slot):
            layer.bind_kv_cache(self.kv_caches[slot])
        return self.num_blocks

    # ------------------------------------------------------------------ execution
    # The pieces of an eager step, public for the other step drivers (speculative decoding, pooling, graphs):
    # inputs from a scheduled step, the forward context over them, the MoE layers' expert counts after.
    def step_inputs(self, plan: StepPlan) -> StepInputs:
        """``plan``'s flat batch on the device (images and LoRA mappings included)."""
        inputs = build_step_inputs(plan, self.config.block_size, self.device, num_groups=self.kv_layout.num_groups)
        if self.multimodal is not None:  # 3-D positions, image rows (running the encoder for new images)
            self.multimodal.prepare(plan, inputs)
        if self.lora is not None:
            inputs.lora = self.lora.mapping(plan)
        return inputs

    def forward_context(self, inputs: StepInputs) -> ForwardContext:
        """The attention backends' metadata for ``inputs`` (``set_forward_context`` around the model)."""
        return prepared_context(inputs.meta, self.backends, token_seq_lens=inputs.token_seq_lens,
                                group_tables=inputs.group_tables, lora=inputs.lora)

    def add_expert_counts(self, ctx: ForwardContext) -> None:
        """Add the tokens per expert a forward under ``ctx`` routed to ``expert_counts`` (MoE models)."""
        found = ctx.expert_counts
        if not found:
            return
        if found.keys() <= self.expert_counts.keys():  # the usual case: one launch for every layer
            names = list(found)
            torch._foreach_add_([self.expert_counts[n] for n in names], [found[n] for n in names])
            return
        for name, counts in found.items():
            acc = self.expert_counts.get(name)
            self.expert_counts[name] = counts.detach().clone() if acc is None else acc.add_(counts)

    def _forward(self, inputs: StepInputs, prompt_logprobs_of: StepPlan | None = None, all_rows: bool = False,
                 count_experts: bool = True) -> tuple[torch.Tensor, dict[int, list]]:
        """The one eager forward of every step form: (logits of the sampling rows, or of every row with
        ``all_rows``; the prompt logprobs of ``prompt_logprobs_of``'s sequences that want them). The
        experts' token counts of MoE layers are accumulated unless ``count_experts`` is False (scoring)."""
        ctx = self.forward_context(inputs)
        with set_forward_context(ctx):
            hidden = self.model(inputs.input_ids, inputs.positions, **inputs.model_kwargs)
            logits = self.model.compute_logits(hidden if all_rows else hidden.index_select(0, inputs.sample_indices))
            prompt = {} if prompt_logprobs_of is None else self.prompt_logprobs(prompt_logprobs_of, inputs, hidden)
        if count_experts:
            self.add_expert_counts(ctx)
        return logits, prompt

    def prompt_logprobs(self, plan: StepPlan, inputs: StepInputs, hidden: torch.Tensor) -> dict[int, list]:
        """Prompt logprobs of the sequences that want them, over the prompt positions this step
        computes: logits in slices of PROMPT_LOGITS_ROWS rows (a long prompt's [T, vocab] at once
        would not fit), each rank computing the same slices (the logits are a collective)."""
        found: dict[int, list] = {}
        qsl = inputs.meta.query_start_loc_cpu
        for i, row in enumerate(plan.rows):
            if not row.wants_prompt_logprobs:
                continue
            scored = plan.sampling_row(i)  # (rank 0's: the prompt ids it scores; None on other ranks)
            start = row.num_computed_tokens
            end = min(start + row.num_new_tokens, row.num_prompt_tokens - 1)  # position p predicts p + 1
            for s in range(start, end, PROMPT_LOGITS_ROWS):
                row = qsl[i] + s - start
                count = min(PROMPT_LOGITS_ROWS, end - s)
                logits = self.model.compute_logits(hidden[row:row + count])
                for seq_id, entries in self.sampler.prompt_logprobs(logits, scored, s).items():
                    found.setdefault(seq_id, []).extend(entries)
        return found

    # ------------------------------------------------------------------ launch and collect
    # Every step, pipelined or not, on one device or rank 0 of several: launch(plan) -> PendingStep, then
    # collect(pending) -> StepResult. The step pipeline (pagoda.engine.pipeline) launches the next step
    # between the two; the engine's plain step collects right away.
    launch_modes = frozenset({ARGMAX, ON_DEVICE, ON_HOST})

    @torch.inference_mode()
    def launch(self, plan: StepPlan, feed=None, staged=None, how: str = ON_HOST) -> PendingStep:
        """Start ``plan``'s forward without waiting for it: graphs for a batch they hold, else eagerly.
        ``how`` its tokens are chosen (ARGMAX, ON_DEVICE, ON_HOST). ``feed`` (``pagoda.engine.pipeline.
        StepFeed``): the input ids of decode ``feed.rows`` are ``feed.tokens[feed.indices]`` (a previous
        step's tokens, not yet on the host). ``staged``: ``stage_launch(plan)``'s, if done already."""
        kind, prepared = staged if staged is not None else self.stage_launch(plan)
        if feed is not None:  # the fed rows' ids, written where this step's forward reads its input ids
            reader = self.graphs if kind == "graph" else self.mixed_graphs if kind == "mixed" else prepared
            reader.input_ids.index_copy_(0, feed.rows, feed.tokens.index_select(0, feed.indices))
        prompt: dict = {}
        if kind == "graph":  # (staged: (rows, bucket); every row of a decode batch samples)
            logits, n = self.graphs.replay(prepared), prepared[0]
        elif kind == "mixed":  # (staged: (bucket, sampling rows); no row wants prompt logprobs)
            logits, n = self.mixed_graphs.replay(prepared), prepared[1]
        else:
            logits, prompt = self._forward(prepared, prompt_logprobs_of=plan)
            n = prepared.sample_indices.shape[0]
        rows = plan.sampling_rows() if how == ON_HOST else []  # (ON_DEVICE: read when its tokens are chosen)
        pending = PendingStep(how, n, rows, logits[:n], prompt_logprobs=prompt)
        if how == ARGMAX:
            self._send_tokens(pending, row_argmax(pending.logits))
        return pending

    @torch.inference_mode()
    def choose_on_device(self, pending: PendingStep, rows: list) -> None:
        """Choose an ON_DEVICE step's tokens (``Sampler.select_on_device``; nothing waits for the device) from
        its sampling ``rows`` as they stand once the host has advanced the grammars their masks depend on (the
        step pipeline calls it then, with ``pagoda.engine.sampling_batch.sampling_rows`` of the step's
        sequences)."""
        chosen = self.sampler.select_on_device(pending.logits, rows)
        self._send_tokens(pending, chosen.tokens, chosen.blocked)
        pending.grammar_rows, pending.failed = chosen.grammar_rows, chosen.failed

    @torch.inference_mode()
    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step; its tokens in row order (ON_HOST: sampled now, with logprobs and prompt
        logprobs; rows left with no token by their grammar join ``failed``)."""
        if pending.how == ON_HOST:
            result = self.sampler(pending.logits, pending.rows) if pending.rows else StepResult([], [])
            result.prompt_logprobs = pending.prompt_logprobs
            return result
        if pending.waits_for_choice:
            raise RuntimeError("an ON_DEVICE step was collected before choose_on_device chose its tokens")
        if pending.event is not None:
            t0 = time.perf_counter()
            pending.event.synchronize()
            self.device_wait_seconds += time.perf_counter() - t0
        n = pending.num_seqs
        values = pending.host[: n + len(pending.grammar_rows)].tolist()
        if pending.grammar_rows:
            fail_blocked(pending.grammar_rows, values[n:], pending.failed)
        return StepResult(values[:n], None, pending.failed)

    @torch.inference_mode()
    def stage_launch(self, plan: StepPlan) -> tuple:
        """The host work of launching ``plan`` that needs no token of the step before it (its inputs built
        and their uploads queued), done while that step's tokens are still being chosen
        (``pagoda.engine.pipeline``); ``launch`` with ``staged`` then only patches the fed ids and starts
        the forward. Nothing else may launch in between."""
        if self.graphs is not None and self.graphs.can_run(plan):
            return "graph", self.graphs.stage(plan)
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(plan):
            return "mixed", self.mixed_graphs.stage(plan)
        return "eager", self.step_inputs(plan)

    def _send_tokens(self, pending: PendingStep, tokens: torch.Tensor, flags: torch.Tensor | None = None) -> None:
        """A launched step's chosen tokens [n] (and grammar rows' flags) into ``pending``, copied to a page-locked
        host buffer in the background; its logits are done with."""
        if self._token_hosts is None:
            size = max(self.config.max_num_seqs, self.graphs.max_bs if self.graphs is not None else 0)
            self._token_hosts = [self.platform.host_buffer((2 * size,), torch.int64) for _ in (0, 1)]
        host = self._token_hosts[self._token_turn]
        self._token_turn ^= 1  # two steps may be in flight: alternate the host buffers
        n = pending.num_seqs
        both = tokens if flags is None else torch.cat([tokens, flags.to(tokens.dtype)])
        host[:both.shape[0]].copy_(both, non_blocking=True)
        pending.tokens, pending.host, pending.event, pending.logits = both[:n], host, self.platform.record_event(), None

    @torch.inference_mode()
    def forward_all_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits of every scheduled token (tests and scoring): [T, vocab] float32."""
        return self._forward(self.step_inputs(plan), all_rows=True, count_experts=False)[0].float()

    def forget(self, seq_id: int) -> None:
        """A sequence finished or was aborted: drop its per-sequence state."""
        self.sampler.forget(seq_id)
        if self.multimodal is not None:
            self.multimodal.forget(seq_id)

    def load_lora(self, request) -> None:
        """Register and check a LoRA adapter (``LLMEngine.add_request``; on every tensor-parallel rank)."""
        self.lora.load(request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.lora.remove(lora_int_id)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, step_tokens: int | None = None) -> None:
        """Capture decode graphs where the platform and every backend allow it, and graphs of steps with
        prefill chunks (up to ``step_tokens``, the step token budget) where the backend captures those."""
        if self.config.enforce_eager or not self.platform.supports_graphs:
            return
        if not getattr(self.model, "supports_graphs", True):
            logger.info("graphs off: %s runs eagerly", type(self.model).__name__)
            return
        if not all(b.supports_graphs for b in self.backends.values()):
            logger.info("graphs off: attention backend %s cannot be captured",
                        [b.name for b in self.backends.values() if not b.supports_graphs])
            return
        from pagoda.engine.graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)
        self.graphs.capture()
        from pagoda.engine.mixed_graphs import ALWAYS_REPLAYED, MixedGraphs, why_not_mixed

        why = why_not_mixed(self)
        if why is not None:
            logger.info("steps with prefill chunks run eagerly: %s", why)
            return
        self.mixed_graphs = MixedGraphs(self, max_num_seqs, max_model_len,
                                        step_tokens or self.config.max_num_batched_tokens or ALWAYS_REPLAYED)
        self.mixed_graphs.capture()

    def spec_summary(self) -> list[AttentionSpec]:
        return [layer.spec for layer in self.attn_layers]
