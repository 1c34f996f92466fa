"""What the benchmarks share: the CPU they ran on, and how their rows are appended to a CSV file."""

import csv
import os
import platform
from pathlib import Path


def append_rows(path: Path, fields: list, rows: list, missing: dict | None = None) -> Path:
    """Append ``rows`` (dicts) to the CSV file ``path`` with columns ``fields``; the header once, for a new file.

    A file written with other columns (an older version of the script) is first rewritten, whole and then moved in
    place, with ``fields`` and its own columns that ``fields`` lacks, its rows holding ``missing``'s value (else blank)
    in the columns they did not have. A file with a row longer than its header is refused (ValueError) and left as
    it is."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    if not new:
        with path.open(newline="") as f:
            old = next(csv.reader(f), [])
        fields = [*fields, *(c for c in old if c not in fields)]
        if old != fields:
            with path.open(newline="") as f:
                kept = list(csv.DictReader(f))
            if any(None in row for row in kept):
                raise ValueError(f"{path}: a row has more values than its header {old}; mend or move the file first")
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields)
                w.writeheader()
                added = {c: v for c, v in (missing or {}).items() if c not in old}
                w.writerows({**added, **row} for row in kept)
            os.replace(tmp, path)
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
