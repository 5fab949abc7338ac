"""Do SmolLM2's linear layers run faster in bf16 or in fp32 on this CPU, at decoding and prefill shapes?

The CPU default computes in bf16 where it is faster than fp32 and in fp32 elsewhere (`model.dtype: auto`,
`engine.model.bf16_is_faster`): bf16 measured ~4x faster than fp32 at 256 rows on a Zen 5 EPYC and with AMX, 1.53x
slower on an Intel Xeon with AVX-512 bf16 but no AMX, and up to 6.1x slower on an AVX2-only EPYC. Which
holds depends on the kernels the CPU gets (oneDNN with AMX, AVX-512 bf16, or neither), and a decoding step is nothing but matrix products with few rows. This
times one model step's linear work, both dtypes side by side in one process, rows alternating:
every projection of the 30 decoder layers (q, k, v, o, gate, up, down) and the output layer, for M
rows (M = 1, 8, 16: a decoding step at that batch; M = 256: a prefill block), with the weights laid
out as `nn.Linear` keeps them. Random weights of the real shapes: the time does not depend on values.

    .venv/bin/python benchmarks/linear_dtype.py --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
"""SmolLM2-135M: hidden size, MLP width, k/v width (3 kv heads x 64), vocabulary, decoder layers."""

LAYER_SHAPES = ((HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
                (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
"""(out, in) of each projection of one decoder layer, as nn.Linear stores its weight."""


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "unknown")
    flags = next((x.split(":", 1)[1].split() for x in lines if x.startswith("flags")), [])
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX-512'})"


def step_weights(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """One model's linear weights: every layer's seven projections, then the output layer."""
    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [(VOCAB, HIDDEN)]
    return [torch.randn(s, generator=gen).mul_(0.02).to(dtype) for s in shapes]


def one_step(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """Every weight applied to an input of its width (the products, not the model's data flow)."""
    wide = torch.zeros(x.shape[0], INTERMEDIATE, dtype=x.dtype)
    for w in weights:
        F.linear(x if w.shape[1] == HIDDEN else wide, w)


def time_step(rows: int, weights: list[torch.Tensor], dtype: torch.dtype, steps: int) -> float:
    x = torch.randn(rows, HIDDEN).to(dtype)
    one_step(x, weights)  # warm-up: kernel selection, weight reorders
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step(x, weights)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,16,256", help="rows per step (comma-separated)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; each times every row count in both dtypes")
    ap.add_argument("--steps", type=int, default=5, help="model steps per timing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = {d: step_weights(d, gen) for d in (torch.float32, torch.bfloat16)}
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[int, torch.dtype], list[float]] = {}
    for _ in range(args.repeats):
        for m in rows:
            for d in (torch.float32, torch.bfloat16):
                times.setdefault((m, d), []).append(time_step(m, weights[d], d, args.steps))
    print(f"{cpu_name()}; torch {torch.__version__}, {args.threads} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    print("| rows | fp32 ms per step | bf16 ms per step | bf16 / fp32 |")
    print("| ---: | ---: | ---: | ---: |")
    for m in rows:
        f32, b16 = (sorted(times[(m, d)])[len(times[(m, d)]) // 2] * 1e3 for d in (torch.float32, torch.bfloat16))
        print(f"| {m} | {f32:.1f} | {b16:.1f} | {b16 / f32:.2f} |")


if __name__ == "__main__":
    main()
