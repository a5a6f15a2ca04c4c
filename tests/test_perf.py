"""bench/perf.py: every figure, the command and the machine in its JSON (sizes from --quick; no targets)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[1] / "bench" / "perf.py"


def _perf(monkeypatch):
    monkeypatch.syspath_prepend(str(PERF.parent))  # perf.py imports the bench scripts beside it
    spec = importlib.util.spec_from_file_location("perf", PERF)
    perf = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "perf", perf)  # its dataclasses look their module up
    spec.loader.exec_module(perf)
    return perf


def test_bench_perf_quick_writes_every_figure_with_the_command_and_the_machine(
    tmp_path, capsys, monkeypatch, postgres_url, mqtt_url
):
    perf = _perf(monkeypatch)
    out = tmp_path / "perf.json"

    args = ["--quick", "--concurrency", "1,2", "--tokens", "3", "--json", str(out),
            "--postgres", postgres_url, "--mqtt", mqtt_url]  # fmt: skip
    assert perf.main(args) == 0

    report = json.loads(out.read_text())
    assert report["command"] == "python bench/perf.py " + " ".join(args)
    assert report["machine"]["device"] == "cpu" and report["machine"]["dtype"] == "float32"
    figures = report["figures"]
    assert set(figures) == {
        "prefill_tokens_per_s", "decode_tokens_per_s", "serving_speedup_1", "serving_speedup_2",
        "p1_failed_requests", "p1_p99_ratio", "p2_lesson_latency_ms", "p3_adapter_latency_s",
        "p4_overhead_ms_p50", "p5_search_ms_p50", "p5_recall_at_5", "p6_sqlite_turns_per_s",
        "p6_postgres_turns_per_s", "p7_mqtt_events_per_s", "p7_mqtt_latency_ms_p50", "train_tokens_per_s",
        "serving_latency_ratio_while_training",
    }  # fmt: skip
    assert report["unavailable"] == {}
    assert isinstance(figures["p1_failed_requests"], int) and figures["p1_failed_requests"] >= 0
    assert 0.0 <= figures["p5_recall_at_5"] <= 1.0
    counted = ("p1_failed_requests", "p5_recall_at_5")
    rates = {name: value for name, value in figures.items() if name not in counted}
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in rates.values()), rates
    assert report["service"]["p1_requests"] > 0 and report["service"]["p1_swaps"] > 0
    printed = capsys.readouterr().out
    shown = ("serving_speedup_2", "p3_adapter_latency_s", "train_tokens_per_s")
    assert all(name in printed for name in shown)


def test_skipped_figure_groups_are_null_with_the_reason_and_an_unknown_group_is_refused(tmp_path, monkeypatch, capsys):
    perf = _perf(monkeypatch)
    out = tmp_path / "perf.json"
    groups = "p1,p2,p3,p4,p5,p6,p7,train"
    assert perf.main(["--quick", "--concurrency", "1", "--tokens", "2", "--skip", groups, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    figures = report["figures"]
    assert figures["serving_speedup_1"] > 0 and figures["decode_tokens_per_s"] > 0
    assert all(figures[name] is None for name in perf.HEADLINE)  # every service figure
    assert report["unavailable"]["p5_search_ms_p50"] == "skipped (--skip p5)"
    assert report["unavailable"]["train_tokens_per_s"] == "skipped (--skip train)"
    assert report["machine"]["transformers"] and report["machine"]["peft"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        perf.main(["--skip", "p9"])
    assert "--skip p9: not a figure group" in capsys.readouterr().err
