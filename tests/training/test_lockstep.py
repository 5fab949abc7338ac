"""Trainings in lockstep (`training/lockstep.py`): the sampling model shares each training's LoRA tensors, a round
decodes every episode under its own training's adapter, the schedule is deterministic and a failure stops all."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from toy import KVEnv, kv_task

from trace_lib.engine.policy import load_policy
from trace_lib.config import TrainConfig
from trace_lib.budget import RolloutLedger
from trace_lib.agent.episode import play, start_episode
from trace_lib.training.grpo import TrainSource
import trace_lib.training.lockstep as lockstep
from trace_lib.training.lockstep import LockstepAborted, LockstepJob, LockstepSampler, resume_points, run_lockstep
from trace_lib.training.trainer import (
    checkpoint_iterations,
    load_trainable,
    read_timing,
    read_train_log,
    train_adapter_mixture,
)

FAST = {"groups": 2, "group_size": 2, "max_new_tokens": 12, "max_steps_per_episode": 3, "constrained": False,
        "learning_rate": 1e-2, "save_every": 1, "temperature": 1.0}


def kv_tasks(seeds):
    return [kv_task(s % 20).model_copy(update={"seed": s}) for s in seeds]


def trainable(model_dir, seed):
    """A training's policy (LoRA 'default') whose B weights are made non-zero, different per seed."""
    policy, _ = load_trainable(model_dir, TrainConfig(), "trl", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return policy


def episodes(policy, n, source="kv"):
    return [start_episode(policy, source, 3 + i, kv_task(3 + i), i, KVEnv(max_steps=2)) for i in range(n)]


def sampler_for(model_dir):
    return LockstepSampler(lambda: load_policy(model_dir, dtype="float32"), seed=0)


def test_a_round_decodes_each_episode_under_its_own_trainings_weights(tiny_model_dir):
    cfg = TrainConfig(**{**FAST, "temperature": 1e-6, "max_new_tokens": 8})  # as good as greedy
    one, two = trainable(tiny_model_dir, 1), trainable(tiny_model_dir, 2)
    alone = {}
    for name, policy in (("one", one), ("two", two)):
        eps = episodes(policy, 2)
        play(policy, eps, cfg, seed=0)
        alone[name] = [ep.completion_ids for ep in eps]
    assert alone["one"] != alone["two"]  # the two trainings' weights decode differently

    sampler = sampler_for(tiny_model_dir)
    sampler.attach("one", one.model)
    sampler.attach("two", two.model)
    together = episodes(one, 2) + episodes(two, 2)
    play(sampler.policy, together, cfg, seed=0, adapters=["one", "one", "two", "two"])
    assert [ep.completion_ids for ep in together] == alone["one"] + alone["two"]


def test_the_sampler_shares_the_trainings_tensors_and_leaves_them_trainable(tiny_model_dir):
    one, two = trainable(tiny_model_dir, 1), trainable(tiny_model_dir, 2)
    sampler = sampler_for(tiny_model_dir)
    sampler.attach("one", one.model)
    sampler.attach("two", two.model)
    for policy in (one, two):  # PEFT marks only a model's active adapter trainable when one is added
        assert all(p.requires_grad for n, p in policy.model.named_parameters() if "lora_" in n)
    layer = next(m for m in sampler.policy.model.modules() if hasattr(m, "lora_A") and "one" in m.lora_A)
    ours = next(m for m in one.model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    assert layer.lora_A["one"].weight is ours.lora_A["default"].weight  # an optimizer step is seen by the next round
    sampler.detach("one")
    assert "one" not in sampler.policy.model.peft_config and "two" in sampler.policy.model.peft_config
    assert all(p.requires_grad for n, p in two.model.named_parameters() if "lora_" in n)
    assert all(p.requires_grad for n, p in one.model.named_parameters() if "lora_" in n)


def lockstep_run(model_dir, root, trainings):
    """Trainings on the toy environment in lockstep, each (name, iterations, after, temperature); their manifests
    and the sampler."""
    sampler = sampler_for(model_dir)

    def job(name, n, deps, temperature):
        cfg = TrainConfig(**{**FAST, "iterations": n, "temperature": temperature})

        def run(s):
            return train_adapter_mixture(model_dir, [TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks)], cfg,
                                         root / name, seed=0, ledger=RolloutLedger(root / f"{name}.jsonl"), name=name,
                                         sampler=s)
        return LockstepJob(name, run, tuple(deps))

    return run_lockstep([job(*t) for t in trainings], sampler), sampler


def lockstep_pair(model_dir, root, iterations=(2, 3), after=(), temperatures=(1.0, 1.0)):
    return lockstep_run(model_dir, root, [("first", iterations[0], (), temperatures[0]),
                                          ("second", iterations[1], after, temperatures[1])])


def test_trainings_in_lockstep_share_rounds_and_give_the_same_bytes_twice(tiny_model_dir, tmp_path):
    # three trainings: after a round the threads go on in the lock's order, which a pair always alternates
    trainings = [("first", 2, (), 1.0), ("second", 3, (), 1.0), ("third", 2, (), 1.0)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    manifests, sampler = lockstep_run(tiny_model_dir, tmp_path / "a", trainings)
    assert [m.capability_id for m in manifests] == ["first", "second", "third"]
    assert [m.iterations for m in manifests] == [2, 3, 2] and [m.rollouts_used for m in manifests] == [8, 12, 8]
    assert sampler.rounds == 3  # two rounds of all three, then one of the longest training alone
    rounds = [[t["lockstep_trainings"] for t in read_timing(tmp_path / "a" / f"{n}.timing.json")["iterations"]]
              for n in ("first", "second", "third")]
    assert rounds == [[3, 3], [3, 3, 1], [3, 3]]
    assert not sampler._models  # every training's adapter left the sampling model
    lockstep_run(tiny_model_dir, tmp_path / "b", trainings)
    for name in ("first", "second", "third"):
        for file in ("adapter_model.safetensors", "train_log.jsonl"):
            assert (tmp_path / "a" / name / file).read_bytes() == (tmp_path / "b" / name / file).read_bytes()
    assert len(read_train_log(tmp_path / "a" / "second")) == 3


def test_a_training_that_waits_for_another_starts_after_it_ends(tiny_model_dir, tmp_path):
    manifests, sampler = lockstep_pair(tiny_model_dir, tmp_path, iterations=(1, 1), after=("first",))
    assert sampler.rounds == 2 and [m.iterations for m in manifests] == [1, 1]
    assert read_timing(tmp_path / "second.timing.json")["iterations"][0]["lockstep_round"] == 1


def test_trainings_at_other_temperatures_share_a_round(tiny_model_dir, tmp_path):
    manifests, sampler = lockstep_pair(tiny_model_dir, tmp_path, iterations=(1, 1), temperatures=(0.7, 1.0))
    assert sampler.rounds == 1 and [m.rollouts_used for m in manifests] == [4, 4]
    assert read_timing(tmp_path / "second.timing.json")["iterations"][0]["lockstep_trainings"] == 2


def test_a_failed_training_stops_the_others_and_its_error_is_raised():
    sampler = LockstepSampler(lambda: None, seed=0)
    sampler._models = {"ok": object()}  # as if attached: the sampler's model is never needed here
    sampler.detach = lambda name: None
    reached, stopped = threading.Event(), []

    def waits(s):
        reached.set()
        try:
            s.play("ok", [], TrainConfig(), 0)
        except LockstepAborted as exc:
            stopped.append(str(exc))
            raise
        return "never"

    def fails(s):
        while not reached.is_set():  # let the other training run until it waits for this one's episodes
            s._cond.wait(0.05)
        raise ValueError("broken environment")

    with pytest.raises(ValueError, match="broken environment"):
        run_lockstep([LockstepJob("ok", waits), LockstepJob("bad", fails)], sampler)
    assert len(stopped) == 1 and "'bad' failed" in stopped[0] and "broken environment" in stopped[0]


def test_a_round_decodes_under_the_decoding_malloc_threshold_and_the_updates_run_under_the_update_one(monkeypatch):
    thresholds, during_play = [], []
    monkeypatch.setattr(lockstep, "set_mmap_threshold", thresholds.append)
    monkeypatch.setattr(lockstep, "play", lambda *a, **kw: during_play.append(thresholds[-1]) or {})
    sampler = LockstepSampler(lambda: None, seed=0)
    sampler.policy = SimpleNamespace(clear_prefix_cache=lambda: None)
    sampler._models = {"ok": object()}  # as if attached
    sampler.detach = lambda name: None

    def trains(s):
        before = thresholds[-1]
        s.play("ok", [], TrainConfig(), 0)
        return before, thresholds[-1]

    assert run_lockstep([LockstepJob("ok", trains)], sampler) == [(lockstep.UPDATE_MMAP_THRESHOLD,) * 2]
    assert during_play == [lockstep.DECODING_MMAP_THRESHOLD]
    assert thresholds[-1] == lockstep.DECODING_MMAP_THRESHOLD  # not the updates' once the lockstep is over
    assert lockstep.UPDATE_MMAP_THRESHOLD < lockstep.DECODING_MMAP_THRESHOLD


def test_jobs_must_have_distinct_names_and_wait_only_for_earlier_jobs():
    sampler = LockstepSampler(lambda: None, seed=0)
    with pytest.raises(ValueError, match="distinct"):
        run_lockstep([LockstepJob("a", lambda s: 1), LockstepJob("a", lambda s: 2)], sampler)
    with pytest.raises(ValueError, match="not earlier jobs"):
        run_lockstep([LockstepJob("a", lambda s: 1, ("b",)), LockstepJob("b", lambda s: 2)], sampler)


def test_trainings_resume_from_the_newest_round_every_unfinished_one_has_a_checkpoint_of():
    # killed between two trainings' updates of a round: one is a checkpoint ahead; one that is done rolls back too
    assert resume_points({"a": 4, "b": 2, "done": 2}, {"a": 7, "b": 7, "done": 2}) == {"a": 2, "b": 2, "done": 2}
    assert resume_points({"a": 4, "b": 2, "done": 2}, {"a": 7, "b": 7, "done": 4}) == {"a": 2, "b": 2, "done": 2}
    assert resume_points({"a": 0, "b": 2}, {"a": 7, "b": 7}) == {"a": 0, "b": 0}
    assert resume_points({"a": 7, "b": 2}, {"a": 7, "b": 2}) == {"a": None, "b": None}  # all done: each its own
    # a training that waited for others and started in round 2: its iteration 1 is round 3
    assert resume_points({"a": 4, "late": 1}, {"a": 7, "late": 2}, {"late": 2}) == {"a": 3, "late": 1}
    assert resume_points({"a": 1, "late": 0}, {"a": 7, "late": 2}, {"late": 2}) == {"a": 1, "late": 0}


def test_a_resume_at_most_an_earlier_iteration_drops_the_later_checkpoints(tiny_model_dir, tmp_path):
    cfg = TrainConfig(**{**FAST, "iterations": 3})
    source = TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks)
    ckpt = tmp_path / "ckpt"

    def train(**kw):
        return train_adapter_mixture(tiny_model_dir, [source], cfg, tmp_path / "adapter", seed=0,
                                     ledger=RolloutLedger(tmp_path / "ledger.jsonl"), name="cap", ckpt_dir=ckpt,
                                     keep_checkpoints=True, **kw)

    straight = train()
    weights = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    assert checkpoint_iterations(ckpt) == [2, 3] and straight.iterations == 3  # TRL keeps the two newest
    again = train(resume_at_most=2)  # resumed from checkpoint-2: its third iteration is trained again
    assert again.rollouts_used == 12 and checkpoint_iterations(ckpt) == [2, 3]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == weights


@pytest.mark.parametrize("differ", [{"dtype": "float32"}, {"shared_prompt": False}, {"micro_batch": 4}])
def test_a_round_refuses_trainings_whose_loss_passes_would_differ(differ):
    """With `micro_batch: 0` the rollouts per loss pass follow `shared_prompt` and the dtype; trainings whose
    gradient accumulation steps differ cannot wait for a round at the same micro-step."""
    sampler = LockstepSampler(lambda: None, seed=0)
    sampler.policy = SimpleNamespace(clear_prefix_cache=lambda: None)
    sampler._order = {"a": 0, "b": 1}
    sampler._handed = {"a": ([], TrainConfig(dtype="bfloat16"), 0),
                       "b": ([], TrainConfig(dtype="bfloat16").model_copy(update=differ), 0)}
    with pytest.raises(ValueError, match=f"'a' and 'b' differ in \\['{next(iter(differ))}'\\]"):
        sampler._play_round()
