"""Peak memory and time of one training pass: the trainer as it is, or as it was at a git revision.

    python bench/step_memory.py MODEL_DIR [--samples 8] [--rehearsal 16] [--epochs 1] [--anchor]
                                          [--trainer-from REV] [--cores 0]

The batch is made of the bundled rehearsal set's items (the prompts serving shows, tool lists
included): the first ``--rehearsal`` are rehearsed, the next ``--samples`` are the judged samples,
alternately -1 with a hint (hindsight's teacher actions) and +1. One pass (``--epochs``) of the
learner's default objective; ``--anchor`` holds the rehearsal set's small talk's odds of opening with a
call, as the learner does by default (``learner.rehearsal.anchor_weight``: one-token passes, many of
them). The peak resident memory is the process's, so each measurement runs in a process of its own.
``--trainer-from REV`` loads ``learner/trainer.py`` as it was at REV (e.g. the commit before the
one-graph-at-a-time pass, ``e6631e7``) to compare the two on one machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def trainer_module(revision: str | None) -> Any:
    """``whet.learner.trainer``, or the same file as it was at ``revision``."""
    if revision is None:
        import whet.learner.trainer as current

        return current
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:learner/trainer.py"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "trainer_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("trainer_at_revision", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF model folder (e.g. the one `whet model build` makes)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rehearsal", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1, help="optimizer passes over the batch (learner.lora.epochs)")
    parser.add_argument("--anchor", action="store_true", help="with the learner's anchor on the set's small talk")
    parser.add_argument("--trainer-from", metavar="REV", help="the trainer as it was at this git revision")
    parser.add_argument("--cores", help="pin to these cores (taskset list, e.g. 0), one thread each")
    args = parser.parse_args()
    if args.cores is not None:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    import torch

    from whet.config.settings import load_config
    from whet.learner.gate import encode_records, read_records
    from whet.learner.learner import _called, rehearsal_path
    from whet.learner.objective import objective_from_config
    from whet.learner.prompt import call_opening, hinted_prompt_ids

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    module = trainer_module(args.trainer_from)
    config = load_config().learner
    trainer = module.LoraTrainer.load(args.model, config.lora.model_copy(update={"epochs": args.epochs}),
                                      objective_from_config(config.objective), device="cpu")  # fmt: skip
    path = rehearsal_path("bundled")
    assert path is not None
    records = read_records(path)
    items = encode_records(records, trainer.tokenizer)
    if len(items) < args.rehearsal + args.samples:
        parser.error(f"the rehearsal set has {len(items)} items: --rehearsal + --samples must not be more")
    rehearsal = items[: args.rehearsal]
    samples = []
    for i in range(args.samples):
        record, (prompt, response) = records[args.rehearsal + i], items[args.rehearsal + i]
        with torch.no_grad():
            behaviour = trainer.response_logprobs(prompt, response).tolist()
        hinted = hinted_prompt_ids(trainer.tokenizer, record["messages"], prompt, "The user meant Lisbon") if i % 2 == 0 else None
        samples.append(module.Sample(f"t{i}", prompt, response, behaviour, -1 if i % 2 == 0 else 1, teacher_prompt_ids=hinted))
    anchor = None
    if args.anchor:
        opening = call_opening(trainer.tokenizer)
        # the learner's own split (Learner._small_talk, Learner._anchor): replies that call no tool, and the
        # draw's replies that open with a call
        talk = [p for p, r in items if not _called(trainer.tokenizer, r)]
        calls = [p for p, r in rehearsal if r and r[0] == opening]
        anchor = module.Anchor(talk, opening, config.rehearsal.anchor_weight, calls)
    before = peak_mb()
    started = time.perf_counter()
    stats = trainer.step(samples, 0.0, rehearsal, config.rehearsal.weight, config.rehearsal.first_token_weight, anchor)
    took = time.perf_counter() - started
    prompts = sum(len(p) for p, _ in rehearsal) + sum(len(s.prompt_ids) for s in samples)
    shown = f", anchor on {len(anchor.prompts)} chats and {len(anchor.calls)} calls" if anchor else ""
    print(f"trainer {args.trainer_from or 'as it is'}: {args.samples} samples + {args.rehearsal} rehearsal items{shown}, "
          f"{args.epochs} pass(es), "
          f"{torch.get_num_threads()} thread(s): peak RSS {before:.0f} MB before the step, {peak_mb():.0f} MB after "
          f"(+{peak_mb() - before:.0f} MB); {took:.1f} s; loss {stats['loss']:.4f}, rehearsal loss "
          f"{stats.get('rehearsal_loss', 0.0):.4f}, grad norm {stats['grad_norm']:.4f}; prompts "
          f"{prompts / (args.samples + args.rehearsal):.0f} tokens on average")
    return 0


if __name__ == "__main__":
    sys.exit(main())
