"""Tool-call parsing and the ChatML fallback renderer."""

from __future__ import annotations

import json
import re

import pytest

from whet.learner.prompt import render_chatml, template_messages
from whet.runtime.chat_format import TOOL_CALL_OPEN, parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — today",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_text_without_tool_calls_is_all_content():
    content, calls, errors = parse_tool_calls("  Hello there.\n")
    assert (content, calls, errors) == ("Hello there.", [], [])


def test_a_well_formed_block_becomes_a_tool_call_and_leaves_the_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert content == "Let me check."
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_multiple_blocks_parse_in_order_with_distinct_ids():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    content, calls, errors = parse_tool_calls(text)
    assert content == "and"
    assert [c.name for c in calls] == ["a", "b"]
    assert calls[0].id != calls[1].id
    assert errors == []


def test_missing_arguments_default_to_an_empty_object_and_string_arguments_are_decoded():
    _, calls, errors = parse_tool_calls(
        '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "w", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    )
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("now", {}), ("w", {"city": "Oslo"})]


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        ('{"name": "a", "arguments": {', "invalid JSON"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": "", "arguments": {}}', 'missing "name"'),
        ('{"name": "a", "arguments": [1, 2]}', '"arguments" of \'a\' must be a JSON object, got list'),
        ('["a"]', "expected a JSON object, got list"),
    ],
)
def test_a_malformed_block_gives_one_error_naming_the_problem(block, problem):
    text = f'Hi <tool_call>{block}</tool_call> <tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert content == "Hi"
    assert [c.name for c in calls] == ["ok"]
    assert len(errors) == 1
    assert errors[0].startswith("tool call 1: ")
    assert problem in errors[0]
    assert "<tool_call>" in errors[0]  # the fix is named


def test_an_unterminated_block_at_the_end_is_an_error_and_is_cut_from_the_content():
    text = 'Sure. <tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b", "argu'
    content, calls, errors = parse_tool_calls(text)
    assert content == "Sure.  then"
    assert [c.name for c in calls] == ["a"]
    assert len(errors) == 1 and errors[0].startswith("tool call 2:") and "never closed" in errors[0]
    assert TOOL_CALL_OPEN == "<tool_call>"


def test_tool_call_round_trips_through_openai_shape():
    _, calls, _ = parse_tool_calls('<tool_call>{"name": "w", "arguments": {"city": "Zürich"}}</tool_call>')
    wire = calls[0].to_openai()
    assert wire["function"]["name"] == "w"
    assert json.loads(wire["function"]["arguments"]) == {"city": "Zürich"}


def test_template_messages_decodes_argument_strings_without_mutating_the_input():
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    out = template_messages(messages)
    assert out[0]["content"] == ""
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_render_chatml_matches_qwen25_layout():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},
    ]
    prompt = render_chatml(messages, TOOLS)
    tools_json = json.dumps(TOOLS[0], ensure_ascii=False)
    assert prompt == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools_json}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n20C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_chatml_without_tools_or_system_has_no_system_block():
    assert render_chatml([{"role": "user", "content": "hi"}], []) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


CONVERSATIONS = [
    ([{"role": "user", "content": "hi"}], []),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], []),
    ([{"role": "user", "content": "hi"}], TOOLS),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "checking",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                    {"id": "2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "rain"},
            {"role": "assistant", "content": "It rains."},
            {"role": "user", "content": "thanks"},
            {"role": "tool", "tool_call_id": "2", "content": "x"},
        ],
        TOOLS,
    ),
]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from whet.learner.tiny import build_tokenizer

    return build_tokenizer(512)


@pytest.mark.parametrize(("messages", "tools"), CONVERSATIONS)
def test_the_tiny_models_chat_template_renders_exactly_like_render_chatml(tiny_tokenizer, messages, tools):
    for generation_prompt in (True, False):
        rendered = tiny_tokenizer.apply_chat_template(
            template_messages(messages), tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert rendered == render_chatml(messages, tools, add_generation_prompt=generation_prompt)


@pytest.mark.parametrize(("messages", "tools"), CONVERSATIONS)
def test_the_compact_template_lists_tools_one_line_each_before_the_system_text_and_renders_the_rest_alike(
    tiny_tokenizer, messages, tools
):
    from whet.learner.templates import COMPACT_CHAT_TEMPLATE

    rendered = tiny_tokenizer.apply_chat_template(template_messages(messages), tools=tools or None,
                                                  chat_template=COMPACT_CHAT_TEMPLATE, add_generation_prompt=True,
                                                  tokenize=False)  # fmt: skip
    full = render_chatml(messages, tools, add_generation_prompt=True)
    if not tools:
        assert rendered == full
        return
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    # one line a tool: its arguments, then the first sentence of its description
    head = "<|im_start|>system\n# Tools\n- get_weather(city): Weather for a city — today\nCall a tool as <tool_call>\n"
    assert rendered.startswith(head) and rendered.count("<|im_end|>") == full.count("<|im_end|>")
    block = rendered[: rendered.index("<|im_end|>\n") + len("<|im_end|>\n")]
    assert block.endswith(f"\n\n{system}<|im_end|>\n" if system else "</tool_call><|im_end|>\n")
    assert rendered[len(block):] == full[full.index("<|im_end|>\n") + len("<|im_end|>\n"):]
