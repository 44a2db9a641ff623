"""Parsers against a real (tiny) tokenizer: which markers need skip_special_tokens=False, and
the server's pipeline (incremental detokenization, the reasoning parser first, then the
tool parser on the content) streamed token by token agrees with parsing the whole text."""

import pytest
from pagoda.parsers import ToolCallResult
from pagoda.parsers.reasoning.qwen3 import Qwen3ReasoningParser
from pagoda.parsers.tool.deepseek_v3 import DeepSeekV3ToolParser
from pagoda.parsers.tool.hermes import HermesToolParser
from pagoda.parsers.tool.mistral import MistralToolParser
from parser_cases import ids, marker_tokenizer


@pytest.fixture
def tokenizer():
    return marker_tokenizer()


def decode_incrementally(tokenizer, token_ids, skip_special_tokens=False):
    """Text deltas as a server produces them: a character split over tokens waits for its rest."""
    sent = ""
    for n in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:n], skip_special_tokens=skip_special_tokens)
        if not text.endswith("\ufffd") or n == len(token_ids):
            yield text[len(sent):]
            sent = text


def test_which_parsers_need_special_tokens_kept(tokenizer):
    assert not HermesToolParser(tokenizer).needs_special_tokens  # Qwen's <tool_call> is a plain added token
    assert MistralToolParser(tokenizer).needs_special_tokens  # [TOOL_CALLS] is a control token
    assert not DeepSeekV3ToolParser(tokenizer).needs_special_tokens  # not tokens here: plain text survives
    assert not Qwen3ReasoningParser(tokenizer).needs_special_tokens
    assert MistralToolParser(None).needs_special_tokens  # no tokenizer to ask: assume so


def test_mistral_calls_survive_only_with_special_tokens_kept(tokenizer):
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[ARGS]{}'
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    parser = MistralToolParser(tokenizer, id_factory=ids)
    kept = "".join(decode_incrementally(tokenizer, token_ids))
    assert kept == text
    stream = parser.stream()
    deltas = [d for piece in decode_incrementally(tokenizer, token_ids) for d in stream.feed(piece)]
    deltas += stream.feed("", done=True)
    assert ToolCallResult.from_deltas(deltas) == parser.extract(text)
    assert [c.name for c in parser.extract(text).calls] == ["get_weather", "get_time"]
    skipped = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert parser.extract(skipped).calls == []  # what goes wrong when the markers are skipped


def test_reasoning_then_tool_calls_streamed_token_by_token(tokenizer):
    text = ('<think>\nThe user wants the weather in two cities.\n</think>\n\nLet me check.\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>')
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    reasoning_parser = Qwen3ReasoningParser(tokenizer)
    tool_parser = HermesToolParser(tokenizer, tools=[{"type": "function"}], id_factory=ids)

    reasoning, content = reasoning_parser.extract(text)
    expected = tool_parser.extract(content)
    assert reasoning == "The user wants the weather in two cities."
    assert expected.content == "Let me check." and [c.arguments for c in expected.calls] == \
        ['{"city": "Paris"}', '{"city": "Tōkyō"}']

    r_stream, t_stream = reasoning_parser.stream(), tool_parser.stream()
    streamed_reasoning, deltas = [], []
    pieces = list(decode_incrementally(tokenizer, token_ids))
    for n, piece in enumerate(pieces):
        done = n == len(pieces) - 1
        r, c = r_stream.feed(piece, done)
        streamed_reasoning.append(r or "")
        deltas += t_stream.feed(c or "", done)
    assert "".join(streamed_reasoning) == reasoning
    assert ToolCallResult.from_deltas(deltas) == expected
