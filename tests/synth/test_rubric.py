"""Multi-level rewards (trace_lib.synth.rubric): verdicts, item means, and a rubric through the sandbox."""

from __future__ import annotations

import math

import pytest
from toy import CONTRACT_STUB

from trace_lib.config import EnvConfig
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.records import Message, ToolCall
from trace_lib.synth.rubric import RubricError, item_means, rubric, share, verdict
from trace_lib.sandbox import SandboxError, SandboxLimits, SandboxProcess
from trace_lib.synth.templates import render_template_module

TARGET = {"name": "retail", "tools": "core"}


def test_zero_one_verdicts_have_no_items():
    assert verdict(1) == {"score": 1.0, "steps": {}, "gates": {}}
    assert verdict(False) == {"score": 0.0, "steps": {}, "gates": {}}


def test_score_is_the_mean_of_steps_when_every_gate_holds():
    v = verdict(rubric({"read": True, "said": 0.5}, {"no_write": True}))
    assert v == {"score": 0.75, "steps": {"read": 1.0, "said": 0.5}, "gates": {"no_write": True}}
    assert verdict(rubric({"read": True, "said": 1.0}))["score"] == 1.0
    assert verdict(rubric({"read": True, "said": 1.0}, {"no_write": False}))["score"] == 0.0


@pytest.mark.parametrize("value, message", [
    (0.5, r"evaluate returned 0.5, expected 0, 1 or a rubric"),
    ("1", r"evaluate returned '1'"),
    ({"steps": {}}, r"rubric 'steps' is \{\}, expected a non-empty dict"),
    ({"steps": {"a": 2}}, r"rubric step 'a' is 2, expected a number in \[0, 1\]"),
    ({"steps": {"a": math.nan}}, r"rubric step 'a' is nan"),
    ({"steps": {"a": "yes"}}, r"rubric step 'a' is 'yes'"),
    ({"steps": {"a": 1}, "gates": {"g": "no"}}, r"rubric gates \{'g': 'no'\} are not bools"),
    ({"steps": {"a": 1}, "gates": [True]}, r"rubric 'gates' is \[True\], expected a dict"),
    ({"steps": {"a": 1}, "score": 1}, r"rubric has unknown keys \['score'\]"),
    ({"steps": {"": 1}}, r"rubric item name '' is not a non-empty string"),
])
def test_malformed_verdicts_are_rejected_with_the_reason(value, message):
    with pytest.raises(RubricError, match=message):
        verdict(value)


def test_share_and_item_means():
    assert share([]) == 1.0 and share([True, False, False, True]) == 0.5
    means = item_means([rubric({"read": 1, "said": 0.5}, {"no_write": True}), None,
                        rubric({"read": 0, "said": 1.0}, {"no_write": False})])
    assert means == {"read": 0.5, "said": 0.75, "no_write": 0.5}
    assert list(means) == ["read", "said", "no_write"]  # steps, then gates
    assert item_means([None, {"steps": {}, "gates": {}}]) == {}


BROKEN = CONTRACT_STUB.replace("def evaluate(trajectory, task, state): return 0",
                               'def evaluate(trajectory, task, state): return {"steps": {"read": 1.5}}')


def test_a_malformed_rubric_from_a_module_is_a_clear_sandbox_error(tmp_path):
    path = tmp_path / "env.py"
    path.write_text(BROKEN)
    with SandboxProcess(path, SandboxLimits(timeout_s=30)) as box:
        box.request("init", handle="h", task={})
        with pytest.raises(SandboxError, match=r"rubric step 'read' is 1.5, expected a number in \[0, 1\]"):
            box.request("evaluate", handle="h", trajectory={"messages": []}, task={})
        assert box.alive


def test_a_template_environment_records_its_rubric(tmp_path):
    """Through the sandbox: the lookup done and the answer withheld scores half, with both items named."""
    path = tmp_path / "env.py"
    path.write_text(render_template_module("communicate_result", TARGET, 0))
    with SandboxProcess(path, SandboxLimits(timeout_s=60)) as box:
        task = synthetic_tasks(box, "communicate_result", [3], 0, "train")[0]
        env = SyntheticEnv(box, EnvConfig(**TARGET))
        env.reset(task)
        gold = task.gold_actions[0]
        env.step(Message(role="assistant", tool_calls=[ToolCall(name=gold.name, arguments=gold.arguments, id="c0")]))
        env.step(Message(role="assistant", content="I have looked it up for you."))
        assert env.done
        score, info = env.reward()
        assert score == 0.5 and info["evaluate"] == 0.5
        assert info["rubric"] == {"steps": {"orders_read": 1.0, "facts_said": 0.0}, "gates": {"no_write": True}}
