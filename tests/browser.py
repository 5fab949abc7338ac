"""Headless Chromium for the report's tests: open a page as a reader would and record what it shows.

The check runs on a throwaway copy next to the page (so relative paths resolve the same), with a script
appended that records, at the load event, every image and table, the findings' lines, each figure's
caption and what the page fetched. A control image that cannot load proves the check tells loaded from
broken.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHECK_SCRIPT = """<img id="control" src="figures/does-not-exist.png" alt="control">
<script>
window.addEventListener("load", () => {
  const images = [...document.images].map(i => ({id: i.id, src: i.getAttribute("src").slice(0, 40),
                                                 loaded: i.complete && i.naturalWidth > 0}));
  const tables = [...document.querySelectorAll("table")].map(t => ({
    section: t.closest("section") ? t.closest("section").id : "",
    head: [...t.rows[0].cells].map(c => c.innerText.trim()), rows: t.rows.length,
    shown: t.getBoundingClientRect().height > 0, overflow: t.scrollWidth - t.clientWidth}));
  const heading = document.getElementById("findings") || document.getElementById("run");
  const findings = heading ? [...heading.nextElementSibling.querySelectorAll("li")].map(li => li.innerText) : [];
  const figures = [...document.querySelectorAll("figure")].map(f => {
    const cap = f.querySelector("figcaption"), src = cap && cap.querySelector(".src");
    return {src: f.querySelector("img").getAttribute("src"),
            caption: cap ? cap.innerText.replace(src ? src.innerText : "", "").trim() : ""};
  });
  const fetched = performance.getEntriesByType("resource").map(e => e.name)
    .filter(n => !n.startsWith("file:") && !n.startsWith("data:"));
  const out = document.createElement("pre");
  out.id = "browser-check";
  out.textContent = JSON.stringify({images, tables, findings, figures, fetched, width: window.innerWidth});
  document.body.appendChild(out);
});
</script>
"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    pytest.skip("chromium not installed: apt-get install chromium")


def browser_check(page: Path, tmp_path: Path, width: int = 1280) -> dict:
    """Open a copy of `page` in headless Chromium, `width` px wide, and return what the check script recorded."""
    probe = page.with_name(f".check-{page.name}")
    probe.write_text(page.read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--disable-component-update", f"--user-data-dir={tmp_path / 'profile'}",
           f"--window-size={width},900", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        probe.unlink(missing_ok=True)
    found = re.search(r'<pre id="browser-check">(.*?)</pre>', done.stdout, re.S)
    assert found, f"no check output from chromium (rc {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(html.unescape(found[1]))
