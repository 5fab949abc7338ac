"""The rollout loop: concurrent episodes, records, metrics, invalid actions counted not raised."""

import pytest

from trace_lib.config import RolloutConfig
from trace_lib.envs.base import Environment
from trace_lib.records import Message
from trace_lib.agent.rollout import collect_rollouts, summarize

from toy import KVEnv, ScriptedPolicy, kv_task


def run(policy, n_tasks=5, samples=2, batch=3):
    tasks = [kv_task(i) for i in range(1, n_tasks + 1)]
    cfg = RolloutConfig(samples_per_task=samples, batch_size=batch)
    return collect_rollouts(policy, KVEnv, tasks, cfg, seed=7, progress=False)


def test_every_episode_is_recorded_in_stable_order():
    trajs, timing = run(ScriptedPolicy())
    assert [t.id for t in trajs] == sorted(f"toy/read/{i}#{s}" for i in range(1, 6) for s in range(2))
    assert all(t.success and t.reward == 1.0 for t in trajs)
    t = trajs[0]
    assert [m.role for m in t.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert t.messages[2].tool_calls[0].id == "call_0_0"
    assert (t.tool_calls, t.turns, t.invalid_actions, t.termination) == (1, 2, 0, "user_stop")
    assert (t.prompt_tokens, t.completion_tokens) == (20, 10)
    assert t.seconds is None
    assert timing.episodes == 10


def test_batch_is_refilled_as_episodes_finish():
    policy = ScriptedPolicy()
    run(policy, n_tasks=5, samples=1, batch=2)
    assert max(policy.calls) == 2
    assert sum(policy.calls) == 10  # 5 episodes x 2 agent turns, no idle slots until the queue empties


def test_invalid_actions_end_in_max_errors_and_score_zero():
    trajs, _ = run(ScriptedPolicy(bad_every=2), n_tasks=4, samples=1)
    bad = {t.task_id: t for t in trajs}
    t = bad["toy/read/2"]
    assert (t.success, t.reward, t.termination) == (False, 0.0, "max_errors")
    assert t.invalid_actions == 3
    assert t.messages[3].role == "tool" and t.messages[3].content.startswith("Error: invalid action")
    assert bad["toy/read/1"].success


def test_summary_rates_and_intervals():
    trajs, _ = run(ScriptedPolicy(bad_every=2), n_tasks=4, samples=1)
    s = summarize(trajs)
    assert (s["n"], s["successes"], s["success_rate"]) == (4, 2, 0.5)
    assert 0 < s["ci_low"] < 0.5 < s["ci_high"] < 1
    assert s["by_family"]["read"]["n"] == 4
    assert s["terminations"] == {"max_errors": 2, "user_stop": 2}
    assert s["invalid_action_rate"] == 6 / (6 + 4)


def _call(key: str) -> Message:
    from trace_lib.records import ToolCall

    return Message(role="assistant", tool_calls=[ToolCall(name="get_value", arguments={"key": key})])


def test_a_repeated_call_ends_the_episode_unrun_and_scores_zero():
    env: Environment = KVEnv(max_steps=6)
    env.end_on_repeat = True
    env.reset(kv_task(1))
    assert not env.step(_call("k1")).done
    assert not env.step(_call("k2")).done  # another argument is another call
    out = env.step(_call("k1"))
    assert (out.done, out.termination) == (True, "repeated_call")
    assert out.observations[0].error and "already called" in out.observations[0].content
    assert env.state.tool_calls == 2  # the repeat was not run
    assert env.reward() == (0.0, {"termination": "repeated_call"})


def test_repeats_are_allowed_unless_asked_and_make_env_sets_it():
    from trace_lib.config import EnvConfig
    from trace_lib.envs import make_env

    env: Environment = KVEnv(max_steps=6)
    env.reset(kv_task(1))
    for _ in range(3):
        assert not env.step(_call("k1")).done
    assert make_env(EnvConfig(end_on_repeated_call=True)).end_on_repeat
    assert not make_env(EnvConfig()).end_on_repeat


def test_step_after_done_is_an_error():
    env: Environment = KVEnv()
    env.reset(kv_task(1))
    env.step(Message(role="assistant", content="hi"))
    import pytest

    with pytest.raises(RuntimeError, match="finished episode"):
        env.step(Message(role="assistant", content="again"))


def test_tool_choice_first_requires_a_call_only_on_the_opening_turn():
    policy = ScriptedPolicy()
    tasks = [kv_task(i) for i in range(1, 3)]
    cfg = RolloutConfig(samples_per_task=1, batch_size=2, tool_choice="first")
    collect_rollouts(policy, KVEnv, tasks, cfg, seed=0, progress=False)
    assert policy.required == [[True, True], [False, False]]
    policy = ScriptedPolicy()
    collect_rollouts(policy, KVEnv, tasks, RolloutConfig(samples_per_task=1, batch_size=2), seed=0, progress=False)
    assert policy.required == [[False, False], [False, False]]


@pytest.mark.parametrize("constrained", [True, False])
def test_continuous_batching_plays_the_episodes_turn_by_turn_calls_play(tiny_model_dir, constrained):
    """Greedy, the tiny model: one `play_turns` call (turns joining a decoding batch, the queue refilling
    slots) records what one call per turn records; the rows' turns end at different steps."""
    from trace_lib.engine.policy import load_policy

    policy = load_policy(tiny_model_dir)
    policy.stop_ids = [*policy.stop_ids, *range(0, policy._vocab_size(), 7)]  # turns of many lengths
    tasks = [kv_task(i) for i in range(1, 6)]
    calls = []
    play_turns = policy.play_turns
    policy.play_turns = lambda *a, **kw: calls.append(1) or play_turns(*a, **kw)

    def rollouts(continuous):
        cfg = RolloutConfig(samples_per_task=1, batch_size=2, temperature=0.0, max_new_tokens=24,
                            constrained=constrained, tool_choice="first", continuous_batching=continuous)
        trajs, timing = collect_rollouts(policy, KVEnv, tasks, cfg, seed=7, progress=False)
        return [t.model_dump() for t in trajs], timing

    turn_by_turn, _ = rollouts(False)
    assert not calls
    continuous, timing = rollouts(True)
    assert calls == [1]
    assert continuous == turn_by_turn
    assert timing.episodes == 5 and timing.completion_tokens == sum(t["completion_tokens"] for t in continuous)
    assert len({len(m.get("content") or "") for t in continuous for m in t["messages"] if m["role"] == "assistant"}) > 2
