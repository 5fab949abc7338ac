"""Where every artifact of the pipeline lives: the one home of `data/...` and `reports/...` paths.

Reads and writes nothing. A `Paths(root)` names each stage's outputs under a run's root (the repo,
or a sweep's `<out>/<name>/`); `STAGE_OUTS` lists, per dvc stage, the paths that `dvc.yaml` declares
as its outs, so a test can hold the two together. Folder layouts inside one artifact (an adapter's
`manifest.json`, a snapshot's `snapshot.json`) belong to the module that writes that format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BASELINES = "_baselines"
"""Sub-folder of data/adapters (and data/train) that holds the baseline adapters (GRPO on target, merged data)."""


@dataclass(frozen=True)
class Paths:
    """Every artifact path of one run, under `root`."""

    root: Path = Path(".")

    @property
    def data(self) -> Path:
        return Path(self.root) / "data"

    @property
    def reports(self) -> Path:
        return Path(self.root) / "reports"

    # --- reports/ (uncached outputs of every stage) -------------------------------------------------
    @property
    def metrics_dir(self) -> Path:
        return self.reports / "metrics"

    def metrics(self, stage: str) -> Path:
        """`reports/metrics/<stage>.json`: the stage's metrics (dvc `metrics:`)."""
        return self.metrics_dir / f"{stage}.json"

    @property
    def figures(self) -> Path:
        return self.reports / "figures"

    def figure(self, name: str) -> Path:
        return self.figures / f"{name}.png"

    @property
    def tables(self) -> Path:
        return self.reports / "tables"

    def table(self, name: str, suffix: str = ".md") -> Path:
        return self.tables / f"{name}{suffix}"

    @property
    def notebooks(self) -> Path:
        """Executed notebooks (papermill writes them; uncached: they hold timings)."""
        return self.reports / "notebooks"

    @property
    def html(self) -> Path:
        return self.reports / "html"

    @property
    def index(self) -> Path:
        return self.reports / "index.html"

    @property
    def provenance(self) -> Path:
        """`reports/provenance.json`: one record per kept capability (`evaluation.provenance`)."""
        return self.reports / "provenance.json"

    @property
    def capability_pages(self) -> Path:
        """`reports/capabilities/<id>.html`: each kept capability's provenance page."""
        return self.reports / "capabilities"

    @property
    def trajectory_viewer(self) -> Path:
        """`reports/trajectories.html`: every stored episode of the run, filterable."""
        return self.reports / "trajectories.html"

    @property
    def train_logs(self) -> Path:
        """`reports/train/<adapter>/plots/metrics/*.tsv`: each training's curves as DVCLive writes them, under TRL's
        metric names (dvc plots, live while the stage runs; `training.tracking`)."""
        return self.reports / "train"

    @property
    def train_summaries(self) -> Path:
        """`reports/metrics/train/<adapter>.json`: each training's last values (dvc metrics, `dvc exp show`)."""
        return self.metrics_dir / "train"

    @property
    def train_episodes(self) -> Path:
        """`reports/tables/train_episodes/<adapter>.tsv`: a few sampled episodes of each iteration per training."""
        return self.tables / "train_episodes"

    @property
    def lock(self) -> Path:
        return Path(self.root) / "dvc.lock"

    # --- prepare_model ----------------------------------------------------------------------------
    @property
    def model(self) -> Path:
        return self.data / "model"

    # --- rollout ----------------------------------------------------------------------------------
    @property
    def rollouts_dir(self) -> Path:
        return self.data / "rollouts"

    def rollouts(self, split: str) -> Path:
        """`data/rollouts/<split>.jsonl`: the base agent's trajectories on the target (Trajectory)."""
        return self.rollouts_dir / f"{split}.jsonl"

    def tasks(self, split: str) -> Path:
        """`data/rollouts/tasks-<split>.jsonl`: the target's tasks of a split (Task), written once by the
        rollout stage and read by every later stage."""
        return self.rollouts_dir / f"tasks-{split}.jsonl"

    # --- discover ---------------------------------------------------------------------------------
    @property
    def discover(self) -> Path:
        return self.data / "discover"

    @property
    def capabilities(self) -> Path:
        """Candidate capabilities, merged over runs (Capability)."""
        return self.discover / "capabilities.jsonl"

    @property
    def proposals(self) -> Path:
        """Every proposal of every discovery run and batch (Capability)."""
        return self.discover / "proposals.jsonl"

    @property
    def discover_ledger(self) -> Path:
        return self.discover / "ledger.jsonl"

    # --- score ------------------------------------------------------------------------------------
    @property
    def score(self) -> Path:
        return self.data / "score"

    @property
    def labels(self) -> Path:
        return self.score / "labels.jsonl"

    @property
    def scores(self) -> Path:
        return self.score / "scores.jsonl"

    @property
    def kept(self) -> Path:
        """The capabilities selected for training (Capability)."""
        return self.score / "kept.jsonl"

    @property
    def score_runs(self) -> Path:
        return self.score / "runs.jsonl"

    @property
    def score_ledger(self) -> Path:
        return self.score / "ledger.jsonl"

    # --- synthesize -------------------------------------------------------------------------------
    @property
    def envs(self) -> Path:
        return self.data / "envs"

    def env_dir(self, capability: str) -> Path:
        """`data/envs/<capability>/`: the installed, validated module (`env.py`) and its attempts."""
        return self.envs / capability

    @property
    def env_manifests(self) -> Path:
        return self.envs / "manifests.jsonl"

    @property
    def synth_ledger(self) -> Path:
        return self.envs / "llm_ledger.jsonl"

    @property
    def synth_rollouts(self) -> Path:
        """Rollouts spent by validation (difficulty band checks), counted in the budget."""
        return self.envs / "rollouts.jsonl"

    # --- train ------------------------------------------------------------------------------------
    @property
    def adapters(self) -> Path:
        return self.data / "adapters"

    @property
    def adapter_manifests(self) -> Path:
        return self.adapters / "manifests.jsonl"

    def adapter(self, name: str, baseline: bool = False) -> Path:
        """`data/adapters/<name>/` (a capability) or `data/adapters/_baselines/<name>/` (a baseline)."""
        return self.adapters / BASELINES / name if baseline else self.adapters / name

    @property
    def train(self) -> Path:
        return self.data / "train"

    def train_ledger(self, name: str, baseline: bool = False) -> Path:
        """The rollout ledger an adapter's training appended to (outside its folder, which is replaced whole)."""
        folder = self.train / BASELINES / name if baseline else self.train / name
        return folder / "rollouts.jsonl"

    @property
    def checkpoints(self) -> Path:
        """`data/checkpoints/`: the train stage's checkpoints while it runs; no DVC output, so they
        survive DVC deleting the stage's outputs before a rerun (resume after a crash)."""
        return self.data / "checkpoints"

    def checkpoint(self, name: str, baseline: bool = False) -> Path:
        """`data/checkpoints/[_baselines/]<name>/`: one adapter's training checkpoints."""
        return self.checkpoints / BASELINES / name if baseline else self.checkpoints / name

    @property
    def logs(self) -> Path:
        """`data/logs/`: wall times and the like; no DVC output and nothing reads it as a dependency, so
        a rerun's timings never make a cached artifact differ."""
        return self.data / "logs"

    def train_timing(self, name: str, baseline: bool = False) -> Path:
        """`data/logs/train/[_baselines/]<name>.timing.json`: one adapter's seconds per iteration."""
        folder = self.logs / "train" / BASELINES if baseline else self.logs / "train"
        return folder / f"{name}.timing.json"

    # --- evaluate ---------------------------------------------------------------------------------
    @property
    def evaluate(self) -> Path:
        return self.data / "evaluate"

    @property
    def eval_trajectories(self) -> Path:
        return self.evaluate / "trajectories"

    def eval_episodes(self, key: str) -> Path:
        """`data/evaluate/trajectories/<key>.jsonl`: one method's (or weights') episodes on the test split."""
        return self.eval_trajectories / f"{key}.jsonl"

    @property
    def eval_routes(self) -> Path:
        return self.evaluate / "routes"

    def route_decisions(self, key: str) -> Path:
        """`data/evaluate/routes/<key>.jsonl`: a router's decision per task (RouteDecision)."""
        return self.eval_routes / f"{key}.jsonl"

    @property
    def eval_results(self) -> Path:
        return self.evaluate / "results.jsonl"

    @property
    def oracle_labels(self) -> Path:
        """`data/evaluate/oracle_labels.jsonl`: the analyst's labels of the base model's evaluation episodes
        (`evaluate.oracle: labels`)."""
        return self.evaluate / "oracle_labels.jsonl"

    @property
    def validation_labels(self) -> Path:
        """`data/evaluate/validation_labels.jsonl`: the analyst's labels of the base model's validation episodes
        (the labels oracle the routers are chosen against, `evaluate.router: auto`)."""
        return self.evaluate / "validation_labels.jsonl"

    @property
    def oracle_llm(self) -> Path:
        return self.evaluate / "oracle_llm.jsonl"

    @property
    def gepa_prompt(self) -> Path:
        return self.evaluate / "gepa_prompt.md"

    @property
    def gepa_rollouts(self) -> Path:
        return self.evaluate / "gepa_rollouts.jsonl"

    @property
    def gepa_llm(self) -> Path:
        return self.evaluate / "gepa_llm.jsonl"

    # --- scaling ----------------------------------------------------------------------------------
    @property
    def scaling(self) -> Path:
        return self.data / "scaling"

    @property
    def scaling_points(self) -> Path:
        return self.scaling / "points.jsonl"

    @property
    def scaling_trajectories(self) -> Path:
        return self.scaling / "trajectories"

    def scaling_episodes(self, key: str) -> Path:
        """`data/scaling/trajectories/<method>@<budget>.jsonl`: the episodes of one intermediate budget point."""
        return self.scaling_trajectories / f"{key}.jsonl"


STAGES: tuple[str, ...] = ("prepare_model", "rollout", "discover", "score", "synthesize", "train", "evaluate",
                           "scaling", "report")
"""The dvc stages in pipeline order; stage `s` is `trace_lib.stages.<s>.run_<s>(params, root)` and
`notebooks/<nn>_<s>.ipynb`."""


def notebook(stage: str) -> Path:
    """`notebooks/<nn>_<stage>.ipynb`, numbered in pipeline order."""
    return Path("notebooks") / f"{STAGES.index(stage):02d}_{stage}.ipynb"


def stage_outs(paths: Paths) -> dict[str, list[Path]]:
    """Per stage, the outputs `dvc.yaml` must declare (data folders, metrics, tables, figures)."""
    p, fig, tab = paths, paths.figure, paths.table
    return {
        "prepare_model": [p.model],
        "rollout": [p.rollouts_dir, p.metrics("rollout"), fig("rollout_success_by_family")],
        "discover": [p.discover, p.metrics("discover")],
        "score": [p.score, p.metrics("score"), fig("score_error_rates"), fig("score_delta_coverage"),
                  fig("score_stability")],
        "synthesize": [p.envs, p.metrics("synthesize")],
        "train": [p.adapters, p.train, p.metrics("train"), fig("train_curves"), fig("train_efficiency"),
                  fig("train_vs_base"), fig("train_rubric"), p.train_logs, p.train_summaries, p.train_episodes],
        "evaluate": [p.evaluate, p.metrics("evaluate"), tab("table1"), tab("table1", ".csv"), tab("routing"),
                     tab("interference"), tab("capabilities"), fig("evaluate_success"),
                     fig("evaluate_routing_confusion"), fig("evaluate_interference")],
        "scaling": [p.scaling, p.metrics("scaling"), tab("scaling"), tab("ablations"), fig("scaling")],
        "report": [p.table("environments"), p.table("llm_costs"), p.html, p.index, p.provenance, p.capability_pages,
                   p.trajectory_viewer, p.metrics("report")],
    }
