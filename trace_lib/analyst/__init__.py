"""The analyst (paper §3.1): the one LLM call (cached by request hash, ledgered), its prompts, plain-text
renderings of trajectories, the offline rules detectors, MiniLM embeddings, capability discovery from
failure batches and contrastive scoring with selection."""
