"""The transformers backend and the LoRA trainer on CUDA, on the tiny model. Skipped without a GPU
(CI has none); run on a machine with one: ``python -m pytest -q tests/test_cuda.py``.

``WHET_TEST_DEVICE=cpu`` runs the same tests on the CPU, to check the tests themselves where no GPU is.
"""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import pytest
import torch
from batchgate import decoded_together
from perturbed import perturbed_adapter

from whet.runtime.policy import SamplingParams

DEVICE = os.environ.get("WHET_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device here")

PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief and kind."}, {"role": "user", "content": "What time is it in Tokyo?"}],
    [{"role": "user", "content": "Write a short poem about the sea, the wind and a small boat at night."}],
    [{"role": "user", "content": "Weather?"}],
]
ADAPTERS = [None, "a1", "a2", "a1"]
BUDGETS = [6, 14, 9, 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from whet.learner.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("data") / "models" / "tiny")


def _backend(model_dir: Path, adapters: Path, dtype: str):
    from whet.runtime.hf import TransformersBackend

    engine = TransformersBackend(str(model_dir), device=DEVICE, dtype=dtype, workers=4)

    async def load() -> None:
        await engine.load_adapter("a1", str(perturbed_adapter(model_dir, adapters / "a1", 1)))
        await engine.load_adapter("a2", str(perturbed_adapter(model_dir, adapters / "a2", 2)))

    asyncio.run(load())
    return engine


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def backend(request, model_dir, tmp_path_factory):
    engine = _backend(model_dir, tmp_path_factory.mktemp("adapters"), request.param)
    yield engine
    asyncio.run(engine.aclose())


async def _alone(backend, params):
    return [await backend.generate(m, [], p, adapter=a) for m, p, a in zip(PROMPTS, params, ADAPTERS, strict=True)]


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="a CUDA check")
def test_auto_serves_bfloat16_on_a_gpu_with_bfloat16_tensor_cores(model_dir):
    from whet.learner.model import cuda_has_bfloat16
    from whet.runtime.hf import TransformersBackend

    engine = TransformersBackend(str(model_dir), device="auto", workers=1)
    try:
        assert engine.device.type == "cuda"
        assert engine.model.dtype == (torch.bfloat16 if cuda_has_bfloat16(engine.device) else torch.float32)
    finally:
        asyncio.run(engine.aclose())


@pytest.mark.anyio
async def test_greedy_requests_on_mixed_adapters_decode_together_on_cuda_as_each_would_alone(backend):
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in BUDGETS]
    alone = await _alone(backend, params)
    assert next(backend.model.parameters()).device.type == torch.device(DEVICE).type
    engine = backend._engine
    mixed = engine.mixed_steps
    together = await decoded_together(
        backend, [backend.generate(m, [], p, adapter=a) for m, p, a in zip(PROMPTS, params, ADAPTERS, strict=True)]
    )
    assert engine.widest == len(PROMPTS) and engine.mixed_steps > mixed
    # float32: the batched pass reproduces the single-sequence tokens; bfloat16 sums in another order per
    # batch shape, so a near tie may flip: its log-probs stay close while the tokens agree
    tolerance = 1e-4 if backend.model.dtype == torch.float32 else 0.1
    for got, want in zip(together, alone, strict=True):
        same = got.token_ids[: len(want.token_ids)] == want.token_ids
        if backend.model.dtype == torch.float32:
            assert same
        if same:
            assert got.logprobs == pytest.approx(want.logprobs, abs=tolerance)
        assert all(isinstance(lp, float) and math.isfinite(lp) and lp <= 0.0 for lp in got.logprobs)


@pytest.mark.anyio
async def test_seeded_sampling_on_cuda_repeats_with_the_same_seed(backend):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    first = await backend.generate(PROMPTS[2], [], params, adapter="a2")
    second = await backend.generate(PROMPTS[2], [], params, adapter="a2")
    assert first.token_ids == second.token_ids and len(first.token_ids) > 1


@pytest.mark.anyio
async def test_the_trainer_on_cuda_trains_saves_and_its_adapter_serves_on_cuda(model_dir, tmp_path):
    from whet.config.settings import LoraConfig
    from whet.learner.objective import build_objective
    from whet.learner.trainer import LoraTrainer, Sample
    from whet.runtime.hf import TransformersBackend

    backend = TransformersBackend(str(model_dir), device=DEVICE, workers=4)  # auto: bfloat16 on an A100/H100
    trainer = LoraTrainer.load(str(model_dir), LoraConfig(), build_objective("rl"), device=DEVICE)
    try:
        assert trainer.device.type == backend.device.type == torch.device(DEVICE).type
        # the learner loads what serving loads, so it recomputes log-probs on the weights that served them
        assert trainer.model.get_base_model().dtype == backend.model.dtype
        served = await asyncio.gather(*(backend.generate(m, [], SamplingParams(max_new_tokens=10, seed=i))
                                        for i, m in enumerate(PROMPTS)))  # fmt: skip
        with torch.no_grad():
            again = [trainer.response_logprobs(g.prompt_token_ids, g.token_ids).cpu() for g in served]
        # the learner recomputes what serving recorded, in the same dtype: the importance ratio is near 1
        for g, lp in zip(served, again, strict=True):
            assert lp.dtype == torch.float32
            assert lp.tolist() == pytest.approx(g.logprobs, abs=0.1)
        samples = [Sample(f"t{i}", g.prompt_token_ids, g.token_ids, g.logprobs, 1 if i % 2 else -1)
                   for i, g in enumerate(served)]  # fmt: skip
        before = trainer.lora_state()
        stats = trainer.step(samples, baseline=0.0)
        assert all(math.isfinite(v) for v in stats.values())
        after = trainer.lora_state()
        assert all(v.device.type == trainer.device.type for v in after.values())
        assert any(not torch.equal(before[k], after[k]) for k in before)
        trainer.save(tmp_path / "v1")
        trainer.reset(tmp_path / "v1")  # a lineage resumes on the device, optimizer state included
        await backend.load_adapter("v1", str(tmp_path / "v1"))
        both = await decoded_together(backend, [
            backend.generate(PROMPTS[1], [], SamplingParams(max_new_tokens=6, temperature=0.0), adapter="v1"),
            backend.generate(PROMPTS[1], [], SamplingParams(max_new_tokens=6, temperature=0.0)),
        ])  # fmt: skip
        assert [g.adapter for g in both] == ["v1", None]
    finally:
        await backend.aclose()
