"""The reasoning parsers: Qwen3 with thinking on and off, the prompts that open the reasoning
(DeepSeek-R1, Qwen3 Thinking-2507, DeepSeek-V3.1), reasoning cut short; streaming agrees
with extract() for any split; is_reasoning_end on token ids of a real tokenizer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda.parsers import AUTO, CONTENT, REASONING
from pagoda.parsers.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagoda.parsers.reasoning.deepseek_v3 import DeepSeekV3ReasoningParser
from pagoda.parsers.reasoning.qwen3 import Qwen3ReasoningParser
from parser_cases import byte_tokenizer, marker_tokenizer, pieces_at, stream_reasoning


@pytest.fixture
def tokenizer():
    return marker_tokenizer()


PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser,
           "deepseek_v3": DeepSeekV3ReasoningParser}
# (parser, initial, text, reasoning, content)
CASES = [
    ("qwen3", None, "<think>\nThe user asks for the capital.\n</think>\n\nParis.", "The user asks for the capital.",
     "Paris."),
    ("qwen3", None, "Paris is the capital.\n", None, "Paris is the capital.\n"),  # no thinking: unchanged
    ("qwen3", CONTENT, "Paris.", None, "Paris."),  # enable_thinking=False: the prompt closed the block
    ("qwen3", REASONING, "Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),  # Thinking-2507, QwQ
    ("qwen3", None, "<think>\nstill thinking about", "still thinking about", None),  # cut short
    ("qwen3", None, "<think>\n\n</think>\n\nHi", None, "Hi"),  # an empty block
    ("qwen3", None, "Hello <think> x </think> y", None, "Hello <think> x </think> y"),  # tags later are text
    ("qwen3", None, "  \n<think>a\n\nb</think>c", "a\n\nb", "c"),
    ("deepseek_r1", None, "Okay, 2 + 2.\n</think>\n\n**4**", "Okay, 2 + 2.", "**4**"),
    ("deepseek_r1", None, "<think>\nOkay.</think>4", "Okay.", "4"),  # the output repeats <think>
    ("deepseek_r1", None, "Hmm, hm", "Hmm, hm", None),
    ("deepseek_v3", None, "Hello!", None, "Hello!"),  # V3.1 non-thinking is its default
    ("deepseek_v3", REASONING, "Plan.</think>Do it.", "Plan.", "Do it."),
    ("deepseek_v3", AUTO, "<think>x</think>y", "x", "y"),
]


@pytest.mark.parametrize("name,initial,text,reasoning,content", CASES)
def test_extract_splits_reasoning_from_content(name, initial, text, reasoning, content):
    parser = PARSERS[name](None)
    assert parser.extract(text, initial) == (reasoning, content)
    assert stream_reasoning(parser, list(text) + [""], initial) == (reasoning, content)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_any_split_into_deltas_matches_extract(data):
    name, initial, text, reasoning, content = CASES[data.draw(st.integers(0, len(CASES) - 1))]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert stream_reasoning(PARSERS[name](None), pieces_at(text, cuts), initial) == (reasoning, content)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_texts_stream_as_they_extract(data):
    text = "".join(data.draw(st.lists(st.sampled_from(["<think>", "</think>", "<thi", "</th", " ", "\n", "a", "b c"]),
                                      max_size=20)))
    initial = data.draw(st.sampled_from([AUTO, CONTENT, REASONING]))
    parser = Qwen3ReasoningParser(None)
    expected = parser.extract(text, initial)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert stream_reasoning(parser, pieces_at(text, cuts), initial) == expected
    if initial != REASONING and not text.lstrip(" \n").startswith("<think>"):
        assert expected == (None, text or None)  # no reasoning block: the content is the text, unchanged


def test_initial_state_comes_from_the_end_of_the_prompt():
    q, r, v = Qwen3ReasoningParser(None), DeepSeekR1ReasoningParser(None), DeepSeekV3ReasoningParser(None)
    assert q.initial_state("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n") == AUTO
    assert q.initial_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == CONTENT  # enable_thinking=False
    assert q.initial_state("<|im_start|>assistant\n<think>\n") == REASONING  # Thinking-2507 / QwQ
    assert r.initial_state("<｜User｜>Hi<｜Assistant｜><think>\n") == REASONING
    assert r.initial_state(None) == REASONING and q.initial_state(None) == AUTO
    assert v.initial_state("<｜User｜>Hi<｜Assistant｜></think>") == CONTENT
    assert v.initial_state("<｜User｜>Hi<｜Assistant｜><think>") == REASONING
    with pytest.raises(ValueError, match="initial must be one of"):
        q.extract("x", "thinking")


def test_prompt_rendered_by_a_chat_template_picks_the_initial_state(tokenizer):
    # a template in Qwen3's manner: enable_thinking=False writes an empty, closed block
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    parser = Qwen3ReasoningParser(tokenizer)
    messages = [{"role": "user", "content": "Capital of France?"}]
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert parser.initial_state(on) == AUTO and parser.initial_state(off) == CONTENT
    assert parser.extract("Paris.", parser.initial_state(off)) == (None, "Paris.")


def test_is_reasoning_end_on_token_ids(tokenizer):
    parser = Qwen3ReasoningParser(tokenizer)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert parser.reasoning_end_token_ids == [end]
    words = tokenizer.encode("Paris", add_special_tokens=False)
    assert not parser.is_reasoning_end([], AUTO)  # the model may still open a block
    assert not parser.is_reasoning_end([start, *words], AUTO)
    assert parser.is_reasoning_end([start, *words, end], AUTO)
    assert parser.is_reasoning_end(words, AUTO)  # it answered without thinking
    assert not parser.is_reasoning_end(words, REASONING)
    assert parser.is_reasoning_end([*words, end, *words], REASONING)
    assert parser.is_reasoning_end([], CONTENT)


def test_is_reasoning_end_decodes_where_the_tags_are_not_single_tokens():
    plain = byte_tokenizer()
    parser = DeepSeekR1ReasoningParser(plain)
    assert parser.reasoning_end_token_ids == []
    assert not parser.is_reasoning_end(plain.encode("Let me think", add_special_tokens=False))
    assert parser.is_reasoning_end(plain.encode("Hm.</think>4", add_special_tokens=False))
    with pytest.raises(ValueError, match="needs the tokenizer"):
        DeepSeekR1ReasoningParser(None).is_reasoning_end([1, 2])
