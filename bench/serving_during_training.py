"""How much a training step slows serving when the learner runs alongside (the default deployment).

Runs on the untrained tiny model built locally (no download): median chat latency of the
in-process transformers engine while the learner is idle, then while LoRA training
steps run back to back in the learner's worker thread, and the ratio of the two.

    python bench/serving_during_training.py [--requests 20] [--batch 16]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
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
from whet.learner.trainer import LoraTrainer, Sample
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


async def main(requests: int, size: int) -> None:
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "model")
    backend = TransformersBackend(str(model), device="cpu", workers=2)
    objective = build_objective("combined", clip_low=0.2, clip_high=0.28, advantage_clip=5.0,
                                rl_weight=1.0, opd_weight=1.0, kl_weight=0.0)  # fmt: skip
    trainer = LoraTrainer.load(str(model), LoraConfig(), objective, device="cpu")
    samples = batch(trainer, size)
    await latencies(backend, 3)  # warm-up
    idle = await latencies(backend, requests)

    stop, steps = threading.Event(), []

    def train() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            trainer.step(samples, baseline=0.0)
            steps.append(time.perf_counter() - started)

    training = asyncio.ensure_future(anyio.to_thread.run_sync(train))
    busy = await latencies(backend, requests)
    stop.set()
    await training
    await backend.aclose()
    idle_p50, busy_p50 = statistics.median(idle), statistics.median(busy)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads")
    print(f"chat latency p50, learner idle:     {idle_p50 * 1000:.1f} ms ({requests} requests, 32 new tokens)")
    print(f"chat latency p50, training steps:   {busy_p50 * 1000:.1f} ms ({len(steps)} steps of {size} samples, "
          f"{statistics.median(steps) * 1000:.0f} ms each)")  # fmt: skip
    print(f"ratio (training / idle): {busy_p50 / idle_p50:.2f}")
    print("reproduce: python bench/serving_during_training.py " f"--requests {requests} --batch {size}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.batch))
