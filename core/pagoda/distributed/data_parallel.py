"""Data parallelism: ``data_parallel_size`` engine replicas behind one front.

``DataParallelEngine`` has the request interface of ``LLMEngine`` (``add_request``,
``step``, ``abort_request``, ``has_unfinished_requests``, ``get_stats``, ``shutdown``) so
that ``LLM`` drives it unchanged. Each replica is a whole engine (possibly tensor/pipeline
parallel) in its own process (``pagoda.distributed.dp_replica``), started as a fresh
interpreter and talking to the front over a local ``multiprocessing.connection`` socket.
On CUDA, replica i sees devices ``[i*R, (i+1)*R)`` of the visible ones (R = its ranks).

Where a request goes (``choose_replica``): the least loaded replica, where load = the
requests the front has given it and not seen finish (running + waiting) + its KV cache
usage (fraction of blocks in use, from its last report) x ``max_num_seqs``; except that a
prompt whose first KV block (``block_size`` tokens) was seen before goes back to the replica
that holds that prefix in its cache, unless that one is much more loaded (more than twice
the least load + ``AFFINITY_SLACK``). The front tokenizes and checks prompts and preprocesses images
(a vision model's class built on the meta device answers for it); the rest of a request's validation
happens in its replica, whose refusal comes back as a failed output.

A replica that dies stops the front with a ``WorkerError`` naming it.
"""

from __future__ import annotations

import logging
import time
import weakref
from multiprocessing.connection import wait
from typing import Any

from pagoda.config import EngineConfig
from pagoda.distributed.output_deltas import OutputReceiver
from pagoda.distributed.replicas import Replica, SchedulerView, choose_replica, start_replicas, stop_replicas
from pagoda.engine.executor.failures import WorkerError, describe_exit
from pagoda.engine.prompt_ids import check_prompt_ids, truncate_prompt_ids
from pagoda.engine.prompt_ids import prompt_token_ids as prompt_ids
from pagoda.errors import ConfigError, RequestError
from pagoda.multimodal.inputs import block_key_images, for_transfer
from pagoda.multimodal.processor import processor_without_weights
from pagoda.multimodal.prompts import prompt_with_images
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.pooling.engine import check_pooling_params, fit_prompt, refuse_pooling_on_a_generator
from pagoda.pooling.params import PoolingParams
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")
STARTUP_TIMEOUT_S = 900.0
STREAM_WAIT_S = 0.02  # streaming: how long a step waits for outputs before the server's commands run


class DataParallelEngine:
    """The front of ``data_parallel_size`` replicas (see the module docstring)."""

    def __init__(self, config: EngineConfig, finished_only: bool = True):
        from pagoda.engine.llm_engine import LLMEngine
        from pagoda.loader.model_loader import load_config
        from pagoda.loader.source import resolve_source
        from pagoda.selection import select_platform
        from pagoda.tokenizer import load_tokenizer, tokenizer_location

        self.config = config
        size = config.data_parallel_size
        device_name, dtype = config.resolved_device_and_dtype()
        self.platform = select_platform(device_name)
        self.dtype = self.platform.default_dtype if dtype == "auto" else dtype
        self.source = resolve_source(config.model, config.revision, config.download_dir)
        self.hf_config = load_config(self.source)
        self.model_name = config.served_model_name or self.source.name
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            self.source, tokenizer_location(config.tokenizer, self.source, config.tokenizer_revision,
                                            config.download_dir))
        self.max_model_len = LLMEngine._max_model_len(self)  # the same rule as every replica's
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        local = config.model_copy(update={"data_parallel_size": 1, "model": str(self.source.path)}
                                  if getattr(self.source, "repo_id", None) else {"data_parallel_size": 1})
        self._listener, self.replicas = start_replicas(size, self.platform, ranks)
        self._finalizer = weakref.finalize(self, stop_replicas, self.replicas, self._listener)
        self.error: WorkerError | None = None
        self._receiver = OutputReceiver()  # the replicas send deltas (pagoda.distributed.output_deltas)
        self.parameter_count = 0  # replica 0 reports it when ready
        try:
            self._connect(local.model_dump_json(), finished_only)
        except BaseException:
            self._finalizer()
            raise
        self.requests: dict[str, int] = {}  # request id -> replica
        self._prefix_home: dict[int, int] = {}  # hash of a prompt's first block -> replica
        self._pending: list[RequestOutput] = []  # outputs made by the front (refused requests)
        self._counter = 0
        # what the server reads of an engine (pagoda.server): request controls for grammars and
        # processors, a scheduler view, the parameter count replica 0 reported
        from pagoda.engine.request_controls import RequestControls

        self.eos_token_ids = LLMEngine._eos_ids(self)
        self.controls = RequestControls(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids, config)
        self.scheduler = SchedulerView(self.replicas, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = None
        self.pooling = self.replicas[0].pooling  # runner: pooling: what the server reads of it
        # a model that takes images: the front processes them (off the engine loop), the replica encodes them
        self.mm_processor = processor_without_weights(config, self.source, self.hf_config)
        self._step_timeout = 60.0 if finished_only else STREAM_WAIT_S

    # ------------------------------------------------------------------ start-up
    def _connect(self, config_json: str, finished_only: bool) -> None:
        """Accept every replica's connection, send it its config, wait until its engine is up."""
        import threading

        accepted: list[Any] = []

        def accept() -> None:
            for _ in self.replicas:
                try:
                    accepted.append(self._listener.accept())
                except OSError:
                    return

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(accepted) < len(self.replicas):
            self._check_alive("while starting")
            if time.monotonic() > deadline:
                raise WorkerError(f"data-parallel replicas did not connect within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        for conn in accepted:
            _, index, _pid = conn.recv()
            self.replicas[index].conn = conn
            conn.send((config_json, finished_only))
        waiting = {r.conn: r for r in self.replicas}
        while waiting:
            for conn in wait(list(waiting), timeout=0.5):
                replica = waiting.pop(conn)
                self._handle(replica, self._recv(replica, "while starting"), "while starting")
            self._check_alive("while starting")
            if time.monotonic() > deadline:
                raise WorkerError(f"data-parallel replicas did not start within {STARTUP_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------------ failures
    def _check_alive(self, what: str) -> None:
        if self.error is not None:
            raise self.error
        for replica in self.replicas:
            code = replica.proc.poll()
            if code is not None:
                self._fail(replica, f"{describe_exit(code)} {what}".rstrip())

    def _fail(self, replica: Replica, what: str) -> None:
        self.error = WorkerError(f"{replica.describe()} {what}. The engine has stopped; create a new one.",
                                 [replica.index])
        self._finalizer()
        raise self.error

    def _recv(self, replica: Replica, what: str) -> Any:
        try:
            return replica.conn.recv()
        except (EOFError, OSError):
            replica.proc.wait(5.0)
            self._fail(replica, f"{describe_exit(replica.proc.poll())} {what}")

    def _send(self, replica: Replica, message: tuple) -> None:
        try:
            replica.conn.send(message)
        except OSError:
            self._fail(replica, "is gone (its connection closed)")

    def _handle(self, replica: Replica, message: tuple, what: str) -> list[RequestOutput]:
        kind = message[0]
        if kind == "crashed":
            if message[3] is not None:  # the user's error while the engine was being built (pagoda.errors)
                self._finalizer()
                raise message[3]
            self._fail(replica, f"raised {message[1]} {what}")
        if kind == "ready":
            replica.stats, self.parameter_count, replica.choices, replica.pooling = message[1:5]
            return []
        if kind == "stats":
            replica.stats = message[1]
            return []
        if kind == "failed":
            _, rid, text = message
            replica.unfinished.discard(rid)
            self.requests.pop(rid, None)
            return [RequestOutput(rid, None, [], [CompletionOutput(0, "", [], None, None, "error")], True,
                                  error=text)]
        outputs = self._receiver.decode(message[1])
        if message[2] is not None:  # (sent with some outputs only)
            replica.stats = message[2]
        for out in outputs:
            if out.finished:
                replica.unfinished.discard(out.request_id)
                self.requests.pop(out.request_id, None)
        return outputs

    # ------------------------------------------------------------------ requests
    def _loads(self) -> list[float]:
        return [len(r.unfinished) + r.kv_usage() * self.config.max_num_seqs for r in self.replicas]

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: pass token ids", field="prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str | None, prompt: str | list[int] | None,
                    params: SamplingParams | None = None, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, multi_modal_data=None, mm_inputs=None,
                    lora_request=None) -> str:
        self._check_alive("")
        pooled = self.pooling is not None or isinstance(params, PoolingParams)
        if pooled and (multi_modal_data is not None or mm_inputs is not None):
            raise RequestError("images are not supported by the pooling runner yet", field="prompt")
        if pooled:  # (the checks of pagoda.pooling.engine, here so that refusals stay 400s)
            if self.pooling is None:
                refuse_pooling_on_a_generator()
            check_pooling_params(params, self.pooling.head is not None, self.pooling.hidden_size)
        else:
            params = params or SamplingParams()
            params.validate(self.config.max_logprobs, vocab_size=self.hf_config.vocab_size, max_n=self.config.max_n)
        if lora_request is not None and not self.config.enable_lora:  # (the replica loads and checks the adapter)
            raise RequestError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} requested but "
                               f"this engine was started without enable_lora (--enable-lora)", field="lora_request")
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", field="request_id")
        text = prompt if isinstance(prompt, str) else None
        prompt_token_ids = prompt_ids(prompt, prompt_token_ids, self.tokenize)
        prompt_token_ids, mm_inputs = prompt_with_images(self, prompt_token_ids, multi_modal_data, mm_inputs, params)
        if pooled:
            prompt_token_ids = fit_prompt(prompt_token_ids, self.max_model_len, params.truncate_prompt_tokens, "prompt")
        else:
            prompt_token_ids = truncate_prompt_ids(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len)
        check_prompt_ids(prompt_token_ids, self.hf_config.vocab_size)
        if not pooled and len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_token_ids)} tokens; this model's max_model_len "
                               f"is {self.max_model_len}, which leaves no room for output", field="prompt")
        block = self.config.block_size
        adapter = lora_request.lora_int_id if lora_request is not None else 0  # (its blocks are its own)
        images = block_key_images(mm_inputs, block)  # (a prefix's images are part of it)
        key = hash((adapter, *prompt_token_ids[:block], *images)) if len(prompt_token_ids) >= block else None
        index = choose_replica(self._loads(), self._prefix_home.get(key) if key is not None else None)
        if key is not None:
            self._prefix_home[key] = index
        replica = self.replicas[index]
        self._send(replica, ("add", request_id, text, list(prompt_token_ids), params, arrival_time or time.time(),
                             lora_request, for_transfer(mm_inputs) if mm_inputs is not None else None))
        replica.unfinished.add(request_id)
        self.requests[request_id] = index
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            index = self.requests.pop(rid, None)
            if index is not None:
                self.replicas[index].unfinished.discard(rid)
                by_replica.setdefault(index, []).append(rid)
        for index, ids in by_replica.items():
            self._receiver.forget(ids)
            self._send(self.replicas[index], ("abort", ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def set_streaming(self, streaming: bool) -> None:
        """Streaming (the server): replicas send every request's output after each step, and
        ``step`` waits only briefly so that new requests are not held up. Offline (the default):
        only finished requests (and first tokens), and ``step`` waits for them."""
        for replica in self.replicas:
            self._send(replica, ("mode", not streaming))
        self._step_timeout = STREAM_WAIT_S if streaming else 60.0

    def process_multimodal(self, prompt_token_ids: list[int], images: list[tuple[Any, str]],
                           prompt_field: str = "prompt"):
        """``LLMEngine.process_multimodal``, done here: the replicas get the processed images and encode them."""
        if self.mm_processor is None:
            arch = ", ".join(getattr(self.hf_config, "architectures", None) or ["?"])
            raise RequestError(f"this model ({arch}) is text-only: it takes no images",
                               field=images[0][1] if images else "multi_modal_data")
        return self.mm_processor.process(prompt_token_ids, images, prompt_field)

    def load_lora(self, request) -> None:
        """Load a LoRA adapter (``pagoda.lora.LoRARequest``) in every replica; LoRAError if one refuses it."""
        self._call_replicas(("lora", "load", request), "while loading LoRA adapter " + repr(request.lora_name))

    def remove_lora(self, lora_int_id: int) -> None:
        self._call_replicas(("lora", "remove", lora_int_id), "while removing a LoRA adapter")

    def _call_replicas(self, message: tuple, what: str) -> None:
        """Send every replica ``message`` and wait for each one's answer; outputs sent meanwhile are kept
        for the next ``step``."""
        from pagoda.lora.peft_format import LoRAError

        self._check_alive(what)
        for replica in self.replicas:
            self._send(replica, message)
        refusals = []
        for replica in self.replicas:
            while True:
                reply = self._recv(replica, what)
                if reply[0] == "done":
                    if reply[1] is not None:
                        refusals.append(reply[1])
                    break
                self._pending.extend(self._handle(replica, reply, what))
        if refusals:
            raise LoRAError(refusals[0])

    def validate_params(self, params: SamplingParams) -> None:
        params.validate(self.config.max_logprobs, vocab_size=self.hf_config.vocab_size, max_n=self.config.max_n)

    def step(self, finished_only: bool = False, timeout: float | None = None) -> list[RequestOutput]:
        """The outputs the replicas have sent since the last call (waiting up to ``timeout``
        for at least one message while requests are unfinished)."""
        timeout = self._step_timeout if timeout is None else timeout
        outputs, self._pending = self._pending, []
        if not self.requests:
            return outputs
        busy = {r.conn: r for r in self.replicas if r.unfinished}
        deadline = time.monotonic() + timeout
        while busy:
            ready = wait(list(busy), timeout=0.2)
            for conn in ready:
                replica = busy[conn]
                while conn.poll(0):
                    outputs.extend(self._handle(replica, self._recv(replica, "during a step"), "during a step"))
            self._check_alive("during a step")
            if ready or outputs or time.monotonic() > deadline:
                break
        return outputs

    # ------------------------------------------------------------------ stats, shutdown
    def score_prompt(self, prompt_token_ids):
        raise ConfigError("prompt logits are scored on one engine: use data_parallel_size 1")

    def get_stats(self) -> dict[str, Any]:
        """Sums over the replicas (as of their last reports), and each replica's own under
        ``data_parallel``."""
        for replica in self.replicas:
            while replica.conn.poll(0):  # reports not read yet (a replica that went idle sends one unasked)
                self._pending.extend(self._handle(replica, self._recv(replica, "during a step"), "during a step"))
            replica.stats["num_unfinished"] = len(replica.unfinished)
        per = [dict(r.stats, replica=r.index, pid=r.proc.pid) for r in self.replicas]
        if len(per) == 1:  # one replica (engine_process): its own stats, nested ones included
            return dict(self.replicas[0].stats, data_parallel=per)
        summed: dict[str, Any] = {}
        for stats in per:
            for key, value in stats.items():
                if key not in ("replica", "pid") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    summed[key] = summed.get(key, 0) + value
        masks = [s["structured_outputs"] for s in per if s.get("structured_outputs")]
        if masks:  # grammar masks' cost over the replicas
            from pagoda.engine.sampler import MaskCost

            summed["structured_outputs"] = MaskCost(*(sum(m[k] for m in masks) for k in (
                "mask_steps", "mask_rows", "mask_seconds", "fill_wait_seconds"))).summary()
        summed["data_parallel"] = per
        return summed

    def replica_pid(self, index: int) -> int:
        return self.replicas[index].proc.pid

    def shutdown(self) -> None:
        """Stop the replicas (also done when the front is dropped or the process exits)."""
        self._finalizer()

