"""How far a narrowed lesson still reaches: retrieval scores only, no model.

The lesson check adds a lesson that broke pinned turns *narrowed*: shown only to requests at least
``learner.gate.lesson_scope_margin`` more similar to it than the closest pinned turn it broke
(:func:`whet.learner.lesson_check.narrowed`). Whether that keeps the lesson useful is a question about
the embedder alone: do the other ways of asking a lesson's request score above that floor, and do
the general requests that merely read like it score below?

For each personal request of a profile's first ``--interactions`` (its lesson says the right call, and
is keyed by the request it came from and by that request less what the call copied,
:func:`whet.memory.index.lesson_keys`), this takes the worst case: the lesson broke the
closest pinned request of all (``config/regression.jsonl``). It then counts, at that floor:

- ``held-out``: the profile's held-out requests of the same intent (and person) the lesson still
  reaches: what ``whet bench learn`` measures it on;
- ``general``: general requests (``--general`` drawn from the training vocabulary, any profile) that
  it still reaches: look-alikes the check never asked the model about.

    python bench/lesson_scopes.py [--profile FILE] [--margin M] [--interactions N] [--general N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np

from whet.config.settings import load_config
from whet.learner.gate import load_pinned_turns
from whet.learner.learner import regression_path
from whet.learner.prompt import last_user_text
from whet.memory.index import LessonIndex, open_embedder
from whet.world.conversations import random_profile, success_lesson, training_vocabulary
from whet.world.tasks import GENERAL, World, load_profile, make_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--margin", type=float, default=None,
                        help="the narrowing margin (default: learner.gate.lesson_scope_margin)")
    parser.add_argument("--interactions", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=24)
    parser.add_argument("--general", type=int, default=150, help="general requests drawn per general intent")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    margin = load_config().learner.gate.lesson_scope_margin if args.margin is None else args.margin

    embedder = open_embedder("auto")
    pinned = sorted({last_user_text(turn.messages) for turn in load_pinned_turns(regression_path("bundled"))})
    profile = load_profile(args.profile)
    world = World(profile, args.seed)
    asked = {t.text: t for t in world.training_tasks(args.interactions) if t.personal}  # in order, each request once
    lessons = list(asked)
    heldout = world.heldout_tasks(args.heldout)
    rng, vocab = random.Random(args.seed), training_vocabulary()
    general = sorted({make_task(i, rng, random_profile(rng, vocab), vocab=vocab).text
                      for _ in range(args.general) for i in GENERAL})  # fmt: skip

    index = LessonIndex(embedder)
    vectors = {name: embedder.embed(texts) for name, texts in
               (("pinned", pinned), ("heldout", [t.text for t in heldout]), ("general", general))}
    print(f"profile {profile.name}, embedder {embedder.name}, margin {margin}: {len(lessons)} lesson requests, "
          f"{len(pinned)} pinned requests, {len(general)} general requests")
    print(f"{'lesson request':44s} {'closest pinned':>15s} {'floor':>6s} {'held-out reached':>17s} {'general reached':>16s}")
    reached = total = general_reached = 0
    for text in lessons:
        task = asked[text]
        lesson = success_lesson(task)
        closest = float(index.scores(vectors["pinned"], lesson).max())
        floor = closest + margin
        same = [j for j, h in enumerate(heldout) if h.intent == task.intent and h.meta.get("person") == task.meta.get("person")]
        scores = index.scores(vectors["heldout"][same], lesson) if same else np.zeros(0)
        near = int((index.scores(vectors["general"], lesson) >= floor).sum())
        reached, total, general_reached = reached + int((scores >= floor).sum()), total + len(same), general_reached + near
        print(f"{text[:44]:44s} {closest:15.2f} {floor:6.2f} {f'{int((scores >= floor).sum())}/{len(same)}':>17s} "
              f"{f'{near}/{len(general)}':>16s}")
    print(f"held-out requests a lesson of theirs still reaches: {reached}/{total}; "
          f"general requests reached, summed over lessons: {general_reached} ({general_reached / len(lessons):.1f} a lesson)")


if __name__ == "__main__":
    main()
