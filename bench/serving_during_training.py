"""How much a training step slows serving when the learner runs alongside (the default deployment).

Runs on the untrained tiny model built locally (no download): median chat latency of the
in-process transformers engine while the learner is idle, then while LoRA training
steps run back to back in the learner's worker thread (on ``learner.threads`` CPU threads,
half the cores by default, as the learner runs them), and the ratio of the two. Training
speed is reported as tokens (prompt and response) through forward and backward per second.

    python bench/serving_during_training.py [--requests 20] [--batch 16] [--threads N] [--device cuda]
                                            [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

import anyio
import torch

from whet.config.settings import LoraConfig
from whet.learner.objective import build_objective
from whet.learner.tiny import build_tiny_model
from whet.learner.trainer import LoraTrainer, Sample, cpu_name, limited_threads, training_threads
from whet.runtime.hf import TransformersBackend
from whet.runtime.policy import SamplingParams

PROMPT = [{"role": "system", "content": "You are whet."}, {"role": "user", "content": "What is on my list today?"}]


async def latencies(backend: TransformersBackend, n: int) -> list[float]:
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    out = []
    for _ in range(n):
        started = time.perf_counter()
        await backend.generate(PROMPT, [], params)
        out.append(time.perf_counter() - started)
    return out


def batch(trainer: LoraTrainer, size: int) -> list[Sample]:
    prompt = trainer.tokenizer.encode("<|im_start|>user\nAdd milk to the shopping list<|im_end|>\n<|im_start|>assistant\n")
    response = trainer.tokenizer.encode("Added milk to your shopping list.<|im_end|>")
    with torch.no_grad():
        behaviour = trainer.response_logprobs(prompt, response).tolist()
    return [Sample(f"t{i}", prompt, response, behaviour, 1 if i % 2 else -1) for i in range(size)]


async def measure(model: Path, requests: int, size: int, threads: int | None = None, *, device: str = "cpu",
                  dtype: str = "auto") -> dict[str, float]:  # fmt: skip
    """Serving latency idle and while training on ``model``; training tokens/s on ``threads``.

    Serving and training both run on ``device`` in ``dtype`` (``model.dtype``), as ``whet serve``
    runs them with the learner alongside (on CUDA they share the GPU; ``threads`` then bounds the
    CPU side of a step only)."""
    backend = TransformersBackend(str(model), device=device, dtype=dtype, workers=2)
    objective = build_objective("combined", clip_low=0.2, clip_high=0.28, advantage_clip=5.0,
                                rl_weight=1.0, opd_weight=1.0, kl_weight=0.0)  # fmt: skip
    trainer = LoraTrainer.load(str(model), LoraConfig(), objective, device=device, dtype=dtype)
    samples = batch(trainer, size)
    tokens_per_step = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    await latencies(backend, 3)  # warm-up
    idle = await latencies(backend, requests)

    stop, steps = threading.Event(), []
    threads = training_threads(threads)

    def train() -> None:
        with limited_threads(threads):  # as the learner runs its steps
            while not stop.is_set() or not steps:  # at least one whole step
                started = time.perf_counter()
                trainer.step(samples, baseline=0.0)
                steps.append(time.perf_counter() - started)

    training = asyncio.ensure_future(anyio.to_thread.run_sync(train))
    busy = await latencies(backend, requests)
    stop.set()
    await training
    await backend.aclose()
    return {
        "serving_p50_idle_ms": statistics.median(idle) * 1000,
        "serving_p50_training_ms": statistics.median(busy) * 1000,
        "serving_latency_ratio_while_training": statistics.median(busy) / statistics.median(idle),
        "train_step_ms": statistics.median(steps) * 1000,
        "train_steps": len(steps),
        "train_threads": threads,
        "train_tokens_per_s": tokens_per_step / statistics.median(steps),
        "train_device": str(trainer.device),
        "train_bfloat16": trainer.bf16,
    }


async def main(requests: int, size: int, threads: int | None, device: str, dtype: str) -> None:
    with tempfile.TemporaryDirectory(prefix="whet-perf-") as scratch:
        model = build_tiny_model(Path(scratch) / "model")
        m = await measure(model, requests, size, threads, device=device, dtype=dtype)
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} torch threads")
    idle = m["serving_p50_idle_ms"]
    print(f"chat latency p50, learner idle:     {idle:.1f} ms ({requests} requests, 32 new tokens)")
    print(f"chat latency p50, training steps:   {m['serving_p50_training_ms']:.1f} ms ({m['train_steps']} steps of "
          f"{size} samples on {m['train_threads']} threads, {m['train_step_ms']:.0f} ms each)")  # fmt: skip
    print(f"ratio (training / idle): {m['serving_latency_ratio_while_training']:.2f}")
    print(f"training: {m['train_tokens_per_s']:.0f} tokens/s")
    print(f"reproduce: python bench/serving_during_training.py --requests {requests} --batch {size}"
          + (f" --threads {threads}" if threads else "") + f" --device {device} --dtype {dtype}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, help="training threads (default: half the cores, learner.threads)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.batch, args.threads, args.device, args.dtype))
