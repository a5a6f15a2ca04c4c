"""bench/perf.py: every figure, the command and the machine in its JSON (sizes from --quick; no targets)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

PERF = Path(__file__).resolve().parents[1] / "bench" / "perf.py"


def test_bench_perf_quick_writes_every_figure_with_the_command_and_the_machine(
    tmp_path, capsys, monkeypatch, postgres_url, mqtt_url
):
    monkeypatch.syspath_prepend(str(PERF.parent))  # perf.py imports the bench scripts beside it
    spec = importlib.util.spec_from_file_location("perf", PERF)
    perf = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "perf", perf)  # its dataclasses look their module up
    spec.loader.exec_module(perf)
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
