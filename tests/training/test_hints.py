"""The hint swap's pure parts: which samples are guided, the guidance text, where it goes."""

from __future__ import annotations

import pytest

from trace_lib.records import Message, Task, ToolCall, UserScenario
from trace_lib.training.hints import (
    HINT_CLOSE,
    HINT_OPEN,
    MAX_HINT_STEPS,
    hint_from_steps,
    hinted_samples,
    reference_steps,
    with_hint,
)


@pytest.mark.parametrize(("k", "fraction", "expected"), [
    (4, 0.0, []), (4, 0.25, [3]), (4, 0.5, [2, 3]), (4, 0.9, [1, 2, 3]), (2, 0.5, [1]), (8, 0.25, [6, 7]),
    (16, 0.05, [15]),  # any positive fraction guides at least one rollout ...
    (2, 0.99, [1]),  # ... and never all of them
])
def test_hinted_samples_are_the_last_share_of_a_group(k, fraction, expected):
    assert hinted_samples(k, fraction) == expected


def test_hint_text_spells_out_reference_steps_in_order():
    steps = [{"tool": "get_order_details", "arguments": {"order_id": "#W1"}},
             {"say": "Your order   #W1 is\n delivered."}]
    assert hint_from_steps(steps) == ('A correct way to handle this: (1) call get_order_details with '
                                      '{"order_id": "#W1"}. (2) tell the customer: "Your order #W1 is delivered.".')
    assert hint_from_steps([{"name": "f", "arguments": {}}]) == "A correct way to handle this: (1) call f with {}."


@pytest.mark.parametrize("steps", [None, [], "solve me", [1, "x", {"tool": ""}, {"arguments": {}}],
                                   [{"tool": "f", "arguments": {"x": object()}}]])
def test_no_usable_step_gives_no_hint(steps):
    assert hint_from_steps(steps) is None


def test_long_references_are_cut():
    text = hint_from_steps([{"tool": f"t{i}", "arguments": {}} for i in range(MAX_HINT_STEPS + 3)])
    assert f"({MAX_HINT_STEPS}) call t{MAX_HINT_STEPS - 1}" in text and f"({MAX_HINT_STEPS + 1})" not in text


def test_a_target_tasks_reference_is_its_gold_actions_then_its_outputs():
    task = Task(id="t", env="retail", split="train", family="f", instruction="i",
                user=UserScenario(reason_for_call="r"), gold_actions=[ToolCall(name="get", arguments={"id": 1})],
                required_outputs=["42", "blue"])
    assert reference_steps(task) == [{"tool": "get", "arguments": {"id": 1}}, {"say": "The answer: 42, blue"}]


def test_the_hint_goes_into_the_last_user_turn_only():
    opening = [Message(role="system", content="policy"), Message(role="user", content="Where is my order?")]
    out = with_hint(opening, "look it up")
    assert out[0] == opening[0] and opening[1].content == "Where is my order?"
    assert out[1].content == f"Where is my order?\n\n{HINT_OPEN}look it up{HINT_CLOSE}"
    with pytest.raises(ValueError, match="no user turn"):
        with_hint([Message(role="system", content="policy")], "x")
