"""Routing (paper §3.4): the base model picks an adapter (or none) from label-token logits, with
retrieval candidates and top-p; adapters are composed exactly into the base weights per task."""
