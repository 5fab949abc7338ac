"""What the evaluate stage reads: adapters, their rollout budgets, synthetic envs, router candidates.

Reads (all optional — a missing piece turns the rows that need it into 'not run: <why>'):

    data/adapters/<capability>/            PEFT folder + manifest.json (AdapterManifest), one per
                                           kept capability (train stage)
    data/adapters/_baselines/<name>/       the same for the baselines `grpo_target` (GRPO on the
                                           target's train tasks) and `merged_data` (one adapter on
                                           the mixture of all synthetic environments), and the
                                           distilled student `distilled`
    data/train/[_baselines/]<name>/rollouts.jsonl
                                           the rollout ledger of each adapter (`Paths.train_ledger`); when it
                                           is missing the manifest's `rollouts_used` is used instead
    data/envs/rollouts.jsonl               band-check rollouts of the synthesize stage (TRACE's)
    data/envs/manifests.jsonl, env.py      the validated synthetic environments
    data/score/kept.jsonl                  the kept capabilities (router descriptions)

Writes nothing. Paper §4: methods are compared at equal rollout budget, so TRACE's budget is every
rollout the method cost (the discovery rollouts on the target, the adapters' training and the
synthesize stage's band checks) and `trace_budget` is the number a baseline trainer should be given.

Router examples (paper §3.4 shows each candidate with a solved trajectory): the train stage keeps no
trajectories, so each candidate's example is the synthetic environment's reference solution
(`solve(task)`) on the first training seed, replayed against the scripted customer — the same replay
validation scored 1 on, so it is a correct use of the capability by construction and costs no model
call. Retrieval items are the openings of the first `RETRIEVAL_EXAMPLES` training seeds' tasks.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from trace_lib.budget import adapter_manifest
from trace_lib.config import EnvConfig
from trace_lib.io import read_jsonl
from trace_lib.paths import Paths
from trace_lib.records import Capability, SyntheticEnvManifest, Trajectory

RETRIEVAL_EXAMPLES = 8
"""Synthetic training tasks per capability whose openings the retrieval index holds."""


def check_base_model(folder: Path, base_id: str) -> None:
    """Warn when an adapter was trained on another base model than the one evaluated."""
    manifest = adapter_manifest(folder)
    if manifest is not None and manifest.base_model and manifest.base_model != base_id:
        warnings.warn(f"adapter {folder.name!r} was trained on {manifest.base_model!r}, evaluated on {base_id!r}",
                      stacklevel=2)


def kept_capabilities(root: Path, names: list[str]) -> list[Capability]:
    """The Capability record of each adapter name (kept.jsonl), a bare one where the record is missing."""
    path = Paths(root).kept
    known = {c.id: c for c in read_jsonl(path, Capability)} if path.is_file() else {}
    return [known.get(n) or Capability(id=n, name=n.replace("_", " "), description=n.replace("_", " "))
            for n in names]


def synthetic_manifests(root: Path) -> dict[str, Any]:
    """Capability -> validated SyntheticEnvManifest (empty when the synthesize stage wrote none)."""
    from trace_lib.synth.synthesize import valid_envs

    if not Paths(root).env_manifests.is_file():
        return {}
    return {m.capability_id: m for m in valid_envs(root)}


def why_no_adapters(root: Path) -> str:
    """Why no capability adapter exists, from the score and synthesize stages' records: nothing kept, or each kept
    capability's environment and the reason it was not installed."""
    paths = Paths(root)
    if not paths.env_manifests.is_file():
        return "no capability adapters under data/adapters/"
    manifests = read_jsonl(paths.env_manifests, SyntheticEnvManifest)
    if not manifests:
        return "no capability adapters: the score stage kept no capability"
    dropped = "; ".join(f"{m.capability_id}: {m.reason.split(' (')[0]}" for m in manifests if not m.valid)
    return f"no capability adapters: no environment to train on ({dropped})" if dropped else (
        "no capability adapters under data/adapters/")


def reference_trajectory(box: Any, capability: str, target_cfg: EnvConfig, seed: int, difficulty: int) -> Trajectory:
    """The module's `solve(task)` for one seed, replayed against the scripted customer, as a Trajectory."""
    from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks, task_payload
    from trace_lib.synth.validate import action_message

    task = synthetic_tasks(box, capability, [seed], difficulty, "train")[0]
    actions = box.request("solve", task=task_payload(task))
    env = SyntheticEnv(box, target_cfg)
    env.reset(task)
    try:
        for i, action in enumerate(actions):
            if env.done:
                break
            env.step(action_message(action, i))
        reward, info = env.reward()
        st = env.state
        return Trajectory(
            id=f"{task.id}#ref", task_id=task.id, env=task.env, family=task.family, split=task.split,
            policy_id="reference", seed=seed, messages=st.messages, reward=reward, success=reward >= 1.0,
            termination=st.termination or "", tool_calls=st.tool_calls, invalid_actions=st.invalid_actions,
            tool_errors=st.tool_errors, turns=st.steps, prompt_tokens=0, completion_tokens=0, reward_info=info)
    finally:
        env.close()


def retrieval_openings(box: Any, capability: str, seeds: list[int], difficulty: int) -> list[tuple[str, str]]:
    """(capability, the customer's opening) of the synthetic training tasks of `seeds`."""
    from trace_lib.envs.synthetic import synthetic_tasks
    from trace_lib.envs.user import ScriptedUser

    tasks = synthetic_tasks(box, capability, seeds, difficulty, "train")
    return [(capability, ScriptedUser(t.user).opening()) for t in tasks]
