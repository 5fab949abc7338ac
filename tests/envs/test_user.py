"""The scripted customer: reveals what it knows on request, never what it does not, confirms, stops."""

import pytest

from trace_lib.envs.user import ScriptedUser, field_keywords, is_confirmation_request, split_sentences
from trace_lib.records import UserScenario


def scenario(**kw) -> UserScenario:
    base = dict(
        reason_for_call="Hi, I want to cancel my order #W1234567.",
        known_info={"first_name": "Ann", "last_name": "Lee", "zip": "12345",
                    "order_id": "#W1234567", "reason": "no longer needed"},
        unknown_info=["email"],
    )
    base.update(kw)
    return UserScenario(**base)


def test_opening_is_reason_for_call():
    assert ScriptedUser(scenario()).opening() == "Hi, I want to cancel my order #W1234567."


def test_reveals_requested_fields_only():
    user = ScriptedUser(scenario())
    turn = user.reply("Sure. What is the order id?")
    assert "#W1234567" in turn.content and not turn.stop
    assert "Ann" not in turn.content and "12345." not in turn.content
    turn = user.reply("Please provide your first name, last name and zip code.")
    assert "My name is Ann Lee." in turn.content and "My zip code is 12345." in turn.content
    assert user.revealed == {"order_id", "first_name", "last_name", "zip"}


def test_unknown_email_falls_back_to_name_and_zip_and_never_leaks():
    secret = "ann.lee@example.com"
    user = ScriptedUser(scenario(unknown_info=["email"]))
    turn = user.reply("Could you give me your email address?")
    assert "don't remember my email" in turn.content
    assert "Ann Lee" in turn.content and "12345" in turn.content
    for text in ["What is your email?", "Please provide your email.", "Email please?"]:
        assert secret not in user.reply(text).content
    # "email address" is not a request for the (unknown) postal address either
    user2 = ScriptedUser(scenario(known_info={"email": secret, "new_address": "1 Main St"}, unknown_info=[]))
    turn = user2.reply("What is your email address?")
    assert secret in turn.content and "1 Main St" not in turn.content


def test_unknown_field_answered_with_dont_know():
    user = ScriptedUser(scenario(known_info={"item": "Desk Lamp"}, unknown_info=["item id"]))
    turn = user.reply("Which item would you like to return? What is the item id?")
    assert "The item is Desk Lamp." in turn.content
    assert "don't know my item id" in turn.content


@pytest.mark.parametrize("confirm,answer", [(True, "Yes"), (False, "No")])
def test_confirmation_follows_scenario(confirm, answer):
    user = ScriptedUser(scenario(confirm=confirm))
    turn = user.reply("I will cancel order #W1234567 with reason 'no longer needed'. Do you want me to proceed (yes/no)?")
    assert turn.content.startswith(answer) and not turn.stop
    assert user.confirmations == (1 if confirm else 0)
    assert "no longer needed" not in turn.content  # a confirmation is not a request for the reason


@pytest.mark.parametrize("sentence,confirmation", [
    ("should i proceed?", True), ("shall i cancel order #w1?", True), ("do you want me to cancel it?", True),
    ("how about i go ahead and send it now?", True), ("how does that sound, shall i proceed?", True),
    ("when you're ready, shall i send it?", True), ("what do you think, should i go ahead?", True),
    ("what would you like me to do: proceed with cancelling order #w1234567 (yes/no)?", True),
    ("do you want me to send it to priya, who is your friend?", True),
    ("who should i send it to?", False), ("what would you like me to say?", False),
    ("which order would you like me to cancel?", False), ("okay, when should i set the reminder?", False),
    ("sure, i can help with that — who should i send it to?", False), ("to whom should i send it?", False),
    ("can you tell me who should i send it to?", False), ("your order is pending.", False),
])
def test_yes_no_confirmations_and_detail_questions(sentence, confirmation):
    assert is_confirmation_request(sentence) is confirmation


@pytest.mark.parametrize("question,key,value", [
    ("Who should I send it to?", "recipient", "Priya"),
    ("What would you like me to say in the message?", "message", "Running late"),
    ("Okay, when should I set the reminder?", "reminder_time", "tomorrow at 9"),
    ("Which order would you like me to cancel?", "order_id", "#W1234567"),
])
def test_an_open_question_with_a_confirmation_cue_asks_for_a_detail(question, key, value):
    """'who/what/when should I ...?' wants a detail, not a yes: the user tells it and confirms nothing."""
    user = ScriptedUser(scenario(known_info={key: value}, reason_for_call="Please send a text for me."))
    turn = user.reply(question)
    assert value in turn.content and not turn.content.startswith("Yes") and user.confirmations == 0
    assert not turn.stop


@pytest.mark.parametrize("text", [
    "Your order #W1234567 has been cancelled. The refund takes 5-7 business days.",
    "The status of your order is delivered, which means it has arrived.",
    "Your order is pending. Is there anything else I can help you with?",
    "I'm sorry, I cannot help with that.",
    "I am transferring you to a human agent.",
])
def test_stops_after_final_answer_or_give_up(text):
    turn = ScriptedUser(scenario()).reply(text)
    assert turn.stop


def test_wait_turn_and_unmatched_question_keep_going():
    user = ScriptedUser(scenario())
    assert user.reply("Let me check that for you.").content == "Okay."
    assert user.reply("How can I help you today?").content == scenario().reason_for_call
    second = user.reply("How can I help you today?")
    assert not second.stop and "help me" in second.content


def test_turn_limit_is_a_backstop():
    user = ScriptedUser(scenario(), max_turns=3)
    turns = [user.reply("What is the order id?") for _ in range(3)]
    assert [t.stop for t in turns] == [False, False, True]
    with pytest.raises(ValueError, match="max_turns"):
        ScriptedUser(scenario(), max_turns=0)


def test_deterministic_and_generic_over_keys():
    sc = scenario(known_info={"gift_card_code": "GC-9", "order_id": "#W1"}, unknown_info=[])
    a, b = ScriptedUser(sc), ScriptedUser(sc)
    texts = ["What is your gift card code?", "And the order number?", "Thanks, all done."]
    assert [a.reply(t) for t in texts] == [b.reply(t) for t in texts]
    assert "gift card" in field_keywords("gift_card_code")[0]
    assert split_sentences("Is it a.b@x.com? Total is 536.65. OK") == ["is it a.b@x.com?", "total is 536.65.", "ok"]


def test_declines_changes_it_did_not_ask_for():
    user = ScriptedUser(scenario(reason_for_call="What is the status of my order #W1?", known_info={}))
    turn = user.reply("Your order is pending. Would you like me to cancel it?")
    assert turn.content.startswith("No") and user.confirmations == 0
    canceller = ScriptedUser(scenario())
    turn = canceller.reply("I will cancel the order; the refund goes to your card. Shall I proceed with this change?")
    assert turn.content.startswith("Yes") and canceller.confirmations == 1
    mover = ScriptedUser(scenario(reason_for_call="Please change the shipping address of order #W1 to 1 Main St."))
    assert mover.reply("I'll update the address to 1 Main St. Is that correct?").content.startswith("Yes")
