"""How near a tie does the model make each pinned call, under the base model and saved learner versions?

For every item of the gate's pinned set (``config/regression.jsonl``) whose reply is a tool call, the
reply's closest token: log p(its token) minus the likeliest other token's there, in nats, read along
the pinned reply (:meth:`LoraTrainer.reply_gaps`). Below 0, greedy decoding leaves the pinned call at that
token; a little above 0, any training step's noise may tip it (``learner.gate.pinned_tie_margin``: the
gate's greedy check does not count a call the base model makes by less).

    python bench/pinned_ties.py MODEL_DIR [--adapter ARM/data/adapters/global/global-0002 ...] [--show N]

Prints the calls nearest a tie first, each version's gap and the token where it is. One forward pass
a call and version (seconds on one core).
"""
import argparse
from pathlib import Path

import torch
from rich.progress import Progress, TimeElapsedColumn

from whet.config.settings import LoraConfig
from whet.learner.gate import encode_records, read_records
from whet.learner.objective import build_objective
from whet.learner.prompt import TOOL_CALL_OPEN
from whet.learner.trainer import LoraTrainer

CONFIG = Path(__file__).resolve().parents[1] / "config"

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--adapter", action="append", default=[], help="a saved adapter folder (repeatable)")
p.add_argument("--show", type=int, default=12, help="calls listed, nearest to a tie first")
args = p.parse_args()

torch.manual_seed(0)
trainer = LoraTrainer.load(args.model, LoraConfig(precision="float32"), build_objective("combined"), device="cpu")
records = read_records(CONFIG / "regression.jsonl")
calls = [(i, r["messages"][-1]["content"][:40], prompt, response) for i, (r, (prompt, response))
         in enumerate(zip(records, encode_records(records, trainer.tokenizer), strict=True))
         if TOOL_CALL_OPEN in r["response"]]  # fmt: skip

versions = [("base", None), *((Path(a).name, Path(a)) for a in args.adapter)]
closest: dict[str, list[tuple[float, str]]] = {}
with Progress(*Progress.get_default_columns(), TimeElapsedColumn()) as bar:
    task = bar.add_task("pinned calls", total=len(versions))
    for label, folder in versions:
        bar.update(task, description=label)
        trainer.reset(folder)
        gaps = trainer.reply_gaps([prompt for _, _, prompt, _ in calls], [response for *_, response in calls])
        closest[label] = []
        for (_, _, _, response), row in zip(calls, gaps, strict=True):
            at = min(range(len(row)), key=row.__getitem__)
            closest[label].append((row[at], trainer.tokenizer.decode(response[max(0, at - 2): at + 1])))
        bar.advance(task)

order = sorted(range(len(calls)), key=lambda k: closest["base"][k][0])
print("item  request                                   " + "  ".join(f"{label:>22}" for label, _ in versions))
for k in order[: args.show]:
    i, request, _, _ = calls[k]
    cells = "  ".join(f"{gap:+7.3f} {token[-13:]!r:>14}" for gap, token in (closest[label][k] for label, _ in versions))
    print(f"{i:4}  {request:40}  {cells}")
for label, _ in versions:
    near = sum(gap < 0.5 for gap, _ in closest[label])
    wrong = sum(gap < 0 for gap, _ in closest[label])
    print(f"{label}: {len(calls)} pinned calls, {wrong} left by greedy decoding, {near} within 0.5 nats of a tie")
