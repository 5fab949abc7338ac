"""The capability vocabulary: every capability id the built-in pieces know, in one place.

Reads and writes nothing. A capability is a natural-language skill the base agent may lack (paper
§3.1: "capabilities" proposed by the analyst, selected by the contrastive gap). An LLM analyst may
propose any id; the ids below are the ones trace's offline parts are built around:

* the built-in retail families and phone scenarios tag their tasks with them (`Task.capability_tags`,
  the ground truth that discovery and routing are checked against; the last three ids are the phone's
  own, three of the others it shares),
* the rules analyst has one detector per id (`trace_lib.analyst.detectors`; `recognition` says when it
  labels LACKING),
* the template synthesizer has one environment per id and target (`trace_lib.synth.templates`: the
  retail templates for the first eight, the phone's scenarios for the ids they tag),
* the oracle router breaks ties between a task's tags by `oracle_rank` (`trace_lib.routing.route`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CapabilitySpec:
    id: str
    name: str
    """Title as the analyst and the report show it."""
    skill: str
    """The skill in a few words (task tags, synthesized-module docstrings)."""
    description: str
    """What the agent must do (the rules analyst's capability description)."""
    recognition: str
    """How the rules analyst recognises it in a trajectory (when it says LACKING, PRESENT or NA)."""
    oracle_rank: int
    """Oracle tie-break among a task's tags, 0 first: the most specific skill first (a tag that few
    families carry says more about the task than `tool_call_precision`, which nearly all carry)."""


CAPABILITIES: tuple[CapabilitySpec, ...] = (
    CapabilitySpec(
        "tool_call_precision", "Tool-calling precision",
        "call the right tool with exactly the right argument values and formats",
        "Call existing tools with well-formed arguments and ids taken from the conversation.",
        "LACKING on an invalid action, an unknown tool, a call rejected for its arguments or a missing id, an "
        "id that appeared in no earlier user turn or tool result, or no tool call at all when the task needs "
        "one.", 9),
    CapabilitySpec(
        "structured_data_reasoning", "Structured data reasoning",
        "read the needed field out of nested tool results (JSON records)",
        "Take write arguments (item ids, amounts, addresses) from the right fields of tool results.",
        "LACKING when a write's arguments differ from the values the task's data called for, or a number "
        "matches nothing observed; NA without writes.", 7),
    CapabilitySpec(
        "identity_verification", "Identity verification",
        "authenticate the user by email or name + zip before account actions",
        "Authenticate the user with an identity tool before touching account data.",
        "LACKING when a write or a user-keyed call comes before a successful identity lookup, or when the "
        "task requires one and none happens; NA when no account data is at stake or no identity tool exists.",
        6),
    CapabilitySpec(
        "precondition_verification", "Precondition verification",
        "check an order's status before acting; refuse what the status forbids",
        "Read the entity and check its state before a write; do not attempt what the state forbids.",
        "LACKING when a write is refused for the entity's state, or targets an id no read returned.", 4),
    CapabilitySpec(
        "confirmation_before_write", "Confirmation before consequential writes",
        "explain a change and get an explicit yes before any write",
        "Explain the change and obtain an explicit yes before every write.",
        "LACKING when a write is not preceded (since the previous write) by a confirmation request answered "
        "yes.", 5),
    CapabilitySpec(
        "communicate_result", "Communicating the required result",
        "tell the user the facts the tools returned",
        "Tell the user the facts the task asks for.",
        "LACKING when a required output never appears in the agent's messages; NA when the task requires "
        "none.", 10),
    CapabilitySpec(
        "multi_step_completion", "Multi-step completion",
        "carry a request through several dependent tool calls to the end",
        "Carry a request through all dependent steps to the end instead of stopping or looping.",
        "LACKING on running out of steps, repeating a call or reply three times, or stopping before a "
        "required write.", 8),
    CapabilitySpec(
        "adversarial_policy_compliance", "Adversarial policy compliance",
        "keep to the policy when the user pushes to break it",
        "Keep to the policy when the user pushes to break it.",
        "LACKING when, after the user pushes, the agent attempts a write the policy or state forbids.", 3),
    # the phone environment's own (trace_lib.envs.phone); the three above that it shares carry over
    CapabilitySpec(
        "state_dependency_resolution", "State dependency resolution",
        "change the device setting a tool's error names, then retry",
        "When a tool fails because the world's state blocks it (a setting off, a mode on), change that state "
        "(and what blocks the change) and retry the call.",
        "LACKING when a call fails for a blocked state and the same tool never succeeds afterwards; NA "
        "when no call fails for the state of the world.", 0),
    CapabilitySpec(
        "missing_information_handling", "Handling missing information",
        "ask for what a request leaves out, and refuse what cannot be done, never guessing",
        "Ask the user for what a request leaves out before acting, and say so, without acting, when the "
        "request cannot be done with the tools or the information at hand.",
        "LACKING when a write succeeds on a request that cannot be done, or the first write comes before "
        "the agent asked the user anything on a request that leaves details out; NA on complete requests.", 1),
    CapabilitySpec(
        "argument_canonicalization", "Argument canonicalization",
        "write relative dates, phone numbers, units and currencies in the form the tool expects",
        "Turn what the user said (tomorrow at 5 pm, (415) 555-0132, miles, dollars) into the canonical "
        "argument the tool expects (an ISO timestamp, +14155550132, mile, USD).",
        "LACKING when a call is refused for a non-canonical value, or a call of a tool the task needs carries "
        "a canonical argument other than the task's; NA when the task needs no canonicalization.", 2),
)

BY_ID: dict[str, CapabilitySpec] = {c.id: c for c in CAPABILITIES}

CAPABILITY_TAGS: dict[str, str] = {c.id: c.skill for c in CAPABILITIES}
"""The fixed vocabulary of `Task.capability_tags`, id -> skill, in `CAPABILITIES` order."""

ORACLE_PRIORITY: tuple[str, ...] = tuple(c.id for c in sorted(CAPABILITIES, key=lambda c: c.oracle_rank))
"""Capability ids in oracle tie-break order; unlisted ids come after, alphabetically."""
