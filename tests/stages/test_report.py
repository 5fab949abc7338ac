"""Report stage: notebook export, the index page, the lock fingerprint, and the page in headless Chromium."""

from __future__ import annotations

import base64
import html
import io
import json
import re
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import nbformat
import pandas as pd
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from browser import browser_check, chromium
from trace_lib.config import Params, load_params
from trace_lib.evaluation.environments import EnvBlock, environment_blocks, environments_markdown, environments_table
from trace_lib.evaluation.site import export_notebooks, git_commit, lock_digest, markdown_html, table_order
from trace_lib.stages.report import run_report

REPO = Path(__file__).resolve().parents[2]
TABLE1 = "# Table 1\n\nSuccess rate (%).\n\n| method | retail |\n| --- | --- |\n| base | 24.0 |\n| TRACE | 44.0 |\n"
ROUTING = "# Routing vs merging\n\n| mode | success |\n| --- | --- |\n| argmax | 0.5 |\n"
EXTRA = "# Extra\n\n| a \\| b | c |\n| --- | --- |\n| 1 | — |\n"


def blocks_of(params: Params, root: Path) -> list[EnvBlock]:
    """The report stage's environment blocks for `params` (this run's `env.name`, `report.environments`)."""
    return environment_blocks(params.env.name, params.report.environments, root)


def png_bytes(color: str) -> bytes:
    fig, ax = plt.subplots(figsize=(1.5, 1.0), dpi=40)
    ax.plot([0, 1], [0, 1], color=color)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def fake_notebook(title: str, png: bytes) -> nbformat.NotebookNode:
    out = new_output("display_data", data={"image/png": base64.b64encode(png).decode(), "text/plain": "<Figure>"})
    return new_notebook(cells=[new_markdown_cell(f"# {title}\n\nText."), new_code_cell("plot()", outputs=[out])],
                        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


def fake_lock(report_md5: str, train_md5: str = "aaa") -> str:
    return ("schema: '2.0'\nstages:\n  train:\n    cmd: papermill train\n    outs:\n    - path: data/adapters\n"
            f"      md5: {train_md5}\n  report:\n    cmd: papermill report\n    outs:\n"
            f"    - path: reports/index.html\n      md5: {report_md5}\n")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A project folder as the earlier stages leave it: executed notebooks, tables, metrics, figures."""
    reports = tmp_path / "reports"
    for sub in ("notebooks", "tables", "metrics", "figures"):
        (reports / sub).mkdir(parents=True)
    nbformat.write(fake_notebook("00 · Alpha", png_bytes("red")), reports / "notebooks" / "00_alpha.ipynb")
    nbformat.write(fake_notebook("01 · Beta", png_bytes("blue")), reports / "notebooks" / "01_beta.ipynb")
    nbformat.write(fake_notebook("08 · Report", png_bytes("green")), reports / "notebooks" / "08_report.ipynb")
    (reports / "tables" / "routing.md").write_text(ROUTING)
    (reports / "tables" / "table1.md").write_text(TABLE1)
    (reports / "tables" / "extra.md").write_text(EXTRA)
    (reports / "tables" / "table1.csv").write_text("method,retail\n")
    (reports / "metrics" / "rollout.json").write_text(json.dumps({"success_rate": 0.25, "by_family": {"a": 1}}))
    (reports / "metrics" / "report.json").write_text(json.dumps({"notebooks": 99}))  # last run's, not shown
    (reports / "figures" / "score_error_rates.png").write_bytes(png_bytes("black"))
    (reports / "figures" / "train_curves.png").write_bytes(png_bytes("orange"))
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "dvc.lock").write_text(fake_lock("old"))
    return tmp_path


def test_export_notebooks_is_self_contained_and_skips_the_running_one(tree: Path):
    dest = tree / "reports" / "html"
    dest.mkdir()
    (dest / "07_gone.html").write_text("stale")
    exported = export_notebooks(tree / "reports" / "notebooks", dest)
    assert exported == [("00_alpha", "00 · Alpha"), ("01_beta", "01 · Beta")]
    assert sorted(p.name for p in dest.iterdir()) == ["00_alpha.html", "01_beta.html"]
    page = (dest / "00_alpha.html").read_text()
    assert "data:image/png;base64," in page and "00 · Alpha" in page
    assert not re.search(r'(src|href)="(https?:)?//', page), "the exported page loads something from the network"


def test_lock_digest_leaves_out_the_report_entry(tmp_path: Path):
    a, b, c = tmp_path / "a.lock", tmp_path / "b.lock", tmp_path / "c.lock"
    a.write_text(fake_lock("one"))
    b.write_text(fake_lock("two"))
    c.write_text(fake_lock("one", train_md5="bbb"))
    assert lock_digest(a) == lock_digest(b) != lock_digest(c)
    assert re.fullmatch(r"[0-9a-f]{32}", lock_digest(a))
    assert lock_digest(tmp_path / "missing.lock") is None


def test_markdown_tables_and_order():
    body = markdown_html(EXTRA)
    assert "<h3>Extra</h3>" in body and "<table>" in body and "<th>a | b</th>" in body
    assert table_order(["zeta", "routing", "ablations", "table1", "alpha"]) == [
        "table1", "routing", "ablations", "alpha", "zeta"]


def test_git_commit_is_none_outside_a_checkout(tmp_path: Path):
    assert git_commit(tmp_path) is None


def test_run_report_writes_index_and_metrics(tree: Path):
    metrics = run_report(load_params(tree / "params.yaml"), tree)
    assert metrics == {"notebooks": 2, "exported": ["00_alpha", "01_beta"], "tables": 5, "metrics_files": 1,
                       "figures": 2, "capability_pages": 0}  # the three above, Table 1 across environments (params.yaml names the phone)
    # and the LLM cost table, which says no LLM was called
    assert "No LLM call was made" in (tree / "reports" / "tables" / "llm_costs.md").read_text()
    assert json.loads((tree / "reports" / "metrics" / "report.json").read_text()) == metrics
    page = (tree / "reports" / "index.html").read_text()
    for link in ('href="html/00_alpha.html"', 'href="html/01_beta.html"', 'href="notebooks/08_report.ipynb"'):
        assert link in page
    assert 'href="html/08_report.html"' not in page
    assert '<img src="figures/score_error_rates.png" alt="score error rates">' in page
    assert page.index('id="table-table1"') < page.index('id="table-routing"') < page.index('id="table-extra"')
    assert "<td>TRACE</td>" in page and 'id="table-interference"' not in page  # missing tables are just absent
    assert "success_rate" in page and "<details>" in page and '"notebooks": 99' not in page
    assert "profile <b>cpu</b>" in page and lock_digest(tree / "dvc.lock") in page and "commit <code>unknown" in page
    assert "delta: 0.20" in page  # params.yaml verbatim, comments included
    assert 'id="findings"' not in page  # nothing evaluated: no findings to state
    assert not re.search(r'(src|href)="(https?:)?//', page)
    first = page.encode()
    (tree / "dvc.lock").write_text(fake_lock("new"))  # only the report's own entry changed
    run_report(load_params(tree / "params.yaml"), tree)
    assert (tree / "reports" / "index.html").read_bytes() == first, "same inputs must give the same bytes"


def test_run_report_with_nothing_upstream(tmp_path: Path):
    metrics = run_report(Params(), tmp_path)
    assert metrics["notebooks"] == metrics["figures"] == 0 and metrics["tables"] == 1  # the LLM cost table
    assert (tmp_path / "reports" / "html").is_dir()
    page = (tmp_path / "reports" / "index.html").read_text()
    assert "(no params.yaml)" in page and "no dvc.lock" in page and 'id="table-table1"' not in page


# --- Table 1 across environments ---------------------------------------------------------------------
CSV_HEAD = ("method,key,column,status,n,successes,success_rate,ci_low,ci_high,mean_reward,reward_ci_low,"
            "reward_ci_high,rollouts,reason\n")


def table1_csv(rows: list[tuple]) -> str:
    """table1.csv as the evaluate stage writes it: (label, key, status, n, successes, mean reward, rollouts)."""
    lines = []
    for label, key, status, n, k, reward, rollouts in rows:
        rate = "" if n is None else k / n
        lines.append(f"{label},{key},fam,{status},{n or ''},{k if n else ''},{rate},{rate},{rate},{reward or ''},"
                     f"{reward or ''},{reward or ''},{rollouts if rollouts is not None else ''},\n")
        lines.append(f"{label},{key},overall,{status},{n or ''},{k if n else ''},{rate},"
                     f"{'' if n is None else max(0.0, rate - 0.1)},{'' if n is None else min(1.0, rate + 0.1)},"
                     f"{'' if reward is None else reward},{'' if reward is None else reward / 2},"
                     f"{'' if reward is None else reward * 1.5},{rollouts if rollouts is not None else ''},"
                     f"{'why' if status != 'run' else ''}\n")
    return CSV_HEAD + "".join(lines)


def write_run(root: Path, env: str, rows: list[tuple], graded: bool) -> None:
    (root / "reports" / "tables").mkdir(parents=True, exist_ok=True)
    (root / "reports" / "metrics").mkdir(parents=True, exist_ok=True)
    (root / "reports" / "tables" / "table1.csv").write_text(table1_csv(rows))
    (root / "reports" / "metrics" / "evaluate.json").write_text(
        json.dumps({"envs": [env], "graded_envs": [env] if graded else []}))


RETAIL_ROWS = [("base", "base", "run", 14, 2, 1 / 7, 0), ("GRPO on target", "grpo_target", "not run", None, 0, None, None),
               ("TRACE (argmax)", "trace_argmax", "run", 14, 4, 2 / 7, 60)]
PHONE_ROWS = [("base", "base", "run", 32, 1, 0.05, 0), ("TRACE (argmax)", "trace_argmax", "run", 32, 3, 0.125, 44),
              ("oracle routing", "oracle_route", "run", 32, 2, 0.1, 44)]


def test_environments_table_puts_each_environment_beside_the_others(tmp_path: Path):
    import pandas as pd

    write_run(tmp_path / "r", "retail", RETAIL_ROWS, graded=False)
    write_run(tmp_path / "p", "phone", PHONE_ROWS, graded=True)
    blocks = [EnvBlock("retail", "this run", pd.read_csv(tmp_path / "r/reports/tables/table1.csv")),
              EnvBlock("phone", "sweeps/phone", pd.read_csv(tmp_path / "p/reports/tables/table1.csv"), graded=True),
              EnvBlock("tau2-airline", "sweeps/air", None, reason="missing")]
    table = environments_table(blocks)
    assert list(table.columns) == [
        "method", "retail: success % [95% CI] (k/n)", "retail: rollouts", "phone: perfect % [95% CI] (k/n)",
        "phone: mean reward [95% CI]", "phone: rollouts", "tau2-airline: success % [95% CI] (k/n)",
        "tau2-airline: rollouts"]
    rows = {r["method"]: r for r in table.to_dict("records")}
    assert list(rows) == ["base", "GRPO on target", "TRACE (argmax)", "oracle routing"]  # first block's order first
    assert rows["base"]["retail: success % [95% CI] (k/n)"] == "14.3 [4.3, 24.3] (2/14)"
    assert rows["TRACE (argmax)"]["phone: perfect % [95% CI] (k/n)"] == "9.4 [0.0, 19.4] (3/32)"
    assert rows["TRACE (argmax)"]["phone: mean reward [95% CI]"] == "0.125 [0.062, 0.188]"
    assert rows["TRACE (argmax)"]["phone: rollouts"] == "44" and rows["TRACE (argmax)"]["retail: rollouts"] == "60"
    assert rows["GRPO on target"]["retail: success % [95% CI] (k/n)"] == "not run"
    assert rows["GRPO on target"]["phone: perfect % [95% CI] (k/n)"] == "not in that run"
    assert rows["oracle routing"]["retail: success % [95% CI] (k/n)"] == "not in that run"
    assert rows["base"]["tau2-airline: success % [95% CI] (k/n)"] == "no run"


def test_a_method_labelled_per_run_names_each_environments_choice(tmp_path: Path):
    import pandas as pd

    from trace_lib.evaluation.environments import method_label_across

    best = "single_best"
    write_run(tmp_path / "r", "retail", [*RETAIL_ROWS, ("single-capability (best: a)", best, "run", 14, 2, 1 / 7, 16)],
              graded=False)
    write_run(tmp_path / "p", "phone", [*PHONE_ROWS, ("single-capability (best: b)", best, "run", 32, 1, 0.05, 16)],
              graded=True)
    blocks = [EnvBlock("retail", "this run", pd.read_csv(tmp_path / "r/reports/tables/table1.csv")),
              EnvBlock("phone", "sweeps/phone", pd.read_csv(tmp_path / "p/reports/tables/table1.csv"), graded=True)]
    labels = list(environments_table(blocks)["method"])
    assert "single-capability (best: retail a; phone b)" in labels and "base" in labels
    assert method_label_across({"retail": "x (k: 1)", "phone": "x (k: 1)"}) == "x (k: 1)"
    assert method_label_across({"retail": "x (one)", "phone": "x (two)"}) == "x (retail: one; phone: two)"
    assert method_label_across({"retail": "x", "phone": "y"}) == "retail: x; phone: y"


def test_report_reads_the_other_runs_named_in_params(tmp_path: Path):
    write_run(tmp_path, "retail", RETAIL_ROWS, graded=False)
    write_run(tmp_path / "sweeps" / "phone", "phone", PHONE_ROWS, graded=True)
    write_run(tmp_path / "elsewhere", "retail", RETAIL_ROWS, graded=False)
    params = Params.model_validate({"report": {"environments": {
        "phone": "sweeps/phone", "tau2-retail": "missing", "tau2-airline": str(tmp_path / "elsewhere"),
        "retail": "ignored: this run is the retail block"}}})
    blocks = blocks_of(params, tmp_path)
    assert [(b.env, b.source, b.rows is not None, b.graded) for b in blocks] == [
        ("retail", "this run", True, False), ("phone", "sweeps/phone", True, True),
        ("tau2-retail", "missing", False, False), ("tau2-airline", str(tmp_path / "elsewhere"), False, False)]
    assert blocks[2].reason == "missing: no such folder"
    assert blocks[3].reason.endswith("evaluated on ['retail'], not ['tau2-airline']")
    text = environments_markdown(blocks)
    assert text.startswith("# Table 1 across environments\n")
    assert "phone: sweeps/phone (? split, ? tasks); tau2-retail: missing (not shown: missing: no such folder)" in text
    assert "| TRACE (argmax) | 28.6 [18.6, 38.6] (4/14) | 60 | 9.4 [0.0, 19.4] (3/32) | 0.125 [0.062, 0.188] | 44 |" in text

    run_report(params, tmp_path)
    page = (tmp_path / "reports" / "index.html").read_text()
    assert 'id="table-environments"' in page and "9.4 [0.0, 19.4] (3/32)" in page


@pytest.mark.parametrize("table,metrics,reason", [
    ("", '{"envs": ["phone"]}', "unreadable (No columns to parse from file)"),
    ('a,"b\n1,2', '{"envs": ["phone"]}', "unreadable"),
    (None, "{not json", "unreadable"),
    (None, "[1, 2]", "unreadable (evaluate.json is not a JSON object)"),
    ("method,key\nbase,base\n", '{"envs": ["phone"]}', "unreadable (table1.csv has no column ['column', 'status'"),
])
def test_an_unreadable_other_run_is_a_reason_not_a_crash(tmp_path: Path, table, metrics, reason):
    other = tmp_path / "other"
    write_run(other, "phone", PHONE_ROWS, graded=True)
    if table is not None:
        (other / "reports" / "tables" / "table1.csv").write_text(table)
    (other / "reports" / "metrics" / "evaluate.json").write_text(metrics)
    (block,) = blocks_of(Params.model_validate({"report": {"environments": {"phone": str(other)}}}),
                                  tmp_path)[1:]
    assert block.rows is None and block.reason.startswith(f"{other}: {reason}"), block.reason
    assert f"(not shown: {block.reason})" in environments_markdown([block])


def test_older_and_odd_tables_still_give_cells(tmp_path: Path):
    """A table1.csv from before the mean-reward columns, and a run row with an empty count."""
    import pandas as pd

    write_run(tmp_path, "retail", RETAIL_ROWS, graded=False)
    path = tmp_path / "reports" / "tables" / "table1.csv"
    old = pd.read_csv(path).drop(columns=["mean_reward", "reward_ci_low", "reward_ci_high"])
    old.loc[(old["key"] == "trace_argmax") & (old["column"] == "overall"), "successes"] = None
    old.to_csv(path, index=False)
    (tmp_path / "reports" / "metrics" / "evaluate.json").write_text(json.dumps({"envs": ["retail"]}))
    (block,) = blocks_of(Params(), tmp_path)
    rows = {r["method"]: r for r in environments_table([block]).to_dict("records")}
    assert rows["base"]["retail: success % [95% CI] (k/n)"] == "14.3 [4.3, 24.3] (2/14)"
    assert rows["TRACE (argmax)"]["retail: success % [95% CI] (k/n)"] == "unreadable"


def test_this_runs_block_is_what_it_evaluated_and_the_own_folder_is_not_read_twice(tmp_path: Path):
    write_run(tmp_path, "tau2-retail", RETAIL_ROWS, graded=False)
    (tmp_path / "reports" / "metrics" / "evaluate.json").write_text(
        json.dumps({"envs": ["tau2-retail", "tau2-airline"], "graded_envs": [], "split": "test", "tasks": 164}))
    params = Params.model_validate({"env": {"name": "tau2-retail"}, "report": {"environments": {"phone": "."}}})
    own, other = blocks_of(params, tmp_path)
    assert own.env == "tau2-retail, tau2-airline" and own.rows is not None and own.detail == "test split, 164 tasks"
    assert other.rows is None and other.reason == ".: that is this run's own folder"


def test_no_environments_table_without_any_evaluation(tmp_path: Path):
    (tmp_path / "reports" / "tables").mkdir(parents=True)
    (tmp_path / "reports" / "tables" / "environments.md").write_text("stale")
    run_report(Params(), tmp_path)
    assert not (tmp_path / "reports" / "tables" / "environments.md").exists()


def test_a_run_not_made_yet_is_named_in_the_note_not_given_a_column():

    rows = pd.DataFrame([{"method": "base", "key": "base", "column": "overall", "status": "run", "n": 2,
                          "successes": 1, "success_rate": 0.5, "ci_low": 0.0, "ci_high": 1.0, "rollouts": 0}])
    text = environments_markdown([EnvBlock("retail", "this run", rows),
                                  EnvBlock("phone", "sweeps/phone", None, reason="sweeps/phone: no such folder")])
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    assert "phone" not in header and "retail" in header
    assert "phone: sweeps/phone (not shown: sweeps/phone: no such folder)" in text and "make phone" in text


def test_report_environments_are_the_registry_and_a_typo_is_named():
    import typing

    from trace_lib.config import ConfigError, ReportConfig, params_from_dict
    from trace_lib.envs import env_names

    key_type = typing.get_args(ReportConfig.model_fields["environments"].annotation)[0]
    assert sorted(typing.get_args(key_type)) == env_names()
    with pytest.raises(ConfigError, match="report.environments.phon"):
        params_from_dict({"report": {"environments": {"phon": "sweeps/phone"}}}, "params.yaml")


# --- in a browser (tests/browser.py) -----------------------------------------------------------------
def test_index_renders_in_chromium(tree: Path, tmp_path: Path):
    chromium()
    run_report(load_params(tree / "params.yaml"), tree)
    seen = browser_check(tree / "reports" / "index.html", tmp_path)
    control = [i for i in seen["images"] if i["id"] == "control"]
    assert control == [{"id": "control", "src": "figures/does-not-exist.png", "loaded": False}]
    figures = [i for i in seen["images"] if i["id"] != "control"]
    assert [i["src"] for i in figures] == ["figures/score_error_rates.png", "figures/train_curves.png"]
    assert all(i["loaded"] for i in figures), figures
    tables = {t["section"]: t for t in seen["tables"] if t["section"]}
    assert list(tables) == ["table-table1", "table-environments", "table-routing", "table-extra"]
    assert tables["table-table1"]["head"] == ["method", "retail"] and tables["table-table1"]["rows"] == 3
    assert tables["table-extra"]["head"] == ["a | b", "c"]
    assert all(t["shown"] for t in tables.values())
    assert seen["fetched"] == [], "the page fetched something from the network"

    notebook = browser_check(tree / "reports" / "html" / "00_alpha.html", tmp_path)
    outputs = [i for i in notebook["images"] if i["id"] != "control"]
    assert outputs and all(i["loaded"] and i["src"].startswith("data:image/png") for i in outputs), outputs
    assert notebook["fetched"] == []


def test_the_page_opens_with_the_findings_of_the_evaluation(tree: Path):
    """With evaluate.json there, the page states its findings (`evaluation.tables.findings`) before anything else."""
    from trace_lib.evaluation.tables import findings

    evaluate = {"methods": {"trace_argmax": {"label": "TRACE (argmax)", "status": "not run",
                                             "reason": "no capability adapters under data/adapters/"}}}
    (tree / "reports" / "metrics" / "evaluate.json").write_text(json.dumps(evaluate))
    run_report(load_params(tree / "params.yaml"), tree)
    page = (tree / "reports" / "index.html").read_text()
    lines = findings(evaluate)
    assert lines[0].startswith("TRACE did not run") and all(f"<li>{html.escape(line)}</li>" in page for line in lines)
    assert page.index('id="findings"') < page.index('id="notebooks"')
    assert 'href="#findings"' in page and "arXiv 2604.05336" in page
    # what ran, the paper's Table 1 labelled as the paper's, and what to run next, each with its command
    assert "<li>Profile cpu: model smollm2-135m on the retail environment" in page
    assert "The paper&#x27;s setting: Qwen3-30B-A3B" in page and "<td>47.0</td>" in page
    assert "<code>make phone</code>" in page


def test_the_page_says_when_each_stage_ran_and_for_how_long(tree: Path):
    """The executed notebooks' papermill metadata gives the run's date and each stage's wall time; a notebook
    run by hand (no such metadata) is left out, and so is the report's own."""
    from trace_lib.evaluation.site import duration_text, stage_times

    for name, start, seconds in (("00_alpha", "2026-12-03T21:40:01.5+00:00", 12.4),
                                 ("01_beta", "2026-12-03T21:41:00+00:00", 185.0),
                                 ("08_report", "2026-12-03T22:00:00+00:00", 9.0)):
        path = tree / "reports" / "notebooks" / f"{name}.ipynb"
        nb = nbformat.read(path, as_version=4)
        nb.metadata["papermill"] = {"start_time": start, "duration": seconds}
        nbformat.write(nb, path)
    nbformat.write(fake_notebook("02 · Hand", png_bytes("red")), tree / "reports" / "notebooks" / "02_hand.ipynb")
    assert [t.name for t in stage_times(tree / "reports" / "notebooks")] == ["00_alpha", "01_beta"]
    assert [duration_text(x) for x in (12.4, 185, 3725)] == ["12 s", "3 min 5 s", "1 h 2 min"]
    (tree / "reports" / "metrics" / "evaluate.json").write_text(json.dumps({"methods": {}}))
    run_report(load_params(tree / "params.yaml"), tree)
    page = (tree / "reports" / "index.html").read_text()
    assert ("<li>Stages started between 2026-12-03 21:40 and 2026-12-03 21:41 UTC; wall time 3 min 17 s in all: "
            "alpha 12 s, beta 3 min 5 s (a stage DVC found up to date keeps the time of the run that made its "
            "outputs).</li>") in page


def test_the_llm_cost_table_lists_every_call_of_the_run(tmp_path: Path):
    """Each LLM ledger of the run, by stage, backend and model: a cache hit is free, a failed call costs nothing, and a
    model without a price makes the total 'no price'."""
    from trace_lib.io import write_jsonl
    from trace_lib.paths import Paths

    def row(stage, backend, model, cached=False, cost=0.001, error=None, tokens=(100, 10), retries=0):
        out = {"stage": stage, "backend": backend, "model": model, "request": "0" * 16, "cached": cached,
               "input_tokens": tokens[0], "output_tokens": tokens[1], "cache_write_tokens": 0,
               "cache_read_tokens": 0, "cost_usd": cost, "retries": retries}
        return out | ({"error": error} if error else {})

    paths = Paths(tmp_path)
    write_jsonl(paths.discover_ledger, [row("discover", "anthropic", "claude-sonnet-4-5"),
                                        row("discover", "anthropic", "claude-sonnet-4-5", cached=True, cost=0.0)])
    write_jsonl(paths.score_ledger, [row("label", "openai", "served", cost=None, retries=2),
                                     row("label", "openai", "served", cost=0.0, error="HTTP 500", tokens=(0, 0))])
    write_jsonl(tmp_path / "data/user_cache/ledger.jsonl", [row("tau2_user", "openai", "served", cost=None)])
    run_report(Params(), tmp_path)
    text = (tmp_path / "reports/tables/llm_costs.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]
    assert lines == [
        "| discover | anthropic | claude-sonnet-4-5 | 2 | 1 | 1 | 0 | 0 | 100 | 10 | 0.0010 |",
        "| label | openai | served | 2 | 1 | 0 | 1 | 2 | 100 | 10 | no price |",
        "| tau2_user | openai | served | 1 | 1 | 0 | 0 | 0 | 100 | 10 | no price |",
        "| total |  |  | 5 | 3 | 1 | 1 | 2 | 300 | 30 | no price |",
    ]


def test_traces_budget_reads_as_its_ledger():
    from trace_lib.evaluation.site import budget_text

    assert budget_text({"by_adapter": {"a": 96, "b": 32}, "discovery": 48, "synthesize": 144, "total": 320}) == (
        "320 rollouts (48 discovery, 144 calibration and transfer checks, 128 training: a 96, b 32)")
    assert budget_text({"by_adapter": {}, "discovery": 48, "synthesize": 0, "total": 48}) == (
        "48 rollouts (48 discovery, 0 calibration and transfer checks, 0 training)")
    assert budget_text(288) == "288 rollouts"
