"""TransformersBackend: an in-process engine on transformers + peft, CPU or CUDA.

Generation runs in one batching engine (:mod:`whet.runtime.engine`): concurrent
requests are decoded together, one forward pass advancing every active sequence by
one token, and each sampled token is streamed at once and reported with its
log-prob. A request waits in a worker thread (never on the event loop) while the
engine works on it; ``workers`` bounds how many are decoded at once.

Log-probs are those of the RAW model distribution: ``log_softmax(logits)`` at
temperature 1, before temperature and top-p reshape it for sampling. That is
what the learner recomputes from the stored token ids, so the importance ratio
is exactly 1 for an unchanged policy whatever the sampling settings were.
``token_ids`` include the end-of-turn token when generation stopped on it (the
policy has to learn to stop); ``text`` does not.

Adapters: several peft LoRA adapters live in one model. Each batch row picks its
adapter through peft's mixed-batch ``adapter_names`` argument (``"__base__"`` = no
adapter), so requests on different adapter versions share a forward pass; a forward
pre-hook on the LoRA layers injects the engine's per-row list (the model is called
directly, not through the PeftModel wrapper, whose ``adapter_names`` hooks are
registered per call; ``set_adapter`` is global state and unused). Loading and unloading take
a write lock that waits for the forward pass in progress; unloading also waits
for the requests still generating with that adapter (they finish on it).
DoRA adapters are refused (peft cannot mix them per request).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from whet.learner.model import (
    ModelLoadError,
    cache_of,
    load_causal_lm,
    pick_device,
    quiet_peft,
    stop_token_ids,
    with_cache,
)
from whet.learner.prompt import prompt_text
from whet.runtime.chat_format import parse_tool_calls
from whet.runtime.engine import BatchEngine
from whet.runtime.engine import Sequence as Row
from whet.runtime.policy import BackendError, Generation, PromptTooLong, SamplingParams, last_generation
from whet.runtime.prefix import PrefixCache

# below this temperature sampling is greedy: the next-best token's odds are exp(-gap / T), nil
# for any gap a float32 logit can show, and dividing by a tinier one overflows float32
GREEDY_BELOW = 1e-6
# Prompts prefilled in one padded pass, at most this many tokens in all. On one CPU core with SmolLM2,
# 8 prompts of ~32 tokens took 0.8 s together against 1.3 s one by one, while 8 of ~800 tokens took
# 26 s against 23 s: a pass is already compute-bound at a few hundred tokens there. A GPU is not.
TOGETHER_TOKENS_CPU = 256
TOGETHER_TOKENS_CUDA = 16384
KEEP_FREE = 2  # retired adapters' modules kept for reuse (see TransformersBackend._load_into_free)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE = "__base__"  # peft's name for "no adapter" in adapter_names
_DONE = object()


class _ReadWriteLock:
    """Many readers (forward passes) or one writer (adapter load/unload); writers go first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writers_waiting = 0
        self._writing = False

    @contextmanager
    def read(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def write(self):
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def sample_tokens(
    logits: torch.Tensor, settings: Sequence[tuple[float, float]], generators: Sequence[torch.Generator]
) -> list[tuple[int, float]]:
    """Pick each row's next token from ``logits`` [B, V]: row ``b`` with ``settings[b]`` = (temperature,
    top_p) and ``generators[b]``; return each (token, RAW log-prob: temperature 1, no top-p).

    The rows' picks stay on the device until one transfer at the end: on CUDA each host read waits for
    the GPU, and reading a token, then its log-prob, row by row made two such waits per row a step
    (the saving is expected, not yet measured on a GPU). Each row draws from its own generator exactly
    as it would alone, so batching never changes a seeded request's tokens.
    """
    logits = logits.float()  # log-probs in float32 whatever the model's dtype
    raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    tokens = torch.argmax(logits, dim=-1)  # [B]: the greedy rows' picks
    drawn = [b for b, (temperature, _) in enumerate(settings) if temperature >= GREEDY_BELOW]
    if drawn:
        rows = logits[drawn]  # [S, V]
        temperatures = rows.new_tensor([settings[b][0] for b in drawn])[:, None]  # [S, 1]
        # shifted so the largest is 0: a tiny temperature sends the others to -inf, never to nan
        probs = torch.softmax((rows - rows.amax(dim=-1, keepdim=True)) / temperatures, dim=-1)  # [S, V]
        for k, b in enumerate(drawn):
            if settings[b][1] < 1.0:
                probs[k] = _nucleus(probs[k], settings[b][1])
        # inverse-CDF draws, one uniform from each row's own generator: a seeded row draws the same
        # token in any batch (torch.multinomial, one row at a time, cost 1 ms a row at 49k tokens)
        cdf = torch.cumsum(probs.double(), dim=-1)  # [S, V]
        uniform = torch.cat([torch.rand(1, generator=generators[b], dtype=torch.float64, device=logits.device)
                             for b in drawn])  # [S]  # fmt: skip
        picks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]  # [S]: first cdf > u
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(dim=-1)  # [S]: last drawable
        tokens[drawn] = torch.minimum(picks, last)  # u * total rounded up to the total: the last drawable token
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]  # [B]
    return list(zip(tokens.tolist(), chosen.tolist(), strict=True))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` [V] with the tokens outside the smallest set holding ``top_p`` of the mass set to 0."""
    sorted_probs, order = torch.sort(probs, descending=True)  # [V], [V]
    outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p  # mass before each >= p
    outside[0] = False  # the most likely token stays, however small top_p (even 0 in float32)
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[int, float]:
    """Pick the next token from ``logits`` [V]; return it and its RAW log-prob (temperature 1, no top-p)."""
    return sample_tokens(logits[None], [(temperature, top_p)], [generator])[0]


class TransformersBackend:
    """An HF model id or a local ``save_pretrained`` folder, served in-process.

    ``device``: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:1"...
    ``dtype``: "auto" (:func:`serving_dtype`), "float32" or "bfloat16"; log-probs are float32 either way.
    ``workers``: how many requests are decoded together; requests beyond that many wait.
    """

    def __init__(
        self,
        model_id_or_path: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        workers: int = 2,
        model_name: str | None = None,
        max_context_tokens: int = 4096,
    ) -> None:
        self.model_name = model_name or model_id_or_path
        self.device = pick_device(device)
        try:
            self.tokenizer, self.model = load_causal_lm(model_id_or_path, self.device, dtype)
        except ModelLoadError as exc:
            raise BackendError(str(exc)) from exc
        positions = getattr(self.model.config, "max_position_embeddings", None) or max_context_tokens
        self.context_tokens = min(max_context_tokens, positions)
        # what a too-long prompt can do about it: the setting, or nothing when the model's own positions bound it
        self._context_fix = ("shorten the conversation or raise model.max_context_tokens" if max_context_tokens < positions
                             else f"shorten the conversation: {positions} positions is this model's own limit")  # fmt: skip
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.model)
        # only the last position's logits are needed; older model classes lack the argument
        keeps = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._last_only = {"logits_to_keep": 1} if keeps else {}
        # fast tokenizers raise "Already borrowed" when two threads touch one at once
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="whet-generate")
        self._lock = _ReadWriteLock()
        self._local = threading.local()  # .adapter: the adapter of the request this thread serves
        self._adapter_names: list[str] | None = None  # per batch row, for the forward pass running now
        # adapter version -> the peft adapter holding its weights: a version loads into the modules a
        # drained version left (its weights copied in) when their configs match, see _load_into_free
        self._slot_of: dict[str, str] = {}
        self._free: list[str] = []  # peft adapters no version uses, kept for the next versions
        self._peft: Any = None  # the PeftModel wrapper, once an adapter is loaded
        self._adapters: set[str] = set()
        self._in_use: Counter[str] = Counter()
        self._in_use_cond = threading.Condition()
        self.prefixes = PrefixCache()
        # prompts are prefilled together once one prompt's cache showed plain per-position keys and values
        self._plain_cache = False
        self._engine = BatchEngine(
            self._forward, self._prefill, self._sample, self._accept, self._release, self.device, max_batch=workers
        )

    # -- prompt ---------------------------------------------------------------

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The exact token ids the model sees for this request (chat template, generation prompt added)."""
        with self._tokenizer_lock:
            try:
                text = prompt_text(self.tokenizer, messages, tools)
            except ValueError as exc:
                raise ValueError(f"{self.model_name}: {exc}") from exc
            return self.tokenizer.encode(text, add_special_tokens=False)

    # -- generation -----------------------------------------------------------

    async def generate(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> Generation:
        return await last_generation(self.stream(messages, tools, params, adapter))

    async def stream(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None = None,
    ) -> AsyncIterator[str | Generation]:
        """Yields text deltas as tokens are sampled, then the Generation.

        Closing the iterator early (``contextlib.aclosing``) or cancelling the task
        stops the worker at its next token.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                cancel.set()

        def work() -> Generation:
            try:
                return self._generate_sync(messages, tools, params, adapter, emit, cancel)
            finally:
                emit(_DONE)

        future = loop.run_in_executor(self._pool, work)
        try:
            while (item := await queue.get()) is not _DONE:
                yield item
            yield await future
        finally:
            cancel.set()

    def _generate_sync(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        params: SamplingParams,
        adapter: str | None,
        emit: Callable[[str], None],
        cancel: threading.Event,
    ) -> Generation:
        prompt = self.prompt_ids(messages, tools)
        if len(prompt) >= self.context_tokens:
            raise PromptTooLong(
                f"prompt is {len(prompt)} tokens; the model's context is {self.context_tokens}: {self._context_fix}"
            )
        budget = min(params.max_new_tokens, self.context_tokens - len(prompt))
        with self._using(adapter):
            token_ids, logprobs, finish, sent = self._sample_loop(prompt, params, budget, emit, cancel)
        text, _ = self._decode(token_ids, params.stop)
        if text.startswith(sent) and len(text) > len(sent):
            emit(text[len(sent):])  # what was held back: a partial character or a possible stop string
        content, calls, errors = parse_tool_calls(text)
        return Generation(
            text=text,
            content=content,
            tool_calls=calls,
            tool_call_errors=errors,
            prompt_token_ids=prompt,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason="tool_calls" if calls else finish,
            adapter=adapter,
        )

    def _sample_loop(
        self,
        prompt: list[int],
        params: SamplingParams,
        budget: int,
        emit: Callable[[str], None],
        cancel: threading.Event,
    ) -> tuple[list[int], list[float], str, str]:
        """Sample up to ``budget`` tokens in the batching engine, emitting text as it becomes final;
        returns ids, log-probs, finish reason and the text emitted so far."""
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        adapter = getattr(self._local, "adapter", None) or BASE
        seq = Row(prompt, params, budget, adapter, emit, cancel, generator)
        self._engine.submit(seq)
        self._engine.wait(seq)
        return seq.token_ids, seq.logprobs, seq.finish, seq.sent

    # -- the engine's callbacks (engine thread) ---------------------------------

    def _forward(
        self,
        inputs: torch.Tensor,
        cache: Any,
        adapter_names: list[str],
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """One forward pass, row ``b`` on ``adapter_names[b]``; the last position's logits [B, V]."""
        extra = {} if attention_mask is None else {"attention_mask": attention_mask, "position_ids": position_ids}
        with self._lock.read():
            self._adapter_names = [self._slot_of.get(n, n) for n in adapter_names]  # versions -> peft names
            try:
                out = self.model(inputs, **with_cache(cache), use_cache=True, **extra, **self._last_only)
            finally:
                self._adapter_names = None
        return out.logits[:, -1], cache_of(out)  # [B, V]

    def _prefill(self, seqs: list[Row]) -> list[tuple[Any, torch.Tensor] | BaseException]:
        """Each prompt's cache and the logits of its first new token [V] (or what failed it): a prompt
        an earlier sequence began runs alone from that prefix cache, the others in one padded pass."""
        out: list[tuple[Any, torch.Tensor] | BaseException | None] = [None] * len(seqs)
        fresh = []
        for i, seq in enumerate(seqs):
            cache, reused = self.prefixes.take(seq.adapter, seq.prompt)
            if cache is None:
                fresh.append(i)
                continue
            try:
                inputs = torch.tensor([seq.prompt[reused:]], device=self.device)  # [1, P - reused]
                logits, cache = self._forward(inputs, cache, [seq.adapter])
                out[i] = (cache, logits[0])
            except Exception as exc:
                out[i] = exc
        if len(fresh) > 1 and self._plain_cache:
            budget = TOGETHER_TOKENS_CUDA if self.device.type == "cuda" else TOGETHER_TOKENS_CPU
            for group in _groups([(i, len(seqs[i].prompt)) for i in fresh], budget):
                for i, got in zip(group, self._prefill_together([seqs[i] for i in group]), strict=True):
                    out[i] = got
            fresh = [i for i in fresh if out[i] is None]
        for i in fresh:  # alone: one prompt, or a model whose cache is not plain keys and values per position
            seq = seqs[i]
            try:
                logits, cache = self._forward(torch.tensor([seq.prompt], device=self.device), None, [seq.adapter])
                self._plain_cache = all(type(layer) is DynamicLayer for layer in cache.layers)
                out[i] = (cache, logits[0])
            except Exception as exc:
                out[i] = exc
        return out  # type: ignore[return-value]

    def _prefill_together(self, seqs: list[Row]) -> list[tuple[Any, torch.Tensor]]:
        """One left-padded pass over several whole prompts, then a private cache per prompt with its
        real positions only (the engine pads the batch's rows itself when they join)."""
        width = max(len(seq.prompt) for seq in seqs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(seq.prompt)) + seq.prompt for seq in seqs], device=self.device)  # [n, W]
        mask = torch.tensor([[0] * (width - len(seq.prompt)) + [1] * len(seq.prompt) for seq in seqs],
                            device=self.device)  # [n, W]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [n, W]: each row counts from its first real token
        logits, cache = self._forward(ids, None, [seq.adapter for seq in seqs], mask, positions)  # [n, V]
        out = []
        for row, seq in enumerate(seqs):
            own = DynamicCache()
            start = width - len(seq.prompt)
            for index, layer in enumerate(cache.layers):
                own.update(layer.keys[row : row + 1, :, start:, :].clone(),
                           layer.values[row : row + 1, :, start:, :].clone(), index)  # fmt: skip
            out.append((own, logits[row]))
        return out

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> list[tuple[int, float]]:
        """Each row's next token and its raw log-prob, from ``logits`` [B, V]."""
        settings = [(seq.params.temperature, seq.params.top_p) for seq in rows]
        return sample_tokens(logits, settings, [seq.generator for seq in rows])

    def _accept(self, seq: Row, token: int, logprob: float) -> bool:
        """Add ``seq``'s sampled token, emit what text became final; True when done."""
        params = seq.params
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if token in self.stop_token_ids:
            seq.finish = "stop"
            return True
        text, stopped = self._decode(seq.token_ids, params.stop)
        if stopped:
            seq.finish = "stop"
            return True
        hold = max((len(s) for s in params.stop), default=1) - 1  # chars that may start a stop string
        visible = text[: len(text) - hold]
        if not visible.endswith("\ufffd") and visible.startswith(seq.sent) and len(visible) > len(seq.sent):
            seq.emit(visible[len(seq.sent):])
            seq.sent = visible
        return len(seq.token_ids) >= seq.budget

    def _release(self, seq: Row, cache: Any) -> None:
        """Keep a finished sequence's cache for prefix reuse: the last sampled token was never fed,
        so it holds the prompt and every token before it."""
        if seq.token_ids:
            self.prefixes.put(seq.adapter, [*seq.prompt, *seq.token_ids[:-1]], cache)

    def _decode(self, token_ids: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
        """The completion text (no special tokens, so no end-of-turn, cut before the first stop string);
        whether it was cut. ``token_ids`` keep them: the policy has to learn to stop.

        Decodes the whole completion each time: simple, and cheap next to a forward pass.
        """
        if token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        with self._tokenizer_lock:
            text = self.tokenizer.decode(
                token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        cut = _find_stop(text, stop)
        return (text, False) if cut is None else (text[:cut], True)

    # -- adapters -------------------------------------------------------------

    @contextmanager
    def _using(self, adapter: str | None):
        """Tag this thread's request with ``adapter`` and hold it loaded meanwhile."""
        with self._in_use_cond:
            if adapter is not None and adapter not in self._adapters:
                raise ValueError(f"adapter {adapter!r} is not loaded (loaded: {sorted(self._adapters)})")
            self._in_use[adapter or BASE] += 1
        self._local.adapter = adapter
        try:
            yield
        finally:
            self._local.adapter = None
            with self._in_use_cond:
                self._in_use[adapter or BASE] -= 1
                self._in_use_cond.notify_all()

    def _route_hook(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        names = self._adapter_names
        if names is not None:
            kwargs["adapter_names"] = names
        return args, kwargs

    def _hook_lora_layers(self) -> None:
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        for module in self.model.modules():
            routed = getattr(module, "_whet_routed", False)
            if isinstance(module, (LoraLayer, AuxiliaryTrainingWrapper)) and not routed:
                module.register_forward_pre_hook(self._route_hook, with_kwargs=True)
                module._whet_routed = True

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a peft LoRA adapter folder under ``name``; requests may use it as soon as this returns."""
        await asyncio.to_thread(self._load_adapter_sync, name, path)

    def _load_adapter_sync(self, name: str, path: str) -> None:
        from peft import PeftModel

        if name == BASE or name in self._adapters:
            raise ValueError(f"adapter name {name!r} is already in use; load each version under a new name")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"adapter folder {path} has no adapter_config.json; pass a folder saved by peft")
        if not self._load_into_free(name, path):
            with self._lock.write(), quiet_peft():
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
                else:
                    self._peft.load_adapter(path, adapter_name=name, is_trainable=False)
                if getattr(self._peft.peft_config[name], "use_dora", False):
                    self._peft.delete_adapter(name)
                    raise ValueError(f"adapter {name!r} uses DoRA, which peft cannot route per request; use LoRA")
                self._peft.eval()
                self._hook_lora_layers()
            self._slot_of[name] = name
        with self._in_use_cond:
            self._adapters.add(name)

    def _load_into_free(self, name: str, path: str) -> bool:
        """Load version ``name`` by copying its weights into a free peft adapter of the same config.

        peft's ``load_adapter`` builds new LoRA modules in every targeted layer: for SmolLM2 with all
        seven projections, 0.3-0.6 s of Python under the write lock, every request's decoding paused
        meanwhile, at every swap. A lineage's versions share their config, so the modules of the
        version a swap retired are reused: the file is read outside the lock and only the copy (a few
        ms) holds it. False (nothing changed) when no free adapter matches."""
        from peft import PeftConfig
        from safetensors.torch import load_file

        file = Path(path) / ADAPTER_WEIGHTS
        if self._peft is None or not self._free or not file.is_file():
            return False
        config = PeftConfig.from_pretrained(path).to_dict()
        with self._in_use_cond:  # claim it: no other load may take it meanwhile
            slot = next((s for s in self._free if _same_lora(self._peft.peft_config[s].to_dict(), config)), None)
            if slot is None:
                return False
            self._free.remove(slot)
        marker = f".{slot}."
        params = {n.replace(marker, "."): p for n, p in self._peft.named_parameters() if marker in n}
        weights = load_file(str(file), device=str(self.device))
        if weights.keys() != params.keys() or any(weights[k].shape != params[k].shape for k in weights):
            with self._in_use_cond:
                self._free.append(slot)
            return False
        with self._lock.write(), torch.no_grad():
            for key, tensor in weights.items():
                params[key].copy_(tensor)
        self._slot_of[name] = slot
        return True

    async def unload_adapter(self, name: str) -> None:
        """Refuse new requests for ``name``, wait for those using it, then free it. Unknown names: no-op."""
        await asyncio.to_thread(self._unload_adapter_sync, name)

    def _unload_adapter_sync(self, name: str) -> None:
        with self._in_use_cond:
            if name not in self._adapters:
                return
            self._adapters.discard(name)
            self._in_use_cond.wait_for(lambda: self._in_use[name] == 0)
        self.prefixes.drop(name)
        with self._in_use_cond:
            slot = self._slot_of.pop(name)
            kept = len(self._free) < KEEP_FREE
            if kept:  # no request uses it any more: a next version's weights go in
                self._free.append(slot)
        if kept:
            return
        with self._lock.write(), quiet_peft():
            self._peft.delete_adapter(slot)

    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._engine.close, 30.0)  # the loop ends between two steps
        self._pool.shutdown(wait=False, cancel_futures=True)


def _same_lora(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two peft configs build the same modules with the same scaling (paths and modes aside)."""
    ignored = {"base_model_name_or_path", "revision", "inference_mode", "peft_version", "auto_mapping"}
    return {k: v for k, v in a.items() if k not in ignored} == {k: v for k, v in b.items() if k not in ignored}


def _groups(prompts: list[tuple[int, int]], budget: int) -> list[list[int]]:
    """(index, length) of prompts -> groups of two or more, shortest first, each padded to its longest
    within ``budget`` tokens in all (the rest, longer, run alone)."""
    groups, group, width = [], [], 0
    for i, length in sorted(prompts, key=lambda p: p[1]):
        if group and max(width, length) * (len(group) + 1) > budget:
            groups.append(group)
            group, width = [], 0
        group.append(i)
        width = max(width, length)
    groups.append(group)
    return [g for g in groups if len(g) > 1]


def _find_stop(text: str, stop: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stop if s) if i != -1]
    return min(hits) if hits else None
