"""The agent's chat format: Hermes-style tool calling on ChatML, rendering and robust parsing.

Reads `trace_lib/engine/templates/tool_chat.jinja`; writes nothing. Implements the policy side of the
paper's agent loop (§2: the tool-calling agent whose trajectories TRACE analyses): how an
episode's messages become a prompt and how the model's raw text becomes an action.

The format (one turn per `<|im_start|>role ... <|im_end|>` block):

    <|im_start|>system
    # Tools ... <tools>
    {"type": "function", "function": {...}}        one JSON schema per line ('json')
    </tools> ... instructions ...                  or, 'signature': `- name(arg: type): description`

    <task-specific system text><|im_end|>
    <|im_start|>user
    ...<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "get_order", "arguments": {"order_id": "#W1"}}
    </tool_call><|im_end|>
    <|im_start|>tool
    <tool_response>
    {...}
    </tool_response><|im_end|>

Tool results are `tool` role turns holding one `<tool_response>` each (also the error
observation for an invalid action). The tool list precedes the task's system text so that the
prompt prefix is identical across an environment's episodes (policy.py caches its KV states).

`parse_assistant` never raises. Its verdicts: plain text -> a message; one or more well-formed
`<tool_call>` blocks -> tool calls (text outside them kept as content); anything else -> a
message with `invalid="<reason>"` and the raw text (capped) as content. Near-misses accepted:
a bare JSON object `{"name": ..., "arguments": ...}` with no tags (also inside a code fence),
code fences inside the tags, `parameters` instead of `arguments`, arguments given as a JSON
string, a missing `arguments` key (read as `{}`, then checked against `required`), and a
trailing `<|im_end|>`/`<|endoftext|>`. Not accepted: an unclosed tag, a stray `</tool_call>`,
a JSON array of calls.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from trace_lib.records import Message, ToolCall
from trace_lib.text import clean_json, clean_text

MAX_OUTPUT_CHARS = 8000
"""Longer agent outputs are invalid (a runaway generation, not an action)."""

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_STOP_STRINGS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.DOTALL)
PROTOCOL_MARKUP = ("<tool_response>", "</tool_response>", "<tools>", "</tools>", "<|im_start|>")
"""Chat-format markup that has no place in an agent turn: a turn holding it imitates the protocol (e.g. a
made-up tool result, another turn opened after its own end), so it is an invalid action the environment answers,
also marked `suspicious`. An end-of-turn token is no imitation: the turn ends there and what follows is cut."""
_CALL_SYNTAX = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")


TOOL_FORMATS = ("json", "signature")
"""How the system turn lists the tools (`model.tool_format`): 'json', one JSON schema per line (Hermes);
'signature', one line per tool (`name(arg: type, opt?: type): description`) and one per described
argument, each on one line: the same names, types, enums and descriptions (not those of fields inside nested
objects) without the schemas' JSON syntax and pydantic titles (the retail target's first prompt: 1,180 tokens
against 1,833; docs/LOG.md: tool formats)."""
_FORMAT_DEFAULT = "{%- set tool_format = tool_format if tool_format is defined else 'json' -%}"


@lru_cache(maxsize=len(TOOL_FORMATS))
def tool_chat_template(tool_format: str = "json") -> str:
    """The Jinja chat template text listing tools in `tool_format` (stored on prepared tokenizers and
    handed to servers). The format is the template's default; a render argument `tool_format`
    (`chat_template_kwargs` on a server) overrides it."""
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format: expected one of {list(TOOL_FORMATS)}, got {tool_format!r}")
    text = resources.files("trace_lib").joinpath("engine/templates/tool_chat.jinja").read_text(encoding="utf-8")
    if _FORMAT_DEFAULT not in text:
        raise RuntimeError("tool_chat.jinja no longer sets its tool_format default where chat.py expects it")
    return text.replace(_FORMAT_DEFAULT, _FORMAT_DEFAULT.replace("'json'", repr(tool_format)))


@dataclass
class Generation:
    """One decoded agent turn, whichever backend decoded it (engine/policy.py, engine/remote.py)."""

    text: str
    """Decoded completion without the stop token."""
    message: Message
    """`text` parsed by `parse_assistant` (tool calls, content, or invalid)."""
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = "stop"
    """'stop' (end of turn) or 'length' (max_new_tokens reached)."""


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row `row` of a call seeded `seed`, whichever backend draws it (a torch
    generator per row in engine/policy.py, the request's `seed` in engine/remote.py); within int64."""
    return (seed * 1_000_003 + row) % (2**63)


# --- rendering --------------------------------------------------------------------------------
def message_to_dict(msg: Message) -> dict[str, Any]:
    """A record message in the dict form chat templates (and TRL) consume."""
    out: dict[str, Any] = {"role": msg.role, "content": msg.content}
    if msg.role == "assistant":
        calls = [] if msg.invalid is not None else msg.tool_calls
        out["tool_calls"] = [
            {"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    elif msg.role == "tool":
        out["name"] = msg.name
        out["tool_call_id"] = msg.tool_call_id
    return out


def normalize_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools in the `{"type": "function", "function": {...}}` form, whichever form was given."""
    out = []
    for tool in tools:
        if "function" in tool:
            out.append(tool)
        else:
            out.append({"type": "function", "function": tool})
    return out


def render_prompt(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]],
                  tool_format: str = "json") -> str:
    """The prompt text for the next agent turn (ends with the assistant generation prompt), the tools
    listed in `tool_format` (`TOOL_FORMATS`).

    Always renders with the trace template, whatever template the tokenizer ships, so that
    rendering, parsing and constrained decoding agree on one format.
    """
    return tokenizer.apply_chat_template(
        [message_to_dict(m) for m in messages],
        tools=normalize_tools(tools) or None,
        chat_template=tool_chat_template(tool_format),
        tokenize=False,
        add_generation_prompt=True,
    )


def render_call(call: ToolCall) -> str:
    """The canonical text of one tool call (what the template and the grammar produce)."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"


# --- schema checks ----------------------------------------------------------------------------
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def _type_ok(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False  # bool is an int subclass in Python but not in JSON
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, (object,)))


def check_schema(value: Any, schema: dict[str, Any], path: str = "arguments") -> str | None:
    """First violation of the JSON-schema subset tool definitions use, or None.

    Checks type (incl. type lists), enum, required, properties, additionalProperties: false,
    items, and anyOf/oneOf (any branch passing). Other keywords are ignored.
    """
    if not isinstance(schema, dict):
        return None
    for key in ("anyOf", "oneOf"):
        if key in schema and isinstance(schema[key], list):
            if not any(check_schema(value, s, path) is None for s in schema[key]):
                return f"{path}: matches none of the allowed forms"
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_type_ok(value, t) for t in names):
            return f"{path}: expected {' or '.join(map(str, names))}, got {_json_type(value)}"
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        return f"{path}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for req in schema.get("required") or []:
            if req not in value:
                return f"{path}: missing required argument '{req}'"
        for key, sub in value.items():
            if key in props:
                err = check_schema(sub, props[key], f"{path}.{key}")
                if err:
                    return err
            elif schema.get("additionalProperties") is False:
                return f"{path}: unexpected argument '{key}'"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            err = check_schema(item, schema["items"], f"{path}[{i}]")
            if err:
                return err
    return None


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _type_ok(value, name):
            return name
    return type(value).__name__


def tool_parameters(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tool name -> its parameters schema (either tool form accepted)."""
    out = {}
    for tool in normalize_tools(tools):
        fn = tool.get("function") or {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


# --- parsing ----------------------------------------------------------------------------------
def _strip_fence(text: str) -> str:
    m = _FENCE.match(text.strip())
    return m.group(1).strip() if m else text.strip()


def _cut_at_stop(text: str) -> str:
    for stop in _STOP_STRINGS:
        idx = text.find(stop)
        if idx >= 0:
            text = text[:idx]
    return text


class _NonFinite(ValueError):
    """A JSON number that no strict JSON writer can write back (NaN, Infinity, or one that overflows)."""

    def reason(self, where: str) -> str:
        return f"{where}: number {str(self)[:40]!r} is not finite (JSON has no NaN or Infinity)"


def _strict_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NonFinite(text)
    return value


def _no_constant(text: str) -> float:
    raise _NonFinite(text)


def _load_call_json(text: str) -> Any:
    """`json.loads` for model-written JSON, with every string cleaned (`\\ud800` escapes decode to
    unencodable text) and non-finite numbers refused: Python's parser takes `NaN`, `Infinity` and
    `1e999`, which the strict JSONL writer of every later artifact cannot write."""
    return clean_json(json.loads(text, parse_float=_strict_float, parse_constant=_no_constant))


def _call_from_json(body: str, params: dict[str, dict[str, Any]], where: str) -> ToolCall | str:
    """A ToolCall from the JSON text of one call, or the reason it is not one."""
    try:
        obj = _load_call_json(_strip_fence(body))
    except _NonFinite as err:
        return err.reason(where)
    except (json.JSONDecodeError, RecursionError) as err:
        return f"{where}: bad JSON ({getattr(err, 'msg', type(err).__name__)})"
    if not isinstance(obj, dict):
        return f"{where}: JSON is a {_json_type(obj)}, not an object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: missing function name"
    if name not in params:
        return f"{where}: unknown tool '{name}' (available: {', '.join(sorted(params)) or 'none'})"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI-style stringified arguments
        try:
            args = _load_call_json(args) if args.strip() else {}
        except _NonFinite as err:
            return err.reason(where)
        except (json.JSONDecodeError, RecursionError):
            return f"{where}: arguments are a string that is not JSON"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"{where}: arguments must be an object, got {_json_type(args)}"
    err = check_schema(args, params[name])
    if err:
        return f"{where}: {err}"
    return ToolCall(name=name, arguments=args)


def _invalid(text: str, reason: str, max_chars: int) -> Message:
    return Message(role="assistant", content=text[:max_chars], invalid=reason)


def parse_assistant(
    text: str, tools: list[dict[str, Any]], *, turn: int = 0, max_chars: int = MAX_OUTPUT_CHARS
) -> Message:
    """The agent's raw output as a Message: tool calls, plain content, or `invalid=<reason>`.

    Tool calls get deterministic ids `call_<turn>_<i>`. Never raises.
    """
    try:
        return _parse(text, tools, turn, max_chars)
    except Exception as err:  # a parser bug must not end a run; record it as an invalid action
        return _invalid(str(text), f"unparseable output ({type(err).__name__})", max_chars)


def _parse(text: str, tools: list[dict[str, Any]], turn: int, max_chars: int) -> Message:
    if not isinstance(text, str):
        return _invalid(str(text), f"output is {type(text).__name__}, not text", max_chars)
    text = clean_text(text)
    if len(text) > max_chars:
        return _invalid(text, f"output too long ({len(text)} > {max_chars} characters)", max_chars)
    markup = _protocol_markup(text)
    if markup is not None:
        return _invalid(text, markup, max_chars).model_copy(update={"suspicious": markup})
    text = _cut_at_stop(text)
    if not text.strip():
        return _invalid(text, "empty output", max_chars)
    params = tool_parameters(tools)

    if OPEN_TAG not in text:
        if CLOSE_TAG in text:
            return _invalid(text, f"{CLOSE_TAG} without an opening {OPEN_TAG}", max_chars)
        bare = _strip_fence(text)
        if bare.startswith("{") and bare.endswith("}"):
            try:
                obj = json.loads(bare)
            except (json.JSONDecodeError, RecursionError):
                obj = None
            if isinstance(obj, dict) and "name" in obj:
                call = _call_from_json(bare, params, "tool call")
                if isinstance(call, str):
                    return _invalid(text, call, max_chars)
                return Message(role="assistant", tool_calls=[call.model_copy(update={"id": f"call_{turn}_0"})])
        failed = _failed_call_shape(bare, params)
        if failed:
            return _invalid(text, failed, max_chars)
        return Message(role="assistant", content=text.strip())

    calls: list[ToolCall] = []
    outside: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN_TAG, pos)
        if start < 0:
            tail = text[pos:]
            if CLOSE_TAG in tail:
                return _invalid(text, f"{CLOSE_TAG} without an opening {OPEN_TAG}", max_chars)
            outside.append(tail)
            break
        outside.append(text[pos:start])
        if CLOSE_TAG in text[pos:start]:
            return _invalid(text, f"{CLOSE_TAG} without an opening {OPEN_TAG}", max_chars)
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        nxt = text.find(OPEN_TAG, start + len(OPEN_TAG))
        if end < 0 or (0 <= nxt < end):
            return _invalid(text, f"unclosed {OPEN_TAG} tag", max_chars)
        where = f"tool call {len(calls) + 1}"
        call = _call_from_json(text[start + len(OPEN_TAG):end], params, where)
        if isinstance(call, str):
            return _invalid(text, call, max_chars)
        calls.append(call.model_copy(update={"id": f"call_{turn}_{len(calls)}"}))
        pos = end + len(CLOSE_TAG)
    content = "\n".join(s.strip() for s in outside if s.strip())
    return Message(role="assistant", content=content, tool_calls=calls)


def _protocol_markup(text: str) -> str | None:
    """Why a turn imitates the chat protocol, or None. `<|im_start|>` counts only when a turn follows it."""
    found = []
    for tag in PROTOCOL_MARKUP:
        idx = text.find(tag)
        if idx >= 0 and not (tag in _STOP_STRINGS and not text[idx + len(tag):].strip()):
            found.append((idx, tag))
    return f"imitates protocol markup ({min(found)[1]})" if found else None


def _failed_call_shape(bare: str, params: dict[str, dict[str, Any]]) -> str | None:
    """Why a plain-text turn is a tool call in the wrong form (not a message to the user), or None."""
    if bare.startswith("{") and bare.endswith("}"):
        try:
            obj = ast.literal_eval(bare)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            obj = None
        if isinstance(obj, dict) and "name" in obj:
            return "tool call written as a Python literal, not JSON"
        if '"name"' in bare or "'name'" in bare:
            return "tool call that is not valid JSON"
    m = _CALL_SYNTAX.match(bare)
    if m and m.group(1) in params:
        return f"tool call written as code ({m.group(1)}(...)), not in {OPEN_TAG} tags"
    return None
