"""The policy side: the model (GGUF -> HF), its chat format with tools, constrained decoding, the KV
cache and the episode loop that plays many episodes at once (`collect_rollouts`)."""
