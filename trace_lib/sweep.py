"""Parameter sweeps: one run of a stage notebook per point of a grid of dotted-key overrides.

Reads a params file (params.yaml) and a grid such as `{"rollout.temperature": [0.3, 1.0], "seed": [0, 1]}`;
writes, for each grid point, the stage's outputs under `<out>/<name>/` (the notebook's `root`: its
data/ and reports/), the executed notebook next to them (`<out>/<name>/<notebook>.ipynb`), and one table
`<out>/sweep.csv`: a row per run with the swept values and the stage's metrics
(`reports/metrics/<stage>.json` under the run's root, nested keys joined with dots). The table is
rewritten after every run, so an interrupted sweep keeps the rows it finished.

Every grid point is validated with the config loader before the first run starts, so a typo in a key
fails at once, naming the key. Inputs a stage reads from the repo (the prepared model, `model.out_dir`)
are shared by all runs; only outputs are separated. Not part of the paper: a tool for its ablations.

    python -m trace_lib.sweep notebooks/01_rollout.ipynb --set rollout.temperature=0.3,1.0 --set seed=0,1 --out sweeps/temp

A `--set` key with one value applies to every run and stays out of the run names; `--dry-run`
validates the grid and lists the runs without running them.

Several notebooks run in the order given, all with the run's root, so a whole pipeline can run on
another setting beside the repo's own (each stage reads what the one before wrote under that root); the
table then prefixes each stage's metrics with `<stage>.`. `--root DIR` names the folder of a sweep of
one point (its table is `DIR/sweep.csv`):

    python -m trace_lib.sweep notebooks/0[1-7]_*.ipynb --set env.name=phone --root sweeps/phone
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_lib.config import ConfigError, load_params
from trace_lib.io import atomic_write_text, read_json
from trace_lib.paths import Paths

_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")


@dataclass(frozen=True)
class SweepRun:
    """One grid point: its folder name and the dotted-key overrides it applies."""

    name: str
    overrides: dict[str, Any]


def parse_value(text: str) -> Any:
    """'0.3' -> 0.3, 'true' -> True, 'null' -> None, '[1, 2]' -> [1, 2]; anything else stays a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_assignment(text: str) -> tuple[str, list[Any]]:
    """'rollout.temperature=0.3,1.0' -> ('rollout.temperature', [0.3, 1.0])."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or not key or not values:
        raise ValueError(f"{text!r}: expected KEY=VALUE[,VALUE...], e.g. rollout.temperature=0.3,1.0")
    return key, [parse_value(v.strip()) for v in values.split(",")]


def format_value(value: Any) -> str:
    """A value as written in names and CSV cells: strings as they are, everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def expand_grid(grid: Mapping[str, Sequence[Any]]) -> list[SweepRun]:
    """Every combination of the grid's values, in key order then value order (the last key varies fastest).

    A run is named by the keys that take more than one value (all keys when none does), as
    `key=value` pairs joined by `_`, e.g. `rollout.temperature=0.3_seed=0`; characters unsafe in a
    folder name become '-'. Two points with the same name fail here.
    """
    if not grid:
        raise ValueError("empty sweep grid: give at least one KEY=VALUE[,VALUE...]")
    for key, values in grid.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"{key}: expected a non-empty list of values, got {values!r}")
    keys = list(grid)
    named = [k for k in keys if len(grid[k]) > 1] or keys
    runs, seen = [], {}
    for combo in itertools.product(*(grid[k] for k in keys)):
        overrides = dict(zip(keys, combo))
        name = "_".join(_UNSAFE.sub("-", f"{k}={format_value(overrides[k])}") for k in named)
        if name in seen:
            raise ValueError(f"sweep points {seen[name]} and {overrides} share the folder name {name!r}")
        seen[name] = overrides
        runs.append(SweepRun(name, overrides))
    return runs


def validate_runs(runs: Sequence[SweepRun], params_path: str | Path) -> None:
    """Load the params of every run; the first bad one raises ConfigError naming the run and the key."""
    for run in runs:
        try:
            load_params(params_path, run.overrides)
        except ConfigError as err:
            raise ConfigError(f"sweep point {run.name}: {err}") from None


def stage_name(notebook: str | Path) -> str:
    """'notebooks/01_rollout.ipynb' -> 'rollout' (the name of its dvc stage and metrics file)."""
    return re.sub(r"^\d+_", "", Path(notebook).stem)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> one level with dotted keys; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def table_row(run: SweepRun, metrics: Mapping[str, Any], stage: str) -> dict[str, Any]:
    """The CSV row of one run: its name, its overrides, then its metrics (prefixed on a name clash)."""
    row: dict[str, Any] = {"run": run.name, **run.overrides}
    for key, value in flatten(metrics).items():
        row[f"{stage}.{key}" if key in row else key] = value
    return row


def pipeline_row(run: SweepRun, metrics: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The CSV row of a run of several stages: its name, its overrides, then each stage's metrics as
    `<stage>.<key>`."""
    row: dict[str, Any] = {"run": run.name, **run.overrides}
    for stage, data in metrics.items():
        row.update(flatten(data, f"{stage}."))
    return row


def write_table(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows as CSV (columns in order of first appearance), atomically."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else format_value(row[c]) for c in columns])
    return atomic_write_text(path, buf.getvalue())


def run_sweep(
    notebook: str | Path | Sequence[str | Path],
    grid: Mapping[str, Sequence[Any]],
    out: str | Path,
    params_path: str | Path = "params.yaml",
    kernel_name: str = "python3",
    cwd: str | Path | None = None,
    log_output: bool = False,
    as_root: bool = False,
) -> Path:
    """Run the notebook(s) once per grid point with papermill; returns the path of `<out>/sweep.csv`.

    Each run gets `params_path`, its `overrides` and `root=<out>/<name>` (`root=<out>` when `as_root`,
    which takes a grid of one point); several notebooks run in the order given with the same root.
    Relative paths (these, the notebooks', and those in params such as `model.out_dir`) are taken from
    `cwd` (default: the current directory), where the kernel runs: the repo root, where the stages'
    inputs are. A failing run raises papermill's error (its executed notebook shows where) after writing
    the rows before it.
    """
    notebooks = [notebook] if isinstance(notebook, (str, Path)) else list(notebook)
    if not notebooks:
        raise ValueError("no notebook to run")
    runs = expand_grid(grid)
    if as_root and len(runs) != 1:
        raise ValueError(f"a sweep into one root folder takes one grid point, not {len(runs)}")
    base = Path(cwd or ".")
    if as_root and (base / out).resolve() == base.resolve():
        raise ValueError(f"root {str(out)!r} is the repo itself: the run would write over its own outputs")
    validate_runs(runs, base / params_path)
    import papermill  # slow to import: only once the grid is known to be valid
    out = Path(out)
    rows: list[dict[str, Any]] = []
    table = base / out / "sweep.csv"
    for i, run in enumerate(runs, 1):
        root = out if as_root else out / run.name
        (base / root).mkdir(parents=True, exist_ok=True)
        print(f"[{i}/{len(runs)}] {root}", flush=True)
        start = time.perf_counter()
        metrics: dict[str, dict[str, Any]] = {}
        for nb in notebooks:
            papermill.execute_notebook(
                str(base / nb), str(base / root / Path(nb).name),
                parameters={"params_path": str(params_path), "overrides": run.overrides, "root": str(root)},
                kernel_name=kernel_name, progress_bar=False, log_output=log_output, cwd=str(base),
            )
            stage = stage_name(nb)
            metrics_file = Paths(base / root).metrics(stage)
            metrics[stage] = read_json(metrics_file) if metrics_file.is_file() else {}
            if len(notebooks) > 1:
                print(f"[{i}/{len(runs)}] {stage} done at {time.perf_counter() - start:.0f} s", flush=True)
        rows.append(table_row(run, metrics[stage_name(notebooks[0])], stage_name(notebooks[0]))
                    if len(notebooks) == 1 else pipeline_row(run, metrics))
        write_table(rows, table)
        print(f"[{i}/{len(runs)}] {root} done in {time.perf_counter() - start:.0f} s", flush=True)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", metavar="notebook",
                        help="stage notebook(s), e.g. notebooks/01_rollout.ipynb; several run in order per point")
    parser.add_argument("--set", dest="sets", action="append", required=True, metavar="KEY=V1[,V2...]",
                        help="dotted params key and its values; repeat for a grid (one value: fixed for all runs)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="sweep folder: one subfolder per run, plus sweep.csv")
    where.add_argument("--root", help="the run's own folder (a grid of one point), plus sweep.csv")
    parser.add_argument("--params", default="params.yaml", help="params file every run starts from")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name")
    parser.add_argument("--log-output", action="store_true", help="stream the notebooks' output")
    parser.add_argument("--dry-run", action="store_true", help="validate and list the runs, run nothing")
    args = parser.parse_args(argv)

    try:
        grid: dict[str, list[Any]] = {}
        for text in args.sets:
            key, values = parse_assignment(text)
            if key in grid:
                raise ValueError(f"{key}: given twice")
            grid[key] = values
        runs = expand_grid(grid)
        if args.root and len(runs) != 1:
            raise ValueError(f"--root takes a grid of one point, not {len(runs)}; use --out")
        if args.root and Path(args.root).resolve() == Path.cwd().resolve():
            raise ValueError(f"--root {args.root!r} is this folder: the run would write over its own outputs")
        validate_runs(runs, args.params)
    except ValueError as err:  # ConfigError is a ValueError
        parser.exit(2, f"error: {err}\n")
    if args.dry_run:
        for run in runs:
            print(f"{Path(args.root) if args.root else Path(args.out) / run.name}: {run.overrides}")
        return
    table = run_sweep(args.notebooks, grid, args.root or args.out, args.params, args.kernel,
                      log_output=args.log_output, as_root=bool(args.root))
    print(f"wrote {table}")


if __name__ == "__main__":
    main()
