"""The promotion gate: a candidate adapter goes live only if replay says it is not worse.

Replay measures the average per-token log-prob of recorded actions under the live
adapter (``before``) and the candidate (``after``):

- on held-out judged turns, the likelihood of positively judged actions should rise
  and that of negatively judged ones fall: the *preference margin*
  ``mean(after - before | +1) - mean(after - before | -1)`` must not be below
  ``-tolerance``;
- on a pinned regression set (turns a person wants kept), the average change must not
  be below ``-regression_tolerance``, and no single item may fall by more than
  ``regression_item_tolerance``: a candidate that copies a lesson's city into "What time is
  it in Cairo?" changes a few tokens of one item a lot, which the average of all items hides.

A check without data passes and says so in the metrics. The decision and every number
are stored on the adapter row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from whet.config.settings import ConfigError
from whet.learner.prompt import prompt_text


@dataclass(frozen=True)
class Replayed:
    """One replayed action: its judged score and mean log-prob under live and candidate."""

    score: int
    before: float
    after: float


@dataclass(frozen=True)
class GateDecision:
    accepted: bool
    reason: str
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PromotionGate:
    tolerance: float = 0.01
    regression_tolerance: float = 0.05
    regression_item_tolerance: float | None = None  # None: the average alone decides

    def decide(self, holdout: Sequence[Replayed], regression: Sequence[Replayed]) -> GateDecision:
        margin = preference_margin(holdout)
        drift = fmean(r.after - r.before for r in regression) if regression else None
        worst = min(r.after - r.before for r in regression) if regression else None
        metrics = {
            "holdout_turns": len(holdout),
            "preference_margin": margin,
            "regression_turns": len(regression),
            "regression_drift": drift,
            "regression_worst": worst,
            "tolerance": self.tolerance,
            "regression_tolerance": self.regression_tolerance,
            "regression_item_tolerance": self.regression_item_tolerance,
        }
        if margin is not None and margin < -self.tolerance:
            reason = f"held-out preference margin {margin:+.4f} nats/token is below -{self.tolerance}"
            return GateDecision(False, reason, metrics)
        if drift is not None and drift < -self.regression_tolerance:
            reason = f"regression set likelihood fell {drift:+.4f} nats/token (allowed -{self.regression_tolerance})"
            return GateDecision(False, reason, metrics)
        if worst is not None and self.regression_item_tolerance is not None and worst < -self.regression_item_tolerance:
            reason = (f"a regression item's likelihood fell {worst:+.4f} nats/token "
                      f"(allowed -{self.regression_item_tolerance} for any one item)")  # fmt: skip
            return GateDecision(False, reason, metrics)
        checked = [n for n, v in (("held-out", margin), ("regression", drift)) if v is not None]
        reason = f"passed {' and '.join(checked)} replay" if checked else "no held-out or regression data: passed"
        return GateDecision(True, reason, metrics)


def preference_margin(replayed: Sequence[Replayed]) -> float | None:
    """How much more the candidate favours good actions than bad ones, nats/token (None: no data)."""
    up = [r.after - r.before for r in replayed if r.score > 0]
    down = [r.after - r.before for r in replayed if r.score < 0]
    if not up and not down:
        return None
    return (fmean(up) if up else 0.0) - (fmean(down) if down else 0.0)


def load_regression_set(path: Path, tokenizer: Any,
                        key: str = "learner.gate.regression_set") -> list[tuple[list[int], list[int]]]:  # fmt: skip
    """(prompt ids, response ids) for each line of a JSONL file of ``{"messages": [...], "response": "...",
    "tools": [...]}`` (``tools``, OpenAI function specs the prompt lists, is optional). ``key``: the
    setting that named the file, for errors (the rehearsal set has the same format)."""
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}", "point it at a JSONL file or set it to null") from None
    end = tokenizer.eos_token or ""
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages, response, tools = record["messages"], record["response"], record.get("tools")
            if not isinstance(messages, list) or not isinstance(response, str) or not response:
                raise TypeError
            if tools is not None and not isinstance(tools, list):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            fix = 'each line must be {"messages": [{"role": ..., "content": ...}], "response": "...", "tools"?: [...]}'
            raise ConfigError(key, f"{path} line {number} is not a turn of this format", fix) from None
        prompt = tokenizer.encode(prompt_text(tokenizer, messages, tools), add_special_tokens=False)
        items.append((prompt, tokenizer.encode(response + end, add_special_tokens=False)))
    return items
