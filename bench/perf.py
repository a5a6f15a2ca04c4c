"""whet's performance figures: serving, swaps under load, lessons, adapters, memory, store, bus, training.

Every figure is measured in one run on the machine that runs it, on the untrained tiny model built
locally (no download) unless ``--model`` names another (an HF id, a folder, ``smollm2``).

Serving, on the in-process transformers engine:

- ``prefill_tokens_per_s``: a prompt run alone (prefix reuse off), its tokens over the time;
- ``decode_tokens_per_s``: one sequence, generated tokens over the time after its first token;
- ``serving_speedup_N``: generated tokens/s with N requests at once ÷ the same requests one after
  another, for N = 1, 2, 4, 8, 16 (1 is the check that batching of one costs nothing).

Stop tokens are ignored here, so every request generates exactly ``--tokens`` tokens and the
throughputs compare equal work; prompts differ per request (so the batch is padded).

The service (``bench/service_perf.py``; ``--quick`` shrinks every size):

- ``p1_failed_requests``, ``p1_p99_ratio``: 8 chats in flight in a closed loop with a new adapter
  version going live every 3 s, against the same load without swaps (p99 latency ratio; six
  steady and six swapping windows of 5 s alternate, so the machine's drift falls on both);
- ``p2_lesson_latency_ms``: feedback with a correction -> retrieval offers the lesson (median);
- ``p3_adapter_latency_s``: the feedback completing a training batch -> the first request answered
  by the new version (the learner in-process, training on the same model);
- ``p4_overhead_ms_p50``: a whole chat request (HTTP, agent loop, store, retrieval over 100k
  lessons) minus the backend call, on an instant scripted backend;
- ``p5_search_ms_p50``, ``p5_recall_at_5``: lesson search over 1M lessons against exact search;
- ``p6_sqlite_turns_per_s``, ``p6_postgres_turns_per_s``: turns written one after another;
- ``p7_mqtt_events_per_s``, ``p7_mqtt_latency_ms_p50``: events through Mosquitto;
- ``train_tokens_per_s``, ``serving_latency_ratio_while_training``: LoRA steps on ``learner.threads``
  beside serving (``bench/serving_during_training.py``).

A service that cannot be reached (PostgreSQL, Mosquitto) leaves its figures null and says why, as
does a group left out with ``--skip`` (p4-p7 measure neither the model nor the device).

    python bench/perf.py [--quick] [--json FILE] [--model ID] [--dtype auto|float32|bfloat16]
                         [--device cpu|cuda|auto] [--postgres URL] [--mqtt URL] [--skip p4,p5,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import peft
import torch
import transformers
from rich.console import Console
from rich.table import Table

from whet.learner.trainer import cpu_name
from whet.runtime.hf import TransformersBackend
from whet.runtime.policy import SamplingParams
from whet.runtime.prefix import PrefixCache

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench scripts beside this one
from service_perf import GROUPS, HEADLINE, Sizes, measure_service, temporary_dir  # noqa: E402

CONCURRENCY = (1, 2, 4, 8, 16)
TOPICS = ("the weather in Paris", "my calendar tomorrow", "a short poem", "the train to Berlin",
          "groceries for the week", "a birthday message", "the capital of Canada", "how to boil an egg")  # fmt: skip


@dataclass
class Plan:
    model: str = "tiny"
    dtype: str = "auto"
    device: str = "cpu"
    tokens: int = 48  # generated per request
    prefill_tokens: int = 256
    repeats: int = 3  # timings per figure; the median is reported
    concurrency: tuple[int, ...] = CONCURRENCY


@dataclass
class Report:
    command: str
    machine: dict[str, object]
    plan: dict[str, object]
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    sequential_tokens_per_s: float = 0.0
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # by concurrency
    serving_speedup: dict[str, float] = field(default_factory=dict)  # by concurrency
    service: dict[str, float] = field(default_factory=dict)  # the p* and training figures, with details
    unavailable: dict[str, str] = field(default_factory=dict)  # figure -> why it was not measured

    def figures(self) -> dict[str, float | None]:
        out = {"prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}
        out |= {f"serving_speedup_{n}": v for n, v in self.serving_speedup.items()}
        return out | {name: self.service.get(name) for name in HEADLINE}


def messages(i: int, words: int = 0) -> list[dict[str, str]]:
    """Request ``i``'s prompt: a different question each time, ``words`` more words of context."""
    context = " ".join(f"note {k} about {TOPICS[k % len(TOPICS)]}." for k in range(words // 5))
    question = f"Question {i}: tell me about {TOPICS[i % len(TOPICS)]}" + " please" * (i % 5)
    return [{"role": "system", "content": "You are whet. " + context}, {"role": "user", "content": question}]


async def _generated(backend: TransformersBackend, requests: list[int], tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds) for ``requests`` started together."""
    params = [SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i) for i in requests]
    started = time.perf_counter()
    done = await asyncio.gather(*(backend.generate(messages(i), [], p) for i, p in zip(requests, params, strict=True)))
    return sum(len(g.token_ids) for g in done), time.perf_counter() - started


async def measure(backend: TransformersBackend, plan: Plan, report: Report) -> Report:
    backend.stop_token_ids = set()  # equal work per request: always --tokens tokens
    backend.prefixes = PrefixCache(entries=0)  # every prompt is prefilled in full
    await _generated(backend, [0], 4)  # warm-up

    long = messages(0, words=plan.prefill_tokens)
    prompt_tokens = len(backend.prompt_ids(long, []))
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    prefill = []
    for _ in range(plan.repeats):
        started = time.perf_counter()
        await backend.generate(long, [], one)
        prefill.append(time.perf_counter() - started)
    report.prefill_tokens_per_s = prompt_tokens / statistics.median(prefill)

    first, whole = [], []
    for i in range(plan.repeats):
        first.append((await _generated(backend, [i], 1))[1])
        whole.append((await _generated(backend, [i], plan.tokens))[1])
    report.decode_tokens_per_s = (plan.tokens - 1) / max(statistics.median(whole) - statistics.median(first), 1e-9)

    widest = max(plan.concurrency)
    sequential = [await _generated(backend, [i], plan.tokens) for i in range(max(plan.repeats, 4))]
    report.sequential_tokens_per_s = sum(n for n, _ in sequential) / sum(s for _, s in sequential)
    for n in plan.concurrency:
        rates = []
        for r in range(plan.repeats):
            count, seconds = await _generated(backend, [r * widest + i for i in range(n)], plan.tokens)
            rates.append(count / seconds)
        report.tokens_per_s[str(n)] = statistics.median(rates)
        report.serving_speedup[str(n)] = report.tokens_per_s[str(n)] / report.sequential_tokens_per_s
    return report


def machine(backend: TransformersBackend) -> dict[str, object]:
    device = backend.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "device": str(device), "device_name": name, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "dtype": str(backend.model.dtype).removeprefix("torch."), "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
    }  # fmt: skip


def model_source(plan: Plan) -> Path:
    from whet.config.settings import load_config
    from whet.learner.model import resolve_source
    from whet.learner.tiny import build_tiny_model

    if plan.model == "tiny":
        return build_tiny_model(temporary_dir() / "model")
    return Path(resolve_source(plan.model, load_config().data_path))


def print_table(report: Report, console: Console) -> None:
    m = report.machine
    table = Table(title=f"serving on {report.plan['model']} ({m['device']} {m['device_name']}, {m['dtype']})")
    for column in ("figure", "value", "what"):
        table.add_column(column)
    table.add_row("prefill_tokens_per_s", f"{report.prefill_tokens_per_s:.0f}", "one prompt, alone")
    table.add_row("decode_tokens_per_s", f"{report.decode_tokens_per_s:.1f}", "one sequence")
    table.add_row("sequential tokens/s", f"{report.sequential_tokens_per_s:.1f}", "requests one after another")
    for n, speedup in report.serving_speedup.items():
        table.add_row(f"serving_speedup_{n}", f"{speedup:.2f}", f"{report.tokens_per_s[n]:.1f} tokens/s, {n} at once")
    s = report.service
    for name in HEADLINE:
        value = s.get(name)
        shown = "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)
        table.add_row(name, shown, report.unavailable.get(name) or _what(name, s))
    console.print(table)
    console.print(f"reproduce: {report.command}")


def _what(name: str, s: dict[str, float]) -> str:
    """The context a figure is read in."""
    if name.startswith("p1_"):
        return (f"{s['p1_requests']} requests, {s['p1_swaps']} swaps; p99 {s['p1_p99_ms_swapping']:.0f} ms swapping "
                f"vs {s['p1_p99_ms_steady']:.0f} ms steady")  # fmt: skip
    if name.startswith("p4_"):
        minilm = s.get("p4_minilm_query_ms_p50")
        extra = f"; + {minilm:.1f} ms embedding the request with MiniLM (the default embedder)" if minilm else ""
        return f"{s['p4_lessons']} lessons, hashing embedder, instant backend{extra}"
    if name.startswith("p5_"):
        return f"{s['p5_lessons']} lessons vs exact search"
    if name == "p7_mqtt_latency_ms_p50":
        return f"p99 {s['p7_mqtt_latency_ms_p99']:.1f} ms"
    if name == "train_tokens_per_s":
        return f"{s['train_threads']} threads, {s['train_step_ms']:.0f} ms a step"
    if name == "serving_latency_ratio_while_training":
        return f"p50 {s['serving_p50_training_ms']:.0f} ms training vs {s['serving_p50_idle_ms']:.0f} ms idle"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--json", type=Path, help="write the figures, the command and the machine here")
    parser.add_argument("--model", default="tiny", help="tiny (default), smollm2, an HF id or a model folder")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--device", default="cpu", help="cpu, cuda, auto")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="N values, comma-separated")
    parser.add_argument("--tokens", type=int, help="tokens generated per request (default 48, --quick 12)")
    parser.add_argument("--postgres", default="postgresql+psycopg://postgres@127.0.0.1:5432/test",
                        help="PostgreSQL for p6 (a throwaway schema is made and dropped)")  # fmt: skip
    parser.add_argument("--mqtt", default="mqtt://127.0.0.1:1883", help="MQTT broker for p7")
    parser.add_argument("--skip", default="", help=f"figure groups left out, comma-separated: {','.join(GROUPS)}")
    args = parser.parse_args(argv)
    skip = tuple(group for group in args.skip.split(",") if group)
    if unknown := [group for group in skip if group not in GROUPS]:
        parser.error(f"--skip {unknown[0]}: not a figure group; choose from {', '.join(GROUPS)}")
    plan = Plan(model=args.model, dtype=args.dtype, device=args.device)
    plan.concurrency = tuple(int(n) for n in args.concurrency.split(","))
    if args.quick:
        plan.tokens, plan.prefill_tokens, plan.repeats = 12, 64, 1
    if args.tokens:
        plan.tokens = args.tokens
    source = model_source(plan)
    workers = max(plan.concurrency)
    backend = TransformersBackend(str(source), device=plan.device, dtype=plan.dtype, workers=workers)
    command = shlex.join(["python", "bench/perf.py", *(sys.argv[1:] if argv is None else argv)])
    report = Report(command=command, machine=machine(backend), plan=asdict(plan))
    try:
        asyncio.run(measure(backend, plan, report))
    finally:
        asyncio.run(backend.aclose())
    sizes = Sizes.quick() if args.quick else Sizes()
    report.service, report.unavailable = asyncio.run(
        measure_service(source, plan.device, plan.dtype, sizes, args.postgres, args.mqtt, skip)
    )
    print_table(report, Console(width=120))
    if args.json:
        args.json.write_text(json.dumps({**asdict(report), "figures": report.figures()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
