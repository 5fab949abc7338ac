"""The episode loop that training, calibration and the transfer checks play through (`agent/episode.py`), against
the evaluation loop (`agent/rollout.py`): one task, one seed, the same turns and the same tokens."""

from __future__ import annotations

import json

import pytest
from scripted_tokens import ScriptedPolicy
from tiny_training import FAST, kv_tasks
from toy import ChattyKVEnv, KVEnv, kv_task

from trace_lib.agent.episode import (
    cut_before_skipped_turn,
    leading_steps,
    play,
    play_reference,
    preplayed_opening,
    reference_turn_ids,
    start_episode,
)
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.config import RolloutConfig, TrainConfig
from trace_lib.training.hints import reference_steps


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from trace_lib.engine.policy import load_policy

    base = load_policy(tiny_model_dir)
    return ScriptedPolicy(base.model, base.tokenizer, "tiny")


@pytest.fixture(scope="module")
def scripted_with_lora(tiny_model_dir):
    """The scripted policy over the tiny model with a fresh LoRA adapter, as training plays it."""
    from trace_lib.training.trainer import load_trainable

    policy, _ = load_trainable(tiny_model_dir, TrainConfig(), "trl", seed=0)
    return ScriptedPolicy(policy.model, policy.tokenizer, "tiny")


@pytest.mark.parametrize("continuous", [False, True])
def test_evaluation_and_training_play_a_task_to_the_same_messages_and_tokens(scripted, continuous):
    """k1 and k2 are looked up and answered (row 1 wrongly), k3 is looked up until the step limit."""
    tasks = [kv_task(i) for i in (1, 2, 3)]
    rollout = RolloutConfig(samples_per_task=1, batch_size=3, continuous_batching=continuous)
    trajectories, _ = collect_rollouts(scripted, lambda: KVEnv(max_steps=3), tasks, rollout, seed=7, progress=False)
    episodes = [start_episode(scripted, "kv", i, t, 0, KVEnv(max_steps=3)) for i, t in enumerate(tasks)]
    play(scripted, episodes, TrainConfig(continuous_batching=continuous, filter_lookup_only=False), seed=7)
    tools = KVEnv().tool_schemas()
    assert [t.reward for t in trajectories] == [ep.env.reward()[0] for ep in episodes] == [1.0, 0.0, 0.0]
    for traj, ep in zip(trajectories, episodes, strict=True):
        # the training sequence ends with the agent's last turn; the evaluation record also has the reply to it
        assert traj.messages[:len(ep.context)] == ep.context and len(traj.messages) - len(ep.context) == 1
        assert (traj.tool_calls, traj.turns) == (ep.tool_calls, len(ep.turns))
        evaluated = scripted.encode(scripted.render(traj.messages, tools))
        assert evaluated[:len(ep.prompt_ids) + len(ep.completion_ids)] == ep.prompt_ids + ep.completion_ids
        assert [(r.finish, r.scripted) for r in ep.turn_records] == [("stop", False)] * len(ep.turns)
        assert all(r.seconds >= 0.0 for r in ep.turn_records)


def test_a_turn_sampled_off_the_templates_rendering_is_where_the_two_paths_part(tiny_model_dir):
    """Evaluation re-renders the conversation before each turn; training keeps the sampled tokens. They agree on
    the opening and the first turn always, and after it exactly when that turn's tokens are the template's
    rendering of the message parsed from them (a random model's often are not)."""
    from trace_lib.engine.policy import load_policy

    policy = load_policy(tiny_model_dir)
    tasks = [kv_task(i) for i in (1, 2, 3)]
    rollout = RolloutConfig(samples_per_task=1, batch_size=3, temperature=0.8, max_new_tokens=24, tool_choice="first")
    trajectories, _ = collect_rollouts(policy, lambda: KVEnv(max_steps=3), tasks, rollout, seed=7, progress=False)
    episodes = [start_episode(policy, "kv", i, t, 0, KVEnv(max_steps=3)) for i, t in enumerate(tasks)]
    train = TrainConfig(temperature=0.8, max_new_tokens=24, tool_choice="first", filter_lookup_only=False)
    play(policy, episodes, train, seed=7)
    tools = KVEnv().tool_schemas()
    parted = []
    for traj, ep in zip(trajectories, episodes, strict=True):
        assert ep.prompt_ids == policy.encode(policy.render(traj.messages[:2], tools))
        assert traj.messages[2] == ep.context[2]
        start, end, _ = ep.turns[0]
        canonical = ep.completion_ids[start:end] == reference_turn_ids(policy, ep.context[:2], ep.context[2], tools)
        evaluated = policy.encode(policy.render(traj.messages, tools))
        through_first = len(ep.prompt_ids) + end
        assert (evaluated[:through_first] == (ep.prompt_ids + ep.completion_ids)[:through_first]) == canonical
        parted.append(not canonical)
    assert any(parted)


def test_each_turn_records_its_finish_and_whether_it_was_scripted(scripted, tiny_model_dir):
    cfg = TrainConfig(filter_lookup_only=False)
    reference = start_episode(scripted, "kv", 1, kv_task(1), 0, KVEnv(max_steps=3))
    steps = [{"tool": "get_value", "arguments": {"key": "k1"}}, {"say": "The value is 10."}]
    assert play_reference(scripted, reference, steps, cfg)
    assert [(r.finish, r.scripted, r.seconds) for r in reference.turn_records] == [("stop", True, 0.0)] * 2

    from trace_lib.engine.policy import load_policy

    policy = load_policy(tiny_model_dir)  # a random model: its turns run to the token limit
    cut = start_episode(policy, "kv", 1, kv_task(1), 0, KVEnv(max_steps=2))
    play(policy, [cut], TrainConfig(max_new_tokens=8, filter_lookup_only=False), seed=0)
    assert cut.turn_records and all(r.finish == "length" and not r.scripted for r in cut.turn_records)
    assert len(cut.turn_records) == len(cut.turns)


def test_cut_before_skipped_turn():
    assert cut_before_skipped_turn(lookup_only=True, episode_done=False, filter_lookup_only=True)
    assert not cut_before_skipped_turn(lookup_only=False, episode_done=False, filter_lookup_only=True)  # trained
    assert not cut_before_skipped_turn(lookup_only=True, episode_done=True, filter_lookup_only=True)  # maybe kept
    assert not cut_before_skipped_turn(lookup_only=True, episode_done=False, filter_lookup_only=False)


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


def test_a_reference_sample_has_the_token_ids_the_policy_would_have_sampled(scripted_with_lora):
    cfg = TrainConfig(**{**FAST, "filter_lookup_only": False})
    task = kv_tasks([1001])[0]
    sampled = start_episode(scripted_with_lora, "kv", 1001, task, 0, KVEnv(max_steps=3))
    play(scripted_with_lora, [sampled], cfg, seed=0)  # batch row 0: looks k1 up, then says "The value is 10."
    said = [m for m in sampled.context if m.role == "assistant"]
    steps = [{"tool": "get_value", "arguments": {"key": "k1"}}, {"say": said[1].content}]
    ref = start_episode(scripted_with_lora, "kv", 1001, task, 1, KVEnv(max_steps=3))
    assert play_reference(scripted_with_lora, ref, steps, cfg) and ref.reference
    assert ref.prompt_ids == sampled.prompt_ids
    assert ref.completion_ids == sampled.completion_ids and ref.agent_mask == sampled.agent_mask
    assert ref.turns == sampled.turns and ref.context == sampled.context
    assert ref.env.reward() == sampled.env.reward() and ref.env.reward()[0] == 1.0
    # the trained sequence is the template's rendering of the conversation, token for token
    text = scripted_with_lora.tokenizer.decode(ref.prompt_ids + ref.completion_ids)
    rendered = scripted_with_lora.render(ref.context, ref.env.tool_schemas())  # it ends with the agent's answer
    want = text + "\n<|im_start|>assistant\n"
    i = next((i for i, (a, b) in enumerate(zip(rendered, want)) if a != b), min(len(rendered), len(want)))
    assert rendered == want, (rendered[i - 80:i + 80], want[i - 80:i + 80])
