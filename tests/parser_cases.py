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
