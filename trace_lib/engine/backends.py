"""The agent policy a stage runs on, as `params.policy` names it: trace's engine or a server.

Reads the prepared model folder (embedded) or nothing (openai); writes nothing. Both return an object
with the `Generator` protocol (agent/rollout.py), `set_adapter`, `policy_id` and `device`, which the
routing (`routing.route`) and composition (`engine.compose.apply_route`) code drive either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trace_lib.config import ModelConfig, PolicyConfig


def check_model_dir(policy_cfg: PolicyConfig, model_dir: Path) -> None:
    """Fail before any work when trace's engine is to run and the prepared model folder is missing."""
    if policy_cfg.backend == "embedded" and not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} not found: run the prepare_model stage first "
                                "(dvc repro prepare_model)")


def open_policy(model_cfg: ModelConfig, policy_cfg: PolicyConfig, model_dir: Path,
                adapters: Mapping[str, str | Path] | None = None, *, threads: int = 0) -> Any:
    """The policy with `adapters` ({name: adapter folder}) loaded, the base model active.

    embedded: `engine.policy.load_policy` on `model_dir`, the prepared `model.out_dir` (`threads` torch
    threads; 0 leaves them).
    openai: `engine.remote.OpenAIPolicy` at `policy.base_url`, each adapter loaded into the server at run
    time from its absolute path (the server must see the same file system and allow run-time loading)."""
    if policy_cfg.backend == "openai":
        from trace_lib.engine.remote import OpenAIPolicy

        policy = OpenAIPolicy.from_config(policy_cfg, default_model=model_cfg.id,
                                          tool_format=model_cfg.tool_format)
        for name, folder in sorted((adapters or {}).items()):
            policy.load_adapter(name, str(Path(folder).resolve()))
        return policy
    from trace_lib.engine.policy import load_policy  # heavy import (torch), kept out of module import time

    check_model_dir(policy_cfg, model_dir)
    return load_policy(model_dir, dtype=model_cfg.dtype, device=model_cfg.device, threads=threads,
                       tool_format=model_cfg.tool_format,
                       adapters={n: str(p) for n, p in adapters.items()} if adapters else None)
