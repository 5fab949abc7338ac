"""The agent policy: an HF causal LM (+ optional LoRA adapters) that answers batches of episodes.

Reads a model folder written by `prepare_model` (or any local HF folder / hub id) and optional PEFT
adapter folders written by the train stage; writes nothing. Implements the paper's policy π (the
base agent of §2 that produces D+ and D-, and the adapter-equipped agent of §3.4 evaluated with a
chosen adapter or none).

`Policy.generate` decodes one agent turn for many conversations at once with its own loop
(instead of `model.generate`) because three things matter on a 2-core CPU:

* prefix caching: every episode of an environment starts with the same system turn (tool list
  first, see chat.py). Its KV states are computed once (batch 1) and kept across calls (keyed by
  tokens and adapter). The padding goes between that prefix and each row's own suffix, with the
  attention mask zero there and position ids from the mask's cumsum, which is exactly the
  unpadded computation. With the default `cascade` attention (kvcache.py) the prefix is never
  copied into the rows; with other attention implementations it is;
* per-episode KV caches across turns (`sessions`): a row's keys and values after the shared prefix
  are kept when its turn ends, and the episode's next turn reuses them up to the first token where
  the new prompt differs (normally the whole previous prompt and the generated turn), so a turn
  only prefills what is new (the tool results or user reply);
* shared stems: rows whose prompts repeat one another beyond what they have cached (the K
  episodes of a GRPO group after the same first tool call, which returned the same long result)
  have that common stretch computed once, in a batch of its own, and every row of the group starts
  from its KV states (`shared_stems`; `benchmarks/train_step.py`);
* prefill passes of similar rows: a row's new tokens (a 600-token tool result, say) are computed in
  a pass with rows of similar width and history (`prefill_passes`), not padded into one pass with
  the whole batch, where every row would pay for the widest row's tokens and the longest history;
* a preallocated KV buffer (no `torch.cat` of the whole cache at every step);
* finished rows leave the batch, so a batch costs what its live rows cost;
* continuous batching across turns (`play_turns`, GRPO's sampling): a row whose turn ended starts its
  next one (its environment reply prefilled from its session) and joins the batch still decoding
  (`kvcache.append_rows`), instead of every turn waiting for the call's longest row.
* rows under different weights in one batch (`play_turns(routes=...)`; the evaluate and scaling stages
  with `evaluate.decode_together`): each row runs under its own route (the base model, one adapter or a
  merge; `row_lora`), with one shared prefix per route, so Table 1's methods can decode as one batch
  instead of one batch each.

Sampling draws from one `torch.Generator` per row seeded by (seed, row) (in `play_turns`, per turn),
so a row's tokens do not depend on which other rows share its batch; temperature 0 is greedy.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_lib.engine.chat import Generation, parse_assistant, render_prompt, tool_chat_template
from trace_lib.io import read_json
from trace_lib.engine.model import compute_dtype
from trace_lib.engine.packed import install_packed_linears
from trace_lib.engine.kvcache import CASCADE, RowRoutes, buffered, row_routes, shared_prefix, supports_cascade
from trace_lib.engine.threads import govern_threads, set_threads
from trace_lib.records import Message
from trace_lib.engine.decoding import BatchDecoding, NextTurn, Session, TurnRun, route_labels

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GenerationStats:
    """Running totals since the policy was loaded (for tokens/s metrics)."""

    calls: int = 0
    sequences: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV states came from the prefix cache (not recomputed)."""
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def completion_tokens_per_second(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return self.completion_tokens / total if total > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**self.__dict__, "completion_tokens_per_second": self.completion_tokens_per_second}


class Policy(BatchDecoding):
    """A causal LM with the trace chat format, optional named LoRA adapters and batched decoding."""

    def __init__(self, model: Any, tokenizer: Any, base_id: str, *, prefix_cache: bool = True,
                 tool_format: str = "json") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.base_id = base_id
        self.prefix_cache = prefix_cache
        self.tool_format = tool_format
        """How prompts list the tools (chat.TOOL_FORMATS; `load_policy` reads the prepared folder's)."""
        self.adapter: str | None = None
        self.stats = GenerationStats()
        self.grammar_options: dict[str, Any] = {}
        """Extra options for constrained decoding (grammar.make_tool_call_processor: e.g. max_string_chars,
        max_text_chars, require_tool_call)."""
        self._prefixes: dict[tuple[str | None, tuple[int, ...]], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._sessions: dict[Hashable, Session] = {}
        self.stop_ids = _stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self._turn_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    # --- adapters -----------------------------------------------------------------------------
    @property
    def adapters(self) -> list[str]:
        return sorted(getattr(self.model, "peft_config", {}) or {})

    def set_adapter(self, name: str | None) -> None:
        """Activate a loaded adapter by name; None runs the base model."""
        if name is not None:
            if name not in self.adapters:
                raise ValueError(f"unknown adapter {name!r}; loaded: {self.adapters or 'none'}")
            self.model.set_adapter(name)
        self.adapter = name

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (read per call: a trainer may move the model after loading)."""
        return next(self.model.parameters()).device

    @property
    def policy_id(self) -> str:
        return self.base_id if self.adapter is None else f"{self.base_id}+{self.adapter}"

    def clear_prefix_cache(self) -> None:
        """Drop the cached prefix and session KV states; call after the weights change (a training step)."""
        self._prefixes.clear()
        self._sessions.clear()

    def end_sessions(self, keys: Sequence[Hashable]) -> None:
        """Forget the KV states kept for these episodes (they have ended)."""
        for key in keys:
            self._sessions.pop(key, None)

    def _adapter_context(self):
        if self.adapter is None and self.adapters:
            return self.model.disable_adapter()
        return nullcontext()

    def _routes_context(self, run: TurnRun):
        """The adapter context of a `play_turns` call: none with routes (`row_lora` sets every row's)."""
        return nullcontext() if run.route_of is not None else self._adapter_context()

    def _head(self, run: TurnRun, r: int, prefix_ids: tuple[int, ...]) -> tuple[str | None, tuple[int, ...]]:
        """What row r's kept sessions must have been computed under: its route (or the adapter) and the prefix."""
        return (self.adapter if run.route_of is None else run.labels[run.route_of[r]], prefix_ids)

    def _row_routes(self, run: TurnRun, rows: Sequence[int], device: torch.device) -> RowRoutes | None:
        return None if run.route_of is None else RowRoutes([run.route_of[r] for r in rows], device)

    # --- text helpers -------------------------------------------------------------------------
    def render(self, messages: list[Message], tools: list[dict[str, Any]]) -> str:
        return render_prompt(self.tokenizer, messages, tools, self.tool_format)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    # --- generation ---------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        conversations: list[list[Message]],
        tools: list[dict[str, Any]],
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        constrained: bool = False,
        require_tool_call: bool | list[bool] = False,
        sessions: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        """One agent turn for each conversation, decoded as one batch.

        With `constrained`, `require_tool_call` (one flag, or one per conversation) forbids a plain
        message on those rows, like `tool_choice="required"` in chat APIs. `sessions` (one key per
        conversation, e.g. the episode id) keeps each row's KV states for its next turn; call
        `end_sessions` when the episodes end.
        """
        if not conversations:
            return []
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompts = [self.encode(self.render(conv, tools)) for conv in conversations]
        processor = self.tool_processor(tools, len(prompts), require_tool_call) if constrained else None
        tokens, finish = self.generate_ids(
            prompts, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
            seed=seed, processor=processor, sessions=sessions,
        )
        return [self.turn(conv, tools, prompt, toks, why)
                for conv, prompt, toks, why in zip(conversations, prompts, tokens, finish)]

    def tool_processor(self, tools: list[dict[str, Any]], rows: int, require_tool_call: bool | list[bool] = False):
        """The grammar processor (engine/grammar.py) for `rows` turns; `require_tool_call` False leaves the
        policy's `grammar_options` default."""
        from trace_lib.engine.grammar import make_tool_call_processor  # xgrammar is imported only when used

        options = dict(self.grammar_options)
        if require_tool_call is not False:  # an explicit per-call choice wins over the default
            options["require_tool_call"] = require_tool_call
        return make_tool_call_processor(self.tokenizer, tools, rows, vocab_size=self._vocab_size(), **options)

    def turn(self, conversation: list[Message], tools: list[dict[str, Any]], prompt: list[int], tokens: list[int],
             finish: str) -> Generation:
        """The agent turn `tokens` (stop token included) decoded after `prompt`, the conversation rendered."""
        text = self.tokenizer.decode([t for t in tokens if t not in self.stop_ids], skip_special_tokens=False)
        turn = sum(1 for m in conversation if m.role == "assistant")
        return Generation(text, parse_assistant(text, tools, turn=turn), len(prompt), len(tokens), finish)

    @property
    def plays_turns(self) -> bool:
        """Whether `play_turns` takes this model (every layer full attention: a buffered KV cache)."""
        return buffered(self.model)

    def _vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def generate_ids(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        processor: Any = None,
        use_prefix_cache: bool | None = None,
        sessions: Sequence[Hashable] | None = None,
    ) -> tuple[list[list[int]], list[str]]:
        """Token-level batched decoding; returns each row's new tokens (stop token included) and finish reason.

        `sessions`: one key per prompt; each row's KV states are kept under its key after this call
        and reused by the next call with the same key, as far as the new prompt repeats the old one.
        """
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} session keys for {len(prompts)} prompts")
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        govern_threads()
        use_prefix = self.prefix_cache if use_prefix_cache is None else use_prefix_cache
        with self._adapter_context():
            prefix_len, prefix_kv = self._prefix_for(prompts, self.adapter) if use_prefix else (0, None)
        cascade = prefix_kv is not None and supports_cascade(self.model)
        with self._adapter_context(), shared_prefix(prefix_kv if cascade else None):
            return self._decode(prompts, prefix_len, prefix_kv, cascade, temperature, top_p, max_new_tokens,
                                seed, processor, t0, sessions)

    @torch.inference_mode()
    def play_turns(
        self,
        prompts: list[list[int]],
        next_turn: Callable[[int, list[int], str], NextTurn | tuple | None],
        *,
        temperature: float | Sequence[float],
        top_p: float,
        max_new_tokens: int,
        seed: int,
        sessions: Sequence[Hashable],
        processor: Any = None,
        routes: Sequence[Mapping[str, float]] | None = None,
        row_routes: Sequence[int] | None = None,
    ) -> float:
        """Decode every row's turns until its episode ends, rows starting new turns as others still decode;
        returns the seconds spent in `next_turn` (the caller's, not decoding: the policy's stats leave them out).

        Row i starts from `prompts[i]`. When one of its turns ends, `next_turn(i, tokens, finish)` is
        called (tokens with the stop token, finish "stop" or "length") and returns the row's next turn
        (`NextTurn`, or a tuple of its fields): normally the previous prompt, the turn and the
        environment's reply, and whether the turn must call a tool; with a new `session` key the row
        starts another episode (a queue refilling its slot). None: the row is done. `sessions` (one key
        per row) keep each row's KV states between its turns, as in `generate_ids`; the caller ends them.
        `processor`: a `ToolCallLogitsProcessor` for the rows' first turns (`add_rows` gives later
        turns theirs).

        Continuous batching: with turns decoded call by call, every call runs until its longest row
        stops, so most decoding steps carry a few rows while the rest wait for the next call
        (`benchmarks/train_step.py`). Here a row whose turn ended waits only until a quarter as many
        rows wait as decode (`JOIN_SHARE`), then those rows' new tokens are prefilled (from their
        sessions, with shared stems) and they join the decoding batch (`kvcache.append_rows`). A
        prompt that does not start with the batch's shared prefix (another episode's system turn)
        waits until the batch has emptied and starts the next one. Each turn draws from its own
        generator, seeded by (seed, the turn's index in order of starting), and the order in which
        turns end depends only on the tokens, so a call is deterministic. Models with sliding-window
        layers (no buffered cache, `kvcache.buffered`) are refused: decode their turns call by call
        with `generate_ids`.

        `routes` ({adapter: α} each; {} the base model) with `row_routes` (per row, an index into them):
        each row runs under its own route in the same batch (`engine.row_lora`), its episodes' later
        `NextTurn`s naming the new episode's route (a `NextTurn` with a new session and no route keeps the
        row's route). Each route has its own shared prefix and sessions. Without them every row runs under the
        policy's adapter. With routes, `temperature` may be one per route (each above 0): several trainings'
        episodes sampled together, each at its own temperature (`training/lockstep.py`).
        """
        if len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} session keys for {len(prompts)} prompts")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not buffered(self.model):
            raise ValueError("play_turns needs a model with only full-attention layers (a buffered KV cache); "
                             "decode its turns call by call with generate_ids")
        if not prompts:
            return 0.0
        if (routes is None) != (row_routes is None):
            raise ValueError("routes and row_routes go together")
        if routes is not None and (len(row_routes) != len(prompts)
                                   or not all(0 <= k < len(routes) for k in row_routes)):
            raise ValueError(f"row_routes must give each of the {len(prompts)} rows an index into the "
                             f"{len(routes)} routes")
        per_route = not isinstance(temperature, (int, float))
        if per_route and (routes is None or len(temperature) != len(routes) or min(temperature) <= 0):
            raise ValueError("a temperature per route needs routes, one temperature above 0 for each")
        t0 = time.perf_counter()
        govern_threads()
        torch.manual_seed(seed)
        run = TurnRun(list(prompts), list(sessions), next_turn, seed, processor)
        starting = [(r, None) for r in range(len(prompts))]  # the processor already has the first rows' grammars
        routed = nullcontext()
        if routes is not None:
            from trace_lib.engine.row_lora import RoutedLora

            run.route_of, run.labels = list(row_routes), route_labels(routes)
            run.temperatures = [float(t) for t in temperature] if per_route else None
            routed = RoutedLora(self.model, routes)
        with routed:
            while starting:  # one batch per shared prefix
                with self._routes_context(run):
                    prefix_len, prefix_kv = (self._prefixes_for([run.prompts[r] for r, _ in starting], run)
                                             if self.prefix_cache else (0, None))
                cascade = prefix_kv is not None and supports_cascade(self.model)
                with self._routes_context(run), shared_prefix(prefix_kv if cascade else None):
                    starting = self._decode_turns(run, starting, prefix_len, prefix_kv, cascade, temperature, top_p,
                                                  max_new_tokens)
        self.stats.calls += 1
        self.stats.prefill_seconds += run.prefill_seconds
        self.stats.decode_seconds += time.perf_counter() - t0 - run.prefill_seconds - run.callback_seconds
        return run.callback_seconds


def _stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    vocab = tokenizer.get_vocab()
    for tok in ("<|im_end|>", "<|endoftext|>"):
        if tok in vocab:
            ids.append(int(vocab[tok]))
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    for tid in eos if isinstance(eos, list) else [eos]:
        if tid is not None and tid not in ids:
            ids.append(int(tid))
    if not ids:
        raise ValueError("the tokenizer has no end-of-turn or EOS token to stop on")
    return ids


def prepared_tool_format(model_dir: str | Path) -> str:
    """The tool format (`chat.TOOL_FORMATS`) a prepared folder's model.json records; 'json' for a folder
    prepared before the setting existed, or one that is not prepared (a plain HF folder, a hub id)."""
    manifest = Path(model_dir) / "model.json"
    return str(read_json(manifest).get("tool_format", "json")) if manifest.is_file() else "json"


def use_tool_template(tokenizer: Any, model_dir: str | Path, tool_format: str | None = None) -> str:
    """Give `tokenizer` the trace chat template listing tools in `tool_format` (None: the prepared folder's,
    `prepared_tool_format`); returns the format used."""
    tool_format = tool_format or prepared_tool_format(model_dir)
    tokenizer.chat_template = tool_chat_template(tool_format)
    return tool_format


def resolve_model_path(model_dir: str | Path) -> tuple[str, str]:
    """(path or hub id to load, base id) for a prepared folder, a plain HF folder, or a hub id."""
    path = Path(model_dir)
    manifest = path / "model.json"
    if manifest.is_file():
        info = read_json(manifest)
        target = info.get("path", ".")
        load = str(path) if target in (".", "", None) else str(target)
        return load, str(info.get("model_id") or info.get("source") or path.name)
    return str(model_dir), path.name if path.exists() else str(model_dir)


def load_policy(
    model_dir: str | Path,
    dtype: str = "float32",
    adapters: dict[str, str] | None = None,
    policy_id: str | None = None,
    *,
    threads: int = 0,
    attn_implementation: str = "cascade",
    prefix_cache: bool = True,
    device: str = "auto",
    tool_format: str | None = None,
    packed: bool = True,
) -> Policy:
    """Load a causal LM (+ named LoRA adapters) as a Policy; the base model is active after loading.

    `attn_implementation`: 'cascade' (sdpa, plus kvcache.cascade_attention for the shared prompt
    prefix on CPU), or any transformers name ('sdpa', 'eager', ...). `device`: 'auto' (CUDA when
    present, else the CPU), or any torch device name. `tool_format`: how prompts list the tools
    (chat.TOOL_FORMATS); None: the one the prepared folder's model.json records (`model.tool_format`).
    `packed`: bf16 linear layers on the CPU compute with their weights packed for oneDNN once
    (engine/packed.py) wherever no gradient is recorded; the same outputs, faster products at decoding shapes.
    """
    set_threads(threads)
    load, base_id = resolve_model_path(model_dir)
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES) + ['auto']}, got {dtype!r}")
    target = resolve_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(load)
        model = AutoModelForCausalLM.from_pretrained(
            load, dtype=_DTYPES[compute_dtype(dtype, target)],
            attn_implementation="sdpa" if attn_implementation == "cascade" else attn_implementation,
        )
    except OSError as err:
        raise OSError(
            f"could not load model {load!r}: {err}. Pass a local HF folder (or run prepare_model); "
            "hub ids only work where the hub is reachable."
        ) from err
    if attn_implementation == "cascade" and target.type == "cpu":
        model.set_attn_implementation(CASCADE)
    tool_format = use_tool_template(tokenizer, model_dir, tool_format)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if adapters:
        from peft import PeftModel

        items = sorted(adapters.items())
        model = PeftModel.from_pretrained(model, items[0][1], adapter_name=items[0][0])
        for name, path in items[1:]:
            model.load_adapter(path, adapter_name=name)
    if target.type != "cpu":
        model = model.to(target)
    elif packed:
        install_packed_linears(model)
    return Policy(model, tokenizer, policy_id or base_id, prefix_cache=prefix_cache, tool_format=tool_format)


def resolve_device(device: str = "auto") -> torch.device:
    """'auto': the first CUDA device when there is one, else the CPU; otherwise the named device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
