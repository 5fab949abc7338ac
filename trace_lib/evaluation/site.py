"""The report's site: each executed notebook as self-contained HTML, the index page over everything a run wrote,
the run's LLM costs, and the provenance pages.

Reads executed notebooks, dvc.lock, the run's LLM ledgers and its records (`evaluation.provenance.read_run`);
`export_notebooks`, `write_provenance` write reports/html/ and the provenance pages, `render_index` returns the
index page's HTML, which the report stage (`stages/report.py`) writes. The bytes are a function of the inputs
alone (no timestamps), so an unchanged pipeline rebuilds an unchanged page.
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
import yaml
from nbconvert import HTMLExporter

from trace_lib.evaluation.pages import capability_page, viewer_page, viewer_rows
from trace_lib.evaluation.provenance import provenance, read_run
from trace_lib.evaluation.tables import findings, llm_cost_frame, markdown
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


def llm_ledgers(user_cache_dir: str | Path, root: Path) -> list[Path]:
    """Every LLM ledger a run writes, in pipeline order (the LLM user's with its persistent cache,
    `env.user_cache_dir`)."""
    paths = Paths(root)
    user = Path(user_cache_dir)
    return [paths.discover_ledger, paths.score_ledger, paths.synth_ledger, paths.oracle_llm, paths.gepa_llm,
            user / "ledger.jsonl" if user.is_absolute() else Path(root) / user / "ledger.jsonl"]


def llm_costs_markdown(user_cache_dir: str | Path, root: Path) -> str:
    """The LLM cost table (`evaluation.tables.llm_cost_frame`) over the run's ledgers (`llm_ledgers`), as markdown."""
    frame = llm_cost_frame([list(iter_jsonl(p)) for p in llm_ledgers(user_cache_dir, root) if p.is_file()])
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
