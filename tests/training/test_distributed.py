"""Training on several processes (training/distributed.py): the single-process no-ops, the batch arithmetic,
and a real 2-process gloo run of the trainer on the tiny model (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trace_lib.config import TrainConfig
from trace_lib.training import distributed
from trace_lib.training.trainer import _micro_batch, cpu_pass_rows

TESTS = Path(__file__).resolve().parents[1]  # tests/, where the shared helpers are; the repo one up


@pytest.mark.parametrize("per_iter,group_size,cap,rows", [
    (8, 4, 8, 8), (4, 4, 8, 4), (32, 4, 8, 8), (16, 8, 8, 8), (24, 6, 8, 6), (12, 3, 8, 6), (64, 16, 8, 16),
    (20, 4, 8, 4), (32, 4, 32, 32), (64, 4, 32, 32), (48, 4, 32, 24)])
def test_a_cpu_loss_pass_holds_at_most_cap_rollouts_a_multiple_of_k(per_iter, group_size, cap, rows):
    assert cpu_pass_rows(per_iter, group_size, cap) == rows
    assert per_iter % rows == 0 and rows % group_size == 0


def test_the_cpu_pass_bound_follows_the_training_dtype(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = TrainConfig(groups=8, group_size=4)  # 32 rollouts an iteration
    assert _micro_batch(cfg.model_copy(update={"dtype": "float32"})) == 8
    assert _micro_batch(cfg.model_copy(update={"dtype": "bfloat16"})) == 32
    assert _micro_batch(cfg) == 8  # auto: fp32 in the tests (conftest), as on a CPU without bf16 kernels


def test_one_process_gathers_itself_and_leaves_gradients_alone():
    assert distributed.world() == (0, 1) and distributed.gather([1, {"a": 2}]) == [1, {"a": 2}]
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    assert distributed.average_gradients([p]) == 0 and torch.equal(p.grad, torch.full((3,), 2.0))
    distributed.barrier()


def test_each_process_gets_whole_groups_or_a_clear_error():
    from trace_lib.config import ConfigError, params_from_dict

    cfg = TrainConfig(groups=4, group_size=4)
    assert _micro_batch(cfg, 2) == 8  # CPU, shared prompt: one pass over the process's 2 groups
    assert _micro_batch(cfg.model_copy(update={"micro_batch": 4}), 2) == 4
    assert _micro_batch(cfg) == 8  # one process, 16 rollouts, fp32: two passes of 8 (memory)
    assert _micro_batch(cfg.model_copy(update={"micro_batch": 16})) == 16  # asked for: one pass
    with pytest.raises(ValueError, match="must be a multiple of the 3 training processes"):
        _micro_batch(cfg, 3)
    with pytest.raises(ValueError, match="must hold whole groups"):
        _micro_batch(cfg.model_copy(update={"micro_batch": 2}), 2)
    with pytest.raises(ValueError, match="train.shared_prompt must be on"):
        _micro_batch(cfg.model_copy(update={"shared_prompt": False, "micro_batch": 4}), 2)
    # params.yaml fails before any work
    with pytest.raises(ConfigError, match=r"train.groups \(8\) must be a multiple of train.processes \(3\)"):
        params_from_dict({"train": {"processes": 3}})
    with pytest.raises(ConfigError, match="needs train.shared_prompt"):
        params_from_dict({"train": {"processes": 2, "shared_prompt": False}})


def test_the_launch_command_runs_accelerate_on_local_processes():
    cmd = distributed.launch_command(2, ["-m", "trace_lib.stages.train", "--root", "."], port=29500)
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    flag = {k: v for k, v in zip(cmd, cmd[1:]) if k.startswith("--")}
    assert (flag["--num_processes"], flag["--main_process_port"], flag["--num_machines"]) == ("2", "29500", "1")
    assert "--multi_gpu" in cmd and cmd[-4:] == ["-m", "trace_lib.stages.train", "--root", "."]


RUN = textwrap.dedent("""
    import hashlib, json, sys
    from pathlib import Path
    sys.path[:0] = [{tests!r}]
    from tiny_training import ParityEnv, kv_tasks
    from trace_lib.config import TrainConfig
    from trace_lib.training import distributed, trainer as trainer_mod
    from trace_lib.budget import RolloutLedger
    from trace_lib.training.grpo import TrainSource

    out = Path({out!r})
    made = []
    make = trainer_mod._make_trainer
    trainer_mod._make_trainer = lambda *a, **k: made.append(make(*a, **k)) or made[-1]
    cfg = TrainConfig(groups=4, group_size=2, iterations=2, max_new_tokens=12, max_steps_per_episode=3,
                      constrained=False, learning_rate=1e-2, save_every=1)
    trainer_mod.train_adapter_mixture(Path({model!r}), [TrainSource("cap", lambda: ParityEnv(max_steps=3), kv_tasks)],
                                      cfg, out / "adapter", seed=0, ledger=RolloutLedger(out / "ledger.jsonl"),
                                      name="cap")
    rank, size = distributed.world()
    trainable = [p.detach() for p in made[0].model.parameters() if p.requires_grad]
    digest = hashlib.sha256(b"".join(p.float().numpy().tobytes() for p in trainable)).hexdigest()
    (out / f"rank{{rank}}.json").write_text(json.dumps({{"size": size, "digest": digest,
        "seeds": sorted({{ep.seed for ep in made[0].rollout_func.last}})}}))
""")


@pytest.mark.slow
def test_two_gloo_processes_train_one_adapter_with_the_same_weights_on_both(tiny_model_dir, tmp_path):
    from trace_lib.engine.serve import free_port

    script = tmp_path / "run.py"
    script.write_text(RUN.format(tests=str(TESTS), out=str(tmp_path), model=str(tiny_model_dir)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS.parent)}
    done = subprocess.run(distributed.launch_command(2, [str(script)], port=free_port()), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["size"] for r in ranks] == [2, 2]
    assert ranks[0]["digest"] == ranks[1]["digest"]  # gradients averaged: the same weights after 2 steps
    assert not set(ranks[0]["seeds"]) & set(ranks[1]["seeds"])  # each process played its own groups
    log = [json.loads(x) for x in (tmp_path / "adapter" / "train_log.jsonl").read_text().splitlines()]
    assert [row["rollouts"] for row in log] == [8, 16]  # whole iterations (4 groups x 2), not halves
    ledger = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert sum(r["rollouts"] for r in ledger) == 16 and not list(tmp_path.glob("ledger.jsonl.rank*"))
    manifest = json.loads((tmp_path / "adapter" / "manifest.json").read_text())
    assert manifest["rollouts_used"] == 16 and manifest["iterations"] == 2


def test_the_train_stage_relaunches_itself_on_its_processes_and_reports_a_failed_launch(tmp_path, monkeypatch,
                                                                                       capfd):
    from trace_lib.config import params_from_dict
    from trace_lib.io import read_json, write_json
    from trace_lib.stages.train import run_train

    params = params_from_dict({"train": {"processes": 2, "groups": 2}})
    seen = {}

    def fake_launch(code: int, said: str):
        def popen(cmd, **kw):
            seen["cmd"] = cmd
            seen["params"] = read_json(Path(cmd[cmd.index("--params") + 1]))
            write_json(tmp_path / "reports" / "metrics" / "train.json", {"backend": "trl", "adapters": {}})
            return real_popen([sys.executable, "-c", f"import sys; print({said!r}); sys.exit({code})"], **kw)
        return popen

    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", fake_launch(0, "iteration 1 of 2"))
    assert run_train(params, tmp_path) == {"backend": "trl", "adapters": {}}
    assert "iteration 1 of 2" in capfd.readouterr().err  # the processes' output passes through as it comes
    cmd = seen["cmd"]
    assert cmd[cmd.index("--num_processes") + 1] == "2" and cmd[cmd.index("-m", 3) + 1] == "trace_lib.stages.train"
    assert cmd[cmd.index("--root") + 1] == str(tmp_path.resolve()) and seen["params"] == params.model_dump(mode="json")
    monkeypatch.setattr(subprocess, "Popen", fake_launch(1, "boom: no GPU"))
    with pytest.raises(RuntimeError, match=r"the train stage on 2 processes failed \(exit 1\)(.|\n)*boom: no GPU"):
        run_train(params, tmp_path)
