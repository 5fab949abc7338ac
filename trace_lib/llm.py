"""One call layer for every LLM request the pipeline makes (analyst, synthesizer, LLM user).

Reads: the on-disk reply cache (`cache_dir`), `ANTHROPIC_API_KEY` / `ANTHROPIC_BASE_URL` (anthropic) or the
key variable `analyst.api_key_env` names (openai) from the environment. Writes: one JSON file per distinct request under `cache_dir`, and a JSONL ledger
(`ledger_path`) with one row per call: tokens, estimated cost, retries taken, and the error of a
call that failed.

Backends (paper §3.1 uses an analyst LLM; which one is a parameter here):

    anthropic   Claude through the official SDK. The system prompt is sent as a cached block
                (prompt caching: the long shared prefix is billed once per 5 minutes). Retries on
                408/409/429/5xx, timeouts and dropped connections are the SDK's own (`max_retries`,
                exponential backoff that honours `retry-after`); a 2xx whose body is not a whole
                JSON message (cut off mid-way) is retried the same way. After the last retry the call
                fails with an `LLMError` that says what happened.
    openai      any OpenAI-compatible Chat Completions server (vLLM, SGLang, a hosted API) through the
                official `openai` SDK, at `base_url`. Retries are the SDK's (408/409/429/5xx, timeouts,
                dropped connections); a 2xx whose body is cut short, is not a completion, or holds an
                empty reply is retried the same way. A reply with a schema asks for it with
                `response_format` (`analyst.response_format: json_schema`), and is validated either way.
    local       any HF instruct model folder, run through the project's policy code
                (`trace_lib.engine.policy`), greedy unless a temperature is given.
    rules       not an LLM: discover/label dispatch to `trace_lib.analyst.detectors` instead. Asking this
                client for a completion is an error that says so.

`analyst_client` builds the client that params.yaml's `analyst` section asks for (None for `rules`);
`resolve_analyst` says which backend 'auto' means there.

Every request is cached by sha256 of the canonical JSON of (backend, model, system, messages,
max_tokens, temperature, schema), so a rerun sends nothing and returns the same bytes. A failed call
raises an `LLMError` that starts '<backend>/<model> stage <stage> request <key[:16]>:' (the key's
prefix is the ledger row's `request` and starts the cache file's name). The API key is held only by
the SDK client; it is never part of a cache key, a cache file, the ledger or a repr, and is blanked
out of any error text a server sends back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from trace_lib.config import AnalystConfig
from trace_lib.io import atomic_write_text, dumps_json, iter_jsonl
from trace_lib.text import clean_text

log = logging.getLogger(__name__)

BACKENDS = ("anthropic", "openai", "local", "rules")

# USD per million tokens (input, output); cache writes cost 1.25x input, cache reads 0.1x input.
# Matched by prefix of the model name; unknown models get no estimate rather than a wrong one.
PRICES: dict[str, tuple[float, float]] = {
    "claude-opus-4-5": (5.0, 25.0),
    "claude-opus-4-1": (15.0, 75.0),
    "claude-opus-4": (15.0, 75.0),
    "claude-sonnet-4": (3.0, 15.0),
    "claude-3-7-sonnet": (3.0, 15.0),
    "claude-haiku-4-5": (1.0, 5.0),
    "claude-3-5-haiku": (0.8, 4.0),
}


class LLMError(RuntimeError):
    """An LLM call that could not produce a usable reply (after retries / one re-ask)."""


class BadReply(httpx.RequestError):
    """A 2xx reply the openai backend cannot use (cut short, not a completion, empty): an httpx request error, so
    the SDK retries it like a dropped connection; then an LLMError."""


@dataclass(frozen=True)
class LLMReply:
    text: str
    input_tokens: int
    output_tokens: int
    cached: bool


def resolve_backend(name: str, *, announce: bool = True, base_url: str | None = None) -> str:
    """Map 'auto' to 'anthropic' when ANTHROPIC_API_KEY is set, else to 'openai' when a server is configured
    (`base_url`), else to 'rules'; check other names.

    Says which backend it chose (on stderr) without ever showing the key.
    """
    if name == "auto":
        if os.environ.get("ANTHROPIC_API_KEY"):
            chosen, why = "anthropic", "ANTHROPIC_API_KEY is set"
        elif base_url:
            chosen, why = "openai", f"ANTHROPIC_API_KEY is not set; analyst.base_url is {base_url}"
        else:
            chosen, why = "rules", "ANTHROPIC_API_KEY is not set and no analyst.base_url"
        if announce:
            print(f"analyst backend: auto -> {chosen} ({why})", file=sys.stderr)
        return chosen
    if name not in BACKENDS:
        raise ValueError(f"analyst backend: unknown backend {name!r}; choose 'auto' or one of {list(BACKENDS)}")
    return name


def request_key(backend: str, model: str, system: str, messages: list[dict], max_tokens: int,
                temperature: float, schema: dict | None = None) -> str:
    """sha256 of the canonical JSON of everything that determines a reply."""
    payload = {"backend": backend, "model": model, "system": system, "messages": messages,
               "max_tokens": max_tokens, "temperature": temperature, "schema": schema}
    return hashlib.sha256(dumps_json(payload).encode("utf-8")).hexdigest()


def resolve_analyst(cfg: AnalystConfig, *, announce: bool = True) -> str:
    """The backend the `analyst` section means ('auto' resolved with its `base_url`)."""
    return resolve_backend(cfg.backend, announce=announce, base_url=cfg.base_url)


def estimate_cost(model: str, input_tokens: int, output_tokens: int,
                  cache_write: int = 0, cache_read: int = 0,
                  prices: dict[str, tuple[float, float]] | None = None) -> float | None:
    """Estimated USD for one call, or None for a model without a known price (`prices`, by model-name
    prefix, on top of `PRICES`)."""
    for prefix, (p_in, p_out) in sorted({**PRICES, **(prices or {})}.items(), key=lambda kv: -len(kv[0])):
        if model.startswith(prefix):
            return (input_tokens * p_in + output_tokens * p_out
                    + cache_write * 1.25 * p_in + cache_read * 0.1 * p_in) / 1e6
    return None


def extract_json(text: str) -> Any:
    """The JSON value in a reply: the whole text, a ```json fence, or the outermost {...} / [...]."""
    candidates = [text.strip()]
    fence = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    if fence:
        candidates.append(fence.group(1).strip())
    for open_, close in (("{", "}"), ("[", "]")):
        i, j = text.find(open_), text.rfind(close)
        if 0 <= i < j:
            candidates.append(text[i:j + 1])
    last_err = "empty reply"
    for cand in candidates:
        try:
            return json.loads(cand)
        except json.JSONDecodeError as err:
            last_err = f"{err.msg} at line {err.lineno} column {err.colno}"
    raise ValueError(f"not valid JSON ({last_err})")


_TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,),
                                        "integer": (int,), "number": (int, float), "boolean": (bool,),
                                        "null": (type(None),)}


def schema_errors(value: Any, schema: dict, where: str = "") -> list[str]:
    """Where `value` breaks `schema`, for the JSON Schema subset the analyst uses: type, enum,
    const, required, properties, additionalProperties, items, min/maxItems, minLength. Other
    keywords are ignored. (Written here: jsonschema's import alone takes seconds.)"""
    at = where or "(top level)"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        ok = any(isinstance(value, _TYPES.get(k, ())) and not (k in ("integer", "number") and isinstance(value, bool))
                 for k in kinds)
        if not ok:
            return [f"at {at}: expected {' or '.join(kinds)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"at {at}: {value!r} is not one of {schema['enum']}"]
    if "const" in schema and value != schema["const"]:
        return [f"at {at}: expected {schema['const']!r}"]
    errors: list[str] = []
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        errors.append(f"at {at}: shorter than {schema['minLength']} characters")
    if isinstance(value, dict):
        errors += [f"at {at}: missing required key {k!r}" for k in schema.get("required", []) if k not in value]
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key in value:
                errors += schema_errors(value[key], sub, f"{where}/{key}" if where else key)
        if schema.get("additionalProperties") is False:
            errors += [f"at {at}: unexpected key {k!r}" for k in value if k not in props]
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"at {at}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"at {at}: more than {schema['maxItems']} items")
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += schema_errors(item, schema["items"], f"{where}/{i}" if where else str(i))
    return errors


def validate_json(value: Any, schema: dict) -> None:
    """Raise ValueError naming the first place `value` breaks `schema`."""
    errors = schema_errors(value, schema)
    if errors:
        raise ValueError(f"does not match the schema {errors[0]}")


def ledger_totals(path: str | Path) -> dict[str, dict[str, float]]:
    """Per-stage sums from a ledger file: calls, cache hits, failed calls (`errors`), the retries
    they took, and the tokens and estimated cost of the requests actually sent (a cache hit costs
    nothing)."""
    totals: dict[str, dict[str, float]] = {}
    if not Path(path).exists():
        return totals
    for row in iter_jsonl(path):
        t = totals.setdefault(row.get("stage") or "", {"calls": 0, "cache_hits": 0, "errors": 0, "retries": 0,
                                                       "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0})
        t["calls"] += 1
        t["retries"] += row.get("retries", 0)
        t["errors"] += bool(row.get("error"))
        if row.get("cached"):
            t["cache_hits"] += 1
            continue
        t["input_tokens"] += row.get("input_tokens", 0)
        t["output_tokens"] += row.get("output_tokens", 0)
        t["cost_usd"] += row.get("cost_usd") or 0.0
    return totals


class LLMClient:
    """A cached, ledgered LLM; see the module docstring for backends and caching."""

    def __init__(self, backend: str, model: str, cache_dir: Path, ledger_path: Path | None = None, *,
                 max_retries: int = 4, timeout: float = 120.0, base_url: str | None = None,
                 seed: int = 0, api_key: str | None = None, send_temperature: bool = True,
                 api_key_env: str = "OPENAI_API_KEY", response_format: str = "json_schema",
                 prices: dict[str, tuple[float, float]] | None = None) -> None:
        self.backend = resolve_backend(backend, base_url=base_url)
        self.model = model
        self.cache_dir = Path(cache_dir)
        self.ledger_path = Path(ledger_path) if ledger_path is not None else None
        self.max_retries = max_retries
        self.timeout = timeout
        self.base_url = base_url
        self.seed = seed
        self.send_temperature = send_temperature
        """The SDK no longer has a `temperature` argument (some models reject sampling parameters);
        when True it is sent in the request body, when False the model's default applies."""
        self.api_key_env = api_key_env
        """openai backend: the environment variable holding the key (read on the first request)."""
        self.response_format = response_format
        """openai backend: 'json_schema' sends a reply's schema as `response_format`; 'text' does not."""
        self.prices = dict(prices or {})
        self.requests_sent = 0
        """Requests that reached a backend (cache misses); tests and notebooks read it."""
        self._api_key = api_key
        self._attempt = threading.local()  # `.retries` of the call in flight on this thread
        self._sdk = None
        self._policy = None
        self._ledger: list[dict] | None = None

    def __repr__(self) -> str:  # never shows the key
        return f"LLMClient(backend={self.backend!r}, model={self.model!r}, cache_dir={str(self.cache_dir)!r})"

    # --- public ---------------------------------------------------------------------------------
    def complete(self, system: str, messages: list[dict], *, max_tokens: int, temperature: float = 0.0,
                 stage: str = "") -> LLMReply:
        """One reply to `messages` (list of {"role", "content"}), from the cache when seen before."""
        return self._call(system, messages, max_tokens, temperature, None, stage)

    def complete_json(self, system: str, messages: list[dict], schema: dict, *, max_tokens: int,
                      temperature: float = 0.0, stage: str = "") -> Any:
        """A reply parsed as JSON and validated against `schema`; re-asks once, then LLMError."""
        reply = self._call(system, messages, max_tokens, temperature, schema, stage)
        try:
            return self._parse(reply.text, schema)
        except ValueError as err:
            first_err = str(err)
        key = request_key(self.backend, self.model, system, messages, max_tokens, temperature, schema)
        retry = list(messages) + [
            {"role": "assistant", "content": reply.text or "(empty)"},
            {"role": "user", "content": f"That reply was {first_err}. Answer again with only one JSON "
                                        f"value that matches this JSON Schema, no prose:\n{dumps_json(schema)}"},
        ]
        reply2 = self._call(system, retry, max_tokens, temperature, schema, stage)
        try:
            return self._parse(reply2.text, schema)
        except ValueError as err:
            raise LLMError(f"{self._where(stage, key)}: reply {err} after one re-ask "
                           f"(first reply: {first_err}); reply starts {reply2.text[:200]!r}") from None

    # --- internals ------------------------------------------------------------------------------
    def _where(self, stage: str, key: str) -> str:
        return f"{self.backend}/{self.model} stage {stage or '-'} request {key[:16]}"

    @staticmethod
    def _parse(text: str, schema: dict) -> Any:
        value = extract_json(text)
        validate_json(value, schema)
        return value

    def _call(self, system: str, messages: list[dict], max_tokens: int, temperature: float,
              schema: dict | None, stage: str) -> LLMReply:
        if self.backend == "rules":
            raise LLMError("the 'rules' analyst is not an LLM: discover/label run trajectory detectors "
                           "(trace_lib.analyst.detectors) instead; choose analyst.backend 'anthropic', 'openai' or "
                           "'local' "
                           "for free-text completions")
        key = request_key(self.backend, self.model, system, messages, max_tokens, temperature, schema)
        path = self.cache_dir / key[:2] / f"{key}.json"
        if path.exists():
            try:
                row = json.loads(path.read_text(encoding="utf-8"))
                reply = LLMReply(row["text"], row["input_tokens"], row["output_tokens"], cached=True)
                self._record(stage, key, reply, 0, 0)
                return reply
            except (json.JSONDecodeError, KeyError):
                log.warning("ignoring unreadable cache file %s", path)
        self._attempt.retries = 0
        try:
            if self.backend == "anthropic":
                text, n_in, n_out, c_write, c_read = self._anthropic(system, messages, max_tokens, temperature)
            elif self.backend == "openai":
                text, n_in, n_out, c_write, c_read = self._openai(system, messages, max_tokens, temperature, schema)
            else:
                text, n_in, n_out, c_write, c_read = self._local(system, messages, max_tokens, temperature)
        except LLMError as err:
            failed = LLMError(f"{self._where(stage, key)}: {err}")
            self._record(stage, key, LLMReply("", 0, 0, cached=False), 0, 0, error=str(failed))
            raise failed from None
        self.requests_sent += 1
        text = clean_text(text)  # untrusted: e.g. a `\ud800` escape in the reply body decodes to unencodable text
        reply = LLMReply(text, n_in, n_out, cached=False)
        atomic_write_text(path, dumps_json({"backend": self.backend, "model": self.model, "text": text,
                                            "input_tokens": n_in, "output_tokens": n_out}) + "\n")
        self._record(stage, key, reply, c_write, c_read)
        return reply

    def _on_attempt(self, request: Any, call_next: Any) -> Any:
        """SDK middleware, run once per HTTP attempt inside the SDK's retry loop: notes the retries
        taken so far (for the ledger), and has a 2xx whose body is not a whole JSON message (the
        connection or a proxy cut it mid-way) retried with backoff like a dropped connection."""
        import anthropic

        self._attempt.retries = request.retries_taken
        response = call_next(request)
        if response.http_response.is_success:
            try:
                body = response.http_response.json()
            except ValueError as err:
                raise anthropic.RetryableError(f"reply body is not valid JSON ({err}; "
                                               f"{len(response.http_response.content)} bytes)") from None
            if not isinstance(body, dict) or not isinstance(body.get("content"), list):
                raise anthropic.RetryableError("reply body is JSON but not a message (no 'content' list)")
        return response

    def _anthropic(self, system: str, messages: list[dict], max_tokens: int,
                   temperature: float) -> tuple[str, int, int, int, int]:
        import anthropic

        if self._sdk is None:
            key = self._api_key or os.environ.get("ANTHROPIC_API_KEY")
            if not key:
                raise LLMError("anthropic backend: ANTHROPIC_API_KEY is not set")
            kwargs: dict[str, Any] = {"api_key": key, "max_retries": self.max_retries, "timeout": self.timeout,
                                      "middleware": [self._on_attempt]}
            if self.base_url:
                kwargs["base_url"] = self.base_url
            self._sdk = anthropic.Anthropic(**kwargs)
        # A cached system block: the analyst's long instructions are shared by every call of a stage.
        system_blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}] if system else []
        extra = {"temperature": temperature} if self.send_temperature else None
        try:
            msg = self._sdk.messages.create(model=self.model, system=system_blocks, messages=messages,
                                            max_tokens=max_tokens, extra_body=extra)
        except anthropic.APIStatusError as err:
            retried = err.status_code in (408, 409, 429) or err.status_code >= 500
            when = f"after {self._attempt.retries} retries" if retried else "(not retryable)"
            raise LLMError(f"HTTP {err.status_code} {when}: {self._redact(err.message)}") from None
        except anthropic.APITimeoutError:
            raise LLMError(f"timed out ({self.timeout} s) after {self._attempt.retries} retries") from None
        except anthropic.APIConnectionError as err:
            # The SDK's own text is a bare "Connection error."; the cause says what broke.
            cause = f" ({err.__cause__})" if err.__cause__ else ""
            raise LLMError(f"connection failed after {self._attempt.retries} retries: "
                           f"{self._redact(f'{err}{cause}')}") from None
        except anthropic.RetryableError as err:
            raise LLMError(f"{self._redact(str(err))} after {self._attempt.retries} retries") from None
        except anthropic.AnthropicError as err:
            raise LLMError(f"{type(err).__name__}: {self._redact(str(err))}") from None
        text = "".join(getattr(b, "text", "") for b in msg.content if getattr(b, "type", "") == "text")
        u = msg.usage
        return (text, int(u.input_tokens or 0), int(u.output_tokens or 0),
                int(getattr(u, "cache_creation_input_tokens", 0) or 0),
                int(getattr(u, "cache_read_input_tokens", 0) or 0))

    def _openai_hooks(self) -> dict[str, list]:
        """httpx event hooks, run once per HTTP attempt inside the SDK's retry loop: the attempt count (for the
        ledger), and a 2xx whose body is cut short, is not a completion or holds an empty reply raised inside the
        attempt, so that the SDK retries it with backoff like a dropped connection."""
        def on_request(request: Any) -> None:
            self._attempt.sent = getattr(self._attempt, "sent", 0) + 1
            self._attempt.retries = self._attempt.sent - 1

        def on_response(response: Any) -> None:
            if not response.is_success:
                return
            response.read()  # a body cut short raises here, inside the attempt
            try:
                body = response.json()
            except ValueError as err:
                raise BadReply(f"reply body is not valid JSON ({err}; {len(response.content)} bytes)",
                               request=response.request) from None
            choices = body.get("choices") if isinstance(body, dict) else None
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                raise BadReply("reply body is JSON but not a completion (no 'choices')", request=response.request)
            message = choices[0].get("message") or {}
            if not (message.get("content") or "").strip():
                raise BadReply(f"empty reply (finish_reason {choices[0].get('finish_reason')!r})",
                               request=response.request)

        return {"request": [on_request], "response": [on_response]}

    def _openai(self, system: str, messages: list[dict], max_tokens: int, temperature: float,
                schema: dict | None) -> tuple[str, int, int, int, int]:
        import openai

        if self._sdk is None:
            key = self._api_key or os.environ.get(self.api_key_env) or "no-key"  # a server without a key
            http = httpx.Client(timeout=self.timeout, event_hooks=self._openai_hooks())
            self._sdk = openai.OpenAI(api_key=key, base_url=self.base_url, max_retries=self.max_retries,
                                      timeout=self.timeout, http_client=http)
        self._attempt.sent = 0
        turns = ([{"role": "system", "content": system}] if system else []) + list(messages)
        kwargs: dict[str, Any] = {"temperature": temperature} if self.send_temperature else {}
        if schema is not None and self.response_format == "json_schema":
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
        try:
            out = self._sdk.chat.completions.create(model=self.model, messages=turns, max_tokens=max_tokens, **kwargs)
        except openai.APIStatusError as err:
            retried = err.status_code in (408, 409, 429) or err.status_code >= 500
            when = f"after {self._attempt.retries} retries" if retried else "(not retryable)"
            raise LLMError(f"HTTP {err.status_code} {when}: {self._redact(err.message)}") from None
        except openai.APITimeoutError:
            raise LLMError(f"timed out ({self.timeout} s) after {self._attempt.retries} retries") from None
        except openai.APIConnectionError as err:
            cause = err.__cause__
            what = str(cause) if isinstance(cause, BadReply) else f"connection failed ({cause or err})"
            raise LLMError(f"{self._redact(what)} after {self._attempt.retries} retries") from None
        except openai.OpenAIError as err:
            raise LLMError(f"{type(err).__name__}: {self._redact(str(err))}") from None
        text = out.choices[0].message.content or ""
        usage = out.usage
        return (text, int(getattr(usage, "prompt_tokens", 0) or 0), int(getattr(usage, "completion_tokens", 0) or 0),
                0, int(getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", 0) or 0))

    def _local(self, system: str, messages: list[dict], max_tokens: int,
               temperature: float) -> tuple[str, int, int, int, int]:
        if self._policy is None:
            from trace_lib.engine.policy import (
                load_policy,  # heavy (torch); only when a local analyst is used
            )

            self._policy = load_policy(self.model)
        from trace_lib.records import Message

        turns = ([{"role": "system", "content": system}] if system else []) + list(messages)
        conversation = [Message(role=m["role"], content=str(m.get("content", ""))) for m in turns]
        out = self._policy.generate([conversation], tools=[], temperature=temperature, top_p=1.0,
                                    max_new_tokens=max_tokens, seed=self.seed, constrained=False)[0]
        return (out.text, int(getattr(out, "prompt_tokens", 0) or 0),
                int(getattr(out, "completion_tokens", 0) or 0), 0, 0)

    def _redact(self, text: str) -> str:
        """`text` shortened, with the API key blanked out should a server or proxy echo it."""
        text = _short(text)
        for secret in {self._api_key, os.environ.get("ANTHROPIC_API_KEY"), os.environ.get(self.api_key_env)} - {None, ""}:
            text = text.replace(secret, "[redacted]")
        return text

    def _record(self, stage: str, key: str, reply: LLMReply, cache_write: int, cache_read: int,
                error: str | None = None) -> None:
        if self.ledger_path is None:
            return
        if self._ledger is None:
            self._ledger = list(iter_jsonl(self.ledger_path)) if self.ledger_path.exists() else []
        cost = 0.0 if reply.cached or error else estimate_cost(self.model, reply.input_tokens, reply.output_tokens,
                                                               cache_write, cache_read, self.prices)
        row = {"stage": stage, "backend": self.backend, "model": self.model, "request": key[:16],
               "cached": reply.cached, "input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens,
               "cache_write_tokens": cache_write, "cache_read_tokens": cache_read, "cost_usd": cost,
               "retries": 0 if reply.cached else getattr(self._attempt, "retries", 0)}
        if error:
            row["error"] = error
        self._ledger.append(row)
        # Rewritten whole and atomically: an interrupted run leaves the previous complete ledger.
        atomic_write_text(self.ledger_path, "".join(dumps_json(r) + "\n" for r in self._ledger))


def analyst_client(cfg: AnalystConfig, ledger_path: Path | None, root: Path = Path("."),
                   seed: int = 0) -> LLMClient | None:
    """The LLM behind the analyst, or None for the rules analyst ('auto' says which it picked)."""
    backend = resolve_analyst(cfg)
    if backend == "rules":
        return None
    model = str(root / cfg.local_model) if backend == "local" else cfg.model
    return LLMClient(backend, model, root / cfg.cache_dir, ledger_path, max_retries=cfg.max_retries,
                     timeout=cfg.timeout_s, seed=seed, send_temperature=cfg.send_temperature,
                     base_url=cfg.base_url if backend == "openai" else None, api_key_env=cfg.api_key_env,
                     response_format=cfg.response_format, prices=cfg.prices)


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."
