"""Which lessons a request is shown: by the request a lesson came from alone, or also by that request
with what its calls copied from it left out (:func:`whet.memory.index.lesson_keys`). Retrieval only,
no model.

For each profile and seed, every personal request of the first ``--interactions`` leaves a lesson
saying its right call (:func:`whet.world.conversations.success_lesson`), as a thanked answer does. Each
held-out request is then shown what the agent's rule shows it (``agent.lessons_*``: the ``k`` nearest,
the floor, the margin), and counted:

- ``no lesson of its kind``: none of the shown lessons is of the request's intent: memory cannot
  help it, whatever the model reads;
- ``another kind's``: a shown lesson is of another intent: a value the model may wrongly copy.

and the lessons the chat probe (requests no tool answers), the general tasks and the lesson probes
(``config/lesson_probes.jsonl``) are shown, summed: what could mislead general skill.

    python bench/lesson_retrieval.py [--profile FILE ...] [--seeds 0 1 2 3] [--interactions N] [--heldout N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from whet.config.settings import AgentConfig, load_config
from whet.learner.gate import load_pinned_turns
from whet.learner.learner import lesson_probes_path
from whet.learner.prompt import last_user_text
from whet.memory.index import LessonHit, LessonIndex, agent_shown, lesson_key, open_embedder
from whet.world.conversations import success_lesson
from whet.world.tasks import CHAT_PROBE, World, load_profile

PROFILES = ("default.yaml", "commuter.yaml", "noisy.yaml")


Scorer = Callable[[np.ndarray, str], np.ndarray]  # (requests embedded [q, dim], lesson text) -> [q]


def shown_lessons(index: LessonIndex, agent: AgentConfig, lessons: list[str], score: Scorer,
                  requests: list[str]) -> list[list[int]]:
    """For each of ``requests``, the indexes of the ``lessons`` the agent's rule shows it, scored by ``score``."""
    queries = index.embedder.embed(requests)  # [q, dim]
    matrix = np.stack([score(queries, text) for text in lessons], axis=1)  # [q, lessons]
    out = []
    for row in matrix:
        nearest = np.argsort(-row, kind="stable")[: agent.lessons_k]
        hits = [LessonHit(int(i), "u", lessons[i], float(row[i])) for i in nearest]
        out.append([hit.lesson_id for hit in agent_shown(agent, hits)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, nargs="+",
                        default=[Path(__file__).parents[1] / "config" / "profiles" / name for name in PROFILES])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--interactions", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=24)
    args = parser.parse_args()
    agent = load_config().agent
    index = LessonIndex(open_embedder("auto"))
    probes = [last_user_text(turn.messages) for turn in load_pinned_turns(lesson_probes_path("bundled"))]
    ways: dict[str, Scorer] = {
        "by its request": lambda queries, text: queries @ index.embedder.embed([lesson_key(text)])[0],
        "and by it less what was copied": index.scores,
    }
    totals = {way: np.zeros(4, dtype=int) for way in ways}
    held_total = 0
    print(f"embedder {index.embedder.name}; agent: k {agent.lessons_k}, floor {agent.lessons_min_score}, "
          f"margin {agent.lessons_margin}")
    print(f"{'profile':8s} {'seed':>4s} {'lesson keys':32s} {'no lesson of its kind':>22s} {'another kind':>13s} "
          f"{'shown to chat':>14s} {'to general':>11s}")
    for path in args.profile:
        profile = load_profile(path)
        for seed in args.seeds:
            world = World(profile, seed)
            taught = [t for t in world.training_tasks(args.interactions) if t.personal]
            lessons = [success_lesson(t) for t in taught]
            heldout = world.heldout_tasks(args.heldout)
            general = [t.text for t in world.general_tasks(16)] + probes
            held_total += len(heldout)
            for way, score in ways.items():
                shown = partial(shown_lessons, index, agent, lessons, score)
                kinds = [[taught[i].intent for i in ids] for ids in shown([t.text for t in heldout])]
                counts = np.array([
                    sum(t.intent not in k for t, k in zip(heldout, kinds, strict=True)),
                    sum(any(i != t.intent for i in k) for t, k in zip(heldout, kinds, strict=True)),
                    sum(len(ids) for ids in shown(list(CHAT_PROBE))),
                    sum(len(ids) for ids in shown(general)),
                ])
                totals[way] += counts
                print(f"{profile.name:8s} {seed:4d} {way:32s} {f'{counts[0]}/{len(heldout)}':>22s} "
                      f"{f'{counts[1]}/{len(heldout)}':>13s} {counts[2]:14d} {counts[3]:11d}")
    for way, counts in totals.items():
        print(f"{'all':8s} {'':4s} {way:32s} {f'{counts[0]}/{held_total}':>22s} {f'{counts[1]}/{held_total}':>13s} "
              f"{counts[2]:14d} {counts[3]:11d}")


if __name__ == "__main__":
    main()
