"""Chat format: rendering with the tool template and robust parsing of agent output."""

from __future__ import annotations

import json

import pytest

from trace_lib.engine.chat import (
    MAX_OUTPUT_CHARS,
    check_schema,
    message_to_dict,
    parse_assistant,
    render_call,
    render_prompt,
    tool_chat_template,
)
from trace_lib.records import Message, ToolCall

TOOLS = [
    {"type": "function", "function": {
        "name": "get_order_details", "description": "Look up an order.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}},
    {"type": "function", "function": {
        "name": "cancel_order", "description": "Cancel an order.",
        "parameters": {"type": "object", "properties": {
            "order_id": {"type": "string"},
            "reason": {"type": "string", "enum": ["no longer needed", "ordered by mistake"]},
            "items": {"type": "array", "items": {"type": "integer"}},
            "express": {"type": "boolean"}},
            "required": ["order_id", "reason"]}}},
    {"name": "list_all", "description": "A bare function schema.", "parameters": {"type": "object", "properties": {}}},
]


def call_text(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def test_plain_text_is_a_message():
    msg = parse_assistant("  Could you give me your order id?  ", TOOLS)
    assert msg.role == "assistant" and msg.invalid is None
    assert msg.content == "Could you give me your order id?" and msg.tool_calls == []


def test_well_formed_call_gets_deterministic_id():
    msg = parse_assistant(call_text({"name": "get_order_details", "arguments": {"order_id": "#W1"}}), TOOLS, turn=3)
    assert msg.invalid is None
    assert msg.tool_calls == [ToolCall(name="get_order_details", arguments={"order_id": "#W1"}, id="call_3_0")]


def test_multiple_calls_and_surrounding_text():
    text = ("Let me check.\n" + call_text({"name": "get_order_details", "arguments": {"order_id": "#W1"}})
            + "\n" + call_text({"name": "list_all", "arguments": {}}))
    msg = parse_assistant(text, TOOLS, turn=1)
    assert msg.invalid is None and msg.content == "Let me check."
    assert [(c.name, c.id) for c in msg.tool_calls] == [("get_order_details", "call_1_0"), ("list_all", "call_1_1")]


@pytest.mark.parametrize("text, reason", [
    ("", "empty output"),
    ("   \n ", "empty output"),
    ('<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}', "unclosed <tool_call>"),
    ('<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}\n</tool_call>', "bad JSON"),
    ("<tool_call>\n[1, 2]\n</tool_call>", "not an object"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "missing function name"),
    ('<tool_call>\n{"name": "refund_everything", "arguments": {}}\n</tool_call>', "unknown tool 'refund_everything'"),
    ('<tool_call>\n{"name": "get_order_details", "arguments": [1]}\n</tool_call>', "arguments must be an object"),
    ('<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": 7}}\n</tool_call>',
     "arguments.order_id: expected string, got integer"),
    ('<tool_call>\n{"name": "get_order_details", "arguments": {}}\n</tool_call>',
     "missing required argument 'order_id'"),
    ('<tool_call>\n{"name": "cancel_order", "arguments": {"order_id": "#W1", "reason": "bored"}}\n</tool_call>',
     "is not one of"),
    ('<tool_call>\n{"name": "cancel_order", "arguments": {"order_id": "#W1", "reason": "ordered by mistake", '
     '"items": [1, "x"]}}\n</tool_call>', "arguments.items[1]: expected integer"),
    ('<tool_call>\n{"name": "cancel_order", "arguments": {"order_id": "#W1", "reason": "ordered by mistake", '
     '"express": 1}}\n</tool_call>', "expected boolean"),
    ('{"name": "list_all", "arguments": {}}\n</tool_call>', "without an opening"),
    ("<tool_call><tool_call>\n{}\n</tool_call>", "unclosed"),
    ("x" * (MAX_OUTPUT_CHARS + 1), "output too long"),
])
def test_invalid_outputs_get_a_reason(text, reason):
    msg = parse_assistant(text, TOOLS)
    assert msg.invalid is not None and reason in msg.invalid, msg.invalid
    assert msg.tool_calls == [] and len(msg.content) <= MAX_OUTPUT_CHARS


@pytest.mark.parametrize("text", [
    '{"name": "get_order_details", "arguments": {"order_id": "#W1"}}',
    '```json\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}\n```',
    '<tool_call>\n```json\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}\n```\n</tool_call>',
    '<tool_call>{"name": "get_order_details", "parameters": {"order_id": "#W1"}}</tool_call>',
    '<tool_call>\n{"name": "get_order_details", "arguments": "{\\"order_id\\": \\"#W1\\"}"}\n</tool_call>',
    '<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}\n</tool_call><|im_end|>junk',
])
def test_near_misses_are_accepted(text):
    msg = parse_assistant(text, TOOLS, turn=2)
    assert msg.invalid is None, msg.invalid
    assert msg.tool_calls == [ToolCall(name="get_order_details", arguments={"order_id": "#W1"}, id="call_2_0")]


def test_json_without_name_is_plain_text():
    msg = parse_assistant('{"status": "ok"}', TOOLS)
    assert msg.invalid is None and msg.content == '{"status": "ok"}' and not msg.tool_calls


def test_missing_arguments_key_reads_as_empty_object():
    assert parse_assistant(call_text({"name": "list_all"}), TOOLS).tool_calls[0].arguments == {}
    assert "missing required" in parse_assistant(call_text({"name": "get_order_details"}), TOOLS).invalid


@pytest.mark.parametrize("junk", [
    "<tool_call>", "</tool_call>", "<tool_call>\n\n</tool_call>", "{", "{]", "\x00\xff", "[" * 5000 + "]" * 5000,
    '<tool_call>\n{"name": "x", "arguments": ' + "[" * 3000 + "]" * 3000 + "}\n</tool_call>", "<|im_end|>", "null",
])
def test_parser_never_raises(junk):
    msg = parse_assistant(junk, TOOLS)
    assert msg.role == "assistant"
    assert msg.invalid is not None or msg.content


def test_non_string_input_is_invalid_not_an_exception():
    assert "not text" in parse_assistant(None, TOOLS).invalid  # type: ignore[arg-type]


def test_check_schema_bool_is_not_integer_and_type_lists():
    assert check_schema(True, {"type": "integer"}) is not None
    assert check_schema(3.0, {"type": "integer"}) is None
    assert check_schema(None, {"type": ["string", "null"]}) is None
    assert "unexpected argument 'b'" in check_schema({"b": 1}, {"type": "object", "additionalProperties": False})


def test_render_prompt_format(smollm2_tokenizer):
    msgs = [
        Message(role="system", content="You are a retail agent."),
        Message(role="user", content="Cancel #W1 please."),
        Message(role="assistant", tool_calls=[ToolCall(name="get_order_details", arguments={"order_id": "#W1"},
                                                       id="call_0_0")]),
        Message(role="tool", name="get_order_details", tool_call_id="call_0_0", content='{"status": "pending"}'),
        Message(role="assistant", content="<tool_call>{oops", invalid="unclosed <tool_call> tag"),
        Message(role="tool", name="invalid_action", error=True, content="Error: invalid action"),
    ]
    text = render_prompt(smollm2_tokenizer, msgs, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert text.endswith("<|im_start|>assistant\n")
    # tools first, then the task's system text, in one system turn
    assert text.index("<tools>") < text.index("You are a retail agent.") < text.index("<|im_end|>")
    assert json.dumps(TOOLS[0]) in text
    assert json.dumps({"type": "function", "function": TOOLS[2]}) in text
    assert "<|im_start|>assistant\n" + render_call(msgs[2].tool_calls[0]) + "<|im_end|>\n" in text
    assert '<|im_start|>tool\n<tool_response>\n{"status": "pending"}\n</tool_response><|im_end|>' in text
    assert "<|im_start|>assistant\n<tool_call>{oops<|im_end|>" in text  # invalid turns render their raw text
    assert text.count("<|im_start|>") == 7


AIRLINE_LIKE = {"type": "function", "function": {
    "name": "book", "description": "Book a trip.",
    "parameters": {"$defs": {"Leg": {"type": "object", "properties": {"flight": {"type": "string"},
                                                                        "date": {"type": "string"}},
                                      "required": ["flight"], "title": "Leg"}},
                   "type": "object", "title": "parameters",
                   "properties": {"legs": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/Leg"}, {"type": "null"}]},
                                           "description": "The legs, in order.", "title": "Legs"},
                                  "cabin": {"enum": ["economy", "business"], "title": "Cabin"},
                                  "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
                   "required": ["legs", "cabin"]}}}


def test_signature_format_lists_each_tool_on_a_line(smollm2_tokenizer):
    msgs = [Message(role="system", content="You are a retail agent."), Message(role="user", content="hi")]
    text = render_prompt(smollm2_tokenizer, msgs, [*TOOLS, AIRLINE_LIKE], "signature")
    tools_block = text.split("You may call one function at a time.")[1].split("\n\nTo call a function")[0]
    assert tools_block.splitlines()[1:] == [
        "- get_order_details(order_id: string): Look up an order.",
        "- cancel_order(order_id: string, reason: \"no longer needed\" | \"ordered by mistake\", items?: list[integer], "
        "express?: boolean): Cancel an order.",
        "- list_all(): A bare function schema.",
        "- book(legs: list[Leg{flight: string, date?: string} | null], cabin: \"economy\" | \"business\", "
        "note?: string | null): Book a trip.",
        "    legs: The legs, in order.",
    ]
    # the rest of the prompt is the json format's, character for character
    json_text = render_prompt(smollm2_tokenizer, msgs, [*TOOLS, AIRLINE_LIKE])
    assert text.split("\n\nTo call a function")[1] == json_text.split("\n\nTo call a function")[1]
    assert "<tools>" not in text and "title" not in text
    assert len(smollm2_tokenizer(text)["input_ids"]) < len(smollm2_tokenizer(json_text)["input_ids"])


def test_signature_format_writes_odd_schemas_on_one_line(smollm2_tokenizer):
    odd = {"name": "odd", "description": "Line one.\nLine two.", "parameters": {"type": "object", "$defs": {
        "Cabin": {"enum": ["a", "b"]}, "Id": {"type": "string"},
        "Leg": {"type": "object", "properties": {"start": {"$ref": "#/$defs/Airport"}}},
        "Airport": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        "Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}},
        "properties": {"cabin": {"$ref": "#/$defs/Cabin"}, "id": {"$ref": "#/$defs/Id"},
                       "either": {"anyOf": [{"$ref": "#/$defs/Id"}, {"type": "integer"}]},
                       "maybe": {"type": ["string", "null"], "description": "A text,\n   or nothing."},
                       "nums": {"type": ["array", "null"], "items": {"type": "number"}},
                       "leg": {"$ref": "#/$defs/Leg"}, "node": {"$ref": "#/$defs/Node"}, "three": {"const": 3},
                       "airport": {"allOf": [{"$ref": "#/$defs/Airport"}]}, "anything": {},
                       "unknown": {"$ref": "#/$defs/Nope"}},
        "required": ["cabin"]}}
    text = render_prompt(smollm2_tokenizer, [Message(role="user", content="hi")], [odd], "signature")
    block = text.split("('?': optional):\n")[1].split("\n\nTo call a function")[0]
    assert block.splitlines() == [
        '- odd(cabin: "a" | "b", id?: string, either?: string | integer, maybe?: string | null, nums?: list[number] | null, '
        "leg?: Leg{start?: Airport{code: string}}, node?: Node{next?: Node{next?: Node}}, three?: 3, "
        "airport?: Airport{code: string}, anything?: any, unknown?: Nope): Line one. Line two.",
        "    maybe: A text, or nothing.",  # descriptions on one line: a line break cannot start a false tool line
    ]


def test_tool_format_is_the_templates_default_and_a_render_argument_overrides_it(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    signature = tool_chat_template("signature")
    assert tool_chat_template() != signature and "{{ tool | tojson }}" in signature  # one template, two defaults
    by_default = smollm2_tokenizer.apply_chat_template(msgs, tools=TOOLS, chat_template=signature, tokenize=False)
    assert "- get_order_details(order_id: string)" in by_default
    overridden = smollm2_tokenizer.apply_chat_template(msgs, tools=TOOLS, chat_template=signature, tokenize=False,
                                                       tool_format="json")
    assert overridden == smollm2_tokenizer.apply_chat_template(msgs, tools=TOOLS, chat_template=tool_chat_template(),
                                                               tokenize=False)
    with pytest.raises(ValueError, match="tool_format: expected one of \\['json', 'signature'\\], got 'xml'"):
        tool_chat_template("xml")


def test_render_then_parse_round_trip(smollm2_tokenizer):
    call = ToolCall(name="cancel_order", arguments={"order_id": "#W1", "reason": "ordered by mistake"}, id="call_0_0")
    msg = Message(role="assistant", content="Cancelling now.", tool_calls=[call])
    text = render_prompt(smollm2_tokenizer, [Message(role="user", content="hi"), msg], TOOLS)
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_assistant(turn, TOOLS, turn=0) == msg


def test_render_without_tools_or_system(smollm2_tokenizer):
    text = render_prompt(smollm2_tokenizer, [Message(role="user", content="hi")], [])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_message_to_dict_drops_calls_of_invalid_turns():
    msg = Message(role="assistant", content="raw", invalid="bad", tool_calls=[ToolCall(name="x")])
    assert message_to_dict(msg)["tool_calls"] == []
    assert "<tool_call>" in tool_chat_template()
