"""The requests whet's vLLM backend sends, checked against vLLM's documented HTTP API.

vLLM itself is not installed here (it needs a GPU build), so its request models are restated
below, field for field, from vLLM's OpenAI server (``vllm/entrypoints/openai/protocol.py`` and
the LoRA routes' ``LoadLoRAAdapterRequest`` / ``UnloadLoRAAdapterRequest``) and its docs
("Dynamically serving LoRA Adapters": ``POST /v1/load_lora_adapter`` with ``lora_name`` and
``lora_path``, ``POST /v1/unload_lora_adapter`` with ``lora_name``, the adapter then addressed as
the request's ``model``). vLLM's chat request accepts unknown fields with only a log warning, so
the restated model forbids them: a field whet sends that vLLM does not declare would be silently
ignored there, and fails here.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from whet.config.settings import LearnerConfig
from whet.memory.store import open_store
from whet.runtime.adapters import AdapterRouter
from whet.runtime.policy import BackendError, SamplingParams
from whet.runtime.remote import VllmBackend

pytestmark = pytest.mark.anyio


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_int_id: int | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolsParam(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_Strict):
    """The fields of vLLM's ChatCompletionRequest that whet may send (a subset; all optional but two)."""

    model: str | None = None  # vLLM: optional, the served model by default; an adapter's name picks it
    messages: list[dict[str, Any]]
    temperature: float | None = None
    top_p: float | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    stream: bool | None = False
    tools: list[ChatCompletionToolsParam] | None = None
    logprobs: bool | None = False
    seed: int | None = None
    stop: str | list[str] | None = None
    # vLLM extra parameters
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None


TOOLS = [{"type": "function", "function": {"name": "now", "description": "The time in a timezone",
                                           "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}}]  # fmt: skip
USER = [{"role": "user", "content": "What time is it in Lisbon?"}]


class FakeVllm:
    """Answers as ``vllm serve --enable-lora`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` does."""

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self.loaded: dict[str, str] = {}
        self.most_loaded = 0
        self.log: list[tuple[str, str]] = []  # (path, model or adapter name)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.method == "POST" and request.headers["content-type"] == "application/json"
        body = json.loads(request.content)
        path = request.url.path
        if path == "/v1/load_lora_adapter":
            load = LoadLoRAAdapterRequest.model_validate(body)
            if load.lora_name in self.loaded:  # vLLM: 400, "The lora adapter '...' has already been loaded."
                return _error(400, f"The lora adapter '{load.lora_name}' has already been loaded.")
            self.loaded[load.lora_name] = load.lora_path
            self.most_loaded = max(self.most_loaded, len(self.loaded))
            self.log.append((path, load.lora_name))
            return httpx.Response(200, text=f"Success: LoRA adapter '{load.lora_name}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            unload = UnloadLoRAAdapterRequest.model_validate(body)
            if self.loaded.pop(unload.lora_name, None) is None:
                return _error(404, f"The lora adapter '{unload.lora_name}' cannot be found.")
            self.log.append((path, unload.lora_name))
            return httpx.Response(
                200, text=f"Success: LoRA adapter '{unload.lora_name}' removed successfully."
            )
        assert path == "/v1/chat/completions", path
        chat = ChatCompletionRequest.model_validate(body)
        if chat.model not in (self.base_model, *self.loaded):
            return _error(404, f"The model `{chat.model}` does not exist.")
        self.log.append((path, chat.model))
        assert chat.logprobs and chat.return_token_ids and chat.return_tokens_as_token_ids
        message = {"role": "assistant", "content": "It is noon."}
        logprobs = {
            "content": [{"token": "token_id:11", "logprob": -0.5}, {"token": "token_id:2", "logprob": -0.1}]
        }
        return httpx.Response(200, json={
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": chat.model,
            "prompt_token_ids": [1, 5, 9],
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": "stop",
                         "token_ids": [11, 2]}],
        })  # fmt: skip


def _error(status: int, message: str) -> httpx.Response:
    kind = "BadRequestError" if status == 400 else "NotFoundError"
    return httpx.Response(
        status, json={"error": {"message": message, "type": kind, "param": None, "code": status}}
    )


async def test_whets_vllm_requests_match_vllms_documented_lora_and_chat_api(tmp_path):
    server = FakeVllm("Qwen/Qwen2.5-7B-Instruct")
    backend = VllmBackend(
        "http://vllm:8001/v1", None, server.base_model, transport=httpx.MockTransport(server)
    )
    store = open_store(f"sqlite:///{tmp_path / 'whet.db'}")
    router = AdapterRouter(backend, store, LearnerConfig())
    adapters = tmp_path / "adapters" / "global"
    try:
        params = SamplingParams(max_new_tokens=16, temperature=0.2, top_p=0.9, seed=3, stop=("</s>",))
        base = await backend.generate(USER, TOOLS, params)
        assert (
            base.token_ids == [11, 2] and base.logprobs == [-0.5, -0.1] and base.prompt_token_ids == [1, 5, 9]
        )

        # one adapter name per version; a request in flight keeps its version loaded through a swap
        assert await router.activate("global-0001", str(adapters / "global-0001"))
        with router.lease(None) as held:
            assert held == "global-0001"
            assert await router.activate("global-0002", str(adapters / "global-0002"))
            answer = await backend.generate(USER, TOOLS, params, adapter=held)  # finishes on its own version
            assert answer.adapter == "global-0001"
        await router.settle()
        await backend.generate(USER, [], SamplingParams(), adapter=router.current(None))
    finally:
        await router.aclose()
        await backend.aclose()
        await store.aclose()

    assert server.log == [
        ("/v1/chat/completions", server.base_model),
        ("/v1/load_lora_adapter", "global-0001"),
        ("/v1/load_lora_adapter", "global-0002"),
        ("/v1/chat/completions", "global-0001"),
        ("/v1/unload_lora_adapter", "global-0001"),
        ("/v1/chat/completions", "global-0002"),
    ]
    assert server.loaded == {"global-0002": str(adapters / "global-0002")}
    assert server.most_loaded == 2  # live + draining: --max-loras must be at least 2 per scope served


async def test_vllms_documented_lora_errors_reach_whet_as_backend_errors_with_their_message(tmp_path):
    server = FakeVllm("base")
    backend = VllmBackend("http://vllm:8001/v1", None, "base", transport=httpx.MockTransport(server))
    try:
        await backend.load_adapter("global-0001", "/shared/adapters/global/global-0001")
        server.loaded.pop("global-0001")  # the vLLM server restarted and lost it
        server.loaded["global-0002"] = "/elsewhere"
        with pytest.raises(BackendError, match="already been loaded"):
            await backend.load_adapter("global-0002", "/shared/adapters/global/global-0002")
        with pytest.raises(BackendError, match="cannot be found"):
            await backend.unload_adapter("global-0001")
        assert backend.adapters() == []  # an adapter vLLM no longer has is not addressed any more
    finally:
        await backend.aclose()
