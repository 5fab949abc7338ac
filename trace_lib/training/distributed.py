"""Training on several processes (`train.processes`): DDP through `accelerate launch`, gloo on CPU, NCCL on GPUs.

Reads and writes nothing itself. The train stage relaunches itself under `accelerate launch` (`launch_command`,
`stages.train.run_train`); every process then runs the same trainer (`training.trainer`) on its share of
each iteration's groups: TRL hands each process whole groups (the per-process batch is a multiple of K),
samples them there, and averages the advantages' inputs across processes itself. What trace adds:

* `gather`: the per-episode summaries of all processes, so the efficiency reward's threshold, the rollout
  ledger and the train log see the whole iteration on every process (they stay identical);
* `average_gradients`: the LoRA gradients averaged across processes before they are clipped and the
  optimizer steps (`AgentGRPOTrainer._clip_grad_norm`; the trainer always clips). The
  shared-prompt loss pass (`training/shared_prompt.py`) calls the model's modules directly, not the DDP
  wrapper's forward, so DDP's own all-reduce never runs; this does it explicitly (all-reduce of the
  trainable gradients, then divide by the number of processes), which is what DDP would compute;
* process 0 alone writes files (adapter, log, checkpoints' trace state, metrics); the others keep a
  private copy of the ledger so their budget arithmetic matches.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def world() -> tuple[int, int]:
    """(this process's rank, number of processes); (0, 1) outside a distributed launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init() -> tuple[int, int]:
    """Join the process group a launcher set up (accelerate's `PartialState`: NCCL with CUDA, else gloo on
    the CPU); (rank, size)."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        import torch
        from accelerate import PartialState

        if torch.cuda.is_available():  # one GPU per process: "cuda" (model.device auto) means this one
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        PartialState(cpu=not torch.cuda.is_available())
    return world()


def barrier() -> None:
    """Wait for every process (no-op with one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather(items: list[Any]) -> list[Any]:
    """Every process's `items`, concatenated in rank order (the list itself with one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(items)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(items))
    return [x for part in out for x in part]


def average_gradients(weights: Iterable[Any]) -> int:
    """Average the gradients of the trainable `weights` (torch parameters) across processes (one all-reduce of
    them all, flattened; a parameter without a gradient counts as zeros on that process). Returns how many."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    weights = [p for p in weights if p.requires_grad]
    if not weights:
        return 0
    for p in weights:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in weights])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(dist.get_world_size())
    offset = 0
    for p in weights:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
    return len(weights)


def private_copy(path: str | Path, rank: int) -> Path:
    """`path` copied for process `rank` (> 0) to `<path>.rank<rank>`, which it then appends to alone."""
    path = Path(path)
    mine = path.with_name(f"{path.name}.rank{rank}")
    if path.exists():
        shutil.copyfile(path, mine)
    else:
        mine.unlink(missing_ok=True)
    return mine


def launch_command(processes: int, target: list[str], *, port: int) -> list[str]:
    """`accelerate launch` of `target` (`["-m", module, *args]` or `[script, *args]`) on `processes` local
    processes.

    `--multi_gpu` is accelerate's launcher for several local processes (torch's elastic launcher); on a
    machine without CUDA each process then joins a gloo group (`init`, and TRL's trainer with
    `use_cpu`)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
            "--dynamo_backend", "no", *target]
