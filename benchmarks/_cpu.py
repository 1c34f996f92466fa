"""What the benchmarks share: the CPU they ran on, and how their rows are appended to a CSV file."""

import csv
import platform
from pathlib import Path


def append_rows(path: Path, fields: list, rows: list) -> Path:
    """Append ``rows`` (dicts) to the CSV file ``path`` with columns ``fields``; the header once, for a new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
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
