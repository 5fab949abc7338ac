"""Policy: batched decoding, determinism, prefix caching, stopping, adapters (tiny random model)."""

from __future__ import annotations

import json

import pytest
import torch

from trace_lib.engine.kvcache import append_rows, shared_prefix
from trace_lib.engine.chat import parse_assistant
from trace_lib.engine.sampling import exponential_draw, sample_tokens
from trace_lib.engine.policy import Generation, load_policy
from trace_lib.records import Message

TOOLS = [{"type": "function", "function": {
    "name": "get_order_details", "description": "Look up an order by id. " * 20,
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]


def convs(n: int) -> list[list[Message]]:
    out = []
    for i in range(n):
        conv = [Message(role="system", content="You are a retail agent."),
                Message(role="user", content=f"Hello, where is my order #W{i}? " * (1 + i % 3))]
        if i % 2:
            conv += [Message(role="assistant", content="Which order id?"), Message(role="user", content=f"#W{i}")]
        out.append(conv)
    return out


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir)


def texts(gens: list[Generation]) -> list[str]:
    return [g.text for g in gens]


def test_generate_shapes_and_accounting(policy):
    before = policy.stats.completion_tokens
    gens = policy.generate(convs(3), TOOLS, temperature=0.0, max_new_tokens=7, seed=0)
    assert len(gens) == 3
    for g, conv in zip(gens, convs(3)):
        assert 1 <= g.completion_tokens <= 7 and g.finish_reason in ("stop", "length")
        assert g.prompt_tokens == policy.count_tokens(policy.render(conv, TOOLS))
        assert g.message.role == "assistant"
    assert policy.stats.completion_tokens - before == sum(g.completion_tokens for g in gens)
    assert policy.stats.completion_tokens_per_second > 0
    assert policy.generate([], TOOLS, temperature=0.0, max_new_tokens=4, seed=0) == []


def test_greedy_outputs_differ_across_prompts(policy):
    # guards the other tests: a model that says the same thing to everyone would pass them trivially
    assert len(set(texts(policy.generate(convs(4), TOOLS, temperature=0.0, max_new_tokens=8, seed=0)))) > 1


def test_batched_equals_one_at_a_time_under_greedy(policy):
    batched = policy.generate(convs(4), TOOLS, temperature=0.0, max_new_tokens=10, seed=0)
    single = [policy.generate([c], TOOLS, temperature=0.0, max_new_tokens=10, seed=0)[0] for c in convs(4)]
    assert texts(batched) == texts(single)


def test_sampling_is_deterministic_per_seed_and_per_row(policy):
    a = policy.generate(convs(3), TOOLS, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=11)
    b = policy.generate(convs(3), TOOLS, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=11)
    c = policy.generate(convs(3), TOOLS, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=12)
    assert texts(a) == texts(b) and texts(a) != texts(c)
    # each row has its own generator, so a row's sample does not depend on its batch mates
    alone = policy.generate(convs(3)[:1], TOOLS, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=11)
    assert alone[0].text == a[0].text


def test_prefix_cache_matches_uncached_path(policy):
    prompts = [policy.encode(policy.render(c, TOOLS)) for c in convs(4)]
    plen, kv = policy._prefix_for(prompts, policy.adapter)
    assert plen > 200 and kv is not None  # the tool list is shared
    with torch.inference_mode():
        plain, _, _ = policy._prefill(prompts, 0, None, 4)
        copied, _, _ = policy._prefill(prompts, plen, kv, 4)
        with shared_prefix(kv):  # the prefix shared by reference (cascade attention), not copied per row
            shared, cache, _ = policy._prefill(prompts, plen, kv, 4, cascade=True)
    assert torch.allclose(copied, plain, atol=1e-4, rtol=1e-4)
    assert torch.allclose(shared, plain, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == max(map(len, prompts)) and cache.layers[0].keys.shape[2] < 100
    kwargs = dict(temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0)
    assert policy.generate_ids(prompts, **kwargs, use_prefix_cache=True) == \
        policy.generate_ids(prompts, **kwargs, use_prefix_cache=False)


def test_attention_implementations_agree(tiny_model_dir):
    kwargs = dict(temperature=0.0, max_new_tokens=10, seed=0)
    outs = [texts(load_policy(tiny_model_dir, attn_implementation=impl).generate(convs(4), TOOLS, **kwargs))
            for impl in ("cascade", "sdpa", "eager")]
    assert outs[0] == outs[1] == outs[2]


def test_prefix_is_reused_across_turns(policy):
    policy._prefixes.clear()
    policy.generate(convs(2), TOOLS, temperature=0.0, max_new_tokens=2, seed=0)
    keys = list(policy._prefixes)
    policy.generate(convs(4)[2:], TOOLS, temperature=0.0, max_new_tokens=2, seed=0)
    assert list(policy._prefixes) == keys and len(keys) == 1
    (_, ids), = keys
    assert policy.tokenizer.decode(list(ids)).endswith("You are a retail agent.<|im_end|>")


class StopAfter:
    """A processor that forces the end-of-turn token for row r after stops[r] tokens."""

    def __init__(self, stops: list[int], eos: int) -> None:
        self.rows, self.stops, self.eos = list(range(len(stops))), stops, eos

    def __call__(self, generated, logits):
        for j, r in enumerate(self.rows):
            if generated.shape[1] >= self.stops[r]:
                logits[j] = float("-inf")
                logits[j, self.eos] = 0.0
        return logits

    def select_rows(self, keep):
        self.rows = [self.rows[j] for j in keep]


def test_rows_stop_independently(policy):
    prompts = [policy.encode(policy.render(c, TOOLS)) for c in convs(3)]
    eos = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kwargs = dict(temperature=0.0, top_p=1.0, max_new_tokens=9, seed=0)
    free, free_finish = policy.generate_ids(prompts, **kwargs)
    outs, finish = policy.generate_ids(prompts, **kwargs, processor=StopAfter([2, 20, 5], eos))
    assert [len(o) for o in outs] == [3, 9, 6]
    assert finish == ["stop", "length", "stop"] and free_finish == ["length"] * 3
    assert outs[0][-1] == eos and outs[2][-1] == eos
    # rows that finished early leave the batch without disturbing the others
    assert outs[1] == free[1] and outs[0][:2] == free[0][:2] and outs[2][:5] == free[2][:5]


def test_stop_token_is_not_in_text(policy):
    prompts = [policy.encode(policy.render(convs(1)[0], TOOLS))]
    eos = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in policy.stop_ids and policy.tokenizer.convert_tokens_to_ids("<|endoftext|>") in policy.stop_ids
    outs, _ = policy.generate_ids(prompts, temperature=0.0, top_p=1.0, max_new_tokens=5, seed=0,
                                  processor=StopAfter([0], eos))
    assert outs == [[eos]]


def test_sample_tokens_at_a_temperature_per_row_draws_as_each_rows_own_temperature():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    temps = [0.3, 1.0, 2.5]

    def gens():
        return [torch.Generator().manual_seed(7 + i) for i in range(3)]

    together = [sample_tokens(logits, torch.tensor(temps), 1.0, g) for g in [gens()] for _ in range(20)]
    alone = [[], [], []]
    for i, t in enumerate(temps):
        g = gens()[i]
        alone[i] = [int(sample_tokens(logits[i:i + 1], t, 1.0, [g])) for _ in range(20)]
    assert [[int(x[i]) for x in together] for i in range(3)] == alone
    with pytest.raises(ValueError, match="above 0"):
        sample_tokens(logits, torch.tensor([0.5, 0.0, 1.0]), 1.0, gens())


def test_sample_tokens_top_p_keeps_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0]])
    gens = [torch.Generator().manual_seed(i) for i in range(1)]
    seen = {int(sample_tokens(logits, 1.0, 0.5, gens)) for _ in range(50)}
    assert seen == {0}
    assert int(sample_tokens(logits, 0.0, 1.0, gens)) == 0


def test_exponential_draw_is_the_draw_multinomial_makes():
    # sample_tokens draws this way on a GPU; here on the CPU, against torch.multinomial with generators in the
    # same state: peaked and flat rows, masked tokens (probability 0) and a row drawn alone or in a batch
    scale = torch.tensor([[4.0], [1.0], [0.3], [8.0]])
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * scale
    logits[:, ::3] = float("-inf")  # a grammar's mask
    probs = logits.softmax(dim=-1)
    gens = lambda seed, rows: [torch.Generator().manual_seed(seed * 10 + i) for i in rows]  # noqa: E731
    for seed in range(25):
        ref = [int(torch.multinomial(probs[i], 1, generator=g)) for i, g in zip(range(4), gens(seed, range(4)))]
        drawn = exponential_draw(probs, gens(seed, range(4))).tolist()
        assert drawn == ref and all(t % 3 for t in drawn)
        assert exponential_draw(probs[2:3], gens(seed, [2])).tolist() == ref[2:3]  # alone, the same draw
    bad = probs.clone()
    bad[1] = 0.0
    bad[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1, 3\]: probabilities are not a distribution"):
        exponential_draw(bad, gens(0, range(4)))


def test_bad_arguments_raise_clearly(policy, tmp_path):
    with pytest.raises(ValueError, match="max_new_tokens"):
        policy.generate(convs(1), TOOLS, temperature=0.0, max_new_tokens=0, seed=0)
    with pytest.raises(ValueError, match="unknown adapter"):
        policy.set_adapter("nope")
    with pytest.raises(OSError, match="could not load model"):
        load_policy(tmp_path / "missing")
    with pytest.raises(ValueError, match="dtype"):
        load_policy(tmp_path, dtype="int3")


@pytest.mark.parametrize("faster, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_computes_in_bf16_only_where_bf16_is_faster(tiny_model_dir, monkeypatch, faster, expected):
    import trace_lib.engine.model as model_mod
    from trace_lib.config import TrainConfig
    from trace_lib.training.trainer import train_dtype

    monkeypatch.setattr(model_mod, "bf16_is_faster", lambda device: faster)
    assert model_mod.compute_dtype("auto", torch.device("cpu")) == str(expected).removeprefix("torch.")
    assert model_mod.compute_dtype("float32", torch.device("cpu")) == "float32"  # an explicit dtype is kept
    assert model_mod.compute_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    assert load_policy(tiny_model_dir, dtype="auto", device="cpu").model.dtype == expected
    assert train_dtype(TrainConfig(dtype="auto")) == str(expected).removeprefix("torch.")
    assert train_dtype(TrainConfig(dtype="bfloat16")) == "bfloat16"


@pytest.mark.cpu_bf16_kernels
def test_bf16_kernels_are_reported_for_the_cpu_and_recorded_in_numerics(monkeypatch):
    from trace_lib.engine.model import has_bf16_kernels, numerics

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert has_bf16_kernels(torch.device("cpu")) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert numerics()["cpu_bf16_kernels"] == has_bf16_kernels(torch.device("cpu"))
    from trace_lib.engine.model import bf16_is_faster

    assert numerics()["cpu_bf16_faster"] == bf16_is_faster(torch.device("cpu"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # pinned below AVX-512: computed as an AVX2 CPU computes
    assert has_bf16_kernels(torch.device("cpu")) is False


@pytest.mark.parametrize("vendor, amx, isa, kernels, expected", [
    ("AuthenticAMD", False, None, True, True),     # AVX-512 bf16 on an EPYC (Zen 5: 0.23x fp32's time at 256 rows)
    ("AuthenticAMD", False, "AVX512_CORE_BF16", True, True),
    ("AuthenticAMD", False, "AVX512_CORE_VNNI", True, False),  # pinned below bf16: emulated
    ("GenuineIntel", True, None, True, True),      # AMX: 0.27x
    ("GenuineIntel", False, None, True, False),    # AVX-512 bf16 without AMX: 1.53x
    ("GenuineIntel", None, None, True, False),     # a torch without the private AMX check
    ("GenuineIntel", True, "AVX512_CORE_BF16", True, False),  # AMX there, but oneDNN pinned below it
    ("GenuineIntel", True, "AVX512_CORE_AMX", True, True),
    ("GenuineIntel", True, "default", True, True),
    ("AuthenticAMD", False, None, False, False),   # no bf16 kernels at all (AVX2): the reference GEMM
    ("", True, None, True, False),                 # vendor unknown: fp32
])
def test_bf16_is_faster_on_a_cpu_only_with_amx_on_intel_or_avx512_bf16_on_amd(monkeypatch, vendor, amx, isa, kernels,
                                                                              expected):
    import trace_lib.engine.model as model_mod

    monkeypatch.setattr(model_mod, "has_bf16_kernels", lambda device: kernels)
    monkeypatch.setattr(model_mod, "_cpu_vendor", lambda: vendor)
    if amx is None:
        monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    else:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert model_mod.bf16_is_faster(torch.device("cpu")) is expected
    assert model_mod.compute_dtype("auto", torch.device("cpu")) == ("bfloat16" if expected else "float32")


def test_the_cpu_vendor_is_read_from_linux(tmp_path):
    from trace_lib.engine.model import _cpu_vendor

    cpuinfo = tmp_path / "cpuinfo"
    for text, expected in [("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t: fpu\n", "GenuineIntel"),
                           ("processor\t: 0\nBogoMIPS\t: 50.00\n", "")]:  # aarch64 lists no vendor_id
        cpuinfo.write_text(text)
        assert _cpu_vendor(str(cpuinfo)) == expected
    assert _cpu_vendor(str(tmp_path / "missing")) == ""  # no /proc: unknown


def test_threads_and_model_json_pointer(tiny_model_dir, tmp_path):
    old = torch.get_num_threads()
    try:
        (tmp_path / "model.json").write_text(json.dumps({"path": str(tiny_model_dir), "model_id": "tiny"}))
        pol = load_policy(tmp_path, threads=1)
        assert torch.get_num_threads() == 1 and pol.policy_id == "tiny"
    finally:
        torch.set_num_threads(old)


def test_lora_adapters_switch(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False, lora_alpha=64))
    peft_model.save_pretrained(tmp_path / "a")
    pol = load_policy(tiny_model_dir, adapters={"skill": str(tmp_path / "a")}, policy_id="tiny")
    plain = load_policy(tiny_model_dir)
    kwargs = dict(temperature=0.0, max_new_tokens=6, seed=0)
    base_out = texts(plain.generate(convs(2), TOOLS, **kwargs))
    assert pol.adapters == ["skill"] and pol.adapter is None and pol.policy_id == "tiny"
    assert texts(pol.generate(convs(2), TOOLS, **kwargs)) == base_out
    pol.set_adapter("skill")
    assert pol.policy_id == "tiny+skill"
    assert texts(pol.generate(convs(2), TOOLS, **kwargs)) != base_out
    pol.set_adapter(None)
    assert texts(pol.generate(convs(2), TOOLS, **kwargs)) == base_out


@pytest.mark.parametrize("impl", ["cascade", "sdpa"])
def test_sessions_reuse_each_episodes_kv_and_match_a_fresh_prefill(tiny_model_dir, impl):
    pol = load_policy(tiny_model_dir, attn_implementation=impl)
    pol.stop_ids = [-1]  # every row decodes the full budget, so turns have their full length
    keys = [("task", i) for i in range(3)]

    def play(sessions):
        conversations = convs(3)
        outs = []
        for turn in range(3):
            n = 3 if turn < 2 else 2  # episode 2 ends after two turns; the others go on in a smaller batch
            gens = pol.generate(conversations[:n], TOOLS, temperature=0.0, max_new_tokens=6, seed=turn,
                                sessions=sessions[:n] if sessions else None)
            outs.append(texts(gens))
            for conv, g in zip(conversations, gens):
                conv += [Message(role="assistant", content=g.text), Message(role="user", content=f"turn {turn}")]
        return outs

    pol.clear_prefix_cache()
    fresh = play(None)
    before = pol.stats.cached_prompt_tokens
    kept = play(keys)
    assert kept == fresh
    assert pol.stats.cached_prompt_tokens - before > 0  # later turns reused the rows' own KV states
    assert set(pol._sessions) == set(keys)
    pol.end_sessions(keys)
    assert not pol._sessions


def test_a_session_is_reused_only_as_far_as_the_prompt_repeats_it(policy):
    conv = convs(1)[0]
    policy.clear_prefix_cache()
    first = policy.generate([conv], TOOLS, temperature=0.0, max_new_tokens=5, seed=0, sessions=["e"])
    # the next prompt rewrites the agent's turn: only the tokens before it can be reused
    edited = [*conv, Message(role="assistant", content="something else"), Message(role="user", content="ok")]
    again = policy.generate([edited], TOOLS, temperature=0.0, max_new_tokens=5, seed=0, sessions=["e"])
    policy.clear_prefix_cache()
    ref = policy.generate([edited], TOOLS, temperature=0.0, max_new_tokens=5, seed=0)
    assert first and texts(again) == texts(ref)
    with pytest.raises(ValueError, match="2 session keys for 1 prompts"):
        policy.generate([conv], TOOLS, temperature=0.0, max_new_tokens=2, seed=0, sessions=["a", "b"])


def test_shared_stems_groups_rows_that_repeat_one_another_beyond_their_cache():
    from trace_lib.engine.decoding import shared_stems

    common = list(range(100, 160))  # 60 tokens every row of the pair has to compute
    prompts = [common + [1, 2], [7] * 40, common + [3], common[:30] + [9] * 20]
    # rows 0 and 2 share 60 tokens, row 3 30 of them: three rows at 30 save as much as two at 60
    assert shared_stems(prompts, [0, 0, 0, 0], max_tail=100) == [([0, 2, 3], 30)]
    # but their tails after 30 tokens would be long: by default a row's tail is at most MAX_STEM_TAIL
    assert shared_stems(prompts, [0, 0, 0, 0]) == [([0, 2], 60)]
    # with everything up to 50 cached by rows 0 and 2, row 3 adds nothing: only the pair is worth it
    assert shared_stems(prompts, [50, 0, 50, 0]) == []  # 10 tokens saved is below MIN_STEM_SAVING
    assert shared_stems(prompts, [20, 0, 20, 40]) == [([0, 2], 60)]
    # a row that already has the stretch cached lends it to the other (saving 60 - 0)
    assert shared_stems([common + [1], common + [2]], [0, 59]) == [([0, 1], 60)]
    # every row keeps at least one token to compute
    assert shared_stems([common, common], [0, 0]) == [([0, 1], 59)]
    assert shared_stems([common], [0]) == [] and shared_stems([[1] * 20, [2] * 20], [0, 0]) == []


@pytest.mark.parametrize("impl", ["cascade", "sdpa"])
def test_shared_stems_decode_exactly_like_separate_rows(tiny_model_dir, impl, monkeypatch):
    import trace_lib.engine.decoding as decoding

    pol = load_policy(tiny_model_dir, attn_implementation=impl)
    pol.stop_ids = [-1]
    keys = [("g", i) for i in range(4)]
    long_result = "order #W1: " + "item, " * 40

    def play():
        pol.clear_prefix_cache()
        conversations = [convs(1)[0] for _ in range(3)] + [convs(2)[1]]  # rows 0-2 open alike, row 3 differs
        outs = []
        for turn in range(2):
            gens = pol.generate(conversations, TOOLS, temperature=0.0, max_new_tokens=4, seed=turn, sessions=keys)
            outs.append(texts(gens))
            for i, conv in enumerate(conversations):  # the same reply to each row, then a row-specific one
                conv += [Message(role="assistant", content="Looking."), Message(role="user", content=long_result),
                         Message(role="assistant", content="ok"), Message(role="user", content=f"row {i}")]
        pol.end_sessions(keys)
        return outs

    before = pol.stats.cached_prompt_tokens
    shared = play()
    saved = pol.stats.cached_prompt_tokens - before
    monkeypatch.setattr(decoding, "MIN_STEM_SAVING", 10**9)  # no stems: each row computes its own
    before = pol.stats.cached_prompt_tokens
    separate = play()
    assert shared == separate
    assert saved > pol.stats.cached_prompt_tokens - before + 2 * 50  # rows 1 and 2 did not compute the result


def test_prefill_passes_give_a_long_row_a_pass_of_its_own():
    from trace_lib.engine.decoding import PASS_OVERHEAD_TOKENS, prefill_cost, prefill_passes

    assert prefill_cost([], [], 100) == 0.0
    assert prefill_cost([10, 4], [0, 50], 0) == pytest.approx(PASS_OVERHEAD_TOKENS + 2 * 10 * (1 + 60 / 750))
    # a 600-token tool result after a long history, two rows of a few tokens, a second long result
    widths, held = [600, 3, 5, 400, 1], [3000, 40, 60, 200, 3000]
    passes = prefill_passes(widths, held, 1800)
    assert sorted(i for p in passes for i in p) == [0, 1, 2, 3, 4]  # every row in exactly one pass
    # the short rows share a pass, but not with the one-token row whose long history all would attend to
    assert passes == [[0], [3], [1, 2], [4]]
    cost = sum(prefill_cost([widths[i] for i in p], [held[i] for i in p], 1800) for p in passes)
    assert cost < prefill_cost(widths, held, 1800) / 3
    # rows of one shape share a pass
    assert prefill_passes([30, 30, 30], [100, 100, 100], 1800) == [[0, 1, 2]]


def test_rows_prefilled_in_separate_passes_decode_like_one_padded_pass(tiny_model_dir, monkeypatch):
    import trace_lib.engine.decoding as decoding
    import trace_lib.engine.policy as policy_mod

    pol = load_policy(tiny_model_dir, dtype="float32")
    pol.stop_ids = [-1]
    keys = [("p", i) for i in range(3)]
    calls = []
    prefill = policy_mod.Policy._prefill

    def counted(self, prompts, *args, **kwargs):
        calls.append(len(prompts))
        return prefill(self, prompts, *args, **kwargs)

    monkeypatch.setattr(policy_mod.Policy, "_prefill", counted)

    def play():
        pol.clear_prefix_cache()
        calls.clear()
        before = pol.stats.cached_prompt_tokens
        conversations = convs(3)
        outs = []
        for turn in range(2):
            gens = pol.generate(conversations, TOOLS, temperature=0.0, max_new_tokens=4, seed=turn, sessions=keys)
            outs.append(texts(gens))
            for i, conv in enumerate(conversations):  # row 0 gets a long tool result, the others a word
                reply = "order #W1: " + "item, " * 150 if i == 0 else f"row {i}"
                conv += [Message(role="assistant", content="Looking."), Message(role="user", content=reply)]
        pol.end_sessions(keys)
        return outs, list(calls), pol.stats.cached_prompt_tokens - before

    split, split_calls, split_cached = play()
    assert split_calls[-3:] == [1, 2, 3]  # the long row alone, the short rows together, then every last token
    monkeypatch.setattr(decoding, "prefill_cost", lambda *a: 0.0)  # one padded pass always looks cheapest
    padded, padded_calls, padded_cached = play()
    assert padded_calls[-1:] == [3] and len(padded_calls) < len(split_calls)
    assert split == padded
    assert split_cached == padded_cached > 0  # the same tokens computed, however they were split


def test_the_engine_runs_where_the_weights_are(tiny_model_dir):
    from trace_lib.engine.policy import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pol = load_policy(tiny_model_dir, device="cpu")
    assert pol.device == torch.device("cpu")
    with pytest.raises(RuntimeError):
        resolve_device("nonsense")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: the engine on a GPU against the same engine on CPU")
def test_cuda_greedy_equals_cpu_and_cuda_sampling_is_seeded(tiny_model_dir):
    convs = [[Message(role="user", content=f"Say something about {w}.")] for w in ("cats", "orders", "refunds")]
    greedy, sampled = {}, {}
    for device in ("cpu", "cuda"):
        pol = load_policy(tiny_model_dir, dtype="float32", device=device)
        assert pol.device.type == device
        greedy[device] = [g.text for g in pol.generate(convs, [], max_new_tokens=12, seed=0)]
        sampled[device] = [[g.text for g in pol.generate(convs, [], max_new_tokens=12, seed=s, temperature=0.8)]
                           for s in (3, 3, 4)]
    assert greedy["cuda"] == greedy["cpu"]
    for device in ("cpu", "cuda"):  # the same seed draws the same tokens; another seed, others
        assert sampled[device][0] == sampled[device][1] != sampled[device][2]


def _turn_script(pol, n_rows: int, turns_of: list[int]):
    """Prompts and a `next_turn` for rows that play `turns_of[i]` turns, each reply naming its row and turn;
    returns (prompts, next_turn, record) where record[i] lists row i's turns' tokens."""
    conversations = convs(n_rows)
    prompts = [pol.encode(pol.render(c, TOOLS)) for c in conversations]
    record: list[list[list[int]]] = [[] for _ in range(n_rows)]

    def next_turn(i, toks, why):
        record[i].append(list(toks))
        if len(record[i]) >= turns_of[i]:
            return None
        reply = pol.encode(f"<|im_end|>\n<|im_start|>user\nrow {i} turn {len(record[i])}: " + "ok " * (3 * i)
                           + "<|im_end|>\n<|im_start|>assistant\n")
        body = [t for t in toks if t not in pol.stop_ids]
        prompts[i] = prompts[i] + body + reply
        return prompts[i], bool(len(record[i]) % 2)

    return prompts, next_turn, record


def _turn_by_turn(pol, n_rows, turns_of, keys, max_new_tokens):
    """The reference: each round one generate_ids call over the live rows, sessions kept."""
    prompts, next_turn, record = _turn_script(pol, n_rows, turns_of)
    live = list(range(n_rows))
    while live:
        outs, finish = pol.generate_ids([prompts[r] for r in live], temperature=0.0, top_p=1.0,
                                        max_new_tokens=max_new_tokens, seed=0, sessions=[keys[r] for r in live])
        live = [r for r, toks, why in zip(live, outs, finish) if next_turn(r, toks, why) is not None]
    pol.end_sessions(keys)
    return record


@pytest.mark.parametrize(("impl", "join_share"), [("cascade", 0.0), ("cascade", 0.25), ("cascade", 10**9),
                                                  ("sdpa", 0.0)])
def test_play_turns_decodes_each_turn_as_turn_by_turn_calls_do(tiny_model_dir, impl, join_share, monkeypatch):
    import trace_lib.engine.decoding as decoding

    monkeypatch.setattr(decoding, "JOIN_SHARE", join_share)
    pol = load_policy(tiny_model_dir, attn_implementation=impl)
    pol.stop_ids = [t for t in range(pol._vocab_size()) if t % 3 == 0]  # turns of many lengths (random weights)
    keys = [("ep", i) for i in range(5)]
    turns_of = [1, 3, 2, 4, 3]
    ref = _turn_by_turn(pol, 5, turns_of, keys, max_new_tokens=10)
    prompts, next_turn, record = _turn_script(pol, 5, turns_of)
    before = pol.stats.sequences
    joins = []
    monkeypatch.setattr(decoding, "append_rows", lambda *a: joins.append(a[2].layers[0].keys.shape[0])
                        or append_rows(*a))
    import time

    def slow_turn(*a):  # the caller's environment takes its time: that is not decoding
        time.sleep(0.01)
        return next_turn(*a)

    engine_before = pol.stats.decode_seconds + pol.stats.prefill_seconds
    t0 = time.perf_counter()
    waited = pol.play_turns(prompts, slow_turn, temperature=0.0, top_p=1.0, max_new_tokens=10, seed=0, sessions=keys)
    wall = time.perf_counter() - t0
    assert record == ref
    assert waited >= 0.01 * sum(turns_of)
    engine = pol.stats.decode_seconds + pol.stats.prefill_seconds - engine_before
    assert 0 < engine <= wall - waited + 1e-6  # the environments' time is not counted as prefill or decoding
    assert [len(r) for r in record] == turns_of
    assert len({len(t) for r in record for t in r}) > 2  # turns of different lengths: rows joined mid-decode
    assert pol.stats.sequences - before == sum(turns_of)
    if join_share < 1:  # rows joined a batch still decoding; at a huge share only an emptied batch restarts
        assert joins
    else:
        assert not joins


def test_play_turns_samples_deterministically_and_keeps_the_grammar_on_joining_rows(tiny_model_dir):
    from trace_lib.engine.grammar import make_tool_call_processor

    pol = load_policy(tiny_model_dir)
    keys = [("ep", i) for i in range(4)]

    def run(seed):
        prompts, next_turn, record = _turn_script(pol, 4, [3, 2, 3, 1])
        flags = {}

        def checked(i, toks, why):
            flags.setdefault(i, []).append(why)
            return next_turn(i, toks, why)

        processor = make_tool_call_processor(pol.tokenizer, TOOLS, 4, vocab_size=pol._vocab_size(),
                                             require_tool_call=[True, False, True, False], max_string_chars=4,
                                             max_text_chars=24)
        pol.play_turns(prompts, checked, temperature=1.0, top_p=1.0, max_new_tokens=96, seed=seed,
                       sessions=keys, processor=processor)
        pol.end_sessions(keys)
        return record, processor

    first, processor = run(3)
    checked_calls = []
    assert run(3)[0] == first and run(4)[0] != first
    assert not any(processor.rejected)
    for i, turns in enumerate(first):
        for t, toks in enumerate(turns):
            text = pol.tokenizer.decode([x for x in toks if x not in pol.stop_ids])
            # the first turns' flags come from the processor, later ones from next_turn (odd turns must call)
            must = [True, False, True, False][i] if t == 0 else bool(t % 2)
            if must and len(toks) < 96:
                assert parse_assistant(text, TOOLS, turn=t).tool_calls, (i, t, text)
                checked_calls.append((i, t))
    assert {t for _, t in checked_calls} >= {0, 1}  # first turns and later (joined) turns were held to a call


def test_play_turns_refuses_a_model_without_a_buffered_cache(tiny_model_dir, monkeypatch):
    pol = load_policy(tiny_model_dir)
    monkeypatch.setattr(pol.model.config, "layer_types", ["sliding_attention"] * pol.model.config.num_hidden_layers,
                        raising=False)
    with pytest.raises(ValueError, match="full-attention layers"):
        pol.play_turns([[1, 2]], lambda *a: None, temperature=0.0, top_p=1.0, max_new_tokens=2, seed=0,
                       sessions=["a"])
    with pytest.raises(ValueError, match="2 session keys for 1 prompts"):
        pol.play_turns([[1, 2]], lambda *a: None, temperature=0.0, top_p=1.0, max_new_tokens=2, seed=0,
                       sessions=["a", "b"])


def test_play_turns_starts_a_new_episode_in_a_slot_and_defers_one_with_another_prefix(tiny_model_dir):
    """Row 0's slot takes a second episode (new session key) whose system turn differs from the batch's
    shared prefix: it waits for the batch to empty and decodes in a batch of its own, as a fresh call would."""
    from trace_lib.engine.decoding import NextTurn

    pol = load_policy(tiny_model_dir)
    pol.stop_ids = [t for t in range(pol._vocab_size()) if t % 3 == 0]
    other = [Message(role="system", content="You are a travel agent with other rules."),
             Message(role="user", content="Book me a flight to Oslo, please.")]
    other_prompt = pol.encode(pol.render(other, TOOLS))
    prompts, next_turn, record = _turn_script(pol, 3, [1, 3, 2])
    extra = []

    def refill(i, toks, why):
        if i == 0 and not extra:
            record[0].append(list(toks))
            extra.append(None)
            return NextTurn(other_prompt, True, ("other", 0))
        if i == 0:
            extra[0] = list(toks)
            return None
        return next_turn(i, toks, why)

    batches = []
    decode_turns = pol._decode_turns
    pol._decode_turns = lambda run, starting, *a: batches.append([r for r, _ in starting]) or decode_turns(
        run, starting, *a)
    pol.clear_prefix_cache()
    pol.play_turns(prompts, refill, temperature=0.0, top_p=1.0, max_new_tokens=10, seed=0,
                   sessions=[("ep", i) for i in range(3)])
    assert batches == [[0, 1, 2], [0]]
    pol.clear_prefix_cache()
    ref = _turn_by_turn(pol, 3, [1, 3, 2], [("ep", i) for i in range(3)], max_new_tokens=10)
    alone, _ = pol.generate_ids([other_prompt], temperature=0.0, top_p=1.0, max_new_tokens=10, seed=0)
    assert record == ref
    assert extra == alone
    # constrained: the deferred episode's turn is held to its grammar in the new batch, as alone
    from trace_lib.engine.grammar import make_tool_call_processor

    def grammar(rows):
        return make_tool_call_processor(pol.tokenizer, TOOLS, rows, vocab_size=pol._vocab_size(),
                                        require_tool_call=True, max_string_chars=4)

    pol.stop_ids = [pol.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompts, next_turn, record = _turn_script(pol, 3, [1, 3, 2])
    extra.clear()
    pol.play_turns(prompts, refill, temperature=0.0, top_p=1.0, max_new_tokens=64, seed=0,
                   sessions=[("ep", i) for i in range(3)], processor=grammar(3))
    alone, _ = pol.generate_ids([other_prompt], temperature=0.0, top_p=1.0, max_new_tokens=64, seed=0,
                                processor=grammar(1))
    assert extra == alone
    assert parse_assistant(pol.tokenizer.decode(alone[0][:-1]), TOOLS).tool_calls


def test_play_turns_routes_are_checked(tiny_model_dir):
    pol = load_policy(tiny_model_dir)
    prompts, next_turn, _ = _turn_script(pol, 2, [1, 1])
    keys = [("ep", 0), ("ep", 1)]
    kw = dict(temperature=0.0, top_p=1.0, max_new_tokens=4, seed=0, sessions=keys)
    with pytest.raises(ValueError, match="routes and row_routes go together"):
        pol.play_turns(prompts, next_turn, routes=[{}], **kw)
    with pytest.raises(ValueError, match="an index into the 1 routes"):
        pol.play_turns(prompts, next_turn, routes=[{}], row_routes=[0, 1], **kw)
    with pytest.raises(ValueError, match="NextTurn.route 0"):  # a route without routes to index
        pol.play_turns(prompts, lambda i, toks, why: (prompts[i] + toks, False, ("new", i), 0), **kw)
