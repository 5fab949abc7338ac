"""The token-scripted policy over the tiny model with a fresh LoRA adapter, for the training tests."""

from __future__ import annotations

import pytest
from scripted_tokens import ScriptedPolicy

from trace_lib.config import TrainConfig
from trace_lib.training.trainer import load_trainable


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    policy, _ = load_trainable(tiny_model_dir, TrainConfig(), "trl", seed=0)
    return ScriptedPolicy(policy.model, policy.tokenizer, "tiny")
