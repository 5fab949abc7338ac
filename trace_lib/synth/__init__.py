"""Synthesized training environments (paper §3.2): the target world they run on, the offline
templates, the LLM synthesizer, validation, and the sandbox (a limited subprocess and its worker)
that runs every generated module."""
