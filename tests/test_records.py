"""Records: JSONL round trips, strictness, stable bytes, and loading with `datasets`."""

import pytest
from pydantic import ValidationError

from trace_lib.io import read_jsonl, write_json, read_json, write_jsonl
from trace_lib.records import (
    AdapterManifest, Capability, CapabilityScore, Check, EvalResult, Label, Message, RouteDecision,
    SyntheticEnvManifest, Task, ToolCall, Trajectory, UserScenario, ValidationReport,
)


def make_task(i: int = 0) -> Task:
    return Task(
        id=f"retail/order_status/{i}", env="retail", split="train", family="order_status",
        instruction="Ask for the status of order #W0000001.",
        user=UserScenario(reason_for_call="Where is my order?", known_info={"order_id": "#W0000001"},
                          unknown_info=["email"]),
        gold_actions=[ToolCall(name="get_order_details", arguments={"order_id": "#W0000001"})],
        required_outputs=["delivered"], capability_tags=["communicate_result"], difficulty=1, seed=i,
    )


def make_trajectory(i: int = 0) -> Trajectory:
    return Trajectory(
        id=f"t{i}", task_id=f"retail/order_status/{i}", env="retail", family="order_status",
        split="train", policy_id="smollm2-135m", seed=0, sample=i,
        messages=[
            Message(role="system", content="policy"),
            Message(role="user", content="Where is my order #W0000001?"),
            Message(role="assistant", tool_calls=[ToolCall(name="get_order_details",
                                                           arguments={"order_id": "#W0000001"}, id="c0")]),
            Message(role="tool", name="get_order_details", tool_call_id="c0", content='{"status": "delivered"}'),
            Message(role="assistant", content="It was delivered."),
            Message(role="assistant", content="<tool_call>{oops", invalid="bad JSON in tool call"),
        ],
        reward=1.0, success=True, termination="user_stop", tool_calls=1, invalid_actions=1,
        tool_errors=0, turns=3, prompt_tokens=120, completion_tokens=30,
    )


SAMPLES = [
    make_task(),
    make_trajectory(),
    Capability(id="precondition_verification", name="Precondition verification",
               description="Check state before writing.", evidence=["t0"]),
    Label(trajectory_id="t0", capability_id="precondition_verification", label="LACKING", rationale="no read"),
    CapabilityScore(capability_id="c", n_pos=3, n_neg=4, e_pos=0, e_neg=2, er_pos=0.0, er_neg=0.5,
                    delta=0.5, coverage=0.5, delta_ci=(0.1, 0.9), kept=True),
    SyntheticEnvManifest(capability_id="c", source="template", path="data/envs/c/env.py", sha256="0" * 64,
                         target_env="retail", valid=True),
    AdapterManifest(capability_id="c", path="data/adapters/c", base_model="m", env_sha256="0" * 64,
                    backend="trl", rollouts_used=64, iterations=4),
    EvalResult(method="base", env="retail", split="test", n=10, successes=3, success_rate=0.3,
               ci_low=0.1, ci_high=0.6),
    ValidationReport(valid=False, checks=[Check(name="interface", ok=True), Check(name="reference_solves", ok=False,
                                                                                  detail="0/8")],
                     failed="reference_solves", capability="c"),
    RouteDecision(task_id="t", mode="top_p", candidates=["a", "b"], labels=[" A", " B", " C"],
                  probs=[0.5, 0.3, 0.2], label_mass=0.9, weights={"a": 0.5, "b": 0.3}),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_jsonl_round_trip(tmp_path, record):
    path = tmp_path / "r.jsonl"
    write_jsonl(path, [record, record])
    back = read_jsonl(path, type(record))
    assert back == [record, record]
    write_jsonl(tmp_path / "again.jsonl", back)
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()


def test_unknown_fields_and_bad_labels_rejected():
    data = make_task().model_dump()
    data["surprise"] = 1
    with pytest.raises(ValidationError, match="surprise"):
        Task.model_validate(data)
    with pytest.raises(ValidationError):
        Label(trajectory_id="t", capability_id="c", label="MAYBE")


def test_json_is_canonical(tmp_path):
    write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]})
    assert (tmp_path / "a.json").read_text().index('"a"') < (tmp_path / "a.json").read_text().index('"b"')
    assert read_json(tmp_path / "a.json") == {"a": [1, 2], "b": 1}


def test_bad_jsonl_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = Label(trajectory_id="t", capability_id="c", label="NA").model_dump_json()
    path.write_text(good + "\n{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(read_jsonl(path, Label))


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import os

    target = tmp_path / "out.jsonl"
    write_jsonl(target, [make_task()])
    before = target.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_jsonl(target, [make_task(1)])
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_trajectories_load_with_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "traj.jsonl"
    write_jsonl(path, [make_trajectory(0), make_trajectory(1)])
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == 2
    assert ds[0]["messages"][2]["tool_calls"][0]["name"] == "get_order_details"
    assert ds[1]["success"] is True


def test_atomic_write_makes_files_others_can_read(tmp_path):
    from trace_lib.io import atomic_write_text

    path = atomic_write_text(tmp_path / "a.txt", "x")
    assert path.stat().st_mode & 0o777 == 0o644
