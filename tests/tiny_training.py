"""Small GRPO trainings on the toy environments, shared by the training tests: settings, tasks and runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from toy import KVEnv, kv_task

from trace_lib.config import TrainConfig
from trace_lib.budget import RolloutLedger
from trace_lib.training.grpo import TrainSource
from trace_lib.training.trainer import train_adapter_mixture


FAST = {"groups": 2, "group_size": 2, "max_new_tokens": 12, "max_steps_per_episode": 3, "constrained": False,
        "learning_rate": 1e-2, "save_every": 1}
"""`train` settings of a training test: 2 groups of 2 short episodes per iteration, a checkpoint every iteration."""


def kv_tasks(seeds):
    """The toy KV tasks for these seeds (20 keys, taken in turn), each carrying its seed."""
    return [kv_task(s % 20).model_copy(update={"seed": s}) for s in seeds]


class ParityEnv(KVEnv):
    """Reward 1 when the agent's first turn has an even number of characters: mixed rewards for a random model."""

    name = "parity"

    def _score(self):
        first = next(m for m in self.state.messages if m.role == "assistant")
        return float(len(first.content) % 2 == 0), {}


def fake_unsloth(calls: list) -> SimpleNamespace:
    """Unsloth's `FastLanguageModel` API (what `load_trainable` calls), done with transformers and PEFT, so
    the unsloth path of the train stage runs on a CPU; records its calls."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def from_pretrained(model_name, dtype=None, load_in_4bit=False, **kw):
        calls.append(("from_pretrained", {"model_name": model_name, "dtype": dtype, "load_in_4bit": load_in_4bit,
                                          **kw}))
        return AutoModelForCausalLM.from_pretrained(model_name), AutoTokenizer.from_pretrained(model_name)

    def peft(model, r, lora_alpha, lora_dropout, target_modules, bias, random_state, **kw):
        calls.append(("get_peft_model", {"r": r, "lora_alpha": lora_alpha, "target_modules": target_modules,
                                         "bias": bias, "random_state": random_state, **kw}))
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                                target_modules=target_modules, bias=bias,
                                                layers_to_transform=kw.get("layers_to_transform")))

    return SimpleNamespace(FastLanguageModel=SimpleNamespace(from_pretrained=from_pretrained, get_peft_model=peft))


def lora_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the adapter saved in `path`."""
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def train_toy_adapter(tiny_model_dir, tmp_path, ledger=None, env=ParityEnv, name="cap", out="adapter", **kw):
    """One adapter trained on `env` with `FAST` settings (overridden by `kw`) into `tmp_path / out`: its manifest
    and the rollout ledger."""
    cfg = TrainConfig(**{**FAST, **kw})
    ledger = ledger or RolloutLedger(tmp_path / "ledger.jsonl")
    manifest = train_adapter_mixture(tiny_model_dir, [TrainSource(name, lambda: env(max_steps=3), kv_tasks)], cfg,
                                     tmp_path / out, seed=0, ledger=ledger, name=name)
    return manifest, ledger


def log_row(iteration: int, success: float, reward: float | None = None, **kw) -> dict:
    """A train-log row with every key the trainer writes (beta = 0: TRL logs no kl; no rubric, hint swap or
    efficiency reward), `kw` added or replacing."""
    row = {"iteration": iteration, "reward": success if reward is None else reward, "reward_std": 0.46291,
           "success_rate": success, "frac_reward_zero_std": 0.5, "tool_calls": 2.75, "tool_calls_correct": 1.0,
           "l_t": None, "completion_tokens": 1404, "completion_length": 175.5, "trained_tokens": 191, "hinted": 0,
           "success_rate_unhinted": None, "success_rate_hinted": None, "env_score": success, "rubric": None,
           "preplayed_steps": 0.0, "loss": -0.068, "kl": None, "entropy": 0.685832, "grad_norm": 0.38,
           "clip_ratio": 0.0, "learning_rate": 1e-05, "rollouts": 8 * iteration}
    return {**row, **kw}
