"""Records passed between stages: one typed schema each, stored as JSON/JSONL.

Every stage reads and writes these and nothing else, so the contracts between stages live here.
Each record carries `schema_version`; a file written by an older layout fails validation loudly
instead of being half-read. Records forbid unknown fields for the same reason.

    Task              one episode's specification (user scenario, gold actions, required outputs)
    ToolCall/Message  the conversation, in the chat-template message format
    Trajectory        one rollout of a policy on a task (paper: an element of D+ or D-)
    Capability        a natural-language skill proposed by the analyst (paper §3.1)
    Label             PRESENT / LACKING / NA for one trajectory x capability
    CapabilityScore   N±, E±, ER±, Δ, coverage, CI and the keep decision
    SyntheticEnvManifest, AdapterManifest, EvalResult   outputs of synthesis, training, evaluation
    Check, ValidationReport   the sandboxed verdict on one synthesized module (in its manifest)
    RouteDecision     what the router decided for one task (evaluate writes them, scaling reads them)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1


class Record(BaseModel):
    """Base for every stored record: strict fields, versioned."""

    model_config = ConfigDict(extra="forbid", frozen=False)
    schema_version: int = SCHEMA_VERSION


class ToolCall(BaseModel):
    """A function call as chat templates and TRL represent it."""

    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None


class Message(BaseModel):
    """One chat turn. `invalid` holds the parse error when an agent turn was not a valid action."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    invalid: str | None = None
    """For assistant turns: why the raw text was not a valid action (None when it was)."""
    suspicious: str | None = None
    """For assistant turns that imitate the chat protocol (markup such as `<tool_response>`): why. Such a turn is
    also `invalid`."""
    error: bool = False
    """For tool turns: the tool refused the call (bad arguments, failed precondition, unknown tool)."""


class UserScenario(BaseModel):
    """What the simulated customer knows and wants (τ²-bench's user scenario, flattened)."""

    model_config = ConfigDict(extra="forbid")
    reason_for_call: str
    known_info: dict[str, str] = Field(default_factory=dict)
    """Fields the user reveals when asked, e.g. {"email": ..., "order_id": ...}."""
    unknown_info: list[str] = Field(default_factory=list)
    """Things the user does not know and must never state."""
    task_instructions: str = ""
    confirm: bool = True
    """How the user answers a request for explicit confirmation."""


class Task(Record):
    id: str
    env: str
    split: str
    family: str
    instruction: str
    """One-paragraph statement of the user's goal (what a human reader sees)."""
    user: UserScenario
    gold_actions: list[ToolCall] = Field(default_factory=list)
    required_outputs: list[str] = Field(default_factory=list)
    """Strings that must appear in the agent's messages to the user (τ²'s COMMUNICATE check)."""
    capability_tags: list[str] = Field(default_factory=list)
    difficulty: int = 0
    seed: int | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class Trajectory(Record):
    id: str
    task_id: str
    env: str
    family: str
    split: str
    policy_id: str
    """Model id plus adapter, e.g. 'smollm2-135m' or 'smollm2-135m+precondition_verification'."""
    adapter: str | None = None
    seed: int
    sample: int = 0
    messages: list[Message]
    reward: float
    success: bool
    termination: str
    """Why the episode ended: 'user_stop', 'agent_stop', 'max_steps', 'max_errors', 'transfer'."""
    tool_calls: int
    invalid_actions: int
    tool_errors: int
    turns: int
    suspicious_turns: int = 0
    """Agent turns that imitate the chat protocol (`Message.suspicious`; each also an invalid action)."""
    tool_faults: int = 0
    """Tool calls stopped by the limits (timeout, crash) or cut by the output cap; also tool errors."""
    prompt_tokens: int
    completion_tokens: int
    seconds: float | None = None
    """Wall time; left None in cached artifacts so the same seed gives the same bytes
    (timings go to metrics and logs instead)."""
    reward_info: dict[str, Any] = Field(default_factory=dict)


class Capability(Record):
    id: str
    name: str
    description: str
    recognition: str = ""
    """How to recognise, in a trajectory, whether the capability was exercised."""
    evidence: list[str] = Field(default_factory=list)
    """Trajectory ids the capability was proposed from."""
    source: str = ""


LabelValue = Literal["PRESENT", "LACKING", "NA"]


class Label(Record):
    trajectory_id: str
    capability_id: str
    label: LabelValue
    rationale: str = ""
    run: int = 0


class CapabilityScore(Record):
    capability_id: str
    n_pos: int
    n_neg: int
    e_pos: int
    e_neg: int
    er_pos: float | None
    er_neg: float | None
    delta: float | None
    coverage: float | None
    delta_ci: tuple[float, float] | None = None
    kept: bool
    kept_runs: int = 0
    n_runs: int = 1
    reason: str = ""


class SyntheticEnvManifest(Record):
    capability_id: str
    source: str
    path: str
    sha256: str
    target_env: str
    validation: dict[str, Any] = Field(default_factory=dict)
    difficulty: dict[str, Any] = Field(default_factory=dict)
    valid: bool
    reason: str = ""
    """Why no environment was installed (empty when valid)."""
    attempts: int = 0
    calibration: dict[str, Any] = Field(default_factory=dict)
    """The calibration against the base model (`training.calibrate.calibrate`'s result; empty when not run)."""


class AdapterManifest(Record):
    capability_id: str
    path: str
    base_model: str
    env_sha256: str
    backend: str
    rollouts_used: int
    iterations: int
    final_reward: float | None = None
    config: dict[str, Any] = Field(default_factory=dict)


class EvalResult(Record):
    method: str
    env: str
    split: str
    n: int
    successes: int
    success_rate: float
    ci_low: float
    ci_high: float
    rollouts_budget: int = 0
    mean_tool_calls: float | None = None
    invalid_action_rate: float | None = None
    by_group: dict[str, dict[str, float]] = Field(default_factory=dict)


class Check(BaseModel):
    """One named validation check and its verdict."""

    model_config = ConfigDict(extra="forbid")
    name: str
    ok: bool
    detail: str = ""


class ValidationReport(BaseModel):
    """The verdict on one module: every check run, in order, and the first that failed."""

    model_config = ConfigDict(extra="forbid")
    valid: bool
    checks: list[Check]
    failed: str | None = None
    capability: str | None = None


RouteMode = Literal["argmax", "top_p"]
RouterName = Literal["logits", "calibrated", "knn"]
NONE_ROUTE = "none"
"""The route to the base model alone: no adapter (the router's option, the oracle's and the tables')."""


class RouteDecision(BaseModel):
    """What the router decided for one task, with the evidence (stored next to eval trajectories)."""

    model_config = ConfigDict(extra="forbid")
    task_id: str = ""
    mode: RouteMode
    candidates: list[str]
    """Capability ids in label order (after retrieval, if any)."""
    labels: list[str]
    """One per candidate, then the none-label."""
    probs: list[float]
    """The router's probabilities, aligned with `labels` (sum to 1): the softmax over the label tokens'
    logits (`logits`), the same divided by the label prior (`calibrated`), or kNN vote shares (`knn`)."""
    label_mass: float | None = None
    """Full-vocabulary probability of the label tokens: how well the model kept to the format (None: knn)."""
    router: RouterName = "logits"
    """Which router produced `probs` (`trace_lib.routing.route`, `trace_lib.routing.routers`)."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Adapter -> α. Empty: base model; {c: 1.0}: adapter c alone; otherwise a weighted merge."""

    @property
    def base_weight(self) -> float:
        """The base model's share (the none-label's mass when kept): 1 − Σ α."""
        return max(0.0, 1.0 - sum(self.weights.values()))

    @property
    def adapter(self) -> str | None:
        """The single adapter when the decision is one adapter at full weight, else None."""
        if len(self.weights) == 1:
            (name, w), = self.weights.items()
            if w == 1.0:
                return name
        return None
