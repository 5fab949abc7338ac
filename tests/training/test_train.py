"""GRPO training: rollout samples and loss masks, curriculum mixing, budget, determinism and resume.

Rollout-level tests drive `grpo.AgentRollout` with a scripted Policy over the tiny model (exact
token control); trainer tests run TRL's GRPOTrainer on the tiny random model for 1–3 iterations.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scripted_tokens import ScriptedPolicy
from toy import KVEnv, PickEnv, kv_task, pick_tasks

from trace_lib.config import TrainConfig
from trace_lib.envs.base import UserTurn
from trace_lib.records import Message
from trace_lib.budget import RolloutLedger
from trace_lib.agent.episode import (
    TRUNCATION_MARK,
    cut_before_skipped_turn,
    leading_steps,
    play,
    play_reference,
    preplayed_opening,
    start_episode,
)
from trace_lib.training.grpo import (
    AgentRollout,
    TrainSource,
    drop_masked_rows,
    loss_mask,
    preplay_count,
    trajectory_reward,
)
from trace_lib.training.hints import HINT_CLOSE, HINT_OPEN, reference_steps
from trace_lib.training.rewards import make_reward
from trace_lib.training.grpo_trainer import AgentGRPOTrainer
from trace_lib.training.trainer import (
    group_sources,
    load_trainable,
    lora_config,
    read_timing,
    read_train_log,
    resolve_train_backend,
    train_adapter_mixture,
    train_dataset,
)

FAST = {"groups": 2, "group_size": 2, "max_new_tokens": 12, "max_steps_per_episode": 3, "constrained": False,
        "learning_rate": 1e-2, "save_every": 1}


def kv_tasks(seeds):
    return [kv_task(s % 20).model_copy(update={"seed": s}) for s in seeds]


class ParityEnv(KVEnv):
    """Reward 1 when the agent's first turn has an even number of characters: mixed rewards for a random model."""

    name = "parity"

    def _score(self):
        first = next(m for m in self.state.messages if m.role == "assistant")
        return float(len(first.content) % 2 == 0), {}


# --- scripted policy: exact control over the agent's tokens ---------------------------------------
@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    policy, _ = load_trainable(tiny_model_dir, TrainConfig(), "trl", seed=0)
    return ScriptedPolicy(policy.model, policy.tokenizer, "tiny")


def run_rollout(policy, prompts, **cfg_kw):
    cfg = TrainConfig(**{**FAST, **cfg_kw})
    spent = []
    ro = AgentRollout(policy, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks)], cfg, make_reward(cfg.reward),
                      spent.append, seed=0)
    out = ro(prompts, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    return ro, out, spent


def segments(tok, ids, mask):
    """[(mask value, decoded text)] runs of equal mask."""
    runs: list[list] = []
    for i, m in zip(ids, mask, strict=True):
        if not runs or runs[-1][0] != m:
            runs.append([m, []])
        runs[-1][1].append(i)
    return [(m, tok.decode(s)) for m, s in runs]


def test_only_agent_tokens_carry_loss(scripted):
    ro, out, spent = run_rollout(scripted, ["kv:1001"] * 2 + ["kv:1002"] * 2, filter_lookup_only=False)
    assert spent == [4]
    assert out["reward"] == [1.0, 0.0, 1.0, 0.0] and out["tool_calls"] == [1, 1, 1, 1]
    assert out["logprobs"] is None and len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["env_mask"]) == 4
    tok = scripted.tokenizer
    assert tok.decode(out["prompt_ids"][0]).endswith("What is the value of k1?<|im_end|>\n<|im_start|>assistant\n")
    segs = segments(tok, out["completion_ids"][0], out["env_mask"][0])
    assert [m for m, _ in segs] == [1, 0, 1]
    assert segs[0][1].startswith("<tool_call>") and segs[0][1].endswith("<|im_end|>")
    assert segs[1][1].startswith("\n<|im_start|>tool\n<tool_response>\n{\"key\": \"k1\", \"value\": 10}")
    assert segs[1][1].endswith("<|im_start|>assistant\n")
    assert segs[2][1] == "The value is 10.<|im_end|>"
    assert "Thanks, bye." not in tok.decode(out["completion_ids"][0])  # the final user turn ends the episode


def test_lookup_only_turns_are_filtered_but_one_sample_per_episode_stays(scripted):
    ro, out, _ = run_rollout(scripted, ["kv:1001"] * 2 + ["kv:1003"] * 2, filter_lookup_only=True)
    tok = scripted.tokenizer
    segs = segments(tok, out["completion_ids"][0], out["env_mask"][0])
    assert [m for m, _ in segs] == [0, 1] and segs[1][1] == "The value is 10.<|im_end|>"
    looping = ro.last[2]  # k3: only lookups until max_steps
    assert len(looping.turns) == 3 and all(t[2] for t in looping.turns)
    kept = loss_mask(looping, True)
    start, end, _ = looping.turns[-1]
    assert sum(kept) == end - start and all(kept[start:end])
    assert out["env_mask"][2] == [0] * len(out["completion_ids"][2])  # but its group has identical rewards


def test_groups_with_identical_rewards_are_dropped(scripted):
    ro, out, _ = run_rollout(scripted, ["kv:1003"] * 2 + ["kv:1001"] * 2)
    assert out["reward"][:2] == [0.0, 0.0]
    assert sum(map(sum, out["env_mask"][:2])) == 0 and sum(map(sum, out["env_mask"][2:])) > 0
    stats = ro.stats[0]
    assert stats["frac_reward_zero_std"] == 0.5 and stats["success_rate"] == 0.25
    assert stats["trained_tokens"] == sum(map(sum, out["env_mask"]))
    assert stats["completion_length"] == stats["completion_tokens"] / 4 == sum(ep.agent_tokens for ep in ro.last) / 4
    assert trajectory_reward([], [], reward=out["reward"]) == out["reward"]


class VerboseEnv(KVEnv):
    """Tool results far longer than `tool_result_tokens`."""

    def _execute(self, call):
        text, err = super()._execute(call)
        return text + " padding" * 200, err


def test_a_result_before_a_skipped_lookup_is_cut_and_every_trained_turn_reads_what_it_is_trained_on(scripted):
    cfg = TrainConfig(**{**FAST, "groups": 2, "tool_result_tokens": 16})
    policy = ScriptedPolicy(scripted.model, scripted.tokenizer, "tiny")
    policy.seen = seen = []
    ro = AgentRollout(policy, [TrainSource("kv", lambda: VerboseEnv(max_steps=3), kv_tasks)], cfg,
                      make_reward(cfg.reward), lambda n: None, seed=0)
    # k1: one lookup, then an answer; k3: lookups until the step limit (3 turns)
    out = ro(["kv:1001"] * 2 + ["kv:1003"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    tok = scripted.tokenizer
    looping = ro.last[2]
    trained = tok.decode(out["completion_ids"][0])
    assert trained.count("padding") == 200 and TRUNCATION_MARK not in trained  # the answer's result stays whole
    assert [t[2] for t in looping.turns] == [True, True, True]
    looped = tok.decode(out["completion_ids"][2])
    # the result before the second (skipped) lookup is cut; the one before the last turn, which the loss keeps
    # when every turn is a lookup, stays whole
    assert looped.count(TRUNCATION_MARK) == 1 and 200 < looped.count("padding") < 220
    cut = [m.content for m in looping.context if m.role == "tool"]
    assert cut[0].endswith(TRUNCATION_MARK) and len(scripted.encode(cut[0][: -len(TRUNCATION_MARK)])) <= 16
    assert cut[1].count("padding") == 200
    assert looping.env.state.messages[3].content.count("padding") == 200  # the env's own record stays whole
    sampled = [list(p) for call in seen for p in call]
    for row, ep in enumerate(ro.last):
        for (start, _, _), m in zip(ep.turns, _turn_masks(out["env_mask"][row], ep.turns), strict=True):
            if m:  # every turn the loss trains was sampled from exactly its training context
                assert out["prompt_ids"][row] + out["completion_ids"][row][:start] in sampled
    # the second lookup was sampled with the first result whole (the cut came after it)
    assert tok.decode(looping.prompt_ids + looping.completion_ids[:looping.turns[2][0]]).count("padding") > 200
    assert any(tok.decode(p).count("padding") == 200 and "k3" in tok.decode(p) for p in sampled)
    assert out["reward"] == [1.0, 0.0, 0.0, 0.0]


def _turn_masks(mask: list[int], turns: list[tuple[int, int, bool]]) -> list[bool]:
    """Whether the loss trains each of an episode's turns (any mask-1 token in its span)."""
    return [any(mask[start:end]) for start, end, _ in turns]


def test_with_every_turn_trained_no_result_is_cut(scripted):
    cfg = TrainConfig(**{**FAST, "groups": 1, "tool_result_tokens": 16, "filter_lookup_only": False})
    policy = ScriptedPolicy(scripted.model, scripted.tokenizer, "tiny")
    ro = AgentRollout(policy, [TrainSource("kv", lambda: VerboseEnv(max_steps=3), kv_tasks)], cfg,
                      make_reward(cfg.reward), lambda n: None, seed=0)
    out = ro(["kv:1003"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    assert TRUNCATION_MARK not in scripted.tokenizer.decode(out["completion_ids"][0])


def test_cut_before_skipped_turn():
    assert cut_before_skipped_turn(lookup_only=True, episode_done=False, filter_lookup_only=True)
    assert not cut_before_skipped_turn(lookup_only=False, episode_done=False, filter_lookup_only=True)  # trained
    assert not cut_before_skipped_turn(lookup_only=True, episode_done=True, filter_lookup_only=True)  # maybe kept
    assert not cut_before_skipped_turn(lookup_only=True, episode_done=False, filter_lookup_only=False)


class GuidedPolicy(ScriptedPolicy):
    """Answers right only when the prompt carries expert guidance; records every prompt."""

    def generate_ids(self, prompts, **kw):
        self.seen.append(prompts)
        outs, finish = [], []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            key = re.search(r"value of (k\d+)", text).group(1)
            if text.count("<|im_start|>assistant") == 1:
                reply = f'<tool_call>\n{{"name": "get_value", "arguments": {{"key": "{key}"}}}}\n</tool_call>'
            else:
                reply = f"The value is {int(key[1:]) * 10 + (HINT_OPEN not in text)}."
            outs.append(self.encode(reply + "<|im_end|>"))
            finish.append("stop")
        return outs, finish


def test_hint_swap_plays_guided_rollouts_and_trains_them_without_the_guidance(scripted):
    policy = GuidedPolicy(scripted.model, scripted.tokenizer, "tiny")
    policy.seen = []
    hint = lambda task: f"Look up {task.user.reason_for_call.split()[-1].rstrip('?')} and say its value."  # noqa: E731
    cfg = TrainConfig(**{**FAST, "group_size": 4, "hint_fraction": 0.5, "filter_lookup_only": False})
    spent = []
    ro = AgentRollout(policy, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, hint=hint)], cfg,
                      make_reward(cfg.reward), spent.append, seed=0)
    out = ro(["kv:1001"] * 4 + ["kv:1002"] * 4, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    tok = policy.tokenizer
    assert spent == [8]  # guided rollouts count like any other
    assert [ep.hinted for ep in ro.last] == [False, False, True, True] * 2
    assert out["reward"] == [0.0, 0.0, 1.0, 1.0] * 2
    first_turn = [tok.decode(ids) for ids in policy.seen[0]]
    assert [HINT_OPEN + "Look up k1 and say its value." + HINT_CLOSE in t for t in first_turn[:4]] == [False, False,
                                                                                                        True, True]
    # the trained sequence: the same unguided prompt for every row, the guided episode's own turns
    assert all(ids == out["prompt_ids"][0] for ids in out["prompt_ids"][:4])
    assert HINT_OPEN not in tok.decode(out["prompt_ids"][2]) and HINT_OPEN not in tok.decode(out["completion_ids"][2])
    assert tok.decode(out["completion_ids"][2]).endswith("The value is 10.<|im_end|>")
    assert sum(out["env_mask"][2]) > 0  # the group has mixed rewards: trained
    stats = ro.stats[0]
    assert (stats["hinted"], stats["success_rate_unhinted"], stats["success_rate_hinted"]) == (4, 0.0, 1.0)


def test_hint_swap_without_guidance_plays_unguided(scripted):
    policy = GuidedPolicy(scripted.model, scripted.tokenizer, "tiny")
    policy.seen = []
    cfg = TrainConfig(**{**FAST, "groups": 1, "hint_fraction": 0.5})
    ro = AgentRollout(policy, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, hint=lambda task: None)], cfg,
                      make_reward(cfg.reward), lambda n: None, seed=0)
    out = ro(["kv:1001"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    assert not any(ep.hinted for ep in ro.last) and out["reward"] == [0.0, 0.0]
    assert ro.stats[0]["hinted"] == 0 and ro.stats[0]["success_rate_hinted"] is None


def test_preplay_count_steps_down_from_every_leading_step_to_none():
    assert [preplay_count(i, 4, 0.5, 2) for i in range(4)] == [2, 1, 0, 0]
    assert [preplay_count(i, 3, 1.0, 3) for i in range(3)] == [3, 2, 1]
    assert [preplay_count(i, 5, 1.0, 1) for i in range(5)] == [1] * 5
    assert [preplay_count(i, 4, 0.0, 2) for i in range(4)] == [0] * 4  # off
    assert preplay_count(0, 4, 1.0, 0) == 0  # nothing to play
    assert [preplay_count(i, 100, 0.07, 1) for i in (6, 7)] == [1, 0]  # 0.07 * 100 != 7 in floating point


def test_leading_steps_stop_at_a_write_or_malformed_step_and_leave_the_answer_to_the_agent():
    steps = [{"say": "Which key?"}, {"tool": "get_value", "arguments": {"key": "k1"}},
             {"name": "set_value", "arguments": {"key": "k1"}}, {"say": "done"}, {"tool": "get_value", "arguments": {}},
             {"say": "The value is 5."}]
    played = leading_steps(steps)
    assert played[0] == "Which key?" and played[3] == "done" and len(played) == 5  # the final answer is left out
    assert [(c.name, c.arguments) for c in played[1:3]] == [("get_value", {"key": "k1"}), ("set_value", {"key": "k1"})]
    kinds = {t.name: t.kind for t in KVEnv().tools}
    assert [getattr(c, "name", c) for c in leading_steps(steps, kinds)] == ["Which key?", "get_value"]  # to the write
    assert leading_steps([{"tool": "x", "arguments": "not a dict"}, {"tool": "y"}]) == []
    assert leading_steps(["junk"]) == [] and leading_steps([]) == []
    # a blank say is malformed, and the message before it (the last) is the agent's to say
    assert leading_steps([{"say": "Hi."}, {"say": "  "}, {"tool": "get_value"}]) == []
    read = {"tool": "get_value", "arguments": {"key": "k1"}}
    assert [c.name for c in leading_steps([read, read])] == ["get_value"] * 2  # ends with a call: all of it
    assert leading_steps([{"say": "Q?"}, {"say": "A."}]) == ["Q?"] and leading_steps([{"say": "A."}]) == []
    assert leading_steps([{"say": "x", "tool": "get_value", "arguments": {"key": "k1"}}, read])[0].name == "get_value"
    confirm = [{"tool": "get_value", "arguments": {"key": "k1"}}, {"say": "Set k1 to 5. Shall I proceed?"},
               {"tool": "set_value", "arguments": {"key": "k1", "value": 5}}, {"say": "Done."}]
    assert leading_steps(confirm, kinds)[1] == "Set k1 to 5. Shall I proceed?"  # asked before the write: played
    declined = [*confirm[:2], {"say": "Understood, nothing changed."}]
    assert leading_steps(declined, kinds)[1:] == ["Set k1 to 5. Shall I proceed?"]  # only the last message is left
    assert [c.name for c in leading_steps(reference_steps(kv_task(1)))] == ["get_value"]  # a target reference


class ChattyKVEnv(KVEnv):
    """KVEnv whose user answers a question with the key instead of hanging up."""

    def _user_reply(self, agent_text):
        return UserTurn("It is k1.", stop=False) if agent_text.endswith("?") else super()._user_reply(agent_text)


def test_preplayed_opening_plays_what_the_reference_says_with_the_users_reply():
    env = ChattyKVEnv(max_steps=4)
    steps = leading_steps([{"say": "Which key?"}, {"tool": "get_value", "arguments": {"key": "k1"}},
                           {"say": "The value is 10."}])
    opening, played = preplayed_opening(env, kv_task(1), steps)
    assert played == 2
    assert [m.role for m in opening] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert opening[2].content == "Which key?" and opening[3].content == "It is k1."
    assert opening[4].tool_calls[0].id == "call_1_0" and env.state.steps == 2 and env.state.tool_calls == 1
    hangs_up = KVEnv(max_steps=4)  # its user stops after any message: the say would end the episode, so not played
    assert [m.role for m in preplayed_opening(hangs_up, kv_task(1), steps)[0]] == ["system", "user"]
    assert not hangs_up.done and hangs_up.state.steps == 0


def test_preplayed_opening_plays_the_calls_and_stops_before_a_failing_one():
    env = KVEnv(max_steps=3)
    calls = leading_steps(reference_steps(kv_task(1)))
    opening, played = preplayed_opening(env, kv_task(1), calls)
    assert played == 1
    assert [m.role for m in opening] == ["system", "user", "assistant", "tool"]
    assert opening[2].tool_calls[0].name == "get_value" and opening[2].tool_calls[0].id == "call_0_0"
    assert json.loads(opening[3].content) == {"key": "k1", "value": 10}
    assert env.state.steps == 1 and env.state.messages == opening and not env.done
    bad = [*calls, calls[0].model_copy(update={"arguments": {"key": "k99"}})]  # the tool refuses it
    opening, played = preplayed_opening(env, kv_task(1), bad)
    assert played == 1
    assert [m.role for m in opening] == ["system", "user", "assistant", "tool"]
    assert env.state.steps == 1 and env.state.tool_errors == 0 and env.state.messages == opening
    write = calls[0].model_copy(update={"name": "set_value", "arguments": {"key": "k1", "value": 5}})
    opening, played = preplayed_opening(env, kv_task(1), [write, *calls])  # a write is never played for the agent
    assert played == 0
    assert [m.role for m in opening] == ["system", "user"] and env.state.steps == 0 and env.db["k1"] == 10
    short = KVEnv(max_steps=1)  # the call would end the episode: not played
    assert preplayed_opening(short, kv_task(1), calls) == ([m for m in short.state.messages], 0) and not short.done
    assert [m.role for m in short.state.messages] == ["system", "user"]


def test_start_late_episodes_begin_after_the_reference_lookups_then_whole_episodes(scripted):
    cfg = TrainConfig(**{**FAST, "groups": 1, "iterations": 2, "start_late": 0.5, "filter_lookup_only": False})
    source = TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, reference=reference_steps)
    ro = AgentRollout(scripted, [source], cfg, make_reward(cfg.reward), lambda n: None, seed=0)
    tok = scripted.tokenizer
    late = ro(["kv:1001"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    prompt = tok.decode(late["prompt_ids"][0])
    assert prompt.endswith('"value": 10}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    assert '"name": "get_value"' in prompt and late["prompt_ids"][0] == late["prompt_ids"][1]
    # the agent's only turn is the answer: the lookup is the environment's, neither sampled nor trained
    assert [tok.decode(c) for c in late["completion_ids"]] == ["The value is 10.<|im_end|>",
                                                               "The value is 11.<|im_end|>"]
    assert late["reward"] == [1.0, 0.0] and late["tool_calls"] == [1, 1]
    assert ro.stats[0]["preplayed_steps"] == 1.0 and [ep.preplayed for ep in ro.last] == [1, 1]
    whole = ro(["kv:1001"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=1)))  # past the first half
    assert tok.decode(whole["prompt_ids"][0]).endswith("What is the value of k1?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(whole["completion_ids"][0]).startswith("<tool_call>")
    assert ro.stats[1]["preplayed_steps"] == 0.0


class GreetingChattyKVEnv(ChattyKVEnv):
    """Opens with the agent's greeting before the user's request, as τ²-bench does."""

    def reset(self, task):
        opening = super().reset(task)
        opening.insert(1, Message(role="assistant", content="Hi! How can I help you today?"))
        self.state.messages = list(opening)
        return opening


def test_start_late_plays_the_references_question_and_the_users_reply_not_counting_a_greeting(scripted):
    cfg = TrainConfig(**{**FAST, "groups": 1, "start_late": 1.0, "filter_lookup_only": False})
    reference = [{"say": "Which key?"}, {"tool": "get_value", "arguments": {"key": "k1"}}, {"say": "It is 10."}]
    source = TrainSource("kv", lambda: GreetingChattyKVEnv(max_steps=4), kv_tasks, reference=lambda task: reference)
    ro = AgentRollout(scripted, [source], cfg, make_reward(cfg.reward), lambda n: None, seed=0)
    out = ro(["kv:1001"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    prompt = scripted.tokenizer.decode(out["prompt_ids"][0])
    assert "Which key?<|im_end|>\n<|im_start|>user\nIt is k1.<|im_end|>" in prompt and "Hi! How can I help" in prompt
    assert prompt.endswith('"value": 10}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    assert [ep.preplayed for ep in ro.last] == [2, 2] and ro.stats[0]["preplayed_steps"] == 2.0  # not the greeting
    assert out["tool_calls"] == [1, 1] and out["reward"] == [1.0, 0.0]


def test_start_late_off_never_asks_for_the_reference(scripted):
    def reference(task):
        raise AssertionError("the reference was asked for")

    cfg = TrainConfig(**{**FAST, "groups": 1})
    ro = AgentRollout(scripted, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, reference=reference)], cfg,
                      make_reward(cfg.reward), lambda n: None, seed=0)
    ro(["kv:1001"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    assert ro.stats[0]["preplayed_steps"] == 0.0


def test_start_late_with_the_hint_swap_trains_the_late_prompt_without_the_guidance(scripted):
    policy = GuidedPolicy(scripted.model, scripted.tokenizer, "tiny")
    policy.seen = []
    cfg = TrainConfig(**{**FAST, "groups": 1, "group_size": 4, "hint_fraction": 0.5, "start_late": 1.0,
                         "filter_lookup_only": False})
    source = TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, hint=lambda task: "Say the value.",
                         reference=reference_steps)
    ro = AgentRollout(policy, [source], cfg, make_reward(cfg.reward), lambda n: None, seed=0)
    out = ro(["kv:1001"] * 4, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    tok = policy.tokenizer
    assert all(ids == out["prompt_ids"][0] for ids in out["prompt_ids"])  # one trained prompt, no guidance
    trained = tok.decode(out["prompt_ids"][0])
    assert HINT_OPEN not in trained and '"name": "get_value"' in trained
    sampled = [tok.decode(ids) for ids in policy.seen[0]]
    assert [HINT_OPEN in t for t in sampled] == [False, False, True, True]
    assert all(t.endswith('"value": 10}\n</tool_response><|im_end|>\n<|im_start|>assistant\n') for t in sampled)
    assert out["reward"] == [0.0, 0.0, 1.0, 1.0] and [ep.preplayed for ep in ro.last] == [1] * 4


def _guided_hint(scripted, start_late: float, reference) -> tuple[str, list[int]]:
    """The guidance the second (guided) rollout of a KV group of two was sampled with, and each episode's played
    steps; the source's own hint is "Say the value."."""
    policy = GuidedPolicy(scripted.model, scripted.tokenizer, "tiny")
    policy.seen = []
    cfg = TrainConfig(**{**FAST, "groups": 1, "group_size": 2, "reference_samples": 0, "hint_fraction": 0.5, "start_late": start_late})
    source = TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, hint=lambda task: "Say the value.",
                         reference=reference)
    ro = AgentRollout(policy, [source], cfg, make_reward(cfg.reward), lambda n: None, seed=0)
    ro(["kv:1001"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    guided = policy.tokenizer.decode(policy.seen[0][1])
    return guided[guided.index(HINT_OPEN) + len(HINT_OPEN):guided.index(HINT_CLOSE)], [ep.preplayed for ep in ro.last]


def test_a_late_start_hint_lists_only_the_steps_left_to_do(scripted):
    """After the played lookup the guidance says what is left (the answer), not the lookup again; a whole
    episode keeps the source's own hint."""
    hint, played = _guided_hint(scripted, 1.0, reference_steps)
    assert '(1) tell the customer: "The answer: 10".' in hint and "call get_value" not in hint, hint
    assert played == [1, 1]
    assert _guided_hint(scripted, 0.0, reference_steps) == ("Say the value.", [0, 0])


def test_a_late_start_whose_step_is_refused_keeps_the_whole_hint(scripted):
    """The guidance follows the steps actually played: a planned lookup the environment refuses is not played,
    so the episode starts from the opening and its guidance is the source's own."""
    refused = [{"tool": "get_value", "arguments": {"key": "nope"}}, {"say": "The answer: 10"}]
    assert _guided_hint(scripted, 1.0, lambda task: refused) == ("Say the value.", [0, 0])


def test_start_late_without_a_reference_plays_whole_episodes(scripted):
    cfg = TrainConfig(**{**FAST, "groups": 1, "start_late": 1.0})
    ro = AgentRollout(scripted, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks)], cfg,
                      make_reward(cfg.reward), lambda n: None, seed=0)
    out = ro(["kv:1001"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    assert scripted.tokenizer.decode(out["completion_ids"][0]).startswith("<tool_call>")
    assert ro.stats[0]["preplayed_steps"] == 0.0


def test_efficiency_reward_in_rollouts(scripted):
    reward = {"efficiency": True, "warmup_threshold": 0, "warmup_epochs": 0, "lam": 0.05}
    ro, out, _ = run_rollout(scripted, ["kv:1001"] * 2, groups=1, reward=reward)
    assert out["reward"] == [pytest.approx(0.95), 0.0]  # one call above l_t = 0
    assert ro.stats[0]["l_t"] == 0 and ro.reward.threshold == 0 and ro.stats[0]["tool_calls_correct"] == 1.0


class RubricKVEnv(KVEnv):
    """KVEnv scored by a rubric: the lookup and the value said are its two steps."""

    def _score(self):
        said = " ".join(self.agent_texts())
        steps = {"looked_up": float(self.state.tool_calls > 0),
                 "value_said": float(all(out in said for out in self.state.task.required_outputs))}
        score = sum(steps.values()) / len(steps)
        return score, {"evaluate": score, "rubric": {"steps": steps, "gates": {"no_write": True}}}


def test_multi_level_rewards_give_failures_partial_credit_and_log_each_item(scripted):
    cfg = TrainConfig(**{**FAST, "groups": 1})
    ro = AgentRollout(scripted, [TrainSource("kv", lambda: RubricKVEnv(max_steps=3), kv_tasks)], cfg,
                      make_reward(cfg.reward), lambda n: None, seed=0)
    out = ro(["kv:1001"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    # row 0 looks the value up and says it; row 1 looks it up and says a wrong one: half the rubric,
    # times partial_credit 0.5
    assert out["success"] == [True, False] and out["reward"] == [1.0, 0.25]
    stats = ro.stats[0]
    assert stats["env_score"] == 0.75 and stats["rubric"] == {"looked_up": 1.0, "value_said": 0.5, "no_write": 1.0}
    assert [ep.rubric["steps"]["value_said"] for ep in ro.last] == [1.0, 0.0]


def test_rows_without_loss_are_dropped_from_micro_batches():
    pad = 0
    inputs = {
        "prompt_ids": torch.tensor([[4, 4, 5, 6], [pad, 7, 8, 9], [pad, 5, 6, 7]]),
        "prompt_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]]),
        "completion_ids": torch.tensor([[1, 2, 3], [1, 2, pad], [1, pad, pad]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]),
        "tool_mask": torch.tensor([[0, 0, 0], [1, 0, 1], [1, 1, 1]]),
        "advantages": torch.tensor([0.0, 1.0, -1.0]),
        "num_items_in_batch": torch.tensor(2),
    }
    out = drop_masked_rows(inputs)
    assert out["prompt_ids"].tolist() == [[7, 8, 9], [5, 6, 7]] and out["prompt_mask"].tolist() == [[1, 1, 1]] * 2
    assert out["completion_ids"].tolist() == [[1, 2], [1, pad]] and out["tool_mask"].tolist() == [[1, 0], [1, 1]]
    assert out["advantages"].tolist() == [1.0, -1.0] and int(out["num_items_in_batch"]) == 2
    inputs["tool_mask"] = torch.zeros(3, 3, dtype=torch.long)
    assert drop_masked_rows(inputs) is None
    inputs["tool_mask"] = torch.ones(3, 3, dtype=torch.long)
    assert drop_masked_rows(inputs) is inputs


def test_the_trainer_skips_the_forward_pass_of_rows_without_loss(monkeypatch):
    """AgentGRPOTrainer.compute_loss hands TRL only the rows with loss; with none left, a zero loss that
    still reaches the trainable weights (backward() runs, every gradient is 0)."""
    from trl import GRPOTrainer

    seen = []
    monkeypatch.setattr(GRPOTrainer, "compute_loss",
                        lambda self, model, inputs, *a: seen.append(inputs["advantages"].tolist()) or torch.tensor(1.0))
    trainer = object.__new__(AgentGRPOTrainer)  # compute_loss needs no trainer state
    model = torch.nn.Linear(2, 1)
    model.bias.requires_grad_(False)
    inputs = {
        "prompt_ids": torch.tensor([[4, 5], [6, 7]]), "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 2], [3, 4]]), "completion_mask": torch.ones(2, 2, dtype=torch.long),
        "tool_mask": torch.tensor([[0, 0], [1, 0]]), "advantages": torch.tensor([0.5, -1.0]),
    }
    assert trainer.compute_loss(model, inputs) == 1.0 and seen == [[-1.0]]
    inputs["tool_mask"] = torch.zeros(2, 2, dtype=torch.long)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    assert loss.requires_grad and float(loss.detach()) == 0.0 and seen == [[-1.0]]  # TRL was not called
    assert model.weight.grad is not None and model.weight.grad.abs().sum() == 0


# --- configuration pieces -------------------------------------------------------------------------
def test_resolve_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_train_backend("trl") == "trl"
    assert resolve_train_backend("auto") == "trl"
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        resolve_train_backend("unsloth")
    with pytest.raises(ValueError):
        resolve_train_backend("deepspeed")


def test_lora_targets_only_existing_modules(scripted):
    base = scripted.model.get_base_model()
    cfg = TrainConfig(target_modules=["q_proj", "v_proj", "c_attn"])
    assert sorted(lora_config(cfg, base).target_modules) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="match no module"):
        lora_config(TrainConfig(target_modules=["c_attn"]), base)


def test_the_trainable_policy_samples_with_its_adapter(tiny_model_dir):
    policy, base_id = load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "trl", seed=0)
    assert policy.adapter == "default" and base_id == tiny_model_dir.name
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-2] for n in trainable} == {"default"}
    assert policy.tool_format == "json"  # the folder records no format
    listed, _ = load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "trl", seed=0, tool_format="signature")
    assert listed.tool_format == "signature"  # the train stage passes `model.tool_format`


def test_episodes_are_sampled_with_the_adapter_folded_in_and_the_base_weights_come_back_bit_for_bit(
        tiny_model_dir, monkeypatch):
    import trace_lib.training.grpo as grpo_mod
    from trace_lib.engine.compose import is_merged

    policy, _ = load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "trl", seed=0)
    torch.manual_seed(1)
    with torch.no_grad():  # a nonzero adapter (B starts at zero), so folding it in changes the weights
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "base_layer" in n}
    prompt = policy.encode(policy.render([Message(role="user", content="What is the value of k3?")], []))
    unfolded, _ = policy.generate_ids([prompt], temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0)
    cfg = TrainConfig(**FAST)
    ro = AgentRollout(policy, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks)], cfg, make_reward(cfg.reward),
                      lambda n: None, seed=0)
    with ro._folded():
        assert is_merged(policy.model)
        changed = [n for n, p in policy.model.named_parameters() if n in base and not torch.equal(p, base[n])]
        assert changed  # W + BA is in the base weights ...
        policy.clear_prefix_cache()
        folded, _ = policy.generate_ids([prompt], temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0)
    assert folded == unfolded  # ... and the adapter layers are off: the delta counts once (fp32: same tokens)
    assert not is_merged(policy.model)
    assert all(torch.equal(p, base[n]) for n, p in policy.model.named_parameters() if n in base)

    seen = []
    real_play = grpo_mod.play
    monkeypatch.setattr(grpo_mod, "play", lambda *a, **kw: (seen.append(is_merged(policy.model)), real_play(*a, **kw))[1])
    ro(["kv:0"] * cfg.group_size, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    ro.fold_lora = False  # what the trainer sets for Unsloth
    ro(["kv:0"] * cfg.group_size, SimpleNamespace(state=SimpleNamespace(global_step=1)))
    assert seen == [True, False]
    assert all(torch.equal(p, base[n]) for n, p in policy.model.named_parameters() if n in base)


def fake_unsloth(calls: list) -> SimpleNamespace:
    """Unsloth's `FastLanguageModel` API (what `load_trainable` calls), done with transformers and PEFT, so
    the unsloth path of the train stage runs on a CPU; records its calls."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def from_pretrained(model_name, dtype=None, load_in_4bit=False, **kw):
        calls.append(("from_pretrained", {"model_name": model_name, "dtype": dtype, "load_in_4bit": load_in_4bit,
                                          **kw}))
        return AutoModelForCausalLM.from_pretrained(model_name), AutoTokenizer.from_pretrained(model_name)

    def peft(model, r, lora_alpha, lora_dropout, target_modules, bias, random_state, **kw):
        calls.append(("get_peft_model", {"r": r, "lora_alpha": lora_alpha, "target_modules": target_modules,
                                         "bias": bias, "random_state": random_state, **kw}))
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                                target_modules=target_modules, bias=bias,
                                                layers_to_transform=kw.get("layers_to_transform")))

    return SimpleNamespace(FastLanguageModel=SimpleNamespace(from_pretrained=from_pretrained, get_peft_model=peft))


def test_the_unsloth_backend_trains_through_the_same_path_and_writes_the_same_records(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trace_lib.engine.chat import tool_chat_template
    from trace_lib.training import trainer as trainer_mod

    calls: list = []
    monkeypatch.setitem(sys.modules, "unsloth", fake_unsloth(calls))
    monkeypatch.setattr(trainer_mod, "resolve_train_backend", lambda name: "unsloth")  # as on a CUDA machine
    manifest, ledger = train(tiny_model_dir, tmp_path, iterations=1, group_size=2, lora_rank=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"])
    assert [c[0] for c in calls] == ["from_pretrained", "get_peft_model"]
    assert calls[0][1] == {"model_name": str(tiny_model_dir), "dtype": None, "load_in_4bit": False}
    assert calls[1][1] == {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none",
                           "random_state": 0, "use_gradient_checkpointing": False}  # the shared-prompt pass's cache
    assert manifest.backend == "unsloth" and manifest.rollouts_used == ledger.used("train", "cap") == 4
    out = tmp_path / "adapter"
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 1
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    assert sorted(loaded.peft_config["default"].target_modules) == ["q_proj", "v_proj"]
    policy, _ = trainer_mod.load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "unsloth", seed=0)
    assert policy.tokenizer.chat_template == tool_chat_template() and policy.adapter == "default"


def test_mixture_proportions_follow_the_weights():
    picks = group_sources([3.0, 1.0, 0.0], 4000, seed=1)
    share = Counter(picks)
    assert abs(share[0] / 4000 - 0.75) < 0.03 and share[2] == 0
    assert picks == group_sources([3.0, 1.0, 0.0], 4000, seed=1)
    assert picks != group_sources([3.0, 1.0, 0.0], 4000, seed=2)
    with pytest.raises(ValueError):
        group_sources([0.0, 0.0], 3, seed=0)
    cfg = TrainConfig(iterations=10, groups=8)
    src = [TrainSource("a", KVEnv, kv_tasks, 1.0), TrainSource("b", KVEnv, kv_tasks, 1.0)]
    rows = train_dataset(src, cfg, seed=0)["prompt"]
    assert len(rows) == 80 and rows[0].endswith(":1000") and rows[-1].endswith(":1079")
    assert 25 < sum(r.startswith("a:") for r in rows) < 55


def test_rollout_batches_mixed_sources(scripted):
    cfg = TrainConfig(**FAST)
    srcs = [TrainSource(n, lambda: KVEnv(max_steps=3), kv_tasks) for n in ("x", "y")]
    ro = AgentRollout(scripted, srcs, cfg, make_reward(cfg.reward), lambda n: None, seed=0)
    out = ro(["y:1001"] * 2 + ["x:1002"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    assert [ep.source for ep in ro.last] == ["y", "y", "x", "x"]
    assert [ep.seed for ep in ro.last] == [1001, 1001, 1002, 1002]
    assert out["tool_calls"] == [1, 1, 1, 1]


# --- the trainer ------------------------------------------------------------------------------------
def lora_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def train(tiny_model_dir, tmp_path, ledger=None, env=ParityEnv, name="cap", out="adapter", **kw):
    cfg = TrainConfig(**{**FAST, **kw})
    ledger = ledger or RolloutLedger(tmp_path / "ledger.jsonl")
    manifest = train_adapter_mixture(tiny_model_dir, [TrainSource(name, lambda: env(max_steps=3), kv_tasks)], cfg,
                                     tmp_path / out, seed=0, ledger=ledger, name=name)
    return manifest, ledger


def test_one_iteration_trains_and_writes_a_loadable_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    manifest, ledger = train(tiny_model_dir, tmp_path, iterations=1, group_size=4)
    out = tmp_path / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json", "train_log.jsonl",
            "manifest.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "timing.json").exists()  # wall times stay out of the adapter folder
    assert manifest.iterations == 1 and manifest.rollouts_used == 8 == ledger.used("train", "cap")
    assert manifest.backend == "trl" and manifest.capability_id == "cap"
    assert not (tmp_path / ".cap.ckpt").exists()  # checkpoints are removed once the adapter is written
    log = (out / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 1 and '"seconds"' not in log[0] and '"frac_reward_zero_std"' in log[0]
    row = read_train_log(out)[0]
    assert row["iteration"] == 1 and row["rollouts"] == 8 and row["trained_tokens"] > 0
    timing = read_timing(tmp_path / "adapter.timing.json")
    assert [t["iteration"] for t in timing["iterations"]] == [1] and timing["seconds_per_iteration"] > 0
    weights = lora_weights(out)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # B starts at zero
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_identical_rewards_carry_no_gradient(tiny_model_dir, tmp_path):
    manifest, _ = train(tiny_model_dir, tmp_path, env=KVEnv, iterations=1)  # random model: every reward 0
    log = (tmp_path / "adapter" / "train_log.jsonl").read_text()
    assert '"frac_reward_zero_std": 1.0' in log and '"trained_tokens": 0' in log
    assert all(v.abs().sum() == 0 for k, v in lora_weights(tmp_path / "adapter").items() if "lora_B" in k)


def test_budget_stops_training(tiny_model_dir, tmp_path):
    manifest, ledger = train(tiny_model_dir, tmp_path, iterations=3, rollout_budget=9)
    assert manifest.iterations == 2 and ledger.used("train", "cap") == 8
    with pytest.raises(ValueError, match="cannot pay for one iteration"):
        train(tiny_model_dir, tmp_path, iterations=3, rollout_budget=3, out="other", name="other")


class CrashingLedger(RolloutLedger):
    """Records the n-th add, then dies (a crash in the middle of an iteration)."""

    def __init__(self, path, crash_at: int) -> None:
        super().__init__(path)
        self.crash_at, self.adds = crash_at, 0

    def add(self, stage, rollouts, key=""):
        super().add(stage, rollouts, key)
        self.adds += 1
        if self.adds == self.crash_at:
            raise KeyboardInterrupt("simulated crash")


@pytest.mark.slow
def test_same_seed_same_bytes_and_resume_matches_a_straight_run(tiny_model_dir, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    train(tiny_model_dir, a, iterations=3, group_size=4)
    train(tiny_model_dir, b, iterations=3, group_size=4)
    assert (a / "adapter" / "train_log.jsonl").read_bytes() == (b / "adapter" / "train_log.jsonl").read_bytes()
    assert (a / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (b / "adapter" / "adapter_model.safetensors").read_bytes()

    crashing = CrashingLedger(c / "ledger.jsonl", crash_at=3)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_model_dir, c, ledger=crashing, iterations=3, group_size=4)
    assert (c / ".cap.ckpt" / "checkpoint-2" / "trace_state.json").is_file() and not (c / "adapter").exists()
    assert crashing.used("train", "cap") == 24  # the crashed iteration's rollouts were recorded ...
    with pytest.warns(UserWarning, match="dropped 8 rollouts"):
        manifest, ledger = train(tiny_model_dir, c, iterations=3, group_size=4)
    assert ledger.used("train", "cap") == 24 and manifest.iterations == 3  # ... and are redone, not double counted
    assert (c / "adapter" / "train_log.jsonl").read_bytes() == (a / "adapter" / "train_log.jsonl").read_bytes()
    wa, wc = lora_weights(a / "adapter"), lora_weights(c / "adapter")
    assert wa.keys() == wc.keys()
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    rows = (a / "adapter" / "train_log.jsonl").read_text().splitlines()
    assert all('"trained_tokens": 0,' not in r for r in rows)  # every iteration, the resumed one too, has signal
    # snapshots of the earlier iterations (the scaling stage's budget points), the same after a resume
    snaps = sorted(p.name for p in (a / "adapter" / "snapshots").iterdir())
    assert snaps == ["iter-1", "iter-2"] and sorted(p.name for p in (c / "adapter" / "snapshots").iterdir()) == snaps
    assert [json.loads((a / "adapter" / "snapshots" / n / "snapshot.json").read_text())["rollouts"]
            for n in snaps] == [8, 16]
    for n in snaps:
        assert (a / "adapter" / "snapshots" / n / "adapter_model.safetensors").read_bytes() == \
            (c / "adapter" / "snapshots" / n / "adapter_model.safetensors").read_bytes()
    assert not (c / ".cap.ckpt").exists()


def test_a_crash_while_writing_the_adapter_resumes_without_retraining(tiny_model_dir, tmp_path, monkeypatch):
    import trace_lib.training.trainer as train_mod

    def boom(tmp, out_dir):
        raise OSError("disk full")

    monkeypatch.setattr(train_mod, "_replace_dir", boom)
    with pytest.raises(OSError):
        train(tiny_model_dir, tmp_path, iterations=1)
    monkeypatch.undo()
    manifest, ledger = train(tiny_model_dir, tmp_path, iterations=1)
    assert manifest.iterations == 1 and ledger.used("train", "cap") == 4
    assert len((tmp_path / "adapter" / "train_log.jsonl").read_text().splitlines()) == 1


def test_kept_checkpoints_restore_a_deleted_ledger_and_other_configurations_start_over(tiny_model_dir, tmp_path):
    """What the train stage relies on under DVC, which deletes the adapter and its ledger (the stage's
    outputs) before a rerun: the kept final checkpoint gives back the same adapter, log and ledger rows
    without training; a checkpoint saved under another configuration is not resumed."""
    ckpt = tmp_path / "ckpt"

    def run(**kw):
        cfg = TrainConfig(**{**FAST, "iterations": 2, **kw})
        ledger = RolloutLedger(tmp_path / "ledger.jsonl")
        manifest = train_adapter_mixture(tiny_model_dir, [TrainSource("cap", lambda: ParityEnv(max_steps=3), kv_tasks)],
                                         cfg, tmp_path / "adapter", seed=0, ledger=ledger, name="cap", ckpt_dir=ckpt,
                                         resume_key="k", keep_checkpoints=True)
        return manifest, ledger, (tmp_path / "adapter" / "train_log.jsonl").read_bytes()

    manifest, ledger, log = run()
    rows, weights = ledger.rows(), lora_weights(tmp_path / "adapter")
    assert (ckpt / "checkpoint-2" / "trace_state.json").is_file() and len(rows) == 2
    (tmp_path / "adapter.timing.json").unlink()  # the rerun must write it again, from the checkpoint
    ledger.path.unlink()
    manifest, ledger, again = run()
    assert again == log and ledger.rows() == rows and manifest.rollouts_used == 8
    assert (tmp_path / "adapter.timing.json").is_file()
    assert all(torch.equal(weights[k], v) for k, v in lora_weights(tmp_path / "adapter").items())
    assert sorted(p.name for p in (tmp_path / "adapter" / "snapshots").iterdir()) == ["iter-1"]

    with pytest.warns(UserWarning, match="another configuration"):
        manifest, ledger, _ = run(learning_rate=2e-2)
    assert ledger.rows() == rows and manifest.config["train"]["learning_rate"] == 2e-2  # trained anew, not added


def test_reward_rises_on_a_learnable_toy_environment(tiny_model_dir, tmp_path):
    """The real path (TRL's GRPOTrainer + AgentRollout, constrained decoding) learns a choice the tiny
    random model can learn: PickEnv pays 1 iff the first (and only) tool call is `approve` — about a
    quarter of the base model's calls at temperature 1. Seed 0 goes from 1 success in 8 to 14 in the
    last 16; over seeds 0-5 the last two iterations averaged 0.75-0.94 (at lr 3e-2 one seed in three fell to
    zero success, where every group is identical and learning stops)."""
    cfg = TrainConfig(groups=2, group_size=4, iterations=8, learning_rate=1e-2, temperature=1.0, max_new_tokens=64,
                      max_steps_per_episode=2, save_every=100)
    ledger = RolloutLedger(tmp_path / "ledger.jsonl")
    train_adapter_mixture(tiny_model_dir, [TrainSource("pick", PickEnv, pick_tasks)], cfg, tmp_path / "pick", seed=0,
                          ledger=ledger, name="pick")
    rows = read_train_log(tmp_path / "pick")
    reward = [r["reward"] for r in rows]
    assert len(rows) == 8 and [r["success_rate"] for r in rows] == reward  # 0/1 env reward: reward == success
    first, last = reward[0], (reward[-1] + reward[-2]) / 2
    assert first <= 0.5 and last >= first + 0.25, reward


def test_the_shared_prompt_pass_scores_at_the_sampling_temperature_as_trls_own(tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    """The loss pass takes the log-probs of the distribution the rollouts were drawn from (logits / T), as TRL's
    own pass does: on the batch of a real iteration at T = 0.5 both give the same values on the trained tokens,
    and they differ from the temperature-1 log-probs."""
    import trace_lib.training.trainer as train_mod
    from trl import GRPOTrainer

    captured: list = []
    ours = train_mod.AgentGRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = ours(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if torch.is_grad_enabled() and not captured:
            captured.append((self, model, input_ids, attention_mask, logits_to_keep, self._score_mask))
        return out

    monkeypatch.setattr(train_mod.AgentGRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    cfg = TrainConfig(**{**FAST, "iterations": 1, "group_size": 4, "temperature": 0.5})
    ledger = RolloutLedger(tmp_path / "ledger.jsonl")
    train_adapter_mixture(tiny_model_dir, [TrainSource("p", lambda: ParityEnv(max_steps=3), kv_tasks)], cfg,
                          tmp_path / "p", seed=0, ledger=ledger, name="p")
    assert captured, "no loss pass ran: every group had equal rewards"
    trainer, model, ids, attention, keep, score = captured[0]
    assert trainer.temperature == 0.5
    scored = score.bool()
    with torch.no_grad():
        # both on the weights after the step
        mine = ours(trainer, model, ids, attention, keep)[0]
        trl = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, attention, keep)[0]
        trainer.temperature = 1.0  # TRL's fused head keeps the temperature it was built with; ours reads this
        at_one = ours(trainer, model, ids, attention, keep)[0]
    assert int(scored.sum()) > 0
    assert torch.allclose(mine[scored], trl[scored], atol=1e-4)
    assert float((mine[scored] - at_one[scored]).abs().max()) > 1e-2


def test_prompt_grad_false_reaches_the_loss_pass(tiny_model_dir, tmp_path, monkeypatch):
    """`train.prompt_grad: false` is what the trainer's loss pass runs with (its effect on the gradient:
    tests/training/test_shared_prompt.py)."""
    import trace_lib.training.grpo_trainer as train_mod

    seen: list = []
    real = train_mod.grouped_logps

    def spy(*args, **kwargs):
        if torch.is_grad_enabled():
            seen.append(kwargs.get("prompt_grad", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "grouped_logps", spy)
    cfg = TrainConfig(**{**FAST, "iterations": 1, "group_size": 4, "temperature": 0.5, "prompt_grad": False})
    train_adapter_mixture(tiny_model_dir, [TrainSource("p", lambda: ParityEnv(max_steps=3), kv_tasks)], cfg,
                          tmp_path / "p", seed=0, ledger=RolloutLedger(tmp_path / "ledger.jsonl"), name="p")
    assert seen and not any(seen)


def test_an_iteration_in_several_passes_gives_each_pass_whole_groups(tiny_model_dir, tmp_path, monkeypatch):
    """TRL shuffles an iteration's rows before it splits them into loss passes; with several passes the rows keep
    their order, so each pass holds whole groups (whose rows share their task's opening in the prefix tree), and
    TRL's shuffle is back in place afterwards."""
    import trace_lib.training.trainer as train_mod
    from trl.trainer import grpo_trainer

    passes: list = []
    real = train_mod.AgentGRPOTrainer.compute_loss

    def spy(self, model, inputs, *args, **kwargs):
        passes.append([tuple(row) for row in inputs["prompt_ids"].tolist()])
        return real(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(train_mod.AgentGRPOTrainer, "compute_loss", spy)
    shuffle = grpo_trainer.shuffle_sequence_dict
    train(tiny_model_dir, tmp_path, iterations=1, groups=4, group_size=2, micro_batch=2)
    assert len(passes) == 4 and all(len(rows) == 2 for rows in passes)
    assert all(rows[0] == rows[1] for rows in passes)  # one group's two rows: the same task
    assert len({rows[0] for rows in passes}) == 4  # four groups, one per pass
    assert grpo_trainer.shuffle_sequence_dict is shuffle


def test_several_passes_with_the_common_start_run_once_give_the_one_pass_gradient(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """An iteration in four passes, the rows' common start computed once for all of them (`SharedPrefix`), reaches
    the same gradient before clipping as the iteration in one pass (the same episodes: sampling comes first)."""
    import trace_lib.training.shared_prompt as shared_mod
    import trace_lib.training.grpo_trainer as train_mod

    monkeypatch.setattr(train_mod, "MIN_PREFIX_TOKENS", 1)  # the toy environment's prompts are short
    grads: dict[int, dict[str, torch.Tensor]] = {}
    runs: list[int] = []
    real_average, real_ensure = train_mod.distributed.average_gradients, shared_mod.SharedPrefix.ensure

    def capture(params):
        params = list(params)
        grads[runs[-1]] = {str(i): p.grad.clone() for i, p in enumerate(params) if p.grad is not None}
        return real_average(params)

    prefix_runs: list[int] = []
    monkeypatch.setattr(train_mod.distributed, "average_gradients", capture)
    monkeypatch.setattr(shared_mod.SharedPrefix, "ensure",
                        lambda self, *a: (self.cache is None and prefix_runs.append(runs[-1])) or real_ensure(self, *a))
    for micro in (8, 2):
        runs.append(micro)
        # fp32 whatever the CPU: the two ways sum the same gradients in another order
        train(tiny_model_dir, tmp_path / str(micro), iterations=1, groups=4, group_size=2, micro_batch=micro,
              dtype="float32")
    assert prefix_runs == [2]  # computed once, by the split iteration only
    assert grads[8].keys() == grads[2].keys() and grads[8]
    assert any(float(g.abs().sum()) > 0 for g in grads[8].values())
    for key, g in grads[8].items():
        assert torch.allclose(grads[2][key], g, atol=1e-6, rtol=1e-4), key


def test_grouped_logps_refuse_a_temperature_of_zero(tiny_model_dir):
    from trace_lib.training.shared_prompt import grouped_logps

    with pytest.raises(ValueError, match="temperature must be > 0"):
        grouped_logps(None, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 1,
                      temperature=0.0)


def test_mixture_training_runs(tiny_model_dir, tmp_path):
    cfg = TrainConfig(**{**FAST, "iterations": 1})
    srcs = [TrainSource("x", lambda: ParityEnv(max_steps=3), kv_tasks, 2.0),
            TrainSource("y", lambda: KVEnv(max_steps=3), kv_tasks, 1.0)]
    ledger = RolloutLedger(tmp_path / "ledger.jsonl")
    m = train_adapter_mixture(tiny_model_dir, srcs, cfg, tmp_path / "mix", seed=0, ledger=ledger, name="mix")
    assert m.config["sources"] == {"x": 2.0, "y": 1.0} and ledger.used("train", "mix") == 4


# --- cross-skill distillation -------------------------------------------------------------------------
def test_distill_advantages_are_the_teacher_minus_student_log_probs_on_trained_tokens():
    from trace_lib.training.grpo_trainer import distill_advantages

    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-1.0, -0.1, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert torch.equal(distill_advantages(student, teacher, mask), torch.tensor([[0.5, -0.5, 0.0], [2.0, 0.0, 0.0]]))


def _save_lora(model_dir, folder, seed):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), _lora())
    model.save_pretrained(folder)
    return folder


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False)


def test_distillation_scores_each_episode_with_the_teacher_of_its_source(tiny_model_dir, tmp_path, monkeypatch):
    """Rows of source `a` get teacher `a`'s log-probs, rows of `b` teacher `b`'s (a stand-in log-prob pass
    returns a constant per model and adapter), and every episode is trained though all rewards are equal."""
    import trace_lib.training.grpo_trainer as train_mod

    teachers = {"a": _save_lora(tiny_model_dir, tmp_path / "ta", 1),
                "b": _save_lora(tiny_model_dir, tmp_path / "tb", 2)}
    real = train_mod.grouped_logps
    seen: list = []

    def fake(model, ids, attention, keep, mask=None, compute_entropy=False, **kw):
        if torch.is_grad_enabled():  # the loss pass
            return real(model, ids, attention, keep, mask, compute_entropy, **kw)
        trainer = seen[-1]
        fill = {"a": -1.0, "b": -2.0}[trainer.teachers.adapter] if model is trainer.teachers.model else -3.0
        return torch.full((ids.shape[0], keep), fill), None

    original = train_mod.DistillGRPOTrainer._generate_and_score_completions
    captured: list = []

    def spy(self, inputs):
        seen.append(self)
        out = original(self, inputs)
        mask = out["completion_mask"] * out["tool_mask"]
        captured.append((out["advantages"], mask, [ep.source for ep in self.rollout_func.last]))
        return out

    monkeypatch.setattr(train_mod, "grouped_logps", fake)
    monkeypatch.setattr(train_mod.DistillGRPOTrainer, "_generate_and_score_completions", spy)
    cfg = TrainConfig(**{**FAST, "iterations": 1, "groups": 4})
    srcs = [TrainSource(name, lambda: KVEnv(max_steps=3), kv_tasks) for name in ("a", "b")]
    ledger = RolloutLedger(tmp_path / "ledger.jsonl")
    m = train_adapter_mixture(tiny_model_dir, srcs, cfg, tmp_path / "student", seed=0, ledger=ledger, name="distilled",
                              teachers=teachers)
    advantages, mask, sources = captured[0]
    assert sorted(set(sources)) == ["a", "b"]
    for row, source in enumerate(sources):
        assert torch.equal(advantages[row], {"a": 2.0, "b": 1.0}[source] * mask[row].float())
    assert m.config["teachers"] == {k: v.as_posix() for k, v in teachers.items()} and m.config["teachers_digest"]
    row = read_train_log(tmp_path / "student")[0]
    assert row["frac_reward_zero_std"] == 0.0 and row["trained_tokens"] > 0 and m.rollouts_used == 8
    kl = -float((advantages * mask).sum() / mask.sum())
    assert row["distill_kl"] == pytest.approx(kl, abs=1e-6)
    # the student's folder holds its own adapter only, and the teachers are untouched
    assert not any(p.is_dir() and p.name in teachers for p in (tmp_path / "student").iterdir())
    with pytest.raises(ValueError, match="one teacher per source"):
        train_adapter_mixture(tiny_model_dir, srcs, cfg, tmp_path / "other", seed=0, ledger=ledger, name="other",
                              teachers={"a": teachers["a"]})


def test_the_student_samples_at_temperature_one_and_trains_every_turn():
    from trace_lib.training.plan import distill_config

    cfg = TrainConfig(temperature=0.8, hint_fraction=0.5, start_late=0.5, learning_rate=5e-4, iterations=7,
                      distill={"iterations": 2, "learning_rate": 1e-4})
    d = distill_config(cfg)
    assert (d.iterations, d.learning_rate, d.temperature, d.hint_fraction, d.start_late, d.filter_lookup_only) == (
        2, 1e-4, 1.0, 0.0, 0.0, False)
    assert distill_config(TrainConfig(learning_rate=5e-4, distill={"iterations": 1})).learning_rate == 5e-4


def test_a_student_distilled_from_a_trained_teacher_learns_its_choice(tiny_model_dir, tmp_path):
    """The real path: a GRPO teacher that learned PickEnv's `approve` (as in the test above: 1/8 -> 8/8), then
    a fresh student distilled from it on-policy, rewarded by nothing but the teacher's log-probs: its success
    rises (seed 2: 0.375, 0.5, ... 0.625, 1.0) and the teacher's weights are untouched."""
    cfg = TrainConfig(groups=2, group_size=4, iterations=8, learning_rate=1e-2, temperature=1.0, max_new_tokens=64,
                      max_steps_per_episode=2, save_every=100)
    src = [TrainSource("pick", PickEnv, pick_tasks)]
    train_adapter_mixture(tiny_model_dir, src, cfg, tmp_path / "teacher", seed=0,
                          ledger=RolloutLedger(tmp_path / "t.jsonl"), name="pick")
    before = (tmp_path / "teacher" / "adapter_model.safetensors").read_bytes()
    teacher_rate = read_train_log(tmp_path / "teacher")[-1]["success_rate"]
    train_adapter_mixture(tiny_model_dir, src, cfg.model_copy(update={"iterations": 10}), tmp_path / "student",
                          seed=2, ledger=RolloutLedger(tmp_path / "s.jsonl"), name="distilled",
                          teachers={"pick": tmp_path / "teacher"})
    rows = read_train_log(tmp_path / "student")
    rate = [r["success_rate"] for r in rows]
    assert (tmp_path / "teacher" / "adapter_model.safetensors").read_bytes() == before
    assert all(isinstance(r["distill_kl"], float) and r["trained_tokens"] > 0 for r in rows)
    assert teacher_rate >= 0.75 and sum(rate[-3:]) / 3 >= sum(rate[:2]) / 2 + 0.25, rate


# --- the train stage ----------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::trace_lib.config.ProfileOverride")
def test_the_train_stage_reports_each_adapters_seconds_per_rollout_in_its_metrics_only(tmp_path, monkeypatch):
    """`reports/metrics/train.json`'s `timing` gives every trained adapter (capability adapters and baselines) its
    wall seconds over the rollouts it spent; data/ holds no timing. The trainings are stand-ins that write what
    `train_adapter_mixture` writes."""
    from trace_lib.config import params_from_dict
    from trace_lib.io import read_json, write_json
    from trace_lib.records import AdapterManifest
    from trace_lib.stages import train as stage
    from trace_lib.training import plan
    from trace_lib.training.trainer import planned_rollouts

    params = params_from_dict({"train": {"groups": 1, "group_size": 2, "reference_samples": 0, "iterations": 2, "baselines": ["grpo_target"],
                                         "distill": {"iterations": 0}, "lockstep": False}})
    seconds = {"cap": [3.0, 4.5], "grpo_target": [2.0, 2.5, 1.0, 1.5, 3.0]}

    class Box:  # the sandbox the capability's environment would be served by
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    late = {}

    def fake_train(model_dir, sources, cfg, out_dir, *, name, timing_path, **kw):
        late[name] = cfg.start_late
        out_dir.mkdir(parents=True)
        (out_dir / "train_log.jsonl").write_text('{"iteration": 1, "reward": 0.5}\n')
        times = seconds[name]
        write_json(timing_path, {"iterations": [{"iteration": i + 1, "seconds": t} for i, t in enumerate(times)],
                                 "total_seconds": sum(times), "seconds_per_iteration": sum(times) / len(times)})
        return AdapterManifest(capability_id=name, path=str(out_dir), base_model="tiny", env_sha256="", backend="trl",
                               rollouts_used=planned_rollouts(cfg), iterations=len(times))

    calibration = {"ok": True, "difficulty": 0, "start_late": 1.0}  # the capability trains where it was calibrated
    monkeypatch.setattr(stage, "valid_envs", lambda root: [SimpleNamespace(
        capability_id="cap", path="envs/cap", sha256="0", calibration=calibration, difficulty={"value": 0})])
    monkeypatch.setattr(stage, "SandboxProcess", Box)
    monkeypatch.setattr(plan, "trace_budget", lambda root, names, split: {"total": 6 + 4 * len(names)})
    monkeypatch.setattr(plan, "target_source", lambda env, split, root: None)
    monkeypatch.setattr(plan, "train_adapter_mixture", fake_train)
    metrics = stage.run_train(params, tmp_path)

    assert metrics == read_json(tmp_path / "reports/metrics/train.json")
    rollouts = {name: row["rollouts"] for name, row in metrics["adapters"].items()}
    assert rollouts == {"cap": 4, "grpo_target": 10}  # the baseline at TRACE's budget (6 + 4)
    for name, row in metrics["timing"].items():
        assert row["total_seconds"] == sum(seconds[name])
        assert row["seconds_per_rollout"] == row["total_seconds"] / rollouts[name]
    assert metrics["timing"]["cap"]["seconds_per_rollout"] == 7.5 / 4
    assert late == {"cap": 1.0, "grpo_target": params.train.start_late}
    data = [p.read_text() for p in (tmp_path / "data").rglob("*") if p.is_file() and "logs" not in p.parts]
    assert data and not any("seconds" in text for text in data)  # wall times: metrics and data/logs only
    assert plan.per_rollout({"total_seconds": 5.0}, 0)["seconds_per_rollout"] is None  # nothing spent


def test_the_train_stage_with_no_environment_writes_its_outputs_empty(tmp_path):
    """No capability kept (e.g. a base model that never succeeds): nothing trains, and every DVC output of the
    stage still exists, so the pipeline goes on and says why."""
    from trace_lib.config import params_from_dict
    from trace_lib.io import read_json, write_jsonl
    from trace_lib.stages import train as stage

    write_jsonl(tmp_path / "data/envs/manifests.jsonl", [])
    metrics = stage.run_train(params_from_dict({}), tmp_path)
    assert metrics["adapters"] == {} and metrics["note"] == "no validated environments: no adapters trained"
    assert (tmp_path / "data/train").is_dir() and (tmp_path / "data/adapters/manifests.jsonl").read_text() == ""
    assert read_json(tmp_path / "reports/metrics/train.json") == metrics


def test_the_baselines_get_tracess_discovery_and_calibration_even_when_no_environment_survived(tmp_path, monkeypatch):
    """Every environment dropped by calibration: TRACE trained nothing but spent its discovery and calibration
    rollouts, and GRPO on the target gets exactly those (a whole number of iterations of them)."""
    from trace_lib.config import params_from_dict
    from trace_lib.io import write_json
    from trace_lib.records import AdapterManifest
    from trace_lib.stages import train as stage
    from trace_lib.training import plan
    from trace_lib.training.trainer import planned_rollouts

    params = params_from_dict({"train": {"groups": 1, "group_size": 2, "reference_samples": 0, "baselines": ["grpo_target", "grpo_target_late"],
                                         "distill": {"iterations": 0}, "lockstep": False}})
    budgets = {}

    def fake_train(model_dir, sources, cfg, out_dir, *, name, timing_path, **kw):
        budgets[name] = (cfg.rollout_budget, planned_rollouts(cfg), cfg.start_late)
        out_dir.mkdir(parents=True)
        (out_dir / "train_log.jsonl").write_text('{"iteration": 1, "reward": 0.0}\n')
        write_json(timing_path, {"iterations": [], "total_seconds": 1.0, "seconds_per_iteration": 1.0})
        return AdapterManifest(capability_id=name, path=str(out_dir), base_model="tiny", env_sha256="", backend="trl",
                               rollouts_used=planned_rollouts(cfg), iterations=cfg.iterations)

    monkeypatch.setattr(stage, "valid_envs", lambda root: [])
    monkeypatch.setattr(plan, "trace_budget", lambda root, names, split: {"total": 48 + 96 + 3})
    monkeypatch.setattr(plan, "target_source", lambda env, split, root: None)
    monkeypatch.setattr(plan, "train_adapter_mixture", fake_train)
    metrics = stage.run_train(params, tmp_path)
    assert budgets == {"grpo_target": (147, 146, params.train.start_late), "grpo_target_late": (147, 146, 1.0)}
    assert metrics["trace_budget"] == 147 and metrics["baselines_skipped"] == {}


# --- reference samples (train.reference_samples) ----------------------------------------------------
KV_REFERENCE = lambda task: reference_steps(task)  # noqa: E731  (get_value, then "The answer: <value>")


def run_reference_rollout(policy, prompts, reference=KV_REFERENCE, **cfg_kw):
    cfg = TrainConfig(**{**FAST, "filter_lookup_only": False, **cfg_kw})
    spent = []
    ro = AgentRollout(policy, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, reference=reference)], cfg,
                      make_reward(cfg.reward), spent.append, seed=0)
    out = ro(prompts, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    return ro, out, spent


def test_a_reference_sample_has_the_token_ids_the_policy_would_have_sampled(scripted):
    cfg = TrainConfig(**{**FAST, "filter_lookup_only": False})
    task = kv_tasks([1001])[0]
    sampled = start_episode(scripted, "kv", 1001, task, 0, KVEnv(max_steps=3))
    play(scripted, [sampled], cfg, seed=0)  # batch row 0: looks k1 up, then says "The value is 10."
    said = [m for m in sampled.context if m.role == "assistant"]
    steps = [{"tool": "get_value", "arguments": {"key": "k1"}}, {"say": said[1].content}]
    ref = start_episode(scripted, "kv", 1001, task, 1, KVEnv(max_steps=3))
    assert play_reference(scripted, ref, steps, cfg) and ref.reference
    assert ref.prompt_ids == sampled.prompt_ids
    assert ref.completion_ids == sampled.completion_ids and ref.agent_mask == sampled.agent_mask
    assert ref.turns == sampled.turns and ref.context == sampled.context
    assert ref.env.reward() == sampled.env.reward() and ref.env.reward()[0] == 1.0
    # the trained sequence is the template's rendering of the conversation, token for token
    text = scripted.tokenizer.decode(ref.prompt_ids + ref.completion_ids)
    rendered = scripted.render(ref.context, ref.env.tool_schemas())  # it ends with the agent's answer
    want = text + "\n<|im_start|>assistant\n"
    i = next((i for i, (a, b) in enumerate(zip(rendered, want)) if a != b), min(len(rendered), len(want)))
    assert rendered == want, (rendered[i - 80:i + 80], want[i - 80:i + 80])


def test_reference_samples_join_each_group_with_the_environments_reward_and_their_tokens_in_the_loss(scripted):
    # k3 and k6 make the scripted policy look up forever (reward 0); their references answer (reward 1)
    ro, out, spent = run_reference_rollout(scripted, ["kv:1003"] * 2 + ["kv:1006"] * 2, reference_samples=1)
    assert spent == [4]  # a reference is a rollout
    assert [ep.reference for ep in ro.last] == [False, True, False, True]
    assert out["reward"] == [0.0, 1.0, 0.0, 1.0] and out["success"] == [False, True, False, True]
    ref = ro.last[1]
    assert out["env_mask"][1] == ref.agent_mask and sum(out["env_mask"][1]) > 0  # its group is mixed: trained
    assert ref.env.reward()[0] == 1.0 and "The answer: 30" in scripted.tokenizer.decode(out["completion_ids"][1])
    stats = ro.stats[0]
    assert stats["references"] == 2 and stats["reference_skipped"] == 0
    assert stats["success_rate_on_policy"] == 0.0 and stats["success_rate"] == 0.5
    assert stats["frac_groups_mixed_by_reference"] == 1.0 and stats["frac_reward_zero_std"] == 0.0
    assert stats["_timing"]["reference_seconds"] >= 0.0  # what playing the references cost (no decoding)


def test_a_broken_reference_is_skipped_counted_and_its_slot_sampled(scripted):
    bad_call = lambda task: [{"tool": "get_value", "arguments": {"key": "nope"}}, {"say": "0"}]  # noqa: E731
    wrong_answer = lambda task: [{"tool": "get_value", "arguments": {"key": "k1"}}, {"say": "I do not know."}]  # noqa: E731
    for reference in (bad_call, wrong_answer):
        ro, out, spent = run_reference_rollout(scripted, ["kv:1003"] * 2 + ["kv:1001"] * 2, reference=reference,
                                               reference_samples=1)
        assert spent == [4] and not any(ep.reference for ep in ro.last)
        assert ro.stats[0]["reference_skipped"] == 2 and ro.stats[0]["references"] == 0
        assert all(ep.env.done and ep.turns for ep in ro.last)  # every slot was sampled instead
        assert "nope" not in "".join(scripted.tokenizer.decode(c) for c in out["completion_ids"])


def test_reference_when_all_failed_guides_only_the_groups_without_a_success(scripted):
    # batch row 0 (k1) answers right, row 1 (k3) looks up forever; k1's second slot is sampled in a second round
    ro, out, spent = run_reference_rollout(scripted, ["kv:1001"] * 2 + ["kv:1003"] * 2, reference_samples=1,
                                           reference_when="all_failed")
    assert [ep.reference for ep in ro.last] == [False, False, False, True]
    assert out["reward"] == [1.0, 1.0, 0.0, 1.0] and spent == [4]
    assert all(ep.env.done and ep.turns for ep in ro.last) and ro.stats[0]["references"] == 1


def test_reference_samples_leave_a_sampled_episode_in_each_group_and_lockstep_refuses_all_failed():
    with pytest.raises(ValueError, match="reference_samples"):
        TrainConfig(group_size=4, reference_samples=4)
    with pytest.raises(ValueError, match="all_failed"):
        TrainConfig(group_size=4, reference_samples=1, reference_when="all_failed", lockstep=True)


def test_a_reference_is_trained_with_its_groups_advantage(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    original = AgentGRPOTrainer.compute_loss

    def spy(self, model, inputs, *args, **kwargs):
        seen.append({k: inputs[k].clone() for k in ("advantages", "completion_ids", "completion_mask")})
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(AgentGRPOTrainer, "compute_loss", spy)
    cfg = TrainConfig(**{**FAST, "groups": 1, "group_size": 4, "iterations": 1, "reference_samples": 1})
    never = lambda task: [{"tool": "escalate", "arguments": {}}]  # noqa: E731
    manifest = train_adapter_mixture(
        tiny_model_dir, [TrainSource("pick", lambda: PickEnv(target="escalate"), pick_tasks, reference=never)], cfg,
        tmp_path / "adapter", seed=0, ledger=RolloutLedger(tmp_path / "ledger.jsonl"), name="pick")
    assert manifest.rollouts_used == 4 and manifest.config["train"]["reference_samples"] == 1
    row = read_train_log(tmp_path / "adapter")[0]
    assert row["references"] == 1 and row["reference_skipped"] == 0
    batch = {k: torch.cat([s[k] for s in seen]) if k == "advantages" else [r for s in seen for r in s[k]]
             for k in seen[0]}
    tok_texts = [read_tokens(tiny_model_dir, ids, mask) for ids, mask in zip(batch["completion_ids"],
                                                                             batch["completion_mask"], strict=True)]
    refs = [i for i, t in enumerate(tok_texts) if '"name": "escalate"' in t]
    assert refs, tok_texts
    rewards = torch.tensor([1.0 if '"name": "escalate"' in t else 0.0 for t in tok_texts])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # TRL: group-normalised
    assert torch.allclose(batch["advantages"].flatten().float(), expected, atol=1e-3)


def read_tokens(model_dir, ids, mask) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.decode([int(i) for i, m in zip(ids, mask, strict=True) if m])


def test_a_training_without_reference_samples_records_its_config_as_before(tiny_model_dir, tmp_path):
    manifest, _ = train(tiny_model_dir, tmp_path, iterations=1)
    assert "reference_samples" not in manifest.config["train"] and "reference_when" not in manifest.config["train"]
    assert "references" not in read_train_log(tmp_path / "adapter")[0]
