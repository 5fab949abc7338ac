"""One decoding step's attention over rows whose histories differ in length: the engine's ways to read them.

`kvcache.cascade_attention` for 8 rows, one query each, a 1.8k-token shared prefix and each row's own
history in a `BufferedLayer` (keys stored transposed) as long as the longest row's history plus 96 free
positions (a turn's `max_new_tokens`), bf16, SmolLM2-135M's heads (9 query, 3 key-value, 64 wide). Rows
(`rollout_batch.py`'s modes):
    ragged   the engine: the whole buffers (contiguous, the free tail masked), or the late keys of all
             rows together and a long row's early keys apart, whichever `history_split` prices lower
    sliced   the filled part of the buffers (a slice), split the same way with slices priced as the
             whole: the engine before 2026-11-26 (evening)
    padded   the filled part, every row's keys from column 0
Milliseconds per layer and per step (x 30 layers), mean of 50 calls after one warm-up.

    python benchmarks/ragged_history.py
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from rollout_batch import engine_mode  # this folder: the script's own path entry
from trace_lib.engine import kvcache

CASES = [("one row 4.8k, seven 1k", 4800, [4800] + [1000] * 7), ("all 1k", 1000, [1000] * 8),
         ("all 2.4k", 2400, [2400] * 8), ("all 5k", 5000, [5000] * 8),
         ("two rows 3k, six 600", 3000, [3000] * 2 + [600] * 6)]


def per_call_ms(fn, n: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    bf, plen, free = torch.bfloat16, 1800, 96
    pk, pv = torch.randn(1, 3, plen, 64, dtype=bf), torch.randn(1, 3, plen, 64, dtype=bf)
    module = SimpleNamespace(layer_idx=0)
    modes = ("ragged", "sliced", "padded")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| histories | " + " | ".join(f"{m} ms/layer" for m in modes) + " | "
          + " | ".join(f"{m} ms/step" for m in modes) + " | sliced / ragged |")
    print("| --- |" + " ---: |" * (2 * len(modes) + 1))
    for name, length, lens in CASES:
        q = torch.randn(8, 9, 1, 64, dtype=bf)
        layer = kvcache.BufferedLayer(length + free, offset=plen)
        whole = layer.update(torch.randn(8, 3, length, 64, dtype=bf), torch.randn(8, 3, length, 64, dtype=bf))
        filled = (layer.keys, layer.values)
        mask = torch.zeros(8, 1, 1, plen + length, dtype=torch.bool)
        mask[..., :plen] = True
        for i, n in enumerate(lens):
            mask[i, ..., plen + length - n:] = True
        times = {}
        for mode in modes:
            k, v = whole if mode == "ragged" else filled
            with engine_mode(mode), kvcache.shared_prefix([(pk, pv)]):
                times[mode] = per_call_ms(lambda: kvcache.cascade_attention(module, q, k, v, mask, scaling=0.125))
        print(f"| {name} | " + " | ".join(f"{times[m]:.2f}" for m in modes) + " | "
              + " | ".join(f"{30 * times[m]:.1f}" for m in modes) + f" | {times['sliced'] / times['ragged']:.2f}x |")


if __name__ == "__main__":
    main()
