"""Stage `report`: one browsable page over everything the pipeline wrote.

Reads   reports/notebooks/*.ipynb (each stage's executed notebook), reports/tables/*.md,
        reports/metrics/*.json, reports/figures/*.png, params.yaml and dvc.lock (plus the git commit,
        when there is one).
Writes  reports/tables/environments.md: Table 1 across environments, this run's block beside those of the
        other runs named in `report.environments` (their reports/tables/table1.csv and
        reports/metrics/evaluate.json; not DVC deps, as for `scaling.ablation_runs`); reports/tables/llm_costs.md:
        every LLM call of the run (the analyst's, the synthesizer's, GEPA's and the LLM user's ledgers; the
        last lives with its persistent cache, `env.user_cache_dir`) by stage, backend and model, tokens and cost;
        reports/html/<name>.html, each executed notebook as self-contained HTML (images embedded, no
        script or stylesheet fetched from a CDN); reports/index.html, the params, a fingerprint of the
        pipeline, links to the notebooks, the tables, metrics and figures inline, with relative links
        only; reports/provenance.json, reports/capabilities/<id>.html and reports/trajectories.html (each kept
        capability from its evidence to the test tasks it changed, and every stored episode:
        `evaluation.provenance`, `evaluation.pages`, reading data/rollouts, data/score, data/envs,
        data/adapters, data/train and data/evaluate); reports/metrics/report.json (counts).
The bytes are a function of those inputs alone (no timestamps), so an unchanged pipeline rebuilds an
unchanged page. What it writes is built in `evaluation.site` (the notebooks' HTML, the index, LLM costs, provenance
pages) and `evaluation.environments` (Table 1 across environments). This stage implements no part of the paper;
it presents the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trace_lib.config import Params
from trace_lib.evaluation.environments import environment_blocks, environments_markdown
from trace_lib.evaluation.pages import capability_links
from trace_lib.evaluation.site import (
    SELF,
    export_notebooks,
    git_commit,
    llm_costs_markdown,
    lock_digest,
    render_index,
    stage_times,
    write_provenance,
)
from trace_lib.io import atomic_write_text, write_json
from trace_lib.paths import Paths


def run_report(params: Params, root: Path = Path("."), *, params_path: str | Path | None = None,
               overrides: dict[str, Any] | None = None, self_name: str = SELF) -> dict[str, Any]:
    """Export the executed notebooks, write reports/index.html and reports/metrics/report.json.

    `params` is the resolved configuration the page shows; `params_path` (default `root/params.yaml`)
    is quoted verbatim, comments included, with the sweep's `overrides` under it."""
    paths = Paths(root)
    params_path = Path(params_path) if params_path is not None else Path(root) / "params.yaml"
    params_text = params_path.read_text(encoding="utf-8") if params_path.is_file() else ""
    notebooks = export_notebooks(paths.notebooks, paths.html, exclude=(self_name,))
    blocks = environment_blocks(params.env.name, params.report.environments, Path(root))
    if any(b.rows is not None for b in blocks) or params.report.environments:
        atomic_write_text(paths.table("environments"), environments_markdown(blocks))
    else:  # nothing evaluated anywhere: no table, and none left over from an earlier run
        paths.table("environments").unlink(missing_ok=True)
    atomic_write_text(paths.table("llm_costs"), llm_costs_markdown(params.env.user_cache_dir, Path(root)))
    tables = {p.stem: p.read_text(encoding="utf-8") for p in sorted(paths.tables.glob("*.md"))}
    # report.json is this stage's own output: quoting last run's counts would make the page drift.
    own = paths.metrics("report")
    metrics = {p.stem: json.loads(p.read_text(encoding="utf-8"))
               for p in sorted(paths.metrics_dir.glob("*.json")) if p != own}
    figures = [p.stem for p in sorted(paths.figures.glob("*.png"))]
    records = write_provenance(paths)
    page = render_index(params_text=params_text, resolved=params.model_dump(mode="json"), profile=params.profile,
                        overrides=overrides or {}, digest=lock_digest(paths.lock), commit=git_commit(root),
                        notebooks=notebooks, tables=tables, metrics=metrics, figures=figures, self_name=self_name,
                        capabilities=capability_links(records),
                        times=stage_times(paths.notebooks, exclude=(self_name,)))
    atomic_write_text(paths.index, page)
    summary = {"notebooks": len(notebooks), "exported": [n for n, _ in notebooks], "tables": len(tables),
               "metrics_files": len(metrics), "figures": len(figures), "capability_pages": len(records)}
    write_json(own, summary)
    return summary
