"""The GEPA baseline: reflective evolution of the agent's system prompt (paper §4, Table 1's GEPA row).

Reads params (`analyst`); writes nothing. GEPA (the `gepa` package, PyPI 0.1.4) rewrites a prompt from
the model's failures with an LLM as the reflection model; here that LLM would be the analyst backend,
and its metric calls — rollouts of the agent on the target's train tasks — would be capped at TRACE's
rollout budget. The package is not a dependency of the pipeline yet, and the offline `rules` analyst
is no language model, so `gepa_status` says why the row is not run:

* analyst backend resolves to `rules` (no API key, no local model chosen): nothing can reflect;
* an LLM backend but no `gepa` installed: install it to run the row;
* both present: the optimization loop itself is not wired into the stage yet.
"""

from __future__ import annotations

import importlib.util
from typing import Any

RULES_REASON = ("GEPA needs an LLM reflection model (analyst.backend anthropic/local); "
                "the rules analyst cannot reflect")


def gepa_status(params: Any) -> str:
    """Why the GEPA row is not run (always a reason at present; see the module docstring)."""
    from trace_lib.llm import resolve_backend

    backend = resolve_backend(params.analyst.backend, announce=False)
    if backend == "rules":
        return RULES_REASON
    if importlib.util.find_spec("gepa") is None:
        return (f"the analyst backend {backend!r} could reflect, but the gepa package is not installed "
                "(pip install gepa==0.1.4)")
    return (f"gepa is installed and the analyst backend is {backend!r}, but the GEPA optimization loop "
            "is not wired into the evaluate stage yet (trace_lib.eval_gepa)")
