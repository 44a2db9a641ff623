"""Shared helpers of the parser tests: feeding a text to a stream in pieces, and checking the
shape of what comes back."""

from pagoda.parsers import ContentDelta, ToolCallDelta, ToolCallResult


def ids(index: int) -> str:
    return f"call{index}"


def pieces_at(text: str, cuts) -> list[str]:
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream_tool_calls(parser, pieces: list[str]) -> ToolCallResult:
    """Feed ``pieces`` (the last with done=True) and check the deltas' shape on the way."""
    stream = parser.stream()
    deltas = []
    for n, piece in enumerate(pieces):
        deltas += stream.feed(piece, done=n == len(pieces) - 1)
    started: list[int] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            assert delta.text
            continue
        assert isinstance(delta, ToolCallDelta)
        if delta.index not in started:  # a call's first delta names it; calls arrive in order
            assert delta.id and delta.name and delta.index == len(started), deltas
            started.append(delta.index)
        else:
            assert delta.id is None and delta.name is None and delta.arguments, deltas
            assert delta.index == started[-1], deltas
    return ToolCallResult.from_deltas(deltas)


def stream_reasoning(parser, pieces: list[str], initial=None) -> tuple[str | None, str | None]:
    stream = parser.stream(initial)
    reasoning, content = [], []
    for n, piece in enumerate(pieces):
        r, c = stream.feed(piece, done=n == len(pieces) - 1)
        assert r is None or r, "an empty delta is reported as None"
        reasoning.append(r or "")
        content.append(c or "")
    return "".join(reasoning) or None, "".join(content) or None


def byte_tokenizer():
    """A tiny byte-level tokenizer with no added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def marker_tokenizer():
    """The byte-level tokenizer with the markers models add: Qwen's <think> and <tool_call> as
    plain added tokens, Mistral's [TOOL_CALLS] family as special (control) tokens."""
    from tokenizers import AddedToken

    fast = byte_tokenizer()
    fast.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    fast.add_tokens([AddedToken(t, special=True) for t in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")],
                    special_tokens=True)
    return fast
