"""The transformers backend's batching engine on the tiny model: concurrent requests share forward
passes and get exactly what each would get alone; reply text without special tokens; sampling
settings at the edge of float32."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from batchgate import decoded_together
from perturbed import perturbed_adapter

from whet.runtime.policy import Generation, SamplingParams

PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief and kind."}, {"role": "user", "content": "What time is it in Tokyo?"}],
    [{"role": "user", "content": "Write a short poem about the sea, the wind and a small boat at night."}],
    [{"role": "user", "content": "Weather?"}],
]
ADAPTERS = [None, "a1", "a2", "a1"]
BUDGETS = [6, 14, 9, 12]  # rows leave the batch at different steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from whet.learner.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("data") / "models" / "tiny")


@pytest.fixture(scope="module")
def backend(model_dir, tmp_path_factory):
    from whet.runtime.hf import TransformersBackend

    engine = TransformersBackend(str(model_dir), device="cpu", workers=4)

    async def load() -> None:
        await engine.load_adapter("a1", str(perturbed_adapter(model_dir, tmp_path_factory.mktemp("a1"), 1)))
        await engine.load_adapter("a2", str(perturbed_adapter(model_dir, tmp_path_factory.mktemp("a2"), 2)))

    asyncio.run(load())
    yield engine
    asyncio.run(engine.aclose())


async def _alone(backend, params: list[SamplingParams]) -> list[Generation]:
    return [await backend.generate(m, [], p, adapter=a) for m, p, a in zip(PROMPTS, params, ADAPTERS, strict=True)]


def _same(together: list[Generation], alone: list[Generation]) -> None:
    for got, want in zip(together, alone, strict=True):
        assert got.token_ids == want.token_ids and got.text == want.text and got.adapter == want.adapter
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


@pytest.mark.anyio
async def test_concurrent_greedy_requests_on_different_adapters_decode_together_as_each_would_alone(backend):
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in BUDGETS]
    alone = await _alone(backend, params)
    assert len({tuple(g.token_ids) for g in alone}) == len(alone), "the prompts should give different replies"
    assert sum(len(g.token_ids) for g in alone) > 2 * len(alone)
    engine = backend._engine
    steps, mixed = engine.steps, engine.mixed_steps
    together = await decoded_together(
        backend, [backend.generate(m, [], p, adapter=a) for m, p, a in zip(PROMPTS, params, ADAPTERS, strict=True)]
    )
    _same(together, alone)
    assert engine.widest == len(PROMPTS)
    # every step after the prefills advanced the rows still running, in one pass for all
    assert engine.steps - steps == max(len(g.token_ids) for g in alone) - 1
    assert engine.mixed_steps > mixed


@pytest.mark.anyio
async def test_prompts_arriving_together_are_prefilled_in_one_padded_pass_as_each_would_be_alone(backend, monkeypatch):
    from whet.runtime.prefix import PrefixCache

    monkeypatch.setattr(backend, "prefixes", PrefixCache(entries=0))  # no prompt starts from a kept cache
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in BUDGETS]
    alone = await _alone(backend, params)
    together_sizes = []
    real = backend._prefill_together
    monkeypatch.setattr(backend, "_prefill_together", lambda seqs: together_sizes.append(len(seqs)) or real(seqs))
    together = await decoded_together(
        backend, [backend.generate(m, [], p, adapter=a) for m, p, a in zip(PROMPTS, params, ADAPTERS, strict=True)]
    )
    _same(together, alone)  # padded prompts of different lengths, on three adapters, give each its own tokens
    assert together_sizes and max(together_sizes) > 1 and sum(together_sizes) <= len(PROMPTS)


@pytest.mark.anyio
async def test_seeded_sampling_with_per_request_settings_is_unchanged_by_batching(backend):
    params = [
        SamplingParams(max_new_tokens=n, temperature=t, top_p=p, seed=s)
        for n, t, p, s in zip(BUDGETS, [1.0, 0.7, 1.5, 1.2], [1.0, 0.9, 0.5, 1.0], [1, 2, 3, 4], strict=True)
    ]
    alone = await _alone(backend, params)
    together = await decoded_together(
        backend, [backend.generate(m, [], p, adapter=a) for m, p, a in zip(PROMPTS, params, ADAPTERS, strict=True)]
    )
    _same(together, alone)


@pytest.mark.anyio
async def test_a_request_joining_a_running_batch_with_a_longer_prompt_gets_its_single_sequence_tokens(backend):
    long_params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    late_params = SamplingParams(max_new_tokens=10, temperature=0.0)
    long_prompt = [{"role": "user", "content": "Tell me everything about the weather in Paris. " * 6}]
    first_alone = await backend.generate(PROMPTS[0], [], long_params, adapter="a2")
    late_alone = await backend.generate(long_prompt, [], late_params, adapter="a1")
    assert len(first_alone.token_ids) > 12, "the first request should still be running when the second joins"

    stream = backend.stream(PROMPTS[0], [], long_params, adapter="a2")
    deltas, late = [], None
    async for item in stream:
        if isinstance(item, Generation):
            first = item
        else:
            deltas.append(item)
            if late is None:  # the first is mid-decode: the second joins its batch
                late = await _join_running(backend, backend.generate(long_prompt, [], late_params, adapter="a1"))
    _same([first, await late], [first_alone, late_alone])
    assert "".join(deltas) == first.text


async def _join_running(backend, request) -> asyncio.Future:
    """Start ``request`` while the engine holds a running sequence, before its next step."""
    engine, loop = backend._engine, asyncio.get_running_loop()
    expected = engine.submitted + 1
    deadline = loop.time() + 20
    while not engine.rows and loop.time() < deadline:  # its first token's text can arrive before it joins the batch
        await asyncio.sleep(0.001)
    with backend._lock.write():  # waits for the step in progress; the next one waits for us
        assert len(engine.rows) == 1, "the running request should still be in the batch"
        task = asyncio.ensure_future(request)
        deadline = loop.time() + 20
        while engine.submitted < expected and loop.time() < deadline:
            await asyncio.sleep(0.005)
    return task


def _token(backend, text: str) -> int:
    return backend.tokenizer.convert_tokens_to_ids(text)


@pytest.mark.anyio
async def test_special_tokens_stay_in_the_token_ids_but_never_reach_the_reply_text(backend, monkeypatch):
    import whet.runtime.hf as hf

    words = backend.tokenizer.encode("Hello there", add_special_tokens=False)
    script = [*words[:1], _token(backend, "<|im_start|>"), *words[1:]]  # <|endoftext|> is a stop token here
    script.append(_token(backend, "<|im_end|>"))
    picks = iter(script)
    monkeypatch.setattr(hf, "sample_tokens", lambda logits, settings, generators: [(next(picks), -1.0)])

    deltas, final = [], None
    async for item in backend.stream(PROMPTS[0], [], SamplingParams(max_new_tokens=20)):
        if isinstance(item, Generation):
            final = item
        else:
            deltas.append(item)
    assert final.token_ids == script and final.finish_reason == "stop"
    assert final.text == final.content == "Hello there"
    assert "".join(deltas) == "Hello there"


@pytest.mark.anyio
@pytest.mark.parametrize("temperature, top_p", [(1e-39, 1.0), (1e-300, 1.0), (1.0, 1e-46), (0.5, 1e-300), (5e-324, 0.0)])
async def test_tiny_temperatures_and_top_ps_sample_the_most_likely_token_streaming_included(
    backend, temperature, top_p
):
    greedy = await backend.generate(PROMPTS[1], [], SamplingParams(max_new_tokens=8, temperature=0.0))
    params = SamplingParams(max_new_tokens=8, temperature=temperature, top_p=top_p, seed=1)
    deltas, final = [], None
    async for item in backend.stream(PROMPTS[1], [], params):
        if isinstance(item, Generation):
            final = item
        else:
            deltas.append(item)
    assert final.token_ids == greedy.token_ids
    assert "".join(deltas) == final.text == greedy.text
    assert all(lp == lp and lp <= 0.0 for lp in final.logprobs)  # no nan


def test_log_probs_are_float32_even_when_the_model_computes_in_bfloat16():
    from whet.runtime.hf import sample_token

    logits = (torch.randn(500, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)  # [V]
    token, logprob = sample_token(logits, 0.0, 1.0, torch.Generator())
    assert token == int(torch.argmax(logits))
    exact = float(torch.log_softmax(logits.float(), dim=-1)[token])
    assert logprob == exact
    assert logprob != float(torch.log_softmax(logits, dim=-1)[token])  # what bfloat16 arithmetic would give


def test_sampling_a_batch_draws_each_row_exactly_as_it_would_alone():
    from whet.runtime.hf import sample_token, sample_tokens

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3  # [B, V]
    settings = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (1e-30, 1.0)]
    alone = [sample_token(logits[b], t, p, torch.Generator().manual_seed(b)) for b, (t, p) in enumerate(settings)]
    together = sample_tokens(logits, settings, [torch.Generator().manual_seed(b) for b in range(len(settings))])
    assert together == alone
    assert len({token for token, _ in together}) > 2  # the rows did draw different tokens


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu_and_a_name_is_kept(monkeypatch):
    from whet.learner.model import serving_dtype

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100
    assert serving_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert serving_dtype("auto", torch.device("cpu")) == "float32"
    assert serving_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    assert serving_dtype("float32", torch.device("cuda")) == "float32"


@pytest.mark.parametrize("capability, bf16", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True),
                                              ((9, 0), True)])  # fmt: skip
def test_auto_is_float32_on_gpus_that_only_emulate_bfloat16_for_serving_and_training(monkeypatch, capability, bf16):
    from whet.learner.model import serving_dtype
    from whet.learner.trainer import use_bfloat16

    asked = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    device = torch.device("cuda:1")
    assert serving_dtype("auto", device) == ("bfloat16" if bf16 else "float32")
    assert use_bfloat16("auto", device) is bf16
    assert asked == [device, device]  # the device in use, not whichever is current
    assert serving_dtype("bfloat16", device) == "bfloat16" and use_bfloat16("bfloat16", device)


@pytest.mark.parametrize("machine, onednn, avx512_bf16, amx, bf16", [
    ("x86_64", True, False, False, False),  # AVX-512 without its bfloat16 instructions: oneDNN emulates them
    ("x86_64", True, True, False, True), ("x86_64", True, False, True, True), ("x86_64", False, True, True, False),
    ("aarch64", True, False, False, True), ("aarch64", False, False, False, False),
])  # fmt: skip
def test_auto_trains_in_bfloat16_on_a_cpu_only_where_it_has_native_bfloat16(monkeypatch, machine, onednn, avx512_bf16,
                                                                           amx, bf16):  # fmt: skip
    import platform

    from whet.learner.trainer import use_bfloat16

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert use_bfloat16("auto", torch.device("cpu")) is bf16
    assert use_bfloat16("bfloat16", torch.device("cpu")) and not use_bfloat16("float32", torch.device("cpu"))


@pytest.mark.anyio
async def test_a_bfloat16_backend_serves_in_bfloat16_with_float32_log_probs(model_dir):
    from whet.runtime.hf import TransformersBackend

    engine = TransformersBackend(str(model_dir), device="cpu", dtype="bfloat16", workers=2)
    try:
        assert engine.model.dtype == torch.bfloat16
        generation = await engine.generate(PROMPTS[1], [], SamplingParams(max_new_tokens=6, temperature=0.0))
        ids = torch.tensor([generation.prompt_token_ids + generation.token_ids])  # [1, P+T]
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(generation.prompt_token_ids) - 1 : -1]  # [T, V] bfloat16
        exact = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(generation.token_ids)[:, None])
        assert generation.logprobs == pytest.approx(exact[:, 0].tolist(), abs=0.05)  # bf16 sums differ per pass
    finally:
        await engine.aclose()


@pytest.mark.anyio
async def test_closing_the_backend_ends_its_batching_thread_before_it_returns(model_dir):
    # a process that exited with the loop's thread still in torch aborted now and then (exit -6)
    from whet.runtime.hf import TransformersBackend

    engine = TransformersBackend(str(model_dir), device="cpu", workers=2)
    await engine.generate(PROMPTS[1], [], SamplingParams(max_new_tokens=4, temperature=0.0))
    thread = engine._engine._thread
    assert thread.is_alive()
    await engine.aclose()
    assert not thread.is_alive()


@pytest.mark.anyio
async def test_a_request_whose_prefill_fails_gets_the_error_while_the_batch_goes_on(backend, monkeypatch):
    engine = backend._engine
    real_prefill = engine._prefill

    def prefill(seqs):  # a shared prefill with the bad request fails whole: each is then tried alone
        if any(seq.params.seed == 13 for seq in seqs):
            raise RuntimeError("prefill broke")
        return real_prefill(seqs)

    async def caught(request):
        try:
            return await request
        except RuntimeError as exc:
            return exc

    ok = SamplingParams(max_new_tokens=8, temperature=0.0, seed=1)
    alone = await backend.generate(PROMPTS[2], [], ok, adapter="a2")
    monkeypatch.setattr(engine, "_prefill", prefill)
    failed, done = await decoded_together(backend, [
        caught(backend.generate(PROMPTS[1], [], SamplingParams(max_new_tokens=8, seed=13))),
        backend.generate(PROMPTS[2], [], ok, adapter="a2"),
    ])  # fmt: skip
    assert isinstance(failed, RuntimeError) and "prefill broke" in str(failed)
    _same([done], [alone])


@pytest.mark.anyio
async def test_a_row_leaving_the_batch_leaves_its_own_cache_for_prefix_reuse(backend, monkeypatch):
    from whet.runtime.hf import BASE
    from whet.runtime.prefix import PrefixCache

    monkeypatch.setattr(backend, "prefixes", PrefixCache())
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in BUDGETS]
    prompts = [[{"role": "system", "content": "You are whet. " * k}, m[-1]] for k, m in zip((9, 14, 20, 11), PROMPTS, strict=True)]
    done = await decoded_together(backend, [backend.generate(m, [], p) for m, p in zip(prompts, params, strict=True)])
    assert len({len(g.prompt_token_ids) for g in done}) == len(done)  # rows of different lengths: padded
    for generation in done:
        ids = [*generation.prompt_token_ids, *generation.token_ids[:-1]]  # the last token was never fed
        kept, length = backend.prefixes.take(BASE, [*ids, 0])
        assert length == len(ids)
        _, fresh = backend._forward(torch.tensor([ids]), None, [BASE])  # [1, n] from scratch
        for mine, theirs in zip(kept.layers, fresh.layers, strict=True):
            assert mine.keys.shape == theirs.keys.shape  # [1, H, n, D]: no padding, no other row
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
            assert torch.allclose(mine.values, theirs.values, atol=1e-5)


def test_prompts_are_grouped_for_one_pass_only_within_the_token_budget():
    from whet.runtime.hf import _groups

    assert _groups([(0, 30), (1, 31), (2, 800), (3, 40)], 256) == [[0, 1, 3]]  # the long one runs alone
    assert _groups([(i, 100) for i in range(5)], 256) == [[0, 1], [2, 3]]  # 2 x 100 fit, not 3; the fifth alone
    assert _groups([(0, 300), (1, 300)], 256) == []


@pytest.mark.anyio
async def test_a_version_loaded_into_a_retired_versions_modules_answers_as_if_loaded_fresh(model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from whet.runtime.hf import TransformersBackend

    first, second = perturbed_adapter(model_dir, tmp_path / "v1", 5), perturbed_adapter(model_dir, tmp_path / "v2", 6)
    other_rank = tmp_path / "r8"  # another config: it cannot use rank-4 modules
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                   LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).save_pretrained(other_rank)  # fmt: skip
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    fresh = TransformersBackend(str(model_dir), device="cpu")
    reused = TransformersBackend(str(model_dir), device="cpu")
    try:
        await fresh.load_adapter("v2", str(second))
        want = await fresh.generate(PROMPTS[1], [], params, adapter="v2")

        await reused.load_adapter("v1", str(first))
        await reused.unload_adapter("v1")  # retired: its modules are kept
        await reused.load_adapter("v2", str(second))
        assert reused._slot_of["v2"] == "v1" and "v2" not in reused._peft.peft_config  # no new modules built
        got = await reused.generate(PROMPTS[1], [], params, adapter="v2")
        assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-6)
        assert got.adapter == "v2"

        await reused.load_adapter("r8", str(other_rank))
        assert reused._slot_of["r8"] == "r8"  # built its own
        await reused.unload_adapter("v2")
        await reused.load_adapter("v3", str(first))  # back into the modules v2 used
        again = await reused.generate(PROMPTS[1], [], params, adapter="v3")
        assert again.token_ids != want.token_ids or again.logprobs != pytest.approx(want.logprobs, abs=1e-6)
    finally:
        await fresh.aclose()
        await reused.aclose()


def test_sampling_draws_from_the_tempered_distribution_and_never_outside_the_nucleus():
    from whet.runtime.hf import sample_tokens

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])  # [1, V]
    for temperature in (1.0, 0.5):
        want = torch.softmax(logits[0] / temperature, dim=-1)
        generator = torch.Generator().manual_seed(7)
        counts = torch.zeros(5)
        for _ in range(4000):
            counts[sample_tokens(logits, [(temperature, 1.0)], [generator])[0][0]] += 1
        assert torch.allclose(counts / 4000, want, atol=0.025), (temperature, counts / 4000, want)
    # top_p 0.7: the two likeliest tokens hold 0.66 + 0.24 of the mass, so only they may be drawn
    generator = torch.Generator().manual_seed(7)
    drawn = {sample_tokens(logits, [(1.0, 0.7)], [generator])[0][0] for _ in range(500)}
    assert drawn == {0, 1}
