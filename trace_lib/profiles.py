"""The profiles: the sizes a run takes unless params.yaml says otherwise (`cpu`, `gpu`, `paper`).

Reads and writes nothing. `trace_lib.config.load_params` lays the chosen profile's values (`profile_values`) under
the file's own, and warns about each file value that replaces one of the profile's (`profile_overrides`).
"""

from __future__ import annotations

import copy
from typing import Any


# Values a profile sets when params.yaml does not. The file's own values win, and `load_params` warns
# about each one that replaces a value of the chosen profile (`profile_overrides`), so a file written for
# one profile cannot silently pin another profile's sizes.
PROFILES: dict[str, dict[str, Any]] = {
    # The CPU default: SmolLM2-135M on 2 cores; on the built-in retail target, the planted testbed (`TESTBED`)
    "cpu": {
        # fp32 or bf16, whichever this CPU computes faster; tools listed as signatures (fewer prompt tokens)
        "model": {"id": "smollm2-135m", "dtype": "auto", "device": "cpu", "tool_format": "signature"},
        # an episode ends at a repeated call (a looping episode is the costliest)
        "env": {"tasks_per_family": 2, "max_steps": 8, "max_errors": 4, "end_on_repeated_call": True},
        # a tool call forced on the first turn: SmolLM2 almost never calls a tool unprompted
        "rollout": {"samples_per_task": 2, "temperature": 0.3, "max_new_tokens": 96, "batch_size": 16,
                    "constrained": True, "tool_choice": "first"},
        # the capability of largest gap only: one adapter's training is what 2 cores afford in the hour
        "score": {"max_kept": 1},
        # each environment fitted to the base model before training (kinds it does not solve, references of full
        # reward), or dropped with the reason
        "synthesize": {"difficulty": 0, "validation": {"band": False},
                       "calibration": {"enabled": True, "seeds": 4, "samples": 8, "max_attempts": 3}},
        # G8 x K8 at T 0.8, 2 of each group the task's reference, 640 rollouts per adapter, LoRA on the top 8
        # layers (docs/LOG.md: the reference-sample gate); GRPO on target and its reads-played ablation at TRACE's
        # total
        "train": {"iterations": 10, "groups": 8, "group_size": 8, "temperature": 0.8, "learning_rate": 2e-3,
                  "reference_samples": 2, "lora_layers": 8, "dtype": "auto",
                  "baselines": ["grpo_target", "grpo_target_late"], "distill": {"iterations": 0}},
        # greedy episodes of every method but GEPA (needs an LLM), merged data and the student (gpu, paper)
        "evaluate": {"methods": ["base", "grpo_target", "grpo_target_late", "linear_merge", "single", "oracle_route",
                                 "trace"], "route_mode": "argmax", "interference_seeds": 2,
                     "router": "knn", "decode_together": True, "batch_size": 32},
        # TRACE after 2, 4, 6 and 8 of its 10 updates (its discovery and calibration first), and the final adapter
        "scaling": {"budgets": [240, 368, 496, 624]},
        "testbed": {
            # four one-lookup families: order_status (the control the base model solves) and three planted
            # deficits; 24 train, 16 validation and 48 test tasks; the router chosen on validation
            "env": {"families": ["order_status", "order_total", "order_tracking", "refuse_cancel"],
                    "tasks_per_family": 6, "validation_fraction": 0.15, "validation_tasks_per_family": 4,
                    "test_tasks_per_family": 12},
            "evaluate": {"router": "auto"},
        },
    },
    # SmolLM2-135M on one GPU: 640 rollouts per adapter, 56 tasks per split, every method (docs/scale.md)
    "gpu": {
        "model": {"id": "smollm2-135m", "dtype": "bfloat16", "device": "auto", "tool_format": "signature"},
        "env": {"tasks_per_family": 8, "max_steps": 8, "max_errors": 4,  # 7 families x 8 = 56 tasks per split
                "end_on_repeated_call": True},
        "rollout": {"samples_per_task": 4, "temperature": 0.3, "max_new_tokens": 128, "batch_size": 64,
                    "constrained": True, "tool_choice": "first"},
        "synthesize": {"difficulty": 0, "validation": {"band": False}},
        "train": {"iterations": 10, "groups": 8, "group_size": 8, "temperature": 0.8, "learning_rate": 2e-4,
                  "dtype": "bfloat16", "hint_fraction": 0.5, "save_every": 2,
                  "baselines": ["grpo_target", "grpo_target_late", "merged_data"], "distill": {"iterations": 4}},
        "evaluate": {"route_mode": "both", "interference_seeds": 2, "router": "calibrated"},
    },
    "paper": {
        "model": {"id": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16"},
        "env": {"tasks_per_family": 64, "max_steps": 30, "max_errors": 10},
        "rollout": {"samples_per_task": 1, "temperature": 0.0, "max_new_tokens": 512,
                    "batch_size": 32, "constrained": False},
        "synthesize": {"validation": {"band": True}},
        "train": {"lora_rank": 16, "lora_alpha": 32, "learning_rate": 1e-5, "iterations": 40, "groups": 64,
                  "group_size": 16, "temperature": 1.0, "max_new_tokens": 512, "max_steps_per_episode": 30,
                  "constrained": False, "tool_choice": "auto", "tool_result_tokens": 1024,
                  "baselines": ["grpo_target", "grpo_target_late", "merged_data"], "distill": {"iterations": 10},
                  "save_every": 5},
    },
}


TESTBED = "testbed"
"""A profile's key for the values it sets only on the built-in retail target (`profile_values`): the cpu profile's
planted testbed. Another target (`env.name`: phone, τ²) keeps the rest of the profile."""


def profile_values(profile: str, data: dict[str, Any]) -> dict[str, Any]:
    """The values profile `profile` sets for params `data`: its own, with its `TESTBED` values on top where the
    target is the built-in retail environment."""
    prof = {k: v for k, v in PROFILES.get(profile, {}).items() if k != TESTBED}
    env = data.get("env") if isinstance(data.get("env"), dict) else {}
    if env.get("name", prof.get("env", {}).get("name", "retail")) == "retail":
        prof = merge(prof, PROFILES.get(profile, {}).get(TESTBED, {}))
    return prof


def profile_overrides(data: dict[str, Any], profile: str | None = None) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value in `data` replaces a different value of the profile's:
    `{"train.iterations": (40, 2)}` (profile's value, the file's)."""
    profile = profile or data.get("profile", "cpu")
    out: dict[str, tuple[Any, Any]] = {}

    def walk(prof: dict[str, Any], given: dict[str, Any], prefix: str) -> None:
        for key, value in prof.items():
            if key not in given:
                continue
            if isinstance(value, dict) and isinstance(given[key], dict):
                walk(value, given[key], f"{prefix}{key}.")
            elif given[key] != value:
                out[f"{prefix}{key}"] = (value, given[key])

    walk(profile_values(profile, data), data, "")
    return out


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` laid over `base`, nested dicts merged key by key (neither is changed)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
