"""LLMEngine: requests in, RequestOutputs out, one ``step()`` at a time."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pagoda.config import EngineConfig
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.detokenizer import Detokenizer
from pagoda.engine.executor.tensor_parallel import create_executor
from pagoda.engine.kv_groups import blocks_for_one_sequence
from pagoda.engine.model_runner import ModelRunner
from pagoda.engine.pipeline import StepPipeline
from pagoda.engine.prompt_ids import check_prompt_ids, truncate_prompt_ids
from pagoda.engine.prompt_ids import prompt_token_ids as prompt_ids
from pagoda.engine.request_controls import RequestControls
from pagoda.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from pagoda.engine.sequence import Request, Sequence, SequenceStatus
from pagoda.engine.step_budget import choose_step_budget
from pagoda.engine.step_completion import StepCompletion, StepTimes
from pagoda.engine.step_plan import plan_step
from pagoda.errors import ConfigError, RequestError
from pagoda.layers.rotary import rope_parameters_of, uses_sequence_length
from pagoda.loader.model_loader import load_config
from pagoda.loader.source import resolve_source
from pagoda.multimodal.prompts import prompt_with_images
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.selection import select_platform
from pagoda.speculative.decoder import create_speculative_decoder
from pagoda.structured_outputs.mask_ahead import MaskAhead
from pagoda.tokenizer import load_tokenizer, tokenizer_location

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("pagoda")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device_name, dtype = config.resolved_device_and_dtype()
        named_by = f"dtype {config.dtype!r}" if device_name != config.device else None
        self.platform = select_platform(device_name, source=named_by)
        if dtype == "auto":
            dtype = self.platform.default_dtype
        why = self.platform.dtype_unsupported_reason(dtype)
        if why is not None:
            raise ConfigError(f"dtype {config.dtype!r}: {self.platform.name} cannot compute in {dtype}: {why}")
        self.dtype = dtype
        self.source = resolve_source(config.model, config.revision, config.download_dir)
        self.hf_config = load_config(self.source)
        self.model_name = config.served_model_name or self.source.name
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            self.source, tokenizer_location(config.tokenizer, self.source, config.tokenizer_revision,
                                            config.download_dir))
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.max_model_len = self._max_model_len()
        # one device: a ModelRunner; tensor_parallel_size > 1 or torchrun: rank 0's executor
        self.runner = create_executor(config, self.source, self.hf_config, self.platform, dtype)
        # speculative decoding (pagoda.speculative): a draft model takes its share of the memory first
        self.speculative = create_speculative_decoder(self) if config.speculative_config else None
        num_blocks = (self.runner.allocate_kv_cache(self.speculative.target_kv_blocks()) if self.speculative
                      else self.runner.allocate_kv_cache())
        self.step_budget = choose_step_budget(config, self.platform, self.runner.model)
        step_tokens = max(self.step_budget.tokens, self.step_budget.idle_tokens or 0)  # the largest chunk
        windows = self.runner.kv_layout.windows
        one_sequence = blocks_for_one_sequence(windows, self.max_model_len, config.block_size, step_tokens)
        if num_blocks < one_sequence:
            groups = f" in {len(windows)} KV cache groups (windows {list(windows)})" if len(windows) > 1 else ""
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks × block_size {config.block_size} = "
                f"{num_blocks * config.block_size} tokens, less than one sequence of max_model_len="
                f"{self.max_model_len} needs ({one_sequence} blocks{groups}): lower max_model_len or give the "
                f"cache more room (num_kv_blocks, kv_cache_memory_gb, memory_utilization)")
        prefix_caching = config.enable_prefix_caching
        if prefix_caching and uses_sequence_length(self.runner.model, self.max_model_len):
            logger.warning("prefix caching is off: this model's rotary scaling depends on each sequence's length "
                           "(e.g. LongRoPE beyond original_max_position_embeddings), so cached blocks cannot be "
                           "shared between sequences; lower max_model_len to the switch length to keep it")
            prefix_caching = False
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_caching, windows)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.step_budget.tokens, self.max_model_len,
                                   idle_step_tokens=self.step_budget.idle_tokens,
                                   max_loras=config.max_loras if config.enable_lora else None)
        if config.runner != "pooling":  # (a pooling runner only prefills: decode graphs would go unused)
            graph_batch = self.speculative.graph_batch_size(config.max_num_seqs) if self.speculative else None
            self.runner.capture_graphs(graph_batch or config.max_num_seqs, self.max_model_len,
                                       self.step_budget.tokens)
        # offline steps launched ahead of the host work (pagoda.engine.pipeline), on one device or over
        # tensor-parallel ranks, where the platform queues work asynchronously (pipeline stages: not yet)
        self.pipeline: StepPipeline | None = None
        if self.platform.supports_async_steps and config.pipeline_parallel_size == 1:
            self.pipeline = StepPipeline(self)
        if self.speculative is not None:  # verification steps run one at a time
            self.pipeline = None
        if config.async_scheduling is True and self.pipeline is None:
            logger.warning("async_scheduling: the %s platform runs steps one at a time; the key changes nothing "
                           "here", self.platform.name)
        self.eos_token_ids = self._eos_ids()
        grammar_process = config.structured_outputs_process
        if grammar_process is None:  # unset: where host work bounds the steps (they run ahead of it)
            grammar_process = self.platform.supports_async_steps
        self.controls = RequestControls(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids, config,
                                        grammar_process)
        sampler = self.runner.sampler
        sampler.stop_token_ids, sampler.processors = self.eos_token_ids, self.controls.processors
        # grammar masks filled during the host work, into host buffers the device copies from without waiting
        self.mask_ahead = sampler.mask_ahead = MaskAhead(self.platform.host_buffer, self.platform.pin_in_place)
        self.requests: dict[str, Request] = {}
        self._counter = itertools.count()
        self.mm_processor = self._multimodal_processor()  # None: a model that takes no images
        self.times = StepTimes()
        self.completion = StepCompletion(self)  # a step's end, for every step driver
        self.pooling = None  # runner: pooling -> pagoda.pooling.engine.PoolingEngine (prefill-only steps)
        if config.runner == "pooling":
            from pagoda.pooling.engine import PoolingEngine

            self.pooling = PoolingEngine(self)

    # ------------------------------------------------------------------ setup helpers
    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if self.config.max_model_len is None:
            return int(limit)
        rope = rope_parameters_of(self.hf_config)
        if rope.get("rope_type") == "dynamic" and rope.get("factor"):
            limit = int(limit * rope["factor"])  # dynamic NTK scaling extends the trained length
        if self.config.max_model_len > limit:
            raise ConfigError(f"max_model_len={self.config.max_model_len} exceeds the model's longest supported "
                              f"length {limit} (max_position_embeddings, times the dynamic rope factor if any)")
        return self.config.max_model_len

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.hf_config, "eos_token_id", None),
                    getattr(getattr(self.hf_config, "generation_config", None), "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(i for i in src if isinstance(i, int))
        return ids

    def _multimodal_processor(self):
        from pagoda.interfaces import supports_multimodal

        model = getattr(self.runner, "model", None)
        if model is None or not supports_multimodal(model):
            return None
        if not isinstance(self.runner, ModelRunner):  # the workers would not see the images
            raise ConfigError(f"{type(model).__name__} takes images, which run on one device for now: set "
                              f"tensor_parallel_size to 1 (docs/multimodal.md)")
        from pagoda.multimodal.processor import MultiModalProcessor

        return MultiModalProcessor(model, str(self.source.path) if self.source.kind != "gguf" else None, self.config)

    def process_multimodal(self, prompt_token_ids: list[int], images: list[tuple[Any, str]],
                           prompt_field: str = "prompt"):
        """A prompt's images (each with the request field that carries it) processed for this model:
        ``pagoda.multimodal.MultiModalInputs``. CPU work, safe to run off the engine loop."""
        if self.mm_processor is None:
            arch = ", ".join(getattr(self.hf_config, "architectures", None) or ["?"])
            raise RequestError(f"this model ({arch}) is text-only: it takes no images",
                               field=images[0][1] if images else "multi_modal_data")
        return self.mm_processor.process(prompt_token_ids, images, prompt_field)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer (none in its directory, or skip_tokenizer_init): "
                               "pass token ids", field="prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str | None, prompt: str | list[int] | None,
                    params: SamplingParams | None = None, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, multi_modal_data: dict | None = None,
                    mm_inputs=None, lora_request: Any = None) -> str:
        """Validate and queue a request. A bad request raises RequestError and changes nothing.
        ``multi_modal_data`` ({"image": image or list}) is processed here; ``mm_inputs``: already
        processed (``process_multimodal``, e.g. by the server off the engine loop). ``lora_request``: a
        ``pagoda.lora.LoRARequest`` (None: the base model)."""
        if self.pooling is not None or not isinstance(params, (SamplingParams, type(None))):
            from pagoda.pooling.engine import add_pooling_request  # PoolingParams (pagoda.pooling)

            if multi_modal_data is not None or mm_inputs is not None:
                raise RequestError("images are not supported by the pooling runner yet", field="prompt")
            if lora_request is not None:
                raise RequestError("LoRA adapters are not supported by the pooling runner yet", field="model")
            return add_pooling_request(self, request_id, prompt, params, prompt_token_ids, arrival_time)
        params = params or SamplingParams()
        self.validate_params(params)
        if lora_request is not None:
            from pagoda.lora.engine_support import check_lora_request

            check_lora_request(self, lora_request)
        if request_id is None:
            request_id = self.new_request_id()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", field="request_id")
        text = prompt if isinstance(prompt, str) else None
        prompt_token_ids = prompt_ids(prompt, prompt_token_ids, self.tokenize)
        prompt_token_ids, mm_inputs = prompt_with_images(self, prompt_token_ids, multi_modal_data, mm_inputs, params)
        prompt_token_ids = truncate_prompt_ids(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len)
        check_prompt_ids(prompt_token_ids, self.hf_config.vocab_size)
        budget = self.max_model_len - len(prompt_token_ids)
        if budget < 1:
            raise RequestError(f"the prompt has {len(prompt_token_ids)} tokens; this model's max_model_len "
                               f"is {self.max_model_len}, which leaves no room for output", field="prompt")
        if params.max_tokens is not None and params.max_tokens > budget:
            params = SamplingParams(**{**_fields(params), "max_tokens": budget})
        prepared = self.controls.prepare(params)  # a grammar that does not compile is this request's error
        request = Request(request_id, text, list(prompt_token_ids), params, arrival_time or time.time())
        self.controls.attach(request, prepared)
        if mm_inputs is not None:
            for seq in request.seqs:
                seq.mm_inputs = mm_inputs
        self.requests[request_id] = request
        for seq in request.seqs:
            seq.lora_request = lora_request
            self.scheduler.add(seq)
        return request_id

    def new_request_id(self) -> str:
        """A request id no other request of this engine was given by default ("req-N")."""
        return f"req-{next(self._counter)}"

    def load_lora(self, request) -> None:
        """Load a LoRA adapter (``pagoda.lora.LoRARequest``) ahead of its requests (the server's
        ``--lora-modules`` and load route); raises LoRAError if it is refused."""
        from pagoda.lora.engine_support import register_lora

        register_lora(self, request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget a LoRA adapter (the server's unload route)."""
        from pagoda.lora.engine_support import remove_lora

        remove_lora(self, lora_int_id)

    def validate_params(self, params: SamplingParams) -> None:
        """Check ``params`` against this engine's limits (max_logprobs, the vocabulary, max_n);
        a bad field raises RequestError naming it."""
        params.validate(self.config.max_logprobs, vocab_size=self.hf_config.vocab_size, max_n=self.config.max_n)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self.runner.forget(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ stepping
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled step. Returns an output for every request that received tokens,
        or with ``finished_only`` only for those that finished (offline batches: building
        every running request's partial output each step costs host time)."""
        if self.pooling is not None:  # prefill-only steps: outputs of the requests that finished
            return self.pooling.step()
        if self.pipeline is not None:  # (None back: this step is not for the pipeline)
            outputs = self.pipeline.step(finished_only)
            if outputs is not None:
                return outputs
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        if out.is_empty:
            return []
        self.completion.mark_scheduled(out)
        if self.speculative is not None:
            outputs = self.speculative.step(out, finished_only, t0, t1)
            if outputs is not None:  # (None: nothing was drafted, a plain step)
                return outputs
        result = self.runner.collect(self.runner.launch(plan_step(out)))
        if result.prompt_logprobs:
            self.controls.record_prompt_logprobs(self.requests, {it.seq.seq_id: it.seq for it in out.scheduled},
                                                 result.prompt_logprobs)
        return self.completion.complete(out, result.tokens, result.logprobs, finished_only, t0, t1,
                                        failed=result.failed)

    def fail_request(self, request_id: str, error: BaseException) -> None:
        """End a request that failed inside a step (a row that could not be sampled, decoded or
        constrained): its sequences finish with "error" and free their blocks; its final output
        (built by the step) carries the message. Nothing else in the step is touched."""
        request = self.requests.get(request_id)
        if request is None or request.error is not None:
            return
        logger.error("request %s failed and was ended (the other requests go on): %s: %s", request_id,
                     type(error).__name__, error, exc_info=error)
        request.error = f"{type(error).__name__}: {error}"
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)

    def enable_step_pipeline(self) -> None:
        """Pipeline offline steps on a device that does not do it by default (tests on a CPU,
        where it changes nothing but the order of host work)."""
        if self.config.pipeline_parallel_size > 1:
            raise ConfigError("the step pipeline runs on one device or over tensor-parallel ranks, not over "
                              "pipeline stages")
        self.pipeline = StepPipeline(self)

    def shutdown(self) -> None:
        """Stop the grammar masks' worker thread (or process) and the other ranks of a tensor-parallel engine (the ranks
        are also stopped when the engine is garbage-collected or the process exits)."""
        self.mask_ahead.close()
        self.controls.structured_outputs.shutdown()
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ------------------------------------------------------------------ stats
    def score_prompt(self, prompt_token_ids) -> torch.Tensor:
        """Logits [len(prompt), vocab] (float32, on the CPU) of every prompt position, computed in one
        prefill through the paged path, outside the scheduler (scoring, quantization checks, tests). Its
        KV blocks are taken from the free pool and given back; running requests are not disturbed."""
        ids = list(prompt_token_ids)
        check_prompt_ids(ids, self.hf_config.vocab_size)
        if len(ids) > self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}",
                               field="prompt")
        seq = Sequence("score", 0, ids, SamplingParams(max_tokens=1))
        if not self.block_manager.allocate_slots(seq, seq.num_tokens):
            raise RequestError(f"not enough free KV blocks to score a {seq.num_tokens}-token prompt "
                               f"({self.block_manager.num_free_blocks} free)")
        try:
            seq.num_computed_tokens = 0  # compute every position, even a cached prefix
            out = SchedulerOutput([ScheduledSeq(seq, seq.num_tokens, True)], 0, seq.num_tokens)
            return self.runner.forward_all_logits(plan_step(out)).cpu()
        finally:
            self.block_manager.free(seq)

    @property
    def parameter_count(self) -> int:
        """Parameters of the loaded model (under tensor parallelism: of rank 0's shard)."""
        return sum(p.numel() for p in self.runner.model.parameters())

    def get_stats(self) -> dict[str, Any]:
        bm = self.block_manager
        stats = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "num_preemptions": self.scheduler.stats.num_preemptions,
            "num_steps": self.scheduler.stats.num_steps,
            "prefill_tokens_computed": self.scheduler.stats.num_prefill_tokens,
            "generated_tokens": self.scheduler.stats.num_generated_tokens,
            "prefix_cache_hit_tokens": bm.prefix_hits,
            "prefix_cache_query_tokens": bm.prefix_queries,
        }
        from pagoda.engine.expert_stats import expert_load_summary

        if self.speculative is not None:
            stats["speculative"] = self.speculative.stats.as_dict()
        experts = expert_load_summary(self.runner.expert_counts)
        if experts:
            stats["expert_load"] = experts
        if self.pipeline is not None:  # steps launched before the previous one's tokens were known
            stats["steps_launched_ahead"] = self.pipeline.launched_ahead
            stats["steps_sampled_after_launch"] = self.pipeline.sampled_later
            # host seconds spent waiting for the device (near 0: the host's work bounds the steps)
            stats["device_wait_seconds"] = getattr(self.runner, "device_wait_seconds", 0.0)
        mixed = getattr(self.runner, "mixed_graphs", None)
        if mixed is not None:  # steps with prefill chunks replayed from graphs (pagoda.engine.mixed_graphs)
            stats["mixed_steps_replayed"] = mixed.replays
        mask = self.runner.sampler.mask
        if mask.steps:  # structured outputs: the grammar masks' host cost
            stats["structured_outputs"] = replace(mask, fill_wait_seconds=self.mask_ahead.wait_seconds).summary()
        return stats


def _fields(params: SamplingParams) -> dict:
    from dataclasses import fields

    return {f.name: getattr(params, f.name) for f in fields(params) if f.init}
