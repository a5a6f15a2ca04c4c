"""bench/lesson_scopes.py: how far a narrowed lesson reaches, by retrieval scores alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def scopes(*args: str) -> tuple[list[str], int, int]:
    done = subprocess.run([sys.executable, "bench/lesson_scopes.py", "--interactions", "8", "--general", "3", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    found = re.search(r"still reaches: (\d+)/(\d+)", lines[-1])
    assert found, lines[-1]
    return lines, int(found[1]), int(found[2])


def test_a_floor_above_one_reaches_nothing_and_one_below_every_score_reaches_everything():
    lines, none, total = scopes("--profile", "config/profiles/commuter.yaml", "--margin", "2")
    assert total > 0 and none == 0
    assert len(lines) == 2 + 1 + len(set(lines[2:-1]))  # the header, one row a distinct lesson request, the sum
    _, every, same_total = scopes("--profile", "config/profiles/commuter.yaml", "--margin", "-1")
    assert same_total == total == every  # a cosine is at least -1, so every pinned score - 1 is below every held-out one
