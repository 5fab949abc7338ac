"""torch's CPU thread count, chosen from what other processes use of the CPUs while decoding runs.

Reads /proc/stat and /proc/self/stat (Linux); elsewhere nothing changes. Writes nothing.

torch's CPU build runs its threads with GNU OpenMP, whose threads spin while they wait for each other
at the end of every operator. When other work shares the cores, a spinning thread takes the core its
descheduled partner needs: beside busy processes decoding at 2 threads falls below its speed at 1 thread,
while on an idle machine 2 threads are faster than 1 (benchmarks/threads_under_load.py). Making waiting
threads sleep (`OMP_WAIT_POLICY=PASSIVE`) also avoids the collapse but slows every run on an idle machine.

So decoding keeps torch's thread count while the other processes leave the cores free, and drops to
as many threads as there are free cores when they do not, re-checked about once a second. The thread
count does not change a decoded token: the same seed gives the same bytes at 1 and 2 threads (the
default rollout, `engine.model.numerics`). Only decoding is governed; the GRPO update runs at the
configured count (`restore_threads`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

CHECK_EVERY_S = 1.0
"""Seconds between two looks at /proc/stat."""
BUSY_SLACK = 0.25
"""Cores other processes may use before a thread is given up (a core counts as free from 0.75 of it)."""


def pick_threads(others_busy: float, cpus: int, max_threads: int) -> int:
    """Threads to run when other processes keep `others_busy` of `cpus` cores busy: the free cores,
    a core counting as free when less than BUSY_SLACK of it is used; at least 1, at most `max_threads`."""
    free = cpus - max(0.0, others_busy)
    return max(1, min(max_threads, math.floor(free + BUSY_SLACK)))


@dataclass(frozen=True)
class CpuSample:
    """Clock ticks since boot: the CPUs' busy and total time, this process's (all its threads and its
    waited-for children: the forked tool calls are this process's work, not competing load)."""

    busy: int
    total: int
    own: int
    cpus: int


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def read_cpu_sample() -> CpuSample | None:
    """CPU time now of the CPUs this process may run on (its affinity: a container's or `taskset`'s
    cores, not the whole host) and of this process; None where /proc is not readable."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        with open("/proc/self/stat") as f:
            own_fields = f.read().rsplit(")", 1)[1].split()
        # utime + stime + cutime + cstime (fields 14-17 of the whole line): this process's threads and its
        # waited-for children, i.e. the forked tool calls (envs/limits.py): counted as other processes' use,
        # they would hold the long prefill after each turn's tool calls at one thread.
        own = sum(int(own_fields[i]) for i in (11, 12, 13, 14))
        allowed = _allowed_cpus()
        busy = total = cpus = 0
        for line in lines:
            name, *fields = line.split()
            if not (name.startswith("cpu") and name[3:].isdigit()):
                continue
            if allowed is not None and int(name[3:]) not in allowed:
                continue
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # minus idle and iowait
            cpus += 1
    except (OSError, ValueError, IndexError):
        return None
    if cpus == 0:
        return None
    return CpuSample(busy=busy, total=total, own=own, cpus=cpus)


def others_busy(before: CpuSample, after: CpuSample) -> float | None:
    """Cores that other processes kept busy between two samples (None if no time passed)."""
    total = after.total - before.total
    if total <= 0:
        return None
    busy = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, busy) / total * after.cpus


class ThreadGovernor:
    """Sets torch's thread count for decoding from the last second's CPU use by other processes."""

    def __init__(self, max_threads: int | None = None, check_every_s: float = CHECK_EVERY_S) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.check_every_s = check_every_s
        self.fixed = False
        self._last: CpuSample | None = None
        self._last_t = -math.inf

    def fix(self, threads: int) -> None:
        """A count set by the user (params `threads`): kept, never governed."""
        torch.set_num_threads(threads)
        self.max_threads, self.fixed = threads, True

    def govern(self, now: float | None = None) -> int:
        """Called between decoding steps; looks at the CPUs at most once per `check_every_s`."""
        if self.fixed or self.max_threads <= 1:
            return torch.get_num_threads()
        now = time.monotonic() if now is None else now
        if now - self._last_t < self.check_every_s:
            return torch.get_num_threads()
        sample = read_cpu_sample()
        if sample is None:
            return torch.get_num_threads()
        busy = others_busy(self._last, sample) if self._last is not None else None
        self._last, self._last_t = sample, now
        if busy is not None:
            threads = pick_threads(busy, sample.cpus, self.max_threads)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        return torch.get_num_threads()

    def restore(self) -> None:
        """Back to the full count (before work whose numerics may depend on it, e.g. the GRPO update)."""
        if torch.get_num_threads() != self.max_threads:
            torch.set_num_threads(self.max_threads)
        self._last, self._last_t = None, -math.inf


_GOVERNOR: ThreadGovernor | None = None


def governor() -> ThreadGovernor:
    """The process's governor (torch's thread count is process-wide); created on first use."""
    global _GOVERNOR
    if _GOVERNOR is None:
        _GOVERNOR = ThreadGovernor()
    return _GOVERNOR


def set_threads(threads: int) -> None:
    """params' `threads`: 0 lets the governor choose (up to torch's count), n > 0 fixes n."""
    if threads > 0:
        governor().fix(threads)


def govern_threads() -> int:
    """Between decoding steps: the governor's thread count for now."""
    return governor().govern()


def restore_threads() -> None:
    """The full thread count again (before the GRPO update's log-probs and loss)."""
    governor().restore()
