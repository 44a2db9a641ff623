"""The pooling runner: an ``LLMEngine`` whose steps only prefill (``runner: pooling``).

Requests go through the same Scheduler and BlockManager as generation (token budget, chunked
prefill, prefix cache, preemption): a prompt's chunks are computed step by step, each chunk's hidden
states update the sequence's pooler state, and when the last prompt token is computed the request
ends at once: pooled vector -> (score head) -> output, KV blocks freed. Nothing is sampled and no
KV cache grows past the prompt. Prefix caching stays on for LAST pooling (the last token is always
computed); MEAN and CLS need every position, so they turn it off.
"""

from __future__ import annotations

import logging
import time

import torch

from pagoda.engine.prompt_ids import check_prompt_ids
from pagoda.engine.prompt_ids import prompt_token_ids as prompt_ids
from pagoda.engine.sequence import Request, Sequence, SequenceStatus
from pagoda.engine.step_plan import plan_step
from pagoda.errors import RequestError
from pagoda.forward_context import set_forward_context
from pagoda.pooling.heads import build_score_head
from pagoda.pooling.outputs import PoolingOutput, PoolingRequestOutput
from pagoda.pooling.params import PoolingParams
from pagoda.pooling.pooler_config import resolve_pooler_config
from pagoda.pooling.poolers import get_pooler
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")
UNSUPPORTED = "unsupported_task"  # the served model's runner does not do what the request asks


def fit_prompt(ids: list[int], max_model_len: int, truncate: int | None, field: str) -> list[int]:
    """A pooling prompt may fill the whole context; a longer one is refused (naming ``field``) unless
    ``truncate`` (truncate_prompt_tokens) keeps its last tokens (-1: max_model_len of them)."""
    if truncate is not None:
        keep = max_model_len if truncate == -1 else truncate
        if keep > max_model_len:
            raise RequestError(f"truncate_prompt_tokens={truncate} is over this model's max_model_len "
                               f"{max_model_len}", field="truncate_prompt_tokens")
        ids = ids[-keep:]
    if len(ids) > max_model_len:
        raise RequestError(f"{field} has {len(ids)} tokens, over this model's maximum context length of "
                           f"{max_model_len} tokens; shorten it or set truncate_prompt_tokens", field=field,
                           code="context_length_exceeded")
    return ids


class PoolingEngine:
    def __init__(self, engine):
        self.engine = engine
        config = engine.config
        model = engine.runner.model
        self.head = build_score_head(model, engine.tokenizer, config.classifier_from_token)
        self.pooler_config = resolve_pooler_config(engine.source.path, config.pooling_type, config.normalize,
                                                   self.head is not None)
        self.pooler = get_pooler(self.pooler_config.pooling_type)
        self.hidden_size = int(engine.hf_config.hidden_size)
        bm = engine.block_manager
        if self.pooler.needs_every_token and bm.enable_prefix_caching:
            logger.info("prefix caching is off: %s pooling reads every prompt position", self.pooler.name)
            bm.enable_prefix_caching = False
        self.params: dict[str, PoolingParams] = {}  # request id -> its params
        self.states: dict[int, object] = {}  # seq id -> pooler state (carried across prefill chunks)
        logger.info("pooling runner: %s pooling, normalize %s (%s)%s", self.pooler.name, self.pooler_config.normalize,
                    self.pooler_config.source, f"; {self.head.describe}" if self.head else "")

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("embed", "classify", "score") if self.head is not None else ("embed",)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, params, prompt_token_ids: list[int] | None,
                    arrival_time: float | None) -> str:
        engine = self.engine
        check_pooling_params(params, self.head is not None, self.hidden_size)
        if request_id in engine.requests:
            raise RequestError(f"request id {request_id!r} is already in use", field="request_id")
        text = prompt if isinstance(prompt, str) else None
        prompt_token_ids = prompt_ids(prompt, prompt_token_ids, engine.tokenize)
        check_prompt_ids(prompt_token_ids, engine.hf_config.vocab_size)
        ids = fit_prompt(prompt_token_ids, engine.max_model_len, params.truncate_prompt_tokens, "prompt")
        request = Request(request_id, text, ids, SamplingParams(max_tokens=1), arrival_time or time.time())
        engine.requests[request_id] = request
        self.params[request_id] = params
        for seq in request.seqs:
            engine.scheduler.add(seq)
        return request_id

    # ------------------------------------------------------------------ steps
    def step(self) -> list[PoolingRequestOutput]:
        """Prefill one scheduled batch; outputs of the requests whose prompts it completed."""
        engine = self.engine
        scheduler, bm = engine.scheduler, engine.block_manager
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        if out.is_empty:
            return []
        for seq in out.preempted:  # recomputed from its first token: its pooling starts over
            self.states.pop(seq.seq_id, None)
        engine.completion.mark_scheduled(out)
        hidden, starts = forward_hidden(engine.runner, out)
        done: list[Sequence] = []
        pooler = self.pooler
        for item, row in zip(out.scheduled, starts):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            state = pooler.update(self.states.get(seq.seq_id), hidden[row:row + n], start, seq.num_prompt_tokens)
            self.states[seq.seq_id] = state.clone() if state is not None and state._base is not None else state
            seq.num_computed_tokens += n
            if bm.enable_prefix_caching and seq.num_computed_tokens // bm.block_size > len(seq.block_hashes):
                bm.cache_computed_blocks(seq)
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                done.append(seq)
        t2 = time.perf_counter()
        outputs = self._finish(done)
        self._prune()
        times = engine.times
        times.steps += 1
        times.schedule += t1 - t0
        times.prefill += t2 - t1
        times.postprocess += time.perf_counter() - t2
        return outputs

    def _finish(self, done: list[Sequence]) -> list[PoolingRequestOutput]:
        if not done:
            return []
        engine = self.engine
        pooled = torch.stack([self.pooler.finish(self.states.pop(s.seq_id), s.num_prompt_tokens) for s in done])
        params = [self.params.pop(s.request_id) for s in done]
        results: list[torch.Tensor | None] = [None] * len(done)
        scored = [i for i, p in enumerate(params) if p.task != "embed"]
        if scored:  # the head on the device, then one copy to the host
            logits = self.head.logits(pooled[scored])
            both = torch.stack([logits, self.head.activate(logits)]).cpu()
            for j, i in enumerate(scored):
                results[i] = both[1 if params[i].activation else 0, j]
        if len(scored) < len(done):
            host = pooled.cpu()  # one copy for every embedding of the step
            for i, p in enumerate(params):
                if p.task == "embed":
                    vector = host[i] if p.dimensions is None else host[i, : p.dimensions]
                    normalize = self.pooler_config.normalize if p.normalize is None else p.normalize
                    results[i] = torch.nn.functional.normalize(vector, dim=-1) if normalize else vector
        now = time.time()
        outputs = []
        for seq, data in zip(done, results):
            request = engine.requests.pop(seq.request_id)
            engine.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)  # frees its blocks now
            engine.runner.forget(seq.seq_id)
            request.metrics.first_token_time = request.metrics.finished_time = now
            outputs.append(PoolingRequestOutput(request.request_id, PoolingOutput(data),
                                                request.prompt_token_ids, True, request.metrics,
                                                prompt=request.prompt))
        return outputs

    def _prune(self) -> None:
        """Forget the state of aborted requests."""
        engine = self.engine
        if len(self.params) > len(engine.requests):
            self.params = {rid: p for rid, p in self.params.items() if rid in engine.requests}
        running = engine.scheduler.running
        if len(self.states) > len(running):
            live = {s.seq_id for s in running}
            self.states = {k: v for k, v in self.states.items() if k in live}


@torch.inference_mode()
def forward_hidden(runner, out) -> tuple[torch.Tensor, list[int]]:
    """Hidden states [T, H] (after the final norm) of every scheduled token, and the first row of
    each scheduled sequence."""
    inputs = runner.step_inputs(plan_step(out))
    ctx = runner.forward_context(inputs)
    with set_forward_context(ctx):
        hidden = runner.model(inputs.input_ids, inputs.positions)
    runner.add_expert_counts(ctx)
    starts = [int(x) for x in inputs.meta.query_start_loc_cpu[: len(out.scheduled)]]
    return hidden, starts


def check_pooling_params(params, has_head: bool, hidden_size: int) -> None:
    """A pooling engine's checks of a request's parameters (also made by the front of engines in other
    processes, ``pagoda.distributed.data_parallel``, so that its refusals are the same 400s)."""
    if not isinstance(params, PoolingParams):
        raise RequestError("this server runs a pooling model (runner: pooling): it computes embeddings and "
                           "scores, not text; use /v1/embeddings, /v1/rerank, /v1/score or /api/embed (offline: "
                           "LLM.embed, LLM.score, LLM.classify)", field="prompt", code=UNSUPPORTED)
    params.validate()
    if params.task != "embed" and not has_head:
        raise RequestError(f"task {params.task!r} needs a score head and this model has none (it serves "
                           f"embeddings): load a *ForSequenceClassification checkpoint or set "
                           f"classifier_from_token", field="task", code=UNSUPPORTED)
    if params.task == "embed" and params.dimensions is not None and params.dimensions > hidden_size:
        raise RequestError(f"dimensions={params.dimensions} is over this model's embedding size "
                           f"{hidden_size}", field="dimensions")


def refuse_pooling_on_a_generator() -> None:
    raise RequestError("this server runs a generative model (runner: generate): embeddings and scores need a "
                       "pooling model; start it with --runner pooling (runner: pooling)", field="model",
                       code=UNSUPPORTED)


def add_pooling_request(engine, request_id, prompt, params, prompt_token_ids, arrival_time) -> str:
    """``LLMEngine.add_request`` for a pooling engine, or for PoolingParams sent to a generator."""
    if engine.pooling is None:
        refuse_pooling_on_a_generator()
    if request_id is None:
        request_id = engine.new_request_id()
    return engine.pooling.add_request(request_id, prompt, params, prompt_token_ids, arrival_time)
