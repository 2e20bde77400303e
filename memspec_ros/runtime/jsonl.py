"""JSON-lines rows read with errors that name the file and the line (workloads, requests, the demo's prompt).

Here, below the zoo and the ROS layer, so that both read rows one way (zoo/workloads.py re-exports it).
"""

from __future__ import annotations

import json
from pathlib import Path


class WorkloadFileError(ValueError):
    """A JSON-lines file with a line that is not a usable row; the message names the file and the line."""


def read_jsonl(path: str | Path, limit: int = 0, row_check=None) -> list[dict]:
    """The JSON-object rows of a JSON-lines file (blank lines skipped), the first ``limit`` when it is set.
    A line that is not a JSON object, or that ``row_check(row)`` rejects (it returns what is missing), raises a
    WorkloadFileError (a ValueError) naming the file and the line, the one thing a user needs to fix it."""
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                # a byte-order mark (files saved by Windows editors) is no part of the first row
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:  # a Latin-1 file: a bare traceback, no file or line named
                raise WorkloadFileError(f"{path}:{n}: not UTF-8 (byte {exc.object[exc.start]:#x} at column"
                                        f" {exc.start + 1});"
                                        " save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadFileError(f"{path}:{n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise WorkloadFileError(f"{path}:{n}: not a JSON object (a row is {{\"key\": value, ...}})")
            problem = row_check(row) if row_check else None
            if problem:
                raise WorkloadFileError(f"{path}:{n}: {problem}")
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    return rows
