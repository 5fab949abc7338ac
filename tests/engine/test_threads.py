"""Decoding threads chosen from the CPU use of other processes (trace_lib/engine/threads.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from trace_lib.engine import threads
from trace_lib.engine.threads import CpuSample, ThreadGovernor, others_busy, pick_threads, read_cpu_sample


@pytest.mark.parametrize(("busy", "cpus", "most", "expected"), [
    (0.0, 2, 2, 2), (0.2, 2, 2, 2), (0.3, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1), (5.0, 2, 2, 1),
    (0.0, 16, 4, 4), (13.5, 16, 4, 2), (-0.1, 2, 2, 2),
])
def test_threads_are_the_free_cores(busy: float, cpus: int, most: int, expected: int) -> None:
    assert pick_threads(busy, cpus, most) == expected


def test_others_busy_leaves_out_this_process() -> None:
    before = CpuSample(busy=1000, total=4000, own=100, cpus=2)
    # 200 jiffies of 2 CPUs passed (100 per CPU): 150 busy, 60 of them ours -> 90 by others = 0.9 cores
    after = CpuSample(busy=1150, total=4200, own=160, cpus=2)
    assert others_busy(before, after) == pytest.approx(0.9)
    assert others_busy(after, after) is None


def test_read_cpu_sample_on_this_machine() -> None:
    sample = read_cpu_sample()
    if sample is None:
        pytest.skip("no /proc/stat here: the governor leaves the thread count alone")
    assert sample.cpus >= 1 and 0 <= sample.busy <= sample.total and sample.own >= 0


def test_forked_children_count_as_this_process() -> None:
    """A forked tool call (envs/limits.py) is this process's work: counted as other processes' load, a
    turn's tool calls made the governor run the next prefill on one thread on an idle machine."""
    if read_cpu_sample() is None or not hasattr(os, "fork"):
        pytest.skip("no /proc/stat or no fork here: the governor leaves the thread count alone")
    before = read_cpu_sample()
    pid = os.fork()
    if pid == 0:  # the child: burn 0.3 s of CPU, then leave without running any cleanup
        start = time.process_time()
        while time.process_time() - start < 0.3:
            pass
        os._exit(0)
    os.waitpid(pid, 0)
    after = read_cpu_sample()
    assert before is not None and after is not None
    assert (after.own - before.own) / os.sysconf("SC_CLK_TCK") >= 0.2  # the child's 0.3 s, tick-rounded


class _FakeCpu:
    """CPU samples in which other processes use `busy` cores per 100 jiffies of each CPU."""

    def __init__(self, cpus: int = 2) -> None:
        self.cpus, self.busy, self.t = cpus, 0.0, CpuSample(0, 0, 0, cpus)

    def __call__(self) -> CpuSample:
        total = 100 * self.cpus
        t = self.t
        self.t = CpuSample(t.busy + round(100 * self.busy) + 50, t.total + total, t.own + 50, self.cpus)
        return self.t


@pytest.fixture()
def fake_cpu(monkeypatch: pytest.MonkeyPatch):
    cpu = _FakeCpu()
    monkeypatch.setattr(threads, "read_cpu_sample", cpu)
    start = torch.get_num_threads()
    yield cpu
    torch.set_num_threads(start)


def test_the_governor_gives_up_a_thread_while_others_are_busy_and_takes_it_back(fake_cpu) -> None:
    gov = ThreadGovernor(max_threads=2, check_every_s=1.0)
    torch.set_num_threads(2)
    assert gov.govern(now=0.0) == 2  # first look: nothing to compare with yet
    fake_cpu.busy = 1.0
    assert gov.govern(now=0.5) == 2  # looks at most once per second
    assert gov.govern(now=1.0) == 1
    assert torch.get_num_threads() == 1
    fake_cpu.busy = 0.0
    assert gov.govern(now=2.0) == 2
    fake_cpu.busy = 2.0
    assert gov.govern(now=3.0) == 1
    gov.restore()  # the update runs on the full count
    assert torch.get_num_threads() == 2


def test_a_fixed_thread_count_is_never_governed(fake_cpu) -> None:
    gov = ThreadGovernor(max_threads=2)
    gov.fix(2)
    fake_cpu.busy = 2.0
    assert [gov.govern(now=float(t)) for t in range(3)] == [2, 2, 2]


def test_the_governed_count_does_not_change_decoded_tokens(tiny_model_dir) -> None:
    """Same seed at 1 and 2 threads: the same tokens (bf16, sampling at temperature 1)."""
    from trace_lib.engine.policy import load_policy
    from trace_lib.records import Message

    tiny_policy = load_policy(tiny_model_dir, dtype="bfloat16")
    conv = [[Message(role="user", content=f"Say something about order #{i}.")] for i in range(8)]
    start = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append([g.text for g in tiny_policy.generate(conv, [], temperature=1.0, max_new_tokens=12, seed=3)])
    finally:
        torch.set_num_threads(start)
    assert outs[0] == outs[1]


def test_policy_generate_asks_the_governor_between_steps(tiny_model_dir, fake_cpu, monkeypatch) -> None:
    """Beside a busy process, decoding drops to one thread; the GRPO update's restore brings two back."""
    from trace_lib.engine.policy import load_policy
    from trace_lib.records import Message

    gov = ThreadGovernor(max_threads=2, check_every_s=0.0)
    monkeypatch.setattr(threads, "_GOVERNOR", gov)
    torch.set_num_threads(2)
    fake_cpu.busy = 1.5
    policy = load_policy(tiny_model_dir)
    policy.generate([[Message(role="user", content="Hi")]], [], max_new_tokens=4)
    assert torch.get_num_threads() == 1
    threads.restore_threads()
    assert torch.get_num_threads() == 2


@pytest.mark.slow
def test_switching_threads_mid_decoding_keeps_the_tokens_of_smollm2(smollm2_dir, monkeypatch) -> None:
    """The real model in bf16, 8 rows sampled at temperature 1: a thread count switched between every
    decoding step (as the governor may) gives the tokens of a fixed 2 threads."""
    from trace_lib.engine import decoding, policy as policy_module
    from trace_lib.engine.policy import load_policy
    from trace_lib.records import Message

    policy = load_policy(smollm2_dir, dtype="bfloat16")
    conv = [[Message(role="user", content=f"Where is my order #{1000 + i}?")] for i in range(8)]
    start = torch.get_num_threads()
    calls = []

    def alternate() -> int:
        calls.append(1)
        torch.set_num_threads(1 + len(calls) % 2)
        return torch.get_num_threads()

    try:
        torch.set_num_threads(2)
        for module in (policy_module, decoding):  # the calls of each decoding call and of each step
            monkeypatch.setattr(module, "govern_threads", lambda: 2)
        fixed = [g.text for g in policy.generate(conv, [], temperature=1.0, max_new_tokens=24, seed=5)]
        for module in (policy_module, decoding):
            monkeypatch.setattr(module, "govern_threads", alternate)
        switched = [g.text for g in policy.generate(conv, [], temperature=1.0, max_new_tokens=24, seed=5)]
    finally:
        torch.set_num_threads(start)
    assert len(calls) > 10
    assert switched == fixed
