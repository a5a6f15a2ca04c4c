"""Policy backends: the scripted twin, the in-process transformers engine on a tiny model, remote engines."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from batchgate import decoded_together
from perturbed import perturbed_adapter

from whet.runtime.backends import create_backend
from whet.runtime.policy import BackendError, Generation, PolicyBackend, SamplingParams
from whet.runtime.scripted import SCRIPTED_LOGPROB, ScriptedBackend

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def _collect(stream) -> tuple[list[str], Generation]:
    deltas, final = [], None
    async for item in stream:
        if isinstance(item, Generation):
            final = item
        else:
            deltas.append(item)
    assert final is not None
    return deltas, final


# -- scripted -----------------------------------------------------------------


@pytest.mark.anyio
async def test_scripted_backend_streams_word_deltas_then_a_generation_with_tool_calls():
    backend = ScriptedBackend([CALL_REPLY])
    assert isinstance(backend, PolicyBackend)
    deltas, final = await _collect(backend.stream(USER, TOOLS, SamplingParams()))
    assert len(deltas) > 3 and "".join(deltas) == CALL_REPLY
    assert final.content == "Checking."
    assert [(c.name, c.arguments) for c in final.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert final.finish_reason == "tool_calls"
    assert final.token_ids == list(CALL_REPLY.encode())
    assert final.logprobs == [SCRIPTED_LOGPROB] * len(final.token_ids)
    assert bytes(final.prompt_token_ids).decode().endswith("<|im_start|>assistant\n")


@pytest.mark.anyio
async def test_scripted_backend_records_calls_and_stamps_the_adapter():
    backend = ScriptedBackend(lambda messages, tools: f"you said {messages[-1]['content']}")
    await backend.load_adapter("v1", "/nowhere")
    messages = [{"role": "user", "content": "hi"}]
    generation = await backend.generate(messages, [], SamplingParams(seed=3), adapter="v1")
    messages.append({"role": "assistant", "content": "mutated later"})
    assert generation.text == generation.content == "you said hi"
    assert generation.adapter == "v1" and generation.finish_reason == "stop"
    assert backend.calls[0].messages == [{"role": "user", "content": "hi"}]
    assert backend.calls[0].adapter == "v1" and backend.calls[0].params.seed == 3
    await backend.unload_adapter("v1")
    assert backend.adapters() == []
    with pytest.raises(ValueError, match="adapter 'v1' is not loaded"):
        await backend.generate(messages, [], SamplingParams(), adapter="v1")


@pytest.mark.anyio
async def test_scripted_backend_says_when_it_runs_out_of_replies():
    backend = ScriptedBackend(["one"])
    assert (await backend.generate(USER, [], SamplingParams())).text == "one"
    with pytest.raises(RuntimeError, match="ran out of replies: call 2 but only 1 scripted"):
        await backend.generate(USER, [], SamplingParams())


# -- transformers on the tiny model --------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from whet.learner.tiny import ensure_tiny_model

    root = tmp_path_factory.mktemp("data")
    assert ensure_tiny_model(root / "models" / "tiny") == root / "models" / "tiny"
    return root


@pytest.fixture(scope="module")
def model_dir(data_dir) -> Path:
    return data_dir / "models" / "tiny"


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter on the tiny model whose B weights are perturbed, so it changes the outputs."""
    return perturbed_adapter(model_dir, tmp_path_factory.mktemp("adapter"), seed=1)


@pytest.fixture(scope="module")
def backend(data_dir):
    from whet.config.settings import ModelConfig

    engine = create_backend(ModelConfig(id="tiny", device="cpu", workers=2), data_dir)
    yield engine
    asyncio.run(engine.aclose())


def _raw_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + token_ids])  # [1, P+T]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]  # [P+T, V]
    start = len(prompt_ids) - 1
    return [float(logprobs[start + i, t]) for i, t in enumerate(token_ids)]


def test_create_backend_serves_the_tiny_model_built_once_into_the_data_dir(backend, data_dir):
    assert [p.name for p in (data_dir / "models").iterdir()] == ["tiny"]  # no staging folder left behind
    assert (data_dir / "models" / "tiny" / "model.safetensors").is_file()
    assert isinstance(backend, PolicyBackend) and backend.model_name == "tiny"
    assert backend.context_tokens == 4096
    assert backend.device.type == "cpu"


@pytest.mark.anyio
async def test_prompt_ids_are_the_tokenizers_encoding_of_the_chat_template(backend, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generation = await backend.generate(USER, TOOLS, SamplingParams(max_new_tokens=4, seed=0))
    text = tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert generation.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") and "<tools>" in text and '"get_weather"' in text  # Qwen2.5's


@pytest.mark.anyio
async def test_logprobs_are_the_raw_model_distribution_of_each_sampled_token(backend):
    params = SamplingParams(max_new_tokens=24, temperature=1.7, top_p=0.8, seed=5)
    generation = await backend.generate(USER, [], params)
    assert 0 < len(generation.token_ids) == len(generation.logprobs)
    expected = _raw_logprobs(backend.model, generation.prompt_token_ids, generation.token_ids)
    assert generation.logprobs == pytest.approx(expected, abs=1e-4)
    assert generation.usage["completion_tokens"] == len(generation.token_ids)


@pytest.mark.anyio
async def test_an_agents_next_step_reuses_the_cache_of_its_first_and_samples_the_same_tokens(backend):
    from whet.runtime.prefix import PrefixCache

    params = SamplingParams(max_new_tokens=16, temperature=1.3, seed=3)
    system = {"role": "system", "content": "You are a careful assistant. " * 12}  # past the cache's minimum length
    first = await backend.generate([system, *USER], [], params)
    step = [system, *USER, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    hits, reused = backend.prefixes.hits, backend.prefixes.reused_tokens
    cached = await backend.generate(step, [], params)
    assert backend.prefixes.hits == hits + 1
    assert backend.prefixes.reused_tokens - reused >= len(first.prompt_token_ids)  # the first step is not prefilled again
    backend.prefixes, saved = PrefixCache(entries=0), backend.prefixes
    try:
        fresh = await backend.generate(step, [], params)
    finally:
        backend.prefixes = saved
    assert cached.token_ids == fresh.token_ids
    assert cached.logprobs == pytest.approx(fresh.logprobs, abs=1e-4)


def test_special_tokens_a_model_writes_never_reach_the_reply_text(backend):
    """A sampled <|im_start|> or <|endoftext|> mid-answer is a token id the learner keeps, not text a user reads."""
    tokenizer = backend.tokenizer
    specials = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>", "<|im_end|>")]
    assert len(set(specials)) == 3  # each its own token in the vocabulary
    words = tokenizer.encode("Hello there", add_special_tokens=False)
    text, cut = backend._decode([*words[:1], *specials, *words[1:], specials[-1]], ())
    assert text == "Hello there" and not cut


@pytest.mark.anyio
async def test_stream_deltas_concatenate_to_the_final_text_and_match_generate(backend):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=11)
    deltas, final = await _collect(backend.stream(USER, [], params))
    assert len(deltas) > 1
    assert "".join(deltas) == final.text
    same = await backend.generate(USER, [], params)
    assert same.token_ids == final.token_ids and same.text == final.text


@pytest.mark.anyio
async def test_stop_strings_cut_the_text_and_the_stream(backend):
    free = await backend.generate(USER, [], SamplingParams(max_new_tokens=40, temperature=1.0, seed=11))
    assert len(free.text) > 10, "the seeded sample should be long enough to cut"
    stop = free.text[len(free.text) // 2 :][:3]
    deltas, cut = await _collect(backend.stream(USER, [], SamplingParams(max_new_tokens=40, temperature=1.0, seed=11, stop=(stop,))))
    assert cut.text == free.text[: free.text.find(stop)]
    assert "".join(deltas) == cut.text
    assert cut.finish_reason == "stop"


@pytest.mark.anyio
async def test_a_second_request_completes_while_the_first_is_still_generating(backend, monkeypatch):
    release = threading.Event()
    real_loop = backend._sample_loop

    def held_loop(prompt, params, budget, emit, cancel):
        if params.seed == 1:  # the first request waits until the second one has finished
            assert release.wait(timeout=20)
        return real_loop(prompt, params, budget, emit, cancel)

    monkeypatch.setattr(backend, "_sample_loop", held_loop)
    first = asyncio.create_task(backend.generate(USER, [], SamplingParams(max_new_tokens=8, seed=1)))
    second = await asyncio.wait_for(backend.generate(USER, [], SamplingParams(max_new_tokens=8, seed=2)), 20)
    assert not first.done()
    release.set()
    done = await asyncio.wait_for(first, 20)
    assert len(done.token_ids) > 0 and len(second.token_ids) > 0


@pytest.mark.anyio
async def test_a_prompt_longer_than_the_context_is_refused_with_both_sizes(model_dir):
    from whet.runtime.hf import TransformersBackend

    small = TransformersBackend(str(model_dir), device="cpu", workers=1, max_context_tokens=16)
    try:
        with pytest.raises(ValueError, match=r"prompt is \d+ tokens; the model's context is 16"):
            await small.generate(USER, [], SamplingParams())
    finally:
        await small.aclose()


def test_a_model_folder_without_config_is_named_in_the_error(tmp_path):
    from whet.runtime.hf import TransformersBackend

    with pytest.raises(BackendError, match=f"model folder {tmp_path} has no config.json"):
        TransformersBackend(str(tmp_path), device="cpu")


@pytest.mark.anyio
async def test_an_adapter_request_uses_the_adapter_while_a_concurrent_base_request_stays_on_base(
    backend, model_dir, adapter_dir
):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    base_alone = await backend.generate(USER, [], params)
    await backend.load_adapter("v1", str(adapter_dir))
    assert backend.adapters() == ["v1"]

    # the two requests are decoded in one batch: every forward pass mixes the adapter and the base
    mixed = backend._engine.mixed_steps
    tuned, base = await decoded_together(
        backend, [backend.generate(USER, [], params, adapter="v1"), backend.generate(USER, [], params)]
    )
    assert backend._engine.mixed_steps > mixed

    assert base.adapter is None and tuned.adapter == "v1"
    assert base.token_ids == base_alone.token_ids
    assert base.logprobs == pytest.approx(base_alone.logprobs, abs=1e-5)
    on_base, on_adapter = _reference_logprobs(model_dir, adapter_dir, tuned)
    assert tuned.logprobs == pytest.approx(on_adapter, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(tuned.logprobs, on_base, strict=True)) > 1e-2

    await backend.unload_adapter("v1")
    assert backend.adapters() == []
    with pytest.raises(ValueError, match="adapter 'v1' is not loaded"):
        await backend.generate(USER, [], params, adapter="v1")
    after = await backend.generate(USER, [], params)
    assert after.token_ids == base_alone.token_ids


def _reference_logprobs(model_dir, adapter_dir, generation) -> tuple[list[float], list[float]]:
    """The generation's tokens scored by a fresh base model and by a fresh base + adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    on_base = _raw_logprobs(plain, generation.prompt_token_ids, generation.token_ids)
    tuned = PeftModel.from_pretrained(plain, adapter_dir)
    return on_base, _raw_logprobs(tuned, generation.prompt_token_ids, generation.token_ids)


@pytest.mark.anyio
async def test_unloading_waits_for_requests_still_generating_with_the_adapter(
    backend, model_dir, adapter_dir, monkeypatch
):
    await backend.load_adapter("v2", str(adapter_dir))
    started, release = threading.Event(), threading.Event()
    real_loop = backend._sample_loop

    def held_loop(*args):
        started.set()
        assert release.wait(timeout=20)
        return real_loop(*args)

    monkeypatch.setattr(backend, "_sample_loop", held_loop)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    in_flight = asyncio.create_task(backend.generate(USER, [], params, adapter="v2"))
    assert await asyncio.to_thread(started.wait, 20)
    unloading = asyncio.create_task(backend.unload_adapter("v2"))
    deadline = asyncio.get_running_loop().time() + 20
    while backend.adapters() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)  # until the unload has begun: it refuses new requests first
    assert backend.adapters() == []
    with pytest.raises(ValueError, match="adapter 'v2' is not loaded"):
        await backend.generate(USER, [], params, adapter="v2")
    assert not unloading.done()

    release.set()
    finished = await asyncio.wait_for(in_flight, 20)
    await asyncio.wait_for(unloading, 20)
    on_base, on_adapter = _reference_logprobs(model_dir, adapter_dir, finished)
    assert finished.adapter == "v2"
    assert finished.logprobs == pytest.approx(on_adapter, abs=1e-4)


# -- remote engines over httpx.MockTransport -------------------------------------


def _sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.anyio
async def test_openai_backend_parses_native_tool_calls_logprobs_and_token_ids():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization"), json.loads(request.content)))
        return httpx.Response(
            200,
            json={
                "prompt_token_ids": [1, 2, 3],
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {"id": "call_x", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
                            ],
                        },
                        "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}]},
                        "token_ids": [10, 11],
                        "finish_reason": "tool_calls",
                    }
                ],
            },
        )

    from whet.runtime.remote import OpenAIBackend

    backend = OpenAIBackend("http://engine/v1", "sk-test", "qwen", transport=httpx.MockTransport(handler))
    generation = await backend.generate(USER, TOOLS, SamplingParams(max_new_tokens=9, seed=4))
    await backend.aclose()
    path, auth, body = seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body["model"] == "qwen" and body["tools"] == TOOLS and body["logprobs"] is True
    assert body["max_tokens"] == 9 and body["seed"] == 4 and body["stream"] is False
    assert [(c.id, c.name, c.arguments) for c in generation.tool_calls] == [("call_x", "get_weather", {"city": "Paris"})]
    assert generation.content == "" and "<tool_call>" in generation.text
    assert (generation.prompt_token_ids, generation.token_ids, generation.logprobs) == ([1, 2, 3], [10, 11], [-0.5, -1.5])
    assert generation.finish_reason == "tool_calls"


@pytest.mark.anyio
async def test_openai_backend_parses_markup_when_the_server_has_no_tool_parser():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"message": {"content": CALL_REPLY}, "finish_reason": "stop"}]})

    from whet.runtime.remote import OpenAIBackend

    backend = OpenAIBackend("http://engine/v1", None, "m", transport=httpx.MockTransport(handler))
    generation = await backend.generate(USER, TOOLS, SamplingParams())
    assert generation.content == "Checking." and generation.tool_calls[0].arguments == {"city": "Paris"}
    assert generation.token_ids == [] and generation.finish_reason == "tool_calls"


@pytest.mark.anyio
async def test_vllm_stream_assembles_tool_call_deltas_and_token_ids():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        stream = _sse(
            {"prompt_token_ids": [5, 6], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "Let"}, "token_ids": [1],
                          "logprobs": {"content": [{"token": "token_id:1", "logprob": -0.1}]}}]},
            {"choices": [{"index": 0, "delta": {"content": " me"}, "token_ids": [2],
                          "logprobs": {"content": [{"token": "token_id:2", "logprob": -0.2}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
                "token_ids": [3], "logprobs": {"content": [{"token": "token_id:3", "logprob": -0.3}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                          "token_ids": [4], "logprobs": {"content": [{"token": "token_id:4", "logprob": -0.4}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
                          "token_ids": [7], "logprobs": {"content": [{"token": "token_id:7", "logprob": -0.7}]},
                          "finish_reason": "tool_calls"}]},
        )
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    from whet.runtime.remote import VllmBackend

    backend = VllmBackend("http://vllm/v1", None, "base", transport=httpx.MockTransport(handler))
    deltas, final = await _collect(backend.stream(USER, TOOLS, SamplingParams()))
    assert deltas == ["Let", " me"]
    assert final.content == "Let me"
    assert [(c.id, c.name, c.arguments) for c in final.tool_calls] == [("call_1", "get_weather", {"city": "Oslo"})]
    assert final.prompt_token_ids == [5, 6] and final.token_ids == [1, 2, 3, 4, 7]
    assert final.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.7]
    assert bodies[0]["stream"] is True and bodies[0]["return_token_ids"] is True
    assert bodies[0]["max_completion_tokens"] == SamplingParams().max_new_tokens


@pytest.mark.anyio
async def test_vllm_loads_and_unloads_adapters_and_addresses_them_as_the_model():
    requests = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append((request.url.path, body))
        if request.url.path.endswith("load_lora_adapter"):
            return httpx.Response(200, text="Success")
        return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]})

    from whet.runtime.remote import VllmBackend

    backend = VllmBackend("http://vllm/v1", None, "base", transport=httpx.MockTransport(handler))
    await backend.load_adapter("user-7-v3", "/adapters/user-7/v3")
    generation = await backend.generate(USER, [], SamplingParams(), adapter="user-7-v3")
    await backend.unload_adapter("user-7-v3")
    assert requests[0] == ("/v1/load_lora_adapter", {"lora_name": "user-7-v3", "lora_path": "/adapters/user-7/v3"})
    assert requests[1][0] == "/v1/chat/completions" and requests[1][1]["model"] == "user-7-v3"
    assert requests[2] == ("/v1/unload_lora_adapter", {"lora_name": "user-7-v3"})
    assert generation.adapter == "user-7-v3" and backend.adapters() == []


@pytest.mark.anyio
async def test_remote_http_errors_become_backend_errors_with_status_and_message():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "The model `nope` does not exist."}})

    from whet.runtime.remote import VllmBackend

    backend = VllmBackend("http://vllm/v1", None, "nope", transport=httpx.MockTransport(handler))
    with pytest.raises(BackendError, match="does not exist") as caught:
        await backend.generate(USER, [], SamplingParams())
    assert caught.value.status == 404
    with pytest.raises(BackendError) as streamed:
        await _collect(backend.stream(USER, [], SamplingParams()))
    assert streamed.value.status == 404


def test_remote_backends_need_a_base_url(tmp_path):
    from whet.config.settings import ModelConfig
    from whet.runtime.remote import VllmBackend

    with pytest.raises(BackendError, match="model.base_url is required for the openai backend"):
        create_backend(ModelConfig(backend="openai", id="gpt-4o-mini"), tmp_path)
    engine = create_backend(ModelConfig(backend="vllm", id="Qwen/Qwen2.5-7B-Instruct", base_url="http://h:8001/v1"), tmp_path)
    assert isinstance(engine, VllmBackend) and isinstance(engine, PolicyBackend)
    assert engine.model_name == "Qwen/Qwen2.5-7B-Instruct"
    asyncio.run(engine.aclose())


def test_the_policy_protocol_module_imports_none_of_its_implementations():
    """No import circle: policy.py defines the seam; backends.py, where config is read, builds engines."""
    import ast

    import whet.runtime.policy as policy

    tree = ast.parse(Path(policy.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not [name for name in imported if name and name.startswith("whet.")]
    assert not hasattr(policy, "create_backend")
