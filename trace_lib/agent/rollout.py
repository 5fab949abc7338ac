"""The episode loop: a policy plays many episodes of an environment at once (paper §3.1, first step).

Reads nothing from disk and writes nothing: `collect_rollouts` takes a policy (anything with the
`Generator` protocol, e.g. `trace_lib.engine.policy.Policy`), an environment factory and tasks, and
returns `Trajectory` records sorted by id (no timings inside, so the bytes repeat) plus the timing.
`summarize` turns trajectories into success rates with 95% Wilson intervals. The rollout, evaluate,
scaling and GEPA steps all play their episodes through here.

Episodes run concurrently: a pool of `batch_size` live episodes is decoded together, and a finished
episode's slot is refilled from the queue, so the batch stays full until the queue runs dry. With
trace's own engine (`rollout.continuous_batching`) that happens as each turn ends, inside one
`Policy.play_turns` call; otherwise between calls, one call per turn of the live episodes.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tqdm.auto import tqdm

from trace_lib.engine.adapters import canonical_weights, route_label
from trace_lib.config import RolloutConfig
from trace_lib.envs.base import Environment, EpisodeState
from trace_lib.records import Message, Task, Trajectory
from trace_lib.stats import wilson_interval


class Generator(Protocol):
    """What rollouts need from a policy (trace_lib.engine.policy.Policy satisfies it)."""

    policy_id: str

    def generate(self, conversations: list[list[Message]], tools: list[dict], *, temperature: float,
                 top_p: float, max_new_tokens: int, seed: int, constrained: bool,
                 require_tool_call: bool | list[bool] = False) -> list[Any]: ...


@dataclass
class _Episode:
    task: Task
    sample: int
    env: Environment
    prompt_tokens: int = 0
    completion_tokens: int = 0
    route: int = 0
    """Index of the weights it runs under (`collect_routed_rollouts`); 0 otherwise."""

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.task.id, self.sample, self.route)

    @property
    def state(self) -> EpisodeState:
        """The environment's episode state: the conversation so far and its counters."""
        assert self.env.state is not None, "episodes are created right after env.reset()"
        return self.env.state


@dataclass
class RolloutTiming:
    seconds: float = 0.0
    generate_seconds: float = 0.0
    completion_tokens: int = 0
    episodes: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.generate_seconds if self.generate_seconds else 0.0




class Progress:
    """Episodes done: tqdm's bar, or, with tqdm's bars off by environment (`TQDM_DISABLE`, as the stage notebooks
    set it), one summary line when closed."""

    def __init__(self, total: int, enabled: bool) -> None:
        quiet = os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true")
        self.summary = enabled and quiet
        self.bar = tqdm(total=total, desc="rollout", unit="episode", disable=not enabled or quiet)
        self.done = 0
        self.started = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()
        if self.summary:
            print(f"rollout: {self.done} episodes in {time.perf_counter() - self.started:.0f} s", flush=True)

def close_progress(bar: Any) -> None:
    bar.close()
    if bar.summary:
        print(f"rollout: {bar.n} episodes in {time.perf_counter() - bar.started:.0f} s", flush=True)

def episode_queue(tasks: Sequence[Task], samples_per_task: int) -> list[tuple[Task, int]]:
    """Every (task, sample index) pair in a fixed order."""
    return [(task, s) for task in tasks for s in range(samples_per_task)]


def _finish(ep: _Episode, policy_id: str, seed: int, adapter: str | None) -> Trajectory:
    reward, info = ep.env.reward()
    st = ep.state
    return Trajectory(
        id=f"{ep.task.id}#{ep.sample}", task_id=ep.task.id, env=ep.task.env, family=ep.task.family,
        split=ep.task.split, policy_id=policy_id, adapter=adapter, seed=seed, sample=ep.sample,
        messages=st.messages, reward=reward, success=reward >= 1.0, termination=st.termination or "",
        tool_calls=st.tool_calls, invalid_actions=st.invalid_actions, tool_errors=st.tool_errors,
        turns=st.steps, suspicious_turns=st.suspicious_turns, tool_faults=st.tool_faults,
        prompt_tokens=ep.prompt_tokens, completion_tokens=ep.completion_tokens,
        reward_info=info,
    )


def collect_rollouts(
    policy: Generator,
    env_factory: Callable[[], Environment],
    tasks: Sequence[Task],
    cfg: RolloutConfig,
    seed: int,
    adapter: str | None = None,
    progress: bool = True,
) -> tuple[list[Trajectory], RolloutTiming]:
    """Run every task `cfg.samples_per_task` times; returns trajectories sorted by id and timings."""
    queue = episode_queue(tasks, cfg.samples_per_task)
    queue.reverse()  # pop() from the end keeps the original order
    live: list[_Episode] = []
    done: list[Trajectory] = []
    timing = RolloutTiming(episodes=len(queue))
    t0 = time.perf_counter()
    bar = Progress(len(queue), progress)
    call = 0
    keeps_kv = hasattr(policy, "end_sessions")  # the embedded engine keeps each episode's KV across turns
    if cfg.continuous_batching and getattr(policy, "plays_turns", False):
        _play_continuously(policy, env_factory, queue, cfg, seed, adapter, done, timing, bar)
    while queue or live:
        while queue and len(live) < cfg.batch_size:
            task, sample = queue.pop()
            env = env_factory()
            env.reset(task)
            live.append(_Episode(task, sample, env))
        tools = live[0].env.tool_schemas()
        g0 = time.perf_counter()
        gens = policy.generate(
            [ep.state.messages for ep in live], tools, temperature=cfg.temperature, top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens, seed=seed * 1_000_003 + call, constrained=cfg.constrained,
            require_tool_call=[must_call(cfg.tool_choice, ep.env) for ep in live],
            **({"sessions": [ep.key for ep in live]} if keeps_kv else {}),
        )
        timing.generate_seconds += time.perf_counter() - g0
        call += 1
        still: list[_Episode] = []
        for ep, gen in zip(live, gens, strict=True):
            msg = _with_call_ids(gen.message, ep.state.steps)
            ep.prompt_tokens += gen.prompt_tokens
            ep.completion_tokens += gen.completion_tokens
            timing.completion_tokens += gen.completion_tokens
            result = ep.env.step(msg)
            if result.done:
                done.append(_finish(ep, policy.policy_id, seed, adapter))
                if keeps_kv:
                    policy.end_sessions([ep.key])
                bar.update(1)
            else:
                still.append(ep)
        live = still
    bar.close()
    timing.seconds = time.perf_counter() - t0
    return sorted(done, key=lambda t: t.id), timing


def collect_routed_rollouts(
    policy: Any,
    env_factory: Callable[[], Environment],
    jobs: Sequence[tuple[Task, Mapping[str, float]]],
    cfg: RolloutConfig,
    seed: int,
    progress: bool = True,
) -> tuple[list[list[Trajectory]], RolloutTiming]:
    """Every job's task `cfg.samples_per_task` times under the job's weights ({adapter: α}; {} the base
    model), all jobs in one continuously refilled batch whose rows run under different weights
    (`Policy.play_turns` with routes, `engine.row_lora`); returns each job's trajectories (sorted by id) and
    the timing. A trajectory's `adapter` and `policy_id` name its weights as `collect_rollouts` under
    `engine.compose.apply_route` names them. Needs trace's own engine (`Policy.plays_turns`)."""
    if not getattr(policy, "plays_turns", False):
        raise ValueError("collect_routed_rollouts needs trace's own engine (Policy.play_turns)")
    routes: list[dict[str, float]] = []
    index: dict[tuple, int] = {}  # by the weights themselves: two merges may share a label (6 digits)
    job_route = []
    for _, weights in jobs:
        key = tuple(canonical_weights(weights).items())
        if key not in index:
            index[key] = len(routes)
            routes.append(dict(key))
        job_route.append(index[key])
    labels = [route_label(r) for r in routes]
    seen: set[tuple[str, int]] = set()
    for (task, _), k in zip(jobs, job_route):
        if (task.id, k) in seen:
            raise ValueError(f"jobs repeat task {task.id!r} under the same weights {routes[k]}")
        seen.add((task.id, k))
    # the routes' episodes interleaved (round robin over the routes, each in its jobs' order), so that a batch
    # holds rows of every route in about equal numbers rather than one route's tasks after another's
    per_route: dict[int, list[tuple[Task, int, int]]] = defaultdict(list)
    for (task, _), k in zip(jobs, job_route):
        per_route[k] += [(task, s, k) for s in range(cfg.samples_per_task)]
    queue = [item for rank in range(max((len(v) for v in per_route.values()), default=0))
             for k in sorted(per_route) if rank < len(per_route[k]) for item in [per_route[k][rank]]]
    queue.reverse()
    done: list[Trajectory] = []
    done_routes: list[int] = []
    timing = RolloutTiming(episodes=len(queue))
    t0 = time.perf_counter()
    bar = Progress(len(queue), progress)
    if queue:
        ids = [policy.base_id if lab is None else f"{policy.base_id}+{lab}" for lab in labels]
        _play_continuously(policy, env_factory, queue, cfg, seed, None, done, timing, bar,
                           routes=routes, route_ids=list(zip(ids, labels)), done_routes=done_routes)
    bar.close()
    timing.seconds = time.perf_counter() - t0
    by_route: dict[tuple[int, str], list[Trajectory]] = defaultdict(list)
    for t, k in zip(done, done_routes, strict=True):
        by_route[(k, t.task_id)].append(t)
    return [sorted(by_route[(k, task.id)], key=lambda t: t.id) for (task, _), k in zip(jobs, job_route)], timing


def _play_continuously(policy: Any, env_factory: Callable[[], Environment], queue: list[tuple],
                       cfg: RolloutConfig, seed: int, adapter: str | None, done: list[Trajectory],
                       timing: RolloutTiming, bar: Any, routes: list[dict[str, float]] | None = None,
                       route_ids: list[tuple[str, str | None]] | None = None,
                       done_routes: list[int] | None = None) -> None:
    """`collect_rollouts` through one `Policy.play_turns` call: the queue refills a slot when its episode ends.
    Queue items are (task, sample), or (task, sample, route) with `routes` (each route's (policy id,
    adapter label) in `route_ids`; each finished episode's route appended to `done_routes`)."""
    from trace_lib.engine.decoding import NextTurn

    def start() -> _Episode:
        task, sample, *route = queue.pop()
        env = env_factory()
        env.reset(task)
        return _Episode(task, sample, env, route=route[0] if route else 0)

    def finish(ep: _Episode) -> Trajectory:
        if routes is None:
            return _finish(ep, policy.policy_id, seed, adapter)
        done_routes.append(ep.route)
        return _finish(ep, route_ids[ep.route][0], seed, route_ids[ep.route][1])

    slots = [start() for _ in range(min(cfg.batch_size, len(queue)))]
    tools = slots[0].env.tool_schemas()
    prompts: dict[int, list[int]] = {}

    def prompt(i: int) -> list[int]:
        prompts[i] = policy.encode(policy.render(slots[i].state.messages, tools))
        return prompts[i]

    def next_turn(i: int, toks: list[int], why: str) -> NextTurn | None:
        ep = slots[i]
        gen = policy.turn(ep.state.messages, tools, prompts[i], toks, why)
        ep.prompt_tokens += gen.prompt_tokens
        ep.completion_tokens += gen.completion_tokens
        timing.completion_tokens += gen.completion_tokens
        if not ep.env.step(_with_call_ids(gen.message, ep.state.steps)).done:
            return NextTurn(prompt(i), must_call(cfg.tool_choice, ep.env))
        done.append(finish(ep))
        policy.end_sessions([ep.key])
        bar.update(1)
        if not queue:
            return None
        slots[i] = start()
        return NextTurn(prompt(i), must_call(cfg.tool_choice, slots[i].env), slots[i].key,
                        None if routes is None else slots[i].route)

    processor = (policy.tool_processor(tools, len(slots), [must_call(cfg.tool_choice, ep.env) for ep in slots])
                 if cfg.constrained else None)
    g0 = time.perf_counter()
    stepping = policy.play_turns([prompt(i) for i in range(len(slots))], next_turn, temperature=cfg.temperature,
                                 top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, seed=seed * 1_000_003,
                                 sessions=[ep.key for ep in slots], processor=processor,
                                 **({} if routes is None else {"routes": routes,
                                                               "row_routes": [ep.route for ep in slots]}))
    timing.generate_seconds += time.perf_counter() - g0 - stepping  # the environments' turns are not generating


def must_call(tool_choice: str, env: Environment) -> bool:
    """Whether the agent's next turn must be a tool call under `rollout.tool_choice`."""
    if tool_choice == "required":
        return True
    return tool_choice == "first" and env.state is not None and env.state.steps == 0


def _with_call_ids(msg: Message, turn: int) -> Message:
    """Deterministic tool-call ids (call_<turn>_<i>) so tool results can point back at their call."""
    if not msg.tool_calls:
        return msg
    calls = [c.model_copy(update={"id": f"call_{turn}_{i}"}) for i, c in enumerate(msg.tool_calls)]
    return msg.model_copy(update={"tool_calls": calls})


def _rate(k: int, n: int) -> dict[str, float]:
    lo, hi = wilson_interval(k, n)
    return {"n": n, "successes": k, "success_rate": k / n if n else 0.0, "ci_low": lo, "ci_high": hi}


def summarize(trajectories: Sequence[Trajectory], group_by: str = "family") -> dict[str, Any]:
    """Success rate with a 95% Wilson interval overall and per group, tool calls, invalid actions,
    suspicious turns and tool faults (counts).

    Samples of the same task are counted as separate episodes, so with several samples per task
    the interval is narrower than a per-task interval would be.
    """
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        groups[str(getattr(t, group_by))].append(t)
    turns = sum(t.turns for t in trajectories)
    successes = [t for t in trajectories if t.success]
    return {
        **_rate(len(successes), len(trajectories)),
        "mean_tool_calls": sum(t.tool_calls for t in trajectories) / max(1, len(trajectories)),
        "mean_tool_calls_success": (sum(t.tool_calls for t in successes) / len(successes)) if successes else None,
        "invalid_action_rate": sum(t.invalid_actions for t in trajectories) / max(1, turns),
        "tool_error_rate": sum(t.tool_errors for t in trajectories) / max(1, sum(t.tool_calls for t in trajectories)),
        "suspicious_turns": sum(t.suspicious_turns for t in trajectories),
        "tool_faults": sum(t.tool_faults for t in trajectories),
        "terminations": dict(sorted(Counter(t.termination for t in trajectories).items())),
        f"by_{group_by}": {g: _rate(sum(t.success for t in ts), len(ts)) for g, ts in sorted(groups.items())},
    }
