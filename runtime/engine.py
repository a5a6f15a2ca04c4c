"""Continuous batching: one thread decodes every active sequence together.

Each step runs ONE forward pass that advances every active sequence by one token. A request
joins between steps, after its own prefill (its prompt run alone, from a reused prefix cache when
there is one), and leaves between steps when it stops; the others never wait for it to finish.

The batch keeps one key/value cache, left-padded: row ``b`` holds its ``lengths[b]`` real
positions at the right end, ``mask`` marks them, and each step passes explicit position ids, so
a row sees exactly what it would see alone (a batched greedy decode gives the single-sequence
tokens). Joining pads the shorter side on the left and concatenates on the batch dimension;
leaving selects the remaining rows (``DynamicCache.batch_select_indices``) and drops padding
columns no row needs any more.

transformers' own continuous batching (``generate_batch``) samples its tokens itself, over a
paged cache, with no per-row LoRA adapter and no reuse of whet's prefix caches, so the loop is
here; the forward pass, the cache and the per-row adapters are transformers' and peft's.

Requests that arrive together are prefilled together: the backend's ``prefill`` takes every joining
sequence at once, and may run short prompts as one left-padded pass (see ``TOGETHER_TOKENS_CPU``).
Not done: a prompt is prefilled in one pass, so a long one pauses the batch's decoding meanwhile
(chunked prefill would bound that pause).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from whet.runtime.policy import BackendError, SamplingParams

# forward(input_ids [B, T], cache, adapter_names, attention_mask [B, L+T] | None,
#         position_ids [B, T] | None) -> (last-position logits [B, V], cache)
Forward = Callable[..., tuple[torch.Tensor, Any]]


@dataclass(eq=False)
class Sequence:
    """One request's generation, as the engine advances it."""

    prompt: list[int]
    params: SamplingParams
    budget: int  # at most this many new tokens
    adapter: str  # BASE for the base weights
    emit: Callable[[str], None]  # text deltas, from the engine thread
    cancel: threading.Event
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: str = ""  # text emitted so far
    finish: str = "length"
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class BatchEngine:
    """Owns the model's forward passes: ``submit`` a Sequence, wait on its ``done`` event.

    ``sample(seqs, logits [B, V])`` picks each row's next token, returning (token, log-prob) per row
    (one call per step, so a GPU is waited for once per step, not twice per row); ``accept(seq, token,
    logprob)`` adds it to ``seq`` (and emits its text), returning True when ``seq`` is finished.
    ``prefill(seqs)`` returns, for each sequence, (its private cache, the first new token's logits [V])
    or the exception that failed it; ``release(seq, cache)`` hands back a finished sequence's private cache.
    """

    def __init__(
        self,
        forward: Forward,
        prefill: Callable[[list[Sequence]], list[tuple[Any, torch.Tensor] | BaseException]],
        sample: Callable[[list[Sequence], torch.Tensor], list[tuple[int, float]]],
        accept: Callable[[Sequence, int, float], bool],
        release: Callable[[Sequence, Any], None],
        device: torch.device,
        max_batch: int,
    ) -> None:
        self._forward, self._prefill, self._sample, self._accept = forward, prefill, sample, accept
        self._release = release
        self.device = device
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._waiting: list[Sequence] = []
        self._closed = False
        # the batch: rows, their left-padded cache, its mask [B, L] and each row's real length
        self.rows: list[Sequence] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._lengths: list[int] = []
        self.steps = 0  # batched decode steps run
        self.mixed_steps = 0  # steps whose rows used more than one adapter (base counts as one)
        self.widest = 0  # the most rows one step advanced
        self.submitted = 0
        self._thread = threading.Thread(target=self._run, name="whet-batch", daemon=True)
        self._thread.start()

    # -- requests ----------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            if self._closed:
                raise BackendError("the model backend is closed")
            self._waiting.append(seq)
            self.submitted += 1
            self._cond.notify_all()

    def wait(self, seq: Sequence) -> None:
        """Block until ``seq`` is finished; re-raise what failed it."""
        while not seq.done.wait(timeout=1.0):
            if not self._thread.is_alive():
                raise BackendError("the batching engine stopped; restart the server")
        if seq.error is not None:
            raise seq.error

    def close(self, wait: float | None = None) -> None:
        """Stop taking requests and end the loop (requests still queued or decoding fail); with ``wait``,
        block up to that many seconds until the loop's thread has ended. A process that exited with the
        thread still inside torch aborted now and then ("terminate called without an active exception",
        exit -6, 2 of 12 runs of ``whet doctor`` on one machine)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait is not None and threading.current_thread() is not self._thread:
            self._thread.join(wait)

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._waiting or self.rows)
                if self._closed:
                    break
                joining = self._admit()
            try:
                with torch.inference_mode():
                    while joining:  # those that arrived during a prefill join before the next step too
                        self._join(joining)
                        with self._cond:
                            joining = [] if self._closed else self._admit()
                    if self.rows:
                        self._step()
            except Exception as exc:  # a bug in the bookkeeping fails the batch, never the engine
                self._fail([*joining, *self.rows], exc)
                self.rows, self._cache, self._mask, self._lengths = [], None, None, []
        self._fail([*self._waiting, *self.rows], BackendError("the model backend is closed"))
        self._waiting, self.rows = [], []

    def _admit(self) -> list[Sequence]:
        room = self.max_batch - len(self.rows)
        if self.rows and not self._batchable():
            room = 0  # a cache that is not plain per-position keys/values cannot be padded: one at a time
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        return joining

    def _join(self, seqs: list[Sequence]) -> None:
        """Prefill ``seqs`` (together where the backend can), sample each one's first token, and add
        to the batch those it did not finish. A request that fails here fails alone."""
        live = []
        for seq in seqs:
            if seq.cancel.is_set() or seq.budget <= 0:
                self._finish(seq, None)
            else:
                live.append(seq)
        if not live:
            return
        try:
            prefilled = self._prefill(live)
        except Exception as exc:  # the shared pass failed: each one fails alone, so try them one by one
            if len(live) == 1:
                prefilled = [exc]
            else:
                for seq in live:
                    self._join([seq])
                return
        ready = [(seq, got) for seq, got in zip(live, prefilled, strict=True) if not isinstance(got, BaseException)]
        for seq, got in zip(live, prefilled, strict=True):
            if isinstance(got, BaseException):
                seq.error = got
                self._finish(seq, None)
        if not ready:
            return
        try:
            picks = self._sample([seq for seq, _ in ready], torch.stack([logits for _, (_, logits) in ready]))
        except Exception as exc:
            self._fail([seq for seq, _ in ready], exc)
            return
        for (seq, (cache, _)), pick in zip(ready, picks, strict=True):
            try:
                if self._accept(seq, *pick):
                    self._finish(seq, cache)
                else:
                    self._add_row(seq, cache)
            except Exception as exc:  # this request fails; the batch goes on
                seq.error = exc
                self._finish(seq, None)

    def _step(self) -> None:
        """One forward pass over every row, one token sampled for each; finished rows leave."""
        rows = self.rows
        self._drop([i for i, seq in enumerate(rows) if seq.cancel.is_set()])
        if not self.rows:
            return
        rows = self.rows
        inputs = torch.tensor([[seq.token_ids[-1]] for seq in rows], device=self.device)  # [B, 1]
        mask = torch.cat([self._mask, self._mask.new_ones(len(rows), 1)], dim=1)  # [B, L+1]
        positions = torch.tensor([[n] for n in self._lengths], device=self.device)  # [B, 1]
        names = [seq.adapter for seq in rows]
        try:
            logits, self._cache = self._forward(inputs, self._cache, names, mask, positions)  # [B, V]
            picks = self._sample(rows, logits)
        except Exception as exc:  # the whole batch shared the pass (and the sampling) that failed
            self._fail(rows, exc)
            self.rows, self._cache, self._mask, self._lengths = [], None, None, []
            return
        self._mask = mask
        self._lengths = [n + 1 for n in self._lengths]
        self.steps += 1
        self.mixed_steps += len(set(names)) > 1
        self.widest = max(self.widest, len(rows))
        finished = []
        for i, seq in enumerate(rows):
            try:
                if self._accept(seq, *picks[i]):
                    finished.append(i)
            except Exception as exc:
                seq.error = exc
                finished.append(i)
        self._drop(finished)

    # -- the batch's cache -------------------------------------------------------------------

    def _batchable(self) -> bool:
        return self._cache is None or all(type(layer) is DynamicLayer for layer in self._cache.layers)

    def _add_row(self, seq: Sequence, cache: Any) -> None:
        length = cache.get_seq_length()
        ones = torch.ones(1, length, dtype=torch.long, device=self.device)  # [1, n]
        if not self.rows:
            self.rows, self._cache, self._mask, self._lengths = [seq], cache, ones, [length]
            return
        # DynamicCache can select rows (batch_select_indices) but not add a row of another length: pad by hand
        width = max(self._mask.shape[1], length)
        grow, pad = width - self._mask.shape[1], width - length
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, grow), _pad_left(theirs.keys, pad)])  # [B+1, H, W, D]
            mine.values = torch.cat([_pad_left(mine.values, grow), _pad_left(theirs.values, pad)])
        self._mask = torch.cat([_pad_left(self._mask, grow, dim=1), _pad_left(ones, pad, dim=1)])  # [B+1, W]
        self.rows.append(seq)
        self._lengths.append(length)

    def _drop(self, indices: list[int]) -> None:
        """Finish the rows at ``indices`` and remove them from the batch."""
        if not indices:
            return
        for i in indices:
            self._finish(self.rows[i], self._row_cache(i))
        keep = [i for i in range(len(self.rows)) if i not in set(indices)]
        self.rows = [self.rows[i] for i in keep]
        self._lengths = [self._lengths[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        self._cache.batch_select_indices(torch.tensor(keep, device=self.device))
        self._mask = self._mask[keep]
        start = int(self._mask.any(dim=0).long().argmax())  # the first column some row still uses
        if start:
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]
            self._mask = self._mask[:, start:]

    def _row_cache(self, i: int) -> Any:
        """A private cache holding row ``i``'s real positions only (for prefix reuse)."""
        if len(self.rows) == 1:
            return self._cache
        cache = DynamicCache()
        start = self._mask.shape[1] - self._lengths[i]
        for index, layer in enumerate(self._cache.layers):
            keys = layer.keys[i : i + 1, :, start:, :].clone()  # [1, H, n, D]
            cache.update(keys, layer.values[i : i + 1, :, start:, :].clone(), index)
        return cache

    def _finish(self, seq: Sequence, cache: Any) -> None:
        try:
            if cache is not None and seq.error is None:
                self._release(seq, cache)
        finally:
            seq.done.set()

    def _fail(self, seqs: list[Sequence], exc: BaseException) -> None:
        for seq in seqs:
            seq.error = exc
            seq.done.set()


def _pad_left(tensor: torch.Tensor, n: int, dim: int = -2) -> torch.Tensor:
    """``tensor`` with ``n`` zero positions added before the others along ``dim``."""
    if n == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = n
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
