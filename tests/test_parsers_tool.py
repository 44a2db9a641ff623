"""The built-in tool-call parsers on their models' own formats: several calls, content around
them, malformed calls given back as content; and streaming, where any split of the text
into deltas adds up to exactly what extract() returns."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda.parsers import ToolCall, ToolCallResult
from pagoda.parsers.tool.deepseek_v3 import DeepSeekV3ToolParser
from pagoda.parsers.tool.hermes import HermesToolParser
from pagoda.parsers.tool.llama3_json import Llama3JsonToolParser
from pagoda.parsers.tool.mistral import MistralToolParser
from pagoda.parsers.tool.pythonic import PythonicToolParser
from parser_cases import ids, pieces_at, stream_tool_calls

WEATHER = '{"location": "Paris, France", "unit": "celsius"}'
CODE_ARGS = ('{"path": "a.py", "text": "print(\\"}\\")\\n# \\u00e9 </tool_call> [TOOL_CALLS] ]", '
             '"n": [1, 2.5, true, null]}')


def calls(*pairs):
    return [ToolCall(ids(i), name, args) for i, (name, args) in enumerate(pairs)]


# (text, expected content, expected [(name, arguments)])
HERMES = [
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
     [("get_weather", WEATHER)]),
    ('I will check both cities.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo"}}\n</tool_call>',
     "I will check both cities.", [("get_weather", '{"location": "Paris"}'), ("get_weather", '{"location": "Tokyo"}')]),
    (f'<tool_call>\n{{"name": "write_file", "arguments": {CODE_ARGS}}}\n</tool_call>', None,
     [("write_file", CODE_ARGS)]),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),  # keys reversed
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.', "\nDone.", [("f", "{}")]),
    ("The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    # malformed: the block is content, tags included
    ('<tool_call>\n{"name": get_weather}\n</tool_call>', '<tool_call>\n{"name": get_weather}\n</tool_call>', []),
    ('Try <tool_call>\nget_weather(location="Paris")\n</tool_call> ok',
     'Try <tool_call>\nget_weather(location="Paris")\n</tool_call> ok', []),
    ('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', []),
    ('<tool_call>{"name": "f", "extra": 1, "arguments": {}}</tool_call>',
     '<tool_call>{"name": "f", "extra": 1, "arguments": {}}</tool_call>', []),
    # cut short by max_tokens: a started call keeps the arguments written so far; an unstarted one is content
    ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par', None,
     [("get_weather", '{"location": "Par')]),
    ('<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    ("a <tool_ca", "a <tool_ca", []),
]

LLAMA3_JSON = [
    ('{"name": "get_weather", "parameters": {"location": "Paris"}}', None, [("get_weather", '{"location": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [1, {"z": "}"}]}}',
     None, [("a", '{"x": 1}'), ("b", '{"y": [1, {"z": "}"}]}')]),
    ('Let me look that up. {"name": "search", "arguments": {"q": "pagoda"}}', "Let me look that up.",
     [("search", '{"q": "pagoda"}')]),
    ('Here is the data: {"name": "Ada", "born": 1815}', 'Here is the data: {"name": "Ada", "born": 1815}', []),
    ("function f() { return {a: 1}; }", "function f() { return {a: 1}; }", []),
    ('<|python_tag|>brave_search.call(query="weather")', 'brave_search.call(query="weather")', []),
    ('{"name": "Ada"}', '{"name": "Ada"}', []),
]

MISTRAL = [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris"}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}}]', None,
     [("get_weather", '{"location": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
    ('Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abc123XYZ"}]', "Sure.", [("f", '{"a": 1}')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [("get_weather", '{"location": "Paris"}'), ("get_time", "{}")]),
    ('[TOOL_CALLS]get_weather{"location": "Paris"}', None, [("get_weather", '{"location": "Paris"}')]),
    ("[TOOL_CALLS] I cannot call tools.", "[TOOL_CALLS] I cannot call tools.", []),
    ('[TOOL_CALLS] [{"name": 1}] after', '[TOOL_CALLS] [{"name": 1}] after', []),
    ('[TOOL_CALLS]f[ARGS]{"a": [1, 2]\n', None, [("f", '{"a": [1, 2]')]),  # v11 arguments pass through as written
]

DEEPSEEK = [
    ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
     '{"location": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
     '```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking.",
     [("get_weather", '{"location": "Paris"}'), ("get_time", "{}")]),
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Paris"}<｜tool▁call▁end｜>'
     '<｜tool▁call▁begin｜>write<｜tool▁sep｜>' + CODE_ARGS + '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None,
     [("get_weather", '{"location": "Paris"}'), ("write", CODE_ARGS)]),
    ("x <｜tool▁calls▁begin｜>oops", "x <｜tool▁calls▁begin｜>oops", []),
    ("<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>", "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>", []),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\nno fence<｜tool▁call▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\nno fence<｜tool▁call▁end｜>", []),
]

PYTHONIC = [
    ('[get_weather(city="San Francisco", metric="celsius"), get_time()]', None,
     [("get_weather", '{"city": "San Francisco", "metric": "celsius"}'), ("get_time", "{}")]),
    ("<|python_start|>[f(a=true, b=None, c=-2, d=(1, 'x'), e={'k': [1.5]})]<|python_end|>", None,
     [("f", '{"a": true, "b": null, "c": -2, "d": [1, "x"], "e": {"k": [1.5]}}')]),
    ('\n[f(s="""a ] \\" b"""), g(t=\'\')] Done.', " Done.", [("f", '{"s": "a ] \\" b"}'), ("g", '{"t": ""}')]),
    ("[f(1)]", "[f(1)]", []),  # positional arguments
    ("[f(x=y)]", "[f(x=y)]", []),  # not a literal
    ("[f(x=__import__('os'))]", "[f(x=__import__('os'))]", []),  # never evaluated
    ("I think [f()]", "I think [f()]", []),  # the list must open the output
    ("[f(x=1", "[f(x=1", []),  # unclosed
    ("[1, 2, 3]", "[1, 2, 3]", []),
]

PARSERS = {
    "hermes": (HermesToolParser, HERMES),
    "llama3_json": (Llama3JsonToolParser, LLAMA3_JSON),
    "mistral": (MistralToolParser, MISTRAL),
    "deepseek_v3": (DeepSeekV3ToolParser, DEEPSEEK),
    "pythonic": (PythonicToolParser, PYTHONIC),
}
CASES = [(name, i) for name, (_, examples) in PARSERS.items() for i in range(len(examples))]


def make(name):
    return PARSERS[name][0](None, tools=[], id_factory=ids)


@pytest.mark.parametrize("name,i", CASES)
def test_extract_reads_the_models_format(name, i):
    text, content, expected = PARSERS[name][1][i]
    assert make(name).extract(text) == ToolCallResult(content, calls(*expected))


@pytest.mark.parametrize("name,i", CASES)
def test_streaming_one_character_at_a_time_matches_extract(name, i):
    text = PARSERS[name][1][i][0]
    parser = make(name)
    assert stream_tool_calls(parser, list(text) + [""]) == parser.extract(text)


@pytest.mark.parametrize("name", PARSERS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_split_into_deltas_matches_extract(name, data):
    examples = PARSERS[name][1]
    text = examples[data.draw(st.integers(0, len(examples) - 1))][0]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    parser = make(name)
    assert stream_tool_calls(parser, pieces_at(text, cuts)) == parser.extract(text)


# Random texts built from each format's pieces (markers, halves of markers, JSON and Python
# punctuation, names, escapes, whitespace): whatever the text, every split agrees with extract().
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", '{"name": "f"', '"arguments": ', "{", "}", '"', "\\",
               ", ", ":", "\n", " ", "x", "é", '"a"', "[", "]", "1"],
    "llama3_json": ["<|python_tag|>", '{"name": "f"', '"parameters": ', '"arguments": ', "{", "}", '"', ";", "\\",
                    ", ", ":", "\n", " ", "x", '"a"', "[", "]", "1", "<|py"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "abc123XYZ", "[TOOL_", "f", '{"name": "f"', '"arguments": ',
                "{", "}", "[", "]", '"', ",", " ", "\n", ":", "1", "x y"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁calls▁end｜>", "<｜tool", "function", "f", "\n", "```json", "```", "{", "}", '"a"', ":",
                    " ", "x"],
    "pythonic": ["[", "]", "(", ")", "f", "g", "=", "1", '"', "'", '"""', "\\", ",", " ", "\n", "x", "None", "true",
                 "<|python_start|>", "<|python_end|>", "{", "}", ":"],
}


@pytest.mark.parametrize("name", PARSERS)
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_random_texts_stream_as_they_extract(name, data):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=30)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    parser = make(name)
    expected = parser.extract(text)
    assert stream_tool_calls(parser, pieces_at(text, cuts)) == expected
    if not expected.calls:  # no call found: nothing is lost, nothing added (llama3_json drops <|python_tag|>)
        kept = text.replace("<|python_tag|>", "") if name == "llama3_json" else text
        assert (expected.content or "") == kept


def test_ids_are_fixed_per_parser_instance_and_unique_across_instances():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    parser = HermesToolParser(None)
    first = parser.extract(text)
    assert [c.id for c in first.calls] == [c.id for c in stream_tool_calls(parser, list(text)).calls]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in first.calls)
    assert first.calls[0].id != first.calls[1].id
    assert HermesToolParser(None).extract(text).calls[0].id != first.calls[0].id


def test_mistral_ids_are_nine_alphanumerics_or_the_models_own():
    result = MistralToolParser(None).extract('[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[CALL_ID]a1b2c3d4e[ARGS]{}')
    assert len(result.calls[0].id) == 9 and result.calls[0].id.isalnum()
    assert result.calls[1].id == "a1b2c3d4e"


def test_feeding_after_done_is_an_error():
    stream = HermesToolParser(None).stream()
    stream.feed("hi", done=True)
    with pytest.raises(RuntimeError, match="after done=True"):
        stream.feed("more")


def test_a_parser_must_implement_stream_or_extract():
    from pagoda.parsers import ToolParser

    with pytest.raises(NotImplementedError, match="neither stream"):
        ToolParser(None).extract("x")
