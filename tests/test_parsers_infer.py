"""Choosing parsers from a chat template: only where exactly one format's markers appear.
(The templates here are short stand-ins written for the test, each with the markers its
model family's template uses.)"""

import pytest
from pagoda.parsers import infer_reasoning_parser, infer_tool_parser

QWEN3 = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{{ tools | tojson }}</tools>\nCall a tool as\n"
         '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>{%- endif %}'
         "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
         "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{%- endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is false %}<think>\n\n"
         "</think>\n\n{%- endif %}{%- endif %}")
QWEN25 = QWEN3.replace("<think>", "").replace("</think>", "")
QWEN3_CODER = ("<|im_start|>system\nCall as <tool_call>\n<function=name>\n<parameter=x>\n1\n</parameter>\n</function>\n"
               '</tool_call> with "arguments"<|im_end|>')
LLAMA31 = ("<|start_header_id|>system<|end_header_id|>\n\nRespond in the format {\"name\": function name, "
           "\"parameters\": dictionary of argument name and its value}.<|eot_id|>"
           "{%- if m.tool_calls %}<|python_tag|>{{ '{\"name\": \"' + call.name + '\", \"parameters\": ' }}{% endif %}")
LLAMA32_PYTHONIC = ("<|start_header_id|>system<|end_header_id|>\n\nYou MUST put it in the format of "
                    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
                    "<|eot_id|>")
MISTRAL = "[INST]{{ m.content }}[/INST]{% for call in m.tool_calls %}[TOOL_CALLS]{{ call.name }}[ARGS]{% endfor %}"
DEEPSEEK_R1 = ("<｜User｜>{{ m.content }}<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
               "function<｜tool▁sep｜>{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
               "{% set c = content.split('</think>') %}")
DEEPSEEK_V31 = ("{% if not thinking is defined %}{% set thinking = false %}{% endif %}<｜User｜>{{ m.content }}"
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>{{ args }}<｜tool▁call▁end｜>"
                "{% if add_generation_prompt %}<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}"
                "{% endif %}")
DEEPSEEK_V3 = DEEPSEEK_R1.replace("<think>\n", "").replace("'</think>'", "''")
SMOLLM2 = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template,tool,reasoning", [
    (QWEN3, "hermes", "qwen3"),
    (QWEN25, "hermes", None),
    (QWEN3_CODER, None, None),  # XML calls inside <tool_call>: not hermes
    (LLAMA31, "llama3_json", None),
    (LLAMA32_PYTHONIC, "pythonic", None),
    (MISTRAL, "mistral", None),
    (DEEPSEEK_R1, "deepseek_v3", "deepseek_r1"),
    (DEEPSEEK_V31, "deepseek_v3", "deepseek_v3"),
    (DEEPSEEK_V3, "deepseek_v3", None),
    (SMOLLM2, None, None),
    (QWEN3 + MISTRAL, None, "qwen3"),  # two tool formats: ambiguous
    (None, None, None),
])
def test_parsers_are_inferred_only_where_unambiguous(template, tool, reasoning):
    assert infer_tool_parser(template) == tool
    assert infer_reasoning_parser(template) == reasoning
