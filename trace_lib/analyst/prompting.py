"""Prompts and their loading: the analyst's prompt files with their `{{field}}` placeholders filled.

Reads the Markdown files in `trace_lib/analyst/prompts/` (discover, merge, label, synthesize, route);
writes nothing. The prompts are files next to the code that uses them, so a dvc stage can list the
ones it depends on; this module is the one place that knows where they are.
"""

from __future__ import annotations

from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts"
"""The folder of prompt files."""


def load_prompt(name: str, **fields: str) -> str:
    """A prompt file from trace_lib/analyst/prompts with `{{field}}` placeholders filled."""
    text = (PROMPTS / name).read_text(encoding="utf-8")
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", value)
    return text
