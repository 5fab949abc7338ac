"""The built-in retail environment played by a scripted agent: trajectories with known faults for analyst tests."""

from __future__ import annotations

from trace_lib.records import Message, Trajectory


def play_retail(tasks, mode: str = "gold") -> list[Trajectory]:
    """A scripted agent replaying each task's gold actions on the real environment.

    mode 'gold': confirm before writes and say the required outputs (scores 1);
    'no_confirm': skip the confirmation; 'no_auth': skip identity lookups; 'silent': never say
    the result; 'stop_early': stop before the last gold action.
    """
    from trace_lib.config import EnvConfig
    from trace_lib.envs import make_env

    env = make_env(EnvConfig())
    kinds = env.tool_kinds()
    out = []
    for task in tasks:
        env.reset(task)
        gold = list(task.gold_actions)
        if mode == "no_auth":
            gold = [g for g in gold if not g.name.startswith("find_user")]
        if mode == "stop_early":
            gold = gold[:-1]
        for i, g in enumerate(gold):
            if env.done:
                break
            if kinds[g.name] == "write" and mode != "no_confirm":
                env.step(Message(role="assistant", content="Shall I proceed with this change? (yes/no)"))
            if not env.done:
                env.step(Message(role="assistant", tool_calls=[g.model_copy(update={"id": f"c{i}"})]))
        if not env.done:
            said = "" if mode == "silent" else ", ".join(task.required_outputs)
            env.step(Message(role="assistant", content=f"Here is what I found: {said}. Anything else?"))
        reward, _ = env.reward()
        st = env.state
        out.append(Trajectory(id=f"{task.id}-{mode}", task_id=task.id, env="retail", family=task.family,
                              split=task.split, policy_id=f"scripted-{mode}", seed=0, messages=st.messages,
                              reward=reward, success=reward == 1.0, termination=st.termination or "agent_stop",
                              tool_calls=st.tool_calls, invalid_actions=st.invalid_actions,
                              tool_errors=st.tool_errors, turns=st.steps, prompt_tokens=0, completion_tokens=0))
    return out


def retail_tasks(per_family: int = 2):
    from trace_lib.config import EnvConfig
    from trace_lib.envs import make_tasks

    return make_tasks(EnvConfig(tasks_per_family=per_family), "train")


def retail_kinds() -> dict[str, str]:
    from trace_lib.config import EnvConfig
    from trace_lib.envs import make_env

    return make_env(EnvConfig()).tool_kinds()
