"""One meaning of "the agent said X": the reward, the synthesized environments and the analyst agree."""

from __future__ import annotations

import pytest

from trace_lib import synth_sdk
from trace_lib.analyst.detectors import detect
from trace_lib.envs.said import normalize_text, output_found, rival_values, said_to_user, texts_said
from trace_lib.records import Message, Task, ToolCall, Trajectory, UserScenario

CASES = [
    ("1234.50", "That is $1,234.50.", True),
    ("1234.5", "The total was 1234.50 dollars", True),
    ("536.65", "You paid $536.65 in total.", True),
    ("100.00", "It cost 100 dollars", True),
    ("$100", "It cost $100.", True),
    ("100", "You paid 1000", False),
    ("100", "It cost 1000 dollars", False),
    ("Delivered", "your order was DELIVERED.", True),
    ("pending", "it is not processed", False),
    ("delivered", "it is undelivered", False),
    # an answer naming several candidates of the required value's kind does not say it
    ("delivered", "Your order is delivered or pending.", False),
    ("processed", "It has been processed and delivered.", False),
    ("cancelled", "The status of order #W1 is cancelled and the item details are listed.", True),
    ("delivered", "Your order is delivered, so it cannot be cancelled: only pending orders can be.", True),
    ("536.65", "You paid $536.65: $500.00 for the items and 36.65 for shipping.", False),
    ("536.65", "Order #W4817420 (zip 78234) cost 536.65 in total.", True),
    ("1234.5", "That is $1,234.50, paid in full.", True),
    ("Porto", "It ships to Porto, 12.50 km away.", True),
    ("delivered", "The order is not delivered.", False),
    ("delivered", "It isn't delivered yet... sorry, it is delivered.", True),
    ("263958857111", "Order #W4794911 has tracking number 263958857111.", True),
    ("263958857111", "You have 263958857111 and 9534205511.", False),
    ("263958857111", "Tracking 263958857111, shipped to zip 78234.", True),
]


@pytest.mark.parametrize("required,text,found", CASES)
def test_output_matching(required, text, found):
    assert output_found(required, [text]) is found


def test_normalize_text():
    assert normalize_text("Total: $1,234.50 and 3.00 and 7") == "total: $1234.5 and 3 and 7"


def _trajectory(text: str) -> Trajectory:
    msgs = [Message(role="system", content="policy"), Message(role="user", content="status of #W1?"),
            Message(role="assistant", content="", tool_calls=[ToolCall(name="get_order_details",
                                                                          arguments={"order_id": "#W1"})]),
            Message(role="tool", name="get_order_details", content='{"status": "delivered"}'),
            Message(role="assistant", content=text)]
    return Trajectory(id="t", task_id="task", env="retail", family="f", split="train", policy_id="p", seed=0,
                      messages=msgs, reward=0.0, success=False, termination="user_stop", tool_calls=1,
                      invalid_actions=0, tool_errors=0, turns=len(msgs), prompt_tokens=0, completion_tokens=0)


@pytest.mark.parametrize("required,text,found", CASES)
def test_reward_sdk_and_analyst_agree(required, text, found):
    """The analyst's communicate_result label is PRESENT exactly when the reward's matcher finds the
    output; before the matcher was shared, 'You paid 1000' counted as saying '100' for the analyst."""
    traj = _trajectory(text)
    task = Task(id="task", env="retail", split="train", family="f", instruction="i",
                user=UserScenario(reason_for_call="help"), required_outputs=[required])
    (label,) = detect(traj, {"get_order_details": "read"}, task, ids=["communicate_result"])
    as_dict = {"messages": [m.model_dump(mode="json") for m in traj.messages]}
    assert said_to_user(traj.messages, required) is found
    assert synth_sdk.said(as_dict, required) is found
    assert label.label == ("PRESENT" if found else "LACKING")


def test_only_plain_agent_turns_count():
    msgs = [Message(role="user", content="the total is 45"),
            Message(role="assistant", content="45", tool_calls=[ToolCall(name="x", arguments={})]),
            Message(role="assistant", content="45", invalid="not a tool call"),
            Message(role="tool", name="x", content="45"),
            Message(role="assistant", content="It was 46.")]
    assert texts_said(msgs) == ["It was 46."]
    assert not said_to_user(msgs, "45") and said_to_user(msgs, "46")
    assert texts_said([m.model_dump(mode="json") for m in msgs]) == ["It was 46."]


def test_a_hedge_in_one_message_does_not_spoil_a_clear_answer_in_another():
    msgs = [Message(role="assistant", content="It is pending or delivered, let me check."),
            Message(role="assistant", content="Your order is delivered.")]
    assert said_to_user(msgs, "delivered")
    assert not said_to_user(msgs[:1], "delivered")


def test_rival_values_by_kind():
    assert rival_values("delivered", normalize_text("Delivered, not cancelled; pending orders can be cancelled")) == [
        "cancelled"]
    assert rival_values("12.5", "$12.50 or $13 or 12.50 or 7.00") == ["13", "7"]
    assert rival_values("porto", "porto or lisbon") == []
    assert output_found("12.5", ["12.50 or 13.00"], strict=False) and not output_found("12.5", ["12.50 or 13.00"])


def test_the_tasks_other_required_values_are_no_rivals():
    text = ["You paid 746.59 in total; the Garden Hose cost 102.90."]
    assert not output_found("746.59", text)
    assert output_found("746.59", text, ["746.59", "102.90"]) and output_found("102.9", text, ["746.59", "102.90"])
    assert not output_found("746.59", ["You paid 746.59; the hose cost 102.90, or 5.00."], ["746.59", "102.90"])
    msgs = [Message(role="assistant", content="Order #W1 is delivered and order #W2 is pending.")]
    assert said_to_user(msgs, "delivered", ["delivered", "pending"]) and not said_to_user(msgs, "delivered")
