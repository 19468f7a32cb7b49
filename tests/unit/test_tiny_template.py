"""The tiny model's chat template: ChatML as before without tools, Qwen2.5's tool format with them, and
prefix-stable either way (a past assistant turn re-renders as sampled)."""

from __future__ import annotations

import json

import pytest

from rlfleet.env.tool_calls import parse_tool_calls
from rlfleet.services.environment.rendering import ChatRenderer

# The template before tools (BUILDER_VERSION 1): without tools, the new one must render every
# conversation byte for byte as this one did.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 script and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
ADD = {
    "type": "function",
    "function": {"name": "add", "description": "a + b, «exact»", "parameters": {"type": "object"}},
}
TOOLS = [PYTHON, ADD]
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(PYTHON, ensure_ascii=False) + "\n" + json.dumps(ADD, ensure_ascii=False) + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
USER = {"role": "user", "content": "what is 6 times 7?"}


def call_text(name: str, **arguments: object) -> str:
    """A tool call as the template's instruction asks the model to write it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'



def render(tokenizer, messages, tools=None, *, chat_template=None, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


CONVERSATIONS = {
    "user only": [USER],
    "system first": [{"role": "system", "content": "you add numbers"}, USER],
    "system later": [USER, {"role": "system", "content": "be brief"}],
    "whitespace and markup kept": [
        {"role": "user", "content": "  {{ not jinja }} {% raw %}\n\n"},
        {"role": "assistant", "content": " five \n"},
    ],
    "non-ascii": [{"role": "user", "content": "2 × 3 = ? «日本»"}],
    "tool turn": [
        USER,
        {"role": "assistant", "content": call_text("python", code="print(6 * 7)")},
        {"role": "tool", "name": "python", "content": "42"},
        {"role": "assistant", "content": "the answer is 42"},
    ],
    "openai tool_calls": [
        USER,
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": '{"code": "1"}'}}]},
        {"role": "tool", "tool_call_id": "0", "content": "1"},
    ],
    "tool_calls without content": [
        USER, {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, []], ids=["tools=None", "tools=[]"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_without_tools_every_conversation_renders_as_plain_chatml(tokenizer, name, tools, add_generation_prompt):
    messages = CONVERSATIONS[name]
    old = render(tokenizer, messages, chat_template=CHATML_TEMPLATE, add_generation_prompt=add_generation_prompt)
    assert render(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt) == old


def test_tools_are_offered_in_a_system_block_one_json_object_a_line(tokenizer):
    assert render(tokenizer, [USER], TOOLS) == (
        "<|im_start|>system\n" + TOOLS_BLOCK
        + "<|im_start|>user\nwhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_leading_system_message_is_merged_into_the_tools_block(tokenizer):
    messages = [{"role": "system", "content": "you add numbers"}, USER, {"role": "system", "content": "be brief"}]
    assert render(tokenizer, messages, TOOLS) == (
        "<|im_start|>system\nyou add numbers\n\n" + TOOLS_BLOCK
        + "<|im_start|>user\nwhat is 6 times 7?<|im_end|>\n"
        + "<|im_start|>system\nbe brief<|im_end|>\n"  # only the leading one is merged
        + "<|im_start|>assistant\n"
    )


def test_with_tools_turns_render_as_chatml_after_the_tools_block(tokenizer):
    messages = CONVERSATIONS["tool turn"]
    assert render(tokenizer, messages, TOOLS) == (
        "<|im_start|>system\n" + TOOLS_BLOCK + render(tokenizer, messages, chat_template=CHATML_TEMPLATE)
    )
    assert "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\nthe answer" in render(tokenizer, messages, TOOLS)


def test_assistant_tool_calls_without_content_render_as_blocks_the_parser_reads(tokenizer):
    openai_form = {"type": "function", "function": {"name": "python", "arguments": '{"code": "print(6 * 7)"}'}}
    mapping_form = {"function": {"name": "add", "arguments": {"a": 6, "b": 7}}}
    turn = {"role": "assistant", "content": None, "tool_calls": [openai_form, mapping_form]}
    rendered = render(tokenizer, [USER, turn], TOOLS, add_generation_prompt=False)
    written = call_text("python", code="print(6 * 7)") + "\n" + call_text("add", a=6, b=7)
    assert rendered.endswith(f"<|im_start|>assistant\n{written}<|im_end|>\n")
    calls, problems, skipped = parse_tool_calls(written)
    expected = [("python", {"code": "print(6 * 7)"}), ("add", {"a": 6, "b": 7})]
    assert [(call.name, call.arguments) for call in calls] == expected
    assert (problems, skipped) == ([], 0)


def test_assistant_content_is_never_rewritten_even_next_to_tool_calls(tokenizer):
    content = " I will call python.\n" + call_text("python", code="print(1)") + "  "
    turn = {"role": "assistant", "content": content, "tool_calls": [{"function": {"name": "add", "arguments": {}}}]}
    rendered = render(tokenizer, [USER, turn], TOOLS, add_generation_prompt=False)
    assert rendered.endswith(f"<|im_start|>assistant\n{content}<|im_end|>\n")


def test_the_instruction_describes_calls_that_parse_tool_calls_reads(tokenizer):
    system_block = render(tokenizer, [USER], TOOLS).split("<|im_end|>")[0]
    example = system_block[system_block.rindex("<tool_call>"):]
    assert example == '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    arguments = {"code": 'print("6 * 7 =", 6 * 7)'}
    written = example.replace("<function-name>", json.dumps("python"))
    written = written.replace("<args-json-object>", json.dumps(arguments))
    calls, problems, skipped = parse_tool_calls(f"Let me compute.\n{written}")
    assert [(call.name, call.arguments, call.raw) for call in calls] == [("python", arguments, written)]
    assert (problems, skipped) == ([], 0)


def test_a_three_turn_tool_conversation_is_prefix_stable(tokenizer):
    turns = [  # (what the model writes, what the environment answers)
        (call_text("python", code="print(6 * 7)"), [{"role": "tool", "name": "python", "content": "42"}]),
        ("Checking.\n" + call_text("add", a=40, b=2) + "\n" + call_text("python", code="print(42)"),
         [{"role": "tool", "name": "add", "content": "42"}, {"role": "tool", "name": "python", "content": "42\n"}]),
        ("  the answer is 42\n", []),
    ]
    messages = [{"role": "system", "content": "you use tools"}, USER]
    for content, observation in turns:
        given = render(tokenizer, messages, TOOLS) + content + "<|im_end|>"
        messages += [{"role": "assistant", "content": content}, *observation]
        assert render(tokenizer, messages, TOOLS).startswith(given)
        assert render(tokenizer, messages, TOOLS, add_generation_prompt=False).startswith(given)


def test_chat_renderer_observations_are_token_exact_with_tools(tiny_model_dir):
    renderer = ChatRenderer.from_pretrained(str(tiny_model_dir))
    messages = [USER]
    sequence = renderer.prompt(messages, TOOLS)[1]
    assert renderer.decode(sequence) == renderer.render(messages, TOOLS)
    assert renderer.decode(sequence).startswith("<|im_start|>system\n# Tools\n")
    eos = renderer.tokenizer.eos_token_id
    for content, observation, expected in [
        (call_text("python", code="print(6 * 7)"), [{"role": "tool", "name": "python", "content": "42"}],
         "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"),
        ("the answer is 42", [{"role": "user", "content": "are you sure?"}],
         "\n<|im_start|>user\nare you sure?<|im_end|>\n<|im_start|>assistant\n"),
    ]:
        sampled = renderer.encode(content) + [eos]
        result = renderer.observation(messages, sampled, observation, TOOLS)
        assert result.assistant_message == {"role": "assistant", "content": content}
        assert result.text == expected
        messages += [result.assistant_message, *observation]
        sequence += sampled + result.token_ids
        assert renderer.decode(sequence) == renderer.render(messages, TOOLS)
