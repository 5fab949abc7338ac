"""Multi-turn agent rollouts as GRPO samples: the glue between recorded episodes and TRL's GRPOTrainer.

Reads nothing on disk; used by the GRPO trainer in training/trainer.py (paper §3.3). TRL 1.16's
`rollout_func(prompts, trainer)` receives the generation batch's prompts — each dataset row repeated
K = num_generations times in a row — and must return `prompt_ids`, `completion_ids` and `logprobs`
per row; any other key is forwarded to the reward functions, and `env_mask` (1 = the policy's own
token) becomes the loss mask of the completion (TRL multiplies it into `completion_mask`).

One row = one episode. A dataset prompt is the key "<source>:<env seed>"; `AgentRollout` builds
the task with the source's `make_tasks`, has the K episodes of each group played on the trainer's
current model (LoRA active, eval mode, no grad) by the episode loop (`trace_lib.agent.episode`: this module
never decodes) and returns each episode's recorded `prompt_ids` and `completion_ids`, and as `env_mask` its
loss mask (`loss_mask`: the agent's tokens, less the lookup-only turns the filter drops).

Sampling logprobs are not returned (`logprobs: None`): generation and training use the same
weights, so TRL's ratio is exactly 1 at the single update per batch. With constrained decoding the
sampler draws from the grammar-masked distribution while the loss uses the model's; that is the
usual approximation of grammar-constrained RL.

Hint swap (`train.hint_fraction`, `training/hints.py`): the last round(fraction·K) samples of each
group are played from the opening with the task's expert guidance appended to its last user turn (after
a played question, the user's reply); their `prompt_ids` (what is trained) are the opening without it,
their completion the guided episode's turns, so the gradient is taken as if the policy had acted that way
unguided. A source without a `hint` function, or a task whose hint is None, plays every sample unguided.

Reference samples (`train.reference_samples`, off-policy guidance as in LUFFY arXiv 2504.14945 and ToolExpander
arXiv 2510.07737): the last r samples of each group are the task's reference solution (`TrainSource.reference`: a
synthesized environment's `solve(task)`, a target task's gold actions then its required outputs said), played through
the environment and its scripted user from the start the group's episodes take (`play_reference`). Each step's tokens
are the template's rendering of that message (`reference_turn_ids`), the tokens the policy emits when it samples the
same message, and go through the sampled turns' path (`agent.episode.apply_turn`: loss mask, lookup-only filter,
result cuts). Its reward is the environment's own; a reference short of full reward is skipped, counted
(`reference_skipped`), and its slot sampled. With `reference_when: all_failed` only groups whose sampled episodes
all failed get references, the other groups' reference slots are sampled in a second round. The off-policy tokens need no ratio of their own: with
one optimizer step per batch TRL's old log-probs are the current policy's, detached, so every token's ratio is 1
and clipping never acts; a reference token's gradient is its group's advantage times ∇log π, an advantage-weighted
cross-entropy. LUFFY's shaping f(π) = π/(π+γ) exists to lift the vanishing weight π of low-probability tokens under a
true importance ratio; at ratio 1 that weight is already 1, so no shaping is applied.

Reverse curriculum (`train.start_late`, a share R of the N = `train.iterations`): at iteration i < L =
ceil(R·N) an episode starts after the first ceil(n·(L-i)/L) of the n leading steps of the task's reference
solution (`TrainSource.reference`, `leading_steps`): its read-tool calls and what it says to the user, up
to its first write (a confirmation asked before it included), the answer it ends with left to the agent.
The environment plays them (tool results in full; the user replies to what is said), and they are part of
`prompt_ids`, so they are neither sampled nor trained; the environment's rubric sees them as the agent's.
From iteration L on, episodes are whole (if a rollout budget stops training early, possibly never). A
source without a reference, or a task whose reference starts otherwise, plays from the start. Played steps
count as the episode's turns (`max_steps`) and played calls as its tool calls (the efficiency reward's
count); `tool_choice: first` then no longer forces the agent's first own turn.

Samples (paper: "samples whose only action is a read-only lookup are filtered out"): a sample is
one agent turn, i.e. one span of mask-1 tokens. With `filter_lookup_only` a turn whose action is
only calls to read tools gets mask 0, except that an episode keeps at least its last turn.
Groups with identical rewards (paper: "dropped") get mask 0 on every token: TRL keeps them with
advantage 0, which adds nothing to the gradient but still counts their tokens in the loss
normaliser of the default `dapo` loss and so dilutes the other groups.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from trace_lib.agent.episode import Episode, leading_steps, play, play_reference, start_episode
from trace_lib.config import TrainConfig
from trace_lib.engine.compose import merged_adapters
from trace_lib.engine.policy import Policy
from trace_lib.envs.base import Environment
from trace_lib.records import Message, Task
from trace_lib.synth.rubric import item_means
from trace_lib.training import distributed
from trace_lib.training.hints import hint_from_steps, hinted_samples, with_hint



@dataclass
class TrainSource:
    """One environment the trainer draws groups from (several make a curriculum mixture)."""

    name: str
    make_env: Callable[[], Environment]
    make_tasks: Callable[[list[int]], list[Task]]
    """Tasks for a list of env seeds, one per seed, in order."""
    weight: float = 1.0
    hint: Callable[[Task], str | None] | None = None
    """Expert guidance for a task (`training/hints.py`), or None where there is none."""
    reference: Callable[[Task], Sequence[Any]] | None = None
    """A task's reference actions ({"tool", "arguments"} or {"say"} steps), for `train.start_late`."""










def preplay_count(iteration: int, iterations: int, start_late: float, n_steps: int) -> int:
    """How many of a reference's `n_steps` leading steps the environment plays before the agent's
    first turn at `iteration` (0-based) of `iterations` (`train.iterations`, the reverse curriculum of
    `train.start_late`)."""
    phase = math.ceil(round(start_late * iterations, 9))  # 0.07 * 100 is 7.000000000000001
    if n_steps <= 0 or iteration >= phase:
        return 0
    return math.ceil(n_steps * (phase - iteration) / phase)










def guidance(source: TrainSource, task: Task, played: int) -> str | None:
    """The hint of a guided episode that starts after `played` steps of the task's reference (`train.start_late`):
    the steps left to do. A hint that still lists the played lookup tells the agent to make it again (on the
    structured_data_reasoning environment SmolLM2-135M then repeated the lookup); what an episode from the start
    is told stays the source's own hint."""
    if played and source.reference is not None:
        return hint_from_steps(list(source.reference(task))[played:])
    return source.hint(task)


def _cached_guidance(cache: dict, key: tuple[str, int], source: TrainSource, task: Task) -> Callable[[int], str | None]:
    """`guidance` for the episodes of one group, by the number of steps played: one `solve` call per group and start."""
    def hint(played: int) -> str | None:
        if (key, played) not in cache:
            cache[key, played] = guidance(source, task, played)
        return cache[key, played]
    return hint


def _guide(hint: Callable[[int], str | None] | None) -> Callable[[list[Message], int], list[Message] | None] | None:
    """`start_episode`'s guide from a hint by steps played: the opening with the hint appended (`with_hint`), or
    None where the hint is None."""
    if hint is None:
        return None

    def guided(opening: list[Message], played: int) -> list[Message] | None:
        text = hint(played)
        return None if text is None else with_hint(opening, text)
    return guided










def reference_slots(group_size: int, n: int) -> list[int]:
    """Which samples (0..K-1) of a group are reference episodes (`train.reference_samples`): the last n."""
    return list(range(group_size - n, group_size)) if n > 0 else []


















def loss_mask(ep: Episode, filter_lookup_only: bool) -> list[int]:
    """The agent mask with lookup-only turns removed (keeping the episode's last turn if all are)."""
    mask = list(ep.agent_mask)
    if not filter_lookup_only or not ep.turns:
        return mask
    drop = [t for t in ep.turns if t[2]]
    if len(drop) == len(ep.turns):
        drop = drop[:-1]
    for start, end, _ in drop:
        mask[start:end] = [0] * (end - start)
    return mask


def parse_key(prompt: Any) -> tuple[str, int]:
    """The (source, env seed) a dataset prompt names ("<source>:<seed>")."""
    source, _, seed = str(prompt).rpartition(":")
    return source, int(seed)


def prompt_key(source: str, seed: int) -> str:
    return f"{source}:{seed}"


class AgentRollout:
    """TRL `rollout_func`: K multi-turn episodes per group on the trainer's current model.

    Also the place that counts rollouts in the ledger, scores episodes with the (efficiency)
    reward, closes the reward's epoch and keeps per-iteration statistics for the train log.
    """

    def __init__(self, policy: Policy, sources: Sequence[TrainSource], cfg: TrainConfig, reward: Any,
                 on_rollouts: Callable[[int], None], seed: int) -> None:
        self.policy = policy
        self.sources = {s.name: s for s in sources}
        self.cfg = cfg
        self.reward = reward
        self.on_rollouts = on_rollouts
        self.seed = seed
        self.stats: dict[int, dict[str, Any]] = {}
        """Iteration (trainer's global_step when generating) -> statistics for the log."""
        self.last: list[Episode] = []
        self.sampler: Any = None
        """A `training.lockstep.LockstepSampler` that plays each iteration's episodes together with other
        trainings' (None: played here, on `policy`)."""
        self.name = ""
        """The training's name with the sampler."""

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        iteration = int(trainer.state.global_step)
        model = self.policy.model
        was_training = model.training
        model.eval()  # no dropout while sampling; TRL switches back for the loss
        self.policy.clear_prefix_cache()  # the weights changed since the last iteration
        try:
            episodes = self._start(prompts, iteration)
            skipped, reference_s = 0, 0.0
            if self.cfg.reference_samples and self.cfg.reference_when == "always":
                t_ref = time.perf_counter()
                skipped = self._references(episodes, range(0, len(episodes), self.cfg.group_size))
                reference_s = time.perf_counter() - t_ref
            # with 'all_failed' the reference slots wait until their group's sampled episodes are scored
            later = set(reference_slots(self.cfg.group_size, self.cfg.reference_samples)) \
                if self.cfg.reference_when == "all_failed" else set()
            timing = self._play([ep for ep in episodes if not ep.reference and ep.sample not in later], iteration)
            if self.cfg.reference_samples and self.cfg.reference_when == "all_failed":
                t_ref = time.perf_counter()
                skipped = self._references(episodes, self._failed_groups(episodes))
                reference_s = time.perf_counter() - t_ref
                rest = [ep for ep in episodes if not ep.reference and not ep.env.done]
                if rest:  # the reference slots of groups with a success: sampled like the rest
                    more = self._play(rest, iteration, call=1)
                    timing = {k: v + more.get(k, 0) for k, v in timing.items()}
        finally:
            model.train(was_training)
        for ep in episodes:
            ep.env_reward, info = ep.env.reward()
            ep.rubric = info.get("rubric")
            ep.success = ep.env_reward >= 1.0
            ep.reward = float(self.reward.score(ep.env_reward, ep.success, ep.tool_calls))
        masks, dropped = self._masks(episodes)
        # with several training processes (training/distributed.py) every process sees the whole iteration
        # here, so the ledger, the efficiency threshold and the log stay the same on each
        done = distributed.gather([_summary(ep, sum(mask), drop)
                                   for ep, mask, drop in zip(episodes, masks, dropped, strict=True)])
        self.on_rollouts(len(done))
        epoch = self.reward.end_epoch([d["tool_calls"] for d in done if d["success"]])
        self.last = episodes
        extra = {} if not self.cfg.reference_samples else reference_stats(done, self.cfg.group_size, skipped)
        self.stats[iteration] = {**iteration_stats(done), **extra,
                                 "tool_calls_correct": epoch["tool_calls_correct"], "l_t": epoch["l_t"],
                                 "_timing": {**timing, "rollout_seconds": time.perf_counter() - t0,
                                             **({"reference_seconds": reference_s} if self.cfg.reference_samples
                                                else {})}}
        rewards = [ep.reward for ep in episodes]
        return {
            "prompt_ids": [ep.prompt_ids for ep in episodes],
            "completion_ids": [ep.completion_ids for ep in episodes],
            "logprobs": None,
            "env_mask": masks,
            "reward": rewards,
            "success": [ep.success for ep in episodes],
            "tool_calls": [ep.tool_calls for ep in episodes],
        }

    def _play(self, episodes: list[Episode], iteration: int, call: int = 0) -> dict[str, float]:
        """Sample the episodes to their end on the current adapter (or through the lockstep sampler)."""
        if self.sampler is not None:
            return self.sampler.play(self.name, episodes, self.cfg, iteration)
        with self._folded():
            return play(self.policy, episodes, self.cfg, seed=self.seed * 1_000_003 + iteration + 7919 * call)

    def _failed_groups(self, episodes: list[Episode]) -> list[int]:
        """The first row of each group whose sampled (played) episodes all failed."""
        k, slots = self.cfg.group_size, set(reference_slots(self.cfg.group_size, self.cfg.reference_samples))
        return [g for g in range(0, len(episodes), k)
                if all(ep.env.reward()[0] < 1.0 for ep in episodes[g:g + k] if ep.sample not in slots)]

    def _references(self, episodes: list[Episode], groups: Sequence[int]) -> int:
        """Turn the reference slots of the groups starting at `groups` into reference episodes; a slot whose
        reference fails (broken, or short of full reward) is started afresh, to be sampled. Returns how many
        references were skipped so."""
        slots = set(reference_slots(self.cfg.group_size, self.cfg.reference_samples))
        solutions: dict[tuple[str, int], list[Any]] = {}
        skipped = 0
        for g in groups:
            for i in range(g, g + self.cfg.group_size):
                ep = episodes[i]
                if ep.sample not in slots:
                    continue
                source, key = self.sources[ep.source], (ep.source, ep.seed)
                if key not in solutions:
                    solutions[key] = list(source.reference(self._tasks[key])) if source.reference else []
                steps = solutions[key][ep.preplayed:]
                if play_reference(self.policy, ep, steps, self.cfg) and ep.env.reward()[0] >= 1.0:
                    continue
                skipped += 1
                episodes[i] = self._episode(key, ep.sample, guided=False)
        return skipped

    def _episode(self, key: tuple[str, int], sample: int, guided: bool, env: Environment | None = None) -> Episode:
        """A new episode of the group `key` for sample `sample`, from the start the iteration's episodes take."""
        source, task = self.sources[key[0]], self._tasks[key]
        env = source.make_env() if env is None else env
        hint = _cached_guidance(self._hints, key, source, task) if guided and source.hint else None
        env.max_steps = min(env.max_steps, self.cfg.max_steps_per_episode)  # the trainer's cap on turns
        return start_episode(self.policy, key[0], key[1], task, sample, env, guide=_guide(hint),
                             preplay=self._preplay[key])

    def _start(self, prompts: list[Any], iteration: int = 0) -> list[Episode]:
        keys = [parse_key(p) for p in prompts]
        by_source: dict[str, list[int]] = {}
        for source, seed in dict.fromkeys(keys):  # unique, in order
            if source not in self.sources:
                raise ValueError(f"prompt names unknown source {source!r}; known: {sorted(self.sources)}")
            by_source.setdefault(source, []).append(seed)
        tasks: dict[tuple[str, int], Task] = {}
        for source, seeds in by_source.items():
            made = self.sources[source].make_tasks(seeds)
            if len(made) != len(seeds):
                raise ValueError(f"make_tasks({seeds}) for {source!r} returned {len(made)} tasks")
            tasks.update({(source, s): t for s, t in zip(seeds, made, strict=True)})
        # the hint swap guides the last of the sampled slots; the reference slots come after them
        guided = set(hinted_samples(self.cfg.group_size - self.cfg.reference_samples, self.cfg.hint_fraction))
        self._tasks, self._hints, self._preplay = tasks, {}, {}
        episodes, sample = [], 0
        for i, key in enumerate(keys):
            sample = sample + 1 if i and keys[i - 1] == key else 0
            source = self.sources[key[0]]
            env = source.make_env()
            if key not in self._preplay:
                late = lambda n: preplay_count(iteration, self.cfg.iterations, self.cfg.start_late, n)  # noqa: E731
                steps = (leading_steps(source.reference(tasks[key]), env.tool_kinds())
                         if source.reference and late(1) else [])
                self._preplay[key] = steps[:late(len(steps))]
            episodes.append(self._episode(key, sample, guided=sample in guided, env=env))
        return episodes

    fold_lora: bool = True
    """Sample with the adapter being trained folded into the base weights (`engine.compose.merged_adapters`: W + BA,
    the adapter layers off, the base weights restored bit for bit afterwards) instead of through PEFT's LoRA layers,
    whose many small extra products per decoding step are a large share of a step on a CPU
    (benchmarks/README.md: routed_lora_step, train_step). The trainer turns it off for Unsloth, whose fused LoRA
    kernels do not read PEFT's layer switches. In bf16 the folded weights round W + BA once, so the sampled tokens
    can differ from the unfolded path's in the last bits of a logit."""

    def _folded(self) -> Any:
        """The context the iteration's episodes are sampled in: the trained adapter folded in (`fold_lora`)."""
        if not (self.fold_lora and self.policy.adapter and hasattr(self.policy.model, "peft_config")):
            return nullcontext()
        return merged_adapters(self.policy.model, {self.policy.adapter: 1.0})

    drop_equal_groups: bool = True
    """Whether a group whose rewards are all equal is dropped (GRPO: no learning signal in it)."""

    def _masks(self, episodes: list[Episode]) -> tuple[list[list[int]], list[bool]]:
        """Each episode's loss mask, and whether its group was dropped (identical rewards)."""
        masks = [loss_mask(ep, self.cfg.filter_lookup_only) for ep in episodes]
        dropped = [False] * len(episodes)
        if not self.drop_equal_groups:
            return masks, dropped
        k = self.cfg.group_size
        if len(episodes) % k:
            raise ValueError(f"{len(episodes)} rollouts are not whole groups of {k}")
        for g in range(0, len(episodes), k):
            rewards = [ep.reward for ep in episodes[g:g + k]]
            if max(rewards) - min(rewards) <= 1e-9:  # no learning signal: drop the group
                for i in range(g, g + k):
                    masks[i] = [0] * len(masks[i])
                    dropped[i] = True
        return masks, dropped


def _summary(ep: Episode, trained_tokens: int, group_dropped: bool) -> dict[str, Any]:
    """What the iteration's statistics need of one scored episode (picklable, for `distributed.gather`)."""
    return {"reward": ep.reward, "success": ep.success, "hinted": ep.hinted, "env_reward": ep.env_reward,
            "rubric": ep.rubric, "tool_calls": ep.tool_calls, "agent_tokens": ep.agent_tokens,
            "trained_tokens": trained_tokens, "group_dropped": group_dropped, "preplayed": ep.preplayed,
            "reference": ep.reference}


def iteration_stats(done: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The train log's statistics of one iteration from its episodes' `_summary` rows (all processes)."""
    n = len(done)
    rewards = [d["reward"] for d in done]
    mean = sum(rewards) / n
    guided = [d for d in done if d["hinted"]]
    unguided = [d for d in done if not d["hinted"] and not d.get("reference")]
    return {
        "reward": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / max(1, n - 1)) ** 0.5,
        "success_rate": sum(d["success"] for d in done) / n,
        "hinted": len(guided),
        "success_rate_unhinted": sum(d["success"] for d in unguided) / len(unguided) if unguided else None,
        "success_rate_hinted": sum(d["success"] for d in guided) / len(guided) if guided else None,
        # share of groups dropped: every group has K episodes, so the share of episodes in one
        "frac_reward_zero_std": sum(d["group_dropped"] for d in done) / n,
        "env_score": sum(d["env_reward"] for d in done) / n,
        "rubric": item_means([d["rubric"] for d in done]) or None,
        "tool_calls": sum(d["tool_calls"] for d in done) / n,
        "preplayed_steps": sum(d.get("preplayed", 0) for d in done) / n,
        "completion_tokens": sum(d["agent_tokens"] for d in done),
        "completion_length": sum(d["agent_tokens"] for d in done) / n,
        "trained_tokens": sum(d["trained_tokens"] for d in done),
        "rollouts": n,
    }


def reference_stats(done: Sequence[dict[str, Any]], group_size: int, skipped: int) -> dict[str, Any]:
    """The train log's statistics of the reference samples (`train.reference_samples`) of one iteration: how many
    there were and were skipped, on-policy success (the sampled, unguided episodes alone), and the share of groups
    whose rewards only the references made mixed."""
    groups = [done[g:g + group_size] for g in range(0, len(done), group_size)]

    def spread(rows: Sequence[dict[str, Any]]) -> bool:
        return bool(rows) and max(r["reward"] for r in rows) - min(r["reward"] for r in rows) > 1e-9

    sampled = [d for d in done if not d.get("reference") and not d["hinted"]]
    by_reference = [spread(g) and not spread([d for d in g if not d.get("reference")]) for g in groups]
    return {"references": sum(bool(d.get("reference")) for d in done), "reference_skipped": skipped,
            "success_rate_on_policy": sum(d["success"] for d in sampled) / len(sampled) if sampled else None,
            "frac_groups_mixed_by_reference": sum(by_reference) / len(groups) if groups else None}


def trajectory_reward(prompts: list[Any], completions: list[Any], reward: list[float], **_: Any) -> list[float]:
    """TRL reward function: the reward AgentRollout computed for each episode (forwarded field)."""
    return [float(r) for r in reward]


PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def scored_mask(batch: dict[str, Any]) -> Any:
    """The completion tokens a TRL batch trains: its completion mask, times its tool mask (the
    tokens the environment wrote) when it has one."""
    return batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]


def drop_masked_rows(inputs: dict[str, Any]) -> dict[str, Any] | None:
    """A TRL micro-batch without the episodes whose loss mask is empty, padding columns trimmed.

    Such rows (dropped groups, or whole episodes filtered out) add exactly zero to the loss and
    its gradient, yet cost a full forward and backward pass; on CPU that is most of an iteration.
    Returns None when no row is left. Everything else (num_items_in_batch included) is unchanged.
    """
    import torch

    mask = scored_mask(inputs)
    keep = mask.sum(-1) > 0
    if bool(keep.all()):
        return inputs
    if not bool(keep.any()):
        return None
    rows, width = keep.numel(), mask.shape[1]
    out = {k: v[keep] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows else v
           for k, v in inputs.items()}
    start = int(out["prompt_mask"].any(0).nonzero().min())  # prompts are left-padded
    end = int(out["completion_mask"].any(0).nonzero().max()) + 1  # completions right-padded
    for k, v in out.items():
        if k in PROMPT_KEYS:
            out[k] = v[:, start:]
        elif isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == (int(keep.sum()), width):
            out[k] = v[:, :end]
    return out

