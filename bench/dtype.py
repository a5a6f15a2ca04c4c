"""Which ``model.dtype`` to default to on this device: float32 against bfloat16, measured.

For each dtype, on one model and one device:

- serving, as ``bench/perf.py`` measures it: prefill tokens/s, one-sequence decode tokens/s, and
  tokens/s with N requests decoded together;
- ``raw_decode_tokens_per_s``: the model's own forward passes, one token at a time with its cache and
  greedy picks on the device, no engine: what the engine's bookkeeping and sampling cost is read against;
- training: LoRA steps as the learner builds its trainer (weights in ``model.dtype``,
  ``lora.precision: auto``), tokens through forward and backward per second;
- ``logprob_error_*``: how far the learner's recomputed log-probs of served tokens are from the ones
  serving recorded (batched, then recomputed one sample at a time): the importance ratio of an
  unchanged policy is ``exp`` of that, exactly 1 in exact arithmetic.

On CUDA, ``float32-tf32`` is float32 weights with TF32 matrix products
(``torch.set_float32_matmul_precision("high")``), a third candidate between the two.

    python bench/dtype.py [--model tiny|smollm2|FOLDER|FILE.gguf] [--device cuda] [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench scripts beside this one
from perf import Plan, Report, machine, measure, messages, model_source  # noqa: E402
from serving_during_training import batch  # noqa: E402

from whet.config.settings import LoraConfig  # noqa: E402
from whet.learner.model import cache_of, with_cache  # noqa: E402
from whet.learner.objective import build_objective  # noqa: E402
from whet.learner.trainer import LoraTrainer  # noqa: E402
from whet.runtime.hf import TransformersBackend  # noqa: E402
from whet.runtime.policy import SamplingParams  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_decode(backend: TransformersBackend, tokens: int, repeats: int) -> float:
    """Tokens/s of the bare model decoding one sequence greedily (no engine, no sampling on the host)."""
    model, device = backend.model, backend.device
    prompt = torch.tensor([backend.prompt_ids(messages(0), [])], device=device)  # [1, P]
    rates = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is a warm-up
            out = model(prompt, use_cache=True, logits_to_keep=1)
            cache, token = cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            _sync(device)
            started = time.perf_counter()
            for _ in range(tokens):
                out = model(token, **with_cache(cache), use_cache=True, logits_to_keep=1)
                cache, token = cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            rates.append(tokens / (time.perf_counter() - started))
    return statistics.median(rates[1:])


async def logprob_error(backend: TransformersBackend, trainer: LoraTrainer, n: int, tokens: int) -> dict[str, float]:
    """Served log-probs (n requests decoded together) against the trainer's recomputation."""
    params = [SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i) for i in range(n)]
    served = await asyncio.gather(*(backend.generate(messages(i), [], p) for i, p in enumerate(params)))
    errors = []
    with torch.no_grad():
        for g in served:
            again = trainer.response_logprobs(g.prompt_token_ids, g.token_ids).float().cpu()  # [T]
            errors.append((again - torch.tensor(g.logprobs)).abs())
    every = torch.cat(errors)
    return {"logprob_error_mean": float(every.mean()), "logprob_error_max": float(every.max()),
            "ratio_error_max": float(torch.expm1(every.max()))}  # fmt: skip


def train_rate(trainer: LoraTrainer, size: int, steps: int) -> dict[str, float]:
    samples = batch(trainer, size)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    trainer.step(samples, baseline=0.0)  # warm-up
    times = []
    for _ in range(steps):
        _sync(trainer.device)
        started = time.perf_counter()
        trainer.step(samples, baseline=0.0)
        _sync(trainer.device)
        times.append(time.perf_counter() - started)
    return {"train_tokens_per_s": tokens / statistics.median(times), "train_step_ms": statistics.median(times) * 1000,
            "train_bfloat16_compute": trainer.bf16}  # fmt: skip


async def one(source: Path, device: str, dtype: str, plan: Plan, train_batch: int, train_steps: int) -> dict:
    weights = "float32" if dtype == "float32-tf32" else dtype
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "float32-tf32" else "highest")
    try:
        backend = TransformersBackend(str(source), device=device, dtype=weights, workers=max(plan.concurrency))
        objective = build_objective("combined", clip_low=0.2, clip_high=0.28, advantage_clip=5.0,
                                    rl_weight=1.0, opd_weight=1.0, kl_weight=0.0)  # fmt: skip
        trainer = LoraTrainer.load(str(source), LoraConfig(), objective, device=device, dtype=weights)
        try:
            error = await logprob_error(backend, trainer, 8, plan.tokens)
            report = Report(command="", machine=machine(backend), plan=asdict(plan))
            await measure(backend, plan, report)
            raw = raw_decode(backend, plan.tokens, plan.repeats)
        finally:
            await backend.aclose()
        training = train_rate(trainer, train_batch, train_steps)
        return {
            "machine": report.machine, "prefill_tokens_per_s": report.prefill_tokens_per_s,
            "decode_tokens_per_s": report.decode_tokens_per_s, "raw_decode_tokens_per_s": raw,
            "sequential_tokens_per_s": report.sequential_tokens_per_s, "tokens_per_s": report.tokens_per_s,
            **training, **error,
        }  # fmt: skip
    finally:
        torch.set_float32_matmul_precision(precision)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (default), smollm2, an HF id, a folder or a .gguf file")
    parser.add_argument("--device", default="auto", help="cpu, cuda, auto")
    parser.add_argument("--dtypes", default=None, help="comma-separated (default: float32,bfloat16, and "
                        "float32-tf32 on CUDA)")  # fmt: skip
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32", "bfloat16", *(["float32-tf32"] if cuda else [])]
    plan = Plan(model=args.model, device=args.device, tokens=args.tokens,
                concurrency=tuple(int(n) for n in args.concurrency.split(",")))  # fmt: skip
    steps = 5
    if args.quick:
        plan.tokens, plan.prefill_tokens, plan.repeats, args.train_batch, steps = 6, 32, 1, 2, 1
    source = model_source(plan)
    command = "python bench/dtype.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results: dict[str, dict] = {}
    # each dtype's figures are printed and written as it ends: a run cut off at a time limit keeps what it measured
    for dtype in dtypes:
        results[dtype] = r = asyncio.run(one(source, args.device, dtype, plan, args.train_batch, steps))
        print(f"{dtype}: prefill {r['prefill_tokens_per_s']:.0f} tokens/s, decode {r['decode_tokens_per_s']:.1f}, "
              f"train {r['train_tokens_per_s']:.0f}, log-prob error max {r['logprob_error_max']:.2e}", flush=True)
        if args.json:
            left = dtypes[len(results):]
            args.json.write_text(json.dumps({"command": command, "plan": asdict(plan), "dtypes": results,
                                             **({"not_yet_measured": left} if left else {})}, indent=2) + "\n")  # fmt: skip

    first = next(iter(results.values()))["machine"]
    table = Table(title=f"model.dtype on {args.model} ({first['device']} {first['device_name']})")
    table.add_column("figure")
    for dtype in dtypes:
        table.add_column(dtype)
    rows = [("prefill_tokens_per_s", "{:.0f}"), ("decode_tokens_per_s", "{:.1f}"), ("raw_decode_tokens_per_s", "{:.1f}"),
            *((f"tokens_per_s@{n}", "{:.1f}") for n in plan.concurrency),
            ("train_tokens_per_s", "{:.0f}"), ("logprob_error_mean", "{:.2e}"), ("logprob_error_max", "{:.2e}")]  # fmt: skip
    for name, fmt in rows:
        values = [r["tokens_per_s"][name.split("@")[1]] if "@" in name else r[name] for r in results.values()]
        table.add_row(name, *(fmt.format(v) for v in values))
    Console(width=120).print(table)
    print(f"reproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
