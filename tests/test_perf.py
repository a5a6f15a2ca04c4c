"""bench/perf.py: the serving figures, the command and the machine in its JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

PERF = Path(__file__).resolve().parents[1] / "bench" / "perf.py"


def test_bench_perf_writes_every_serving_figure_with_the_command_and_the_machine(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("perf", PERF)
    perf = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "perf", perf)  # its dataclasses look their module up
    spec.loader.exec_module(perf)
    out = tmp_path / "perf.json"

    args = ["--quick", "--concurrency", "1,2", "--tokens", "3", "--json", str(out)]
    assert perf.main(args) == 0

    report = json.loads(out.read_text())
    assert report["command"] == "python bench/perf.py " + " ".join(args)
    assert report["machine"]["device"] == "cpu" and report["machine"]["dtype"] == "float32"
    assert set(report["figures"]) == {
        "prefill_tokens_per_s", "decode_tokens_per_s", "serving_speedup_1", "serving_speedup_2"
    }  # fmt: skip
    assert all(value > 0 for value in report["figures"].values())
    assert "serving_speedup_2" in capsys.readouterr().out
