"""Reload a finished run's adapters with plain transformers + PEFT, on the CPU and (when present) on CUDA.

For the adapters the train stage wrote on one machine (e.g. the `gpu` profile on a GPU) and a user loads on
another. For each `data/adapters/<name>/` and `data/adapters/_baselines/<name>/` of `--root` (the final weights;
snapshots are left out):

- every tensor in `adapter_model.safetensors` loads into a LoRA module of `PeftModel.from_pretrained` on the
  CPU base model (float32), with equal values;
- the adapter moves the logits of a fixed retail prompt (max |logit change| against the adapter disabled);
- every LoRA weight of the loaded model came from the file (none left at its initial value);
- with CUDA, the same adapter on the base model in `--dtype` (default bf16) on the GPU: max |logit difference|
  to the CPU's float32 and the share of positions whose top token agrees (dtype and device together;
  informational, not part of `ok`).

    python benchmarks/reload_adapters.py --root . --out /tmp/reload.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = [{"role": "system", "content": "You are a customer service agent for an online retail store."},
          {"role": "user", "content": "Hi, where is my order #W2378156? It has been a week."}]


def _logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        on = model(input_ids=ids).logits.float().cpu()
        with model.disable_adapter():
            off = model(input_ids=ids).logits.float().cpu()
    return on, off


def compare_saved_lora(saved: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
                       ) -> tuple[int, list[str], list[str]]:
    """Each tensor of an adapter file against the loaded PeftModel's parameter it became:
    (how many are equal, keys whose values differ, keys no parameter took)."""
    equal, different, missing = 0, [], []
    for key, tensor in saved.items():
        # saved: base_model.model.X.lora_A.weight -> loaded: base_model.model.X.lora_A.default.weight
        name = re.sub(r"\.(lora_[AB]|lora_embedding_[AB])\.", r".\1.default.", key)
        if name not in params:
            missing.append(key)
        elif torch.equal(params[name].detach().cpu().to(tensor.dtype), tensor):
            equal += 1
        else:
            different.append(key)
    return equal, different, missing


def check(model_dir: Path, adapter: Path, ids: torch.Tensor, dtype: torch.dtype) -> dict:
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    params = dict(model.named_parameters())
    equal, _, missing = compare_saved_lora(saved, params)
    lora_weights = sum(1 for name in params if ".lora_A." in name or ".lora_B." in name)
    cpu_on, cpu_off = _logits(model, ids)
    res = {"saved_tensors": len(saved), "loaded_equal": equal, "not_found": missing[:5],
           "model_lora_weights": lora_weights,
           "adapter_effect_max_abs_logit_cpu": round(float((cpu_on - cpu_off).abs().max()), 5)}
    if torch.cuda.is_available():
        gbase = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, device_map="cuda")
        gmodel = PeftModel.from_pretrained(gbase, str(adapter)).eval()
        gpu_on, _ = _logits(gmodel, ids.cuda())
        res["gpu_dtype"] = str(dtype).removeprefix("torch.")
        res["gpu_vs_cpu_max_abs_logit"] = round(float((gpu_on - cpu_on).abs().max()), 5)
        res["gpu_vs_cpu_top1_agree"] = round(float((gpu_on.argmax(-1) == cpu_on.argmax(-1)).float().mean()), 4)
    res["ok"] = (not missing and equal == len(saved) == lora_weights
                 and res["adapter_effect_max_abs_logit_cpu"] > 0)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=".", help="a finished run (data/model, data/adapters)")
    ap.add_argument("--dtype", default="bfloat16", help="the GPU copy's base-weight dtype")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.root)
    model_dir = root / "data" / "model"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    adapters = sorted(p.parent for pattern in ("*/adapter_config.json", "_baselines/*/adapter_config.json")
                      for p in (root / "data" / "adapters").glob(pattern))
    result = {"root": str(root.resolve()),
              "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "prompt_tokens": int(ids.shape[1]), "adapters": {}}
    for adapter in adapters:
        name = str(adapter.relative_to(root / "data" / "adapters"))
        try:
            result["adapters"][name] = check(model_dir, adapter, ids, getattr(torch, args.dtype))
        except Exception as err:  # noqa: BLE001 - one adapter's failure is reported, the others still run
            result["adapters"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}
    result["all_ok"] = bool(adapters) and all(r.get("ok") for r in result["adapters"].values())
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
