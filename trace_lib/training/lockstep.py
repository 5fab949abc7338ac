"""Several GRPO trainings in lockstep: each round, the iteration's episodes of every training decoded in one batch.

Used by the train stage (`train.lockstep`) for the capability adapters and the baselines, which train
independently of one another; reads and writes nothing itself.

Why: a decoding step on a CPU costs nearly as much for one row as for eight, and an iteration spends many of
its decoding steps on the few rows of its longest episodes; played together, a step carries rows of every
training (benchmarks/README.md: train_lockstep.py).

How: each training runs TRL's loop unchanged in a thread of its own (`run_lockstep`), but only one thread
runs at a time: it holds the sampler's lock, and lets go of it only while it waits for a round. A
training's rollout function hands its iteration's episodes to `LockstepSampler.play`. Once every expected
training has handed its in, one thread plays them all (`agent.episode.play`) on the sampler's policy: one more copy
of the base model, which holds every training's LoRA weights (the same tensors, attached under the
training's name), each episode decoded under its own training's adapter (per-row routes,
`engine/row_lora.py`). Then the trainings take their updates one after another. A training is expected from
its start (once the trainings it waits for are done) to its end. So which episodes share a round depends
on the schedule alone, not on thread timing, and the same seed gives the same bytes.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import hashlib
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from trace_lib.config import TrainConfig
from trace_lib.io import dumps_json
from trace_lib.agent.episode import Episode, play

T = TypeVar("T")

SHARED_KEYS = ("max_new_tokens", "constrained", "tool_choice", "tool_result_tokens", "continuous_batching",
               "groups", "group_size", "micro_batch", "shared_prompt", "dtype")
"""The train settings a round's trainings must share. The first five: the round's episodes are decoded in one
call (each training samples at its own `temperature`). The last five set TRL's gradient accumulation steps,
which Accelerate keeps in one process-wide state: every training must wait for its round at the same
micro-step. `micro_batch: 0` picks the rollouts per loss pass from `shared_prompt` and, on a CPU, the training
dtype (`trainer._micro_batch`), so those two count as well."""

PLACEHOLDER = "_lockstep"
"""The sampling model's own adapter (PEFT needs one to wrap a model); no episode is decoded under it."""


class LockstepAborted(RuntimeError):
    """Raised in the other trainings when one of them failed: none of them can go on alone."""


@dataclass(frozen=True)
class LockstepJob(Generic[T]):
    """One training: `run(sampler)` trains it (passing the sampler to `train_adapter_mixture`) and returns its
    result; it starts once every job named in `after` has finished."""

    name: str
    run: Callable[[LockstepSampler], T]
    after: tuple[str, ...] = ()


@contextmanager
def _grad_flags_kept(models: Sequence[Any]) -> Iterator[None]:
    """Restore every parameter's `requires_grad` of `models` on exit: PEFT marks only a model's active adapter
    trainable when adapters are added or deleted, and the sampling model shares the trainings' LoRA tensors."""
    flags = [(p, p.requires_grad) for m in models for p in m.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class LockstepSampler:
    """The trainings' shared sampling: rounds of episodes from every expected training (module docstring).

    `make_policy()` loads the sampling policy's base model (once, when the first training attaches); a round's
    decoding is seeded by `seed` and the (training, iteration) pairs it plays (`round_seed`).

    Each training keeps its own random streams: the process-wide ones (torch, Python, NumPy) are saved when a
    training hands in and restored when it goes on. TRL draws a permutation of the batch's rows from torch's
    right after the rollout function returns, and the threads go on in whatever order the lock gives them;
    without this, which training got which draw would depend on thread timing."""

    def __init__(self, make_policy: Callable[[], Any], seed: int) -> None:
        self._make_policy = make_policy
        self.seed = seed
        self.policy: Any = None
        self.rounds = 0
        """Rounds played so far."""
        self._cond = threading.Condition()  # re-entrant: a training's thread holds it while it trains
        self._order: dict[str, int] = {}
        self._models: dict[str, Any] = {}
        self._expected: set[str] = set()
        self._waiting_for: dict[str, set[str]] = {}
        self._handed: dict[str, tuple[list[Episode], TrainConfig, int]] = {}
        self._timing: dict[str, dict[str, Any]] = {}
        self._failed: str | None = None

    # --- the trainings' weights -------------------------------------------------------------------
    def attach(self, name: str, model: Any) -> None:
        """Make training `name`'s LoRA weights (adapter 'default' of its PEFT `model`) adapter `name` of the
        sampling model: the same tensors, so a round decodes with the weights as the training left them."""
        from peft import get_peft_model
        from peft.tuners.lora import LoraLayer

        config = model.peft_config["default"]
        with self._cond, _grad_flags_kept(list(self._models.values()) + [model]), torch.random.fork_rng():
            if self.policy is None:
                self.policy = self._make_policy()
                self.policy.model = get_peft_model(self.policy.model, copy.deepcopy(config), adapter_name=PLACEHOLDER)
                self.policy.model.requires_grad_(False).eval()
            if not self.policy.plays_turns:
                raise ValueError("train.lockstep decodes with Policy.play_turns, which this model's sliding-window "
                                 "layers do not allow; set train.lockstep: false")
            target = self.policy.model
            target.add_adapter(name, copy.deepcopy(config))  # fresh weights, replaced by the training's below
            try:
                theirs = dict(model.named_modules())
                for key, layer in target.named_modules():
                    if isinstance(layer, LoraLayer) and name in layer.lora_A:
                        if key not in theirs:
                            raise ValueError(f"training {name!r} has no module {key!r}: its model is not the "
                                             "sampler's")
                        layer.lora_A[name] = theirs[key].lora_A["default"]
                        layer.lora_B[name] = theirs[key].lora_B["default"]
            except BaseException:
                target.delete_adapter(name)
                raise
            self._models[name] = model

    def detach(self, name: str) -> None:
        """Remove training `name`'s adapter from the sampling model (nothing when it has none)."""
        with self._cond:
            model = self._models.pop(name, None)
            if model is None or self.policy is None:
                return
            with _grad_flags_kept(list(self._models.values()) + [model]):
                self.policy.model.delete_adapter(name)

    # --- rounds -------------------------------------------------------------------------------------
    def play(self, name: str, episodes: Sequence[Episode], cfg: TrainConfig, iteration: int) -> dict[str, Any]:
        """Hand in training `name`'s episodes of its `iteration` (0-based) and return once the round is played
        (the episodes then played to their ends), with the round's timings. A round is seeded by the
        (training, iteration) pairs it plays (`round_seed`), so a lockstep resumed from one round's
        checkpoints (`resume_points`) decodes as the uninterrupted one did."""
        with self._cond:
            if name not in self._expected or name not in self._models:
                raise RuntimeError(f"training {name!r} is not running in this lockstep (expected: "
                                   f"{sorted(self._expected)}, attached: {sorted(self._models)})")
            if name in self._handed:
                raise RuntimeError(f"training {name!r} handed in twice in round {self.rounds}")
            self._handed[name] = (list(episodes), cfg, iteration)
            streams = _random_states()
            release_free_memory()  # what this training's last update freed, before the others run
            round_ = self.rounds
            try:
                while self.rounds == round_:
                    if self._failed:
                        raise LockstepAborted(f"round {round_} not played: {self._failed}")
                    if self._expected <= self._handed.keys():
                        self._play_round()
                    else:
                        self._cond.wait()
            finally:
                _set_random_states(streams)
            return self._timing.pop(name)

    def _play_round(self) -> None:
        names = sorted(self._handed, key=self._order.__getitem__)
        cfg = self._handed[names[0]][1]
        for n in names[1:]:
            other = self._handed[n][1]
            differ = [k for k in SHARED_KEYS if getattr(other, k) != getattr(cfg, k)]
            if differ:
                raise ValueError(f"trainings {names[0]!r} and {n!r} differ in {differ}: one round decodes both")
        episodes = [ep for n in names for ep in self._handed[n][0]]
        adapters = [n for n in names for _ in self._handed[n][0]]
        self.policy.clear_prefix_cache()  # the weights changed since the last round
        seed = round_seed(self.seed, [(n, self._handed[n][2]) for n in names])
        set_mmap_threshold(DECODING_MMAP_THRESHOLD)
        try:
            timing = play(self.policy, episodes, cfg, seed=seed, adapters=adapters,
                          temperatures={n: self._handed[n][1].temperature for n in names})
        finally:
            set_mmap_threshold(UPDATE_MMAP_THRESHOLD)
        shared = {**timing, "lockstep_round": self.rounds, "lockstep_trainings": len(names),
                  "lockstep_episodes": len(episodes)}
        self._timing.update({n: dict(shared) for n in names})
        self._handed.clear()
        self.rounds += 1
        self._cond.notify_all()

    # --- the schedule --------------------------------------------------------------------------------
    def _start_schedule(self, jobs: Sequence[LockstepJob]) -> None:
        self._order = {j.name: i for i, j in enumerate(jobs)}
        self._expected = {j.name for j in jobs if not j.after}
        self._waiting_for = {j.name: set(j.after) for j in jobs if j.after}

    def _finish(self, name: str, error: BaseException | None) -> None:
        """Training `name` ended (with `error`, or done): it is no longer expected, the trainings that waited
        for it may start, and its adapter leaves the sampling model."""
        with self._cond:
            if error is not None and self._failed is None:
                self._failed = f"training {name!r} failed: {error!r}"
            self._expected.discard(name)
            self._handed.pop(name, None)
            for job, deps in list(self._waiting_for.items()):
                deps.discard(name)
                if not deps:
                    del self._waiting_for[job]
                    self._expected.add(job)
            try:
                self.detach(name)
            except BaseException as exc:
                self._failed = self._failed or f"training {name!r}'s adapter could not leave the sampler: {exc!r}"
                raise
            finally:
                self._cond.notify_all()


def round_seed(seed: int, plays: Sequence[tuple[str, int]]) -> int:
    """The seed of a round that plays these (training, iteration) pairs: the same round after a resume draws as
    the uninterrupted one, and no two rounds of a run share a seed."""
    digest = hashlib.sha256(dumps_json([seed, [list(p) for p in plays]]).encode()).digest()
    return int.from_bytes(digest[:8], "big") % 2**62


def _random_states() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _set_random_states(states: tuple[Any, ...]) -> None:
    cpu, cuda, py, npy = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)


def resume_points(latest: Mapping[str, int], final: Mapping[str, int], first: Mapping[str, int] | None = None
                  ) -> dict[str, int | None]:
    """The iteration each training in lockstep resumes from after a crash (`train_adapter_mixture`'s
    `resume_at_most`): all of them resume from one round, the newest that every unfinished training has a
    checkpoint of. `latest`: each training's newest checkpoint (0: none); `final`: its last iteration; `first`:
    the round it started in (0 where missing: a training that waited for others starts later). A kill between
    two trainings' updates of a round leaves some a checkpoint ahead; resumed each from its own newest, the
    rounds would hold other trainings than the uninterrupted run's. None: every training is done (each keeps
    its own). A training whose checkpoints were saved under another configuration starts over by itself (the
    trainer checks their fingerprint), and the rounds then differ from an uninterrupted run's."""
    first = first or {}
    going = [first.get(n, 0) + latest[n] for n in latest if latest[n] < final[n]]
    if not going:
        return dict.fromkeys(latest)
    cut = min(going)
    return {n: max(cut - first.get(n, 0), 0) for n in latest}


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its arenas are not the problem below
        return None


def _glibc(function: str, *args: Any) -> None:
    """Call glibc's `function` with `args`; nothing where the C library is not glibc or lacks it."""
    libc = _libc()
    if libc is not None and hasattr(libc, function):
        getattr(libc, function)(*args)


def share_malloc_arenas() -> None:
    """Let new threads share glibc's existing malloc arenas instead of each making its own (M_ARENA_MAX 1).

    Why: glibc gives every thread an arena, which keeps the memory the thread freed for the thread's next
    allocations, and each training's update frees a few GB of activations (benchmarks/README.md: train_lockstep).
    Only one training runs at a time, so sharing costs no contention."""
    _glibc("mallopt", ctypes.c_int(-8), ctypes.c_int(1))  # M_ARENA_MAX


DECODING_MMAP_THRESHOLD = 32 * 2**20
"""Blocks from this size get pages of their own while a round decodes and once the lockstep is over (glibc's
`M_MMAP_THRESHOLD`): 32 MB, the largest its own adjustment reaches, so a decoding step's many small tensors come
from malloc's heap, and the rest of the process (a notebook, a test session) does not pay for fresh pages."""

UPDATE_MMAP_THRESHOLD = 128 * 2**10
"""The same during the trainings' updates: 128 KB, glibc's starting value, so an update's activations are handed
back to the system as they are freed.

Why the two: with glibc's own (rising) threshold malloc keeps the freed activation blocks, and a low threshold
throughout faults in fresh pages for every decoding step's tensors (benchmarks/README.md: train_lockstep).
Setting the threshold turns glibc's adjustment off for the rest of the process."""


def set_mmap_threshold(size: int) -> None:
    """glibc's `M_MMAP_THRESHOLD`: blocks of `size` bytes or more get pages of their own, returned when freed."""
    _glibc("mallopt", ctypes.c_int(-3), ctypes.c_int(size))  # M_MMAP_THRESHOLD


def release_free_memory() -> None:
    """Hand the memory malloc holds free back to the system (glibc's `malloc_trim`, every arena)."""
    _glibc("malloc_trim", ctypes.c_size_t(0))


def run_lockstep(jobs: Sequence[LockstepJob[T]], sampler: LockstepSampler) -> list[T]:
    """Run the jobs' trainings in lockstep (module docstring); their results in the jobs' order. When one
    fails, the others stop at their next round and its error is raised here."""
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"lockstep job names must be distinct, got {names}")
    for i, job in enumerate(jobs):
        unknown = [a for a in job.after if a not in names[:i]]
        if unknown:
            raise ValueError(f"job {job.name!r} waits for {unknown}, which are not earlier jobs")
    sampler._start_schedule(jobs)
    share_malloc_arenas()
    set_mmap_threshold(UPDATE_MMAP_THRESHOLD)  # a round's decoding raises it while it runs
    results: dict[str, T] = {}
    errors: list[tuple[int, BaseException]] = []

    def body(job: LockstepJob[T]) -> None:
        error: BaseException | None = None
        with sampler._cond:
            sampler._cond.wait_for(lambda: job.name in sampler._expected or sampler._failed is not None)
            try:
                if sampler._failed is not None:
                    raise LockstepAborted(f"{job.name!r} not started: {sampler._failed}")
                results[job.name] = job.run(sampler)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
                error = exc
                errors.append((0 if not isinstance(exc, LockstepAborted) else 1, exc))
            finally:
                sampler._finish(job.name, error)

    threads = [threading.Thread(target=body, args=(j,), name=f"trace-lockstep-{j.name}", daemon=True) for j in jobs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        set_mmap_threshold(DECODING_MMAP_THRESHOLD)  # the updates' setting would slow whatever the process does next
    if errors:  # the failure itself, not the stops it caused in the others
        raise min(errors, key=lambda e: e[0])[1]
    return [results[n] for n in names]
