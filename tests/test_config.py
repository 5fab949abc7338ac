"""params.yaml loading: profiles, defaults, and errors that name the key."""

import warnings
from pathlib import Path

import pytest
import yaml

from trace_lib.config import ConfigError, Params, ProfileOverride, load_params, params_from_dict, profile_overrides


def test_defaults_are_cpu_profile():
    p = params_from_dict({})
    assert p.profile == "cpu"
    assert p.model.id == "smollm2-135m"
    assert p.rollout.temperature == 0.3 and p.train.iterations == 10 and p.env.tasks_per_family == 6


def test_paper_profile_sets_budgets_but_file_wins_and_says_so():
    with pytest.warns(ProfileOverride, match=r"rollout.batch_size: 4 replaces profile 'paper''s 32"):
        p = params_from_dict({"profile": "paper", "rollout": {"batch_size": 4}})
    assert p.model.id == "meta-llama/Llama-3.1-8B-Instruct"
    assert p.rollout.temperature == 0.0
    assert p.rollout.batch_size == 4


def test_repo_params_yaml_switches_to_the_paper_with_one_key(tmp_path: Path):
    """`profile: paper` in the repo's own params.yaml gives the paper's model and budgets: the file pins
    no size of either profile, so nothing is overridden (and nothing is warned about)."""
    repo = Path(__file__).resolve().parents[1]
    data = yaml.safe_load((repo / "params.yaml").read_text())
    assert profile_overrides(data) == {}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({**data, "profile": "paper"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileOverride)
        paper = load_params(path)
        cpu = load_params(repo / "params.yaml")
    assert paper.model.id == "meta-llama/Llama-3.1-8B-Instruct" and cpu.model.id == "smollm2-135m"
    assert (paper.train.iterations, paper.train.groups, paper.train.group_size, paper.train.lora_rank) == (40, 64, 16, 16)
    assert paper.train.learning_rate == 1e-5 and paper.train.baselines == ["grpo_target", "grpo_target_late",
                                                                           "merged_data"]
    assert (paper.env.tasks_per_family, paper.env.max_steps, paper.rollout.max_new_tokens) == (64, 30, 512)
    assert paper.synthesize.validation.band is True and cpu.synthesize.validation.band is False
    assert (cpu.train.iterations, cpu.train.groups, cpu.train.group_size, cpu.train.learning_rate) == (10, 8, 8, 2e-3)
    assert (cpu.train.reference_samples, cpu.train.temperature, cpu.score.max_kept) == (2, 0.8, 1)
    assert paper.train.reference_samples == 0 and paper.score.max_kept is None
    assert paper.env.families == [] and paper.env.validation_fraction == 0  # the whole retail set


def test_profile_overrides_lists_only_values_that_differ():
    data = {"profile": "paper", "train": {"iterations": 2, "groups": 64}, "model": {"id": "x"}, "seed": 3}
    assert profile_overrides(data) == {"train.iterations": (40, 2), "model.id": ("meta-llama/Llama-3.1-8B-Instruct", "x")}
    assert profile_overrides({"train": {"groups": 8}}) == {}  # the cpu profile's own value


@pytest.mark.parametrize(
    "data, key",
    [
        ({"rollout": {"temperatur": 0.5}}, "rollout.temperatur: unknown key (did you mean 'temperature'?)"),
        ({"rolout": {}}, "rolout: unknown key (did you mean 'rollout'?)"),
        ({"train": {"reward": {"lamm": 1}}}, "train.reward.lamm: unknown key (did you mean 'lam'?)"),
        ({"rollout": {"zzz": 1}}, "rollout.zzz: unknown key"),
        ({"rollout": {"batch_size": "eight"}}, "rollout.batch_size"),
        ({"rollout": {"batch_size": 0}}, "rollout.batch_size"),
        ({"env": {"max_steps": -1}}, "env.max_steps"),
        ({"profile": "tpu"}, "profile"),
        ({"train": {"prompt_grad": False, "shared_prompt": False}},
         "train.prompt_grad: false needs train.shared_prompt"),
        ({"env": {"test_fraction": 0.6, "validation_fraction": 0.4}}, "validation_fraction (0.4) must be below 1"),
        ({"env": {"name": "phone", "validation_fraction": 0.2}}, "env.validation_fraction: only the built-in"),
        ({"env": {"validation_fraction": 0.0}, "evaluate": {"router": "auto"}},
         "evaluate.router: 'auto' chooses the router on the validation split"),
    ],
)
def test_bad_keys_and_types_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        params_from_dict(data, "params.yaml")
    assert key in str(err.value) and str(err.value).startswith("params.yaml")
    if key == "rollout.zzz: unknown key":  # nothing close: no guess
        assert "did you mean" not in str(err.value)


def test_a_gpu_profile_without_cuda_is_accepted_with_a_warning(monkeypatch):
    import trace_lib.config as config

    monkeypatch.setattr(config, "_cuda_available", lambda: False)
    with pytest.warns(config.ProfileWithoutGPU, match="profile 'gpu' is sized for a GPU .* no CUDA device"):
        assert params_from_dict({"profile": "gpu"}).profile == "gpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error", config.ProfileWithoutGPU)
        params_from_dict({"profile": "cpu"})
        params_from_dict({"profile": "gpu", "model": {"device": "cpu"}})  # asked for the CPU outright
        monkeypatch.setattr(config, "_cuda_available", lambda: True)
        params_from_dict({"profile": "paper"})


def test_load_params_file(tmp_path: Path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"seed": 3, "env": {"tasks_per_family": 2}}))
    p = load_params(path)
    assert (p.seed, p.env.tasks_per_family) == (3, 2)


def test_missing_and_malformed_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_params(top)


def test_repo_params_yaml_is_valid():
    repo = Path(__file__).resolve().parents[1]
    load_params(repo / "params.yaml")


def test_dotted_overrides(tmp_path: Path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"temperature": 0.7}}))
    p = load_params(path, {"rollout.temperature": 1.0, "env.max_steps": 3})
    assert (p.rollout.temperature, p.env.max_steps) == (1.0, 3)
    with pytest.raises(ConfigError, match="rollout.tempr: unknown key"):
        load_params(path, {"rollout.tempr": 1.0})
    with pytest.raises(ConfigError, match="rollout.temperature: is not a section"):
        load_params(path, {"rollout.temperature.x": 1.0})


def test_cpu_profile_sizes_evaluate_and_paper_runs_every_method():
    cpu = params_from_dict({})
    assert cpu.evaluate.methods == ["base", "grpo_target", "grpo_target_late", "linear_merge", "single",
                                    "oracle_route", "trace"] and cpu.evaluate.route_mode == "argmax"
    assert cpu.train.baselines == ["grpo_target", "grpo_target_late"]
    assert cpu.scaling.budgets == [240, 368, 496, 624]
    assert cpu.train.distill.iterations == 0 and cpu.train.distill.learning_rate is None
    assert cpu.env.end_on_repeated_call and not Params().env.end_on_repeated_call
    assert Params().train.distill.iterations == 0  # outside a profile: no distillation
    assert load_params(Path(__file__).parents[1] / "params.yaml").scaling.budgets == [240, 368, 496, 624]
    # the planted testbed: the control family and three planted deficits, 48 test tasks, a validation split
    assert cpu.env.families == ["order_status", "order_total", "order_tracking", "refuse_cancel"]
    assert (cpu.env.per_family("test") * 4, cpu.env.validation_fraction > 0) == (48, True)
    assert cpu.synthesize.calibration.enabled and cpu.evaluate.router == "auto"
    assert cpu.train.groups * cpu.train.group_size >= 32
    paper = params_from_dict({"profile": "paper"})
    assert "grpo_target" in paper.evaluate.methods and paper.evaluate.route_mode == "both"
    gpu = params_from_dict({"profile": "gpu"})
    assert (gpu.model.id, gpu.model.device) == ("smollm2-135m", "auto")
    assert gpu.train.baselines == ["grpo_target", "grpo_target_late", "merged_data"]
    assert gpu.train.iterations * gpu.train.groups * gpu.train.group_size == 640 and gpu.env.tasks_per_family * 7 == 56
    assert "grpo_target" in gpu.evaluate.methods and gpu.train.save_every == 2


def test_the_params_check_before_each_stage_ends_in_one_line_naming_the_key(tmp_path, capsys):
    """Every dvc stage runs `python -m trace_lib.config params.yaml` first: a typo'd key stops it before any
    work with one line (exit status 2), not a notebook's traceback."""
    from trace_lib.config import main

    repo = Path(__file__).resolve().parents[1]
    stage_cmds = [c for c in (repo / "dvc.yaml").read_text().splitlines() if c.strip().startswith("cmd:")]
    assert stage_cmds and all(c.strip().startswith("cmd: python -m trace_lib.config params.yaml && ") for c in stage_cmds)
    bad = tmp_path / "params.yaml"
    bad.write_text("rollout:\n  temperatur: 0.3\n")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ConfigError: {bad}: rollout.temperatur: unknown key (did you mean 'temperature'?)"]
    assert main([str(repo / "params.yaml")]) == 0
