"""Training one adapter (`training/trainer.py`): backends, LoRA, sources and their mixture, budget, determinism
and resume, and learning on toy environments, with TRL's GRPOTrainer on the tiny random model for 1-10 iterations."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from tiny_training import FAST, ParityEnv, fake_unsloth, kv_tasks, lora_weights, train_toy_adapter
from toy import KVEnv, PickEnv, pick_tasks

from trace_lib.config import TrainConfig
from trace_lib.records import Message
from trace_lib.budget import RolloutLedger
from trace_lib.training.grpo import AgentRollout, TrainSource
from trace_lib.training.rewards import make_reward
from trace_lib.training.trainer import (
    group_sources,
    load_trainable,
    lora_config,
    read_timing,
    read_train_log,
    resolve_train_backend,
    train_adapter_mixture,
    train_dataset,
)


def test_resolve_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_train_backend("trl") == "trl"
    assert resolve_train_backend("auto") == "trl"
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        resolve_train_backend("unsloth")
    with pytest.raises(ValueError):
        resolve_train_backend("deepspeed")


def test_lora_targets_only_existing_modules(scripted):
    base = scripted.model.get_base_model()
    cfg = TrainConfig(target_modules=["q_proj", "v_proj", "c_attn"])
    assert sorted(lora_config(cfg, base).target_modules) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="match no module"):
        lora_config(TrainConfig(target_modules=["c_attn"]), base)


def test_the_trainable_policy_samples_with_its_adapter(tiny_model_dir):
    policy, base_id = load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "trl", seed=0)
    assert policy.adapter == "default" and base_id == tiny_model_dir.name
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-2] for n in trainable} == {"default"}
    assert policy.tool_format == "json"  # the folder records no format
    listed, _ = load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "trl", seed=0, tool_format="signature")
    assert listed.tool_format == "signature"  # the train stage passes `model.tool_format`


def test_episodes_are_sampled_with_the_adapter_folded_in_and_the_base_weights_come_back_bit_for_bit(
        tiny_model_dir, monkeypatch):
    import trace_lib.training.grpo as grpo_mod
    from trace_lib.engine.compose import is_merged

    policy, _ = load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "trl", seed=0)
    torch.manual_seed(1)
    with torch.no_grad():  # a nonzero adapter (B starts at zero), so folding it in changes the weights
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "base_layer" in n}
    prompt = policy.encode(policy.render([Message(role="user", content="What is the value of k3?")], []))
    unfolded, _ = policy.generate_ids([prompt], temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0)
    cfg = TrainConfig(**FAST)
    ro = AgentRollout(policy, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks)], cfg, make_reward(cfg.reward),
                      lambda n: None, seed=0)
    with ro._folded():
        assert is_merged(policy.model)
        changed = [n for n, p in policy.model.named_parameters() if n in base and not torch.equal(p, base[n])]
        assert changed  # W + BA is in the base weights ...
        policy.clear_prefix_cache()
        folded, _ = policy.generate_ids([prompt], temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0)
    assert folded == unfolded  # ... and the adapter layers are off: the delta counts once (fp32: same tokens)
    assert not is_merged(policy.model)
    assert all(torch.equal(p, base[n]) for n, p in policy.model.named_parameters() if n in base)

    seen = []
    real_play = grpo_mod.play
    monkeypatch.setattr(grpo_mod, "play", lambda *a, **kw: (seen.append(is_merged(policy.model)), real_play(*a, **kw))[1])
    ro(["kv:0"] * cfg.group_size, SimpleNamespace(state=SimpleNamespace(global_step=0)))
    ro.fold_lora = False  # what the trainer sets for Unsloth
    ro(["kv:0"] * cfg.group_size, SimpleNamespace(state=SimpleNamespace(global_step=1)))
    assert seen == [True, False]
    assert all(torch.equal(p, base[n]) for n, p in policy.model.named_parameters() if n in base)


def test_the_unsloth_backend_trains_through_the_same_path_and_writes_the_same_records(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trace_lib.engine.chat import tool_chat_template
    from trace_lib.training import trainer as trainer_mod

    calls: list = []
    monkeypatch.setitem(sys.modules, "unsloth", fake_unsloth(calls))
    monkeypatch.setattr(trainer_mod, "resolve_train_backend", lambda name: "unsloth")  # as on a CUDA machine
    manifest, ledger = train_toy_adapter(tiny_model_dir, tmp_path, iterations=1, group_size=2, lora_rank=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"])
    assert [c[0] for c in calls] == ["from_pretrained", "get_peft_model"]
    assert calls[0][1] == {"model_name": str(tiny_model_dir), "dtype": None, "load_in_4bit": False}
    assert calls[1][1] == {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none",
                           "random_state": 0, "use_gradient_checkpointing": False}  # the shared-prompt pass's cache
    assert manifest.backend == "unsloth" and manifest.rollouts_used == ledger.used("train", "cap") == 4
    out = tmp_path / "adapter"
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 1
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    assert sorted(loaded.peft_config["default"].target_modules) == ["q_proj", "v_proj"]
    policy, _ = trainer_mod.load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "unsloth", seed=0)
    assert policy.tokenizer.chat_template == tool_chat_template() and policy.adapter == "default"


def test_mixture_proportions_follow_the_weights():
    picks = group_sources([3.0, 1.0, 0.0], 4000, seed=1)
    share = Counter(picks)
    assert abs(share[0] / 4000 - 0.75) < 0.03 and share[2] == 0
    assert picks == group_sources([3.0, 1.0, 0.0], 4000, seed=1)
    assert picks != group_sources([3.0, 1.0, 0.0], 4000, seed=2)
    with pytest.raises(ValueError):
        group_sources([0.0, 0.0], 3, seed=0)
    cfg = TrainConfig(iterations=10, groups=8)
    src = [TrainSource("a", KVEnv, kv_tasks, 1.0), TrainSource("b", KVEnv, kv_tasks, 1.0)]
    rows = train_dataset(src, cfg, seed=0)["prompt"]
    assert len(rows) == 80 and rows[0].endswith(":1000") and rows[-1].endswith(":1079")
    assert 25 < sum(r.startswith("a:") for r in rows) < 55


def test_one_iteration_trains_and_writes_a_loadable_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    manifest, ledger = train_toy_adapter(tiny_model_dir, tmp_path, iterations=1, group_size=4)
    out = tmp_path / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json", "train_log.jsonl",
            "manifest.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "timing.json").exists()  # wall times stay out of the adapter folder
    assert manifest.iterations == 1 and manifest.rollouts_used == 8 == ledger.used("train", "cap")
    assert manifest.backend == "trl" and manifest.capability_id == "cap"
    assert not (tmp_path / ".cap.ckpt").exists()  # checkpoints are removed once the adapter is written
    log = (out / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 1 and '"seconds"' not in log[0] and '"frac_reward_zero_std"' in log[0]
    row = read_train_log(out)[0]
    assert row["iteration"] == 1 and row["rollouts"] == 8 and row["trained_tokens"] > 0
    timing = read_timing(tmp_path / "adapter.timing.json")
    assert [t["iteration"] for t in timing["iterations"]] == [1] and timing["seconds_per_iteration"] > 0
    weights = lora_weights(out)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # B starts at zero
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_identical_rewards_carry_no_gradient(tiny_model_dir, tmp_path):
    manifest, _ = train_toy_adapter(tiny_model_dir, tmp_path, env=KVEnv, iterations=1)  # random model: every reward 0
    log = (tmp_path / "adapter" / "train_log.jsonl").read_text()
    assert '"frac_reward_zero_std": 1.0' in log and '"trained_tokens": 0' in log
    assert all(v.abs().sum() == 0 for k, v in lora_weights(tmp_path / "adapter").items() if "lora_B" in k)


def test_budget_stops_training(tiny_model_dir, tmp_path):
    manifest, ledger = train_toy_adapter(tiny_model_dir, tmp_path, iterations=3, rollout_budget=9)
    assert manifest.iterations == 2 and ledger.used("train", "cap") == 8
    with pytest.raises(ValueError, match="cannot pay for one iteration"):
        train_toy_adapter(tiny_model_dir, tmp_path, iterations=3, rollout_budget=3, out="other", name="other")


class CrashingLedger(RolloutLedger):
    """Records the n-th add, then dies (a crash in the middle of an iteration)."""

    def __init__(self, path, crash_at: int) -> None:
        super().__init__(path)
        self.crash_at, self.adds = crash_at, 0

    def add(self, stage, rollouts, key=""):
        super().add(stage, rollouts, key)
        self.adds += 1
        if self.adds == self.crash_at:
            raise KeyboardInterrupt("simulated crash")


@pytest.mark.slow
def test_same_seed_same_bytes_and_resume_matches_a_straight_run(tiny_model_dir, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    train_toy_adapter(tiny_model_dir, a, iterations=3, group_size=4)
    train_toy_adapter(tiny_model_dir, b, iterations=3, group_size=4)
    assert (a / "adapter" / "train_log.jsonl").read_bytes() == (b / "adapter" / "train_log.jsonl").read_bytes()
    assert (a / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (b / "adapter" / "adapter_model.safetensors").read_bytes()

    crashing = CrashingLedger(c / "ledger.jsonl", crash_at=3)
    with pytest.raises(KeyboardInterrupt):
        train_toy_adapter(tiny_model_dir, c, ledger=crashing, iterations=3, group_size=4)
    assert (c / ".cap.ckpt" / "checkpoint-2" / "trace_state.json").is_file() and not (c / "adapter").exists()
    assert crashing.used("train", "cap") == 24  # the crashed iteration's rollouts were recorded ...
    with pytest.warns(UserWarning, match="dropped 8 rollouts"):
        manifest, ledger = train_toy_adapter(tiny_model_dir, c, iterations=3, group_size=4)
    assert ledger.used("train", "cap") == 24 and manifest.iterations == 3  # ... and are redone, not double counted
    assert (c / "adapter" / "train_log.jsonl").read_bytes() == (a / "adapter" / "train_log.jsonl").read_bytes()
    wa, wc = lora_weights(a / "adapter"), lora_weights(c / "adapter")
    assert wa.keys() == wc.keys()
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    rows = (a / "adapter" / "train_log.jsonl").read_text().splitlines()
    assert all('"trained_tokens": 0,' not in r for r in rows)  # every iteration, the resumed one too, has signal
    # snapshots of the earlier iterations (the scaling stage's budget points), the same after a resume
    snaps = sorted(p.name for p in (a / "adapter" / "snapshots").iterdir())
    assert snaps == ["iter-1", "iter-2"] and sorted(p.name for p in (c / "adapter" / "snapshots").iterdir()) == snaps
    assert [json.loads((a / "adapter" / "snapshots" / n / "snapshot.json").read_text())["rollouts"]
            for n in snaps] == [8, 16]
    for n in snaps:
        assert (a / "adapter" / "snapshots" / n / "adapter_model.safetensors").read_bytes() == \
            (c / "adapter" / "snapshots" / n / "adapter_model.safetensors").read_bytes()
    assert not (c / ".cap.ckpt").exists()


def test_a_crash_while_writing_the_adapter_resumes_without_retraining(tiny_model_dir, tmp_path, monkeypatch):
    import trace_lib.training.trainer as train_mod

    def boom(tmp, out_dir):
        raise OSError("disk full")

    monkeypatch.setattr(train_mod, "_replace_dir", boom)
    with pytest.raises(OSError):
        train_toy_adapter(tiny_model_dir, tmp_path, iterations=1)
    monkeypatch.undo()
    manifest, ledger = train_toy_adapter(tiny_model_dir, tmp_path, iterations=1)
    assert manifest.iterations == 1 and ledger.used("train", "cap") == 4
    assert len((tmp_path / "adapter" / "train_log.jsonl").read_text().splitlines()) == 1


def test_kept_checkpoints_restore_a_deleted_ledger_and_other_configurations_start_over(tiny_model_dir, tmp_path):
    """What the train stage relies on under DVC, which deletes the adapter and its ledger (the stage's
    outputs) before a rerun: the kept final checkpoint gives back the same adapter, log and ledger rows
    without training; a checkpoint saved under another configuration is not resumed."""
    ckpt = tmp_path / "ckpt"

    def run(**kw):
        cfg = TrainConfig(**{**FAST, "iterations": 2, **kw})
        ledger = RolloutLedger(tmp_path / "ledger.jsonl")
        manifest = train_adapter_mixture(tiny_model_dir, [TrainSource("cap", lambda: ParityEnv(max_steps=3), kv_tasks)],
                                         cfg, tmp_path / "adapter", seed=0, ledger=ledger, name="cap", ckpt_dir=ckpt,
                                         resume_key="k", keep_checkpoints=True)
        return manifest, ledger, (tmp_path / "adapter" / "train_log.jsonl").read_bytes()

    manifest, ledger, log = run()
    rows, weights = ledger.rows(), lora_weights(tmp_path / "adapter")
    assert (ckpt / "checkpoint-2" / "trace_state.json").is_file() and len(rows) == 2
    (tmp_path / "adapter.timing.json").unlink()  # the rerun must write it again, from the checkpoint
    ledger.path.unlink()
    manifest, ledger, again = run()
    assert again == log and ledger.rows() == rows and manifest.rollouts_used == 8
    assert (tmp_path / "adapter.timing.json").is_file()
    assert all(torch.equal(weights[k], v) for k, v in lora_weights(tmp_path / "adapter").items())
    assert sorted(p.name for p in (tmp_path / "adapter" / "snapshots").iterdir()) == ["iter-1"]

    with pytest.warns(UserWarning, match="another configuration"):
        manifest, ledger, _ = run(learning_rate=2e-2)
    assert ledger.rows() == rows and manifest.config["train"]["learning_rate"] == 2e-2  # trained anew, not added


def test_reward_rises_on_a_learnable_toy_environment(tiny_model_dir, tmp_path):
    """The real path (TRL's GRPOTrainer + AgentRollout, constrained decoding) learns a choice the tiny
    random model can learn: PickEnv pays 1 iff the first (and only) tool call is `approve` — about a
    quarter of the base model's calls at temperature 1. Seed 0 goes from 1 success in 8 to 14 in the
    last 16; over seeds 0-5 the last two iterations averaged 0.75-0.94 (at lr 3e-2 one seed in three fell to
    zero success, where every group is identical and learning stops)."""
    cfg = TrainConfig(groups=2, group_size=4, iterations=8, learning_rate=1e-2, temperature=1.0, max_new_tokens=64,
                      max_steps_per_episode=2, save_every=100)
    ledger = RolloutLedger(tmp_path / "ledger.jsonl")
    train_adapter_mixture(tiny_model_dir, [TrainSource("pick", PickEnv, pick_tasks)], cfg, tmp_path / "pick", seed=0,
                          ledger=ledger, name="pick")
    rows = read_train_log(tmp_path / "pick")
    reward = [r["reward"] for r in rows]
    assert len(rows) == 8 and [r["success_rate"] for r in rows] == reward  # 0/1 env reward: reward == success
    first, last = reward[0], (reward[-1] + reward[-2]) / 2
    assert first <= 0.5 and last >= first + 0.25, reward


def test_mixture_training_runs(tiny_model_dir, tmp_path):
    cfg = TrainConfig(**{**FAST, "iterations": 1})
    srcs = [TrainSource("x", lambda: ParityEnv(max_steps=3), kv_tasks, 2.0),
            TrainSource("y", lambda: KVEnv(max_steps=3), kv_tasks, 1.0)]
    ledger = RolloutLedger(tmp_path / "ledger.jsonl")
    m = train_adapter_mixture(tiny_model_dir, srcs, cfg, tmp_path / "mix", seed=0, ledger=ledger, name="mix")
    assert m.config["sources"] == {"x": 2.0, "y": 1.0} and ledger.used("train", "mix") == 4


def test_a_student_distilled_from_a_trained_teacher_learns_its_choice(tiny_model_dir, tmp_path):
    """The real path: a GRPO teacher that learned PickEnv's `approve` (as in the test above: 1/8 -> 8/8), then
    a fresh student distilled from it on-policy, rewarded by nothing but the teacher's log-probs: its success
    rises (seed 2: 0.375, 0.5, ... 0.625, 1.0) and the teacher's weights are untouched."""
    cfg = TrainConfig(groups=2, group_size=4, iterations=8, learning_rate=1e-2, temperature=1.0, max_new_tokens=64,
                      max_steps_per_episode=2, save_every=100)
    src = [TrainSource("pick", PickEnv, pick_tasks)]
    train_adapter_mixture(tiny_model_dir, src, cfg, tmp_path / "teacher", seed=0,
                          ledger=RolloutLedger(tmp_path / "t.jsonl"), name="pick")
    before = (tmp_path / "teacher" / "adapter_model.safetensors").read_bytes()
    teacher_rate = read_train_log(tmp_path / "teacher")[-1]["success_rate"]
    train_adapter_mixture(tiny_model_dir, src, cfg.model_copy(update={"iterations": 10}), tmp_path / "student",
                          seed=2, ledger=RolloutLedger(tmp_path / "s.jsonl"), name="distilled",
                          teachers={"pick": tmp_path / "teacher"})
    rows = read_train_log(tmp_path / "student")
    rate = [r["success_rate"] for r in rows]
    assert (tmp_path / "teacher" / "adapter_model.safetensors").read_bytes() == before
    assert all(isinstance(r["distill_kl"], float) and r["trained_tokens"] > 0 for r in rows)
    assert teacher_rate >= 0.75 and sum(rate[-3:]) / 3 >= sum(rate[:2]) / 2 + 0.25, rate


def test_a_training_without_reference_samples_records_its_config_as_before(tiny_model_dir, tmp_path):
    manifest, _ = train_toy_adapter(tiny_model_dir, tmp_path, iterations=1)
    assert "reference_samples" not in manifest.config["train"] and "reference_when" not in manifest.config["train"]
    assert "references" not in read_train_log(tmp_path / "adapter")[0]


def test_a_training_logs_its_curves_every_iteration_and_a_resumed_one_continues_them_without_repeating_a_step(
        tiny_model_dir, tmp_path):
    """Killed in iteration 4 (iteration 3 logged, the checkpoint at 2): the resumed training rewrites the curves
    from the checkpoint's rows, then logs 3 and 4 again; the files end as an uninterrupted run's (wall times
    aside), and hold what the adapter's train log holds."""
    from trace_lib.training.tracking import LiveCurves, read_episodes, read_rows

    def run(folder, ledger):
        cfg = TrainConfig(**{**FAST, "iterations": 4, "save_every": 2})
        live = LiveCurves(folder / "curves", folder / "summary.json", folder / "episodes.tsv", episodes=2)
        train_adapter_mixture(tiny_model_dir, [TrainSource("cap", lambda: ParityEnv(max_steps=3), kv_tasks)], cfg,
                              folder / "adapter", seed=0, ledger=ledger, name="cap", curves=live)
        return live

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, RolloutLedger(straight / "ledger.jsonl"))
    with pytest.raises(KeyboardInterrupt):
        run(resumed, CrashingLedger(resumed / "ledger.jsonl", crash_at=4))
    assert [r["iteration"] for r in read_rows(resumed / "curves")] == [1, 2, 3]  # as far as it got
    with pytest.warns(UserWarning, match="dropped"):
        run(resumed, RolloutLedger(resumed / "ledger.jsonl"))
    metrics = resumed / "curves/plots/metrics"
    assert [line.split("\t")[0] for line in (metrics / "reward.tsv").read_text().splitlines()] == [
        "step", "1", "2", "3", "4"]
    names = {p.relative_to(metrics).as_posix() for p in metrics.rglob("*.tsv")}
    assert {"reward.tsv", "reward_std.tsv", "frac_reward_zero_std.tsv", "frac_groups_mixed.tsv", "success_sampled.tsv",
            "loss.tsv", "entropy.tsv", "grad_norm.tsv", "completions/mean_length.tsv", "rollouts.tsv",
            "time/seconds_per_rollout.tsv"} <= names and "kl.tsv" not in names  # beta = 0: TRL computes no KL
    for name in sorted(names - {n for n in names if n.startswith("time/")}):
        assert (metrics / name).read_bytes() == (straight / "curves/plots/metrics" / name).read_bytes(), name
    log = [json.loads(line) for line in (resumed / "adapter/train_log.jsonl").read_text().splitlines()]
    assert read_rows(resumed / "curves") == log
    assert json.loads((resumed / "summary.json").read_text())["reward"] == log[-1]["reward"]
    table = read_episodes(resumed / "episodes.tsv")
    assert [r["step"] for r in table] == [1, 1, 2, 2, 3, 3, 4, 4] and table == read_episodes(straight / "episodes.tsv")
