"""Synthesis: one validated training environment per kept capability (paper §3.2).

`synthesize_env` writes, for one capability, `data/envs/<capability>/attempts/NN.py` + `NN.json` (every
attempt and its validation verdict) and `data/envs/<capability>/env.py` and `manifest.json` only when an
attempt passed validation, and returns the SyntheticEnvManifest (valid or not, with the reason). The
synthesize stage (`stages/synthesize.py`) runs it over `data/score/kept.jsonl` and writes the
list `data/envs/manifests.jsonl`; `valid_envs` reads that list back for training and evaluation, and
`validation_table` / `sample_tasks` show it in the notebook.

Two synthesizers behind one loop:

* `template` (offline, pairs with the rules analyst): the module binds a parameterized generator of
  `trace_lib.synth.templates` to the capability; a capability without a template is recorded as
  not synthesized, with the reason.
* `anthropic` / `openai` / `local`: an LLM writes the module from the capability's description and evidence,
  the target's policy and tool list; a rejected attempt's failed checks are fed back, up to
  `max_attempts` times.

Every attempt, whatever wrote it, goes through `trace_lib.synth.validate.validate_env` in a sandboxed
subprocess; only a module that passed is written as `env.py`, and the train stage checks its
sha256 against the manifest, so nothing unvalidated reaches training.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trace_lib.llm import LLMClient, LLMError, resolve_analyst
from trace_lib.analyst.prompting import load_prompt
from trace_lib.analyst.render import render_trajectory, tools_block
from trace_lib.config import AnalystConfig, EnvConfig, SynthesizeConfig
from trace_lib.envs import load_tasks, make_env
from trace_lib.envs.synthetic import synthetic_tasks
from trace_lib.io import atomic_write_text, read_jsonl, write_json
from trace_lib.paths import Paths
from trace_lib.records import Capability, SyntheticEnvManifest, Trajectory
from trace_lib.sandbox import ALLOWED_IMPORTS, SandboxProcess, limits_from_config
from trace_lib.synth.templates import render_template_module, template_capabilities, template_kinds
from trace_lib.synth.validate import validate_env

TEMPLATE_TARGETS = ("retail", "tau2-retail", "phone")


def target_spec(env: EnvConfig) -> dict[str, str]:
    """The `TARGET` constant a module declares: the target env's name and tool set."""
    return {"name": env.name, "tools": env.tools}


def resolve_synth_backend(cfg: SynthesizeConfig, analyst: AnalystConfig) -> str:
    """'auto': the template synthesizer when the analyst is the offline rules analyst, else the analyst's LLM."""
    if cfg.backend != "auto":
        return cfg.backend
    backend = resolve_analyst(analyst, announce=False)
    return "template" if backend == "rules" else backend


def extract_module(reply: str) -> str:
    """The Python source in an LLM reply: the first ```python block, else the whole reply."""
    match = re.search(r"```(?:python|py)?\s*\n(.*?)```", reply, flags=re.S)
    return (match.group(1) if match else reply).strip() + "\n"


def llm_prompt(cap: Capability, target: dict[str, str], tool_kinds: dict[str, str], policy: str,
               examples: Sequence[Trajectory], chars: int = 400) -> tuple[str, str]:
    """(system, first user message) for the LLM synthesizer; the SDK part of the system prompt is the
    target's (the phone's worlds and milestones, or the retail database)."""
    phone = target.get("name") == "phone"
    system = load_prompt("synthesize_system.md", capability_id=cap.id, target=repr(target),
                         allowed_imports=", ".join(sorted(m for m in ALLOWED_IMPORTS if "." not in m)),
                         agent="an assistant acting on the user's phone" if phone else "a customer-service agent",
                         sdk=load_prompt("synthesize_sdk_phone.md" if phone else "synthesize_sdk_retail.md").rstrip())
    shown = "\n\n".join(render_trajectory(t, limit=chars) for t in examples) or "(none available)"
    user = load_prompt("synthesize_user.md", capability_id=cap.id, capability_name=cap.name, description=cap.description,
                       recognition=cap.recognition or "(not given)", policy=policy,
                       tools=tools_block(tool_kinds), examples=shown)
    return system, user


def feedback_message(report: dict[str, Any]) -> str:
    """What a rejected attempt is told: each failed check and why."""
    failed = [f"- {c['name']}: {c['detail']}" for c in report.get("checks", []) if not c.get("ok")]
    return ("The module was rejected by validation:\n" + "\n".join(failed or ["- (no detail)"])
            + "\nFix these problems and answer with the whole corrected module in one ```python block.")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def synthesize_env(cap: Capability, backend: str, cfg: SynthesizeConfig, env_cfg: EnvConfig, split: str,
                   root: Path = Path("."), *,
                   client: LLMClient | None = None, evidence: Sequence[Trajectory] = (),
                   policy=None, ledger=None, kinds: dict[str, int] | None = None) -> SyntheticEnvManifest:
    """Write, validate and (if valid) install one capability's environment under data/envs/<id>/, for the target
    `env_cfg` (its `split` tasks show the LLM synthesizer the system prompt and examples). The template
    synthesizer weights its task kinds by the evidence's failed tasks (`templates.template_kinds`), or by `kinds`
    where given."""
    out_dir = Paths(root).env_dir(cap.id)
    target = target_spec(env_cfg)
    attempts_dir = out_dir / "attempts"
    messages: list[dict[str, str]] = []
    system = ""
    if backend == "template":
        if env_cfg.name not in TEMPLATE_TARGETS:
            return _not_synthesized(cap, backend, target, out_dir,
                                    f"the template synthesizer supports targets {list(TEMPLATE_TARGETS)}, "
                                    f"not {env_cfg.name!r}; use an LLM synthesizer (synthesize.backend)")
        have = template_capabilities(env_cfg.name)
        if cap.id not in have:
            return _not_synthesized(cap, backend, target, out_dir,
                                    f"no template for {cap.id!r} (templates: {', '.join(have)}); "
                                    "use an LLM synthesizer (synthesize.backend)")
        max_attempts = 1
        if kinds is None:
            kinds = evidence_template_kinds(cap, target, evidence,
                                            [t.model_dump(mode="json") for t in
                                             load_tasks(env_cfg, split, root)])
    else:
        if client is None:
            raise ValueError(f"synthesize backend {backend!r} needs an LLM client")
        env = make_env(env_cfg)
        example_tasks = [t for t in evidence if t.id in set(cap.evidence)][: cfg.example_trajectories]
        system, first = llm_prompt(cap, target, env.tool_kinds(), env.system_prompt(load_tasks(env_cfg, split, root)[0]),
                                   example_tasks)
        messages = [{"role": "user", "content": first}]
        max_attempts = cfg.max_attempts

    report: dict[str, Any] = {}
    for attempt in range(1, max_attempts + 1):
        if backend == "template":
            source = render_template_module(cap.id, target, cfg.difficulty, kinds)
        else:
            try:
                reply = client.complete(system, messages, max_tokens=cfg.max_tokens,
                                        temperature=cfg.temperature, stage="synthesize")
            except LLMError as err:
                report = {"valid": False, "failed": "llm", "checks": [{"name": "llm", "ok": False, "detail": str(err)}]}
                write_json(attempts_dir / f"{attempt:02d}.json", report)
                break
            source = extract_module(reply.text)
            messages = messages + [{"role": "assistant", "content": reply.text}]
        module_path = atomic_write_text(attempts_dir / f"{attempt:02d}.py", source)
        verdict = validate_env(module_path, env_cfg, cfg.validation, cfg.difficulty, policy=policy, ledger=ledger)
        report = verdict.model_dump(mode="json") if hasattr(verdict, "model_dump") else dict(verdict)
        write_json(attempts_dir / f"{attempt:02d}.json", report)
        if report["valid"]:
            env_path = atomic_write_text(out_dir / "env.py", source)
            manifest = SyntheticEnvManifest(
                capability_id=cap.id, source=backend, path=env_path.relative_to(root).as_posix(),
                sha256=_sha256(source), target_env=env_cfg.name, validation=report,
                difficulty={"value": cfg.difficulty}, valid=True, attempts=attempt)
            write_json(out_dir / "manifest.json", manifest.model_dump(mode="json"))
            return manifest
        if backend != "template":
            messages = messages + [{"role": "user", "content": feedback_message(report)}]
    reason = f"no attempt passed validation (last failed check: {report.get('failed')})"
    return _not_synthesized(cap, backend, target, out_dir, reason, report, attempts=max_attempts)


def evidence_template_kinds(cap: Capability, target: dict[str, Any], evidence: Sequence[Trajectory],
                            tasks: Sequence[dict[str, Any]]) -> dict[str, int]:
    """The task kinds `cap`'s template draws by default: those of the target `tasks` (JSON) behind the trajectories
    its evidence cites, weighted as `templates.template_kinds` counts them."""
    cited = set(cap.evidence)
    behind = {e.task_id for e in evidence if e.id in cited}
    return template_kinds(cap.id, target, [t for t in tasks if t["id"] in behind])


def _not_synthesized(cap: Capability, backend: str, target: dict[str, str], out_dir: Path, reason: str,
                     report: dict[str, Any] | None = None, attempts: int = 0) -> SyntheticEnvManifest:
    (out_dir / "env.py").unlink(missing_ok=True)  # a stale module from an earlier run must not survive
    (out_dir / "manifest.json").unlink(missing_ok=True)
    return SyntheticEnvManifest(capability_id=cap.id, source=backend, path="", sha256="", target_env=target["name"],
                                validation=report or {}, valid=False, reason=reason, attempts=attempts)


def valid_envs(root: Path = Path(".")) -> list[SyntheticEnvManifest]:
    """Manifests of installed environments whose env.py still hashes as validated (else an error)."""
    out = []
    for m in read_jsonl(Paths(root).env_manifests, SyntheticEnvManifest):
        if not m.valid:
            continue
        source = (root / m.path).read_text(encoding="utf-8")
        if _sha256(source) != m.sha256:
            raise RuntimeError(f"{m.path}: content differs from the validated module (sha256 mismatch); "
                               "rerun the synthesize stage")
        out.append(m)
    return out


def validation_table(manifests: Sequence[SyntheticEnvManifest]):
    """One row per capability x check (ok, detail) for the notebook; capabilities without checks get one row."""
    import pandas as pd

    rows = []
    for m in manifests:
        checks = m.validation.get("checks", [])
        if not checks:
            rows.append({"capability": m.capability_id, "check": "-", "ok": False, "detail": m.reason})
        rows.extend({"capability": m.capability_id, "check": c["name"], "ok": c["ok"], "detail": c.get("detail", "")}
                    for c in checks)
    return pd.DataFrame(rows, columns=["capability", "check", "ok", "detail"])


def sample_tasks(manifest: SyntheticEnvManifest, cfg: SynthesizeConfig, seed_offset: int, root: Path = Path("."),
                 n: int = 3):
    """The first `n` training tasks of an installed environment at `cfg.difficulty` (generated in the sandbox), from
    seed `seed_offset` (`train.seed_offset`) on."""
    with SandboxProcess(root / manifest.path, limits_from_config(cfg.validation)) as box:
        seeds = [seed_offset + i for i in range(n)]
        return synthetic_tasks(box, manifest.capability_id, seeds, cfg.difficulty, "train")
