"""Unsloth GPU training path check: a few GRPO steps with Unsloth vs plain TRL+PEFT on one model.

What it does (each part in its own subprocess, since `import unsloth` patches transformers/TRL
for the whole process):

    prepare   copy the model folder, or with --random-init build a model with its exact config
              and tokenizer but seeded random bf16 weights (for a machine that cannot get the
              real weights: proves the code path and gives honest step times, not learning)
    unsloth   FastLanguageModel.from_pretrained(dir, dtype=bf16, load_in_4bit=False) +
              FastLanguageModel.get_peft_model(r, alpha, q/k/v/o/gate/up/down) + TRL GRPOTrainer
    plain     the same GRPO loop with plain TRL + PEFT (no unsloth), for comparison
              (TRL's default gradient checkpointing; `plain_nockpt`: the same without it)
    reload    plain transformers + peft.PeftModel.from_pretrained on the adapter Unsloth saved:
              every saved LoRA tensor must load into a module (values equal), the adapter must
              change the logits, those logits are compared with the ones Unsloth computed, and
              the adapter's keys and config are compared with the plain TRL+PEFT adapter's

The task is a synthetic one-turn retail prompt (Hermes tool calling, the model's own chat
template, 3 tool schemas); the reward is 1 for the exact call
`<tool_call>{"name": "get_order_details", "arguments": {"order_id": "#W..."}}</tool_call>`,
0.5 for another well-formed call, plus a small shaping term (share of characters in the
completion that belong to a tool call's alphabet) so that rewards differ within a group even
for a random-weight model, and the LoRA weights move.

Both trainers get the same batch and `gradient_accumulation_steps` (`--grad-accum`, default 1):
after `import unsloth` on a GPU, `trl.GRPOConfig` is Unsloth's, whose default is 2. Needs unsloth
(+ unsloth_zoo, and bitsandbytes even for 16-bit LoRA), trl, peft, datasets; benchmarks/README.md
has the wheel list for the lent GPU machine and the measured numbers.

Output: one JSON object (versions, GPU, per-step seconds and their median excluding the first
step, peak GPU memory, reward per step, the adapter check) printed at the end and written to
`--out` (a file, or a folder that gets `unsloth_check.json`).

    python benchmarks/unsloth_check.py --model-dir data/model --steps 8 --out /tmp/uc
    python benchmarks/unsloth_check.py --model-dir .mdl/smollm2 --random-init --modes unsloth,plain,reload

CPU smoke test (no GPU: Unsloth's CPU fallback; a tiny config):

    python benchmarks/unsloth_check.py --model-dir data/model --random-init --tiny --steps 1 \\
        --num-generations 2 --batch 2 --max-completion-length 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# --shape: the model folder's own config, or the paper profile's model shape (Llama-3.1-8B-Instruct's
# published sizes) with the folder's tokenizer, for memory and step time with random weights; RoPE stays
# the folder's (it does not change the cost)
SHAPES: dict[str, dict] = {
    "model": {},
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                     "tie_word_embeddings": False},
}
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")

SYSTEM = ("You are a customer service agent for an online retail store. Authenticate the user, "
          "then help with orders. Make one tool call at a time and never make up information.")


def _tool(name: str, description: str, props: dict[str, str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(props),
                       "properties": {k: {"type": "string", "description": v} for k, v in props.items()}}}}


TOOLS = [
    _tool("find_user_id_by_email", "Find the user id by email.", {"email": "The email of the user."}),
    _tool("get_order_details", "Get the status and details of an order.",
          {"order_id": "The order id, such as '#W0000000'. Mind the '#' at the beginning."}),
    _tool("cancel_pending_order", "Cancel a pending order.",
          {"order_id": "The order id, such as '#W0000000'.", "reason": "'no longer needed' or 'ordered by mistake'."}),
]
USER_LINES = [
    "Hi, where is my order {oid}? It has been a week.",
    "Can you tell me the status of order {oid} please?",
    "I ordered something last Monday, the order number is {oid}. Has it shipped?",
    "Order {oid} - what's going on with it?",
]
CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_ALPHABET = set('<>{}[]":,_/ \n#Wabcdefghijklmnopqrstuvwxyz0123456789')


# ------------------------------------------------------------------------------------ task

def make_rows(tokenizer, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        oid = f"#W{(7919 * (i + 1)) % 10_000_000:07d}"
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": USER_LINES[i % len(USER_LINES)].format(oid=oid)}]
        prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        rows.append({"prompt": prompt, "order_id": oid})
    return rows


def score(completion: str, order_id: str) -> float:
    text = completion.split("<|im_end|>")[0]
    shaping = 0.1 * (sum(c in CALL_ALPHABET for c in text) / len(text)) if text else 0.0
    m = CALL_RE.search(text)
    if not m:
        return shaping
    try:
        call = json.loads(m.group(1))
    except ValueError:
        return 0.2 + shaping
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict) or "name" not in call:
        return 0.2 + shaping
    if call["name"] == "get_order_details" and call["arguments"].get("order_id") == order_id:
        return 1.0 + shaping
    return 0.5 + shaping


def tool_call_reward(prompts, completions, order_id, **_) -> list[float]:
    out = []
    for c, oid in zip(completions, order_id):
        text = c if isinstance(c, str) else "".join(m.get("content", "") for m in c)
        out.append(score(text, oid))
    return out


# ------------------------------------------------------------------------------------ prepare

def prepare(args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src, dst = Path(args.model_dir), Path(args.work) / "model"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    if not args.random_init:
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, dst / f.name)
        return {"model": str(src), "weights": "real"}
    config = AutoConfig.from_pretrained(src)
    for key, value in SHAPES[args.shape].items():
        setattr(config, key, value)
    if args.tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 64, 128
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    torch.manual_seed(0)
    # an 8B-shaped model is initialised on the GPU (seconds; tens of minutes on the CPU)
    device = "cuda" if args.shape != "model" and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    n = sum(p.numel() for p in model.parameters())
    return {"model": str(src), "weights": "random (seed 0), config and tokenizer of the model folder",
            "shape": args.shape, "tiny": bool(args.tiny), "params": n, "init_device": device}


# ------------------------------------------------------------------------------------ train

def train(args, mode: str) -> dict:
    res: dict = {"mode": mode}
    if mode == "unsloth":
        import unsloth  # noqa: F401  (before transformers/trl: it patches them)
        from unsloth import FastLanguageModel
        res["unsloth"] = unsloth.__version__
    import torch
    import transformers
    import trl
    import peft
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    res.update(torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__,
               peft=peft.__version__, gpu=torch.cuda.get_device_name(0) if cuda else None)
    model_dir = str(Path(args.work) / "model")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    if mode == "unsloth":
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=model_dir, max_seq_length=args.max_seq_length, dtype=torch.bfloat16,
            load_in_4bit=False, local_files_only=True)
        model = FastLanguageModel.get_peft_model(
            model, r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGET_MODULES,
            bias="none", random_state=args.seed)
        peft_config = None
    else:
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                     device_map="cuda" if cuda else None)
        peft_config = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                                 target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    res["load_s"] = round(time.perf_counter() - t0, 2)
    res["model_class"] = f"{type(model).__module__}.{type(model).__name__}"
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token

    rows = make_rows(tokenizer, args.steps * args.batch // args.num_generations + 8)
    res["prompt_tokens"] = len(tokenizer(rows[0]["prompt"])["input_ids"])
    ds = Dataset.from_list(rows)
    cfg = GRPOConfig(
        output_dir=str(Path(args.work) / f"out_{mode}"), per_device_train_batch_size=args.batch,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_steps=args.steps, learning_rate=args.lr, logging_steps=1, report_to="none",
        save_strategy="no", bf16=cuda, seed=args.seed, beta=0.0, temperature=1.0,
        use_cpu=not cuda, dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0,
        # explicit: Unsloth's GRPOConfig (what `trl.GRPOConfig` is after `import unsloth` on a GPU)
        # defaults to 2, TRL's to 1 -- without this the two modes do different work per step
        gradient_accumulation_steps=args.grad_accum,
        **({"gradient_checkpointing": False} if mode == "plain_nockpt" else {}))

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], None

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t)

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[tool_call_reward], args=cfg, train_dataset=ds,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[timer])
    res["trainer_class"] = f"{type(trainer).__module__}.{type(trainer).__name__}"
    res["config_class"] = f"{type(cfg).__module__}.{type(cfg).__name__}"
    res["grad_accum"] = trainer.args.gradient_accumulation_steps
    res["completions_per_step"] = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    res["train_s"] = round(time.perf_counter() - t0, 2)
    res["step_s"] = [round(t, 3) for t in timer.times]
    later = timer.times[1:] or timer.times
    res["median_step_s_after_first"] = round(statistics.median(later), 3)
    if cuda:
        res["peak_gpu_mem_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        res["peak_gpu_mem_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    res["reward_per_step"] = [round(h["reward"], 4) for h in logs]
    res["reward_std_per_step"] = [round(h.get("reward_std", float("nan")), 4) for h in logs]
    res["loss_per_step"] = [round(h.get("loss", float("nan")), 6) for h in logs]
    res["completion_mean_length"] = [h.get("completions/mean_length") for h in logs]
    tokens = [h.get("num_tokens") for h in logs]  # cumulative prompt+completion tokens
    if len(tokens) == len(timer.times) and all(t is not None for t in tokens):
        per_step = [b - a for a, b in zip([0.0] + tokens[:-1], tokens)]
        rates = [n / t for n, t in zip(per_step, timer.times)][1:] or [per_step[0] / timer.times[0]]
        res["median_tokens_per_s_after_first"] = round(statistics.median(rates), 1)
    res["median_completions_per_s_after_first"] = round(
        res["completions_per_step"] / res["median_step_s_after_first"], 3)
    res["grad_checkpointing"] = ("unsloth (get_peft_model default)" if mode == "unsloth"
                                 else f"TRL gradient_checkpointing={cfg.gradient_checkpointing}")

    peft_model = trainer.model
    adapter_dir = Path(args.work) / f"adapter_{mode}"
    peft_model.save_pretrained(str(adapter_dir))
    res["adapter_dir"] = str(adapter_dir)
    res["adapter_files"] = sorted(p.name for p in adapter_dir.iterdir())
    # reference logits of the trained model on a fixed prompt, for the reload check
    if mode == "unsloth":
        FastLanguageModel.for_inference(peft_model)
    peft_model.eval()
    ids = tokenizer(rows[0]["prompt"], return_tensors="pt")["input_ids"].to(peft_model.device)
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits.float().cpu()
    torch.save({"input_ids": ids.cpu(), "logits": logits}, Path(args.work) / f"logits_{mode}.pt")
    return res


# ------------------------------------------------------------------------------------ reload

def reload(args, mode: str = "unsloth") -> dict:
    """Load the adapter written by `mode` with plain transformers + peft and check it."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    work = Path(args.work)
    adapter_dir = work / f"adapter_{mode}"
    if not (adapter_dir / "adapter_config.json").exists():
        raise FileNotFoundError(f"no adapter from the {mode!r} mode in {adapter_dir} (did that mode fail?)")
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    base = AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=torch.bfloat16).to(dev)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    from reload_adapters import compare_saved_lora  # this folder: the script's own path entry

    matched, mismatched, missing = compare_saved_lora(saved, dict(model.named_parameters()))
    b_norm = sum(float(t.float().norm()) for k, t in saved.items() if "lora_B" in k)
    ref = torch.load(work / f"logits_{mode}.pt")
    ids = ref["input_ids"].to(dev)
    with torch.no_grad():
        with_adapter = model(input_ids=ids).logits.float().cpu()
        with model.disable_adapter():
            without = model(input_ids=ids).logits.float().cpu()
    res = {
        "adapter_of": mode,
        "peft_type": cfg.get("peft_type"), "r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"),
        "target_modules": sorted(cfg.get("target_modules") or []),
        "saved_tensors": len(saved), "loaded_equal": matched, "loaded_different": mismatched[:5],
        "not_found": missing[:5], "lora_B_total_norm": round(b_norm, 6),
        "adapter_effect_max_abs_logit": round(float((with_adapter - without).abs().max()), 5),
        "reloaded_vs_trained_max_abs_logit": round(float((with_adapter - ref["logits"]).abs().max()), 5),
        "base_vs_trained_max_abs_logit": round(float((without - ref["logits"]).abs().max()), 5),
        "reloaded_vs_trained_top1_agree": round(float(
            (with_adapter.argmax(-1) == ref["logits"].argmax(-1)).float().mean()), 4),
    }
    plain_cfg = work / "adapter_plain" / "adapter_config.json"
    if plain_cfg.exists():  # same adapter format as the plain TRL+PEFT path?
        other = json.loads(plain_cfg.read_text())
        other_keys = set(load_file(str(work / "adapter_plain" / "adapter_model.safetensors")))
        res["same_keys_as_plain_peft"] = other_keys == set(saved)
        norm = lambda v: sorted(v) if isinstance(v, list) else v  # noqa: E731 - target_modules order
        res["config_differences_vs_plain_peft"] = {
            k: [cfg.get(k), other.get(k)] for k in sorted(set(cfg) | set(other))
            if norm(cfg.get(k)) != norm(other.get(k)) and k not in ("revision", "base_model_name_or_path")}
    res["ok"] = (not missing and not mismatched and matched == len(saved) and cfg.get("peft_type") == "LORA"
                 and res["adapter_effect_max_abs_logit"] > 0)
    return res


# ------------------------------------------------------------------------------------ driver

def worker(args) -> None:
    try:
        if args.worker == "prepare":
            res = prepare(args)
        elif args.worker == "reload":
            res = reload(args)
        else:
            res = train(args, args.worker)
        res["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - the driver reports it
        traceback.print_exc()
        res = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
    Path(args.part).write_text(json.dumps(res, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default="data/model")
    ap.add_argument("--random-init", action="store_true", help="config + tokenizer only, random bf16 weights")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64 (CPU smoke test)")
    ap.add_argument("--shape", default="model", choices=sorted(SHAPES),
                    help="with --random-init: the folder's config, or an 8B-shaped Llama (the paper profile)")
    ap.add_argument("--modes", default="unsloth,plain,reload")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="per-device batch (completions per step)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (both modes)")
    ap.add_argument("--max-completion-length", type=int, default=96)
    ap.add_argument("--max-seq-length", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temp folder)")
    ap.add_argument("--out", default=None, help="JSON file, or a folder for unsloth_check.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    if args.shape != "model" and not args.random_init:
        ap.error("--shape sets a model's sizes for random weights: it needs --random-init")
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"unsloth", "plain", "plain_nockpt", "reload"}
    if unknown:
        ap.error(f"unknown modes: {sorted(unknown)}")
    args.model_dir = str(Path(args.model_dir).resolve())
    work = Path(args.work or tempfile.mkdtemp(prefix="unsloth_check_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "UNSLOTH_DISABLE_STATISTICS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k not in ("worker", "part", "work", "out", "modes", "random_init", "tiny") and v is not None]
    passthrough += ["--random-init"] * args.random_init + ["--tiny"] * args.tiny
    result: dict = {"command": " ".join(sys.argv), "work": str(work),
                    "settings": {k: getattr(args, k) for k in ("steps", "batch", "num_generations", "grad_accum",
                                 "max_completion_length", "rank", "alpha", "lr", "random_init", "tiny",
                                 "shape")}}
    for part in ["prepare"] + modes:
        print(f"=== {part}", flush=True)
        part_file = work / f"part_{part}.json"
        t0 = time.perf_counter()
        # the workers run in the scratch folder: Unsloth writes its compiled cache to the cwd
        rc = subprocess.call([sys.executable, str(Path(__file__).resolve()), "--worker", part,
                              "--part", str(part_file), f"--work={work}", *passthrough], cwd=work, env=env)
        res = json.loads(part_file.read_text()) if part_file.exists() else {"status": "error", "error": f"rc={rc}"}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        result[part] = res
        print(f"=== {part}: {res.get('status')} in {res['wall_s']} s", flush=True)
        if part == "prepare" and res.get("status") != "ok":
            break
    for base in ("plain", "plain_nockpt"):  # completions per second, so unequal batches still compare
        if all(result.get(m, {}).get("status") == "ok" for m in ("unsloth", base)):
            result[f"speedup_unsloth_vs_{base}"] = round(result["unsloth"]["median_completions_per_s_after_first"]
                                                         / result[base]["median_completions_per_s_after_first"], 2)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        out = Path(args.out)
        if out.suffix != ".json":
            out.mkdir(parents=True, exist_ok=True)
            out = out / "unsloth_check.json"
        out.write_text(text)


if __name__ == "__main__":
    main()
