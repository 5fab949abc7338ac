"""The TRL glue (`training/grpo_trainer.py`): the loss pass on rows with loss, at the sampling temperature,
in passes of whole groups, advantages of references and of distillation, on the tiny random model."""

from __future__ import annotations

import pytest
import torch
from tiny_training import FAST, ParityEnv, kv_tasks, train_toy_adapter
from toy import KVEnv, PickEnv, pick_tasks

from trace_lib.config import TrainConfig
from trace_lib.budget import RolloutLedger
from trace_lib.training.grpo import TrainSource
from trace_lib.training.grpo_trainer import AgentGRPOTrainer
from trace_lib.training.trainer import read_train_log, train_adapter_mixture


def test_the_trainer_skips_the_forward_pass_of_rows_without_loss(monkeypatch):
    """AgentGRPOTrainer.compute_loss hands TRL only the rows with loss; with none left, a zero loss that
    still reaches the trainable weights (backward() runs, every gradient is 0)."""
    from trl import GRPOTrainer

    seen = []
    monkeypatch.setattr(GRPOTrainer, "compute_loss",
                        lambda self, model, inputs, *a: seen.append(inputs["advantages"].tolist()) or torch.tensor(1.0))
    trainer = object.__new__(AgentGRPOTrainer)  # compute_loss needs no trainer state
    model = torch.nn.Linear(2, 1)
    model.bias.requires_grad_(False)
    inputs = {
        "prompt_ids": torch.tensor([[4, 5], [6, 7]]), "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 2], [3, 4]]), "completion_mask": torch.ones(2, 2, dtype=torch.long),
        "tool_mask": torch.tensor([[0, 0], [1, 0]]), "advantages": torch.tensor([0.5, -1.0]),
    }
    assert trainer.compute_loss(model, inputs) == 1.0 and seen == [[-1.0]]
    inputs["tool_mask"] = torch.zeros(2, 2, dtype=torch.long)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    assert loss.requires_grad and float(loss.detach()) == 0.0 and seen == [[-1.0]]  # TRL was not called
    assert model.weight.grad is not None and model.weight.grad.abs().sum() == 0


def test_the_shared_prompt_pass_scores_at_the_sampling_temperature_as_trls_own(tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    """The loss pass takes the log-probs of the distribution the rollouts were drawn from (logits / T), as TRL's
    own pass does: on the batch of a real iteration at T = 0.5 both give the same values on the trained tokens,
    and they differ from the temperature-1 log-probs."""
    import trace_lib.training.trainer as train_mod
    from trl import GRPOTrainer

    captured: list = []
    ours = train_mod.AgentGRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = ours(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if torch.is_grad_enabled() and not captured:
            captured.append((self, model, input_ids, attention_mask, logits_to_keep, self._score_mask))
        return out

    monkeypatch.setattr(train_mod.AgentGRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    cfg = TrainConfig(**{**FAST, "iterations": 1, "group_size": 4, "temperature": 0.5})
    ledger = RolloutLedger(tmp_path / "ledger.jsonl")
    train_adapter_mixture(tiny_model_dir, [TrainSource("p", lambda: ParityEnv(max_steps=3), kv_tasks)], cfg,
                          tmp_path / "p", seed=0, ledger=ledger, name="p")
    assert captured, "no loss pass ran: every group had equal rewards"
    trainer, model, ids, attention, keep, score = captured[0]
    assert trainer.temperature == 0.5
    scored = score.bool()
    with torch.no_grad():
        # both on the weights after the step
        mine = ours(trainer, model, ids, attention, keep)[0]
        trl = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, attention, keep)[0]
        trainer.temperature = 1.0  # TRL's fused head keeps the temperature it was built with; ours reads this
        at_one = ours(trainer, model, ids, attention, keep)[0]
    assert int(scored.sum()) > 0
    assert torch.allclose(mine[scored], trl[scored], atol=1e-4)
    assert float((mine[scored] - at_one[scored]).abs().max()) > 1e-2


def test_prompt_grad_false_reaches_the_loss_pass(tiny_model_dir, tmp_path, monkeypatch):
    """`train.prompt_grad: false` is what the trainer's loss pass runs with (its effect on the gradient:
    tests/training/test_shared_prompt.py)."""
    import trace_lib.training.grpo_trainer as train_mod

    seen: list = []
    real = train_mod.grouped_logps

    def spy(*args, **kwargs):
        if torch.is_grad_enabled():
            seen.append(kwargs.get("prompt_grad", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "grouped_logps", spy)
    cfg = TrainConfig(**{**FAST, "iterations": 1, "group_size": 4, "temperature": 0.5, "prompt_grad": False})
    train_adapter_mixture(tiny_model_dir, [TrainSource("p", lambda: ParityEnv(max_steps=3), kv_tasks)], cfg,
                          tmp_path / "p", seed=0, ledger=RolloutLedger(tmp_path / "ledger.jsonl"), name="p")
    assert seen and not any(seen)


def test_an_iteration_in_several_passes_gives_each_pass_whole_groups(tiny_model_dir, tmp_path, monkeypatch):
    """TRL shuffles an iteration's rows before it splits them into loss passes; with several passes the rows keep
    their order, so each pass holds whole groups (whose rows share their task's opening in the prefix tree), and
    TRL's shuffle is back in place afterwards."""
    import trace_lib.training.trainer as train_mod
    from trl.trainer import grpo_trainer

    passes: list = []
    real = train_mod.AgentGRPOTrainer.compute_loss

    def spy(self, model, inputs, *args, **kwargs):
        passes.append([tuple(row) for row in inputs["prompt_ids"].tolist()])
        return real(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(train_mod.AgentGRPOTrainer, "compute_loss", spy)
    shuffle = grpo_trainer.shuffle_sequence_dict
    train_toy_adapter(tiny_model_dir, tmp_path, iterations=1, groups=4, group_size=2, micro_batch=2)
    assert len(passes) == 4 and all(len(rows) == 2 for rows in passes)
    assert all(rows[0] == rows[1] for rows in passes)  # one group's two rows: the same task
    assert len({rows[0] for rows in passes}) == 4  # four groups, one per pass
    assert grpo_trainer.shuffle_sequence_dict is shuffle


def test_several_passes_with_the_common_start_run_once_give_the_one_pass_gradient(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """An iteration in four passes, the rows' common start computed once for all of them (`SharedPrefix`), reaches
    the same gradient before clipping as the iteration in one pass (the same episodes: sampling comes first)."""
    import trace_lib.training.shared_prompt as shared_mod
    import trace_lib.training.grpo_trainer as train_mod

    monkeypatch.setattr(train_mod, "MIN_PREFIX_TOKENS", 1)  # the toy environment's prompts are short
    grads: dict[int, dict[str, torch.Tensor]] = {}
    runs: list[int] = []
    real_average, real_ensure = train_mod.distributed.average_gradients, shared_mod.SharedPrefix.ensure

    def capture(params):
        params = list(params)
        grads[runs[-1]] = {str(i): p.grad.clone() for i, p in enumerate(params) if p.grad is not None}
        return real_average(params)

    prefix_runs: list[int] = []
    monkeypatch.setattr(train_mod.distributed, "average_gradients", capture)
    monkeypatch.setattr(shared_mod.SharedPrefix, "ensure",
                        lambda self, *a: (self.cache is None and prefix_runs.append(runs[-1])) or real_ensure(self, *a))
    for micro in (8, 2):
        runs.append(micro)
        # fp32 whatever the CPU: the two ways sum the same gradients in another order
        train_toy_adapter(tiny_model_dir, tmp_path / str(micro), iterations=1, groups=4, group_size=2, micro_batch=micro,
              dtype="float32")
    assert prefix_runs == [2]  # computed once, by the split iteration only
    assert grads[8].keys() == grads[2].keys() and grads[8]
    assert any(float(g.abs().sum()) > 0 for g in grads[8].values())
    for key, g in grads[8].items():
        assert torch.allclose(grads[2][key], g, atol=1e-6, rtol=1e-4), key


def test_distill_advantages_are_the_teacher_minus_student_log_probs_on_trained_tokens():
    from trace_lib.training.grpo_trainer import distill_advantages

    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-1.0, -0.1, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert torch.equal(distill_advantages(student, teacher, mask), torch.tensor([[0.5, -0.5, 0.0], [2.0, 0.0, 0.0]]))


def _save_lora(model_dir, folder, seed):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), _lora())
    model.save_pretrained(folder)
    return folder


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False)


def test_distillation_scores_each_episode_with_the_teacher_of_its_source(tiny_model_dir, tmp_path, monkeypatch):
    """Rows of source `a` get teacher `a`'s log-probs, rows of `b` teacher `b`'s (a stand-in log-prob pass
    returns a constant per model and adapter), and every episode is trained though all rewards are equal."""
    import trace_lib.training.grpo_trainer as train_mod

    teachers = {"a": _save_lora(tiny_model_dir, tmp_path / "ta", 1),
                "b": _save_lora(tiny_model_dir, tmp_path / "tb", 2)}
    real = train_mod.grouped_logps
    seen: list = []

    def fake(model, ids, attention, keep, mask=None, compute_entropy=False, **kw):
        if torch.is_grad_enabled():  # the loss pass
            return real(model, ids, attention, keep, mask, compute_entropy, **kw)
        trainer = seen[-1]
        fill = {"a": -1.0, "b": -2.0}[trainer.teachers.adapter] if model is trainer.teachers.model else -3.0
        return torch.full((ids.shape[0], keep), fill), None

    original = train_mod.DistillGRPOTrainer._generate_and_score_completions
    captured: list = []

    def spy(self, inputs):
        seen.append(self)
        out = original(self, inputs)
        mask = out["completion_mask"] * out["tool_mask"]
        captured.append((out["advantages"], mask, [ep.source for ep in self.rollout_func.last]))
        return out

    monkeypatch.setattr(train_mod, "grouped_logps", fake)
    monkeypatch.setattr(train_mod.DistillGRPOTrainer, "_generate_and_score_completions", spy)
    cfg = TrainConfig(**{**FAST, "iterations": 1, "groups": 4})
    srcs = [TrainSource(name, lambda: KVEnv(max_steps=3), kv_tasks) for name in ("a", "b")]
    ledger = RolloutLedger(tmp_path / "ledger.jsonl")
    m = train_adapter_mixture(tiny_model_dir, srcs, cfg, tmp_path / "student", seed=0, ledger=ledger, name="distilled",
                              teachers=teachers)
    advantages, mask, sources = captured[0]
    assert sorted(set(sources)) == ["a", "b"]
    for row, source in enumerate(sources):
        assert torch.equal(advantages[row], {"a": 2.0, "b": 1.0}[source] * mask[row].float())
    assert m.config["teachers"] == {k: v.as_posix() for k, v in teachers.items()} and m.config["teachers_digest"]
    row = read_train_log(tmp_path / "student")[0]
    assert row["frac_reward_zero_std"] == 0.0 and row["trained_tokens"] > 0 and m.rollouts_used == 8
    kl = -float((advantages * mask).sum() / mask.sum())
    assert row["distill_kl"] == pytest.approx(kl, abs=1e-6)
    # the student's folder holds its own adapter only, and the teachers are untouched
    assert not any(p.is_dir() and p.name in teachers for p in (tmp_path / "student").iterdir())
    with pytest.raises(ValueError, match="one teacher per source"):
        train_adapter_mixture(tiny_model_dir, srcs, cfg, tmp_path / "other", seed=0, ledger=ledger, name="other",
                              teachers={"a": teachers["a"]})


def test_a_reference_is_trained_with_its_groups_advantage(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    original = AgentGRPOTrainer.compute_loss

    def spy(self, model, inputs, *args, **kwargs):
        seen.append({k: inputs[k].clone() for k in ("advantages", "completion_ids", "completion_mask")})
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(AgentGRPOTrainer, "compute_loss", spy)
    cfg = TrainConfig(**{**FAST, "groups": 1, "group_size": 4, "iterations": 1, "reference_samples": 1})
    never = lambda task: [{"tool": "escalate", "arguments": {}}]  # noqa: E731
    manifest = train_adapter_mixture(
        tiny_model_dir, [TrainSource("pick", lambda: PickEnv(target="escalate"), pick_tasks, reference=never)], cfg,
        tmp_path / "adapter", seed=0, ledger=RolloutLedger(tmp_path / "ledger.jsonl"), name="pick")
    assert manifest.rollouts_used == 4 and manifest.config["train"]["reference_samples"] == 1
    row = read_train_log(tmp_path / "adapter")[0]
    assert row["references"] == 1 and row["reference_skipped"] == 0
    batch = {k: torch.cat([s[k] for s in seen]) if k == "advantages" else [r for s in seen for r in s[k]]
             for k in seen[0]}
    tok_texts = [read_tokens(tiny_model_dir, ids, mask) for ids, mask in zip(batch["completion_ids"],
                                                                             batch["completion_mask"], strict=True)]
    refs = [i for i, t in enumerate(tok_texts) if '"name": "escalate"' in t]
    assert refs, tok_texts
    rewards = torch.tensor([1.0 if '"name": "escalate"' in t else 0.0 for t in tok_texts])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # TRL: group-normalised
    assert torch.allclose(batch["advantages"].flatten().float(), expected, atol=1e-3)


def read_tokens(model_dir, ids, mask) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.decode([int(i) for i, m in zip(ids, mask, strict=True) if m])
