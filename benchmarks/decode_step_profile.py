"""Milliseconds per decoding step of trace's engine, and where they go (cProfile), on the CPU or a GPU.

The tests' tiny random model (2 layers, hidden 64, SmolLM2's tokenizer and vocabulary), so the model's own
compute is small and the step's fixed costs show: sampling, grammar masks, transfers, Python. 64 conversations
(the `gpu` profile's batch), 64 new tokens at temperature 0.8, unconstrained and constrained (xgrammar), after one
warm-up call each. Needs the packaged GGUF (for the tokenizer) and a pytest cache folder, as the tests do.

    python benchmarks/decode_step_profile.py --devices cpu,cuda
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import _cached_tokenizer, build_tiny_model  # noqa: E402
from test_grammar import CONVS, TOOLS  # noqa: E402

from trace_lib.engine.policy import load_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=12, help="cProfile rows shown (by own time)")
    args = ap.parse_args()
    tok = _cached_tokenizer(Path(".pytest_cache/d/trace_smollm2_tokenizer"))
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny_")), tok)
    convs = (CONVS * args.batch)[: args.batch]
    for device in args.devices.split(","):
        pol = load_policy(model_dir, dtype="bfloat16", device=device)
        pol.grammar_options = {"max_string_chars": 10, "max_text_chars": 40, "require_tool_call": True}
        for constrained in (False, True):
            kw = dict(temperature=0.8, max_new_tokens=args.new_tokens, seed=1, constrained=constrained)
            pol.generate(convs, TOOLS, **kw)  # warm-up
            t0 = time.perf_counter()
            gens = pol.generate(convs, TOOLS, **kw)  # timed without the profiler
            seconds = time.perf_counter() - t0
            steps = max(g.completion_tokens for g in gens)  # decoding steps: the longest row's tokens
            print(f"=== {device} constrained={constrained}: {seconds:.2f} s for {len(gens)} rows, {steps} steps, "
                  f"{1000 * seconds / steps:.1f} ms per step (prefill included)")
            prof = cProfile.Profile()
            prof.enable()
            pol.generate(convs, TOOLS, **kw)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            text = out.getvalue()
            print(text[text.index("   ncalls"):])


if __name__ == "__main__":
    main()
