"""Atomic file I/O for stage artifacts.

Every artifact a stage writes goes through these helpers: the bytes are written to a temporary
file in the same folder and renamed over the target, so an interrupted stage never leaves a half
artifact behind for DVC to cache. JSON is written with sorted keys so equal records give equal bytes.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through a temp file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(fd, 0o644)  # mkstemp makes 0600; artifacts and report pages are meant to be read by others
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def dumps_json(obj: Any) -> str:
    """Canonical JSON: sorted keys, no NaN surprises, UTF-8 kept readable."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, allow_nan=False)


def write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, sort_keys=True, ensure_ascii=False, indent=2) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _as_jsonable(record: BaseModel | dict) -> Any:
    return record.model_dump(mode="json") if isinstance(record, BaseModel) else record


def write_jsonl(path: str | Path, records: Iterable[BaseModel | dict]) -> Path:
    """Write records one per line, in the order given (callers sort for stable bytes)."""
    lines = [dumps_json(_as_jsonable(r)) for r in records]
    return atomic_write_text(path, "".join(line + "\n" for line in lines))


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err


def read_jsonl(path: str | Path, model: type[M]) -> list[M]:
    """Read a JSONL file into validated records of type `model`."""
    return [model.model_validate(row) for row in iter_jsonl(path)]
