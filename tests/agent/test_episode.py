"""The episode loop that training, calibration and the transfer checks play through (`agent/episode.py`), against
the evaluation loop (`agent/rollout.py`): one task, one seed, the same turns and the same tokens."""

from __future__ import annotations

import pytest
from scripted_tokens import ScriptedPolicy
from toy import KVEnv, kv_task

from trace_lib.agent.episode import play, play_reference, reference_turn_ids, start_episode
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.config import RolloutConfig, TrainConfig


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from trace_lib.engine.policy import load_policy

    base = load_policy(tiny_model_dir)
    return ScriptedPolicy(base.model, base.tokenizer, "tiny")


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
