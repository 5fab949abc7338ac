"""GRPO training of one LoRA adapter on one or more environments (paper §3.3); the train stage
(`stages/train.py`) calls it once per capability and per baseline.

Reads the prepared model folder and one or more environments (a `make_env` factory and a
`make_tasks(seeds)` generator each); writes, atomically (a temp folder renamed into place):

    out_dir/                      PEFT adapter (`PeftModel.from_pretrained(base, out_dir)` loads it)
    out_dir/train_log.jsonl       one row per iteration, no timings: the same seed gives the same bytes
    out_dir/manifest.json         AdapterManifest
    out_dir/snapshots/iter-<k>/   the adapter after each earlier checkpoint + snapshot.json {iteration,
                                  rollouts} (`train.snapshots`): the scaling stage's budget points

and appends every episode it rolls out to the caller's RolloutLedger (stage "train", key = name); given `curves`,
each iteration's row also goes to DVCLive's files as it is logged (training/tracking.py).
Wall times (seconds per iteration, rollout and total) go to `timing_path` (default
`out_dir.parent/<out_dir name>.timing.json`), outside the adapter folder: a cached artifact holds no
timings, so the same seed gives the same adapter folder bytes.

One iteration = one optimizer step of TRL's GRPOTrainer on G groups x K rollouts: the dataset
rows are environment seeds (`seed_offset`, `seed_offset + 1`, ...; row g is group g), TRL repeats
each K times, and `grpo.AgentRollout` (its `rollout_func`) plays them as multi-turn episodes on
the trainer's current model. TRL provides the rest: group-normalised advantages, the clipped
objective (`epsilon`), the KL term (`beta`, 0 by default), optimizer and checkpoints. What we add
at its hooks: the rollout function and its loss mask (grpo.py); `AgentGRPOTrainer` (grpo_trainer.py), TRL's
trainer whose `compute_loss` skips episodes whose mask is empty (TRL would still run their forward and
backward passes) and which, when an iteration takes several loss passes, gives each pass whole groups and
runs the start all rows share once for all passes (`_prepare_inputs`, `SharedPrefix`); `TraceCallback`,
which builds our log from TRL's metrics and saves our own state next to each TRL checkpoint;
`_resume_state`, which picks the newest complete checkpoint of the same configuration, whose ledger rows then
replace the ledger's.

Resume: TRL/HF checkpoints (adapter, optimizer, scheduler, RNG, trainer state) go to
`ckpt_dir/checkpoint-<step>/` (default `out_dir.parent/.<name>.ckpt/`) every `save_every` iterations,
plus our `trace_state.json`, written last (log rows, reward state incl. l_t, the adapter's ledger rows,
a fingerprint of the configuration). A restarted run continues from the newest checkpoint that has it
and the same fingerprint (others are deleted), and removes the folder once the adapter is written
unless the caller keeps it (`keep_checkpoints`: the train stage keeps every adapter's until the stage
is done, because DVC deletes a stage's outputs, finished adapters included, before rerunning it).

Budget: the adapter may spend `rollout_budget` (default iterations x G x K) rollouts; training
runs as many whole iterations as the ledger's remaining budget pays for. On (re)start the adapter's
ledger rows are set to the checkpoint's (none without one): rows a lost run appended after its last
checkpoint are dropped, rows the file lost are restored, so the ledger counts the rollouts behind the
adapter it ends with.

Backends: 'trl' loads the model with transformers and wraps it with PEFT; 'unsloth' (CUDA only)
uses `FastLanguageModel` for both, then the same trainer path.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PrinterCallback, TrainerCallback
from trl import GRPOConfig

from trace_lib.engine.threads import set_threads
from trace_lib.config import TrainConfig
from trace_lib.io import (
    atomic_write_text,
    dumps_json,
    iter_jsonl,
    read_json,
    write_json,
)
from trace_lib.records import AdapterManifest
from trace_lib.training import distributed
from trace_lib.budget import RolloutLedger
from trace_lib.training.grpo import AgentRollout, TrainSource, prompt_key, trajectory_reward
from trace_lib.training.grpo_trainer import AgentGRPOTrainer, DistillGRPOTrainer, DistillRollout
from trace_lib.training.rewards import make_reward
from trace_lib.training.tracking import EXTRA_LOG_KEYS, LOG_KEYS, TRL_KEYS, LiveCurves

STAGE = "train"
STATE_FILE = "trace_state.json"
SNAPSHOTS = "snapshots"
"""Sub-folder of an adapter with the adapter of each earlier checkpoint (`train.snapshots`)."""


# --- backends and model ---------------------------------------------------------------------------
def resolve_train_backend(name: str) -> str:
    """'trl' or 'unsloth' for `train.backend` ('auto': unsloth only with CUDA and an importable unsloth)."""
    import torch

    if name == "trl":
        return "trl"
    if name == "unsloth":
        if not torch.cuda.is_available():
            raise RuntimeError("train.backend 'unsloth' needs a CUDA GPU and none is available; "
                               "use 'trl' (CPU or GPU) or 'auto'")
        return "unsloth"
    if name == "auto":
        if torch.cuda.is_available():
            try:
                import unsloth  # noqa: F401
            except Exception:  # not installed, or unusable on this GPU: TRL works everywhere
                return "trl"
            return "unsloth"
        return "trl"
    raise ValueError(f"train.backend must be 'auto', 'trl' or 'unsloth', got {name!r}")


def lora_config(cfg: TrainConfig, model: Any):
    """PEFT LoraConfig from the train section, targeting only the listed modules the model has, in the top
    `lora_layers` decoder layers (all of them when None)."""
    from peft import LoraConfig

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = [m for m in cfg.target_modules if m in names]
    if not targets:
        raise ValueError(f"train.target_modules {cfg.target_modules} match no module of the model")
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, layers_to_transform=top_layers(cfg, model), bias="none",
                      task_type="CAUSAL_LM")


def top_layers(cfg: TrainConfig, model: Any) -> list[int] | None:
    """The decoder layer indices `train.lora_layers` puts LoRA on (the last k of the model's), or None for all (also
    where k is at least the model's layer count: a profile's k is sized for its own model)."""
    k = cfg.lora_layers
    if k is None:
        return None
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    if not n:
        raise ValueError("train.lora_layers needs the model's layer count (config.num_hidden_layers), which "
                         "this model's config does not give")
    return list(range(n - k, n)) if k < n else None


def stable_target_modules(model: Any) -> None:
    """Make the PEFT config save the same bytes in every process: PEFT keeps `target_modules` as a set
    and writes it to adapter_config.json in hash order, which changes with each interpreter's hash seed
    (so a rerun of the same training changed data/adapters for DVC). A sorted list matches the same
    modules."""
    for peft_cfg in model.peft_config.values():
        if isinstance(peft_cfg.target_modules, set):
            peft_cfg.target_modules = sorted(peft_cfg.target_modules)


def train_dtype(cfg: TrainConfig) -> str:
    """The base weights' dtype while training (`train.dtype`; 'auto': bfloat16 where it is faster than float32
    on the training device, CUDA or a CPU with AMX or AMD's AVX-512 bf16, else float32:
    `engine.model.compute_dtype`)."""
    from trace_lib.engine.model import compute_dtype
    from trace_lib.engine.policy import resolve_device

    return compute_dtype(cfg.dtype, resolve_device("auto"))


def load_trainable(model_dir: Path, cfg: TrainConfig, backend: str, seed: int, tool_format: str | None = None):
    """(Policy over the LoRA-wrapped model, base model id); the adapter is named 'default'."""
    from transformers import set_seed

    from trace_lib.engine.policy import Policy, load_policy, resolve_model_path, use_tool_template

    set_seed(seed)  # the LoRA init draws from the global RNG
    if backend == "unsloth":
        from unsloth import FastLanguageModel  # lazy: GPU machines only

        load, base_id = resolve_model_path(model_dir)
        model, tokenizer = FastLanguageModel.from_pretrained(model_name=load, dtype=None, load_in_4bit=False)
        lcfg = lora_config(cfg, model)
        # Unsloth's own activation checkpointing turns the decoder's KV cache off, which the shared-prompt pass
        # continues from (and TRL's pass is told to checkpoint by GRPOConfig when the shared prompt is off)
        model = FastLanguageModel.get_peft_model(
            model, r=lcfg.r, lora_alpha=lcfg.lora_alpha, lora_dropout=lcfg.lora_dropout,
            target_modules=sorted(lcfg.target_modules), bias="none", random_state=seed,
            use_gradient_checkpointing=False if cfg.shared_prompt else "unsloth",
            **({"layers_to_transform": lcfg.layers_to_transform} if lcfg.layers_to_transform is not None else {}))
        stable_target_modules(model)
        tool_format = use_tool_template(tokenizer, model_dir, tool_format)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        policy = Policy(model, tokenizer, base_id, tool_format=tool_format)
        policy.set_adapter("default")
        return policy, base_id
    from peft import get_peft_model

    policy = load_policy(model_dir, dtype=train_dtype(cfg), tool_format=tool_format)
    policy.model = get_peft_model(policy.model, lora_config(cfg, policy.model))
    stable_target_modules(policy.model)
    policy.set_adapter("default")  # generate with the adapter being trained, not the base model
    return policy, policy.base_id


# --- curriculum -------------------------------------------------------------------------------------
def group_sources(weights: Sequence[float], n_groups: int, seed: int) -> list[int]:
    """Source index of each group, drawn i.i.d. with the mixing weights by a seeded RNG."""
    if not weights or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"mixing weights must be non-negative with a positive sum, got {list(weights)}")
    rng = random.Random(f"trace-mixture-{seed}")
    return rng.choices(range(len(weights)), weights=list(weights), k=n_groups)


def train_dataset(sources: Sequence[TrainSource], cfg: TrainConfig, seed: int):
    """One row per group: prompt "<source>:<env seed>" (what AgentRollout plays)."""
    from datasets import Dataset

    n = cfg.iterations * cfg.groups
    which = group_sources([s.weight for s in sources], n, seed) if len(sources) > 1 else [0] * n
    return Dataset.from_list([{"prompt": prompt_key(sources[w].name, cfg.seed_offset + g)}
                              for g, w in enumerate(which)])


class TraceCallback(TrainerCallback):
    """Builds train_log rows from TRL's metrics + our rollout stats; saves our state with checkpoints."""

    def __init__(self, rollout: AgentRollout, run: dict[str, Any], rollouts_used: Callable[[], int],
                 save_state: Callable[[Path, int], None], curves: LiveCurves | None = None) -> None:
        self.rollout, self.run, self.rollouts_used, self.save_state = rollout, run, rollouts_used, save_state
        self.curves = curves
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        timing = self.rollout.stats.get(state.global_step - 1, {}).get("_timing", {})
        self.run["timing"].append({"iteration": state.global_step, "seconds": time.perf_counter() - self._t0,
                                   **{k: timing[k] for k in sorted(timing)}})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:  # the end-of-training summary has no metrics of ours
            return
        stats = self.rollout.stats.get(state.global_step - 1, {})
        row: dict[str, Any] = {"iteration": state.global_step}
        row.update({k: stats.get(k) for k in LOG_KEYS})
        row.update({k: stats[k] for k in EXTRA_LOG_KEYS if k in stats})
        row.update({k: logs.get(src) for k, src in TRL_KEYS.items()})
        row["rollouts"] = self.rollouts_used()
        self.run["log"].append({k: _round(v) for k, v in row.items()})
        if self.curves is not None:  # on_step_end has added this iteration's timing
            timing = self.run["timing"][-1] if self.run["timing"] else None
            self.curves.log(self.run["log"][-1], timing if timing and timing["iteration"] == state.global_step
                            else None, self.rollout.last)

    def on_save(self, args, state, control, **kwargs):
        self.save_state(Path(args.output_dir) / f"checkpoint-{state.global_step}", state.global_step)


def keep_snapshot(checkpoint: Path, dest: Path, iteration: int, rollouts: int) -> None:
    """Copy a checkpoint's adapter (config + weights, no optimizer) to `dest` with its budget: the
    scaling stage evaluates these instead of retraining at each budget."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for fname in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy2(checkpoint / fname, tmp / fname)
    write_json(tmp / "snapshot.json", {"iteration": iteration, "rollouts": rollouts})
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def _round(v: Any) -> Any:
    if isinstance(v, dict):  # the rubric's item means
        return {k: _round(x) for k, x in v.items()}
    return round(v, 6) + 0.0 if isinstance(v, float) else v  # + 0.0: no "-0.0" in the log


WATCHING = frozenset({"report_to", "episodes_logged"})
"""Train settings of how a run is watched, not of what it trains."""


def train_record(cfg: TrainConfig, exclude: set[str] = frozenset()) -> dict[str, Any]:
    """The train config as a manifest and a checkpoint's fingerprint record it, without `WATCHING`; the
    reference-sample fields are left out while they are off, so a training without them records what it recorded
    before they existed."""
    off = {"reference_samples", "reference_when"} if not cfg.reference_samples else set()
    return cfg.model_dump(mode="json", exclude=set(exclude) | off | WATCHING)


def _fingerprint(cfg: TrainConfig, sources: Sequence[TrainSource], seed: int, env_sha256: str,
                 resume_key: str) -> str:
    """What a checkpoint is only valid under: the train config, seed, sources and the caller's key."""
    # what trains after this adapter (baselines, the distilled student) does not change it
    train = train_record(cfg, exclude={"baselines", "distill"})
    what = {"train": train, "seed": seed, "sources": {s.name: s.weight for s in sources},
            "env_sha256": env_sha256, "resume_key": resume_key}
    return hashlib.sha256(dumps_json(what).encode("utf-8")).hexdigest()


def checkpoint_iterations(ckpt_root: Path) -> list[int]:
    """The iterations of the complete checkpoints in `ckpt_root` (those that hold our state file), ascending."""
    if not Path(ckpt_root).is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in Path(ckpt_root).glob("checkpoint-*")
                  if p.name.split("-")[1].isdigit() and (p / STATE_FILE).is_file())


def _resume_state(ckpt_root: Path, fingerprint: str, delete: bool = True, at_most: int | None = None
                  ) -> tuple[Path | None, dict[str, Any]]:
    """The newest checkpoint that holds our state file (a crash mid-save leaves one without) saved
    under `fingerprint`, of iteration `at_most` or earlier when given (later checkpoints and their snapshots
    are then deleted, if `delete`: the run goes on from the earlier one); when there is none, anything in
    `ckpt_root` is deleted (a crashed run of another configuration must not be resumed, nor its files mixed
    with this run's) if `delete`."""
    found = [i for i in checkpoint_iterations(ckpt_root) if at_most is None or i <= at_most]
    if found:
        path = ckpt_root / f"checkpoint-{found[-1]}"
        state = read_json(path / STATE_FILE)
        if state.get("fingerprint") == fingerprint:
            if delete:
                for later in [*ckpt_root.glob("checkpoint-*"), *(ckpt_root / SNAPSHOTS).glob("iter-*")]:
                    step = later.name.split("-")[1]
                    if step.isdigit() and int(step) > found[-1]:
                        shutil.rmtree(later)
            return path, state
        warnings.warn(f"{ckpt_root}: checkpoints of another configuration deleted; training starts over",
                      stacklevel=3)
    if delete and ckpt_root.is_dir():
        shutil.rmtree(ckpt_root)
    return None, {"iteration": 0, "ledger": [], "log": [], "timing": [], "episodes": [], "reward": None}


def _remove_leftovers(out_dir: Path) -> None:
    """Remove the temp and old folders of `out_dir` that a process killed in `_replace_dir` left."""
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for stale in out_dir.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move a finished folder into place; the old one (if any) is removed only after the rename."""
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


# --- training ---------------------------------------------------------------------------------------
def train_adapter_mixture(model_dir: Path, sources: Sequence[TrainSource], cfg: TrainConfig, out_dir: Path, *,
                          seed: int, ledger: RolloutLedger, name: str, progress: bool = False,
                          env_sha256: str = "", ckpt_dir: Path | None = None, resume_key: str = "",
                          keep_checkpoints: bool = False, timing_path: Path | None = None,
                          teachers: Mapping[str, Path] | None = None, tool_format: str | None = None,
                          sampler: Any = None, resume_at_most: int | None = None,
                          curves: LiveCurves | None = None) -> AdapterManifest:
    """Train one LoRA adapter with GRPO on one or more environments (see the module docstring for the
    outputs); with several, each group's source is drawn with the sources' weights.

    `ckpt_dir` (default `out_dir.parent/.<name>.ckpt`) holds the checkpoints a restarted run resumes
    from; `resume_key` is anything else they are only valid under (the caller's config); with
    `keep_checkpoints` they stay after the adapter is written, for the caller to delete. `timing_path`
    receives the wall times (module docstring). With `teachers` (source name -> adapter folder, one per
    source) the adapter is a student distilled from them on-policy (`DistillGRPOTrainer`) instead of
    trained on rewards. `tool_format` (`model.tool_format`): how the prompts list the tools; None: as the
    prepared folder records it. `sampler` (a `training.lockstep.LockstepSampler`): each iteration's episodes
    are played in one batch with other trainings' (the train stage's `train.lockstep`); `resume_at_most`: resume
    from a checkpoint of that iteration or earlier (trainings in lockstep resume from one round). `curves`
    (`tracking.LiveCurves`): where each iteration's row goes while it trains (DVCLive's files), restarted from
    the resumed checkpoint's rows."""
    if len({s.name for s in sources}) != len(sources) or not sources:
        raise ValueError(f"need one or more sources with distinct names, got {[s.name for s in sources]}")
    if any(":" in s.name for s in sources):
        raise ValueError("source names must not contain ':'")
    out_dir = Path(out_dir)
    if Path(ledger.path).resolve().is_relative_to(out_dir.resolve()):
        raise ValueError(f"the ledger {ledger.path} must live outside out_dir {out_dir} (out_dir is replaced whole)")
    backend = resolve_train_backend(cfg.backend)
    rank, size = distributed.init()
    _micro_batch(cfg, size)
    if rank > 0:  # process 0 writes the ledger; the others append the same counts to a copy of it
        shared = ledger
        ledger = RolloutLedger(distributed.private_copy(shared.path, rank))
    distributed.barrier()  # every copy is taken before process 0 changes the ledger
    per_iter = cfg.groups * cfg.group_size
    budget = cfg.rollout_budget or cfg.iterations * per_iter
    ckpt_root = Path(ckpt_dir) if ckpt_dir is not None else out_dir.parent / f".{name}.ckpt"
    if ckpt_root.resolve().is_relative_to(out_dir.resolve()):
        raise ValueError(f"the checkpoints {ckpt_root} must live outside out_dir {out_dir} (out_dir is replaced whole)")
    if teachers is not None and sorted(teachers) != sorted(s.name for s in sources):
        raise ValueError(f"distillation needs one teacher per source: teachers {sorted(teachers)}, "
                         f"sources {sorted(s.name for s in sources)}")
    teachers_digest = None
    if teachers is not None:  # a checkpoint is only valid for the teachers it was distilled from
        from trace_lib.engine.adapters import adapter_digest

        teachers_digest = adapter_digest(teachers, dict.fromkeys(teachers, 1.0))
        resume_key += "|teachers:" + teachers_digest
    fingerprint = _fingerprint(cfg, sources, seed, env_sha256, resume_key)
    if rank == 0:  # process 0 decides (and deletes a stale folder) before the others read
        ckpt, state = _resume_state(ckpt_root, fingerprint, at_most=resume_at_most)
    distributed.barrier()
    if rank > 0:
        ckpt, state = _resume_state(ckpt_root, fingerprint, delete=False, at_most=resume_at_most)
    dropped = ledger.reset(STAGE, name, state["ledger"])
    if dropped > 0:
        warnings.warn(f"{ledger.path}: dropped {dropped} rollouts of {name!r} logged after the checkpoint resumed "
                      f"({ckpt.name if ckpt else 'none: training starts over'})", stacklevel=2)
    done = int(state["iteration"])
    iterations = min(cfg.iterations, done + ledger.remaining(budget, STAGE, name) // per_iter)
    if iterations < 1:
        raise ValueError(f"rollout budget {budget} cannot pay for one iteration of {per_iter} rollouts")

    set_threads(cfg.threads)
    policy, base_id = load_trainable(Path(model_dir), cfg, backend, seed, tool_format)
    reward = make_reward(cfg.reward)
    if state["reward"] is not None:
        reward.load_state_dict(state["reward"])
    run: dict[str, Any] = {"log": list(state["log"]), "timing": list(state["timing"])}
    rollout = (DistillRollout if teachers is not None else AgentRollout)(
        policy, sources, cfg, reward, lambda n: ledger.add(STAGE, n, key=name), seed)
    if backend == "unsloth":  # its fused LoRA kernels do not read PEFT's adapter switches
        rollout.fold_lora = False
    if sampler is not None:
        if size > 1:
            raise ValueError("trainings in lockstep run in one process (train.processes: 1)")
        sampler.attach(name, policy.model)
        rollout.sampler, rollout.name = sampler, name

    def save_state(folder: Path, iteration: int) -> None:
        if rank > 0:  # process 0 writes the checkpoint's trace state and snapshot
            return
        if cfg.snapshots:  # before the state file: a checkpoint that has one has its snapshot too
            keep_snapshot(folder, ckpt_root / SNAPSHOTS / f"iter-{iteration}", iteration, ledger.used(STAGE, name))
        rows = [r for r in ledger.rows() if r["stage"] == STAGE and r["key"] == name]
        write_json(folder / STATE_FILE, {"iteration": iteration, "ledger": rows, "log": run["log"],
                                         "timing": run["timing"], "reward": reward.state_dict(),
                                         "episodes": curves.episode_rows if curves is not None else [],
                                         "fingerprint": fingerprint})

    if rank > 0:  # process 0 writes the curves
        curves = None
    if curves is not None:
        curves.start(run["log"], run["timing"], state.get("episodes", []))
    callback = TraceCallback(rollout, run, lambda: ledger.used(STAGE, name), save_state, curves)
    trainer = _make_trainer(policy, sources, cfg, rollout, callback, ckpt_root, iterations, seed, progress, size,
                            DistillGRPOTrainer if teachers is not None else AgentGRPOTrainer)
    if teachers is not None:
        from trace_lib.engine.policy import load_policy

        trainer.teachers = load_policy(model_dir, dtype=train_dtype(cfg), tool_format=policy.tool_format,
                                       adapters={k: str(v) for k, v in teachers.items()}, device=str(policy.device))
        # a second copy of the base model (on every process): PEFT saves every adapter a model holds, so teachers
        # loaded into the student would end up in its checkpoints
        trainer.teachers.model.requires_grad_(False)
    trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
    if curves is not None:
        curves.end()

    manifest = AdapterManifest(
        capability_id=name, path=str(out_dir), base_model=base_id, env_sha256=env_sha256, backend=backend,
        rollouts_used=ledger.used(STAGE, name), iterations=len(run["log"]),
        final_reward=run["log"][-1]["reward"] if run["log"] else None,
        config={"train": train_record(cfg), "seed": seed,
                "sources": {s.name: s.weight for s in sources}, "budget": budget,
                **({"teachers": {k: Path(v).as_posix() for k, v in sorted(teachers.items())},
                    "teachers_digest": teachers_digest} if teachers is not None else {})},
    )
    if rank > 0:  # the weights are process 0's (the same on every process); it writes the adapter
        distributed.barrier()
        Path(ledger.path).unlink(missing_ok=True)
        return manifest
    _remove_leftovers(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    policy.model.save_pretrained(tmp)
    atomic_write_text(tmp / "train_log.jsonl", "".join(dumps_json(r) + "\n" for r in run["log"]))
    write_json(tmp / "manifest.json", manifest.model_dump(mode="json"))
    for snap in sorted((ckpt_root / SNAPSHOTS).glob("iter-*")):
        if int(snap.name.split("-")[1]) < len(run["log"]):  # the last one is the adapter itself
            shutil.copytree(snap, tmp / SNAPSHOTS / snap.name)  # copied: a kept checkpoint may be resumed
    _replace_dir(tmp, out_dir)
    times = [t["seconds"] for t in run["timing"]]
    write_json(timing_path or default_timing_path(out_dir),
               {"iterations": run["timing"], "total_seconds": sum(times),
                "seconds_per_iteration": sum(times) / len(times) if times else None})
    if not keep_checkpoints:
        shutil.rmtree(ckpt_root, ignore_errors=True)
    distributed.barrier()
    return manifest


def planned_rollouts(cfg: TrainConfig) -> int:
    """The rollouts a training of `cfg` spends from an empty ledger: whole iterations of groups x group_size,
    `iterations` of them or as many as `rollout_budget` pays for."""
    per_iter = cfg.groups * cfg.group_size
    return min(cfg.iterations, (cfg.rollout_budget or cfg.iterations * per_iter) // per_iter) * per_iter


CPU_PASS_ROWS = {"float32": 8, "bfloat16": 32}
"""On CPU with the shared prompt, the most rollouts one loss pass takes when `train.micro_batch` is 0, by the
training dtype. The pass keeps every token position's activations until TRL's backward, so a 32-rollout
iteration in one fp32 pass does not fit in 24 GB (benchmarks/README.md: train_step.py)."""


def cpu_pass_rows(per_iter: int, group_size: int, cap: int) -> int:
    """Rollouts per loss pass on CPU: the whole iteration when it holds at most `cap`, else the largest multiple
    of K up to `cap` that divides the iteration (K when K alone is more than `cap`): whole groups, since the
    rows of an iteration split in several passes keep their order (`AgentGRPOTrainer._prepare_inputs`)."""
    if per_iter <= cap:
        return per_iter
    fits = [m for m in range(group_size, cap + 1, group_size) if per_iter % m == 0]
    return max(fits, default=group_size)


def _micro_batch(cfg: TrainConfig, processes: int = 1) -> int:
    """Rollouts per forward/backward pass of one process. With several processes each plays and trains
    `groups / processes` whole groups per iteration (the per-process batch a multiple of K)."""
    import torch

    if cfg.groups % processes:
        raise ValueError(f"train.groups ({cfg.groups}) must be a multiple of the {processes} training processes")
    per_iter = cfg.groups * cfg.group_size // processes
    if torch.cuda.is_available():
        auto = cfg.group_size
    else:  # with the shared prompt, up to CPU_PASS_ROWS per pass, whole groups
        auto = cpu_pass_rows(per_iter, cfg.group_size, CPU_PASS_ROWS[train_dtype(cfg)]) if cfg.shared_prompt else 1
    micro = cfg.micro_batch or auto
    if per_iter % micro:
        raise ValueError(f"train.micro_batch ({micro}) must divide the rollouts of an iteration per process "
                         f"({per_iter} = groups x group_size / processes)")
    if processes > 1 and (micro % cfg.group_size or not cfg.shared_prompt):
        raise ValueError(f"with {processes} training processes a micro-batch must hold whole groups "
                         f"(train.micro_batch {micro}, group_size {cfg.group_size}) and train.shared_prompt must "
                         "be on (its loss pass is the one whose gradients trace averages across processes)")
    return micro


def _make_trainer(policy, sources, cfg: TrainConfig, rollout: AgentRollout, callback, ckpt_root: Path,
                  iterations: int, seed: int, progress: bool, processes: int = 1,
                  trainer_cls: type[AgentGRPOTrainer] | None = None) -> AgentGRPOTrainer:
    """TRL's GRPOTrainer set up for one optimizer step per G x K episodes (over all processes)."""
    import torch

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16
    micro, per_process = _micro_batch(cfg, processes), cfg.groups * cfg.group_size // processes
    args = GRPOConfig(
        output_dir=str(ckpt_root), seed=seed, max_steps=iterations,
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_process // micro,
        steps_per_generation=per_process // micro, num_generations=cfg.group_size, shuffle_dataset=False,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        beta=cfg.beta, epsilon=cfg.epsilon, temperature=cfg.temperature, loss_type="dapo", scale_rewards="group",
        logging_steps=1, save_strategy="steps", save_steps=cfg.save_every, save_total_limit=2,
        max_grad_norm=1.0,  # TRL's default, stated: with several processes `_clip_grad_norm` averages the gradients
        report_to=[b for b in cfg.report_to if b != "dvclive"] or "none",  # DVCLive: our own rows (tracking.py)
        disable_tqdm=not progress, bf16=torch.cuda.is_available(),
        # Multi-turn episodes are long (SmolLM2 on retail: ~1.8k prompt + ~1k completion tokens); without
        # checkpointing 4 of them took more than 24 GB on CPU (fp32, prompt per row). The shared-prompt
        # pass needs the KV cache, which checkpointing turns off; it scores only the agent's tokens.
        activation_checkpointing=not cfg.shared_prompt,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, remove_unused_columns=False,
    )
    tok = policy.tokenizer
    tok.padding_side = "left"  # what TRL expects of its processing class; Policy pads by itself
    trainer = (trainer_cls or AgentGRPOTrainer)(model=policy.model, reward_funcs=[trajectory_reward], args=args,
                               train_dataset=train_dataset(sources, cfg, seed), processing_class=tok,
                               rollout_func=rollout, callbacks=[callback])
    trainer.shared_prompt = cfg.shared_prompt
    trainer.prompt_grad = cfg.prompt_grad
    if not progress:  # with tqdm off, HF prints every log dict instead; our log is train_log.jsonl
        trainer.remove_callback(PrinterCallback)
    return trainer


def read_train_log(out_dir: Path) -> list[dict[str, Any]]:
    """The rows of `out_dir/train_log.jsonl`, one per iteration."""
    return list(iter_jsonl(Path(out_dir) / "train_log.jsonl"))


def default_timing_path(out_dir: Path) -> Path:
    """Where `train_adapter_mixture` writes the wall times when the caller names no `timing_path`."""
    out_dir = Path(out_dir)
    return out_dir.parent / f"{out_dir.name}.timing.json"


def read_timing(path: Path) -> dict[str, Any]:
    """A timing file (see `train_adapter_mixture`): seconds per iteration, their total and mean
    (`seconds_per_iteration`)."""
    return read_json(Path(path))
