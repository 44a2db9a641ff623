"""Grammar engines behind one small interface: xgrammar (the default, as in vLLM and SGLang) and
llguidance. pagoda compiles nothing itself: each backend turns a ``GrammarSpec`` into its own
compiled grammar and hands out matchers that fill token bitmasks (int32, one bit per token id, the
format both libraries share) and advance with each accepted token.

    backend = XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    grammar = backend.compile(spec)           # ValueError with the library's message if it does not compile
    matcher = backend.matcher(grammar)        # one per sequence
    matcher.fill_bitmask(bitmask, row); matcher.accept(token)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial

import torch

from pagoda.structured_outputs.params import GrammarSpec

_CPP_PREFIX = re.compile(r"^\[[^\]]*\] [^ :]+:\d+: ")  # xgrammar's "[time] file.cc:94: " before its message
# JSON's flexible whitespace, bounded: unbounded, a small model can fill its budget with newlines between
# two tokens of the object (indentation of pretty-printed JSON fits)
MAX_JSON_WHITESPACE = 20


class GrammarMatcher:
    """One sequence's position in its grammar. ``terminated`` once a stop token was accepted;
    ``accepted`` counts the tokens offered (a mask filled before the last of them is stale)."""

    def __init__(self, stop_token_ids: set[int]):
        self.stop_token_ids = stop_token_ids
        self.terminated = False
        self.accepted = 0
        self.error: Exception | None = None  # set where a refusal is found later than its accept (grammar_process)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        self.accepted += 1
        ok = self._accept(token)
        if ok and token in self.stop_token_ids:
            self.terminated = True
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, ceil(vocab / 32) words)."""
        raise NotImplementedError

    def _accept(self, token: int) -> bool:
        raise NotImplementedError


class StructuredOutputBackend:
    name = ""

    def compile(self, spec: GrammarSpec) -> object:
        raise NotImplementedError

    def matcher(self, grammar: object) -> GrammarMatcher:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the backend started (the grammar process)."""


# ---------------------------------------------------------------------------- xgrammar
class _XGrammarMatcher(GrammarMatcher):
    def __init__(self, inner, stop_token_ids: set[int], words: int):
        super().__init__(stop_token_ids)
        self.inner = inner
        self.words = words  # bitmask words of the tokenizer's ids (the model's vocabulary may pad past them)

    def _accept(self, token: int) -> bool:
        return self.inner.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if bitmask.shape[1] == self.words:
            self.inner.fill_next_token_bitmask(bitmask, row)
            return
        part = torch.empty((1, self.words), dtype=torch.int32)  # (xgrammar writes contiguous rows only)
        self.inner.fill_next_token_bitmask(part, 0)
        _place(bitmask, [row], part)


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], process: bool = False):
        import xgrammar as xgr

        self.xgr = xgr
        self.stop_token_ids = set(stop_token_ids)
        # The tokenizer's ids only: ids a model pads its vocabulary with (151,936 rows for a tokenizer of
        # 151,669, or three times the tokenizer's in the benchmark's shapes) would be special tokens that
        # xgrammar checks one by one in every mask and every accepted token (7x the fill time measured with a
        # 49,152-token tokenizer padded to 151,936); the padding's bits are cleared apart (``_place``).
        count = min(vocab_size, max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1))
        self.words = (count + 31) // 32
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=count, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # pagoda's manager caches
        self.process = None  # process=True: the matchers live in a grammar process (grammar_process.py)
        if process:
            from pagoda.structured_outputs.grammar_process import GrammarProcess

            self.process = GrammarProcess(info.serialize_json())

    def compile(self, spec: GrammarSpec) -> object:
        compiled = self._compile(spec)
        if self.process is None:
            return compiled
        from pagoda.structured_outputs.grammar_process import ShippedGrammar

        return ShippedGrammar(compiled.serialize_json())  # (serialized here: off the engine loop, as the compile)

    def _compile(self, spec: GrammarSpec) -> object:
        c = self.compiler
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.text if spec.kind == "json" else '{"type": "object"}'
                return c.compile_json_schema(schema, any_whitespace=spec.any_whitespace,
                                             max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "choice":  # EBNF string literals take JSON's escapes
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(spec.text)))
            try:
                return c.compile_grammar(spec.text)  # EBNF / GBNF
            except RuntimeError:
                return c.compile_lark(spec.text)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(_CPP_PREFIX.sub("", str(exc).strip())) from None

    def matcher(self, grammar: object) -> GrammarMatcher:
        if self.process is not None:
            from pagoda.structured_outputs.grammar_process import RemoteMatcher

            return RemoteMatcher(self.process, grammar, self.stop_token_ids, self.words)
        return _XGrammarMatcher(self.xgr.GrammarMatcher(grammar), self.stop_token_ids, self.words)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


# ---------------------------------------------------------------------------- llguidance
class _LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, inner, stop_token_ids: set[int]):
        super().__init__(stop_token_ids)
        self.inner = inner

    def _accept(self, token: int) -> bool:
        return self.inner.consume_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.inner, bitmask, row)


class LLGuidanceBackend(StructuredOutputBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.stop_token_ids = set(stop_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids))

    def compile(self, spec: GrammarSpec) -> object:
        llg = self.llg
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.text if spec.kind == "json" else '{"type": "object"}'
                options = {"whitespace_flexible": spec.any_whitespace}
                if spec.any_whitespace:
                    options["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{1,{MAX_JSON_WHITESPACE}}}"
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            else:
                grammar = llg.grammar_from({"grammar": "grammar"}.get(spec.kind, spec.kind), spec.text)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error.strip())
        return grammar

    def matcher(self, grammar: object) -> GrammarMatcher:
        return _LLGuidanceMatcher(self.llg.LLMatcher(self.tokenizer, grammar, log_level=0), self.stop_token_ids)


BACKENDS = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}


def fill_bitmasks(matchers: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
    """Fill ``bitmask`` rows for many sequences at once: each library's batched call (xgrammar's
    BatchGrammarMatcher, llguidance's parallel fill) works on its own threads without the GIL, so a
    batch of constrained rows costs about one row's time per core, not one row's time each. Raises if
    any row fails; the caller then fills row by row to find it."""
    prepared_fill(matchers, bitmask)()


def prepared_fill(matchers: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> Callable[[], None]:
    """``fill_bitmasks`` with its arguments made now: the call left runs little Python before the libraries'
    native fill, which releases the GIL (a fill on a worker thread holds the GIL, the engine thread waiting,
    only that long)."""
    by_kind: dict[type, list[tuple[GrammarMatcher, int]]] = {}
    for matcher, row in matchers:
        by_kind.setdefault(type(matcher), []).append((matcher, row))
    calls = []
    for kind, group in by_kind.items():
        if kind is _XGrammarMatcher and len(group) > 1:
            batch, inners = _xgrammar_batch(), [m.inner for m, _ in group]
            if group[0][0].words == bitmask.shape[1]:
                calls.append(partial(batch.batch_fill_next_token_bitmask, inners, bitmask,
                                     indices=[r for _, r in group]))
            else:
                calls.append(partial(_fill_narrow, batch, inners, group[0][0].words, bitmask, [r for _, r in group]))
        elif getattr(group[0][0], "client", None) is not None:  # matchers in a grammar process: it fills
            calls.append(partial(group[0][0].client.fill_now, [m for m, _ in group], bitmask, [r for _, r in group]))
        elif kind is _LLGuidanceMatcher and len(group) > 1:
            from llguidance.torch import fill_next_token_bitmask_par

            calls.append(partial(fill_next_token_bitmask_par, _llguidance_executor(),
                                 [(m.inner, r) for m, r in group], bitmask))
        else:
            calls.extend(partial(matcher.fill_bitmask, bitmask, row) for matcher, row in group)
    return calls[0] if len(calls) == 1 else partial(_call_each, calls)


def _call_each(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


def _fill_narrow(batch, inners: list, words: int, bitmask: torch.Tensor, rows: list[int]) -> None:
    """xgrammar's rows over the tokenizer's ids, into rows of ``bitmask`` wider than that."""
    part = torch.empty((len(inners), words), dtype=torch.int32)
    batch.batch_fill_next_token_bitmask(inners, part)
    _place(bitmask, rows, part)


def _place(bitmask: torch.Tensor, rows: list[int], part: torch.Tensor) -> None:
    """Masks over the tokenizer's ids ``part`` [len(rows), w] into ``bitmask`` rows, the padded ids past
    them forbidden."""
    index = row_index(rows)
    bitmask[index, :part.shape[1]] = part
    bitmask[index, part.shape[1]:] = 0


def row_index(rows: list[int]) -> slice | torch.Tensor:
    """``rows`` as an index: a slice when they are consecutive and increasing (the usual batch: a copy
    row by row instead of a gather, 10x faster for masks of 64 x 151,936 ids), else an index tensor."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and all(b == a + 1 for a, b in zip(rows, rows[1:])):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.int64)


_POOLS: dict[str, object] = {}


def _xgrammar_batch():
    if "xgrammar" not in _POOLS:
        import xgrammar as xgr

        _POOLS["xgrammar"] = xgr.BatchGrammarMatcher()  # max_threads "auto": the machine's cores
    return _POOLS["xgrammar"]


def _llguidance_executor():
    if "llguidance" not in _POOLS:
        import llguidance

        _POOLS["llguidance"] = llguidance.LLExecutor()
    return _POOLS["llguidance"]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits [n, V] of tokens their row of ``bitmask`` [n, ceil(V/32)] forbids to -inf, in
    place: xgrammar's kernel (CUDA, or its CPU path), the same for both backends' masks."""
    import xgrammar as xgr

    from pagoda.kernels.host_upload import upload

    # (pinned: a copy from pageable memory would wait for the step the device is still running)
    xgr.apply_token_bitmask_inplace(logits, upload(bitmask.numpy(), logits.device))
