"""The report's provenance pages: one per kept capability, and a viewer of every episode of the run.

Pure functions from records to HTML text (equal inputs, equal bytes). Static pages: no server, nothing fetched,
relative links only, so the reports/ folder can be zipped and shared. `evaluation.provenance` builds the records.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from trace_lib.records import Message, Trajectory

FOLD_CHARS = 300
"""A message longer than this is folded (a <details> showing its first line)."""

CSS = """body{font:15px/1.45 system-ui,sans-serif;max-width:80em;margin:2em auto;padding:0 1em;color:#222}
h1,h2{border-bottom:1px solid #ddd;padding-bottom:.2em}table{border-collapse:collapse;margin:.5em 0 1em}
th,td{border:1px solid #ccc;padding:.25em .6em;vertical-align:top}th{background:#f3f3f3}
.ep{border:1px solid #ddd;border-radius:4px;margin:.5em 0;padding:.4em .6em;background:#fff}
.ep h4{margin:.2em 0 .4em;font-size:14px}.ok{color:#176f2c}.fail{color:#a4262c}
.msg{margin:.25em 0;padding:.25em .5em;border-left:4px solid #ccc;white-space:pre-wrap;font-size:13px}
.user{border-color:#4a78c2;background:#f3f7fd}.assistant{border-color:#2e8b57;background:#f4fbf6}
.tool{border-color:#999;background:#f7f7f7;font-family:ui-monospace,monospace}.system{border-color:#ddd;color:#555}
.call{font-family:ui-monospace,monospace;color:#5a3e8a}.invalid{border-color:#a4262c;background:#fdf3f3}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:1em}.src,.muted{color:#666;font-size:13px}
blockquote{margin:.3em 0 .3em 1em;padding-left:.6em;border-left:3px solid #ddd;color:#333}
svg text{font-size:11px;fill:#555}"""


def esc(value: Any) -> str:
    return html.escape(str(value))


def _folded(text: str, cls: str, label: str) -> str:
    head = f'<span class="muted">{esc(label)}</span> '
    if len(text) <= FOLD_CHARS:
        return f'<div class="msg {cls}">{head}{esc(text)}</div>'
    first = text[:120].split("\n")[0].rstrip()
    return (f'<details class="msg {cls}"><summary>{head}{esc(first)}… ({len(text):,} characters)</summary>'
            f"{esc(text)}</details>")


def message_html(m: Message) -> str:
    """One turn, readable: who spoke, the text, each tool call as name(arguments); long turns fold."""
    if m.role == "assistant" and m.tool_calls:
        calls = "<br>".join(f'<span class="call">{esc(c.name)}({esc(json.dumps(c.arguments, ensure_ascii=False))})'
                            "</span>" for c in m.tool_calls)
        return f'<div class="msg assistant"><span class="muted">agent calls</span> {calls}</div>'
    if m.invalid:
        return _folded(f"{m.content}\n[invalid action: {m.invalid}]", "invalid", "agent (invalid)")
    label = {"assistant": "agent", "tool": "tool result" + (" (error)" if m.error else ""), "user": "user",
             "system": "system prompt"}[m.role]
    if m.role == "system":
        return (f'<details class="msg system"><summary><span class="muted">system prompt</span> '
                f"({len(m.content):,} characters)</summary>{esc(m.content)}</details>")
    return _folded(m.content, m.role, label)


def episode_html(t: Trajectory | None, title: str) -> str:
    """An episode with its outcome in the heading; a missing one says so."""
    if t is None:
        return f'<div class="ep"><h4>{esc(title)}</h4><p class="muted">not in this run\'s records</p></div>'
    outcome = '<span class="ok">solved</span>' if t.success else '<span class="fail">failed</span>'
    head = (f"{esc(title)} · {outcome} · reward {t.reward:g} · ended by {esc(t.termination)} · "
            f"{t.tool_calls} tool call(s)")
    return f'<div class="ep" id="{esc(t.id)}"><h4>{head}</h4>' + "".join(map(message_html, t.messages)) + "</div>"


def curve_svg(points: Sequence[tuple[float, float]], width: int = 320, height: int = 120) -> str:
    """A line chart of (iteration, success rate in [0, 1]) as inline SVG; '' without points."""
    if not points:
        return ""
    xs = [p[0] for p in points]
    lo, hi = min(xs), max(xs)
    span = (hi - lo) or 1

    xy = [(30 + (x - lo) / span * (width - 40), height - 20 - y * (height - 30)) for x, y in points]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5"/>' for x, y in xy)
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="on-policy success per iteration">'
            f'<line x1="30" y1="{height - 20}" x2="{width - 10}" y2="{height - 20}" stroke="#999"/>'
            f'<line x1="30" y1="10" x2="30" y2="{height - 20}" stroke="#999"/>'
            f'<text x="2" y="14">1.0</text><text x="2" y="{height - 20}">0</text>'
            f'<text x="{width // 2 - 30}" y="{height - 4}">iteration {lo:g}–{hi:g}</text>'
            f'<polyline fill="none" stroke="#2e6fbe" stroke-width="2" points="{line}"/>'
            f'<g fill="#2e6fbe">{dots}</g></svg>')


def _rows(pairs: Sequence[tuple[str, Any]]) -> str:
    return "<table><tbody>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in pairs) + \
        "</tbody></table>"


def _fmt(x: Any, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _page(title: str, body: list[str]) -> str:
    return "\n".join(['<!DOCTYPE html>', '<html lang="en"><head><meta charset="utf-8">',
                      '<meta name="viewport" content="width=device-width, initial-scale=1">',
                      f"<title>{esc(title)}</title><style>{CSS}</style></head><body>", *body, "</body></html>"]) + "\n"


def changed_html(kind: str, task_ids: Sequence[str], base: Mapping[str, Trajectory],
                 other: Mapping[str, Trajectory], other_title: str) -> str:
    """Each changed task with the base model's episode and the other's side by side."""
    if not task_ids:
        return f'<p class="muted">No test task was {kind}.</p>'
    return "".join(f'<h4>{esc(tid)}</h4><div class="pair">{episode_html(base.get(tid), "base model")}'
                   f"{episode_html(other.get(tid), other_title)}</div>" for tid in task_ids)


def capability_page(record: Mapping[str, Any], train: Mapping[str, Trajectory],
                    evaluation: Mapping[str, Sequence[Trajectory]]) -> str:
    """The page of one capability: evidence, score, environment, adapter and learning curve, tasks changed."""
    cap, score, env, adapter, ev = (record["capability"], record["score"], record["environment"], record["adapter"],
                                    record["evaluation"])
    body = ['<p><a href="../index.html">report</a> · <a href="../trajectories.html">every episode</a></p>',
            f"<h1>{esc(cap['name'])} <code>{esc(cap['id'])}</code></h1>", f"<p>{esc(cap['description'])}</p>",
            f'<p class="muted">recognised as LACKING when: {esc(cap["recognition"])}</p>',
            f"<h2>1. The failures it came from ({len(record['evidence'])} trajectories)</h2>"]
    for e in record["evidence"]:
        why = "; ".join(e["rationale"]) or "no LACKING label on this trajectory"
        body.append(f"<h4>{esc(e['trajectory_id'])} · {esc(e['family'])}</h4><p>analyst: {esc(why)}</p>"
                    f"<blockquote>agent's last turn (message {esc(e['last_agent_turn'])}): {esc(e['quote'])}"
                    "</blockquote>")
        body.append(f"<details><summary>the whole episode</summary>"
                    f"{episode_html(train.get(e['trajectory_id']), e['trajectory_id'])}</details>")
    body.append("<h2>2. Why it was kept</h2>")
    body.append(_rows([("Δ (error rate when lacking − when present)", _fmt(score["delta"])),
                       ("Δ 95% interval", score["delta_ci"] and "[" + ", ".join(_fmt(x) for x in score["delta_ci"]) + "]"),
                       ("coverage", _fmt(score["coverage"])), ("kept in labelling runs", f"{score['kept_runs']} of {score['n_runs']}"),
                       ("trajectories PRESENT / LACKING", f"{score['n_pos']} / {score['n_neg']}")])
                if score else '<p class="muted">no score record</p>')
    body.append("<h2>3. Its environment</h2>")
    if env is None:
        body.append('<p class="muted">No environment was synthesized for it.</p>')
    else:
        state = "installed" if env["installed"] else f"not installed: {env['reason']}"
        body.append(_rows([("state", state), ("synthesizer", env["source"]), ("module sha256", env["sha256"]),
                           ("difficulty trained at", env["difficulty"]), ("calibration rollouts", env["rollouts"])]))
        attempts = (env.get("calibration") or {}).get("attempts", [])
        if attempts:
            body.append("<table><thead><tr><th>calibration setting</th><th>success</th><th>mixed groups</th>"
                        "<th>rollouts</th><th>in band</th></tr></thead><tbody>" + "".join(
                            f"<tr><td>difficulty {esc(a['difficulty'])}, {esc(a['start'])}</td>"
                            f"<td>{_fmt(a['success'])}</td><td>{_fmt(a['mixed_groups'])}</td>"
                            f"<td>{esc(a['rollouts'])}</td><td>{'yes' if a['in_band'] else 'no'}</td></tr>"
                            for a in attempts) + "</tbody></table>")
        transfer = (env.get("calibration") or {}).get("transfer")
        if transfer:
            families = ", ".join(f"{esc(f)} {esc(kn)}" for f, kn in transfer["by_family"].items())
            body.append(f"<p>Transfer check before training: the base model on {len(transfer['tasks'])} failed target "
                        f"train tasks behind it, from the {esc(transfer['start'])}, succeeded in "
                        f"{esc(transfer['successes'])} of {esc(transfer['rollouts'])} episodes ({families}).</p>")
        sample = env.get("sample_task")
        if sample and "error" in sample:
            body.append(f'<p class="muted">No sample task: {esc(sample["error"])}</p>')
        elif sample:
            calls = "; ".join(f"{a['name']}({json.dumps(a['arguments'], ensure_ascii=False)})" for a in sample["gold_actions"])
            body.append(f"<p>A task it generates (seed {esc(sample['seed'])}, difficulty {esc(sample['difficulty'])}):"
                        f"</p><blockquote>user: {esc(sample['opening'])}<br>reference: {esc(calls)}; must say: "
                        f"{esc(', '.join(sample['required_outputs']) or '—')}</blockquote>")
        if env["description"]:
            body.append(f"<details><summary>what the environment asks (its module's docstring)</summary>"
                        f"<pre>{esc(env['description'])}</pre></details>")
    body.append("<h2>4. Its adapter</h2>")
    if adapter is None:
        body.append('<p class="muted">No adapter was trained for it.</p>')
    else:
        body.append(_rows([("iterations", adapter["iterations"]), ("training rollouts", adapter["rollouts_used"]),
                           ("final reward", _fmt(adapter["final_reward"])), ("snapshot", adapter["snapshot"]),
                           ("trained on the environment above", "yes" if adapter["env_matches"] else "no")]))
        pts = [(float(r["iteration"]), float(r["success_rate"])) for r in adapter["curve"]
               if r.get("iteration") is not None and r.get("success_rate") is not None]
        body.append("<p>On-policy success per iteration in its environment:</p>" + curve_svg(pts))
    body.append("<h2>5. The test tasks it changed</h2>")
    base = {t.task_id: t for t in evaluation.get("base", [])}
    if ev["trace_key"] is None:
        body.append('<p class="muted">TRACE was not evaluated in this run.</p>')
    else:
        trace = {t.task_id: t for t in evaluation.get(ev["trace_key"], [])}
        body.append(f"<p>The router sent {len(ev['routed'])} test task(s) here"
                    + (": " + ", ".join(map(esc, ev["routed"])) if ev["routed"] else "") + ".</p>")
        for kind in ("fixed", "broken"):
            body.append(f"<h3>{kind.capitalize()} by TRACE ({len(ev['trace'][kind])})</h3>"
                        + changed_html(kind, ev["trace"][kind], base, trace, f"TRACE ({ev['trace_key']})"))
    if ev["alone"] is not None:
        alone = {t.task_id: t for t in evaluation.get(f"single_{cap['id']}", [])}
        body.append(f"<h3>The adapter alone on every test task: {len(ev['alone']['fixed'])} fixed, "
                    f"{len(ev['alone']['broken'])} broken</h3>")
        for kind in ("fixed", "broken"):
            body.append(f"<details><summary>{kind}</summary>"
                        + changed_html(kind, ev["alone"][kind], base, alone, "adapter alone") + "</details>")
    body.append(f"<p class=\"src\">rollouts: {record['rollouts']['calibration']} calibration, "
                f"{record['rollouts']['training']} training (ledgers under data/envs and data/train); "
                "record in reports/provenance.json</p>")
    return _page(f"{cap['name']} — provenance", body)


def capability_links(records: Sequence[Mapping[str, Any]]) -> str:
    """The index's capability list: each kept capability, what became of it, and its page."""
    if not records:
        return "<p>No capability was kept, so there is no provenance to show.</p>"
    items = []
    for r in records:
        cap, env, ev = r["capability"], r["environment"], r["evaluation"]
        if r["adapter"] is not None:
            state = (f"adapter trained ({r['adapter']['rollouts_used']} rollouts); routed {len(ev['routed'])} test "
                     f"task(s), fixed {len(ev['trace']['fixed'])}, broke {len(ev['trace']['broken'])}")
        elif env is not None and not env["installed"]:
            state = f"no adapter: environment not installed ({env['reason']})"
        else:
            state = "no adapter"
        items.append(f'<li><a href="capabilities/{quote(cap["id"])}.html">{esc(cap["name"])}</a> — {esc(state)}</li>')
    return "<ul>" + "".join(items) + "</ul>"


VIEWER_JS = """
const data = JSON.parse(document.getElementById("episodes").textContent);
const keys = ["source", "family", "outcome", "capability"];
const pick = Object.fromEntries(keys.map(k => [k, document.getElementById("f-" + k)]));
for (const k of keys) {
  for (const v of [...new Set(data.map(e => e[k]))].sort()) pick[k].add(new Option(v, v));
  pick[k].addEventListener("change", show);
}
function show() {
  const want = Object.fromEntries(keys.map(k => [k, pick[k].value]));
  const list = document.getElementById("list");
  const hits = data.filter(e => keys.every(k => !want[k] || e[k] === want[k]));
  document.getElementById("count").textContent = hits.length + " of " + data.length + " episodes";
  list.innerHTML = hits.slice(0, 200).map(e => e.html).join("");
}
show();
"""


def viewer_rows(rollouts: Sequence[Trajectory], evaluation: Mapping[str, Sequence[Trajectory]],
                evidence_of: Mapping[str, Sequence[str]]) -> list[dict[str, str]]:
    """One row per episode for the viewer: its source (rollout or the evaluated method), family, outcome, the
    capability it concerns (the kept capabilities it is evidence for; the adapter an evaluation episode ran
    under) and its rendered HTML."""
    rows = []
    for t in rollouts:
        caps = ", ".join(evidence_of.get(t.id, [])) or "none"
        rows.append({"source": "rollout (train split)", "family": t.family,
                     "outcome": "solved" if t.success else "failed", "capability": caps,
                     "html": episode_html(t, f"rollout {t.id}")})
    for key in sorted(evaluation):
        for t in evaluation[key]:
            rows.append({"source": f"evaluation: {key}", "family": t.family,
                         "outcome": "solved" if t.success else "failed", "capability": t.adapter or "none",
                         "html": episode_html(t, f"{key} · {t.task_id}")})
    return rows


def viewer_page(rows: Sequence[Mapping[str, str]]) -> str:
    """Every episode of the run on one static page, filterable by source, family, outcome and capability (the
    first 200 matches shown). Training samples are not stored by the train stage, so they are not here."""
    selects = "".join(f'<label>{k} <select id="f-{k}"><option value="">any</option></select></label> '
                      for k in ("source", "family", "outcome", "capability"))
    payload = json.dumps(list(rows), ensure_ascii=False, sort_keys=True).replace("</", "<\\/")
    body = ['<p><a href="index.html">report</a></p>', "<h1>Every episode of the run</h1>",
            '<p class="muted">The base model\'s rollouts on the train split (what discovery read) and every '
            "evaluation episode on the test split. Training samples are counted in the ledgers but not stored.</p>",
            f"<p>{selects}</p>", '<p id="count"></p>', '<div id="list"></div>',
            f'<script type="application/json" id="episodes">{payload}</script>', f"<script>{VIEWER_JS}</script>"]
    return _page("Every episode of the run", body)
