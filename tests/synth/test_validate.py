"""trace_lib.synth.validate and trace_lib.envs.synthetic on the modules in tests/synth_fixtures.

Every validate_env run and the shared `good_box` start one sandbox worker (~1-2 s each); the static
rejections start none.
"""

from __future__ import annotations

import gc
import json
import re
import time
from pathlib import Path

import pytest
from toy import Gen

from trace_lib.config import EnvConfig, ValidationConfig
from trace_lib.envs.retail.env import load_policy_text, retail_tool_specs
from trace_lib.envs.synthetic import (
    SyntheticEnv,
    TaskFormatError,
    synthetic_tasks,
    task_from_dict,
    to_trl_environment_factory,
    trl_reward,
    trl_rows,
)
from trace_lib.records import Message, ToolCall, ValidationReport
from trace_lib.sandbox import SandboxError, SandboxProcess, limits_from_config
from trace_lib.synth.validate import action_message, first_difference, validate_env

FIXTURES = Path(__file__).parents[1] / "synth_fixtures"
TARGET = EnvConfig(name="retail", tools="core")
CFG = ValidationConfig(n_seeds=4, timeout_s=20)
CHECKS = ["static", "loads", "contract", "interface", "deterministic", "diverse", "task_schema",
          "reference_solves", "do_nothing_fails", "random_fails"]


@pytest.fixture(scope="module")
def good_box():
    with SandboxProcess(FIXTURES / "good_lookup.py", limits_from_config(CFG)) as box:
        yield box


# --- validate_env -------------------------------------------------------------------------------------
class AlternatingPolicy:
    """Every other episode looks the order up and reports its status; the others give up."""

    policy_id = "alternating"

    def __init__(self) -> None:
        self.episodes = 0

    def generate(self, conversations, tools, *, temperature, top_p, max_new_tokens, seed, constrained,
                 require_tool_call=False):
        out = []
        for conv in conversations:
            last = conv[-1]
            if len(conv) == 2:
                self.episodes += 1
                if self.episodes % 2:
                    order_id = re.search(r"#W\d+", conv[1].content).group(0)
                    msg = Message(role="assistant", tool_calls=[ToolCall(name="get_order_details",
                                                                         arguments={"order_id": order_id})])
                else:
                    msg = Message(role="assistant", content="I cannot help with that.")
            else:
                msg = Message(role="assistant", content=f"Your order is {json.loads(last.content)['status']}.")
            out.append(Gen(text=msg.content, message=msg, prompt_tokens=1, completion_tokens=1))
        return out


class Ledger:
    def __init__(self) -> None:
        self.entries: list[tuple[str, int]] = []

    def add(self, stage: str, rollouts: int) -> None:
        self.entries.append((stage, rollouts))


def test_good_module_is_valid_and_in_band():
    ledger = Ledger()
    cfg = CFG.model_copy(update={"band": True, "band_seeds": 2, "band_samples": 4})
    report = validate_env(FIXTURES / "good_lookup.py", TARGET, cfg, 1, policy=AlternatingPolicy(), ledger=ledger)
    assert report.valid and report.failed is None, report
    assert [c.name for c in report.checks] == CHECKS + ["band"]
    assert report.capability == "communicate_result"
    assert "pass rate 0.50 over 8 rollouts" in report.checks[-1].detail
    assert ledger.entries == [("synthesize", 8)]
    assert ValidationReport.model_validate_json(report.model_dump_json()) == report


def test_band_out_of_range_fails():
    cfg = CFG.model_copy(update={"band": True, "band_seeds": 2, "band_samples": 2, "band_lo": 0.75})
    report = validate_env(FIXTURES / "good_lookup.py", TARGET, cfg, 1, policy=AlternatingPolicy())
    assert not report.valid and report.failed == "band"
    assert "pass rate 0.50" in report.checks[-1].detail


def test_band_needs_a_policy():
    cfg = CFG.model_copy(update={"band": True})
    report = validate_env(FIXTURES / "printing.py", TARGET, cfg, 1)  # prints must not corrupt the protocol
    assert report.valid, report
    assert [c.name for c in report.checks] == CHECKS


@pytest.mark.parametrize("fixture, check, detail", [
    ("bad_syntax", "static", "line 6: syntax error"),
    ("bad_import_os", "static", "line 3: import of 'os' is not allowed"),
    ("bad_subprocess", "static", "import of 'subprocess'"),
    ("bad_socket", "static", "import from 'socket'"),
    ("bad_open", "static", "the builtin 'open'"),
    ("bad_memory", "deterministic", "MemoryError"),
    ("bad_nondeterministic", "deterministic", "gave different tasks on two calls"),
    ("bad_schema", "interface", "get_order_details.function.parameters.properties: missing 'order_id'; "
                                "unexpected 'order_number'"),
    ("bad_reference", "reference_solves", "the reference fails on 4/4 seeds: seed 0: reward 0"),
    ("bad_trivial", "do_nothing_fails", "passes 4/4 seeds"),
    ("bad_always_zero", "reference_solves", "the reference fails on 4/4 seeds"),
    ("bad_sneaky", "deterministic", "attribute '__subclasses__' is not allowed"),
])
def test_broken_module_is_rejected(fixture, check, detail):
    report = validate_env(FIXTURES / f"{fixture}.py", TARGET, CFG, 1)
    assert not report.valid and report.failed == check, report
    failed = next(c for c in report.checks if not c.ok)
    assert detail in failed.detail, failed.detail


def test_infinite_loop_is_killed_in_time():
    start = time.monotonic()
    report = validate_env(FIXTURES / "bad_loop.py", TARGET, CFG.model_copy(update={"timeout_s": 2}), 1)
    assert time.monotonic() - start < 2 + 10  # worker start + deadline + kill, never a hang
    assert report.failed == "deterministic"
    assert "timed out after 2s in generate_task" in report.checks[-1].detail


def test_missing_file_and_out_of_range_difficulty(tmp_path):
    missing = validate_env(tmp_path / "nope.py", TARGET, CFG, 1)
    assert missing.failed == "static" and "cannot read the module" in missing.checks[0].detail
    report = validate_env(FIXTURES / "good_lookup.py", TARGET, CFG, 7)
    assert [c.name for c in report.checks] == ["static", "loads", "contract"]  # nothing after a broken contract
    assert report.checks[-1].detail == "difficulty 7 is outside DIFFICULTY [0, 3]"


def test_first_difference():
    assert first_difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 2}]}) is None
    assert first_difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}) == "a[1].b: 3, expected 2"
    assert first_difference({"a": 1}, {"b": 1}) == "(top): missing 'a'; unexpected 'b'"
    assert first_difference([1], [1, 2]) == "(top): 2 items, expected 1"
    assert first_difference({"x": 1}, {"x": 1.0}) == "x: 1.0, expected 1"


def test_action_message():
    msg = action_message({"tool": "get_order_details", "arguments": {"order_id": "#W1"}}, 3)
    assert msg.tool_calls[0].name == "get_order_details" and msg.tool_calls[0].id == "call_3_0"
    assert action_message({"say": "hi"}, 0).content == "hi"
    with pytest.raises(ValueError, match="action 1 is neither"):
        action_message({"do": "x"}, 1)


# --- tasks ---------------------------------------------------------------------------------------------
GOOD_TASK = {"instruction": "i", "user": {"reason_for_call": "hi", "known_info": {"order_id": "#W1"}},
             "gold_actions": [{"name": "get_order_details", "arguments": {"order_id": "#W1"}}],
             "required_outputs": ["pending"], "meta": {"k": 1}}


def test_task_from_dict():
    task = task_from_dict(GOOD_TASK, "cap", 5, 2, "train")
    assert (task.id, task.env, task.family, task.split) == ("synth/cap/5", "synth:cap", "cap", "train")
    assert task.capability_tags == ["cap"] and task.seed == 5 and task.difficulty == 2
    assert task.gold_actions[0].arguments == {"order_id": "#W1"} and task.meta == {"k": 1}


@pytest.mark.parametrize("change, message", [
    ({"extra": 1}, "task field 'extra' is not allowed"),
    ({"user": None}, "task field 'user'"),
    ({"user": {"known_info": {}}}, "task field 'user.reason_for_call': Field required"),
    ({"user": {"reason_for_call": "hi", "known_info": {"order_id": 7}}}, "task field 'user.known_info.order_id'"),
    ({"gold_actions": [{"arguments": {}}]}, "task field 'gold_actions.0.name'"),
    ({"seed": 6}, "task field 'seed' is 6, expected 5"),
])
def test_task_from_dict_names_the_bad_field(change, message):
    data = {**GOOD_TASK, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(TaskFormatError, match=re.escape(message)):
        task_from_dict(data, "cap", 5, 1, "train")
    with pytest.raises(TaskFormatError, match="returned list, expected a dict"):
        task_from_dict([], "cap", 5, 1, "train")


def test_synthetic_tasks(good_box):
    tasks = synthetic_tasks(good_box, "communicate_result", [3, 4], 1, "train")
    assert [t.id for t in tasks] == ["synth/communicate_result/3", "synth/communicate_result/4"]
    assert tasks[0].gold_actions[0].name == "get_order_details"
    assert tasks[0].required_outputs == [tasks[0].meta["status"]]


# --- SyntheticEnv ------------------------------------------------------------------------------------
def test_synthetic_env_episode(good_box):
    task = synthetic_tasks(good_box, "communicate_result", [1], 1, "train")[0]
    env = SyntheticEnv(good_box, TARGET)
    assert env.tool_schemas() == [s.to_schema() for s in retail_tool_specs("core")]
    assert env.tool_kinds()["cancel_pending_order"] == "write"
    opening = env.reset(task)
    assert opening[0].content == load_policy_text() and task.meta["order_id"] in opening[1].content
    result = env.step(Message(role="assistant", tool_calls=[
        ToolCall(name="get_order_details", arguments={"order_id": task.meta["order_id"]}, id="c0")]))
    assert not result.observations[0].error and json.loads(result.observations[0].content)["status"]
    bad = env.step(Message(role="assistant", tool_calls=[ToolCall(name="get_order_details", arguments={"order_id": "x"})]))
    assert bad.observations[0].error and bad.observations[0].content == "Error: Order not found"
    env.step(Message(role="assistant", content=f"Your order is {task.meta['status']}."))
    assert env.done and env.reward() == (1.0, {"termination": "user_stop", "evaluate": 1})


def test_envs_share_a_sandbox_and_release_their_worlds(good_box):
    task = synthetic_tasks(good_box, "communicate_result", [2], 1, "train")[0]
    first, second = SyntheticEnv(good_box, TARGET), SyntheticEnv(good_box, TARGET)
    first.reset(task)
    second.reset(task)
    handle = first._handle
    assert handle != second._handle
    del first
    gc.collect()
    assert handle in good_box._released  # queued by the finalizer, no I/O
    second.reset(task)  # the next init frees it in the worker
    with pytest.raises(SandboxError, match="unknown episode handle"):
        good_box.request("call_tool", handle=handle, name="get_order_details", arguments={})


# --- TRL -----------------------------------------------------------------------------------------------
def test_trl_environment_factory(good_box):
    import inspect

    from transformers.utils import get_json_schema

    cls = to_trl_environment_factory(good_box, TARGET, 1)
    public = {n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if not n.startswith("_")}
    specs = retail_tool_specs("core")
    assert public == {s.name for s in specs} | {"reset"}
    for spec in specs:  # what TRL shows the model is the target's tool
        schema = get_json_schema(getattr(cls, spec.name))["function"]
        assert schema["name"] == spec.name and schema["description"] == spec.description
        props = schema["parameters"]["properties"]
        assert {k: (v["type"], v["description"]) for k, v in props.items()} == {  # docstrings fold newlines
            k: (v["type"], " ".join(v["description"].split())) for k, v in spec.parameters["properties"].items()}
        assert schema["parameters"].get("required", []) == spec.parameters.get("required", [])

    env = cls()
    task = synthetic_tasks(good_box, "communicate_result", [6], 1, "train")[0]
    assert task.meta["order_id"] in env.reset(seed=6)
    observation = env.get_order_details(order_id=task.meta["order_id"])
    assert json.loads(observation)["status"] == task.meta["status"]
    done = [{"role": "assistant", "content": f"It is {task.meta['status']}."}]
    assert trl_reward([done, [{"role": "assistant", "content": "No idea."}]], [env, env]) == [1.0, 0.0]

    row = trl_rows([task], TARGET)[0]
    assert row["prompt"][0]["content"] == load_policy_text() and row["prompt"][-1] == {"role": "user", "content": ""}
    other = cls()
    assert task.meta["order_id"] in other.reset(**row)
    assert other.get_order_details(order_id="x") == "Error: Order not found"
