"""The openai policy backend (engine/remote.py) against a local server speaking the chat-completions API,
through the real OpenAI SDK: request shape, replies back to trace records, retries, concurrency, the
rollout stage on a server, and the stages that refuse it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from fake_openai import FakeOpenAI, completion, serving
from toy import KVEnv, kv_task

from trace_lib.engine.chat import normalize_tools, parse_assistant, row_seed
from trace_lib.engine.remote import OpenAIPolicy, ServerError, api_message, reply_text, route_probabilities
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.config import ConfigError, RolloutConfig, params_from_dict
from trace_lib.io import read_json, read_jsonl
from trace_lib.records import Message, ToolCall, Trajectory


def kv_agent(body: dict) -> tuple[int, dict]:
    """The toy KV task solved as a server would: look the key up, then say its value."""
    messages = body["messages"]
    last = messages[-1]
    if last["role"] == "user":
        key = messages[1]["content"].split("value of ")[1].rstrip("?")
        return 200, completion(calls=[("get_value", json.dumps({"key": key}))], finish="tool_calls")
    value = json.loads(last["content"].split("<tool_response>")[-1].split("</tool_response>")[0]
                       if "<tool_response>" in last["content"] else last["content"])["value"]
    return 200, completion(content=f"The value is {value}.")


def policy(url: str, **kw) -> OpenAIPolicy:
    return OpenAIPolicy(url, "smollm2-135m", **{"max_retries": 2, "timeout_s": 10, **kw})


def kv_tools() -> list[dict]:
    env = KVEnv()
    return env.tool_schemas()


def test_api_message_sends_arguments_as_json_text_and_drops_empty_fields():
    call = Message(role="assistant", tool_calls=[ToolCall(name="get_value", arguments={"key": "k1"}, id="c1")])
    assert api_message(call) == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "c1", "function": {"name": "get_value", "arguments": '{"key": "k1"}'}}]}
    no_id = api_message(Message(role="assistant", tool_calls=[ToolCall(name="get_value", arguments={})]))
    assert no_id["tool_calls"][0]["id"] == "call_0"
    invalid = Message(role="assistant", content="<tool_call>{", invalid="unclosed <tool_call>",
                      tool_calls=[ToolCall(name="x")])
    assert api_message(invalid) == {"role": "assistant", "content": "<tool_call>{"}
    assert api_message(Message(role="tool", content="{}", name="get_value", tool_call_id="c1")) == {
        "role": "tool", "content": "{}", "name": "get_value", "tool_call_id": "c1"}


def test_reply_text_parses_back_to_the_same_record_and_keeps_bad_arguments_for_the_parser():
    tools = kv_tools()
    fn = type("Fn", (), {})
    good, bad = fn(), fn()
    good.function = type("F", (), {"name": "get_value", "arguments": '{"key": "k2"}'})()
    bad.function = type("F", (), {"name": "get_value", "arguments": '{"key": '})()
    text = reply_text("Let me look.", [good])
    assert text == 'Let me look.\n<tool_call>\n{"name": "get_value", "arguments": {"key": "k2"}}\n</tool_call>'
    msg = parse_assistant(text, tools, turn=0)
    assert msg.invalid is None and [c.arguments for c in msg.tool_calls] == [{"key": "k2"}]
    assert parse_assistant(reply_text(None, [bad]), tools, turn=0).invalid  # an invalid action, not a crash
    assert reply_text("Hi.", None) == "Hi."
    as_object = fn()
    as_object.function = type("F", (), {"name": "get_value", "arguments": {"key": "k2"}})()
    assert reply_text("Let me look.\n", [as_object]) == text  # arguments as an object; the parser's newline dropped
    nameless = fn()
    nameless.function = None
    assert "unclosed" in parse_assistant(reply_text(None, [nameless]), tools, turn=0).invalid


def test_generate_sends_messages_tools_choice_seed_and_model_and_records_usage():
    with FakeOpenAI(kv_agent) as api:
        p = policy(api.url, adapters=["communicate_result"])
        env = KVEnv()
        env.reset(kv_task(3))
        convs = [env.state.messages, env.state.messages]
        out = p.generate(convs, env.tool_schemas(), temperature=0.5, top_p=0.9, max_new_tokens=32, seed=7,
                         constrained=True, require_tool_call=[True, False])
        p.set_adapter("communicate_result")
        p.generate(convs[:1], env.tool_schemas(), max_new_tokens=8, seed=1)
    first, second, third = api.bodies()
    assert sorted([first["tool_choice"], second["tool_choice"]]) == ["auto", "required"]
    by_seed = {b["seed"]: b for b in (first, second)}
    assert set(by_seed) == {row_seed(7, 0), row_seed(7, 1)} and by_seed[row_seed(7, 0)]["tool_choice"] == "required"
    assert first["model"] == "smollm2-135m" and third["model"] == "communicate_result"
    assert (first["temperature"], first["top_p"], first["max_tokens"]) == (0.5, 0.9, 32)
    assert first["tools"] == normalize_tools(env.tool_schemas())
    assert "chat_template_kwargs" not in first  # json: the trace template's default, nothing to ask of the server
    assert [m["role"] for m in first["messages"]] == [m.role for m in env.state.messages]
    assert [g.message.tool_calls[0].arguments for g in out] == [{"key": "k3"}] * 2
    assert (out[0].prompt_tokens, out[0].completion_tokens) == (40, 9)
    assert (p.stats.calls, p.stats.requests, p.stats.prompt_tokens) == (2, 3, 120)
    assert p.policy_id == "smollm2-135m+communicate_result"
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        p.set_adapter("nope")


def test_a_length_cut_reply_is_reported_as_such():
    with FakeOpenAI(lambda body: (200, completion(content="The val", finish="length"))) as api:
        out = policy(api.url).generate([[Message(role="user", content="hi")]], [], max_new_tokens=2)
    assert (out[0].text, out[0].finish_reason, out[0].message.content) == ("The val", "length", "The val")
    assert "tools" not in api.bodies()[0]
    # a tool parser that closes a call cut at max_tokens says "tool_calls"; the token count says "length"
    closed = completion(calls=[("get_value", '{"key": "k1"}')], finish="tool_calls", completion_tokens=16)
    with FakeOpenAI(lambda body: (200, closed)) as api:
        out = policy(api.url).generate([[Message(role="user", content="hi")]], kv_tools(), max_new_tokens=16)
    assert out[0].finish_reason == "length" and out[0].message.tool_calls


@pytest.mark.parametrize("reply", [
    {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []},
    {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [{"index": 0}]},
    {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": "oops"},
    {**completion(content="ok"), "usage": {"prompt_tokens": "x", "completion_tokens": 1, "total_tokens": 1}},
])
def test_an_unusable_reply_is_a_clear_error(reply):
    with FakeOpenAI(lambda body: (200, reply)) as api:
        with pytest.raises(ServerError, match="'smollm2-135m' sent an unusable reply"):
            policy(api.url).generate([[Message(role="user", content="hi")]], [])


def test_a_turn_the_server_refuses_is_an_invalid_action_not_a_crash():
    refusal = {"error": {"message": "This model's maximum context length is 8192 tokens", "type": "BadRequestError",
                         "code": 400}}
    with FakeOpenAI(lambda body: (400, refusal)) as api:
        p = policy(api.url)
        trajs, _ = collect_rollouts(p, KVEnv, [kv_task(1)], RolloutConfig(samples_per_task=1, batch_size=1,
                                                                             temperature=0.0), seed=0, progress=False)
    assert len(api.requests) == 3  # a 400 is not retried; the episode goes on until its error limit
    first = trajs[0].messages[2]
    assert first.invalid.startswith("the server rejected the turn (400)") and "maximum context length" in first.invalid
    assert trajs[0].termination == "max_errors" and p.stats.rejected == 3


def test_transient_faults_are_retried_and_a_dead_server_is_a_clear_error():
    answers = iter([(503, {"error": {"message": "busy"}}), (200, completion(content="ok"))])
    with FakeOpenAI(lambda body: next(answers)) as api:
        out = policy(api.url).generate([[Message(role="user", content="hi")]], [])
    assert out[0].text == "ok" and len(api.requests) == 2
    with FakeOpenAI(lambda body: (500, {"error": {"message": "boom"}})) as api:
        with pytest.raises(ServerError, match=r"127\.0\.0\.1.*'smollm2-135m' did not answer"):
            policy(api.url, max_retries=1).generate([[Message(role="user", content="hi")]], [])
    assert len(api.requests) == 2  # the first try and one retry


def test_requests_of_a_call_are_in_flight_together_up_to_the_bound():
    with FakeOpenAI(lambda body: (200, completion(content="ok")), delay=0.5) as api:
        policy(api.url, concurrency=3).generate([[Message(role="user", content=str(i))] for i in range(6)], [])
    assert api.max_in_flight == 3


def test_episodes_played_through_a_server_are_ordinary_trajectories():
    tasks = [kv_task(i) for i in (1, 2, 3)]
    cfg = RolloutConfig(samples_per_task=1, batch_size=2, temperature=0.0, constrained=True, tool_choice="first")
    with FakeOpenAI(kv_agent) as api:
        trajs, timing = collect_rollouts(policy(api.url), KVEnv, tasks, cfg, seed=0, progress=False)
    assert [t.id for t in trajs] == ["toy/read/1#0", "toy/read/2#0", "toy/read/3#0"]
    assert all(t.success and t.tool_calls == 1 and t.policy_id == "smollm2-135m" for t in trajs)
    assert [m.role for m in trajs[0].messages][-4:] == ["assistant", "tool", "assistant", "user"]
    assert trajs[0].prompt_tokens == 80 and trajs[0].completion_tokens == 18
    choices = [b["tool_choice"] for b in api.bodies()]
    assert choices.count("required") == 3 and choices.count("auto") == 3  # a tool call forced on turn 1 only


def test_adapters_load_at_run_time_and_the_config_names_server_model_and_key(monkeypatch):
    served = {"old"}

    def answer(body):
        name = body.get("lora_name")
        if name == "broken":
            return 404, {"error": {"message": "Not Found"}}
        if name is not None and "lora_path" not in body:  # unload
            served.discard(name)
            return 200, {}
        if name is not None:
            if name in served:
                return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}}
            served.add(name)
            return 200, {}
        return 200, completion(content="ok")

    with FakeOpenAI(answer) as api:
        p = policy(api.url, adapters=["old"])
        p.load_adapter("new", "/adapters/new")
        p.load_adapter("old", "/adapters/old")  # already served: unloaded and loaded again from the folder
        p.set_adapter("new")
        p.generate([[Message(role="user", content="hi")]], [])
        with pytest.raises(ServerError, match="loading adapter 'broken'.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            p.load_adapter("broken", "/adapters/broken")
    assert [(path, b) for path, b in api.requests if "lora" in path][:4] == [
        ("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"}),
        ("/v1/load_lora_adapter", {"lora_name": "old", "lora_path": "/adapters/old"}),
        ("/v1/unload_lora_adapter", {"lora_name": "old"}),
        ("/v1/load_lora_adapter", {"lora_name": "old", "lora_path": "/adapters/old"})]
    assert p.adapters == ["new", "old"] and api.bodies()[0]["model"] == "new"
    monkeypatch.setenv("MY_KEY", "sk-test")
    cfg = params_from_dict({"policy": {"backend": "openai", "base_url": api.url, "api_key_env": "MY_KEY",
                                       "concurrency": 3}}).policy
    q = OpenAIPolicy.from_config(cfg, default_model="smollm2-135m")
    assert (q.served_model, q.client.api_key, q.concurrency, q.policy_id) == ("smollm2-135m", "sk-test", 3,
                                                                              "smollm2-135m")
    monkeypatch.delenv("MY_KEY")
    assert OpenAIPolicy.from_config(cfg, default_model="x").client.api_key == "EMPTY"


def test_openai_backend_needs_a_server():
    with pytest.raises(ConfigError, match="policy.base_url is required"):
        params_from_dict({"policy": {"backend": "openai"}}, "params.yaml")


def test_route_labels_are_scored_from_the_servers_top_logprobs_by_the_base_model():
    from trace_lib.routing.route import RouteCandidate, label_probabilities, route_labels, route_tasks

    question = [Message(role="user", content="Which adapter?")]
    with FakeOpenAI(serving) as api:
        p = policy(api.url, adapters=["x"])
        p.set_adapter("x")  # the base model routes whatever adapter is active
        probs, mass = p.label_scores([question, question], [" A", " B", " C"], "Answer:")
        cands = [RouteCandidate(capability_id=c, description=c) for c in ("alpha", "beta")]
        decisions = route_tasks(p, ["I want a refund.", "Where is my order?"], cands, task_ids=["t1", "t2"])
        with pytest.raises(TypeError, match="as messages"):
            label_probabilities(p, None, ["<|im_start|>user ... Answer:"], route_labels(1))
    a, b, c = math.exp(-1.2), math.exp(-0.4), math.exp(-2.0)  # ' C' unseen: bounded by the least alternative
    assert probs.shape == (2, 3) and np.allclose(probs[0], np.array([a, b, c]) / (a + b + c))
    assert np.allclose(mass, a + b)
    body = api.bodies()[0]
    assert body["model"] == "smollm2-135m" and body["messages"][-1] == {"role": "assistant", "content": "Answer:"}
    assert body["messages"][:-1] == [api_message(question[0])]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert (body["max_tokens"], body["logprobs"], body["top_logprobs"], body["temperature"]) == (1, True, 20, 0.0)
    assert [(d.task_id, d.weights) for d in decisions] == [("t1", {"beta": 1.0}), ("t2", {"beta": 1.0})]
    assert np.isclose(decisions[0].label_mass, a + b) and p.stats.requests == 4


def test_route_probabilities_bound_an_unseen_label_by_the_least_alternative_and_no_label_goes_to_none():
    probs, mass = route_probabilities({" A": -0.5, " C": -2.3, "x": -3.0}, [" A", " B", " C"])
    assert np.allclose(probs, np.exp([-0.5, -3.0, -2.3]) / np.exp([-0.5, -3.0, -2.3]).sum())
    assert np.isclose(mass, math.exp(-0.5) + math.exp(-2.3))  # of the labels the server returned
    assert route_probabilities({}, [" A", " B"]) == ([0.0, 1.0], 0.0)


def lora_folder(folder: Path, seed: int, r: int) -> Path:
    """A saved LoRA adapter (one module) written directly: what `engine.adapters.cat_adapter` reads."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.randn(r, 8, generator=g),
               f"{key}.lora_B.weight": torch.randn(8, r, generator=g)}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"],
        "base_model_name_or_path": "m", "bias": "none"}))
    return folder


def test_routes_are_served_by_name_and_a_merge_as_one_concatenated_adapter_loaded_once(tmp_path):
    from trace_lib.evaluation.runner import evaluate_policy
    from trace_lib.engine.compose import apply_route

    folders = {n: lora_folder(tmp_path / n, i, r) for i, (n, r) in enumerate((("a", 4), ("b", 2)))}
    tasks = [kv_task(i) for i in (1, 2, 3, 4)]
    routing = {tasks[0].id: {}, tasks[1].id: {"a": 1.0}, tasks[2].id: {"a": 0.6, "b": 0.4},
               tasks[3].id: {"b": 0.4, "a": 0.6}}
    cfg = RolloutConfig(samples_per_task=1, batch_size=4, temperature=0.0, constrained=True, tool_choice="first")

    def agent(body):
        return serving(body) if "lora_name" in body else kv_agent(body)

    with FakeOpenAI(agent) as api:
        p = policy(api.url, adapters=["served"], route_dir=tmp_path / "routes")
        for name, folder in folders.items():
            p.load_adapter(name, str(folder))
        trajs = evaluate_policy(p, tasks, KVEnv, cfg, seed=0, routing=routing)
        with pytest.raises(ValueError, match=r"a merge of \['served'\] needs their folders"):
            with apply_route(p, {"served": 0.5, "a": 0.5}):
                pass
    routes = list((tmp_path / "routes").iterdir())
    assert len(routes) == 1 and sorted(f.name for f in routes[0].iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((routes[0] / "adapter_config.json").read_text())["r"] == 6
    loads = [b for path, b in api.requests if path == "/v1/load_lora_adapter"]
    assert loads[2:] == [{"lora_name": routes[0].name, "lora_path": str(routes[0].resolve())}]  # once for both
    models = {b["model"] for b in api.bodies()}
    assert models == {"smollm2-135m", "a", routes[0].name}
    assert [(t.adapter, t.policy_id) for t in trajs] == [
        (None, "smollm2-135m"), ("a", "smollm2-135m+a"), ("merge[a=0.6,b=0.4]", "smollm2-135m+merge[a=0.6,b=0.4]"),
        ("merge[a=0.6,b=0.4]", "smollm2-135m+merge[a=0.6,b=0.4]")]
    assert all(t.success for t in trajs) and p.adapter is None and p.policy_id == "smollm2-135m"


@pytest.mark.filterwarnings("ignore::trace_lib.config.ProfileOverride")
def test_the_rollout_stage_runs_on_a_server_without_a_local_model(tmp_path, monkeypatch):
    def polite(body):
        return 200, completion(content="Sorry, I cannot help with that.")

    monkeypatch.chdir(tmp_path)
    with FakeOpenAI(polite) as api:
        params = params_from_dict({
            "policy": {"backend": "openai", "base_url": api.url, "served_model": "smol"},
            "env": {"tasks_per_family": 1}, "rollout": {"max_tasks": 2, "samples_per_task": 1}})
        from trace_lib.stages.rollout import run_rollout

        metrics = run_rollout(params, Path("."), progress=False)
    trajs = read_jsonl(Path("data/rollouts/train.jsonl"), Trajectory)
    assert len(trajs) == 2 and all(t.policy_id == "smol" for t in trajs)
    saved = read_json(Path("reports/metrics/rollout.json"))
    assert saved["backend"] == "openai" and saved["server"]["requests"] == len(api.bodies()) >= 2
    assert metrics["policy_id"] == "smol" and not Path(params.model.out_dir).exists()
    assert {json.dumps(b["chat_template_kwargs"]) for b in api.bodies()} == {'{"tool_format": "signature"}'}  # cpu profile


def test_the_vllm_command_serves_trace_chat_format_and_named_adapters():
    from trace_lib.engine.serve import chat_template_path, vllm_command

    cmd = vllm_command("/venv/bin/python", "data/model", 8000, served_name="smollm2-135m",
                       adapters={"tool_call_precision": "a/tcp", "communicate_result": "a/cr"})
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flag = {k: v for k, v in zip(cmd, cmd[1:]) if k.startswith("--")}
    assert (flag["--model"], flag["--served-model-name"], flag["--port"]) == ("data/model", "smollm2-135m", "8000")
    assert flag["--tool-call-parser"] == "hermes" and Path(flag["--chat-template"]) == chat_template_path()
    assert chat_template_path().is_file() and "--enable-auto-tool-choice" in cmd and "--enable-lora" in cmd
    assert cmd[cmd.index("--lora-modules") + 1:] == ["communicate_result=a/cr", "tool_call_precision=a/tcp"]
    assert flag["--max-loras"] == "2"


HEALTH_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_process_is_waited_for_and_stopped_and_a_dead_one_is_a_clear_error():
    import sys

    from trace_lib.engine.serve import ServerProcess, free_port, healthy

    port = free_port()
    with ServerProcess("fake", [sys.executable, "-c", HEALTH_SERVER, str(port)], port, timeout=30) as server:
        assert healthy(f"{server.base}/health") and server.startup_seconds > 0
    assert server.proc.poll() is not None and not Path(server.log.name).exists()
    with pytest.raises(RuntimeError, match=r"fake exited with code 3: boom \(log "):
        with ServerProcess("fake", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], free_port()):
            pass
