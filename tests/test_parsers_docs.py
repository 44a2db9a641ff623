"""The plugin example of docs/parsers.md runs: both of its parsers read their format, the
streaming one agrees with extract() for any split, and they register through the hook."""

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda.parsers import ToolCall, ToolCallResult
from parser_cases import ids, pieces_at, stream_tool_calls

DOC = Path(__file__).resolve().parents[1] / "docs" / "parsers.md"
TEXT = 'Let me see. <function=get_weather>{"city": "Paris"}</function><function=get_time></function>'


def example() -> dict:
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(code) == 1
    namespace: dict = {}
    exec(compile(code[0], str(DOC), "exec"), namespace)
    return namespace


def test_the_documented_parsers_read_their_format():
    ns = example()
    expected = ToolCallResult("Let me see.", [ToolCall("call0", "get_weather", '{"city": "Paris"}'),
                                              ToolCall("call1", "get_time", "{}")])
    assert ns["FunctionTagParser"](None, id_factory=ids).extract(TEXT) == expected
    streaming = ns["StreamingFunctionTagParser"](None, id_factory=ids)
    assert streaming.extract(TEXT).calls[0] == expected.calls[0]
    assert streaming.extract("a <function=not a name> b").content == "a <function=not a name> b"
    registered = {}
    ns["register_tool_parsers"](lambda name, cls: registered.setdefault(name, cls))
    assert set(registered) == {"function_tag", "function_tag_streaming"}
    buffered = ns["FunctionTagParser"](None, id_factory=ids)
    assert stream_tool_calls(buffered, list(TEXT)) == expected  # extract-only parsers stream too


@settings(max_examples=40, deadline=None)
@given(text=st.sampled_from([TEXT, "x <function=f>{}", "<function=" + "a" * 70 + ">{}</function>", "<funct"]),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_the_documented_streaming_parser_agrees_with_extract(text, cuts):
    parser = example()["StreamingFunctionTagParser"](None, id_factory=ids)
    assert stream_tool_calls(parser, pieces_at(text, cuts)) == parser.extract(text)
