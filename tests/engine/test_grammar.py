"""Constrained decoding: random weights still produce only valid actions."""

from __future__ import annotations

import pytest
import torch

from trace_lib.engine.chat import parse_assistant, render_call
from trace_lib.engine.grammar import call_schema, compile_tool_grammar, make_tool_call_processor
from trace_lib.engine.policy import load_policy
from trace_lib.records import Message, ToolCall

TOOLS = [
    {"type": "function", "function": {
        "name": "get_order_details", "description": "Look up an order.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}},
    {"type": "function", "function": {
        "name": "cancel_order", "description": "Cancel an order.",
        "parameters": {"type": "object", "properties": {
            "order_id": {"type": "string", "maxLength": 12},
            "reason": {"type": "string", "enum": ["no longer needed", "ordered by mistake"]},
            "quantity": {"type": "integer"}, "express": {"type": "boolean"}},
            "required": ["order_id", "reason"]}}},
    {"type": "function", "function": {"name": "list_all", "description": "No arguments.",
                                      "parameters": {"type": "object", "properties": {}}}},
]
CONVS = [[Message(role="system", content="You are a retail agent."),
          Message(role="user", content=f"Please help with order #W{i}.")] for i in range(6)]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    pol = load_policy(tiny_model_dir)
    pol.grammar_options = {"max_string_chars": 10, "max_text_chars": 40}
    return pol


def test_call_schema_bounds_strings_but_keeps_enums_and_explicit_limits():
    schema = call_schema(TOOLS, max_string_chars=7)
    args = {c["properties"]["name"]["const"]: c["properties"]["arguments"] for c in schema["anyOf"]}
    assert args["get_order_details"]["properties"]["order_id"]["maxLength"] == 7
    assert args["cancel_order"]["properties"]["order_id"]["maxLength"] == 12
    assert "maxLength" not in args["cancel_order"]["properties"]["reason"]
    assert TOOLS[0]["function"]["parameters"]["properties"]["order_id"] == {"type": "string"}  # input untouched
    with pytest.raises(ValueError, match="at least one tool"):
        call_schema([])


def test_grammar_accepts_canonical_calls_and_rejects_others(smollm2_tokenizer):
    import xgrammar as xgr

    compiled = compile_tool_grammar(smollm2_tokenizer, TOOLS)
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.accept_token(end) and m.is_terminated()

    call = ToolCall(name="cancel_order", arguments={"order_id": "#W1", "reason": "ordered by mistake"})
    assert accepts(render_call(call))  # the grammar writes what the chat template renders
    assert accepts("Sure, which order?")
    assert not accepts('<tool_call>\n{"name": "refund", "arguments": {}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "cancel_order", "arguments": {"order_id": "#W1"}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "list_all", "arguments": {"x": 1}}\n</tool_call>')
    assert not accepts("Sure <tool_call>")
    assert not accepts(" leading space")
    assert not accepts('{"name": "list_all", "arguments": {}}')


@pytest.mark.parametrize("require", [False, True])
def test_random_model_only_produces_valid_actions(policy, require):
    policy.grammar_options = {"max_string_chars": 10, "max_text_chars": 40, "require_tool_call": require}
    gens = []
    for seed in range(3):
        gens += policy.generate(CONVS, TOOLS, temperature=1.0, max_new_tokens=96, seed=seed, constrained=True)
    for g in gens:
        assert g.finish_reason == "stop", g.text
        assert g.message.invalid is None, (g.message.invalid, g.text)
        assert "<|im_end|>" not in g.text
    calls = [g for g in gens if g.message.tool_calls]
    if require:
        assert len(calls) == len(gens)
        assert {c.message.tool_calls[0].name for c in calls} > {"list_all"}
    else:
        assert all(not g.message.content.startswith(("<", "{", " ")) for g in gens if not g.message.tool_calls)


def test_greedy_constrained_is_deterministic_and_batch_independent(policy):
    policy.grammar_options = {"max_string_chars": 10, "max_text_chars": 40, "require_tool_call": True}
    kwargs = dict(temperature=0.0, max_new_tokens=96, seed=0, constrained=True)
    batch = policy.generate(CONVS[:3], TOOLS, **kwargs)
    single = [policy.generate([c], TOOLS, **kwargs)[0] for c in CONVS[:3]]
    assert [g.text for g in batch] == [g.text for g in single]
    assert all(g.message.tool_calls for g in batch)


def test_processor_works_with_hf_generate(policy, smollm2_tokenizer):
    prompts = [policy.render(c, TOOLS) for c in CONVS[:2]]
    tok = policy.tokenizer
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    proc = make_tool_call_processor(tok, TOOLS, vocab_size=policy._vocab_size(), require_tool_call=True,
                                    max_string_chars=10)
    torch.manual_seed(0)
    out = policy.model.generate(**enc, logits_processor=[proc], max_new_tokens=96, do_sample=True,
                                eos_token_id=policy.stop_ids[0], pad_token_id=policy.pad_id)
    for row in out[:, enc["input_ids"].shape[1]:]:
        text = tok.decode([t for t in row.tolist() if t not in policy.stop_ids])
        assert parse_assistant(text, TOOLS).tool_calls, text
    assert not any(proc.rejected)


def test_no_tools_means_plain_text_only(policy):
    policy.grammar_options = {"max_text_chars": 30}
    gens = policy.generate(CONVS[:2], [], temperature=1.0, max_new_tokens=40, seed=0, constrained=True)
    assert all(g.message.invalid is None and not g.message.tool_calls and len(g.text) <= 30 for g in gens)


def test_tool_call_can_be_required_per_row(policy):
    policy.grammar_options = {"max_string_chars": 10, "max_text_chars": 40}
    required = [True, False, True, False, True, False]
    gens = policy.generate(CONVS, TOOLS, temperature=1.0, top_p=1.0, max_new_tokens=48, seed=3,
                           constrained=True, require_tool_call=required)
    for flag, gen in zip(required, gens, strict=True):
        assert gen.message.invalid is None or gen.finish_reason == "length", gen.text
        if flag:
            assert gen.text.startswith("<tool_call>"), gen.text
    assert any(not g.text.startswith("<tool_call>") for g in gens), "free rows may answer in text"


def test_tools_with_shared_defs_compile(smollm2_tokenizer):
    """τ² airline's schemas reference pydantic `$defs`; they must survive being nested in anyOf."""
    tools = [{"type": "function", "function": {
        "name": "book", "description": "Book flights.",
        "parameters": {"type": "object", "$defs": {"Flight": {"type": "object", "properties": {
            "number": {"type": "string"}}, "required": ["number"]}},
            "properties": {"flights": {"type": "array", "items": {"$ref": "#/$defs/Flight"}}},
            "required": ["flights"]}}}]
    schema = call_schema(tools + TOOLS)
    assert schema["$defs"]["Flight"]["properties"]["number"]["maxLength"] > 0
    compile_tool_grammar(smollm2_tokenizer, tools + TOOLS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: the grammar's masking on a GPU against the same on CPU")
def test_cuda_constrained_decoding_equals_cpu(tiny_model_dir):
    greedy = {}
    for device in ("cpu", "cuda"):
        pol = load_policy(tiny_model_dir, dtype="float32", device=device)
        pol.grammar_options = {"max_string_chars": 10, "max_text_chars": 40, "require_tool_call": True}
        gens = pol.generate(CONVS, TOOLS, temperature=0.0, max_new_tokens=96, seed=0, constrained=True)
        sampled = pol.generate(CONVS, TOOLS, temperature=1.0, max_new_tokens=96, seed=5, constrained=True)
        assert all(g.message.tool_calls for g in gens), device
        assert all(g.message.invalid is None for g in sampled), device  # the mask holds on the GPU's draw too
        greedy[device] = [g.text for g in gens]
    assert greedy["cuda"] == greedy["cpu"]


def _bounded_mask(tokenizer, tools: list, prefix: str, max_text_chars: int) -> torch.Tensor:
    """The allowed tokens after `prefix` when the message rule is a bounded repetition (how the grammar
    bounded a message before the processor kept the bound); with `tools`, the union with the tool call."""
    import xgrammar as xgr

    from trace_lib.engine import grammar

    text = xgr.Grammar.from_ebnf(f'root ::= [^<{{ \\t\\r\\n] [^<]{{0,{max_text_chars - 1}}}')
    # the tool call part exactly as the module builds it (a required call has no message rule)
    rule = xgr.Grammar.union(grammar.tool_turn_grammar(tools, require_tool_call=True), text) if tools else text
    compiled = grammar._compiler(tokenizer, len(tokenizer)).compile_grammar(rule)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(prefix) if prefix else True
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask, 0)
    scores = torch.zeros(1, len(tokenizer))
    xgr.apply_token_bitmask_inplace(scores, bitmask)
    return scores[0].isfinite()


@pytest.mark.parametrize("tools", [[], TOOLS], ids=["text only", "with tools"])
@pytest.mark.parametrize(("prefix", "left"), [
    (prefix, left) for prefix in ["", "Sure", "Your order #W1 shipped", "Déjà vu, café", "Fine 👍 ok"]
    for left in [0, 1, 2, 5, 30] if len(prefix) + left >= 1])  # a message has at least one character
def test_message_bound_masks_the_tokens_a_bounded_grammar_masked(smollm2_tokenizer, tools, prefix, left):
    """The processor's message bound over the unbounded grammar allows exactly the tokens that the
    bounded repetition allowed, near the bound and away from it, with multi-byte characters too."""
    tok = smollm2_tokenizer
    bound = len(prefix) + left
    proc = make_tool_call_processor(tok, tools, vocab_size=len(tok), max_text_chars=bound)
    ids = tok(prefix, add_special_tokens=False)["input_ids"] if prefix else []
    scores = torch.zeros(1, len(tok))
    for i in range(len(ids) + 1):  # feed the prefix a token at a time, as a decoding loop does
        scores = proc(torch.tensor([ids[:i]], dtype=torch.long), torch.zeros(1, len(tok)))
    if prefix:
        assert proc.text_chars == [len(prefix)]
    assert torch.equal(scores[0].isfinite(), _bounded_mask(tok, tools, prefix, bound))


def test_message_bound_ignores_a_tool_call_and_narrow_logits(smollm2_tokenizer):
    """A row that opened a tool call is not a message; logits narrower than the vocabulary are masked on
    the columns they have; the vocabulary's character table is built once per tokenizer."""
    from trace_lib.engine.grammar import token_chars

    tok = smollm2_tokenizer
    assert token_chars(tok, len(tok)) is token_chars(tok, len(tok))
    proc = make_tool_call_processor(tok, TOOLS, vocab_size=len(tok), max_text_chars=3)
    call = tok('<tool_call>\n{"name": "list_all", "arguments": {}}', add_special_tokens=False)["input_ids"]
    for i in range(len(call) + 1):
        scores = proc(torch.tensor([call[:i]], dtype=torch.long), torch.zeros(1, len(tok) - 16))
    assert proc.text_chars == [None] and not proc.rejected[0]
    assert scores.shape[-1] == len(tok) - 16 and scores[0].isfinite().any()
    short = make_tool_call_processor(tok, [], vocab_size=len(tok), max_text_chars=2)
    ids = tok("Hi", add_special_tokens=False)["input_ids"]
    for i in range(len(ids) + 1):
        scores = short(torch.tensor([ids[:i]], dtype=torch.long), torch.zeros(1, len(tok) - 16))
    assert short.text_chars == [2]
    assert scores[0].isfinite().nonzero().flatten().tolist() == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_message_bound_holds_while_decoding(policy):
    """With tools, a message row stops within the bound; a tool call is not bounded by it."""
    policy.grammar_options = {"max_string_chars": 10, "max_text_chars": 12}
    gens = []
    for seed in range(4):
        gens += policy.generate(CONVS, TOOLS, temperature=1.0, max_new_tokens=64, seed=seed, constrained=True,
                                require_tool_call=[True, False] * 3)
    texts = [g for g in gens if not g.text.startswith("<tool_call>")]
    assert texts and all(len(g.text) <= 12 and g.finish_reason == "stop" for g in texts)
    assert any(g.message.tool_calls and g.finish_reason == "stop" for g in gens)  # calls are longer: not cut


def test_message_bound_must_be_positive(smollm2_tokenizer):
    with pytest.raises(ValueError, match="max_text_chars must be >= 1"):
        make_tool_call_processor(smollm2_tokenizer, TOOLS, max_text_chars=0)
