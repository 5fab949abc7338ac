"""trace: TRACE (capability-targeted agentic training, arXiv 2604.05336) as a reproducible pipeline."""

__version__ = "0.1.0"
