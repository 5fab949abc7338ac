"""One decoding step's model forward with per-row LoRA routes, against the base model and PEFT's own paths.

SmolLM2 (the params' model folder, bf16) with 5 random LoRA adapters in the train stage's shapes (r8, alpha 16,
the 7 projections; `evaluate_routes.save_adapters`). Each arm times `model(input_ids)` for one new token per row
(no KV cache: what a step adds for LoRA does not depend on the context's length), for 1, 4 and 16 rows:

    base            adapters disabled (PEFT's `disable_adapter`)
    peft-single     one adapter active for every row (PEFT's LoRA layers)
    peft-mixed      PEFT's mixed batch (`adapter_names=`: one adapter per row, rows cycling over the 5)
    routed-mixed    `engine.row_lora.RoutedLora`: rows cycling over the base model, the 5 adapters and a merge (7 routes)
    routed-base     `RoutedLora`, every row on the base model (the layers see no route to add)

    python benchmarks/routed_lora_step.py [--params params.yaml] [--rows 1,4,16] [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evaluate_routes import BASELINES, CAPS, save_adapters  # noqa: E402

from trace_lib.engine.kvcache import RowRoutes, row_routes  # noqa: E402
from trace_lib.engine.policy import load_policy  # noqa: E402
from trace_lib.engine.row_lora import RoutedLora  # noqa: E402
from trace_lib.config import load_params  # noqa: E402


def ms_per_call(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return 1000 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    params = load_params(args.params)
    model_dir = Path(params.model.out_dir)
    names = CAPS + BASELINES
    folders = save_adapters(model_dir, Path(tempfile.mkdtemp(prefix="routed_step_")), 0.002)
    policy = load_policy(model_dir, dtype=params.model.dtype, adapters=folders, tool_format=params.model.tool_format,
                         threads=args.threads, device=params.model.device)
    model = policy.model
    routes = [{}] + [{n: 1.0} for n in names] + [{c: 1 / len(CAPS) for c in CAPS}]
    print("| rows | base | peft-single | peft-mixed | routed-mixed | routed-base |  (ms per step)")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (int(r) for r in args.rows.split(",")):
        ids = torch.randint(0, 1000, (n, 1), generator=torch.Generator().manual_seed(n), device=policy.device)
        out = {}
        with torch.inference_mode():
            with model.disable_adapter():
                out["base"] = ms_per_call(lambda: model(input_ids=ids), args.steps)
            model.set_adapter(names[0])
            out["peft-single"] = ms_per_call(lambda: model(input_ids=ids), args.steps)
            per_row = [names[i % len(names)] for i in range(n)]
            out["peft-mixed"] = ms_per_call(lambda: model(input_ids=ids, adapter_names=per_row), args.steps)
            with RoutedLora(model, routes):
                with row_routes(RowRoutes([i % len(routes) for i in range(n)], policy.device)):
                    out["routed-mixed"] = ms_per_call(lambda: model(input_ids=ids), args.steps)
                with row_routes(RowRoutes([0] * n, policy.device)):
                    out["routed-base"] = ms_per_call(lambda: model(input_ids=ids), args.steps)
        print(f"| {n} | " + " | ".join(f"{out[k]:.1f}" for k in
                                       ("base", "peft-single", "peft-mixed", "routed-mixed", "routed-base")) + " |",
              flush=True)


if __name__ == "__main__":
    main()
