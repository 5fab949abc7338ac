"""The agent policy served by an OpenAI-compatible server (`policy.backend: openai`: vLLM, SGLang, llama.cpp).

Reads nothing from disk; sends chat-completions requests to `policy.base_url`. Implements the same
`Generator` protocol (agent/rollout.py) as the embedded `Policy`, so the episode loop, the
environments and the records do not know which backend decoded a turn.

One agent turn of one episode is one request: the episode's messages (`chat.message_to_dict`, tool
call arguments as JSON strings as the API wants them), the tool schemas, `tool_choice` ("required"
where the embedded engine would force a tool call), temperature, top_p, `max_tokens` and a per-row
seed derived as the embedded engine derives it. The server applies the chat template and parses the
tool calls; for trace's Hermes format that is vLLM's `--chat-template trace_lib/engine/templates/
tool_chat.jinja --tool-call-parser hermes --enable-auto-tool-choice`. Its reply is turned back into
trace text (each parsed call rendered as a `<tool_call>` block after the content) and read by
`chat.parse_assistant`, so a turn served remotely becomes the same `Message` record as the same text
decoded in-process, and a malformed call is the same invalid action the environment answers.

Requests of one `generate` call run concurrently on a thread pool bounded by `policy.concurrency`
(threads, not asyncio: the stages run inside Jupyter kernels whose event loop is already running).
Transient faults (408/409/429/5xx, timeouts, dropped connections) are retried by the OpenAI SDK with
exponential backoff (`policy.max_retries`); a request that still fails, or a reply without a usable
choice, raises `ServerError` naming the server, the served model and the cause. A turn the server
refuses (400, e.g. prompt + max_tokens over its context length) is that episode's invalid action,
recorded like any other. Token usage comes from the server's `usage` field; a reply that used all of
`max_tokens` counts as cut ("length") even when the server's tool parser closed the call.

Adapters are served by name (vLLM `--enable-lora --lora-modules <capability>=<folder>`, or loaded at
run time with `load_adapter`, vLLM's `/v1/load_lora_adapter`): `set_adapter(name)` makes later
requests name that model. A route (`use_route`, what `compose.apply_route` calls for this backend):
no adapter, one adapter by name, or an α-weighted merge served as one adapter, PEFT's `cat`
combination of the loaded adapters' folders (`adapters.write_cat_adapter`, exactly base + Σ α·B·A;
rank Σ r, so the server's `--max-lora-rank` must allow it), written under `route_dir` (a folder the
server can read), named by a hash of the weights and the adapters' bytes, loaded once.

Routing (`label_scores`): the base model's probabilities of the route labels at the answer position,
from the server's `top_logprobs` (at most 20) of one token after the routing question with the
assistant turn pre-filled with "Answer:" (vLLM's `continue_final_message`). A label outside the
top 20 gets the 20th's log-probability (an upper bound); exact against the in-process router whenever
every label is among the 20 (the label mass reports how much of the distribution the labels hold).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trace_lib.engine.chat import (
    CLOSE_TAG, OPEN_TAG, Generation, message_to_dict, normalize_tools, parse_assistant, row_seed,
)
from trace_lib.records import Message

NO_KEY = "EMPTY"
"""The API key sent when the key variable is unset (vLLM started without `--api-key` accepts any)."""
TOP_LOGPROBS = 20
"""Alternatives per position the OpenAI API returns at most; a route label outside them is bounded by the
least of them (`route_probabilities`)."""
RUNTIME_LOADING = ("is the server running with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora, "
                   "and can it read that path?")


class ServerError(RuntimeError):
    """A request the server did not answer after the retries, or answered with something unusable."""


@dataclass
class ServerStats:
    """Running totals since the policy was created (usage as the server reported it)."""

    calls: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: int = 0
    """Turns the server refused (400, e.g. over its context length), recorded as invalid actions."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def api_message(msg: Message) -> dict[str, Any]:
    """A record message in the chat-completions request form (tool-call arguments as JSON text)."""
    out = message_to_dict(msg)
    if msg.role == "assistant":
        calls = out.pop("tool_calls")
        if calls:
            out["tool_calls"] = [
                {"type": "function", "id": c["id"] or f"call_{i}",
                 "function": {"name": c["function"]["name"],
                              "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                for i, c in enumerate(calls)]
    elif msg.role == "tool":
        out = {k: v for k, v in out.items() if v is not None}
    return out


def _arguments_text(arguments: Any) -> str:
    """A call's arguments as JSON text: an object as it is, a string parsed first; a string that is not
    JSON is kept as the server sent it, so the parser rejects the call with its reason."""
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        return json.dumps(json.loads(arguments or "{}"), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(arguments)


def reply_text(content: Any, tool_calls: Any) -> str:
    """The served reply as trace text: the content, then one `<tool_call>` block per parsed call.

    The content before a call loses its trailing whitespace (servers' tool parsers keep the newline
    before `<tool_call>`); a call without a function becomes an unclosed tag, which the parser
    answers as an invalid action like any other malformed call."""
    parts = [content.rstrip()] if isinstance(content, str) and content.strip() else []
    if content is not None and not isinstance(content, str):
        raise TypeError(f"message content is {type(content).__name__}, not text")
    for call in tool_calls or []:
        fn = getattr(call, "function", None)
        if fn is None or not isinstance(getattr(fn, "name", None), str):
            parts.append(f"{OPEN_TAG}\n(a tool call without a function name)")
            continue
        parts.append(f'{OPEN_TAG}\n{{"name": {json.dumps(fn.name, ensure_ascii=False)}, '
                     f'"arguments": {_arguments_text(fn.arguments)}}}\n{CLOSE_TAG}')
    return "\n".join(parts)


def _token_text(alternative: Any) -> str:
    """An alternative's token as text: from its UTF-8 bytes when the server sent them."""
    raw = getattr(alternative, "bytes", None)
    if raw:
        try:
            return bytes(raw).decode("utf-8")
        except (UnicodeDecodeError, ValueError, TypeError):
            pass
    return str(alternative.token)


def route_probabilities(top: Mapping[str, float], labels: Sequence[str]) -> tuple[list[float], float]:
    """The server's top alternatives ({token text: log-probability}) -> (the labels' probabilities
    renormalised over them, the total probability of the labels it returned).

    A label not among the alternatives gets the least of their log-probabilities, an upper bound on its
    own, so no label has probability 0 (calibration divides by them). No alternatives at all: every
    probability on the last (none) label, mass 0."""
    if not top:
        return [0.0] * (len(labels) - 1) + [1.0], 0.0
    floor = min(top.values())
    lp = np.array([top.get(label, floor) for label in labels], dtype=np.float64)
    w = np.exp(lp - lp.max())
    return (w / w.sum()).tolist(), float(min(1.0, sum(math.exp(top[x]) for x in labels if x in top)))


class OpenAIPolicy:
    """A policy whose turns an OpenAI-compatible server decodes; adapters are served models named after them."""

    def __init__(self, base_url: str, served_model: str, *, api_key: str = NO_KEY, adapters: list[str] | None = None,
                 concurrency: int = 16, timeout_s: float = 300.0, max_retries: int = 4,
                 policy_id: str | None = None, client: Any = None, route_dir: str | Path | None = None,
                 tool_format: str = "json") -> None:
        from openai import OpenAI  # imported when a server is used

        self.base_url, self.served_model = base_url, served_model
        self.client = client or OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=max_retries)
        self.base_id = policy_id or served_model
        self._adapters = sorted(adapters or [])
        self._folders: dict[str, str] = {}
        self.route_dir = Path(route_dir) if route_dir else Path(tempfile.gettempdir()) / "trace-routes"
        self.adapter: str | None = None
        self._shown: str | None = None  # the route's label in policy_id while a merge is served
        self.concurrency = concurrency
        self.tool_format = tool_format
        """How the server's trace template lists the tools (sent as `chat_template_kwargs` with each request
        that carries tools, unless 'json', the template's default)."""
        self.stats = ServerStats()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Any, default_model: str, adapters: list[str] | None = None,
                    tool_format: str = "json") -> OpenAIPolicy:
        """From a `PolicyConfig` (`policy` section of params.yaml); `default_model` names the base model
        when `policy.served_model` is unset; `tool_format` is `model.tool_format`."""
        if not cfg.base_url:
            raise ValueError("policy.base_url is required with policy.backend: openai")
        return cls(cfg.base_url, cfg.served_model or default_model, api_key=os.environ.get(cfg.api_key_env) or NO_KEY,
                   adapters=adapters, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                   max_retries=cfg.max_retries, route_dir=cfg.route_dir, tool_format=tool_format)

    device = "server"
    """Where the turns are decoded, for the stages' numerics record."""

    # --- adapters -----------------------------------------------------------------------------
    @property
    def adapters(self) -> list[str]:
        return list(self._adapters)

    def set_adapter(self, name: str | None) -> None:
        """Send later requests to the served adapter `name`; None: the base model."""
        if name is not None and name not in self._adapters:
            raise ValueError(f"unknown adapter {name!r}; served: {self._adapters or 'none'}")
        self.adapter, self._shown = name, None

    def load_adapter(self, name: str, path: str, *, reload: bool = True) -> None:
        """Load a LoRA adapter folder into the server under `name` (vLLM's `/v1/load_lora_adapter`;
        the server must run with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`). A name the server already
        serves is unloaded and loaded again from `path` (a retrained adapter must not be served from
        the old weights), unless `reload` is False (names that are digests of their files)."""
        from openai import BadRequestError

        load, unload = {"lora_name": name, "lora_path": path}, {"lora_name": name}
        try:
            try:
                self.client.post("/load_lora_adapter", body=load, cast_to=object)
            except BadRequestError as err:
                if "already" not in str(err).lower():  # vLLM refuses a name it already serves
                    raise
                if reload:
                    self.client.post("/unload_lora_adapter", body=unload, cast_to=object)
                    self.client.post("/load_lora_adapter", body=load, cast_to=object)
        except Exception as err:  # the SDK's errors, after its retries
            raise ServerError(f"{self.base_url}: loading adapter {name!r} from {path} failed: {err} "
                              f"({RUNTIME_LOADING})") from err
        if name not in self._adapters:
            self._adapters = sorted([*self._adapters, name])
        self._folders[name] = path

    @contextmanager
    def use_route(self, weights: Mapping[str, float]) -> Iterator[OpenAIPolicy]:
        """Serve `weights` ({adapter: α}) while inside: {} the base model, one adapter at α 1 by its name,
        anything else the loaded adapters' `cat` adapter (written and loaded the first time; it stays
        registered on the server, which keeps the adapters it holds in memory in an LRU cache).
        Changes which model this policy's later requests name: not for use from several threads."""
        from trace_lib.engine.adapters import active_weights, merge_label, sole_adapter, write_cat_adapter

        active = active_weights(weights)
        prev, prev_shown = self.adapter, self._shown
        if not active or sole_adapter(active):
            self.set_adapter(sole_adapter(active))
        else:
            unknown = sorted(set(active) - set(self._folders))
            if unknown:
                raise ValueError(f"a merge of {unknown} needs their folders: load them with load_adapter "
                                 f"(loaded from folders: {sorted(self._folders) or 'none'})")
            folder = write_cat_adapter({n: Path(self._folders[n]) for n in active}, active, self.route_dir)
            if folder.name not in self._adapters:  # named by a digest of its files: never stale
                self.load_adapter(folder.name, str(folder.resolve()), reload=False)
            self.set_adapter(folder.name)
            self._shown = merge_label(active)
        try:
            yield self
        finally:
            self.adapter, self._shown = prev, prev_shown

    @property
    def policy_id(self) -> str:
        shown = self._shown or self.adapter
        return self.base_id if shown is None else f"{self.base_id}+{shown}"

    # --- routing --------------------------------------------------------------------------------
    def label_scores(self, prompts: Sequence[Sequence[Message]], labels: Sequence[str], prefix: str
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(probabilities of `labels` renormalised over them, their total probability) per routing
        question, the base model answering after the assistant turn pre-filled with `prefix`."""
        if len(labels) > TOP_LOGPROBS:
            raise ValueError(f"{len(labels)} route labels; the server returns at most {TOP_LOGPROBS} alternatives")

        def one(messages: Sequence[Message]) -> tuple[list[float], float]:
            request = {"model": self.served_model, "max_tokens": 1, "temperature": 0.0, "logprobs": True,
                       "top_logprobs": TOP_LOGPROBS,
                       "messages": [*map(api_message, messages), {"role": "assistant", "content": prefix}],
                       "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
            try:
                response = self.client.chat.completions.create(**request)
            except Exception as err:  # the SDK's errors, after its retries
                raise ServerError(f"{self.base_url}: model {self.served_model!r} did not score the route: {err}"
                                  ) from err
            try:
                top = response.choices[0].logprobs.content[0].top_logprobs
                seen: dict[str, float] = {}
                for t in top:  # two tokens with the same text: the more probable one
                    text = _token_text(t)
                    seen[text] = max(float(t.logprob), seen.get(text, -math.inf))
            except (AttributeError, IndexError, TypeError, ValueError) as err:
                raise ServerError(f"{self.base_url}: model {self.served_model!r} sent no top_logprobs for the "
                                  f"route ({type(err).__name__}: {err}); is it an OpenAI-compatible server?") from err
            with self._lock:
                self.stats.requests += 1
                self.stats.prompt_tokens += int(getattr(getattr(response, "usage", None), "prompt_tokens", 0) or 0)
            return route_probabilities(seen, labels)

        if not prompts:
            return np.zeros((0, len(labels))), np.zeros(0)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as pool:
            rows = list(pool.map(one, prompts))
        return np.array([p for p, _ in rows]), np.array([m for _, m in rows])

    # --- generation ---------------------------------------------------------------------------
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
    ) -> list[Generation]:
        """One agent turn for each conversation, the requests in flight together (at most `concurrency`).

        `constrained` with `require_tool_call` sends `tool_choice="required"` on those rows (the
        server constrains the reply to a tool call); otherwise `"auto"`."""
        if not conversations:
            return []
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        flags = require_tool_call if isinstance(require_tool_call, list) else [require_tool_call] * len(conversations)
        if len(flags) != len(conversations):
            raise ValueError(f"require_tool_call has {len(flags)} flags for {len(conversations)} conversations")
        api_tools = normalize_tools(tools) or None
        model = self.adapter or self.served_model

        def one(row: int) -> Generation:
            request: dict[str, Any] = {
                "model": model, "messages": [api_message(m) for m in conversations[row]],
                "temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens,
                "seed": row_seed(seed, row),
            }
            if api_tools:
                request["tools"] = api_tools
                request["tool_choice"] = "required" if constrained and flags[row] else "auto"
                if self.tool_format != "json":  # the template's default; a server without trace's template
                    # (or one refusing unknown fields) is only asked for it where another format is wanted
                    request["extra_body"] = {"chat_template_kwargs": {"tool_format": self.tool_format}}
            return self._turn(request, conversations[row], tools)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            out = list(pool.map(one, range(len(conversations))))
        with self._lock:
            self.stats.calls += 1
            self.stats.seconds += time.perf_counter() - t0
        return out

    def _turn(self, request: dict[str, Any], conversation: list[Message], tools: list[dict[str, Any]]
              ) -> Generation:
        from openai import BadRequestError

        turn = sum(1 for m in conversation if m.role == "assistant")
        try:
            response = self.client.chat.completions.create(**request)
        except BadRequestError as err:  # e.g. prompt + max_tokens over the server's context: this turn fails
            with self._lock:
                self.stats.requests += 1
                self.stats.rejected += 1
            reason = f"the server rejected the turn (400): {str(err)[:300]}"
            return Generation("", Message(role="assistant", invalid=reason), 0, 0, "length")
        except Exception as err:  # the SDK's errors, after its retries
            raise ServerError(f"{self.base_url}: model {request['model']!r} did not answer: {err}") from err
        try:
            choice = response.choices[0]
            text = reply_text(choice.message.content, choice.message.tool_calls)
            usage = getattr(response, "usage", None)
            prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
            completion_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:
            raise ServerError(f"{self.base_url}: model {request['model']!r} sent an unusable reply: "
                              f"{type(err).__name__}: {err}") from err
        with self._lock:
            self.stats.requests += 1
            self.stats.prompt_tokens += prompt_tokens
            self.stats.completion_tokens += completion_tokens
        # a server may close a call cut at max_tokens and call it finished: the token count says otherwise
        cut = choice.finish_reason == "length" or completion_tokens >= request["max_tokens"]
        return Generation(text, parse_assistant(text, tools, turn=turn), prompt_tokens, completion_tokens,
                          "length" if cut else "stop")
