"""Prefix reuse: the key/value caches of recent sequences, so a prompt that starts with tokens
the engine already ran prefills only the rest.

Two prefixes recur in an agent: the agent's next step (its prompt is the previous step's prompt,
the tool call it sampled and the tool's result) and the start every request shares (the tool
list and the system prompt). Both are found the same way: the stored sequence with the longest
common start with the new prompt, on the same adapter, copied and cropped to that length. A
copy is private to its request, so concurrent requests never share a cache they extend.
transformers' ``generate`` does not keep caches across calls (and whet samples its own tokens
to record their raw log-probs), so the bookkeeping is here.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class PrefixCache:
    """At most ``entries`` caches, least recently used dropped first; a hit needs ``min_tokens``."""

    def __init__(self, entries: int = 8, min_tokens: int = 32) -> None:
        self.entries = entries
        self.min_tokens = min_tokens
        self._lock = threading.Lock()
        self._stored: OrderedDict[int, tuple[str, tuple[int, ...], Any]] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0

    def take(self, adapter: str, prompt: Sequence[int]) -> tuple[Any, int]:
        """(a private cache holding the first n tokens of ``prompt``, n), or (None, 0).

        n stops at least one token short of the prompt: the model has to run on the last one
        to give the next token's logits."""
        with self._lock:
            best, length = None, 0
            for key, (owner, ids, _) in self._stored.items():
                if owner == adapter:
                    shared = _common(ids, prompt, len(prompt) - 1)
                    if shared > length:
                        best, length = key, shared
            if best is None or length < self.min_tokens:
                return None, 0
            self._stored.move_to_end(best)
            stored = self._stored[best][2]
            self.hits += 1
            self.reused_tokens += length
        cache = copy.deepcopy(stored)
        surplus = cache.get_seq_length() - length
        if surplus:
            cache.crop(-surplus)  # transformers >= 5 crops by how many tokens to remove
        return cache, length

    def put(self, adapter: str, ids: Sequence[int], cache: Any) -> None:
        """Keep ``cache``, which holds exactly ``ids``; the caller must not extend it afterwards."""
        if len(ids) < self.min_tokens or self.entries == 0:
            return
        with self._lock:
            self._stored[self._next] = (adapter, tuple(ids), cache)
            self._next += 1
            while len(self._stored) > self.entries:
                self._stored.popitem(last=False)

    def drop(self, adapter: str) -> None:
        """Forget every cache computed with ``adapter`` (it is being unloaded)."""
        with self._lock:
            for key in [k for k, (owner, _, _) in self._stored.items() if owner == adapter]:
                del self._stored[key]


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
