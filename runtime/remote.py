"""Remote engines over HTTP: any OpenAI-compatible endpoint, and vLLM with runtime LoRA.

``OpenAIBackend`` speaks ``POST {base_url}/chat/completions`` (``base_url`` as for
the OpenAI SDK, e.g. ``http://127.0.0.1:8001/v1``) with tools passed natively
and ``logprobs: true``. Tool calls come back natively (``message.tool_calls``)
or, from a server without a tool parser, as Hermes markup in the text; both
end up as :class:`ToolCall`. Token ids are recorded when the server returns
them (vLLM does), else left empty: memory still learns, weights cannot.

``VllmBackend`` adds vLLM's runtime adapter endpoints (server started with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): an adapter is
addressed by using its name as the ``model``. Adapter paths are read by the
vLLM server, so they must be on a disk it sees.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from whet.runtime.chat_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, new_call_id, parse_tool_calls
from whet.runtime.policy import BackendError, Generation, SamplingParams, ToolCall


class OpenAIBackend:
    """An OpenAI-compatible chat endpoint. ``transport`` is for tests (``httpx.MockTransport``)."""

    max_tokens_field = "max_tokens"  # the field every compatible server knows

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        model: str,
        *,
        timeout: float = 120.0,
        model_name: str | None = None,
        logprobs: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.model_name = model_name or model
        self.logprobs = logprobs
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )

    # -- requests -------------------------------------------------------------

    def _body(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None,
        stream: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._model_for(adapter),
            "messages": messages,
            "temperature": params.temperature,
            "top_p": params.top_p,
            self.max_tokens_field: params.max_new_tokens,
            "stream": stream,
        }
        if tools:
            body["tools"] = tools
        if self.logprobs:
            body["logprobs"] = True
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        return body

    def _model_for(self, adapter: str | None) -> str:
        if adapter is not None:
            raise ValueError(f"the openai backend serves no adapters (asked for {adapter!r})")
        return self.model

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            response = await self._client.post(path, json=body)
        except httpx.TimeoutException as exc:
            raise BackendError(f"{self.base_url}/{path} timed out after {self.timeout}s") from exc
        except httpx.TransportError as exc:
            raise BackendError(f"cannot reach {self.base_url}/{path}: {exc}") from exc
        if response.is_error:
            raise _http_error(response, path)
        return response

    # -- generation -----------------------------------------------------------

    async def generate(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> Generation:
        body = self._body(messages, tools, params, adapter, stream=False)
        response = await self._post("chat/completions", body)
        data = _json(response, "chat/completions")
        try:
            choice = data["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError) as exc:
            problem = f"chat/completions answered without choices[0].message: {data!s:.200}"
            raise BackendError(problem) from exc
        entries = (choice.get("logprobs") or {}).get("content") or []
        return _generation(
            content=message.get("content") or "",
            native_calls=message.get("tool_calls") or [],
            prompt_token_ids=data.get("prompt_token_ids") or [],
            token_ids=choice.get("token_ids") or _ids_from_tokens(entries),
            logprobs=[float(e["logprob"]) for e in entries],
            finish_reason=choice.get("finish_reason") or "stop",
            adapter=adapter,
        )

    async def stream(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> AsyncIterator[str | Generation]:
        """Yields content deltas from the server's SSE stream, then the Generation (tool calls assembled)."""
        body = self._body(messages, tools, params, adapter, stream=True)
        acc = _StreamAccumulator()
        try:
            async with self._client.stream("POST", "chat/completions", json=body) as response:
                if response.is_error:
                    await response.aread()
                    raise _http_error(response, "chat/completions")
                async for line in response.aiter_lines():
                    delta = acc.feed_line(line)
                    if delta:
                        yield delta
        except httpx.TimeoutException as exc:
            raise BackendError(f"{self.base_url}/chat/completions timed out after {self.timeout}s") from exc
        except httpx.TransportError as exc:
            raise BackendError(f"cannot reach {self.base_url}/chat/completions: {exc}") from exc
        yield acc.generation(adapter)

    # -- adapters -------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        raise BackendError("the openai backend cannot load adapters: its weights live with the provider")

    async def unload_adapter(self, name: str) -> None:
        raise BackendError("the openai backend cannot unload adapters: its weights live with the provider")

    def adapters(self) -> list[str]:
        return []

    async def aclose(self) -> None:
        await self._client.aclose()


class VllmBackend(OpenAIBackend):
    """A vLLM OpenAI server with LoRA enabled and runtime adapter loading.

    Asks for ``return_token_ids`` (prompt and completion ids, vLLM >= 0.10.2) and
    ``return_tokens_as_token_ids`` (ids in the log-prob entries, older vLLM too).
    """

    max_tokens_field = "max_completion_tokens"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaded: set[str] = set()

    def _body(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        body = super()._body(*args, **kwargs)
        body["return_token_ids"] = True
        body["return_tokens_as_token_ids"] = True
        body["skip_special_tokens"] = False  # keep tool-call markup that a tokenizer marks special
        return body

    def _model_for(self, adapter: str | None) -> str:
        if adapter is not None and adapter not in self._loaded:
            raise ValueError(f"adapter {adapter!r} is not loaded (loaded: {sorted(self._loaded)})")
        return adapter or self.model

    async def load_adapter(self, name: str, path: str) -> None:
        """``POST /v1/load_lora_adapter``; ``path`` must be readable by the vLLM server."""
        await self._post("load_lora_adapter", {"lora_name": name, "lora_path": path})
        self._loaded.add(name)

    async def unload_adapter(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``. Requests vLLM already accepted finish on the adapter."""
        try:
            await self._post("unload_lora_adapter", {"lora_name": name})
        finally:
            self._loaded.discard(name)  # gone either way: a 404 means the server no longer has it

    def adapters(self) -> list[str]:
        return sorted(self._loaded)


class _StreamAccumulator:
    """Folds ``chat.completion.chunk`` SSE lines into deltas and one final Generation."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.prompt_token_ids: list[int] = []
        self.token_ids: list[int] = []
        self.entries: list[dict[str, Any]] = []
        self.finish_reason = "stop"

    def feed_line(self, line: str) -> str:
        """One SSE line; returns the content delta it carried ("" for none)."""
        if not line.startswith("data:"):
            return ""  # blank separators, comments, event names
        payload = line[len("data:"):].strip()
        if not payload or payload == "[DONE]":
            return ""
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise BackendError(f"the stream sent a chunk that is not JSON: {payload[:200]}") from exc
        if "error" in chunk:
            raise BackendError(f"the stream failed: {_error_message(chunk)}")
        self.prompt_token_ids = chunk.get("prompt_token_ids") or self.prompt_token_ids
        delta_text = ""
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            delta_text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                self._feed_call(call)
            self.entries.extend((choice.get("logprobs") or {}).get("content") or [])
            self.token_ids.extend(choice.get("token_ids") or [])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.content.append(delta_text)
        return delta_text

    def _feed_call(self, call: dict[str, Any]) -> None:
        index = call.get("index", len(self.calls))
        slot = self.calls.setdefault(index, {"id": None, "name": "", "arguments": ""})
        slot["id"] = call.get("id") or slot["id"]
        function = call.get("function") or {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""

    def generation(self, adapter: str | None) -> Generation:
        native = [
            {"id": slot["id"], "function": {"name": slot["name"], "arguments": slot["arguments"]}}
            for _, slot in sorted(self.calls.items())
        ]
        return _generation(
            content="".join(self.content),
            native_calls=native,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids or _ids_from_tokens(self.entries),
            logprobs=[float(e["logprob"]) for e in self.entries],
            finish_reason=self.finish_reason,
            adapter=adapter,
        )


def _generation(
    *,
    content: str,
    native_calls: list[dict[str, Any]],
    prompt_token_ids: list[int],
    token_ids: list[int],
    logprobs: list[float],
    finish_reason: str,
    adapter: str | None,
) -> Generation:
    """Native tool calls become ToolCalls and are written back into ``text`` as Hermes markup;
    without native calls, markup in the content is parsed as the in-process engines do."""
    calls, errors = [], []
    for number, call in enumerate(native_calls, 1):
        parsed, error = _native_call(call)
        if parsed is not None:
            calls.append(parsed)
        else:
            errors.append(f"tool call {number}: {error}")
    if native_calls:
        blocks = [
            f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, '
            f'"arguments": {c["function"]["arguments"] or "{}"}}}\n{TOOL_CALL_CLOSE}'
            for c in native_calls
        ]
        text = "\n".join([content, *blocks]) if content else "\n".join(blocks)
        stripped = content.strip()
    else:
        text = content
        stripped, calls, errors = parse_tool_calls(content)
    return Generation(
        text=text,
        content=stripped,
        tool_calls=calls,
        tool_call_errors=errors,
        prompt_token_ids=list(prompt_token_ids),
        token_ids=list(token_ids),
        logprobs=logprobs,
        finish_reason="tool_calls" if calls else finish_reason,
        adapter=adapter,
    )


def _native_call(call: dict[str, Any]) -> tuple[ToolCall | None, str]:
    function = call.get("function") or {}
    name = function.get("name")
    if not name:
        return None, "the server sent a tool call without a function name"
    raw = function.get("arguments") or "{}"
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        return None, f"arguments of {name!r} are not valid JSON ({exc.msg}); send a JSON object"
    if not isinstance(arguments, dict):
        return None, f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(id=call.get("id") or new_call_id(), name=name, arguments=arguments), ""


def _ids_from_tokens(entries: list[dict[str, Any]]) -> list[int]:
    """Ids from vLLM's ``token_id:N`` log-prob tokens; [] when the server names tokens by text."""
    ids = []
    for entry in entries:
        token = str(entry.get("token", ""))
        if not token.startswith("token_id:"):
            return []
        ids.append(int(token[len("token_id:"):]))
    return ids


def _json(response: httpx.Response, path: str) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError as exc:
        raise BackendError(f"{path} answered with something that is not JSON: {response.text[:200]}") from exc
    if not isinstance(data, dict):
        raise BackendError(f"{path} answered with JSON that is not an object: {response.text[:200]}")
    return data


def _error_message(data: Any) -> str:
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)
        return str(data.get("message") or data.get("detail") or error)
    return str(data)


def _http_error(response: httpx.Response, path: str) -> BackendError:
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text[:500] or response.reason_phrase
    return BackendError(f"{path} failed: {message}", status=response.status_code)
