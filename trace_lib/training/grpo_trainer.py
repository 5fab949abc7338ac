"""TRL's GRPOTrainer with the hooks this project's training needs: episodes as rows, empty rows skipped, the common
prompt start computed once per iteration, and on-policy distillation from teachers.

Reads and writes nothing itself (the trainer, `training/trainer.py`, builds and runs it). `AgentGRPOTrainer`
takes its rollouts from `grpo.AgentRollout` (TRL's `rollout_func`), keeps each iteration's rows in order, skips
the rows whose loss mask is empty (TRL would still run their forward and backward passes) and, with
`train.shared_prompt`, computes the rows' common prompt start once for all of an iteration's loss passes
(`shared_prompt.SharedPrefix`). `DistillGRPOTrainer` trains the student on its teachers' log-probabilities.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from trl import GRPOTrainer
from trl.trainer import grpo_trainer as grpo_trainer_module

from trace_lib.engine.threads import restore_threads
from trace_lib.training import distributed
from trace_lib.training.grpo import AgentRollout, drop_masked_rows, scored_mask
from trace_lib.training.shared_prompt import SharedPrefix, grouped_logps


MIN_PREFIX_TOKENS = 64
"""An iteration's rows must share at least this many tokens for their common start to be computed once for all
of its loss passes (`SharedPrefix`); the system turn and tool list are hundreds."""


def common_prompt_start(batches: Sequence[Mapping[str, Any]]) -> list[int]:
    """The tokens every row's prompt in `batches` (TRL's left-padded `prompt_ids` / `prompt_mask`) starts with,
    leaving out at least each prompt's last token, whose hidden state predicts the row's first completion token."""
    prompts = [ids[m.bool()].tolist() for b in batches for ids, m in zip(b["prompt_ids"], b["prompt_mask"])]
    if not prompts:
        return []
    common = os.path.commonprefix(prompts)
    return list(common[:min(len(p) for p in prompts) - 1])


@contextmanager
def rows_in_order():
    """Within the block, TRL's GRPOTrainer splits a generation batch into passes without shuffling its rows
    first (it shuffles through the module's `shuffle_sequence_dict`, which this replaces by the identity)."""
    name = "shuffle_sequence_dict"
    if not hasattr(grpo_trainer_module, name):
        raise RuntimeError(f"trl.trainer.grpo_trainer has no {name}: this TRL splits its batches differently; "
                           "update AgentGRPOTrainer._prepare_inputs")
    original = getattr(grpo_trainer_module, name)
    setattr(grpo_trainer_module, name, lambda batch: batch)
    try:
        yield
    finally:
        setattr(grpo_trainer_module, name, original)


class AgentGRPOTrainer(GRPOTrainer):
    """TRL's trainer, minus the forward/backward of episodes whose loss mask is empty, and (with
    `shared_prompt`) with every stretch of tokens several rows share computed once (training/shared_prompt.py).

    TRL keeps zero-advantage (and fully masked) rows in the batch; they contribute exactly
    nothing, yet cost a whole forward and backward pass each, on CPU most of an iteration.
    """

    shared_prompt: bool = False
    prompt_grad: bool = True
    """With `shared_prompt`: False runs each row's prompt without gradient (`grouped_logps`)."""
    _score_mask: Any = None
    _prefix: SharedPrefix | None = None
    """With several loss passes per iteration: the start all its rows share, computed once for them all."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # With several processes every row stays: TRL's loss gathers per-row values across processes,
        # which needs the same rows on each (and every process must run the pass).
        kept = inputs if distributed.world()[1] > 1 else drop_masked_rows(inputs)

        def zero():  # a zero loss still connected to the trainable weights, for backward()
            return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0

        if kept is None:
            return zero()
        self._score_mask = scored_mask(kept)
        try:
            loss = super().compute_loss(model, kept, return_outputs, num_items_in_batch)
        finally:
            self._score_mask = None
        # every row masked (kept for the other processes): the shared-prompt pass scored nothing
        return loss if return_outputs or loss.requires_grad else loss + zero()

    def _prepare_inputs(self, generation_batch):
        # TRL shuffles an iteration's rows before it splits them into loss passes. The step is the same in any
        # order (one optimizer step per iteration, the loss normalised over the whole iteration), but its cost
        # is not: the K rows of a group share their task's opening and usually its first tool result, which the
        # prefix tree computes once only when they share a pass. With several passes per iteration the rows
        # keep their order (whole groups per pass, `cpu_pass_rows`), and the start all the iteration's rows share
        # (system turn, tool list) runs once for all its passes (`SharedPrefix`). One pass is shuffled as TRL
        # does, which leaves the default run's draws unchanged.
        if not (self.shared_prompt and self.model.training and self.args.steps_per_generation > 1):
            return super()._prepare_inputs(generation_batch)
        buffered = self._buffered_inputs
        with rows_in_order():
            inputs = super()._prepare_inputs(generation_batch)
        if self._buffered_inputs is not buffered:  # a new iteration: its rows' common start, run once for all passes
            if self._prefix is not None and self._prefix.cache is not None:
                raise RuntimeError("the shared prefix of the last optimizer step was never carried into the weights")
            tokens = common_prompt_start(self._buffered_inputs)
            self._prefix = SharedPrefix(tokens, grad=self.prompt_grad) if len(tokens) >= MIN_PREFIX_TOKENS else None
        return inputs

    def training_step(self, model, inputs, num_items_in_batch=None):
        out = super().training_step(model, inputs, num_items_in_batch)
        # after the last pass before an optimizer step (TRL counts passes in `_step`), before clipping and the
        # step: the shared prefix's gradient into the weights
        if self._prefix is not None and self._step % self.current_gradient_accumulation_steps == 0:
            self._prefix.backward()
        return out

    def _clip_grad_norm(self, model):
        # several processes: average the gradients first, so the norm clipped is the whole batch's (as DDP)
        distributed.average_gradients(model.parameters())
        return super()._clip_grad_norm(model)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        import torch

        # every log-prob pass (loss, old and reference log-probs) runs at the full thread count: sampling may
        # have run on fewer (engine/threads.py)
        restore_threads()
        if not self.shared_prompt or compute_aux_loss or any(v is not None for v in extra.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **extra)
        score = self._score_mask
        if score is not None and score.shape != (input_ids.shape[0], logits_to_keep):
            score = None
        with self.accelerator.autocast():
            logps, entropies = grouped_logps(model, input_ids, attention_mask, logits_to_keep, score,
                                             compute_entropy, temperature=self.temperature,
                                             prompt_grad=self.prompt_grad,
                                             prefix=self._prefix if torch.is_grad_enabled() else None)
        return logps, entropies, None


class DistillRollout(AgentRollout):
    """The student's episodes for distillation: every episode is trained (no group is dropped for equal
    rewards: the signal is the teacher's, token by token); rewards are still scored, for the log."""

    drop_equal_groups = False


def distill_advantages(student: Any, teacher: Any, mask: Any) -> Any:
    """Per-token advantages of on-policy distillation: log π_teacher(y_t) − log π_student(y_t) on the
    trained tokens, 0 elsewhere (rows x completion width). With one update per batch TRL's ratio is 1 and
    its loss is −Σ A_t log π_student(y_t): a policy gradient whose per-token reward is the negative
    reverse-KL sample, which raises the student's tokens the teacher prefers and lowers the others."""
    return (teacher - student) * mask


class DistillGRPOTrainer(AgentGRPOTrainer):
    """On-policy distillation of several teachers into one student, on TRL's GRPO machinery.

    The student plays the episodes (`DistillRollout`); each episode's tokens are then scored by the teacher
    of the source it came from (`teachers`: a Policy holding one adapter per source) and by the student,
    both with no gradient, and the group-normalised reward advantages TRL computed are replaced by the
    per-token `distill_advantages` (TRL's loss takes advantages of shape rows x tokens). Everything else
    (optimizer, checkpoints, resume, ledger, snapshots) is the GRPO trainer's. The authors' code does the
    same with one student episode per task (their 'ppo_surrogate' loss); here the K episodes of a seed
    share their prompt's pass. Teacher and student log-probs are taken at the sampling temperature (the train
    stage's student samples at 1, so they are the models' own).
    """

    teachers: Any = None

    def _generate_and_score_completions(self, inputs):
        import torch

        out = super()._generate_and_score_completions(inputs)
        episodes = self.rollout_func.last
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        keep = out["completion_ids"].shape[1]
        mask = scored_mask(out)
        if len(episodes) != ids.shape[0]:
            raise RuntimeError(f"{len(episodes)} episodes for {ids.shape[0]} rows: cannot pair them with teachers")
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                # at the sampling temperature, as the loss pass scores the student (1 in the train stage)
                student = grouped_logps(model, ids, attention, keep, mask, temperature=self.temperature)[0]
                teacher = torch.zeros_like(student)
                for source in sorted({ep.source for ep in episodes}):
                    rows = torch.tensor([i for i, ep in enumerate(episodes) if ep.source == source],
                                        device=ids.device)
                    self.teachers.set_adapter(source)
                    self.teachers.model.requires_grad_(False)  # PEFT's set_adapter marks the active one trainable
                    teacher[rows] = grouped_logps(self.teachers.model, ids[rows], attention[rows], keep,
                                                  mask[rows], temperature=self.temperature)[0].to(teacher.device)
        finally:
            model.train(was_training)
        out["advantages"] = distill_advantages(student, teacher, mask.to(student.dtype))
        # every process's rows: the log is the same on each (training/distributed.py)
        parts = distributed.gather([(-float(out["advantages"].sum()), float(mask.sum()))])
        n = sum(c for _, c in parts)
        self.rollout_func.stats.setdefault(int(self.state.global_step), {})["distill_kl"] = (
            sum(s for s, _ in parts) / n if n else None)
        return out
