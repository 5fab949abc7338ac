"""A synthesized environment module, run in a sandbox, as a trace `Environment` (and for TRL).

Reads a module through `trace_lib.sandbox.SandboxProcess` (never imports it) and the target
environment's tools and system prompt (`trace_lib.envs.make_env`); writes nothing. Paper §3.2: a
synthetic environment keeps the target's interface (the SAME tool schemas, read/write kinds and
system prompt), so what an adapter learns on it transfers; only the task generator, the world behind
the tools and the capability-specific verifier R_c come from the module.

* `SyntheticEnv`: the episode protocol of `trace_lib.envs.base` over the module. Tools and system
  prompt are the target's; the user is the scripted customer of `trace_lib.envs.user`; tool calls and
  scoring are sandbox requests. Several instances share one sandbox, one episode handle each.
* `synthetic_tasks` / `task_from_dict`: generator output -> `Task` records, with errors that name the
  offending field.
* `to_trl_environment_factory` / `trl_reward` / `trl_rows`: the same episodes in the shape of TRL's
  `GRPOTrainer(environment_factory=...)` (a class whose public methods are the tools, plus `reset`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from pydantic import ValidationError

from trace_lib.config import EnvConfig
from trace_lib.envs.base import Environment, ToolSpec
from trace_lib.envs.limits import ToolLimits
from trace_lib.envs.user import ScriptedUser
from trace_lib.records import Message, Task, ToolCall
from trace_lib.sandbox import SandboxError, SandboxProcess

TASK_FIELDS = ("instruction", "user", "required_outputs", "gold_actions", "meta")
"""What `generate_task` returns; `instruction` and `user` are required."""
OPTIONAL_TASK_FIELDS = ("capability_tags", "difficulty", "seed")
"""Also accepted; `seed` and `difficulty` must then repeat the requested values."""


class TaskFormatError(ValueError):
    """A generated task dict that does not make a `Task`; the message names the field."""


@lru_cache(maxsize=8)
def _target_env(cfg_json: str) -> Environment:
    from trace_lib.envs import make_env

    return make_env(EnvConfig.model_validate_json(cfg_json))


def target_env(cfg: EnvConfig) -> Environment:
    """One shared instance of the target environment, read for its tools and system prompt only."""
    return _target_env(cfg.model_dump_json())


# --- tasks -------------------------------------------------------------------------------------
def task_from_dict(data: Any, capability: str, seed: int, difficulty: int, split: str) -> Task:
    """The `Task` record of one `generate_task(seed, difficulty)` result (TaskFormatError if malformed)."""
    where = f"generate_task({seed}, {difficulty})"
    if not isinstance(data, dict):
        raise TaskFormatError(f"{where} returned {type(data).__name__}, expected a dict")
    unknown = [k for k in data if k not in TASK_FIELDS + OPTIONAL_TASK_FIELDS]
    if unknown:
        raise TaskFormatError(f"{where}: task field '{unknown[0]}' is not allowed "
                              f"(fields: {', '.join(TASK_FIELDS + OPTIONAL_TASK_FIELDS)})")
    for key in ("instruction", "user"):
        if key not in data:
            raise TaskFormatError(f"{where}: task field '{key}' is missing")
    for key, value in (("seed", seed), ("difficulty", difficulty)):
        if key in data and data[key] != value:
            raise TaskFormatError(f"{where}: task field '{key}' is {data[key]!r}, expected {value!r}")
    tags = data.get("capability_tags", [])
    if not isinstance(tags, list):
        raise TaskFormatError(f"{where}: task field 'capability_tags' must be a list")
    try:
        return Task(
            id=f"synth/{capability}/{seed}", env=f"synth:{capability}", split=split, family=capability,
            instruction=data["instruction"], user=data["user"], gold_actions=data.get("gold_actions", []),
            required_outputs=data.get("required_outputs", []), meta=data.get("meta", {}),
            capability_tags=[capability, *(t for t in tags if t != capability)], difficulty=difficulty, seed=seed,
        )
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise TaskFormatError(f"{where}: task field '{field}': {first['msg']}") from None


def synthetic_tasks(sandbox: SandboxProcess, capability: str, seeds: Iterable[int], difficulty: int,
                    split: str) -> list[Task]:
    """Generate one task per seed in the sandbox (SandboxError, TaskFormatError on failure)."""
    return [task_from_dict(sandbox.request("generate_task", seed=seed, difficulty=difficulty),
                           capability, seed, difficulty, split) for seed in seeds]


def task_payload(task: Task) -> dict[str, Any]:
    """The `task` argument the module's init_state / evaluate / solve receive: the whole record as JSON."""
    return task.model_dump(mode="json")


def trajectory_payload(messages: Sequence[Message], termination: str | None, tool_calls: int, tool_errors: int,
                       invalid_actions: int) -> dict[str, Any]:
    """The `trajectory` argument of the module's evaluate (see `trace_lib.synth_sdk`)."""
    return {"messages": [m.model_dump(mode="json") for m in messages], "termination": termination or "",
            "tool_calls": tool_calls, "tool_errors": tool_errors, "invalid_actions": invalid_actions}


# --- the environment ---------------------------------------------------------------------------
class SyntheticEnv(Environment):
    """The target's tools and prompt, the module's world and verifier, the scripted customer."""

    isolate_tools = False  # tools run in the sandbox worker, under its time and memory limits

    def __init__(self, sandbox: SandboxProcess, target_cfg: EnvConfig, *, max_steps: int | None = None,
                 max_errors: int | None = None, user_max_turns: int = 12) -> None:
        super().__init__(max_steps=max_steps or target_cfg.max_steps, max_errors=max_errors or target_cfg.max_errors,
                         tool_limits=ToolLimits.of(target_cfg))
        target = target_env(target_cfg)
        self.end_on_repeat = target_cfg.end_on_repeated_call
        self.sandbox = sandbox
        self.name = f"synth:{sandbox.meta.get('CAPABILITY')}"
        self.transfer_tools = target.transfer_tools
        self._target = target
        self._tools = list(target.tools)
        self.user_max_turns = user_max_turns
        self._user: ScriptedUser | None = None
        self._handle: str | None = None
        self._payload: dict[str, Any] = {}
        self._finalizer: weakref.finalize | None = None

    @property
    def tools(self) -> list[ToolSpec]:
        return self._tools

    def system_prompt(self, task: Task) -> str:
        return self._target.system_prompt(task)

    def _reset_state(self, task: Task) -> None:
        self.close()
        self._handle = self.sandbox.new_handle()
        self._payload = task_payload(task)
        self.sandbox.request("init", handle=self._handle, task=self._payload, release=self.sandbox.take_released())
        # An env dropped without close() (rollouts make one per episode) frees its world in the worker
        # on the next init; the finalizer only queues the handle, it never talks to the worker.
        self._finalizer = weakref.finalize(self, self.sandbox.release, self._handle)
        self._user = ScriptedUser(task.user, max_turns=self.user_max_turns)

    def _execute(self, call: ToolCall) -> tuple[str, bool]:
        reply = self.sandbox.request("call_tool", handle=self._handle, name=call.name, arguments=dict(call.arguments))
        return reply["text"], bool(reply["error"])

    def _score(self) -> tuple[float, dict[str, Any]]:
        st = self._require_state()
        trajectory = trajectory_payload(st.messages, st.termination, st.tool_calls, st.tool_errors,
                                        st.invalid_actions)
        verdict = self.sandbox.request("evaluate", handle=self._handle, trajectory=trajectory, task=self._payload)
        info: dict[str, Any] = {"evaluate": verdict["score"]}
        if verdict["steps"]:  # a multi-level verdict: its named items go into the record
            info["rubric"] = {"steps": verdict["steps"], "gates": verdict["gates"]}
        return verdict["score"], info

    def close(self) -> None:
        """Free this episode's world in the worker (the next init sends the release)."""
        if self._finalizer is not None:
            self._finalizer()  # queues the handle once
            self._finalizer = None
        self._handle = None


# --- TRL ---------------------------------------------------------------------------------------
_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "object": dict}


def _python_type(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if kind == "array":
        return list[_python_type(schema.get("items", {}))]
    return _JSON_TYPES.get(kind, str)


def _tool_method(spec: ToolSpec):
    """A method named like the tool, with a signature and Google docstring that transformers'
    `get_json_schema` turns back into the target's schema: names, types, required arguments and
    descriptions (whose line breaks a docstring folds into spaces; τ²'s titles are dropped)."""
    props: dict[str, Any] = spec.parameters.get("properties", {})
    required = set(spec.parameters.get("required", []))
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    hints: dict[str, Any] = {}
    lines = [" ".join(spec.description.split()), "", "Args:"]
    for name, schema in props.items():
        hint = _python_type(schema)
        if name not in required:
            hint = hint | None
        hints[name] = hint
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hint,
                                        default=inspect.Parameter.empty if name in required else None))
        lines.append(f"    {name}: {' '.join(str(schema.get('description', name)).split())}")

    def tool(self, **arguments: Any) -> str:
        return self._call(spec.name, {k: v for k, v in arguments.items() if v is not None or k in required})

    tool.__name__ = tool.__qualname__ = spec.name
    tool.__doc__ = "\n".join(lines if props else lines[:1])
    tool.__signature__ = inspect.Signature(params, return_annotation=str)
    tool.__annotations__ = {**hints, "return": str}
    return tool


class _TRLEpisode:
    """Base of the exported class: `reset` plus private helpers (TRL treats public methods as tools)."""

    sandbox: SandboxProcess
    target_cfg: EnvConfig
    capability: str
    difficulty: int

    def __init__(self) -> None:
        self._handle: str | None = None
        self._payload: dict[str, Any] = {}
        self._messages: list[Message] = []
        self._calls = self._errors = 0

    def reset(self, **kwargs: Any) -> str:
        """Start the episode of the dataset row: its `task` (a Task as JSON) or else its `seed`."""
        if "task" in kwargs and kwargs["task"] is not None:
            raw = kwargs["task"]
            task = Task.model_validate_json(raw) if isinstance(raw, str) else Task.model_validate(raw)
        else:
            task = synthetic_tasks(self.sandbox, self.capability, [int(kwargs["seed"])], self.difficulty, "train")[0]
        if self._handle is not None:
            self.sandbox.release(self._handle)
        self._handle = self.sandbox.new_handle()
        self._payload = task_payload(task)
        self.sandbox.request("init", handle=self._handle, task=self._payload, release=self.sandbox.take_released())
        opening = ScriptedUser(task.user).opening()
        self._messages = [Message(role="user", content=opening)]
        self._calls = self._errors = 0
        return opening

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        if self._handle is None:
            return "Error: the episode has not been reset"
        call = ToolCall(name=name, arguments=arguments, id=f"call_{self._calls}")
        self._calls += 1
        try:
            reply = self.sandbox.request("call_tool", handle=self._handle, name=name, arguments=arguments)
        except SandboxError as err:
            reply = {"text": f"Error: {err}", "error": True}
        self._errors += bool(reply["error"])
        self._messages += [Message(role="assistant", tool_calls=[call]),
                           Message(role="tool", name=name, tool_call_id=call.id, content=reply["text"],
                                   error=bool(reply["error"]))]
        return reply["text"]

    def _reward(self, final_text: str) -> float:
        """The module's verdict on the episode, the agent's final message included."""
        if self._handle is None:
            return 0.0
        messages = self._messages + ([Message(role="assistant", content=final_text)] if final_text else [])
        trajectory = trajectory_payload(messages, "agent_stop", self._calls, self._errors, 0)
        verdict = self.sandbox.request("evaluate", handle=self._handle, trajectory=trajectory, task=self._payload)
        return float(verdict["score"])


def to_trl_environment_factory(sandbox: SandboxProcess, target_cfg: EnvConfig, difficulty: int) -> type:
    """A class for `GRPOTrainer(environment_factory=cls)`: one method per target tool, plus `reset`.

    Instances share `sandbox`. Score episodes with `trl_reward` as a reward function; the dataset rows
    come from `trl_rows` (or carry a `seed` to generate the task at reset)."""
    capability = str(sandbox.meta.get("CAPABILITY"))
    namespace: dict[str, Any] = {spec.name: _tool_method(spec) for spec in target_env(target_cfg).tools}
    namespace.update(sandbox=sandbox, target_cfg=target_cfg, capability=capability, difficulty=difficulty,
                     __doc__=f"Synthetic environment '{capability}' (TRL environment_factory).")
    return type(f"SyntheticTRLEnv_{capability}", (_TRLEpisode,), namespace)


def trl_reward(completions: list[Any], environments: list[Any] | None = None, **kwargs: Any) -> list[float]:
    """TRL reward function: each environment's module verdict, given the completion's final message."""
    if environments is None:
        raise ValueError("trl_reward needs the trainer's environments (pass environment_factory)")
    rewards = []
    for completion, env in zip(completions, environments, strict=True):
        if isinstance(completion, list):
            finals = [m.get("content") or "" for m in completion if m.get("role") == "assistant" and not m.get("tool_calls")]
            text = finals[-1] if finals else ""
        else:
            text = str(completion)
        rewards.append(env._reward(text))
    return rewards


def trl_rows(tasks: Sequence[Task], target_cfg: EnvConfig) -> list[dict[str, Any]]:
    """Dataset rows for the TRL class: the target's system prompt, an empty user turn that `reset`
    fills with the customer's opening, and the task."""
    target = target_env(target_cfg)
    return [{"prompt": [{"role": "system", "content": target.system_prompt(t)}, {"role": "user", "content": ""}],
             "task": t.model_dump_json()} for t in tasks]
