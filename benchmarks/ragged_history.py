"""One decoding step's attention over rows whose histories differ in length: split against padded.

`kvcache.cascade_attention` for 8 rows, one query each, a 1.8k-token shared prefix and each row's own
history in a buffer as long as the longest row's (keys stored transposed, as `BufferedLayer` does),
bf16, SmolLM2-135M's heads (9 query, 3 key-value, 64 wide). Rows: `split` (the engine: the late keys of
all rows together, a long row's early keys apart, `history_split`) and `padded` (every row's keys from
column 0: `rollout_batch.py`'s padded mode). Milliseconds per layer and per step (x 30 layers), mean of 50 calls after one warm-up.

    python benchmarks/ragged_history.py
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from rollout_batch import engine_mode  # this folder: the script's own path entry
from trace_lib.agent import kvcache

CASES = [("one row 4.8k, seven 1k", 4800, [4800] + [1000] * 7), ("all 1k", 1000, [1000] * 8),
         ("all 2.4k", 2400, [2400] * 8), ("two rows 3k, six 600", 3000, [3000] * 2 + [600] * 6)]


def per_call_ms(fn, n: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    bf, plen = torch.bfloat16, 1800
    pk, pv = torch.randn(1, 3, plen, 64, dtype=bf), torch.randn(1, 3, plen, 64, dtype=bf)
    layer = SimpleNamespace(layer_idx=0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| histories | split ms/layer | padded ms/layer | split ms/step | padded ms/step | padded / split |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, length, lens in CASES:
        q = torch.randn(8, 9, 1, 64, dtype=bf)
        k = torch.randn(8, 3, 64, length, dtype=bf).transpose(-1, -2)
        v = torch.randn(8, 3, length, 64, dtype=bf)
        mask = torch.zeros(8, 1, 1, plen + length, dtype=torch.bool)
        mask[..., :plen] = True
        for i, n in enumerate(lens):
            mask[i, ..., plen + length - n:] = True
        times = {}
        for row, mode in (("split", "ragged"), ("padded", "padded")):
            with engine_mode(mode), kvcache.shared_prefix([(pk, pv)]):
                times[row] = per_call_ms(lambda: kvcache.cascade_attention(layer, q, k, v, mask, scaling=0.125))
        print(f"| {name} | {times['split']:.2f} | {times['padded']:.2f} | {30 * times['split']:.1f} | "
              f"{30 * times['padded']:.1f} | {times['padded'] / times['split']:.2f}x |")


if __name__ == "__main__":
    main()
