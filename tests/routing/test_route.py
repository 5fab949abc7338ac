"""Router: label tokens, prompt, label probabilities, argmax/top-p, retrieval, baselines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_lib.engine.policy import load_policy
from trace_lib.records import Capability, Message, Task, Trajectory, UserScenario
from trace_lib.routing.route import (
    ANSWER_PREFIX,
    RetrievalIndex,
    RouteCandidate,
    RouteDecision,
    label_probabilities,
    label_token_ids,
    make_candidate,
    oracle_route,
    random_route,
    render_route_prompt,
    route_argmax,
    route_labels,
    route_prompt,
    route_task,
    route_tasks,
    route_top_p,
    task_opening,
)

CANDS = [
    RouteCandidate(capability_id="precondition_verification",
                   description="check an order's status before acting; refuse what the status forbids",
                   example="USER: cancel #W1\nAGENT calls get_order_details({\"order_id\": \"#W1\"})"),
    RouteCandidate(capability_id="structured_data_reasoning",
                   description="read the needed field out of nested tool results", example=""),
]
OPENINGS = ["Hi, please cancel my order #W2 right away.", "How much did I pay for order #W7?",
            "I forgot my email, can you still look up my account? My zip is 12345 and the gift card..."]


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    out = tmp_path_factory.mktemp("route_lora") / "a"
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                          LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                     init_lora_weights=False))  # random B: the adapter really changes outputs
    lora.save_pretrained(out)
    return load_policy(tiny_model_dir, adapters={"a": str(out)})


# --- labels and prompt ----------------------------------------------------------------------------
def test_route_labels_are_single_tokens_in_smollm2(smollm2_tokenizer):
    for n in (0, 1, 4, 25):
        labels = route_labels(n)
        assert len(labels) == n + 1 and labels[0] == " A"
        ids = label_token_ids(smollm2_tokenizer, labels)
        assert len(set(ids)) == n + 1
    with pytest.raises(ValueError, match="0 to 25"):
        route_labels(26)
    with pytest.raises(ValueError, match="not a single token"):
        label_token_ids(smollm2_tokenizer, [" A", " Qzxv"])


def test_route_prompt_shows_task_candidates_and_none(smollm2_tokenizer):
    msgs = route_prompt(OPENINGS[0], CANDS)
    text = msgs[-1].content
    assert msgs[-1].role == "user" and OPENINGS[0] in text
    assert "A. precondition verification: check an order's status" in text
    assert "B. structured data reasoning" in text and "C. none:" in text
    assert '| AGENT calls get_order_details({"order_id": "#W1"})' in text
    assert "(A, B, C)" in text and "Answer C if" in text
    rendered = render_route_prompt(smollm2_tokenizer, msgs)
    assert rendered.endswith("<|im_start|>assistant\n" + ANSWER_PREFIX)
    # the label is the next token in the rendered context too, not only after a bare 'Answer:'
    ids = label_token_ids(smollm2_tokenizer, route_labels(2))
    for label, tid in zip(route_labels(2), ids):
        full = smollm2_tokenizer(rendered + label, add_special_tokens=False)["input_ids"]
        assert full[:-1] == smollm2_tokenizer(rendered, add_special_tokens=False)["input_ids"] and full[-1] == tid


def test_task_opening_and_candidate_from_records():
    msgs = [Message(role="system", content="Retail policy: be nice. " * 50),
            Message(role="user", content="  I want to return a lamp. "),
            Message(role="assistant", content="Sure, your email?")]
    assert task_opening(msgs) == "I want to return a lamp."
    short = task_opening(msgs, system_chars=40)
    assert short.startswith("(agent policy, start) Retail policy")
    assert short.endswith("Customer: I want to return a lamp.")
    traj = Trajectory(id="t", task_id="x", env="retail", family="f", split="train", policy_id="p", seed=0,
                      messages=msgs, reward=1.0, success=True, termination="agent_stop", tool_calls=0,
                      invalid_actions=0, tool_errors=0, turns=1, prompt_tokens=0, completion_tokens=0)
    cand = make_candidate(Capability(id="c", name="C", description="do c"), traj, chars=30)
    assert cand.example.startswith("USER:") and "I want to return" in cand.example and len(cand.example) <= 30
    assert "Retail policy" not in cand.example


# --- scoring ---------------------------------------------------------------------------------------
def test_label_probabilities_batched_and_base_routed(policy):
    labels = route_labels(len(CANDS))
    prompts = [route_prompt(o, CANDS) for o in OPENINGS]
    probs = label_probabilities(policy, None, prompts, labels, batch_size=3)
    assert probs.shape == (3, 3) and np.allclose(probs.sum(axis=1), 1.0) and (probs > 0).all()
    assert not np.allclose(probs[0], probs[1])  # the prompts differ, so do the answers
    # left padding is exact: a row scored alone equals the row scored in a padded batch
    alone = np.stack([label_probabilities(policy.model, policy.tokenizer, [p], labels)[0] for p in prompts])
    np.testing.assert_allclose(probs, alone, atol=1e-5)
    # the base model routes, whichever adapter the policy has active
    policy.set_adapter("a")
    try:
        with torch.inference_mode():  # (with the adapter on, the answer would differ)
            first = policy.encode(render_route_prompt(policy.tokenizer, prompts[0]))
            on = policy.model(input_ids=torch.tensor([first]))
        ids = label_token_ids(policy.tokenizer, labels)
        assert not np.allclose(on.logits[0, -1, ids].double().softmax(-1).numpy(), probs[0], atol=1e-3)
        np.testing.assert_allclose(label_probabilities(policy, None, prompts, labels, batch_size=3), probs, atol=1e-6)
    finally:
        policy.set_adapter(None)


def test_route_task_decision(policy):
    d = route_task(policy, OPENINGS[1], CANDS, mode="argmax", task_id="t1")
    assert d.task_id == "t1" and d.candidates == [c.capability_id for c in CANDS] and d.labels == [" A", " B", " C"]
    assert abs(sum(d.probs) - 1) < 1e-9 and 0 < d.label_mass <= 1
    assert d.adapter == route_argmax(d.probs, CANDS)
    assert d.weights == ({} if d.adapter is None else {d.adapter: 1.0})
    t = route_task(policy, OPENINGS[1], CANDS, mode="top_p", top_p=1.0)
    assert t.probs == pytest.approx(d.probs) and t.base_weight == pytest.approx(d.probs[-1])
    assert RouteDecision.model_validate_json(t.model_dump_json()) == t
    with pytest.raises(ValueError, match="route mode"):
        route_task(policy, OPENINGS[1], CANDS, mode="best")


def test_argmax_and_top_p_on_constructed_probabilities():
    ids = ["x", "y"]
    assert route_argmax([0.5, 0.3, 0.2], ids) == "x"
    assert route_argmax([0.1, 0.2, 0.7], ids) is None  # the none-label: base model
    assert route_argmax([0.4, 0.4, 0.2], ids) == "x"  # ties: the earlier label
    assert route_top_p([0.5, 0.3, 0.2], ids, 0.5) == {"x": 1.0}
    assert route_top_p([0.5, 0.3, 0.2], ids, 0.7) == pytest.approx({"x": 0.625, "y": 0.375})
    w = route_top_p([0.5, 0.3, 0.2], ids, 0.9)  # none kept: its 0.2 stays with the base model
    assert w == pytest.approx({"x": 0.5, "y": 0.3})
    assert RouteDecision(mode="top_p", candidates=ids, labels=[" A", " B", " C"], probs=[0.5, 0.3, 0.2],
                         weights=w).base_weight == pytest.approx(0.2)
    assert route_top_p([0.1, 0.2, 0.7], ids, 0.6) == {}  # none alone reaches p: base model
    assert route_top_p([0.1, 0.2, 0.7], ids, 0.8) == pytest.approx({"y": 0.2 / 0.9})
    assert route_top_p([1.0], [], 0.9) == {}
    with pytest.raises(ValueError, match="top_p"):
        route_top_p([0.5, 0.3, 0.2], ids, 0.0)
    with pytest.raises(ValueError, match="candidates"):
        route_argmax([0.5, 0.5], ids)


# --- retrieval -------------------------------------------------------------------------------------
ITEMS = [
    ("refunds", "I want my money back for the broken blender I sent back last week."),
    ("address", "Please change the delivery address of my order to 12 Oak Street, Springfield."),
    ("login", "I forgot my account password and cannot sign in to the website."),
    ("refunds", "The headphones arrived damaged, please refund the full amount to my card."),
]


@pytest.fixture(scope="module")
def index():
    return RetrievalIndex.build(ITEMS)


def test_retrieval_returns_capability_of_most_similar_opening(index):
    assert index.top_k("Can I get a refund for the cracked toaster I returned?", 1) == ["refunds"]
    assert index.top_k("I moved house; ship my parcel to my new street address instead.", 1) == ["address"]
    assert index.top_k("My password does not work and I am locked out of my account.", 1) == ["login"]
    got = index.top_k("refund please", 3)
    assert got[0] == "refunds" and sorted(got) == ["address", "login", "refunds"]  # distinct ids
    assert index.top_k("refund please", 3, among={"address", "login"})[0] in {"address", "login"}
    assert index.search(["ship to my new street address"], 1, among={"login", "refunds"})[0][0] in {"login", "refunds"}


def test_route_tasks_with_retrieval(policy, index):
    cands = [RouteCandidate(capability_id=c, description=f"handles {c}") for c in ("refunds", "address", "login")]
    ds = route_tasks(policy, ["refund my blender", "new delivery address please"], cands, index=index, k=2,
                     task_ids=["t0", "t1"])
    assert [d.task_id for d in ds] == ["t0", "t1"]
    assert ds[0].candidates[0] == "refunds" and ds[1].candidates[0] == "address"
    assert all(len(d.candidates) == 2 and len(d.probs) == 3 for d in ds)


# --- baselines -------------------------------------------------------------------------------------
def _task(tags: list[str]) -> Task:
    return Task(id="t", env="retail", split="test", family="f", instruction="i",
                user=UserScenario(reason_for_call="r"), capability_tags=tags)


def test_oracle_route_uses_tags_priority_and_available_adapters():
    t = _task(["tool_call_precision", "precondition_verification", "communicate_result"])
    assert oracle_route(t, ["tool_call_precision", "precondition_verification"]) == "precondition_verification"
    assert oracle_route(t, ["tool_call_precision", "structured_data_reasoning"]) == "tool_call_precision"
    assert oracle_route(t, ["structured_data_reasoning"]) is None
    assert oracle_route(_task(["zeta", "alpha"]), ["zeta", "alpha"]) == "alpha"  # unlisted: alphabetical


def test_random_route_is_deterministic_and_covers_options():
    ids = ["x", "y", "z"]
    picks = [random_route(f"task-{i}", ids, seed=0) for i in range(200)]
    assert picks == [random_route(f"task-{i}", ids, seed=0) for i in range(200)]
    assert set(picks) == {"x", "y", "z", None}
    assert picks != [random_route(f"task-{i}", ids, seed=1) for i in range(200)]
    assert None not in {random_route(f"task-{i}", ids, seed=0, include_none=False) for i in range(50)}
    assert random_route("t", [], seed=0, include_none=False) is None
