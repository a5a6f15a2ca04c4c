"""How near does small talk sit to a tool call, and a pinned call to a tie, under the base model and saved learner versions?

For every item of the gate's pinned set (``config/regression.jsonl``) and of the rehearsal set
(``config/rehearsal.jsonl``) whose reply calls no tool (chats, and answers read off a tool's result), the log-odds of the reply opening with a
tool call: log p(first token of ``<tool_call>``) minus the likeliest other first token's, in nats
(above 0, greedy decoding calls a tool). A step that costs the gate a pinned chat moves these; this
shows by how much, and whether it moved the chats it was trained to keep (rehearsal, the anchor)
as far as the ones the gate keeps.

    python bench/opening_odds.py MODEL_DIR --adapter ARM/data/adapters/global/global-0002 [--adapter ...]

Prints each chat's odds under the base and each adapter, nearest first, then per set the mean
shift from the base and the number of chats above 0. One forward pass a chat and version
(seconds on one core).

Then the pinned set's tool calls, the other side of it: each call's closest token, log p(its token)
minus the likeliest other token's there, in nats, read along the pinned reply
(:meth:`LoraTrainer.reply_gaps`). Below 0, greedy decoding leaves the pinned call at that token; a
little above 0, any training step's noise may tip it (``learner.gate.pinned_tie_margin``: the gate's
greedy check does not count a call the base model makes by less).
"""
import argparse
import statistics
from pathlib import Path

import torch
from rich.progress import Progress, TimeElapsedColumn

from whet.config.settings import LoraConfig
from whet.learner.gate import encode_records, read_records
from whet.learner.objective import build_objective
from whet.learner.prompt import TOOL_CALL_OPEN, call_opening
from whet.learner.trainer import LoraTrainer

CONFIG = Path(__file__).resolve().parents[1] / "config"

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--adapter", action="append", default=[], help="a saved adapter folder (repeatable)")
p.add_argument("--show", type=int, default=8, help="chats listed per set, nearest to a call first (and pinned calls, nearest a tie)")
args = p.parse_args()

torch.manual_seed(0)
trainer = LoraTrainer.load(args.model, LoraConfig(precision="float32"), build_objective("combined"), device="cpu")
opening = call_opening(trainer.tokenizer)
sets = {}
for name in ("regression", "rehearsal"):
    records = read_records(CONFIG / f"{name}.jsonl")
    encoded = encode_records(records, trainer.tokenizer)
    talk = [(r["messages"][-1]["content"][:48].replace("\n", " "), prompt) for r, (prompt, response)
            in zip(records, encoded, strict=True) if TOOL_CALL_OPEN not in r["response"]]  # fmt: skip
    sets[name] = talk
    if name == "regression":
        calls = [(i, r["messages"][-1]["content"][:40], prompt, response) for i, (r, (prompt, response))
                 in enumerate(zip(records, encoded, strict=True)) if TOOL_CALL_OPEN in r["response"]]  # fmt: skip

versions = [("base", None), *((Path(a).name, Path(a)) for a in args.adapter)]
odds: dict[str, dict[str, list[float]]] = {}
closest: dict[str, list[tuple[float, str]]] = {}  # version -> each pinned call's smallest gap, and its token
with Progress(*Progress.get_default_columns(), TimeElapsedColumn()) as bar:
    task = bar.add_task("opening odds", total=len(versions) * (len(sets) + 1))
    for label, folder in versions:
        trainer.reset(folder)
        odds[label] = {}
        for name, talk in sets.items():
            bar.update(task, description=f"{label}: {name}")
            odds[label][name] = trainer.opening_odds([prompt for _, prompt in talk], opening)
            bar.advance(task)
        bar.update(task, description=f"{label}: pinned calls")
        gaps = trainer.reply_gaps([prompt for _, _, prompt, _ in calls], [response for *_, response in calls])
        closest[label] = []
        for (*_, response), row in zip(calls, gaps, strict=True):
            at = min(range(len(row)), key=row.__getitem__)
            closest[label].append((row[at], trainer.tokenizer.decode(response[max(0, at - 2): at + 1])))
        bar.advance(task)

for name, talk in sets.items():
    print(f"\n{name}: {len(talk)} chats whose reply calls no tool; odds of opening with a call (nats)")
    print(f"{'chat':50} " + " ".join(f"{label[-11:]:>11}" for label, _ in versions))
    order = sorted(range(len(talk)), key=lambda i: -max(odds[label][name][i] for label, _ in versions))
    for i in order[: args.show]:
        print(f"{talk[i][0]:50} " + " ".join(f"{odds[label][name][i]:>11.2f}" for label, _ in versions))
    for label, _ in versions[1:]:
        shift = [a - b for a, b in zip(odds[label][name], odds["base"][name], strict=True)]
        print(f"  {label}: mean shift {statistics.mean(shift):+.2f} (min {min(shift):+.2f}, max {max(shift):+.2f}), "
              f"{sum(o > 0 for o in odds[label][name])} above 0 (base {sum(o > 0 for o in odds['base'][name])})")

print(f"\nregression: {len(calls)} pinned tool calls; the closest token's gap to the best other (nats)")
print(f"{'item':4}  {'request':40}  " + "  ".join(f"{label[-22:]:>22}" for label, _ in versions))
for k in sorted(range(len(calls)), key=lambda k: closest["base"][k][0])[: args.show]:
    cells = "  ".join(f"{gap:+7.3f} {token[-13:]!r:>14}" for gap, token in (closest[label][k] for label, _ in versions))
    print(f"{calls[k][0]:4}  {calls[k][1]:40}  {cells}")
for label, _ in versions:
    print(f"  {label}: {sum(g < 0 for g, _ in closest[label])} left by greedy decoding, "
          f"{sum(g < 0.5 for g, _ in closest[label])} within 0.5 nats of a tie")
