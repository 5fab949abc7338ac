"""Does `torch.compile` make a CPU decoding step of SmolLM2 faster? Eager against inductor, one process.

One decoding step (one new token per row) of the prepared model in bf16 through transformers' own forward with a
`StaticCache` (fixed shapes, so one compiled graph serves every step), after a `--context`-token prefill of random
ids per row. Ways, each on the same rows and cache length:

    eager     the model as the pipeline runs it, op by op
    compile   `torch.compile(step, dynamic=False)` (inductor's C++/OpenMP code for the CPU)
    freeze    the same with `torch._inductor.config.freezing` (weights folded in as constants, prepacked for oneDNN)

Reported per way and batch: the first call (compilation included) and the median of the later steps, in ms. Why it
is here: a decoding step at a few rows is mostly the fixed cost of ~1,000 small operators dispatched one by one
(benchmarks/README.md, train_lockstep.py), which is what a compiler removes; the measurement says whether inductor
does so here. The pipeline's engine (`engine/policy.py`) is not compiled.

    python benchmarks/compile_decode.py --model-dir data/model --batches 1,16 --ways eager,compile,freeze
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, StaticCache


def step_times(model, batch: int, context: int, way: str, steps: int, seed: int) -> tuple[float, float]:
    """(first call ms, median ms of the steps after `warm`) for one way at one batch size."""
    torch.manual_seed(seed)
    cache = StaticCache(config=model.config, max_batch_size=batch, max_cache_len=context + steps + 8,
                        device="cpu", dtype=torch.bfloat16)
    vocab = model.config.vocab_size
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (batch, context)), past_key_values=cache,
              cache_position=torch.arange(context), use_cache=True)

        def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

        run = step
        if way != "eager":
            import torch._inductor.config as inductor_config

            inductor_config.freezing = way == "freeze"
            torch._dynamo.reset()
            run = torch.compile(step, dynamic=False)
        tok = torch.randint(0, vocab, (batch, 1))
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            run(tok, torch.tensor([context + i]))
            times.append((time.perf_counter() - t0) * 1000)
    warm = min(5, steps - 1)
    return times[0], statistics.median(times[warm:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="data/model")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--ways", default="eager,compile,freeze")
    ap.add_argument("--context", type=int, default=1536, help="tokens per row before the timed steps")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).eval()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for way in args.ways.split(","):
            first, median = step_times(model, batch, args.context, way, args.steps, seed=0)
            rows.append((way, batch, first, median))
            print(way, batch, f"first {first:.0f} ms, median {median:.1f} ms", flush=True)
    eager = {b: m for w, b, _, m in rows if w == "eager"}
    print(f"\ncontext={args.context} steps={args.steps} threads={args.threads} torch={torch.__version__}")
    print("| way | rows | first call ms | median ms per step | vs eager |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for way, batch, first, median in rows:
        ratio = f"{median / eager[batch]:.2f}x" if batch in eager else "-"
        print(f"| {way} | {batch} | {first:.0f} | {median:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
