"""GRPO batches from recorded episodes (`training/grpo.py`): loss masks, dropped groups, hints, late starts,
reference samples, rewards and mixed sources, driven by `AgentRollout` with a scripted policy over the tiny model
(exact token control)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from scripted_tokens import ScriptedPolicy
from tiny_training import FAST, kv_tasks
from toy import ChattyKVEnv, KVEnv

from trace_lib.config import TrainConfig
from trace_lib.records import Message
from trace_lib.agent.episode import TRUNCATION_MARK
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


def test_rollout_batches_mixed_sources(scripted):
    cfg = TrainConfig(**FAST)
    srcs = [TrainSource(n, lambda: KVEnv(max_steps=3), kv_tasks) for n in ("x", "y")]
    ro = AgentRollout(scripted, srcs, cfg, make_reward(cfg.reward), lambda n: None, seed=0)
    out = ro(["y:1001"] * 2 + ["x:1002"] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    assert [ep.source for ep in ro.last] == ["y", "y", "x", "x"]
    assert [ep.seed for ep in ro.last] == [1001, 1001, 1002, 1002]
    assert out["tool_calls"] == [1, 1, 1, 1]


KV_REFERENCE = lambda task: reference_steps(task)  # noqa: E731  (get_value, then "The answer: <value>")


def run_reference_rollout(policy, prompts, reference=KV_REFERENCE, **cfg_kw):
    cfg = TrainConfig(**{**FAST, "filter_lookup_only": False, **cfg_kw})
    spent = []
    ro = AgentRollout(policy, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, reference=reference)], cfg,
                      make_reward(cfg.reward), spent.append, seed=0)
    out = ro(prompts, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    return ro, out, spent


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
