"""The inference engine: the model (GGUF -> HF), its chat format with tools, constrained decoding, the KV cache,
packed and row-routed LoRA batches, adapter composition, the server backends and serving. It knows nothing of the
method: the episode loop (`agent.rollout`) and every stage build on it."""
