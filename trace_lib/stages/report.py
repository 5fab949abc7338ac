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
unchanged page. This stage implements no part of the paper; it presents the others.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import jinja2
import mistune
import nbformat
import pandas as pd
import yaml
from nbconvert import HTMLExporter

from trace_lib.config import Params
from trace_lib.evaluation.pages import capability_links, capability_page, viewer_page, viewer_rows
from trace_lib.evaluation.provenance import provenance, read_run
from trace_lib.evaluation.tables import (
    TABLE1_COLUMNS,
    EnvBlock,
    environments_table,
    findings,
    llm_cost_frame,
    markdown,
)
from trace_lib.io import atomic_write_text, iter_jsonl, write_json
from trace_lib.paths import Paths

SELF = "08_report"  # the notebook running this stage: still executing, so it cannot be exported
FIGURE_CAPTIONS = {
    "rollout_success_by_family": "The base model's success per task family on the train split, with 95% intervals "
                                 "(what discovery contrasts).",
    "score_error_rates": "Each candidate capability's error rate where the analyst labelled it PRESENT and where "
                         "LACKING (✓: kept).",
    "score_delta_coverage": "Contrastive gap Δ against coverage; the kept candidates lie past both thresholds.",
    "score_stability": "How often each candidate was kept across labelling runs, and its Δ in each run.",
    "train_curves": "Training per iteration: mean reward, on-policy success, groups with identical rewards and tool "
                    "calls, one line per adapter.",
    "train_efficiency": "The efficiency penalty's threshold and the tool calls of correct episodes per iteration "
                        "(empty when the reward has no efficiency term).",
    "train_vs_base": "Each adapter against the base model on its own environment's held-out seeds.",
    "train_rubric": "Each rubric item's mean per iteration (partial credit), per adapter.",
    "evaluate_success": "Test-split success per method with 95% intervals (Table 1's overall column).",
    "evaluate_routing_confusion": "The router's choice against the oracle's, per test task.",
    "evaluate_interference": "Each adapter on each capability's environment: the diagonal is the adapter at home.",
    "scaling": "Test success against training rollouts, TRACE and the baselines at intermediate budgets.",
}
"""Caption of each figure the stages draw; the index shows them in this order (the pipeline's), others after."""
TABLE_ORDER = ("table1", "environments", "routing", "interference", "capabilities", "scaling", "ablations",
               "llm_costs")

# JupyterLab's template, less the blocks that load require.js, MathJax, mermaid and widgets from a CDN:
# the notebooks hold no widgets or diagrams, and their formulas are written in Unicode.
_OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
"""

_CSS = """body{font:15px/1.45 system-ui,sans-serif;max-width:70em;margin:2em auto;padding:0 1em;color:#222}
h1,h2{border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.5em 0 1em;display:block;overflow-x:auto;max-width:100%}th,td{border:1px solid #ccc;padding:.25em .6em;max-width:32em}
th{background:#f3f3f3}tbody tr:nth-child(even){background:#fafafa}
pre{background:#f6f8fa;padding:.8em;overflow-x:auto;font-size:13px}
figure{display:inline-block;margin:0 1em 1em 0;vertical-align:top;max-width:46em}
figure img{max-width:100%;border:1px solid #eee}figcaption,.src{color:#666;font-size:13px}"""


def notebook_title(nb: nbformat.NotebookNode) -> str:
    """The first markdown heading of a notebook, or '' when it has none."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""


def export_notebook(nb: nbformat.NotebookNode) -> str:
    """One notebook as a self-contained HTML page (outputs' images are inlined as data URIs)."""
    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"offline.html.j2": _OFFLINE_TEMPLATE})],
                            template_file="offline.html.j2", embed_images=True)
    body, _ = exporter.from_notebook_node(nb)
    return body


def export_notebooks(src: Path, dest: Path, exclude: tuple[str, ...] = (SELF,)) -> list[tuple[str, str]]:
    """Export every `src/*.ipynb` but `exclude` to `dest/<name>.html`, sorted by name; drop stale pages.

    Returns (name, title) per exported notebook.
    """
    dest.mkdir(parents=True, exist_ok=True)  # an output of the stage even when nothing ran yet
    exported = []
    for path in sorted(src.glob("*.ipynb")):
        if path.stem in exclude:
            continue
        nb = nbformat.read(path, as_version=4)
        atomic_write_text(dest / f"{path.stem}.html", export_notebook(nb))
        exported.append((path.stem, notebook_title(nb)))
    keep = {f"{name}.html" for name, _ in exported}
    for old in dest.glob("*.html"):
        if old.name not in keep:
            old.unlink()
    return exported


def lock_digest(path: str | Path, skip: tuple[str, ...] = ("report",)) -> str | None:
    """md5 of dvc.lock's stages other than `skip`, as canonical JSON; None without a lock file.

    The report stage's own entry is left out: it records this page's hash, which changes after the page
    is written, so the digest of the whole file could never match the page that quotes it.
    """
    path = Path(path)
    if not path.is_file():
        return None
    lock = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    stages = {k: v for k, v in (lock.get("stages") or {}).items() if k not in skip}
    return hashlib.md5(json.dumps(stages, sort_keys=True).encode()).hexdigest()


def git_commit(root: Path) -> str | None:
    """The short commit of `root`'s checkout; None outside git or without a git binary."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def markdown_html(text: str, shift: int = 2) -> str:
    """Markdown (with pipe tables) to HTML, headings pushed `shift` levels down to nest under the page's."""
    body = mistune.create_markdown(escape=True, plugins=["table"])(text)
    return re.sub(r"<(/?)h([1-6])>", lambda m: f"<{m[1]}h{min(6, int(m[2]) + shift)}>", body)


def table_order(names: list[str]) -> list[str]:
    """The evaluate/scaling tables in paper order first, then any others by name."""
    known = [n for n in TABLE_ORDER if n in names]
    return known + sorted(n for n in names if n not in TABLE_ORDER)


PAPER_TABLE1 = (
    "| method | airline | retail | overall |\n| --- | --- | --- | --- |\n| base | 24.0 | 36.8 | 32.9 |\n"
    "| GRPO on target | 32.0 | 40.4 | 37.8 |\n| GEPA | 38.0 | 40.4 | 39.6 |\n"
    "| single-capability GRPO | 34.0 | 43.0 | 40.3 |\n| TRACE | 44.0 | 48.2 | 47.0 |\n")
"""The paper's Table 1 as its authors' code evaluates it (success %)."""
PAPER_SETTING = ("The paper's setting: Qwen3-30B-A3B on τ²-bench airline and retail, all 164 tasks, one trial at "
                 "temperature 0, an LLM analyst (Kang et al., arXiv 2604.05336; the authors' repository).")
NEXT_STEPS = (
    ("Run the pipeline on the phone environment and see both in Table 1 across environments", "make phone"),
    ("Let Claude label and propose capabilities (needs ANTHROPIC_API_KEY)",
     "source .venv/bin/activate && dvc exp run -S analyst.backend=anthropic"),
    ("The GPU-sized run (10 iterations of 8 x 8 rollouts per adapter, every method)",
     "source .venv/bin/activate && dvc exp run -S profile=gpu"),
    ("Read every notebook beside its source", "make lab"),
)
"""What a reader can run next, each with its command (docs/scale.md has the rest)."""


class StageTime(NamedTuple):
    """When a stage's notebook ran under papermill, from the executed notebook's own metadata."""

    name: str
    start: str
    """ISO 8601 start time, UTC."""
    seconds: float


def stage_times(src: Path, exclude: tuple[str, ...] = (SELF,)) -> list[StageTime]:
    """Every executed notebook's start and wall time (papermill's metadata), by name; notebooks without
    that metadata (run by hand) are left out."""
    out = []
    for path in sorted(src.glob("*.ipynb")):
        if path.stem in exclude:
            continue
        meta = nbformat.read(path, as_version=4).metadata.get("papermill", {})
        if meta.get("start_time") and isinstance(meta.get("duration"), (int, float)):
            out.append(StageTime(path.stem, str(meta["start_time"]), float(meta["duration"])))
    return out


def duration_text(seconds: float) -> str:
    """'42 s', '3 min 5 s' or '1 h 2 min'."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def times_line(times: list[StageTime]) -> str:
    """One sentence: when the stages ran and each one's wall time."""
    starts = sorted(t.start[:16].replace("T", " ") for t in times)
    when = starts[0] if len(starts) == 1 else f"between {starts[0]} and {starts[-1]}"
    return (f"Stages started {when} UTC; wall time {duration_text(sum(t.seconds for t in times))} in all: "
            + ", ".join(f"{t.name.split('_', 1)[-1]} {duration_text(t.seconds)}" for t in times)
            + " (a stage DVC found up to date keeps the time of the run that made its outputs).")


def what_ran(resolved: dict[str, Any] | None, metrics: dict[str, Any],
             times: list[StageTime] | None = None) -> list[str]:
    """What ran, in sentences computed from the resolved params, the evaluation's metrics and the executed
    notebooks' times."""
    if not resolved:
        return []
    env, ev = resolved.get("env", {}), metrics.get("evaluate", {})
    out = [f"Profile {resolved.get('profile')}: model {resolved.get('model', {}).get('id')} on the "
           f"{env.get('name')} environment ({', '.join(env.get('families') or []) or 'its default families'})."]
    if ev:
        out.append(f"Evaluated on the {ev.get('split')} split: {ev.get('tasks')} tasks, greedy; TRACE's rollout "
                   f"budget {budget_text(ev.get('trace_budget'))}, the baselines trained to the same total.")
    if times:
        out.append(times_line(times))
    return out


def budget_text(budget: Any) -> str:
    """TRACE's ledger in words: '320 rollouts (48 discovery, 176 calibration and transfer checks, 96 training:
    communicate_result 96)'."""
    if not isinstance(budget, dict):
        return f"{budget} rollouts"
    adapters = budget.get("by_adapter") or {}
    parts = [f"{budget.get('discovery', 0)} discovery",
             f"{budget.get('synthesize', 0)} calibration and transfer checks",
             f"{sum(adapters.values())} training" + (": " + ", ".join(f"{k} {v}" for k, v in adapters.items())
                                                     if adapters else "")]
    return f"{budget.get('total')} rollouts ({', '.join(parts)})"


def figure_order(names: list[str]) -> list[str]:
    """Figures in pipeline order (`FIGURE_CAPTIONS`), any other after them by name."""
    known = [n for n in FIGURE_CAPTIONS if n in names]
    return known + sorted(n for n in names if n not in FIGURE_CAPTIONS)


def metrics_html(name: str, data: Any) -> str:
    """A key/value table of a metrics file's top-level scalars, and the whole JSON folded below it."""
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v, ensure_ascii=False))}</td></tr>"
                   for k, v in sorted(data.items()) if isinstance(v, (str, int, float, bool)) or v is None
                   ) if isinstance(data, dict) else ""
    pretty = html.escape(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False))
    return (f'<h3 id="metrics-{quote(name)}">{html.escape(name)}</h3>'
            + (f"<table><tbody>{rows}</tbody></table>" if rows else "")
            + f"<details><summary>reports/metrics/{html.escape(name)}.json</summary><pre>{pretty}</pre></details>")


def render_index(*, params_text: str, resolved: dict | None, profile: str, overrides: dict, digest: str | None,
                 commit: str | None, notebooks: list[tuple[str, str]], tables: dict[str, str],
                 metrics: dict[str, Any], figures: list[str], self_name: str = SELF,
                 capabilities: str = "", times: list[StageTime] | None = None) -> str:
    """The index page from already-read inputs (pure: equal inputs give equal bytes)."""
    esc = html.escape
    nb_items = "".join(f'<li><a href="html/{quote(n)}.html">{esc(n)}</a>{" — " + esc(t) if t else ""}</li>'
                       for n, t in notebooks)
    nb_items += (f'<li><a href="notebooks/{quote(self_name)}.ipynb">{esc(self_name)}</a> — this page\'s '
                 "notebook (still running while the page is built, so linked as .ipynb, not exported)</li>")
    found = findings(metrics["evaluate"]) if "evaluate" in metrics else []
    nav = [("findings", found), ("run", not found and resolved), ("capabilities", capabilities), ("notebooks", True), ("tables", tables),
           ("figures", figures), ("metrics", metrics), ("params", True)]
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>TRACE pipeline report</title><style>{_CSS}</style></head><body>",
        "<h1>TRACE pipeline report</h1>",
        f"<p>profile <b>{esc(profile)}</b> · pipeline fingerprint <code>{esc(digest or 'no dvc.lock')}</code>"
        " (md5 of dvc.lock without its report entry) · commit "
        f"<code>{esc(commit or 'unknown')}</code></p>",
        "<p>The method: TRACE, capability-targeted agentic training (Kang et al., arXiv 2604.05336).</p>",
        "<p>" + " · ".join(f'<a href="#{key}">{key}</a>' for key, shown in nav if shown) + "</p>",
    ]
    ran = what_ran(resolved, metrics, times)
    if found or ran:
        parts += ['<h2 id="findings">Findings</h2>' if found else '<h2 id="run">This run</h2>',
                  "<ul>" + "".join(f"<li>{esc(line)}</li>" for line in ran + found) + "</ul>",
                  '<p class="src">computed from params.yaml, reports/metrics/evaluate.json and the executed '
                  "notebooks' papermill metadata</p>",
                  "<details><summary>The paper's Table 1, for its setting (not this run's)</summary>"
                  f"{markdown_html(PAPER_TABLE1)}<p class=\"src\">{esc(PAPER_SETTING)}</p></details>"
                  if found else "",
                  "<h3>Next</h3><ul>" + "".join(f"<li>{esc(what)}: <code>{esc(cmd)}</code></li>"
                                                for what, cmd in NEXT_STEPS) + "</ul>"]
    if capabilities:
        parts += ['<h2 id="capabilities">Capabilities: from the failures to the tasks changed</h2>', capabilities,
                  '<p><a href="trajectories.html">Every episode of the run</a> (rollouts and evaluation, filterable)'
                  ' · <a href="provenance.json">provenance.json</a></p>']
    parts += ['<h2 id="notebooks">Executed notebooks</h2>', f"<ul>{nb_items}</ul>"]
    if tables:
        parts.append('<h2 id="tables">Tables</h2>')
        for name in table_order(list(tables)):
            parts.append(f'<section class="table" id="table-{quote(name)}">{markdown_html(tables[name])}'
                         f'<p class="src">reports/tables/{esc(name)}.md</p></section>')
    if figures:
        parts.append('<h2 id="figures">Figures</h2>')
        for name in figure_order(figures):
            alt = esc(name.replace("_", " "))
            caption = f"{esc(FIGURE_CAPTIONS[name])} " if name in FIGURE_CAPTIONS else ""
            parts.append(f'<figure><img src="figures/{quote(name)}.png" alt="{alt}">'
                         f'<figcaption>{caption}<span class="src">{esc(name)}.png</span></figcaption></figure>')
    if metrics:
        parts.append('<h2 id="metrics">Metrics</h2>')
        parts += [metrics_html(name, metrics[name]) for name in sorted(metrics)]
    parts += ['<h2 id="params">Parameters</h2>',
              f"<details open><summary>params.yaml</summary><pre>{esc(params_text or '(no params.yaml)')}</pre>"
              "</details>"]
    if overrides:
        parts.append(f"<p>overrides: <code>{esc(json.dumps(overrides, sort_keys=True))}</code></p>")
    if resolved is not None:
        parts.append("<details><summary>resolved (profile defaults filled in)</summary><pre>"
                     f"{esc(json.dumps(resolved, indent=2, sort_keys=True, ensure_ascii=False))}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


TABLE1_NEEDS = ("method", "key", "column", "status", "n", "successes", "success_rate", "ci_low", "ci_high")


def env_block(env: str, root: Path, source: str, own: bool = False) -> EnvBlock:
    """One environment's Table 1 block from a run's root (this one, `own`, or another), or why there is
    none: no such folder, no evaluation there, an unreadable file, or a run of another environment."""
    paths = Paths(root)
    table, metrics = paths.table("table1", ".csv"), paths.metrics("evaluate")
    if not Path(root).is_dir():
        return EnvBlock(env, source, None, reason=f"{source}: no such folder")
    if not table.is_file() or not metrics.is_file():
        missing = "reports/tables/table1.csv" if not table.is_file() else "reports/metrics/evaluate.json"
        return EnvBlock(env, source, None, reason=f"{source}: no {missing} (has its evaluate stage run?)")
    try:
        info = json.loads(metrics.read_text(encoding="utf-8"))
        if not isinstance(info, dict):
            raise ValueError("evaluate.json is not a JSON object")
        rows = pd.read_csv(table)
        lacking = [c for c in TABLE1_NEEDS if c not in rows.columns]
        if lacking:
            raise ValueError(f"table1.csv has no column {lacking}")
    except (OSError, ValueError, pd.errors.ParserError) as err:  # EmptyDataError is a ValueError
        return EnvBlock(env, source, None, reason=f"{source}: unreadable ({err})")
    envs = info.get("envs") if isinstance(info.get("envs"), list) else []
    if own:  # this run's block is what this run evaluated (several environments under `evaluate.envs`)
        env = ", ".join(map(str, envs)) or env
    elif envs != [env]:
        return EnvBlock(env, source, None, reason=f"{source}: evaluated on {envs}, not [{env!r}]")
    graded = bool(set(envs) & set(info.get("graded_envs", []))) if "graded_envs" in info else bool(
        "mean_reward" in rows and ((rows["mean_reward"] > 0) & (rows["mean_reward"] < 1)).any())
    detail = f"{info.get('split', '?')} split, {info.get('tasks', '?')} tasks"
    return EnvBlock(env, source, rows.reindex(columns=TABLE1_COLUMNS), graded=graded, detail=detail)


def environment_blocks(params: Params, root: Path) -> list[EnvBlock]:
    """This run's block first, then one per `report.environments` entry (relative roots from `root`)."""
    blocks = [env_block(params.env.name, root, "this run", own=True)]
    for env, other in params.report.environments.items():
        if env == params.env.name:
            continue  # this run is that environment's block
        where = Path(other)
        where = where if where.is_absolute() else root / where
        if where.resolve() == Path(root).resolve():
            blocks.append(EnvBlock(env, other, None, reason=f"{other}: that is this run's own folder"))
            continue
        blocks.append(env_block(env, where, other))
    return blocks


def environments_markdown(blocks: list[EnvBlock]) -> str:
    """reports/tables/environments.md: the table, where each block comes from, and the missing ones' reasons. A run
    whose folder does not exist yet (e.g. the phone before `make phone`) is named in the note, not given a column."""
    sources = "; ".join(f"{b.env}: {b.source}" + (f" ({b.detail})" if b.detail else "")
                        + (f" (not shown: {b.reason})" if b.rows is None else "") for b in blocks)
    shown = [b for i, b in enumerate(blocks) if i == 0 or b.rows is not None or not b.reason.endswith("no such folder")]
    note = ("Each block is one run of the pipeline on that environment (its own discovered capabilities, "
            "adapters and evaluation split), read from the run's reports/tables/table1.csv: overall success % "
            "with its 95% Wilson interval (a run written without one: its bootstrap interval over tasks) and "
            "successes/tasks; on a graded environment success means a perfect score and the mean reward "
            "(milestone similarity) follows; rollouts = training episodes behind the method. Runs: " + sources
            + ". Another environment's block comes from `report.environments` in params.yaml (e.g. "
            "`{phone: sweeps/phone}`, which `make phone` fills).")
    return "# Table 1 across environments\n\n" + note + "\n\n" + markdown(environments_table(shown))


def llm_ledgers(params: Params, root: Path) -> list[Path]:
    """Every LLM ledger a run writes, in pipeline order (the LLM user's with its persistent cache)."""
    paths = Paths(root)
    user = Path(params.env.user_cache_dir)
    return [paths.discover_ledger, paths.score_ledger, paths.synth_ledger, paths.oracle_llm, paths.gepa_llm,
            user / "ledger.jsonl" if user.is_absolute() else Path(root) / user / "ledger.jsonl"]


def llm_costs_markdown(params: Params, root: Path) -> str:
    """The LLM cost table (`evaluation.tables.llm_cost_frame`) over the run's ledgers, as markdown."""
    frame = llm_cost_frame([list(iter_jsonl(p)) for p in llm_ledgers(params, root) if p.is_file()])
    head = ("# LLM calls and their cost\n\nEvery call the run's LLM parts made (analyst, synthesizer, GEPA's "
            "reflection, the LLM user), from their ledgers; tokens and cost count the requests sent, a cache hit is "
            "free. Prices: `analyst.prices` on top of the built-in Claude list prices; a model without one shows "
            "'no price'.\n\n")
    if frame.empty:
        return head + ("No LLM call was made: the rules analyst, the template synthesizer and scripted users need "
                       "none.\n")
    return head + markdown(frame)


def write_provenance(paths: Paths) -> list[dict[str, Any]]:
    """reports/provenance.json, a page per kept capability (the folder rebuilt whole, so no page of an earlier
    run's capability stays) and the episode viewer; returns the records."""
    run = read_run(paths.root)
    records = provenance(run)
    write_json(paths.provenance, records)
    train = {t.id: t for t in run.train_episodes}
    shutil.rmtree(paths.capability_pages, ignore_errors=True)
    for record in records:
        atomic_write_text(paths.capability_pages / f"{record['capability']['id']}.html",
                          capability_page(record, train, run.evaluation))
    evidence_of: dict[str, list[str]] = {}
    for cap in run.kept:
        for tid in cap.evidence:
            evidence_of.setdefault(tid, []).append(cap.id)
    atomic_write_text(paths.trajectory_viewer, viewer_page(viewer_rows(run.train_episodes, run.evaluation,
                                                                       evidence_of)))
    return records


def run_report(params: Params, root: Path = Path("."), *, params_path: str | Path | None = None,
               overrides: dict[str, Any] | None = None, self_name: str = SELF) -> dict[str, Any]:
    """Export the executed notebooks, write reports/index.html and reports/metrics/report.json.

    `params` is the resolved configuration the page shows; `params_path` (default `root/params.yaml`)
    is quoted verbatim, comments included, with the sweep's `overrides` under it."""
    paths = Paths(root)
    params_path = Path(params_path) if params_path is not None else Path(root) / "params.yaml"
    params_text = params_path.read_text(encoding="utf-8") if params_path.is_file() else ""
    notebooks = export_notebooks(paths.notebooks, paths.html, exclude=(self_name,))
    blocks = environment_blocks(params, Path(root))
    if any(b.rows is not None for b in blocks) or params.report.environments:
        atomic_write_text(paths.table("environments"), environments_markdown(blocks))
    else:  # nothing evaluated anywhere: no table, and none left over from an earlier run
        paths.table("environments").unlink(missing_ok=True)
    atomic_write_text(paths.table("llm_costs"), llm_costs_markdown(params, Path(root)))
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
