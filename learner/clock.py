"""Wall seconds by phase, for whoever reports where a long piece of work spent its time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PhaseClock:
    """Wall seconds by phase: ``with clock("train"): ...`` adds the block's time to ``seconds["train"]``;
    ``begun(phase)`` is called as each block begins."""

    def __init__(self, begun: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.begun = begun

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.begun is not None:
            self.begun(phase)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = round(self.seconds.get(phase, 0.0) + time.perf_counter() - started, 3)
