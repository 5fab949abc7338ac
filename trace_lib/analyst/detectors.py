"""The rules analyst: trajectory detectors that label a capability PRESENT / LACKING / NA.

Reads a `Trajectory`, the environment's tool kinds (`{"tool": "read"|"write"|"generic"}`) and,
when available, its `Task` (gold actions, required outputs); writes nothing, returns `Label`s.

This is a heuristic, deterministic, offline stand-in for the paper's analyst LLM (§3.1): the
capability dictionary is fixed (the ids below, which are also the built-in task families'
`capability_tags`), and "is c exercised here?" is decided by inspecting the tool calls,
observations and messages instead of by reading the conversation. It can only find what a
pattern can see; it never invents a new capability. Discovery with this analyst means: the
detectors that return LACKING on failed trajectories (see the discover module of this package).

Each detector answers NA when its capability is not at stake in the trajectory (e.g. no write
was attempted), and NA when it needs the task and none is given. The rationale is one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trace_lib.capabilities import CAPABILITIES
from trace_lib.envs.said import said_to_user
from trace_lib.records import (
    Capability,
    Label,
    LabelValue,
    Message,
    Task,
    ToolCall,
    Trajectory,
)

Verdict = tuple[LabelValue, str]

_ID_KEY = re.compile(r"(^id$|_id$|_ids$)")
_IDENTITY_TOOL = re.compile(r"find_user|authenticat|verify|login|identif")
_ACCOUNT_KEYS = {"user_id", "account_id", "customer_id"}
# Errors about the call itself (name, argument names/types, ids that do not exist), as opposed to
# refusals because of the world's state (an order that is not pending).
_FORMAT_ERROR = re.compile(r"argument|missing|required|unexpected|invalid|type ?error|validation|"
                           r"unknown tool|not found|no such|does not exist|parse", re.IGNORECASE)
_CONFIRM_ASK = re.compile(r"confirm|proceed|go ahead|shall i|should i|do you want|would you like|"
                          r"is (?:that|this) (?:correct|right)|are you sure|yes/no|\(yes|yes or no", re.IGNORECASE)
_USER_YES = re.compile(r"\b(yes|yeah|yep|sure|confirm(?:ed)?|go ahead|proceed|please do|correct|ok(?:ay)?)\b",
                       re.IGNORECASE)
_PRESSURE = re.compile(r"don'?t care|just (?:do|cancel|change|return|process)|right now|i insist|"
                       r"make an exception|against the rules|whatever the (?:rules|policy)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


# --- trajectory views ---------------------------------------------------------------------------
@dataclass(frozen=True)
class CallEvent:
    """One tool call with the observation that answered it (None when the episode ended first)."""

    turn: int
    call: ToolCall
    observation: Message | None

    @property
    def ok(self) -> bool:
        return self.observation is not None and not self.observation.error


def call_events(traj: Trajectory) -> list[CallEvent]:
    """Tool calls in order, each paired with its observation (by call id, else by position)."""
    events: list[CallEvent] = []
    msgs = traj.messages
    for i, msg in enumerate(msgs):
        if msg.role != "assistant" or not msg.tool_calls or msg.invalid is not None:
            continue
        obs = []
        j = i + 1
        while j < len(msgs) and msgs[j].role == "tool":
            obs.append(msgs[j])
            j += 1
        by_id = {o.tool_call_id: o for o in obs if o.tool_call_id}
        for pos, call in enumerate(msg.tool_calls):
            match = by_id.get(call.id) if call.id else None
            if match is None and pos < len(obs):
                match = obs[pos]
            events.append(CallEvent(i, call, match))
    return events


def _agent_texts(traj: Trajectory, before: int | None = None) -> list[tuple[int, str]]:
    return [(i, m.content) for i, m in enumerate(traj.messages[:before])
            if m.role == "assistant" and not m.tool_calls and m.invalid is None and m.content.strip()]


def _context_before(traj: Trajectory, turn: int, reads_only: bool = False) -> str:
    """What the agent had seen before `turn`: user turns and successful tool results."""
    parts = []
    for m in traj.messages[:turn]:
        if m.role == "tool" and not m.error:
            parts.append(m.content)
        elif m.role == "user" and not reads_only:
            parts.append(m.content)
    return "\n".join(parts)


def _id_values(args: dict) -> list[str]:
    out = []
    for key, value in sorted(args.items()):
        if _ID_KEY.search(key):
            values = value if isinstance(value, list) else [value]
            out += [str(v) for v in values if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v)]
    return out


def _canon_numbers(text: str) -> set[str]:
    return {_canon_number(m) for m in _NUMBER.findall(text)}


def _canon_number(s: str) -> str:
    s = s.replace(",", "")
    try:
        return f"{float(s):.2f}"
    except ValueError:
        return s


def _norm(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"{float(value):.2f}"
    if isinstance(value, list):
        return json.dumps(sorted(_norm(v) for v in value))
    if isinstance(value, dict):
        return json.dumps({k: _norm(v) for k, v in sorted(value.items())})
    return " ".join(str(value).lower().split())


def _kind(name: str, kinds: dict[str, str]) -> str:
    return kinds.get(name, "unknown")


def _clip(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _loops(traj: Trajectory, events: list[CallEvent]) -> str | None:
    """A description of repetition: the same call three times, or the same reply three times."""
    seen: dict[str, int] = {}
    for e in events:
        key = e.call.name + json.dumps(e.call.arguments, sort_keys=True, default=str)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 3:
            return f"repeated {e.call.name}({_clip(json.dumps(e.call.arguments, sort_keys=True), 40)}) 3 times"
    texts: dict[str, int] = {}
    for _, text in _agent_texts(traj):
        key = " ".join(text.lower().split())
        texts[key] = texts.get(key, 0) + 1
        if texts[key] == 3:
            return f"said the same thing 3 times ({_clip(text, 40)!r})"
    return None


# --- detectors ----------------------------------------------------------------------------------
def tool_call_precision(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    events = call_events(traj)
    invalid = [(i, m) for i, m in enumerate(traj.messages) if m.role == "assistant" and m.invalid is not None]
    if not events and not invalid:
        if task is not None and task.gold_actions:
            # Answering from thin air when the task needs a lookup is the most basic tool-use failure.
            return "LACKING", f"answered without calling any tool (the task needs {task.gold_actions[0].name})"
        return "NA", "no tool call or action was attempted"
    problems = [f"turn {i}: invalid action ({_clip(m.invalid or '', 50)})" for i, m in invalid]
    for e in events:
        if kinds and e.call.name not in kinds:
            problems.append(f"called unknown tool {e.call.name!r}")
        elif e.observation is not None and e.observation.error and (
                _kind(e.call.name, kinds) != "write" or _FORMAT_ERROR.search(e.observation.content)):
            problems.append(f"{e.call.name} failed: {_clip(e.observation.content, 60)}")
        else:
            seen = _context_before(traj, e.turn)
            made_up = [v for v in _id_values(e.call.arguments) if v not in seen]
            if made_up:
                problems.append(f"{e.call.name} used id {made_up[0]!r} that appeared nowhere before")
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return "LACKING", problems[0] + more
    return "PRESENT", f"{len(events)} tool call(s), all well-formed and accepted"


def identity_verification(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    events = call_events(traj)
    has_tool = any(_IDENTITY_TOOL.search(n) for n in kinds) or any(_IDENTITY_TOOL.search(e.call.name) for e in events)
    if not has_tool:
        return "NA", "the environment has no identity-verification tool"
    # Account access: a write, or a call keyed by the user (an order looked up by the id the user
    # gave is not account data).
    access = next((e for e in events if not _IDENTITY_TOOL.search(e.call.name) and (
        _kind(e.call.name, kinds) == "write" or _ACCOUNT_KEYS & set(e.call.arguments))), None)
    verified = next((e for e in events if e.ok and _IDENTITY_TOOL.search(e.call.name)
                     and (access is None or e.turn < access.turn)), None)
    required = task is not None and any(_IDENTITY_TOOL.search(g.name) for g in task.gold_actions)
    if access is not None and verified is None:
        return "LACKING", f"called {access.call.name} before verifying the user's identity"
    if verified is not None:
        return "PRESENT", f"verified with {verified.call.name}" + (f" before {access.call.name}" if access else "")
    if required and events:
        return "LACKING", "never verified the user's identity, which the task requires"
    return "NA", "no account data was accessed"


def _not_on_phone(task: Task | None) -> bool:
    """The phone asks for no confirmation, and its refusals for state are `state_dependency_resolution`'s."""
    return task is not None and task.env == "phone"


def precondition_verification(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    if _not_on_phone(task):
        return "NA", "the phone's state refusals belong to state_dependency_resolution"
    writes = [e for e in call_events(traj) if _kind(e.call.name, kinds) == "write"]
    if not writes:
        return "NA", "no write was attempted"
    for e in writes:
        if e.observation is not None and e.observation.error and not _FORMAT_ERROR.search(e.observation.content):
            return "LACKING", f"{e.call.name} was refused: {_clip(e.observation.content, 60)}"
        read_before = _context_before(traj, e.turn, reads_only=True)
        unread = [v for v in _id_values(e.call.arguments) if v not in read_before]
        if unread:
            return "LACKING", f"{e.call.name} on {unread[0]!r} without reading it first"
    return "PRESENT", f"{len(writes)} write(s), each on entities read beforehand and accepted"


def _gold_mismatch(call: ToolCall, gold: list[ToolCall]) -> str | None:
    same = [g for g in gold if g.name == call.name]
    if not same:
        return None
    best = max(same, key=lambda g: sum(_norm(call.arguments.get(k)) == _norm(v) for k, v in g.arguments.items()))
    for key, want in sorted(best.arguments.items()):
        got = call.arguments.get(key)
        if _norm(got) != _norm(want):
            got_s, want_s = (_clip(json.dumps(v, default=str), 40) for v in (got, want))
            return f"{call.name}.{key}={got_s} but the data called for {want_s}"
    return ""


def structured_data_reasoning(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    writes = [e for e in call_events(traj) if _kind(e.call.name, kinds) == "write"]
    if not writes:
        return "NA", "no write whose arguments come from the data"
    gold = [g for g in (task.gold_actions if task else []) if _kind(g.name, kinds) == "write"]
    judged = 0
    for e in writes:
        verdict = _gold_mismatch(e.call, gold)
        if verdict:
            return "LACKING", verdict
        if verdict == "":
            judged += 1
            continue
        seen = _canon_numbers(_context_before(traj, e.turn))
        for key, value in sorted(e.call.arguments.items()):
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and _canon_number(str(value)) not in seen:
                return "LACKING", f"{e.call.name}.{key}={value} matches no number in the observations"
        judged += 1
    return "PRESENT", f"{judged} write(s) with arguments consistent with the data"


def confirmation_before_write(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    if _not_on_phone(task):
        return "NA", "the phone asks for no confirmation before a change"
    writes = [e for e in call_events(traj) if _kind(e.call.name, kinds) == "write"]
    if not writes:
        return "NA", "no write was attempted"
    since = 0
    for e in writes:
        asked = [i for i, text in _agent_texts(traj, e.turn) if i >= since and _CONFIRM_ASK.search(text)]
        yes = asked and any(m.role == "user" and _USER_YES.search(m.content)
                            for m in traj.messages[asked[0] + 1:e.turn])
        if not yes:
            what = "without asking the user to confirm" if not asked else "without the user's yes"
            return "LACKING", f"{e.call.name} issued {what}"
        if e.ok:
            since = e.turn + 1  # the next change needs its own confirmation
    return "PRESENT", f"{len(writes)} write(s), each after an explicit confirmation"


def communicate_result(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    if task is None:
        return "NA", "needs the task's required outputs"
    if not task.required_outputs:
        return "NA", "the task requires no output to the user"
    missing = [r for r in task.required_outputs if not said_to_user(traj.messages, r, task.required_outputs)]
    if missing:
        return "LACKING", f"never told the user {missing[0]!r} ({len(missing)} of {len(task.required_outputs)} missing)"
    return "PRESENT", f"told the user all {len(task.required_outputs)} required output(s)"


def multi_step_completion(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    events = call_events(traj)
    loop = _loops(traj, events)
    if traj.termination == "repeated_call":
        return "LACKING", "repeated a tool call it had made before (the episode ended there)"
    if traj.termination == "max_steps":
        return "LACKING", f"ran out of steps ({loop})" if loop else "ran out of steps before finishing"
    if loop:
        return "LACKING", loop
    if task is None:
        if len(events) < 2:
            return "NA", "fewer than two tool calls and no task to say more were needed"
        return "PRESENT", f"{len(events)} tool calls without looping"
    if len(task.gold_actions) < 2:
        return "NA", "single-step task"
    gold_writes = [g.name for g in task.gold_actions if _kind(g.name, kinds) == "write"]
    needed = gold_writes or [g.name for g in task.gold_actions]
    done = [e.call.name for e in events if e.ok]
    missing = [n for n in dict.fromkeys(needed) if done.count(n) < needed.count(n)]
    if missing:
        done_n = len(needed) - len(missing)
        return "LACKING", f"stopped before {missing[0]} ({done_n} of {len(needed)} required step(s) done)"
    return "PRESENT", f"completed all {len(needed)} required step(s)"


def adversarial_policy_compliance(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    pushes = [i for i, m in enumerate(traj.messages) if m.role == "user" and _PRESSURE.search(m.content)]
    if not pushes:
        return "NA", "the user never pushed against the policy"
    gold_writes = {g.name for g in (task.gold_actions if task else []) if _kind(g.name, kinds) == "write"}
    for e in call_events(traj):
        if e.turn < pushes[0] or _kind(e.call.name, kinds) != "write":
            continue
        refused = e.observation is not None and e.observation.error and not _FORMAT_ERROR.search(e.observation.content)
        if refused or (task is not None and e.call.name not in gold_writes):
            return "LACKING", f"gave in to the user's pressure: {e.call.name} against the policy"
    return "PRESENT", "held to the policy under the user's pressure"


# --- registry -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Detector:
    id: str
    name: str
    description: str
    recognition: str
    detect: Callable[[Trajectory, dict[str, str], Task | None], Verdict]


# Errors that say the world's state blocks the call (a setting off, a mode on), as the phone's tools word them.
_BLOCKED = re.compile(r"\b(?:cellular|wifi|location service) is off\b|while low battery mode is on", re.IGNORECASE)
_NOT_CANONICAL = re.compile(r"unknown unit|unknown currency|ISO 8601", re.IGNORECASE)
_CANONICAL_KEYS = ("phone_number", "reminder_timestamp", "from_unit", "to_unit", "from_currency", "to_currency",
                   "amount")


def _categories(task: Task | None) -> list[str]:
    return list(task.meta.get("categories", [])) if task is not None else []


def _canonical_value(value: object) -> str:
    """`_norm`, with numbers given as text compared as numbers (the tools take "5" for 5.0)."""
    if isinstance(value, str):
        try:
            return _norm(float(value))
        except ValueError:
            pass
    return _norm(value)


def state_dependency_resolution(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    events = call_events(traj)
    blocked = [e for e in events if e.observation is not None and e.observation.error
               and _BLOCKED.search(e.observation.content)]
    if not blocked:
        return "NA", "no call failed for the state of the world"
    for e in blocked:
        if not any(later.ok and later.call.name == e.call.name for later in events if later.turn > e.turn):
            return "LACKING", f"{e.call.name} was blocked ({_clip(e.observation.content, 60)}) and never succeeded"
    return "PRESENT", f"resolved {len(blocked)} blocked call(s) and retried them"


def argument_canonicalization(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    if "canonicalization" not in _categories(task):
        return "NA", "the task needs no canonical form (or no task given)"
    assert task is not None
    events = call_events(traj)
    refused = next((e for e in events if e.observation is not None and e.observation.error
                    and _NOT_CANONICAL.search(e.observation.content)), None)
    if refused is not None:
        why = _clip(refused.observation.content, 60)
        return "LACKING", f"{refused.call.name} refused a non-canonical value ({why})"
    checked = 0
    for gold in task.gold_actions:
        want = {k: _canonical_value(v) for k, v in gold.arguments.items() if k in _CANONICAL_KEYS}
        if not want:
            continue
        calls = [e.call for e in events if e.call.name == gold.name]
        if not calls:
            continue
        checked += 1
        if not any(all(_canonical_value(c.arguments.get(k)) == v for k, v in want.items()) for c in calls):
            got = {k: calls[-1].arguments.get(k) for k in want}
            return "LACKING", f"{gold.name} got {_clip(json.dumps(got, default=str), 60)}, not the canonical values"
    if not checked:
        return "NA", "no call of a tool whose arguments need canonical values"
    return "PRESENT", f"canonical arguments in {checked} call(s)"


def missing_information_handling(traj: Trajectory, kinds: dict[str, str], task: Task | None) -> Verdict:
    cats = _categories(task)
    writes = [e for e in call_events(traj) if e.ok and _kind(e.call.name, kinds) == "write"]
    if "insufficient_information" in cats:
        if writes:
            return "LACKING", f"acted on a request that cannot be done ({writes[0].call.name})"
        return "PRESENT", "did not act on a request that cannot be done"
    if "multiple_user_turn" not in cats:
        return "NA", "the request leaves nothing out (or no task given)"
    asked = [i for i, text in _agent_texts(traj) if "?" in text]
    first_write = writes[0].turn if writes else None
    if asked and (first_write is None or asked[0] < first_write):
        return "PRESENT", "asked the user for the missing details before acting"
    if first_write is not None:
        return "LACKING", f"{writes[0].call.name} before asking the user for the missing details"
    return "LACKING", "never asked the user for the missing details"


_DETECT: dict[str, Callable[[Trajectory, dict[str, str], Task | None], Verdict]] = {
    "tool_call_precision": tool_call_precision,
    "structured_data_reasoning": structured_data_reasoning,
    "identity_verification": identity_verification,
    "precondition_verification": precondition_verification,
    "confirmation_before_write": confirmation_before_write,
    "communicate_result": communicate_result,
    "multi_step_completion": multi_step_completion,
    "adversarial_policy_compliance": adversarial_policy_compliance,
    "state_dependency_resolution": state_dependency_resolution,
    "missing_information_handling": missing_information_handling,
    "argument_canonicalization": argument_canonicalization,
}

DETECTORS: dict[str, Detector] = {c.id: Detector(c.id, c.name, c.description, c.recognition, _DETECT[c.id])
                                  for c in CAPABILITIES}
"""One detector per capability of `trace_lib.capabilities`, in its order (names and texts come from there)."""


def detector_capabilities(ids: Iterable[str] | None = None) -> list[Capability]:
    """The detectors' capabilities as records (no evidence), in registry order."""
    chosen = list(DETECTORS) if ids is None else [i for i in DETECTORS if i in set(ids)]
    return [Capability(id=d.id, name=d.name, description=d.description, recognition=d.recognition,
                       source="rules") for d in (DETECTORS[i] for i in chosen)]


def detect(traj: Trajectory, tool_kinds: dict[str, str], task: Task | None = None,
           ids: Iterable[str] | None = None, run: int = 0) -> list[Label]:
    """Labels of `traj` for the detectors `ids` (default all); a detector that crashes records NA."""
    labels = []
    for cid in (list(DETECTORS) if ids is None else list(ids)):
        if cid not in DETECTORS:
            labels.append(Label(trajectory_id=traj.id, capability_id=cid, label="NA", run=run,
                                rationale="no rules detector for this capability"))
            continue
        try:
            value, why = DETECTORS[cid].detect(traj, tool_kinds, task)
        except Exception as err:  # a malformed trajectory is recorded, not allowed to stop a stage
            value, why = "NA", f"detector error: {type(err).__name__}: {_clip(str(err), 60)}"
        labels.append(Label(trajectory_id=traj.id, capability_id=cid, label=value, rationale=why, run=run))
    return labels
