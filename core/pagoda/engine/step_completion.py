"""A step's end, whichever way the step ran: plain (``LLMEngine.step``), launched ahead
(``pagoda.engine.pipeline``), verified (``pagoda.speculative``) or pooled (``pagoda.pooling``).

Once a step's tokens are known: their logprobs join the sequences, the request controls and grammars
take the tokens, the scheduler commits them (ending sequences on EOS, length or a complete grammar), the
new text is decoded in one tokenizer call and checked for stop strings, and each touched request gets its
output; finished requests leave the engine's table. The step drivers go through this interface, not
through the engine's internals.

    completion = StepCompletion(engine)
    completion.mark_scheduled(out)               # before the model runs: first-scheduled metrics
    outputs = completion.complete(out, tokens, logprobs, finished_only, t0, t1, advanced=..., failed=...)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.engine.detokenizer import find_stop_string
from pagoda.engine.sequence import Request, Sequence, SequenceStatus
from pagoda.outputs import CompletionOutput, ListView, RequestOutput

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.scheduler import SchedulerOutput


@dataclass
class StepTimes:
    """Host seconds of the engine's steps by phase (``pagoda bench throughput`` reports them)."""

    schedule: float = 0.0
    prefill: float = 0.0  # model time of steps that hold any prefill chunk
    decode: float = 0.0  # model time of decode-only steps
    postprocess: float = 0.0
    steps: int = 0
    extra: dict = field(default_factory=dict)


class StepCompletion:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # (request, finished) -> what the step returns for it: the cumulative RequestOutput, or in an engine
        # process the delta its front needs (``OutputSender.output_of``: no output built only to be diffed)
        self.build_output = request_output

    def mark_scheduled(self, out: SchedulerOutput) -> None:
        """Before the model runs ``out``: the first time a request is scheduled (and its cached tokens)."""
        requests = self.engine.requests
        for item in out.scheduled[out.num_decodes:]:  # decodes were scheduled before, as prefills
            m = requests[item.seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = time.time()
                m.num_cached_tokens = item.seq.num_computed_tokens

    def complete(self, out: SchedulerOutput, tokens: list[int], logprobs, finished_only: bool, t0: float,
                 t1: float, advanced: bool = False,
                 failed: dict[int, BaseException] | None = None) -> list[RequestOutput]:
        """After the model ran ``out`` and sampled ``tokens`` (one per sampling row; ``logprobs``: None, or
        per row None or (logprob, rank, top)): update the sequences (only commit the tokens when the
        scheduler already ``advanced`` past the step), build the outputs and account the step's time (t0:
        start, t1: scheduled). ``failed``: rows that could not be sampled; their requests fail, the others
        of the step go on."""
        engine = self.engine
        t2 = time.perf_counter()
        seqs = [it.seq for it in out.scheduled if it.sample]
        sampled = {s.seq_id: tok for s, tok in zip(seqs, tokens)}
        broken: dict[str, BaseException] = {seqs[row].request_id: exc for row, exc in (failed or {}).items()}
        if logprobs is not None:
            for seq, lp in zip(seqs, logprobs):
                if lp is not None and seq.request_id not in broken:
                    try:
                        self._record_logprob(seq, sampled[seq.seq_id], lp)
                    except Exception as exc:
                        broken[seq.request_id] = exc
        engine.mask_ahead.wait()  # no matcher advances while a fill reads it
        engine.controls.advance(seqs, sampled, broken)
        for rid, exc in broken.items():
            engine.fail_request(rid, exc)
        scheduler = engine.scheduler
        if advanced:
            touched = scheduler.commit(out, sampled, engine.eos_token_ids)
        else:
            touched = scheduler.update(out, sampled, engine.eos_token_ids)
        for seq in engine.controls.ended(touched):  # its grammar is complete
            scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        engine.mask_ahead.start(seqs, broken)
        outputs = self._outputs(touched, finished_only, failed=list(broken))
        t3 = time.perf_counter()
        tm = engine.times
        tm.steps += 1
        tm.schedule += t1 - t0
        if out.num_decodes == len(out.scheduled):
            tm.decode += t2 - t1
        else:
            tm.prefill += t2 - t1
        tm.postprocess += t3 - t2
        return outputs

    def _record_logprob(self, seq: Sequence, token: int, lp) -> None:
        chosen, rank, top = lp
        seq.cumulative_logprob += chosen
        seq.logprobs.append(self.engine.controls.logprob_entry(token, chosen, rank, top))

    def _detokenize(self, seqs: list[Sequence]) -> list[str]:
        """Text deltas of ``seqs``, in one tokenizer call; if that call fails, one sequence at a
        time, failing only the requests whose tokens cannot be decoded."""
        detokenizer = self.engine.detokenizer
        try:
            return detokenizer.step(seqs)
        except Exception:
            deltas = []
            for seq in seqs:
                try:
                    deltas.append(detokenizer.step([seq])[0])
                except Exception as exc:
                    self.engine.fail_request(seq.request_id, exc)
                    deltas.append("")
            return deltas

    def _outputs(self, touched: list[Sequence], finished_only: bool = False,
                 failed: list[str] = ()) -> list[RequestOutput]:
        """Outputs of the requests whose sequences got a token (``touched``) or failed this step."""
        engine = self.engine
        if engine.detokenizer is not None:
            live = [s for s in touched if s.params.detokenize]
            deltas = self._detokenize(live)
            for seq, delta in zip(live, deltas):
                if seq.status is SequenceStatus.FINISHED_ERROR:
                    continue
                stop = find_stop_string(seq, delta)
                if stop is not None:
                    seq.stop_reason = stop
                    if seq.status is SequenceStatus.RUNNING:
                        engine.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
                    else:
                        seq.status = SequenceStatus.FINISHED_STOPPED
        if finished_only:  # only finished requests, and first tokens (metrics), need a look
            running = SequenceStatus.RUNNING
            touched = [s for s in touched
                       if s.status is not running or len(s.token_ids) - len(s.prompt_token_ids) == 1]
        now = time.time()
        outputs = []
        requests = engine.requests
        for rid in dict.fromkeys([*failed, *(s.request_id for s in touched)]):
            request = requests.get(rid)
            if request is None:  # failed, then touched: already reported above
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
                del requests[rid]
                for seq in request.seqs:
                    engine.runner.forget(seq.seq_id)
            if finished or not finished_only:
                outputs.append(self.build_output(request, finished))
        return outputs


def request_output(request: Request, finished: bool) -> RequestOutput:
    """The request's cumulative output. Unfinished (streamed every step), its token ids and logprobs are
    ``ListView``s of the sequences' own lists, which only grow past them: a copy of every token per step
    cost a stream O(its length) each step."""
    completions = []
    for seq in request.seqs:
        logprobs = seq.logprobs
        if finished:
            token_ids, logprobs = seq.output_token_ids, list(logprobs) if logprobs is not None else None
        else:
            token_ids = ListView(seq.token_ids, seq.num_prompt_tokens, seq.num_tokens)
            logprobs = ListView(logprobs, 0, len(logprobs)) if logprobs is not None else None
        completions.append(CompletionOutput(
            index=seq.index, text=seq.text, token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=logprobs, finish_reason=seq.finish_reason(), stop_reason=seq.stop_reason))
    prompt_logprobs = None if request.prompt_logprobs is None else list(request.prompt_logprobs)
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                         finished, request.metrics, request.metrics.num_cached_tokens, error=request.error,
                         prompt_logprobs=prompt_logprobs)
