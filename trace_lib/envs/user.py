"""A deterministic scripted customer for retail-style episodes (the user simulator of τ²-bench).

Reads a `UserScenario` (records.py) and nothing else; writes nothing. τ²-bench simulates the
customer with an LLM; the paper's target environments do the same. On CPU we replace that LLM with a
script so that rollouts are cheap and the same seed gives the same conversation. The script is
generic over `UserScenario`, so it also plays customers parsed from τ²-bench tasks.

How the script reads an agent turn (keyword matching on lower-cased text, no model):

* The turn is split into sentences. A sentence is a *request* when it ends in '?' or contains an
  imperative request cue ("please provide", "i need your", ...). Fields are only revealed in
  answer to requests, so a final answer that merely mentions "your order" does not make the user recite data.
* A request sentence with a confirmation cue ("yes/no", "shall I", "do you want me to", "proceed",
  "confirm that", ...) is a confirmation request: answered "yes" or "no" per `scenario.confirm`,
  except that a change of a kind the user never asked for (`ACTION_WORDS`: cancelling when the
  user only asked for a status, say) is always declined, as a real customer would.
* Otherwise each `known_info` key is revealed when one of its keywords appears in a request
  sentence. Keywords come from `FIELD_KEYWORDS` (matched on parts of the key: a key containing
  "zip" uses the zip keywords, "order" the order-id keywords, ...); any other key is matched on its
  own words ("gift_card" -> "gift card").
* A requested field the user does not know is answered "I don't know"; `unknown_info` entries are
  never stated. When the agent asks for an email the user does not have, the user offers name and
  zip instead if it knows them (τ²-bench's fallback authentication).
* The user stops (`UserTurn(stop=True)`) when the agent gives a final answer (a turn with no request
  at all), asks "anything else?", says it cannot help, or transfers; and after `max_turns` replies.
* "Let me check" style turns get "Okay." and the episode goes on; an unmatched question gets the
  reason for the call once more, then "I don't know".
"""

from __future__ import annotations

import re

from trace_lib.envs.base import UserTurn
from trace_lib.records import UserScenario

FIELD_KEYWORDS: dict[str, tuple[str, ...]] = {
    "email": ("email", "e-mail", "mail address"),
    "name": ("name",),
    "zip": ("zip", "postal", "postcode"),
    "order": ("order id", "order number", "order #", "order no", "which order", "order's id", "order ids"),
    "address": ("address", "street", "city", "state", "country"),
    "item": ("item", "product", "which one"),
    "payment": ("payment", "card", "paypal", "refund to", "pay with"),
    "reason": ("reason", "why"),
    "phone": ("phone", "number to reach"),
    # the phone environment's fields (trace_lib.envs.phone)
    "recipient": ("who is", "who's", "who should", "who do", "who would", "whom", "recipient", "which contact",
                  "send it to", "send the message to"),
    "message": ("what should", "what would you like", "message say", "content", "what message", "the message",
                "text say", "what do you want"),
    "reminder": ("remind", "reminder about", "what would you like"),
    "time": ("when", "what time", "which time", "what date", "which date", "which day"),
}
"""Keywords per field family; a `known_info` key uses every family whose name it contains."""

REQUEST_CUES = (
    "please provide", "please share", "please give", "please tell", "please let me know",
    "please confirm your", "provide your", "provide the", "may i have", "tell me your",
    "i need your", "i'll need", "i will need", "need your", "let me know your", "share your",
    "give me your", "please enter", "please type",
)
"""Imperative requests; questions are recognised by their '?' (weak cues such as "which" or
"what is" also occur in final answers, where they must not keep the conversation going)."""
EXPLICIT_CONFIRM_CUES = ("yes/no", "yes or no", "(yes", "is that correct", "is this correct", "is that right",
                         "is this right", "are you sure", "do you confirm")
"""Cues that make a request a confirmation whatever else it asks."""
CONFIRM_CUES = (
    *EXPLICIT_CONFIRM_CUES, "would you like me to", "do you want me to", "shall i", "should i",
    "may i proceed", "can i proceed", "proceed", "go ahead", "confirm that", "confirm the",
    "confirm this", "confirm if", "confirm whether", "please confirm.",
)
"""Cues of a request to go ahead (the explicit ones, and offers a wh-question can turn into a detail
question: `is_confirmation_request`)."""
ACTION_WORDS: dict[str, tuple[str, ...]] = {
    "cancel": ("cancel",),
    "return": ("return",),
    "exchange": ("exchange", "swap"),
    "modify": ("modify", "address"),
    "transfer": ("transfer",),
}
"""Kinds of change a confirmation can be about; the user only agrees to kinds it called about."""
CLOSING_CUES = ("anything else", "is there anything", "something else", "any other")
GIVE_UP_CUES = (
    "cannot help", "can't help", "unable to help", "not able to help", "cannot assist",
    "can't assist", "unable to assist", "not able to assist", "transfer you", "transferring you",
    "human agent", "transfer to a human",
)
WAIT_CUES = (
    "let me check", "let me look", "let me find", "let me verify", "let me see", "one moment",
    "just a moment", "please wait", "i will check", "i'll check", "i will look", "i'll look",
)

# Split after sentence punctuation followed by space, so "a.b@x.com?" and "536.65" stay whole.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_NAME_PARTS = ("first_name", "last_name")


def split_sentences(text: str) -> list[str]:
    """Lower-cased sentences, each keeping its final punctuation (so questions stay visible)."""
    return [s.strip() for s in _SENTENCE_END.split(text.lower()) if s.strip()]


def is_request(sentence: str) -> bool:
    return sentence.endswith("?") or any(cue in sentence for cue in REQUEST_CUES)


# A wh-word shortly before an offer ("who should I send it to?", "which order would you like me to
# cancel?", "sure - what would you like me to say?") asks for a detail; the words between carry no
# comma, so "what do you think, should I go ahead?" stays a confirmation.
_DETAIL_QUESTION = re.compile(r"\b(?:who|whom|what|which|when|where)(?:\s+[^\s,;:]+){0,3}?\s+"
                              r"(?:should i|shall i|would you like me to|do you want me to|want me to)\b")


def is_confirmation_request(sentence: str) -> bool:
    """A yes/no request to go ahead. A wh-question about the offer ("who should I send it to?") asks for a
    detail instead, unless it also says yes/no outright."""
    if not is_request(sentence):
        return False
    if any(cue in sentence for cue in EXPLICIT_CONFIRM_CUES):
        return True
    return any(cue in sentence for cue in CONFIRM_CUES) and not _DETAIL_QUESTION.search(sentence)


def actions_in(text: str) -> set[str]:
    text = re.sub(r"e-?mail address", "email", text)
    return {a for a, words in ACTION_WORDS.items() if any(w in text for w in words)}


def field_keywords(key: str) -> tuple[str, ...]:
    """The words that, in a request, ask for the field `key` (see FIELD_KEYWORDS)."""
    k = key.lower()
    words: list[str] = []
    for family, kws in FIELD_KEYWORDS.items():
        if family in k:
            words.extend(kws)
    if not words:
        words.append(k.replace("_", " ").strip())
    return tuple(dict.fromkeys(words))


def requested_keys(sentences: list[str], keys: list[str]) -> list[str]:
    """The keys (in the given order) whose keywords appear in a request sentence."""
    asked = [s for s in sentences if is_request(s) and not is_confirmation_request(s)]
    # "email address" must not read as a request for a postal address.
    asked_no_email = [re.sub(r"e-?mail address", "email", s) for s in asked]
    return [k for k in keys if any(w in s for s in asked_no_email for w in field_keywords(k))]


_LABELS = {"zip": "zip code", "order_id": "order id", "email": "email"}
_PERSONAL = ("email", "name", "zip", "phone", "birth")


def _label(key: str) -> str:
    return _LABELS.get(key, key.replace("_", " ").strip())


def _statement(key: str, value: str) -> str:
    """'My email is ...' for facts about the person, 'The order id is ...' for everything else."""
    owner = "My" if any(p in key.lower() for p in _PERSONAL) else "The"
    return f"{owner} {_label(key)} is {value}."


class ScriptedUser:
    """A customer that follows `scenario` by keyword rules; see the module docstring."""

    def __init__(self, scenario: UserScenario, max_turns: int = 12) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.scenario = scenario
        self.max_turns = max_turns
        self.turns = 0
        self.confirmations = 0
        """How many times the user said yes to a confirmation request (environments read it to
        tell whether a write was confirmed)."""
        self.refusals = 0
        self.revealed: set[str] = set()
        self._restated = False

    def opening(self) -> str:
        """The first user message: the reason for the call, as the scenario words it."""
        return self.scenario.reason_for_call.strip()

    def reply(self, agent_text: str) -> UserTurn:
        """The user's answer to one agent message (a turn with no tool calls)."""
        self.turns += 1
        sentences = split_sentences(agent_text or "")
        text = " ".join(sentences)
        if any(cue in text for cue in GIVE_UP_CUES):
            return UserTurn("Okay, thank you. Goodbye.", stop=True)
        requests = [s for s in sentences if is_request(s)]
        if not requests and any(cue in text for cue in WAIT_CUES):
            return self._limited(UserTurn("Okay."))
        if not requests:
            return UserTurn("Thank you, that's all I needed. Goodbye.", stop=True)
        if any(cue in s for s in requests for cue in CLOSING_CUES):
            return UserTurn("No, that's all. Thank you, goodbye.", stop=True)

        parts: list[str] = []
        confirm_asks = [s for s in requests if is_confirmation_request(s)]
        if confirm_asks:
            wanted = actions_in(self.scenario.reason_for_call.lower() + " " + self.scenario.task_instructions.lower())
            offered = actions_in(" ".join(confirm_asks))
            if offered - wanted:
                parts.append("No, I don't want that.")
            elif self.scenario.confirm:
                self.confirmations += 1
                parts.append("Yes, please go ahead.")
            else:
                self.refusals += 1
                parts.append("No, please don't do that.")
        parts.extend(self._reveal(sentences))
        if not parts:
            if not self._restated:
                self._restated = True
                parts.append(self.opening())
            else:
                parts.append("I'm not sure. Could you please help me with my request?")
        return self._limited(UserTurn(" ".join(parts)))

    # --- helpers ------------------------------------------------------------------------------
    def _limited(self, turn: UserTurn) -> UserTurn:
        """Backstop: the user hangs up once the turn limit is reached."""
        if self.turns >= self.max_turns and not turn.stop:
            return UserTurn(turn.content + " I have to go now, goodbye.", stop=True)
        return turn

    def _reveal(self, sentences: list[str]) -> list[str]:
        known = self.scenario.known_info
        keys = requested_keys(sentences, list(known))
        # Asked for an email the user lacks: offer name and zip, τ²-bench's other way to log in.
        email_asked = bool(requested_keys(sentences, ["email"]))
        if email_asked and "email" not in known:
            fallback = [k for k in ("first_name", "last_name", "zip") if k in known]
            keys = list(dict.fromkeys(keys + fallback))
        out: list[str] = []
        if email_asked and "email" not in known:
            out.append("I don't remember my email address.")
        if all(p in keys for p in _NAME_PARTS):
            out.append(f"My name is {known['first_name']} {known['last_name']}.")
        for key in keys:
            if key in _NAME_PARTS and all(p in keys for p in _NAME_PARTS):
                continue
            out.append(_statement(key, known[key]))
        self.revealed.update(keys)
        for entry in self._unknown_requested(sentences):
            if email_asked and "email" in entry.lower():
                continue
            words = entry.split()
            out.append(f"Sorry, I don't know my {entry}." if len(words) <= 4 else "Sorry, I don't have that information.")
        return out

    def _unknown_requested(self, sentences: list[str]) -> list[str]:
        return requested_keys(sentences, [u for u in self.scenario.unknown_info if u not in self.scenario.known_info])
