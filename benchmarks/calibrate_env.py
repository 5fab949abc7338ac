"""Where a template environment sits against the calibration band: the base model's success rate and share of mixed
groups at every setting of the calibration ladder (`training.calibrate.ladder`), at a given temperature.

Renders the template module itself (`synth.templates.render_template_module`, with `--kinds` for the templates that
draw task kinds), serves it from the sandbox and plays `--seeds` x `--samples` base-model episodes per setting, as
the synthesize stage's calibration does (`training.calibrate.measure`). Reads --root's params.yaml and prepared
model (data/model); writes nothing but one JSON line per setting on stdout.

    .venv/bin/python benchmarks/calibrate_env.py --root . --capability communicate_result \
        --kinds status=1,total=1,tracking=1,refusal=1 --temperature 0.5 --difficulties 0,1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from trace_lib.engine.policy import load_policy
from trace_lib.config import load_params
from trace_lib.sandbox import SandboxProcess
from trace_lib.synth.synthesize import target_spec
from trace_lib.synth.templates import render_template_module
from trace_lib.training.calibrate import ladder, measure
from trace_lib.training.sources import sandbox_limits, synthetic_source


def parse_kinds(text: str) -> dict[str, int]:
    """'status=1,total=2' -> {'status': 1, 'total': 2}; '' -> {}."""
    return {k: int(v) for k, v in (pair.split("=") for pair in text.split(",") if pair)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--capability", required=True)
    ap.add_argument("--kinds", default="", help="task kinds and weights, e.g. status=1,total=1")
    ap.add_argument("--temperature", type=float, default=None, help="default: the params' train.temperature")
    ap.add_argument("--difficulties", default="0", help="comma-separated difficulties to measure")
    ap.add_argument("--seeds", type=int, default=None, help="default: synthesize.calibration.seeds")
    ap.add_argument("--samples", type=int, default=None, help="default: synthesize.calibration.samples")
    a = ap.parse_args()
    root = Path(a.root)
    params = load_params(root / "params.yaml")
    cal = params.synthesize.calibration.model_copy(update={k: v for k, v in (("seeds", a.seeds),
                                                                              ("samples", a.samples)) if v})
    train = params.train.model_copy(update={"temperature": a.temperature} if a.temperature is not None else {})
    levels = [int(d) for d in a.difficulties.split(",")]
    source_text = render_template_module(a.capability, target_spec(params.env), 0, parse_kinds(a.kinds))
    policy = load_policy(root / params.model.out_dir, dtype=params.model.dtype, device=params.model.device,
                         tool_format=params.model.tool_format)
    with tempfile.TemporaryDirectory() as tmp:
        module = Path(tmp) / "env.py"
        module.write_text(source_text)
        with SandboxProcess(module, sandbox_limits(params.synthesize.validation)) as box:
            for setting in [s for s in ladder(min(levels), max(levels)) if s.difficulty in levels]:
                t0 = time.perf_counter()
                source = synthetic_source(box, a.capability, params.env, params.train.max_steps_per_episode,
                                          setting.difficulty)
                out = measure(policy, source, setting, cal, train, params.seed)
                print(json.dumps({"capability": a.capability, "kinds": a.kinds, "temperature": train.temperature,
                                  **out, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
