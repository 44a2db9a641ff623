"""RequestControls: what the engine keeps per request beyond its tokens, so that a request can steer
and inspect its own generation: its structured-output grammar (one matcher per sequence, advanced
with every sampled token), its bad words as token sequences, the logits processors it names, and the
prompt logprobs the runner computes during prefill.

Everything a request asks for is checked and prepared in ``prepare`` (when it is added; a grammar
that does not compile is that request's error); the engine calls ``attach`` once the request exists,
``advance`` with each step's tokens, ``ended`` to stop sequences whose grammar is complete, and
``record_prompt_logprobs`` with what the runner found.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.sequence import Request, Sequence
from pagoda.errors import RequestError
from pagoda.logits_processors import bad_words_token_ids
from pagoda.outputs import Logprob
from pagoda.parsers import AUTO
from pagoda.sampling_params import SamplingParams
from pagoda.structured_outputs.manager import CompiledGrammar, StructuredOutputManager


@dataclass
class Prepared:
    grammar: CompiledGrammar | None = None
    bad_words_ids: list[list[int]] | None = None


class RequestControls:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], config, grammar_process: bool = False):
        from pagoda.selection import get_logits_processor, select_reasoning_parser

        self.tokenizer = tokenizer
        self.structured_outputs = StructuredOutputManager(config.structured_outputs_backend, tokenizer, vocab_size,
                                                          sorted(stop_token_ids), process=grammar_process)
        # enabled logits processors, by name: one instance per engine
        self.processors = {name: get_logits_processor(name)(vocab_size, tokenizer) for name in config.logits_processors}
        template = getattr(tokenizer, "chat_template", None)
        self.reasoning_parser = select_reasoning_parser(config.reasoning_parser, template)

    # ------------------------------------------------------------------ when a request is added
    def prepare(self, params: SamplingParams) -> Prepared:
        """Check and prepare what ``params`` asks for; RequestError naming the field otherwise."""
        prepared = Prepared()
        for name in params.logits_processors or ():
            if name not in self.processors:
                enabled = ", ".join(sorted(self.processors)) or "none"
                raise RequestError(f"logits processor {name!r} is not enabled on this engine (enabled: {enabled}; "
                                   f"engine key logits_processors)", field="logits_processors")
        if params.bad_words:
            if self.tokenizer is None:
                raise RequestError("bad_words need the model's tokenizer (skip_tokenizer_init is set)",
                                   field="bad_words")
            prepared.bad_words_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.structured_outputs is not None:
            prepared.grammar = self.structured_outputs.compile(params.structured_outputs)
        return prepared

    def attach(self, request: Request, prepared: Prepared) -> None:
        """Give the request's sequences their state. With a reasoning parser, a grammar starts where
        the reasoning ends (the model thinks freely, then answers in the grammar)."""
        wait = opening = None
        if prepared.grammar is not None and self.reasoning_parser is not None:
            parser = self.reasoning_parser(self.tokenizer)
            initial = parser.initial_state(request.prompt)
            start = parser.reasoning_start_token_id
            if initial == AUTO and start is not None:  # the model may open its reasoning, or answer at once
                opening = (start, parser, initial)
            elif not parser.is_reasoning_end([], initial):
                wait = (parser, initial)
        for seq in request.seqs:
            seq.bad_words_ids = prepared.bad_words_ids
            if prepared.grammar is not None:
                matcher = prepared.grammar.matcher()  # each of the n completions walks its own
                if wait is None:
                    seq.grammar, seq.grammar_opening = matcher, opening
                else:
                    seq.pending_grammar = (matcher, *wait)

    # ------------------------------------------------------------------ after a step
    @staticmethod
    def advance(seqs: list[Sequence], sampled: dict[int, int], broken: dict[str, BaseException]) -> None:
        """Move each constrained sequence's grammar past its sampled token; a token the grammar
        refuses (it cannot happen through the mask, short of a bug) fails that request. A sequence
        that ended in an earlier step (the step pipeline computed one more token for it, thrown away)
        is left alone."""
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq.pending_grammar is not None:
                matcher, parser, initial = seq.pending_grammar
                if parser.is_reasoning_end([*seq.output_token_ids, sampled[seq.seq_id]], initial):
                    seq.grammar, seq.pending_grammar = matcher, None  # constrains from the next token on
                continue
            if seq.grammar is None or seq.request_id in broken:
                continue
            token = sampled[seq.seq_id]
            if seq.grammar_opening is not None:  # the first token: reasoning opened, or the answer began
                start, parser, initial = seq.grammar_opening
                seq.grammar_opening = None
                if token == start:
                    seq.grammar, seq.pending_grammar = None, (seq.grammar, parser, initial)
                    continue
            try:
                if not seq.grammar.accept(token):
                    raise RuntimeError(f"the structured-output grammar refused token {token}")
            except Exception as exc:
                broken[seq.request_id] = exc

    @staticmethod
    def ended(seqs: list[Sequence]) -> list[Sequence]:
        """Running sequences whose grammar is complete (it accepted a stop token): they stop."""
        return [s for s in seqs if s.grammar is not None and s.grammar.terminated and not s.is_finished]

    def record_prompt_logprobs(self, requests: dict[str, Request], seqs: dict[int, Sequence],
                               found: dict[int, list]) -> None:
        """Store the prompt logprobs the runner computed (seq_id -> [(position, logprob, rank, top)])."""
        for seq_id, entries in found.items():
            seq = seqs.get(seq_id)
            request = requests.get(seq.request_id) if seq is not None else None
            if request is None or request.prompt_logprobs is None:
                continue
            for position, chosen, rank, top in entries:
                request.prompt_logprobs[position] = self.logprob_entry(seq.token_ids[position], chosen, rank, top)

    def logprob_entry(self, token: int, chosen: float, rank: int, top: list) -> dict[int, Logprob]:
        """{token id: Logprob} holding the token's own and the top-k's, with their decoded text."""
        entry = {tid: Logprob(val, r + 1) for r, (tid, val) in enumerate(top)}
        entry[token] = Logprob(chosen, rank)
        if self.tokenizer is not None:
            for tid, item in entry.items():
                item.decoded_token = self.tokenizer.convert_ids_to_tokens(tid)
        return entry
