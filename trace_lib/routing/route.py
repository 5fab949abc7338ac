"""The router: the base model picks, per task, the capability adapter to run with (or none).

Reads the task's opening (the customer's first message), the kept capabilities with one solved
example trajectory each, `trace_lib/analyst/prompts/route.md`, and optionally an index of solved training
trajectories' openings; writes nothing, returns `RouteDecision` records. Implements the paper's
§3.4 (inference-time routing): the base model is a zero-shot classifier over label tokens, one per
candidate capability plus one for "no adapter"; `compose.apply_route` then runs the task with the
chosen adapter or with the α-weighted merge of several.

Label tokens. Candidates get " A", " B", ... and the none-label is the letter after the last
candidate. The prompt is rendered with the chat template and the assistant turn is pre-filled with
"Answer:", so the scored token is the one after "Answer:" — with a BPE tokenizer (SmolLM2, Llama,
Qwen) that is the space-prefixed letter, one token. `label_token_ids` checks this for the tokenizer
at hand and fails, naming the label, when a label is not exactly one token there.

Modes. `argmax`: the most probable label; the none-label means the base model. `top_p`: rank all
labels (the none-label included) by probability, keep the smallest prefix whose mass reaches p,
renormalise over it. The base model counts as an adapter whose delta is zero, so the none-label's
share is the weight of "no change": the adapters' weights then sum to 1 − base_weight and the merged
model is base + Σ w_c Δ_c, a convex combination of base and specialists in weight space.

Retrieval (optional). `RetrievalIndex` embeds solved training trajectories' openings (MiniLM,
`trace_lib.analyst.embed.embed_texts`); the capabilities of the k nearest (distinct, best similarity first) are the
task's candidates, so the prompt stays short when there are many adapters.

Baselines for routing quality: `oracle_route` (the built-in task families' capability tags) and
`random_route` (a seeded, per-task uniform pick).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from trace_lib.engine.chat import render_prompt
from trace_lib.analyst.embed import embed_texts
from trace_lib.analyst.prompting import load_prompt
from trace_lib.analyst.render import render_message
from trace_lib.capabilities import ORACLE_PRIORITY
from trace_lib.records import (
    NONE_ROUTE,
    Capability,
    Message,
    RouteDecision,
    RouteMode,
    Task,
    Trajectory,
)
from trace_lib.engine.compose import is_merged

ANSWER_PREFIX = "Answer:"
"""Pre-filled at the start of the assistant turn; the next token is the label."""

# --- records ------------------------------------------------------------------------------------
class RouteCandidate(BaseModel):
    """One adapter the router may choose, as the prompt shows it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    capability_id: str
    """Also the adapter's name in the Policy."""
    description: str
    example: str = ""
    """A solved trajectory where the capability was exercised correctly, rendered and clipped."""


# --- labels and prompt ----------------------------------------------------------------------------
def route_labels(n: int) -> list[str]:
    """Labels for `n` candidates plus the none-label (last): [' A', ' B', ..., next letter]."""
    if not 0 <= n <= 25:
        raise ValueError(f"the router handles 0 to 25 candidates (letters A-Z incl. the none-label), got {n}")
    return [" " + chr(ord("A") + i) for i in range(n + 1)]


def label_token_ids(tokenizer: Any, labels: Sequence[str], prefix: str = ANSWER_PREFIX) -> list[int]:
    """The token id of each label as it follows `prefix`; fails unless each is exactly one token."""
    base = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    ids = []
    for label in labels:
        full = tokenizer(prefix + label, add_special_tokens=False)["input_ids"]
        if full[: len(base)] != base or len(full) != len(base) + 1:
            raise ValueError(
                f"route label {label!r} is not a single token after {prefix!r} in this tokenizer "
                f"(tokens {full[len(base):] if full[:len(base)] == base else full}); pick other labels"
            )
        ids.append(full[-1])
    if len(set(ids)) != len(ids):
        raise ValueError(f"route labels {list(labels)} map to repeated token ids {ids}")
    return ids


def _clip(text: str, chars: int) -> str:
    text = text.strip()
    return text if len(text) <= chars else text[: chars - 1].rstrip() + "…"


def render_example(messages: Sequence[Message], chars: int = 500) -> str:
    """A trajectory's conversation (system turn left out) as a few clipped lines for the prompt."""
    lines = [render_message(m, limit=160) for m in messages if m.role != "system"]
    return _clip("\n".join(lines), chars)


def make_candidate(cap: Capability, example: Trajectory | str | None = None, chars: int = 500) -> RouteCandidate:
    """A RouteCandidate from a Capability and one solved trajectory of it (or its text)."""
    if isinstance(example, Trajectory):
        example = render_example(example.messages, chars)
    return RouteCandidate(capability_id=cap.id, description=cap.description, example=_clip(example or "", chars))


def task_opening(messages: Sequence[Message], system_chars: int = 0) -> str:
    """What the router sees of a task: the customer's first message, optionally after the first
    `system_chars` characters of the system text (0: left out — the policy text is the same for
    every task of an environment, so it carries no routing signal and only costs tokens)."""
    user = next((m.content for m in messages if m.role == "user"), "")
    system = next((m.content for m in messages if m.role == "system"), "")
    if system_chars > 0 and system:
        return f"(agent policy, start) {_clip(system, system_chars)}\n\nCustomer: {user.strip()}"
    return user.strip()


def _option(label: str, cand: RouteCandidate) -> str:
    name = cand.capability_id.replace("_", " ")
    text = f"{label.strip()}. {name}: {cand.description.strip()}"
    if cand.example:
        shown = "\n".join("   | " + line for line in cand.example.splitlines())
        text += f"\n   Example of this skill applied correctly:\n{shown}"
    return text


def route_prompt(opening: str, candidates: Sequence[RouteCandidate], task_chars: int = 1200) -> list[Message]:
    """The routing question as chat messages (one user turn; see `render_route_prompt`)."""
    labels = route_labels(len(candidates))
    options = [_option(lab, c) for lab, c in zip(labels, candidates)]
    options.append(f"{labels[-1].strip()}. {NONE_ROUTE}: the general agent, no specialist skill.")
    text = load_prompt(
        "route.md", options="\n\n".join(options), task=_clip(opening, task_chars),
        letters=", ".join(lab.strip() for lab in labels), none_label=labels[-1].strip(),
    )
    return [Message(role="user", content=text.strip())]


def render_route_prompt(tokenizer: Any, messages: Sequence[Message]) -> str:
    """Chat-template text of the routing question with the assistant turn pre-filled with 'Answer:'."""
    return render_prompt(tokenizer, list(messages), []) + ANSWER_PREFIX


# --- scoring --------------------------------------------------------------------------------------
def _unwrap(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    if tokenizer is None and hasattr(model, "model") and hasattr(model, "tokenizer"):
        return model.model, model.tokenizer  # a trace Policy
    if tokenizer is None:
        raise ValueError("pass a tokenizer, or a Policy as the model")
    return model, tokenizer


def _label_scores(model, tokenizer, prompts, labels, batch_size) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(model, "label_scores"):  # a served policy (engine.remote): the server's top log-probabilities
        if any(isinstance(p, str) for p in prompts):
            raise TypeError("a served policy scores routing questions as messages (route_prompt), not rendered text")
        return model.label_scores(prompts, labels, ANSWER_PREFIX)
    model, tokenizer = _unwrap(model, tokenizer)
    if is_merged(model):
        raise RuntimeError("routing inside compose.merged_adapters would score a merged model, not the base")
    label_ids = torch.tensor(label_token_ids(tokenizer, labels))
    texts = [p if isinstance(p, str) else render_route_prompt(tokenizer, p) for p in prompts]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    probs = np.zeros((len(encoded), len(labels)))
    mass = np.zeros(len(encoded))
    device = next(model.parameters()).device
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths, less padding
    # The base model routes: PEFT adapters are switched off while scoring (a no-op without adapters).
    off = model.disable_adapter() if hasattr(model, "peft_config") else nullcontext()
    with torch.inference_mode(), off:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(encoded[i]) for i in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, i in enumerate(rows):  # left padding: every row's last token sits at the end
                ids[j, width - len(encoded[i]):] = torch.tensor(encoded[i])
                mask[j, width - len(encoded[i]):] = 1
            positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                           position_ids=positions.to(device), logits_to_keep=1).logits
            last = logits[:, -1, :].double().cpu()  # float64 softmax: rows sum to 1 to ~1e-15
            picked = last[:, label_ids]
            probs[rows] = picked.softmax(dim=-1).numpy()
            mass[rows] = (picked.logsumexp(dim=-1) - last.logsumexp(dim=-1)).exp().numpy()
    return probs, mass


def label_probabilities(model: Any, tokenizer: Any, prompts: Sequence[str | Sequence[Message]],
                        labels: Sequence[str], batch_size: int = 8) -> np.ndarray:
    """(n_prompts, n_labels) probabilities of the label tokens at the answer position; rows sum to 1.

    `prompts`: rendered text ending in 'Answer:', or messages from `route_prompt` (rendered here).
    `model` may be a Policy (then `tokenizer` may be None). With PEFT adapters loaded they are
    disabled while scoring: the base model routes.
    """
    return _label_scores(model, tokenizer, prompts, labels, batch_size)[0]


# --- modes ------------------------------------------------------------------------------------------
def _ids(candidates: Sequence[RouteCandidate | str]) -> list[str]:
    return [c if isinstance(c, str) else c.capability_id for c in candidates]


def route_argmax(probs: Sequence[float], candidates: Sequence[RouteCandidate | str]) -> str | None:
    """The most probable label's capability; None (the base model) when the none-label wins.
    Ties go to the earlier label."""
    ids = _ids(candidates)
    if len(probs) != len(ids) + 1:
        raise ValueError(f"{len(probs)} probabilities for {len(ids)} candidates + none")
    best = int(np.argmax(np.asarray(probs)))
    return None if best == len(ids) else ids[best]


def route_top_p(probs: Sequence[float], candidates: Sequence[RouteCandidate | str], p: float) -> dict[str, float]:
    """Adapter weights: the smallest most-probable set of labels whose mass reaches `p`, renormalised.

    The none-label competes like any label; when kept, its share goes to the base model (a zero
    delta) and is left out of the dict, so the weights sum to 1 − that share. Empty dict: base model.
    """
    ids = _ids(candidates)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    arr = np.asarray(probs, dtype=float)
    if len(arr) != len(ids) + 1:
        raise ValueError(f"{len(arr)} probabilities for {len(ids)} candidates + none")
    order = sorted(range(len(arr)), key=lambda i: (-arr[i], i))
    kept, total = [], 0.0
    for i in order:
        kept.append(i)
        total += arr[i]
        if total >= p - 1e-12:
            break
    return {ids[i]: float(arr[i] / total) for i in kept if i < len(ids)}


def read_weights(probs: Sequence[float], ids: list[str], mode: RouteMode, top_p: float) -> dict[str, float]:
    """Adapter weights from a decision's probabilities: `route_argmax` or `route_top_p`."""
    if mode == "argmax":
        best = route_argmax(probs, ids)
        return {} if best is None else {best: 1.0}
    if mode == "top_p":
        return route_top_p(probs, ids, top_p)
    raise ValueError(f"route mode must be 'argmax' or 'top_p', got {mode!r}")


# --- retrieval ---------------------------------------------------------------------------------------
class RetrievalIndex:
    """Openings of solved training trajectories, embedded, with the capability each one trained."""

    def __init__(self, capability_ids: list[str], vectors: np.ndarray, embed: Callable = embed_texts) -> None:
        self.capability_ids = capability_ids
        self.vectors = vectors
        self.embed = embed

    @classmethod
    def build(cls, items: Iterable[tuple[str, str]], embed: Callable = embed_texts) -> RetrievalIndex:
        """From (capability id, opening text) pairs; `embed` returns L2-normalised rows."""
        items = list(items)
        if not items:
            raise ValueError("a retrieval index needs at least one (capability, opening) item")
        vectors = np.asarray(embed([text for _, text in items]), dtype=np.float32)
        return cls([cap for cap, _ in items], vectors, embed)

    def search(self, openings: Sequence[str], k: int, among: Collection[str] | None = None) -> list[list[str]]:
        """For each opening, up to k distinct capability ids, best similarity first (one embed call)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not openings:
            return []
        sims = np.asarray(self.embed(list(openings)), dtype=np.float32) @ self.vectors.T
        out = []
        for row in sims:
            best: dict[str, float] = {}
            for cap, s in zip(self.capability_ids, row):
                if (among is None or cap in among) and s > best.get(cap, -np.inf):
                    best[cap] = float(s)
            out.append(sorted(best, key=lambda c: (-best[c], c))[:k])
        return out

    def top_k(self, opening: str, k: int, among: Collection[str] | None = None) -> list[str]:
        """Up to k distinct capability ids, ordered by their most similar indexed opening."""
        return self.search([opening], k, among)[0]


# --- routing -----------------------------------------------------------------------------------------
def candidates_per_task(openings: Sequence[str], candidates: Sequence[RouteCandidate],
                        index: RetrievalIndex | None = None, k: int | None = None) -> list[list[RouteCandidate]]:
    """Each task's candidates: the capabilities of its k nearest indexed openings (one embedding call),
    or every candidate when there is no index or no k."""
    if index is None or k is None:
        return [list(candidates) for _ in openings]
    by_id = {c.capability_id: c for c in candidates}
    return [[by_id[c] for c in ids] for ids in index.search(list(openings), k, among=by_id)]


def route_tasks(policy: Any, openings: Sequence[str], candidates: Sequence[RouteCandidate],
                mode: RouteMode = "argmax", top_p: float = 0.9, index: RetrievalIndex | None = None,
                k: int | None = None, task_ids: Sequence[str] | None = None, batch_size: int = 8
                ) -> list[RouteDecision]:
    """Route many tasks: retrieval (one embedding call), then label scoring batched per label count."""
    per_task = candidates_per_task(openings, candidates, index, k)
    task_ids = list(task_ids) if task_ids is not None else [""] * len(openings)
    decisions: list[RouteDecision | None] = [None] * len(openings)
    for n in sorted({len(c) for c in per_task}):  # one label set per candidate count
        rows = [i for i, c in enumerate(per_task) if len(c) == n]
        labels = route_labels(n)
        prompts = [route_prompt(openings[i], per_task[i]) for i in rows]
        probs, mass = _label_scores(policy, None, prompts, labels, batch_size)
        for j, i in enumerate(rows):
            ids = _ids(per_task[i])
            decisions[i] = RouteDecision(
                task_id=task_ids[i], mode=mode, candidates=ids, labels=labels, probs=probs[j].tolist(),
                label_mass=float(mass[j]), weights=read_weights(probs[j], ids, mode, top_p),
            )
    return [d for d in decisions if d is not None]


def route_task(policy: Any, task_opening: str, candidates: Sequence[RouteCandidate], mode: RouteMode = "argmax",
               top_p: float = 0.9, index: RetrievalIndex | None = None, k: int | None = None,
               task_id: str = "") -> RouteDecision:
    """Route one task (see `route_tasks`); `policy` is a trace Policy."""
    return route_tasks(policy, [task_opening], candidates, mode, top_p, index, k, [task_id])[0]


# --- baselines --------------------------------------------------------------------------------------
def oracle_route(task: Task, capability_ids: Collection[str]) -> str | None:
    """The task's known capability tags that have an adapter, the most specific first
    (`trace_lib.capabilities.ORACLE_PRIORITY`; unlisted ids after, alphabetically)."""
    have = set(task.capability_tags) & set(capability_ids)
    rank = {c: i for i, c in enumerate(ORACLE_PRIORITY)}
    return min(have, key=lambda c: (rank.get(c, len(rank)), c)) if have else None


def random_route(task_id: str, candidates: Sequence[RouteCandidate | str], seed: int,
                 include_none: bool = True) -> str | None:
    """A uniform pick among the candidates (and the base model), fixed by (seed, task id)."""
    ids = _ids(candidates)
    n = len(ids) + (1 if include_none else 0)
    if n == 0:
        return None
    h = int.from_bytes(hashlib.sha256(f"{seed}:{task_id}".encode()).digest()[:8], "big")
    i = h % n
    return ids[i] if i < len(ids) else None
