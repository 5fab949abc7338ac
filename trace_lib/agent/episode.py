"""Episodes as token ids: the loop that plays training, calibration and transfer-check episodes (paper §3.3).

Reads nothing on disk and writes nothing. An `Episode` is one rollout recorded as what training needs:
`prompt_ids` (the opening, system + first user turn, rendered with the tool chat template), then
`completion_ids` (the agent's turns and, between them, the environment's replies with the next generation
prompt), `agent_mask` (1 on the agent's tokens, 0 on the environment's), each agent turn's span and whether it
was only reads, how each turn came about (`turn_records`: finish reason, sampled or scripted, seconds), and the
reference steps played for the agent before its first turn (`preplayed`). `training/grpo.py`
turns recorded episodes into GRPO batches; it never decodes.

* `start_episode` opens one: from the task's opening, after reference steps the environment plays for the agent
  (`preplayed_opening`, a late start), and with a guided opening to sample from while the trained sequence
  starts from the unguided one (the hint swap).
* `play` decodes the live episodes to their end, batched per tool set, on one adapter or under several at once
  (per-row routes), with continuous batching where the engine has it.
* `play_reference` plays a reference solution as the agent's turns, each step's tokens the template's rendering
  of that message (`reference_turn_ids`): the tokens the policy emits when it samples the same message.

Every turn, sampled or scripted, goes through `apply_turn`: the environment steps on the parsed message and
the turn's tokens and the reply are appended. The episode is decoded from these ids (`Policy.generate_ids`
or `Policy.play_turns` on concatenated ids, never a re-rendered conversation), so each agent turn is trained in
exactly the context it was sampled in. Paper: "earlier tool results truncated in training prompts". A tool
result is cut to `tool_result_tokens` once the agent's next turn turns out to be one the loss skips (a
lookup-only turn), before the turn after that is sampled: a result the next trained turn reads (the one
before an answer or a write) stays whole, and the turns after a cut result are sampled from the cut sequence
they are trained on (`cut_before_skipped_turn`).

An episode lasts at most its environment's `max_steps` agent turns (the trainer lowers it to
`train.max_steps_per_episode`); as in every env, an episode cut off by a limit scores 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from trace_lib.agent.rollout import must_call
from trace_lib.config import TrainConfig
from trace_lib.engine.chat import parse_assistant
from trace_lib.engine.policy import Policy
from trace_lib.envs.base import Environment
from trace_lib.io import dumps_json
from trace_lib.records import Message, Task, ToolCall

TRUNCATION_MARK = " ...[truncated]"
TURN_END = "<|im_end|>"


@dataclass(frozen=True)
class TurnRecord:
    """How one agent turn came about (`Episode.turn_records`, one per entry of `Episode.turns`)."""

    finish: str
    """'stop' (the turn ended itself) or 'length' (cut at `max_new_tokens`); a scripted turn is 'stop'."""
    scripted: bool
    """Whether the turn was played from a script (a reference solution's step), not sampled."""
    seconds: float
    """Wall time from the turn being asked for to its tokens arriving (0 for a scripted turn)."""


@dataclass(frozen=True)
class PendingReply:
    """An environment reply at the end of an episode's sequence, in full, and the messages that replace it when it
    is cut (rendered only then: most replies stay whole)."""

    start: int
    """Where its tokens start in completion_ids (they run to the end)."""
    context_at: int
    """Where its messages start in the episode's context (they run to the end; the agent's turn before them)."""
    cut_messages: list[Message]


@dataclass
class Episode:
    """One rollout as token ids: the opening, then agent turns and environment text alternating."""

    source: str
    seed: int
    sample: int
    env: Environment
    prompt_ids: list[int]
    context: list[Message]
    """The conversation as trained on (results a skipped turn followed cut to `tool_result_tokens`)."""
    completion_ids: list[int] = field(default_factory=list)
    agent_mask: list[int] = field(default_factory=list)
    """1 on tokens the policy generated, 0 on the environment's text."""
    turns: list[tuple[int, int, bool]] = field(default_factory=list)
    """Agent turns as (start, end, lookup_only) spans of completion_ids."""
    turn_records: list[TurnRecord] = field(default_factory=list)
    """How each of `turns` came about: its finish reason, sampled or scripted, its seconds."""
    pending: PendingReply | None = None
    """The last environment reply, whole at the end of completion_ids until the next turn says whether it
    stays so (`cut_before_skipped_turn`)."""
    sample_prompt_ids: list[int] | None = None
    """The opening the episode is played from when it differs from the trained `prompt_ids` (the
    hint swap: the opening with expert guidance; the guidance is not in the trained sequence)."""
    preplayed: int = 0
    """Reference steps the environment played for the agent before its first turn (`train.start_late`; a
    greeting the environment opens with is not one)."""
    env_reward: float = 0.0
    rubric: dict[str, Any] | None = None
    """The environment's multi-level verdict ({"steps", "gates"}), when it gives one."""
    reward: float = 0.0
    success: bool = False
    reference: bool = False
    """Whether the agent's turns are the task's reference solution (`play_reference`), not sampled."""

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.source, self.seed, self.sample)

    def sampling_ids(self) -> list[int]:
        """What the agent's next turn is sampled from: the sequence as it will be trained (the latest reply
        whole), from the opening it is played with."""
        opening = self.prompt_ids if self.sample_prompt_ids is None else self.sample_prompt_ids
        return opening + self.completion_ids

    @property
    def hinted(self) -> bool:
        return self.sample_prompt_ids is not None

    @property
    def tool_calls(self) -> int:
        assert self.env.state is not None
        return self.env.state.tool_calls

    @property
    def agent_tokens(self) -> int:
        return sum(self.agent_mask)


def truncate_text(tokenizer: Any, text: str, max_tokens: int) -> str:
    """`text` cut to its first `max_tokens` tokens (plus a marker) when longer."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]) + TRUNCATION_MARK


def _lookup_only(msg: Message, kinds: dict[str, str]) -> bool:
    return msg.invalid is None and bool(msg.tool_calls) and all(kinds.get(c.name) == "read" for c in msg.tool_calls)


PlayedStep = ToolCall | str
"""A reference step the environment plays for the agent: a read-tool call, or a message to the user."""


def leading_steps(steps: Sequence[Any], kinds: dict[str, str] | None = None) -> list[PlayedStep]:
    """The steps of a reference solution that may be played for the agent (`train.start_late`): its tool
    calls ({"tool"|"name", "arguments"}) and messages ({"say": text}) up to its first malformed step or, with
    the environment's tool `kinds`, its first call that is not a read. A question asked before that write
    (a confirmation) is played and the user answers it; otherwise the last message (the answer, at the end or
    before a malformed step) is left out, so the agent always has its own part to play."""
    played: list[PlayedStep] = []
    for step in steps:
        if not isinstance(step, dict):
            break
        name, args = step.get("tool", step.get("name")), step.get("arguments", {})
        if name is None and "say" in step:  # a message (a step naming a tool is a call, as the validator reads it)
            text = step["say"]
            if not isinstance(text, str) or not text.strip():
                break
            played.append(text)
            continue
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            break
        if kinds is not None and kinds.get(name) != "read":
            return played  # stopped by a write: what was said before it is a question to the user
        played.append(ToolCall(name=name, arguments=args))
    return played[:-1] if played and isinstance(played[-1], str) else played


def _replay(env: Environment, task: Task, actions: Sequence[Message]) -> bool:
    """Reset to `task` and take `actions`; False when one fails (a refused call) or ends the episode."""
    env.reset(task)
    for action in actions:
        result = env.step(action)
        if result.done or any(o.error for o in result.observations):
            return False
    return True


def preplayed_opening(env: Environment, task: Task, steps: Sequence[PlayedStep]) -> tuple[list[Message], int]:
    """The opening of `task` followed by `steps` played one per assistant turn (a call with its result, a
    message with the user's reply): the environment's conversation after them, which it is left in, and how
    many steps were played.

    Of the calls, only reads are played, and nothing from the first call that is not one, or from the first
    step that the environment refuses or that would end the episode: a write played for the agent would be
    unconfirmed (retail scores that 0), and a failed step would teach from a broken start. The steps played
    count as the episode's turns (`max_steps`), their calls as its tool calls."""
    kinds = env.tool_kinds()
    env.reset(task)
    actions: list[Message] = []
    for turn, step in enumerate(steps):
        if isinstance(step, str):
            msg = Message(role="assistant", content=step)
        elif kinds.get(step.name) != "read":
            break
        else:
            msg = Message(role="assistant", tool_calls=[step.model_copy(update={"id": f"call_{turn}_0"})])
        result = env.step(msg)
        if result.done or any(o.error for o in result.observations):
            if not _replay(env, task, actions):  # not deterministic after all: start from the opening
                env.reset(task)
                actions = []
            break
        actions.append(msg)
    assert env.state is not None
    return list(env.state.messages), len(actions)


def start_episode(policy: Policy, source: str, seed: int, task: Task, sample: int, env: Environment,
                  guide: Callable[[list[Message], int], list[Message] | None] | None = None,
                  preplay: Sequence[PlayedStep] = ()) -> Episode:
    """A new episode of `task`; with `preplay`, started after those reference steps (`preplayed_opening`). With
    `guide`, played from the opening it returns (given the opening and the number of steps actually played,
    fewer than planned when one is refused; None: no guidance) while the trained sequence starts from the
    opening without it (the hint swap)."""
    opening, preplayed = preplayed_opening(env, task, preplay) if preplay else (env.reset(task), 0)
    guided_opening = guide(list(opening), preplayed) if guide is not None else None
    tools = env.tool_schemas()
    prompt = policy.encode(policy.render(opening, tools))
    guided = None if guided_opening is None else policy.encode(policy.render(guided_opening, tools))
    return Episode(source, seed, sample, env, prompt, list(opening), sample_prompt_ids=guided, preplayed=preplayed)


def reference_message(step: Any, turn: int) -> Message | None:
    """One reference step ({"tool"|"name", "arguments"} or {"say": text}) as the agent's message at assistant turn
    `turn` (call ids as the parser numbers them); None for a step in no known form."""
    if not isinstance(step, dict):
        return None
    name, args = step.get("tool", step.get("name")), step.get("arguments", {})
    if name is None and "say" in step:
        text = step["say"]
        return Message(role="assistant", content=text) if isinstance(text, str) and text.strip() else None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return Message(role="assistant", tool_calls=[ToolCall(id=f"call_{turn}_0", name=name, arguments=args)])


def reference_turn_ids(policy: Policy, context: list[Message], msg: Message, tools: list) -> list[int]:
    """The token ids of `msg` as the agent's turn after `context`: the chat template's rendering of it up to and
    including its end-of-turn token, i.e. what the policy emits when it samples this message there (the grammar
    and the parser read the same canonical form, `engine/chat.render_call`)."""
    before = policy.render(context, tools)
    after = policy.render([*context, msg], tools)
    if not after.startswith(before):
        raise RuntimeError("chat template is not prefix-stable across turns; cannot build multi-turn samples")
    rest = after[len(before):]
    end = rest.find(TURN_END)
    if end < 0:
        raise RuntimeError("the chat template ends an assistant turn without " + TURN_END)
    return policy.encode(rest[:end + len(TURN_END)])


def play_reference(policy: Policy, ep: Episode, steps: Sequence[Any], cfg: TrainConfig) -> bool:
    """Play `steps` (a reference solution, after the steps the episode started with) as the agent's turns of `ep`,
    through the same path as sampled turns (`apply_turn`: the environment and its scripted user answer, results
    are cut as for a sampled turn, the loss mask is the agent's tokens); marks `ep` a reference episode.

    False when a step is in no known form, the environment refuses it, or the episode ends before the last step:
    the reference is broken there. Whether it earns full reward is the caller's check (`env.reward`)."""
    tools = ep.env.tool_schemas()
    ep.reference = True
    for step in steps:
        if ep.env.done:
            return False
        msg = reference_message(step, sum(1 for m in ep.context if m.role == "assistant"))
        if msg is None:
            return False
        errors = ep.env.state.tool_errors if ep.env.state is not None else 0
        apply_turn(policy, ep, reference_turn_ids(policy, ep.context, msg, tools), "stop", cfg.tool_result_tokens,
                    cfg.filter_lookup_only, scripted=True)
        assert ep.env.state is not None
        if ep.env.state.tool_errors > errors or ep.env.state.invalid_actions:  # the environment refused the step
            return False
    return bool(steps)


def _turn_processor(policy: Policy, cfg: TrainConfig, batch: Sequence[Episode]) -> Any:
    """The grammar processor for the batch's next turns (None when decoding is not constrained)."""
    if not cfg.constrained:
        return None
    return policy.tool_processor(batch[0].env.tool_schemas(), len(batch),
                                 [must_call(cfg.tool_choice, ep.env) for ep in batch])


def _by_source(episodes: Sequence[Episode]) -> list[list[Episode]]:
    return [list(batch) for _, batch in groupby(sorted(episodes, key=lambda e: e.source), key=lambda e: e.source)]


def play(policy: Policy, episodes: Sequence[Episode], cfg: TrainConfig, seed: int,
         adapters: Sequence[str] | None = None, temperatures: Mapping[str, float] | None = None) -> dict[str, float]:
    """Run the episodes to the end, batched per tool set; returns generation timings.

    With `train.continuous_batching` (and a model `Policy.play_turns` takes) each tool set's episodes are
    decoded in one continuously batched call; otherwise turn by turn, each turn of the live episodes one call.

    `adapters` (one per episode): each episode is decoded under that LoRA adapter of `policy`'s model, all of
    them in the same batches (per-row routes, `engine/row_lora.py`; `training/lockstep.py` plays several
    trainings' iterations so), at `temperatures[adapter]` where given (else `train.temperature`). Needs
    continuous batching. Without it every episode runs under the policy's adapter.
    """
    if adapters is not None and len(adapters) != len(episodes):
        raise ValueError(f"{len(adapters)} adapters for {len(episodes)} episodes")
    names = sorted(set(adapters or ()))
    adapter_of = {id(ep): a for ep, a in zip(episodes, adapters or [None] * len(episodes), strict=True)}
    live = [ep for ep in episodes if not ep.env.done]
    call, gen_s = 0, 0.0
    before = dict(vars(policy.stats))
    if adapters is not None and not (cfg.continuous_batching and policy.plays_turns):
        raise ValueError("episodes under several adapters are played with continuous batching only "
                         "(train.continuous_batching and a model Policy.play_turns takes)")
    if cfg.continuous_batching and policy.plays_turns:
        for batch in _by_source(live) if adapters is None else _by_tools(live):
            asked: dict[int, float] = {}  # row -> when its current turn was asked for

            def next_turn(i: int, toks: list[int], why: str, batch: list[Episode] = batch,
                          asked: dict[int, float] = asked) -> tuple[list[int], bool] | None:
                ep = batch[i]
                apply_turn(policy, ep, toks, why, cfg.tool_result_tokens, cfg.filter_lookup_only,
                           seconds=time.perf_counter() - asked[i])
                asked[i] = time.perf_counter()
                return None if ep.env.done else (ep.sampling_ids(), must_call(cfg.tool_choice, ep.env))

            keys = [ep.key if adapters is None else (adapter_of[id(ep)], *ep.key) for ep in batch]
            routed = {} if adapters is None else {
                "routes": [{n: 1.0} for n in names], "row_routes": [names.index(adapter_of[id(ep)]) for ep in batch]}
            temperature = cfg.temperature if not temperatures else [temperatures.get(n, cfg.temperature) for n in names]
            t0 = time.perf_counter()
            asked.update(dict.fromkeys(range(len(batch)), t0))
            stepping = policy.play_turns(
                [ep.sampling_ids() for ep in batch], next_turn, temperature=temperature, top_p=1.0,
                max_new_tokens=cfg.max_new_tokens, seed=(seed * 1_000_003 + call) % 2**62,
                sessions=keys, processor=_turn_processor(policy, cfg, batch), **routed)
            gen_s += time.perf_counter() - t0 - stepping  # the environments' turns are not generating
            call += 1
            policy.end_sessions(keys)
        live = []
    while live:
        for batch in _by_source(live):
            t0 = time.perf_counter()
            tokens, finish = policy.generate_ids(
                [ep.sampling_ids() for ep in batch], temperature=cfg.temperature, top_p=1.0,
                max_new_tokens=cfg.max_new_tokens, seed=(seed * 1_000_003 + call) % 2**62,
                processor=_turn_processor(policy, cfg, batch), sessions=[ep.key for ep in batch])
            seconds = time.perf_counter() - t0
            gen_s += seconds
            call += 1
            for ep, toks, why in zip(batch, tokens, finish, strict=True):
                apply_turn(policy, ep, toks, why, cfg.tool_result_tokens, cfg.filter_lookup_only, seconds=seconds)
        policy.end_sessions([ep.key for ep in live if ep.env.done])
        live = [ep for ep in live if not ep.env.done]
    after = vars(policy.stats)
    return {"generate_seconds": gen_s, "generate_calls": call,
            "prefill_seconds": after["prefill_seconds"] - before["prefill_seconds"],
            "decode_seconds": after["decode_seconds"] - before["decode_seconds"],
            "prompt_tokens_computed": (after["prompt_tokens"] - after["cached_prompt_tokens"])
            - (before["prompt_tokens"] - before["cached_prompt_tokens"]),
            "completion_tokens": after["completion_tokens"] - before["completion_tokens"]}


def _by_tools(episodes: Sequence[Episode]) -> list[list[Episode]]:
    """The episodes in batches of one tool set (one grammar), in their order."""
    batches: dict[str, list[Episode]] = {}
    for ep in episodes:
        batches.setdefault(dumps_json(ep.env.tool_schemas()), []).append(ep)
    return list(batches.values())


def apply_turn(policy: Policy, ep: Episode, toks: list[int], finish: str, tool_result_tokens: int,
                filter_lookup_only: bool = True, scripted: bool = False, seconds: float = 0.0) -> None:
    """Step the env with one generated turn and append its tokens and the environment's reply (whole: the next
    turn reads it so), cutting the reply before this turn when the loss will skip this turn
    (`cut_before_skipped_turn`)."""
    tok = policy.tokenizer
    tools = ep.env.tool_schemas()
    text = tok.decode([t for t in toks if t not in policy.stop_ids], skip_special_tokens=False)
    msg = parse_assistant(text, tools, turn=sum(1 for m in ep.context if m.role == "assistant"))
    result = ep.env.step(msg)
    lookup = _lookup_only(msg, ep.env.tool_kinds())
    if cut_before_skipped_turn(lookup, result.done, filter_lookup_only):
        _cut_pending(policy, ep, tools)
    ep.pending = None
    start = len(ep.completion_ids)
    ep.completion_ids += toks
    ep.agent_mask += [1] * len(toks)
    ep.turns.append((start, len(ep.completion_ids), lookup))
    ep.turn_records.append(TurnRecord(finish, scripted, seconds))
    if finish != "stop" or toks[-1] != tok.convert_tokens_to_ids(TURN_END):
        close = policy.encode(TURN_END)  # the turn must end like a rendered one; not the agent's token
        ep.completion_ids += close
        ep.agent_mask += [0] * len(close)
    if result.done:
        ep.context.append(msg)
        return
    cut = [o.model_copy(update={"content": truncate_text(tok, o.content, tool_result_tokens)})
           if o.role == "tool" else o for o in result.observations]
    full = policy.encode(_reply_text(policy, ep.context, msg, result.observations, tools))
    ep.context.append(msg)
    if cut != result.observations:
        ep.pending = PendingReply(len(ep.completion_ids), len(ep.context), cut)
    ep.context += result.observations
    ep.completion_ids += full
    ep.agent_mask += [0] * len(full)


def cut_before_skipped_turn(lookup_only: bool, episode_done: bool, filter_lookup_only: bool) -> bool:
    """Whether the reply before an agent turn is cut to `train.tool_result_tokens` in the training sequence (and
    in the contexts every later turn is sampled from).

    The paper truncates earlier tool results in training prompts. A turn must be trained on what it was sampled
    from, and it was sampled with the reply just before it whole, so a reply is cut only before a turn the loss
    skips: a lookup-only turn with `filter_lookup_only`, unless it ends the episode (the loss keeps an episode's
    last turn when all its turns are lookups). The decision is made before the next turn is sampled, so that turn
    and every later one read the sequence they are trained on. Cutting every reply before the turn after it
    trained that turn on a context without what it had read: a retail order's status and payment lie past the
    256th of its 420-770 tokens, so answers that named them were reinforced where they could not be seen."""
    return filter_lookup_only and lookup_only and not episode_done


def _cut_pending(policy: Policy, ep: Episode, tools: list) -> None:
    """Replace the pending (whole) reply at the end of the episode's sequence by its cut form."""
    p = ep.pending
    if p is None:
        return
    before, msg = ep.context[:p.context_at - 1], ep.context[p.context_at - 1]
    ids = policy.encode(_reply_text(policy, before, msg, p.cut_messages, tools))
    del ep.completion_ids[p.start:], ep.agent_mask[p.start:], ep.context[p.context_at:]
    ep.completion_ids += ids
    ep.agent_mask += [0] * len(ids)
    ep.context += p.cut_messages


def _reply_text(policy: Policy, context: list[Message], msg: Message, observations: list[Message], tools: list) -> str:
    """The environment's reply as the template renders it after the agent's turn, up to the next
    generation prompt (the agent's own turn, re-rendered, is cut off: its tokens are the generated ones)."""
    before = policy.render(context, tools)
    after = policy.render([*context, msg, *observations], tools)
    if not after.startswith(before):
        raise RuntimeError("chat template is not prefix-stable across turns; cannot build multi-turn samples")
    rest = after[len(before):]
    return rest[rest.index(TURN_END) + len(TURN_END):]
