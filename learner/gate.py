"""The promotion gate: a candidate adapter goes live only if replay says it is not worse.

Replay measures the average per-token log-prob of recorded actions under the live
adapter (``before``) and the candidate (``after``):

- on held-out judged turns, the likelihood of positively judged actions should rise
  and that of negatively judged ones fall: the *preference margin*
  ``mean(after - before | +1) - mean(after - before | -1)`` must not be below
  ``-tolerance``, once there are ``holdout_min_turns`` held-out turns to average (with fewer,
  one turn's noise would decide: the margin is reported and the other checks decide);
- on a pinned regression set (turns a person wants kept), the average change must not
  be below ``-regression_tolerance``, and no single item may fall by more than
  ``regression_item_tolerance``: a candidate that copies a lesson's city into "What time is
  it in Cairo?" changes a few tokens of one item a lot, which the average of all items hides;
- and the set's average under the candidate must not sit more than ``regression_total_tolerance``
  below the base model's (a lineage's steps together): the checks above compare a candidate with
  the live version, so steps that each pass them add up (run CS: five promoted steps, each at
  -0.004 to -0.041, put the set 0.14 nats/token below the base, and general tasks fell 0.875 to
  0.75). A candidate that moves the set back towards the base passes it, even from beyond the bound.

And on the regression set's greedy replies: a turn the live version does right (its pinned
call, or an answer that calls nothing) the candidate must not do wrong, beyond
``regression_actions_lost`` turns (:class:`PinnedAction`).

A check without data passes and says so in the metrics. The decision and every number
are stored on the adapter row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from whet.config.settings import ConfigError
from whet.learner.prompt import TOOL_CALL_OPEN, prompt_text, split_tool_calls, user_texts


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
    regression_actions_lost: int | None = None  # None: greedy replies unchecked
    holdout_min_turns: int = 1  # held-out turns the preference margin needs before it decides
    regression_total_tolerance: float | None = None  # None: the base model's likelihoods unchecked

    def decide(self, holdout: Sequence[Replayed], regression: Sequence[Replayed],
               actions: Sequence[tuple[bool, bool]] = (), base: Sequence[float] = ()) -> GateDecision:  # fmt: skip
        """``actions``: for each pinned turn, whether the live version's and the candidate's greedy
        replies did what it pins (:class:`PinnedAction`). ``base``: each regression item's mean log-prob
        under the base model (no adapter); empty (a step saved before it was recorded): unchecked."""
        margin = preference_margin(holdout)
        lost_items = [i for i, (live, candidate) in enumerate(actions) if live and not candidate]
        lost = len(lost_items) if actions else None
        drift = fmean(r.after - r.before for r in regression) if regression else None
        worst = min(r.after - r.before for r in regression) if regression else None
        total = (fmean(r.after - b for r, b in zip(regression, base, strict=True))
                 if regression and len(base) == len(regression) else None)  # fmt: skip
        metrics = {
            "holdout_turns": len(holdout),
            "holdout_min_turns": self.holdout_min_turns,
            "preference_margin": margin,
            "regression_turns": len(regression),
            "regression_drift": drift,
            "regression_worst": worst,
            "regression_total_drift": total,  # against the base model: the lineage's steps together
            "regression_total_tolerance": self.regression_total_tolerance,
            "tolerance": self.tolerance,
            "regression_tolerance": self.regression_tolerance,
            "regression_item_tolerance": self.regression_item_tolerance,
            "regression_actions_kept": [sum(a[0] for a in actions), sum(a[1] for a in actions)] if actions else None,
            "regression_actions_lost": lost,
            "regression_actions_lost_items": lost_items,  # their lines in the regression set, from 0
        }
        decisive = margin is not None and len(holdout) >= self.holdout_min_turns
        if decisive and margin < -self.tolerance:
            reason = f"held-out preference margin {margin:+.4f} nats/token is below -{self.tolerance}"
            return GateDecision(False, reason, metrics)
        if drift is not None and drift < -self.regression_tolerance:
            reason = f"regression set likelihood fell {drift:+.4f} nats/token (allowed -{self.regression_tolerance})"
            return GateDecision(False, reason, metrics)
        if (total is not None and self.regression_total_tolerance is not None and total < -self.regression_total_tolerance
                and drift is not None and drift < 0):  # a step back towards the base passes, even from beyond the bound
            reason = (f"regression set likelihood is {total:+.4f} nats/token from the base model's "
                      f"(allowed -{self.regression_total_tolerance} over a lineage's steps)")  # fmt: skip
            return GateDecision(False, reason, metrics)
        if worst is not None and self.regression_item_tolerance is not None and worst < -self.regression_item_tolerance:
            reason = (f"a regression item's likelihood fell {worst:+.4f} nats/token "
                      f"(allowed -{self.regression_item_tolerance} for any one item)")  # fmt: skip
            return GateDecision(False, reason, metrics)
        if lost is not None and self.regression_actions_lost is not None and lost > self.regression_actions_lost:
            reason = (f"{lost} pinned turn(s) that the live version answers right, the candidate answers wrong "
                      f"(allowed {self.regression_actions_lost})")  # fmt: skip
            return GateDecision(False, reason, metrics)
        checked = [n for n, v in (("held-out", margin if decisive else None), ("regression", drift)) if v is not None]
        if checked:
            reason = f"passed {' and '.join(checked)} replay"
        else:
            reason = "no regression data: passed" if margin is not None else "no held-out or regression data: passed"
        if margin is not None and not decisive:
            reason += (f" (held-out margin {margin:+.4f} nats/token on {len(holdout)} turn(s), "
                       f"fewer than the {self.holdout_min_turns} it needs to decide)")  # fmt: skip
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
    return encode_records(read_records(path, key), tokenizer)


def encode_records(records: Sequence[dict[str, Any]], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of records :func:`read_records` read."""
    end = tokenizer.eos_token or ""
    items = []
    for record in records:
        prompt = tokenizer.encode(prompt_text(tokenizer, record["messages"], record.get("tools")), add_special_tokens=False)
        items.append((prompt, tokenizer.encode(record["response"] + end, add_special_tokens=False)))
    return items


def read_records(path: Path, key: str = "learner.gate.regression_set") -> list[dict[str, Any]]:
    """The lines of a regression (or rehearsal) set, checked; ``key`` names the setting in errors."""
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}", "point it at a JSONL file or set it to null") from None
    records = []
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
        records.append(record)
    return records


# -- the greedy check: what each pinned reply must do -------------------------------------------

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
ANSWER_OPENING = 16  # tokens of a greedy reply that decide whether a pinned chat is still answered


@dataclass(frozen=True)
class PinnedAction:
    """What the policy must do on one pinned turn, checked on its greedy reply.

    Likelihood replay sees how probable the pinned reply stays, not what the policy now writes:
    in run K, steps that kept the pinned replies' likelihood within tolerance took general tasks
    from 0.94 to 0.62. This check reads the reply itself: a pinned tool call must be made with
    the same tool and the same arguments (an argument left out equals its schema default; text
    compared without case or spaces), and a pinned answer must be an answer (some text, no tool
    call) that keeps every number it takes from the turn's tool results and, where it reads tool
    results, writes no number that neither they nor the user's messages hold: "It is 7 on Sunday
    in 2027-03-21." keeps every number of "That is Sunday, 2027-03-21." and made one up (bench run
    DX: a lineage that broke the date sums' answers passed every pinned answer).

    A pinned answer with no number to keep is decided by its opening (:meth:`tokens`): a chat
    the policy turns into a tool call opens with the call, so decoding the rest of a long answer
    (most of the greedy check's time with 41 pinned chats) tells nothing more. The price: a reply
    that writes :data:`ANSWER_OPENING` tokens of text and only then calls a tool passes."""

    calls: tuple[tuple[str, str], ...]  # (tool, canonical arguments) of the pinned reply
    defaults: dict[str, dict[str, Any]]  # tool -> argument -> its schema default
    numbers: frozenset[str]  # numbers the pinned answer repeats from the tool results
    # numbers an answer read off tool results may write (:func:`_plain_numbers`: those results' and the user's
    # messages'); None: the turn has no tool result
    said: frozenset[str] | None = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> PinnedAction:
        defaults = {}
        for spec in record.get("tools") or []:
            function = spec.get("function", spec) if isinstance(spec, dict) else {}
            properties = (function.get("parameters") or {}).get("properties") or {}
            defaults[function.get("name")] = {k: v["default"] for k, v in properties.items()
                                              if isinstance(v, dict) and "default" in v}  # fmt: skip
        _, calls, _ = split_tool_calls(record["response"])
        results = " ".join(str(m.get("content", "")) for m in record["messages"] if m.get("role") == "tool")
        numbers = frozenset(_NUMBER.findall(record["response"])) & frozenset(_NUMBER.findall(results)) if not calls else frozenset()
        asked = " ".join(user_texts(record["messages"]))
        said = _plain_numbers(f"{asked} {results}") if results and not calls else None
        return cls(tuple(_canonical(defaults, name, arguments) for name, arguments in calls), defaults, numbers, said)

    def tokens(self, pinned: int) -> int:
        """How many tokens of a greedy reply :meth:`kept` reads, for a pinned reply of ``pinned``
        tokens: all of it and a few more, or only the opening of an answer with no number to keep."""
        return pinned + 8 if self.calls or self.numbers else min(pinned + 8, ANSWER_OPENING)

    def kept(self, reply: str) -> bool:
        content, calls, errors = split_tool_calls(reply)
        if errors or len(calls) != len(self.calls):
            return False
        if self.calls:
            return all(_canonical(self.defaults, *call) == want for call, want in zip(calls, self.calls, strict=True))
        if any(content.endswith(TOOL_CALL_OPEN[:n]) for n in range(2, len(TOOL_CALL_OPEN))):
            return False  # a reply cut off (:meth:`tokens`) as it opened a tool call
        if self.said is not None and not _plain_numbers(content) <= self.said:
            return False  # a number made up
        return bool(content) and self.numbers <= set(_NUMBER.findall(content))


def _plain_numbers(text: str) -> frozenset[str]:
    """The numbers ``text`` writes, without leading zeros: a clock's "05:30" is the "5:30" an answer says."""
    return frozenset(number.lstrip("0") or "0" for number in _NUMBER.findall(text))


def _canonical(defaults: dict[str, dict[str, Any]], tool: str, arguments: dict[str, Any]) -> tuple[str, str]:
    """(tool, its arguments as compared): every argument the schema defaults, then :func:`_plain` values."""
    full = {**defaults.get(tool, {}), **arguments}
    return tool, json.dumps({k: _plain(v) for k, v in full.items() if v is not None}, sort_keys=True)


def _plain(value: Any) -> Any:
    """An argument's value as compared: numbers as floats (``"40"`` = ``40`` = ``40.0``), text without
    whitespace and case-folded."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return "".join(value.split()).casefold()  # "22 + 45" = "22+45"
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class PinnedTurn:
    """One line of a regression set as a conversation to answer: what the lesson check asks the served model."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    response: str
    action: PinnedAction


def load_pinned_turns(path: Path, key: str = "learner.gate.regression_set") -> list[PinnedTurn]:
    """:class:`PinnedTurn` of each line of a regression set (in the order of :func:`load_regression_set`)."""
    return pinned_turns(read_records(path, key))


def pinned_turns(records: Sequence[dict[str, Any]]) -> list[PinnedTurn]:
    """:class:`PinnedTurn` of records :func:`read_records` read."""
    return [PinnedTurn(r["messages"], r.get("tools"), r["response"], PinnedAction.of(r)) for r in records]
