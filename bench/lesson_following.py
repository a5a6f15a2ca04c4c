"""Does the policy use what it is told? Held-out personal tasks, three ways.

For each held-out task of a profile the policy answers, greedily, through the
real prompt format, the bundled tool servers (in-process) and the world's
checker:

- ``nothing``: as a new user's first request (no lessons);
- ``lesson``: with the one lesson the learner would have written after the
  user corrected it on an earlier request of the same kind, in the system
  prompt (what the ``memory`` arm relies on);
- ``success``: with the lesson a thanked earlier request of the same kind leaves instead: its
  right call, written as a call ("calling now({"timezone": "Lisbon"}) was right.");
- ``hint``: with the same correction as a ``[hint]`` in the user's message
  (what the learner's teacher sees in hindsight distillation).

Each way also says how many answers called a tool at all: every held-out task needs one, so an
answer in words alone made its value up.

This isolates the policy from the rest of the loop (judge, retrieval, gate):
if ``lesson`` is not far above ``nothing``, lessons cannot help ``whet bench learn``.

And the other side of it, on general tasks (which need no preference), two ways:

- ``plain``: nothing in context;
- ``look-alike``: with the user's lessons that retrieval would bring beside it (the time at
  home beside "What time is it in Cairo?", the reminders list beside "Add X to my work
  list"): a policy that copies whatever a lesson says loses general skill here.

With ``--pinned``, also what the learner's lesson check sees: each of the user's personal lessons
(one per kind, a hint as the learner writes it) beside each of the gate's pinned general calls of the
same tool that the policy gets right alone (``config/regression.jsonl``); a pinned call lost with the
lesson is one that lesson breaks, and the check would hold the lesson back.

    python bench/lesson_following.py [--model DIR] [--profile FILE] [--tasks N] [--general N] [--seed S] [--pinned]

``--model`` defaults to the default model (``smollm2``) in the default data directory.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from whet.config.settings import AgentConfig, load_config
from whet.learner.gate import load_pinned_turns
from whet.learner.judge import correction_hint
from whet.learner.learner import regression_path
from whet.learner.lessons import lesson_text
from whet.learner.model import DEFAULT_MODEL, model_dir
from whet.learner.prompt import prompt_text, prompt_with_lessons, with_hint, with_lessons
from whet.runtime.chat_format import parse_tool_calls
from whet.world.conversations import NEIGHBOURS, BundledTools, success_lesson
from whet.world.tasks import PERSONAL, Profile, Task, ToolUse, World, load_profile, make_task

WAYS = ("nothing", "lesson", "success", "hint")
GENERAL_WAYS = ("plain", "look-alike")


class Policy:
    def __init__(self, folder: Path, tools: BundledTools) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.tools = tools
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _generate(self, messages: list[dict]) -> str:
        text = prompt_text(self.tokenizer, messages, self.tools.specs)
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=96, do_sample=False, eos_token_id=self.eos)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def solve(self, messages: list[dict]) -> tuple[list[ToolUse], str]:
        """One request as the agent runs it: at most one tool step, then the answer."""
        first = self._generate(messages)
        _, calls, _ = parse_tool_calls(first)
        if not calls:
            return [], first
        results = [{"role": "tool", "tool_call_id": c.id, "name": c.name,
                    "content": self.tools.call(ToolUse(c.name, c.arguments))} for c in calls]  # fmt: skip
        step = {"role": "assistant", "content": "", "tool_calls": [c.to_openai() for c in calls]}
        return [ToolUse(c.name, c.arguments) for c in calls], self._generate([*messages, step, *results])


def prompt(way: str, task: Task, earlier: Task) -> list[dict]:
    system = AgentConfig().system_prompt
    hint = correction_hint(task.correction or "")
    if way == "lesson":
        system = with_lessons(system, [lesson_text(earlier.text, hint=hint)])
    elif way == "success":
        system = with_lessons(system, [success_lesson(earlier)])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task.text}]
    return with_hint(messages, hint) if way == "hint" else messages


def lookalike_prompt(task: Task, profile: Profile, rng: random.Random) -> list[dict]:
    """``task`` with two of the user's personal lessons of the intents that read like it."""
    near = [i for i in NEIGHBOURS[task.intent] if i in PERSONAL] or list(PERSONAL)
    earlier = [make_task(rng.choice(near), rng, profile) for _ in range(2)]
    lessons = [lesson_text(e.text, hint=correction_hint(e.correction or "")) for e in earlier]
    system = with_lessons(AgentConfig().system_prompt, lessons)
    return [{"role": "system", "content": system}, {"role": "user", "content": task.text}]


def pinned_copies(policy: Policy, profile: Profile, rng: random.Random) -> tuple[int, int, list[str]]:
    """(broken, checked, what each broken one answered): the gate's pinned general calls the policy keeps
    alone, each beside each of ``profile``'s personal lessons that calls the same tool."""
    system = AgentConfig().system_prompt
    pinned = [t for t in load_pinned_turns(regression_path("bundled")) if t.action.calls]
    pinned = [t for t in pinned if t.action.kept(policy._generate(prompt_with_lessons(t.messages, [], system)))]
    broken, checked, seen = 0, 0, []
    for intent in PERSONAL:
        earlier = make_task(intent, rng, profile)
        lesson = lesson_text(earlier.text, hint=correction_hint(earlier.correction or ""))
        for turn in (t for t in pinned if t.action.calls[0][0] == earlier.call.name):
            checked += 1
            reply = policy._generate(prompt_with_lessons(turn.messages, [lesson], system))
            if not turn.action.kept(reply):
                broken += 1
                seen.append(f"{turn.messages[-1]['content']} -> {reply.strip()} (beside {lesson})")
    return broken, checked, seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the default model in the data dir)")
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--general", type=int, default=16, help="general tasks, plain and beside look-alike lessons")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pinned", action="store_true", help="also the gate's pinned calls beside personal lessons")
    args = parser.parse_args(argv)
    folder = args.model or model_dir(load_config().data_path, DEFAULT_MODEL)
    if not (folder / "config.json").is_file():
        print(f"no model in {folder}: run `whet model build` or pass --model", file=sys.stderr)
        return 2
    profile = load_profile(args.profile)
    world = World(profile, args.seed)
    tasks, general = world.heldout_tasks(args.tasks), world.general_tasks(args.general)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        tools = BundledTools(Path(scratch))
        try:
            policy = Policy(folder, tools)
            done, called = dict.fromkeys(WAYS, 0), dict.fromkeys(WAYS, 0)
            for task in tasks:
                # the earlier request the lesson came from: same intent (and person), another phrasing
                earlier = task if "person" in task.meta else make_task(task.intent, rng, profile)
                for way in WAYS:
                    calls, answer = policy.solve(prompt(way, task, earlier))
                    done[way] += task.check(calls, answer)
                    called[way] += bool(calls)  # every held-out task needs a tool: words alone are made up
            kept = dict.fromkeys(GENERAL_WAYS, 0)
            for task in general:
                for way, messages in (("plain", prompt("nothing", task, task)),
                                      ("look-alike", lookalike_prompt(task, profile, rng))):  # fmt: skip
                    calls, answer = policy.solve(messages)
                    kept[way] += task.check(calls, answer)
            pinned = pinned_copies(policy, profile, rng) if args.pinned else None
        finally:
            tools.close()
    print(f"model {folder}, profile {profile.name}, seed {args.seed}, {len(tasks)} held-out personal tasks")
    for way in WAYS:
        print(f"  {way:10s} {done[way]:3d}/{len(tasks)}  {done[way] / len(tasks):.2f}"
              f"   (called a tool: {called[way]}/{len(tasks)})")
    print(f"{len(general)} general tasks")
    for way in GENERAL_WAYS:
        print(f"  {way:10s} {kept[way]:3d}/{len(general)}  {kept[way] / max(1, len(general)):.2f}")
    if pinned is not None:
        broken, checked, seen = pinned
        print(f"pinned general calls broken by a personal lesson beside them: {broken}/{checked}")
        for line in seen:
            print("  " + line.replace("\n", " "))
    print("command: python bench/lesson_following.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
