"""LoRA adapters with random weights saved to disk, and the plain-transformers reference of their merged model."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear module of a Llama block that LoRA can target."""


def save_lora(model_dir, out, seed: int, targets: list[str], r: int = 4, alpha: int = 16, b_std: float = 0.0):
    """A PEFT adapter on `targets` saved to `out`, A and B at nn.Linear's random init (PEFT would zero B, a no-op
    adapter) and B redrawn from N(0, b_std) when `b_std` > 0, so the adapter changes the outputs more."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False))
    if b_std > 0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, b_std)
    model.save_pretrained(out)
    return out


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


def explicit_model(model_dir, adapter_dirs, weights: dict[str, float]):
    """A plain transformers model whose weights are set to W + Σ α·(B A · lora_alpha / r), computed
    from the adapter files without PEFT."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, alpha in weights.items():
            folder = adapter_dirs[name]
            cfg = json.loads((folder / "adapter_config.json").read_text())
            scaling = cfg["lora_alpha"] / cfg["r"]
            tensors = load_file(folder / "adapter_model.safetensors")
            for key, a in tensors.items():
                if not key.endswith("lora_A.weight"):
                    continue
                b = tensors[key.replace("lora_A", "lora_B")]
                path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                modules[path].weight += alpha * scaling * (b @ a)
    return model
