"""Grammar-constrained agent turns: every completion is one valid tool call or a plain message.

Reads the environment's tool schemas and the policy's tokenizer; writes nothing. Supports the
paper's rollouts (§2, §3.3): with a 135M-parameter policy almost no free-form output is a
well-formed action, so constrained decoding keeps the trajectories about the agent's choices
rather than about its JSON syntax. Built on xgrammar.

The language, followed by the end-of-turn token `<|im_end|>`:

    <tool_call>\\n{"name": "<tool>", "arguments": <object valid for that tool>}\\n</tool_call>
  | a plain message: 1..max_text_chars characters, no '<' anywhere, not starting with
    whitespace or '{' (so it can never read as a tool call, bare or tagged)

The JSON is canonical (`", "` and `": "` separators, properties in schema order), the same
bytes chat.render_call writes. Strings without a `maxLength` get `max_string_chars`, so a
weak model cannot spend its whole token budget inside one argument; objects accept no
properties beyond the schema's. A completion cut off by `max_new_tokens` can still be an
unfinished tool call (parse_assistant then reports it); give the turn enough tokens.

`ToolCallLogitsProcessor` is a transformers `LogitsProcessor` (works with `model.generate`
batches) with two extra methods, which policy.py calls as its batch changes: `select_rows` when
finished rows leave it, `add_rows` when rows starting a new turn join it (continuous batching).

The message's length bound is kept by the processor, not by the grammar: written as a bounded
repetition (`[^<]{0,1199}`), xgrammar's mask for a message row costs far more per decoding step, and more as
the message grows, than the processor's whole step over `[^<]*` (`benchmarks/grammar_mask.py`). The grammar's
message is therefore unbounded, and the processor forbids, on each message row, the tokens that would take the message
past `max_text_chars` characters (counted as UTF-8 lead bytes, as the grammar counted characters):
the same tokens the bounded repetition forbade (`tests/engine/test_grammar.py` compares the two masks).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor

from trace_lib.engine.chat import normalize_tools

MAX_TEXT_CHARS = 1200
"""Longest plain message a turn may write (kept by `ToolCallLogitsProcessor`)."""
MAX_STRING_CHARS = 256
"""Default `maxLength` for string arguments whose schema sets none."""

_COMPILERS: dict[int, tuple[Any, Any, "TokenChars"]] = {}
COMPILED: dict[tuple, Any] = {}
"""Compiled grammars by (tokenizer, vocabulary, tools, options), at most 16, the oldest dropped first."""


def _bounded(schema: Any, max_string_chars: int) -> Any:
    """A copy of `schema` whose strings have a maxLength (recursively)."""
    if isinstance(schema, list):
        return [_bounded(s, max_string_chars) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v, max_string_chars) for k, v in schema.items()}
    types = schema.get("type")
    if (types == "string" or (isinstance(types, list) and "string" in types)) and "enum" not in schema:
        out.setdefault("maxLength", max_string_chars)
    return out


def call_schema(tools: list[dict[str, Any]], max_string_chars: int = MAX_STRING_CHARS) -> dict[str, Any]:
    """One JSON schema accepting `{"name": <tool>, "arguments": {...}}` for any of `tools`.

    Tools whose parameters use `$defs` (pydantic models, e.g. τ² airline) keep working: every
    `#/$defs/...` reference is resolved against one `$defs` table hoisted to the root.
    """
    cases = []
    defs: dict[str, Any] = {}
    for tool in normalize_tools(tools):
        fn = tool["function"]
        params = copy.deepcopy(fn.get("parameters") or {"type": "object", "properties": {}})
        for name, definition in params.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(f"tools define $defs/{name} differently; cannot share one grammar")
        params.setdefault("type", "object")
        params.setdefault("properties", {})
        cases.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": _bounded(params, max_string_chars)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    if not cases:
        raise ValueError("constrained decoding needs at least one tool")
    schema: dict[str, Any] = {"anyOf": cases}
    if defs:
        schema["$defs"] = _bounded(defs, max_string_chars)
    return schema


TEXT_EBNF = 'root ::= [^<{ \\t\\r\\n] [^<]*'
"""A plain message; its length bound is the processor's (`ToolCallLogitsProcessor`, module docstring)."""


def tool_turn_grammar(
    tools: list[dict[str, Any]], *, max_string_chars: int = MAX_STRING_CHARS, require_tool_call: bool = False,
):
    """The xgrammar Grammar of one agent turn (without the end-of-turn token); a message in it has no
    length bound (the processor's `max_text_chars` keeps it)."""
    import xgrammar as xgr

    if not tools and not require_tool_call:  # nothing to call: the turn can only be a message
        return xgr.Grammar.from_ebnf(TEXT_EBNF)
    call = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
        xgr.Grammar.from_json_schema(call_schema(tools, max_string_chars), any_whitespace=False,
                                     separators=(", ", ": "), strict_mode=True),
        xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'),
    )
    if require_tool_call:
        return call
    return xgr.Grammar.union(call, xgr.Grammar.from_ebnf(TEXT_EBNF))


def _compiler_entry(tokenizer: Any, vocab_size: int) -> tuple[Any, Any, TokenChars]:
    import xgrammar as xgr

    key = id(tokenizer)
    if key not in _COMPILERS or _COMPILERS[key][0] is not tokenizer:
        stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if not isinstance(stop, int) or stop == tokenizer.unk_token_id:
            stop = tokenizer.eos_token_id
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[stop])
        _COMPILERS[key] = (tokenizer, xgr.GrammarCompiler(info, max_threads=2), TokenChars.of(info))
    return _COMPILERS[key]


def _compiler(tokenizer: Any, vocab_size: int):
    return _compiler_entry(tokenizer, vocab_size)[1]


def compile_tool_grammar(tokenizer: Any, tools: list[dict[str, Any]], vocab_size: int | None = None, **options):
    """Compiled grammar for `tools` (cached per tokenizer, tools and options: compiling is slow)."""
    vocab_size = vocab_size or len(tokenizer)
    key = (id(tokenizer), vocab_size, json.dumps(normalize_tools(tools), sort_keys=True), tuple(sorted(options.items())))
    if key not in COMPILED:
        if len(COMPILED) >= 16:
            COMPILED.pop(next(iter(COMPILED)))
        COMPILED[key] = _compiler(tokenizer, vocab_size).compile_grammar(tool_turn_grammar(tools, **options))
    return COMPILED[key]


@dataclass
class TokenChars:
    """Per token of a vocabulary: the characters it adds to a message (its UTF-8 lead bytes, i.e. every
    byte but continuation bytes; 0 for stop tokens) and whether it opens with '<' (a message cannot, so
    such a first token starts a tool call). Built once per tokenizer."""

    chars: list[int]
    opens: list[bool]
    longest: int = field(init=False)
    """The most characters one token adds (with fewer left than this, a bound can bite)."""
    _on: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.longest = max(self.chars)

    @classmethod
    def of(cls, info: Any) -> TokenChars:
        """From an xgrammar `TokenizerInfo` (its decoded vocabulary and stop tokens)."""
        vocab = info.decoded_vocab
        chars = [sum(1 for b in tok if b & 0xC0 != 0x80) for tok in vocab]
        for stop in info.stop_token_ids:
            chars[stop] = 0
        return cls(chars, [tok[:1] == b"<" for tok in vocab])

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(chars, opens) as tensors on `device`, made once per device."""
        if str(device) not in self._on:
            self._on[str(device)] = (torch.tensor(self.chars, dtype=torch.int32, device=device),
                                     torch.tensor(self.opens, dtype=torch.bool, device=device))
        return self._on[str(device)]


def token_chars(tokenizer: Any, vocab_size: int | None = None) -> TokenChars:
    """The `TokenChars` of `tokenizer` as the grammar compiler sees it (cached with the compiler)."""
    return _compiler_entry(tokenizer, vocab_size or len(tokenizer))[2]


class ToolCallLogitsProcessor(LogitsProcessor):
    """Masks every token that would leave the agent-turn grammar, one matcher per batch row.

    Each call first feeds the tokens chosen since the previous call (the new columns of
    `input_ids`) to the rows' matchers, then masks `scores`. Rows whose matcher has finished
    (end-of-turn accepted) are left alone, as `model.generate` keeps padding them. A row whose first
    token does not open with '<' is a message: it may not grow past `max_text_chars` characters
    (module docstring).
    """

    def __init__(self, compiled: Any | list[Any], max_text_chars: int = MAX_TEXT_CHARS,
                 token_chars: TokenChars | None = None, row_grammar: Any = None) -> None:
        """`compiled`: one grammar for every row, or one per row (e.g. tool call required on some rows).
        `token_chars`: the vocabulary's (`grammar.token_chars`); None builds it from the grammar's.
        `row_grammar`: require_tool_call flag -> compiled grammar, for rows that join later (`add_rows`)."""
        if max_text_chars < 1:
            raise ValueError(f"max_text_chars must be >= 1, got {max_text_chars}")
        self.compiled = compiled
        first = compiled[0] if isinstance(compiled, list) else compiled
        self.vocab_size = first.tokenizer_info.vocab_size
        self.max_text_chars = max_text_chars
        self._tokens = token_chars or TokenChars.of(first.tokenizer_info)
        self._longest = self._tokens.longest  # with fewer characters left than this, the bound can bite
        self.matchers: list[Any] | None = None
        self.rejected: list[bool] = []
        self.text_chars: list[int | None] = []
        """Per row: characters of its message so far; None for a tool call, or before the first token."""
        self._started: list[bool] = []
        self._seen = 0
        self._row_grammar = row_grammar
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, one per processor (not shared across threads)

    def _count(self, j: int, tok: int) -> None:
        """Row j's matcher accepted `tok`."""
        if not self._started[j]:
            self._started[j] = True
            self.text_chars[j] = None if self._tokens.opens[tok] else self._tokens.chars[tok]
        elif self.text_chars[j] is not None:
            self.text_chars[j] += self._tokens.chars[tok]

    def _bound_rows(self, active: list[int]) -> tuple[list[int], list[int], list[bool]]:
        """The active rows the message bound can bite on this step: (rows, characters left, first token)."""
        rows, left, first = [], [], []
        for j in active:
            if not self._started[j]:  # a message's first token (a tool call's opens with '<')
                room = self.max_text_chars
            elif self.text_chars[j] is None:
                continue
            else:
                room = self.max_text_chars - self.text_chars[j]
            if room < self._longest:
                rows.append(j)
                left.append(room)
                first.append(not self._started[j])
        return rows, left, first

    def _mask_long(self, scores: torch.FloatTensor, active: list[int]) -> None:
        """Forbid, on message rows near the bound, the tokens that would take them past it."""
        rows, left, first = self._bound_rows(active)
        if not rows:
            return
        n = min(scores.shape[-1], self.vocab_size)
        chars, opens = self._tokens.on(scores.device)
        left_t = torch.tensor(left, dtype=torch.int32, device=scores.device)
        first_t = torch.tensor(first, dtype=torch.bool, device=scores.device)
        over = chars[None, :n] > left_t[:, None]
        over &= ~(first_t[:, None] & opens[None, :n])  # a first token opening with '<' starts a tool call
        index = torch.tensor(rows, device=scores.device)
        scores[index, :n] = scores[index, :n].masked_fill(over, float("-inf"))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        import xgrammar as xgr

        if self.matchers is None:
            per_row = self.compiled if isinstance(self.compiled, list) else [self.compiled] * scores.shape[0]
            if len(per_row) != scores.shape[0]:
                raise ValueError(f"{len(per_row)} row grammars for a batch of {scores.shape[0]}")
            self.matchers = [xgr.GrammarMatcher(c) for c in per_row]
            self.rejected = [False] * scores.shape[0]
            self.text_chars = [None] * scores.shape[0]
            self._started = [False] * scores.shape[0]
            self._bitmask = xgr.allocate_token_bitmask(scores.shape[0], self.vocab_size)
        else:
            new_tokens = input_ids[:, self._seen:].tolist()  # one transfer per step off an accelerator
            for j, m in enumerate(self.matchers):
                for tok in new_tokens[j]:
                    if tok < 0 or m.is_terminated():  # < 0: a column from before the row joined
                        continue
                    if m.accept_token(tok):
                        self._count(j, tok)
                    else:
                        self.rejected[j] = True  # only reachable if a caller ignored the mask
        self._seen = input_ids.shape[1]
        active = [j for j, m in enumerate(self.matchers) if not m.is_terminated()]
        if active:  # the rows' masks on xgrammar's threads, not one row after another
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(mask_threads())
            self._batch.batch_fill_next_token_bitmask([self.matchers[j] for j in active], self._bitmask,
                                                      indices=active)
        if active:
            # off the CPU, plain torch ops rather than xgrammar's default there (a Triton kernel compiled
            # at first use): one masking per decoding step costs little either way
            xgr.apply_token_bitmask_inplace(scores, self._bitmask[: scores.shape[0]].to(scores.device),
                                            vocab_size=min(scores.shape[-1], self.vocab_size), indices=active,
                                            backend="cpu" if scores.device.type == "cpu" else "torch_native")
            if scores.shape[-1] > self.vocab_size:  # padded output rows beyond the tokenizer never fit
                scores[active, self.vocab_size:] = float("-inf")
            self._mask_long(scores, active)
        return scores

    def select_rows(self, keep: list[int]) -> None:
        """Keep only the given batch rows (in this order), mirroring the caller's batch."""
        if self.matchers is not None:
            self.matchers = [self.matchers[j] for j in keep]
            self.rejected = [self.rejected[j] for j in keep]
            self.text_chars = [self.text_chars[j] for j in keep]
            self._started = [self._started[j] for j in keep]

    def clear_rows(self) -> None:
        """Drop every row and count `input_ids`' columns afresh: a new batch follows (`add_rows`)."""
        self.select_rows([])
        self._seen = 0

    def add_rows(self, require_tool_call: list[bool]) -> None:
        """Append fresh rows (a new turn each), after the rows already in the batch.

        Their columns of `input_ids` before they joined must hold negative ids (skipped); the
        batch must have been seen by one call already.
        """
        import xgrammar as xgr

        if self.matchers is None or self._row_grammar is None:
            raise RuntimeError("add_rows needs a processor that has run once and knows its grammars (row_grammar)")
        self.matchers += [xgr.GrammarMatcher(self._row_grammar(flag)) for flag in require_tool_call]
        self.rejected += [False] * len(require_tool_call)
        self.text_chars += [None] * len(require_tool_call)
        self._started += [False] * len(require_tool_call)
        if len(self.matchers) > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(len(self.matchers), self.vocab_size)


def mask_threads() -> int:
    """Threads for filling a batch's grammar masks (xgrammar's `BatchGrammarMatcher`): half the cores this
    process may run on (its affinity), at least one. One on the 2-core CPU, where the masks of real turns are
    cheap; on a GPU machine the rows of a step filling theirs one after another were most of the step
    (benchmarks/README.md, evaluate_routes.py on a GPU)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def make_tool_call_processor(
    tokenizer: Any, tools: list[dict[str, Any]], batch_size: int | None = None,
    vocab_size: int | None = None, require_tool_call: bool | list[bool] = False,
    max_text_chars: int = MAX_TEXT_CHARS, **options,
) -> ToolCallLogitsProcessor:
    """A fresh processor for one batch (matchers are created on the first call).

    `require_tool_call` may be a list with one flag per row: those rows must emit a tool call,
    the others may also answer in plain text, of at most `max_text_chars` characters.
    """
    chars = token_chars(tokenizer, vocab_size)

    grammars: dict[bool, Any] = {}

    def row_grammar(flag: bool) -> Any:
        if flag not in grammars:
            grammars[flag] = compile_tool_grammar(tokenizer, tools, vocab_size, require_tool_call=flag, **options)
        return grammars[flag]

    if isinstance(require_tool_call, list):
        return ToolCallLogitsProcessor([row_grammar(flag) for flag in require_tool_call], max_text_chars, chars,
                                       row_grammar)
    return ToolCallLogitsProcessor(row_grammar(require_tool_call), max_text_chars, chars, row_grammar)
