#!/usr/bin/env python3
"""Copy the shipped data from ``datasets/`` (the editable source) into the package
(``qeval/data/``), where ``builtin:<name>`` recipe paths find it once qeval is installed.

Usage:
    python datasets/tools/sync_package_data.py           # copy what differs (make package-data)
    python datasets/tools/sync_package_data.py --check   # exit 1 and name the files that differ

The list of files is ``qeval.data.FILES``; ``tests/test_package_data.py`` checks the copies
are byte for byte equal to their sources.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from qeval.data import FILES  # noqa: E402

SRC = REPO / "datasets"
DST = REPO / "qeval" / "data"


def stale() -> list[str]:
    """Packaged files missing or differing from their ``datasets/`` source."""
    return [rel for rel in FILES
            if not (DST / rel).is_file() or (DST / rel).read_bytes() != (SRC / rel).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report files that differ (exit 1 if any)")
    a = ap.parse_args(argv)
    todo = stale()
    if a.check:
        for rel in todo:
            print(f"qeval/data/{rel} differs from datasets/{rel}")
        return 1 if todo else 0
    for rel in todo:
        (DST / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SRC / rel, DST / rel)
        print(f"copied datasets/{rel} -> qeval/data/{rel}")
    if not todo:
        print("qeval/data is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
