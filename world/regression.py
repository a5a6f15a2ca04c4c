"""The pinned regression set the promotion gate replays by default (``config/regression.jsonl``),
and the rehearsal set the learner trains beside each batch (``config/rehearsal.jsonl``).

General skill, as the model must keep it whatever one user teaches: the first action of
:data:`PINNED_CALLS` tasks of every general intent of the assistant world (the right tool call, with
the values the request names),
some answers read off a tool's result, and chat requests answered in words without a tool.
A candidate adapter under which these become less likely than under the live one is rejected,
so a user who teaches nonsense (or a flood of wrong feedback) cannot take the general skill
everyone relies on.

The rehearsal set is general skill of the same kinds, other items: a few of them join every
training step (``learner.rehearsal``), so that an adapter that learns one user's values keeps
calling tools for general requests and answering small talk in words. The two sets share no
request, so the gate's check stays a check of what training did not see.

The shipped files are this module's output (``python -m whet.world.regression > config/regression.jsonl``,
``python -m whet.world.regression --rehearsal > config/rehearsal.jsonl``, and the lesson check's optional probes,
``python -m whet.world.regression --probes > config/lesson_probes.jsonl``); a test checks that they agree. Each line is ``{"messages", "tools", "response"}`` in OpenAI shapes:
the response is the assistant's text as the chat template writes it (a Hermes ``<tool_call>``
block for a call).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from whet.config.settings import AgentConfig
from whet.world.conversations import BundledTools, answer_for, training_vocabulary
from whet.world.tasks import GENERAL, NATURAL, Vocabulary, load_profile, make_task

CHATS = (
    ("Hello!", "Hello! How can I help you today?"),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("Tell me a fun fact about giraffes.", "A giraffe's tongue can be about 50 centimetres long."),
    ("Can you suggest a name for a black cat?", "How about Shadow, Midnight or Pepper?"),
    # small talk and word meanings: what an adapter that learned one user's tools turns into a call first (run T:
    # jun's chat probe lost "How are you today?" and a phrase's meaning to tool calls the gate could not see)
    ("How's your day going?", "It's going well, thank you! How can I help you today?"),
    ("I'm feeling a bit tired today.", "Sorry to hear that. A short walk or a glass of water can help."),
    ("What does 'bon voyage' mean?", "\"Bon voyage\" is French for \"have a good trip\"."),
    ("What does the word 'serendipity' mean?", "Serendipity is finding something good by chance."),
    ("Do you like music?", "I don't listen to music myself, but I'm happy to talk about it!"),
    ("Give me an idea for a weekend hobby.", "You could try sketching: all you need is a pencil and paper."),
    # more of every kind (run AA: alex's first promoted lora step turned 3 of the chat probe's 12 requests into
    # tool calls and none of the 10 chats above): greetings, feelings, opinions, how-to, advice, meanings, facts,
    # writing; none is a warm-start chat. They add to the greedy check's time (run AB: 68-76 s a step, run AA 19-48 s),
    # which reads each chat's reply only to its first tokens (learner.gate.ANSWER_OPENING).
    ("Good evening! Long day?", "Good evening! I hope it went well. What can I do for you?"),
    ("How are things with you?", "All good here, thanks for asking! What can I do for you?"),
    ("What's your name?", "I'm whet, your personal assistant."),
    ("Are you a robot?", "I'm an AI assistant, here to help with whatever you need."),
    ("Do you have any hobbies?", "I don't have hobbies, but I love hearing about yours!"),
    ("I had a great day today!", "That's wonderful to hear! What made it so good?"),
    ("I'm nervous about my exam tomorrow.",
     "That's normal. Get a good night's sleep and trust what you've studied. Good luck!"),
    ("I have a free evening. What should I do?", "You could go for a walk, try a new recipe or start a puzzle."),
    ("What's your favourite animal?", "I don't have favourites, but owls are hard not to like."),
    ("Which season do you like best?", "I can't feel the weather, but many people love autumn for its colours."),
    ("How do I make a paper boat?", "Fold a sheet in half, fold the corners into a triangle, then open the bottom and fold it into a boat."),
    ("How do I fold a paper plane?",
     "Fold a sheet in half lengthwise, fold the top corners to the middle, then fold the wings down."),
    ("How can I stay focused while studying?", "Work in short blocks, put your phone away and take small breaks."),
    ("How can I save money on groceries?", "Plan your meals, shop with a list and buy store brands."),
    ("Any tips for a job interview?", "Research the company, prepare a few stories about your work and arrive early."),
    ("Recommend a board game for four people.", "Try Ticket to Ride: it is easy to learn and fun for four."),
    ("Suggest a song for a road trip.", "\"Life is a Highway\" is a classic road-trip song."),
    ("Can you help me choose a gift for my friend?",
     "Sure! A book, a plant or a nice mug are safe choices. What does your friend like?"),
    ("Give me a fun idea for a birthday party.", "A picnic in the park with a few games is easy and fun."),
    ("What does 'deja vu' mean?", "\"Deja vu\" is the feeling that you have lived a moment before."),
    ("What does the word 'ephemeral' mean?", "Ephemeral means lasting only a very short time."),
    ("How do I say thank you in Spanish?", "You say \"gracias\"."),
    ("Why do leaves change colour in autumn?", "Trees stop making green chlorophyll, so the yellow and red pigments show."),
    ("What's the largest planet in our solar system?", "Jupiter is the largest planet in our solar system."),
    ("Who invented the telephone?", "Alexander Graham Bell is credited with inventing the telephone."),
    ("What colour do you get by mixing blue and yellow?", "You get green."),
    ("What's the difference between weather and climate?",
     "Weather is what happens day to day; climate is the pattern over many years."),
    ("Which is healthier, tea or coffee?", "Both are fine in moderation; tea has less caffeine."),
    ("Tell me a riddle.", "What has keys but can't open locks? A piano."),
    ("Write a one-line poem about rain.", "Soft rain on the roof, the whole house breathing slowly."),
    ("Write the first line of a story about a dragon.", "The dragon woke to find its cave full of snow."),
)
PINNED_CALLS = 3  # general tasks per intent in the regression set: one "time in Lagos" is too few to see a
# user's home leak into the requests that name their own city
ANSWERS = len(GENERAL)  # general intents whose answer step is pinned (and rehearsed) too, the first of each:
# with only the first four (time, sums, units, todos), promoted steps broke the answers read off date results
# and nothing in the gate could see it (bench runs DT and DU: "It is a Saturday in San Francisco.")
# small talk, facts and writing for the rehearsal set: none is in CHATS or the bench's chat probe
REHEARSAL_CHATS = (
    ("Hi there!", "Hi! What can I do for you?"),
    ("Good evening.", "Good evening! How can I help?"),
    ("Thanks for your help earlier.", "You're welcome! Happy to help any time."),
    ("What is the capital of Australia?", "The capital of Australia is Canberra."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa."),
    ("How many days are in a leap year?", "A leap year has 366 days."),
    ("What is the boiling point of water at sea level?", "Water boils at 100 °C (212 °F) at sea level."),
    ("Tell me a fun fact about octopuses.", "An octopus has three hearts and blue blood."),
    ("Write a haiku about the sea.", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("Can you suggest a name for a goldfish?", "How about Bubbles, Goldie or Captain Fin?"),
    ("Give me a tip for sleeping better.", "Keep a regular bedtime and put screens away an hour before sleep."),
    ("Explain photosynthesis in one sentence.",
     "Plants use sunlight to turn water and carbon dioxide into sugar and oxygen."),
    ("What should I read next?", "If you like stories, try \"The Little Prince\"; it is short and lovely."),
    ("Tell me a joke.", "Why did the scarecrow win an award? Because he was outstanding in his field."),
    ("What's a good way to start the day?", "A glass of water, a few minutes of stretching and a short plan for the day."),
    ("Why do cats purr?", "Cats purr when they are content, and sometimes to soothe themselves."),
    ("Good night!", "Good night! Sleep well."),
    ("Nice to meet you.", "Nice to meet you too! What can I do for you?"),
    ("What can you do?", "I can check the time anywhere, do sums, convert units, work with dates and keep your notes."),
    ("Who wrote Pride and Prejudice?", "Jane Austen wrote Pride and Prejudice."),
    ("What is the biggest ocean?", "The Pacific is the biggest ocean."),
    ("Write a short poem about the stars.", "Small lights in the dark,\nold fires far beyond our reach,\nthey still find our eyes."),
    ("How do I boil an egg?", "Put it in boiling water for about 7 minutes, then cool it in cold water."),
    ("Give me a word that rhymes with moon.", "Spoon."),
)
REHEARSAL_CALLS = 24  # general tasks per intent in the rehearsal set, over the warm start's wide vocabulary: a
# step draws a third of its items from the tools its batch called, and six per intent over the users' vocabulary
# (six cities) let an adapter keep those six calls and still write one user's home into every other city (run O)
# of those, the first this many have their answer step too: answers read off every tool's result, a share of
# each step's draw (learner.learner.rehearsal_draw); with one per intent, promoted steps that learned a user's
# clock answers still broke the answers read off date results (bench run DX: "It is a Saturday in August 2026.")
REHEARSAL_ANSWERS = 3 * len(GENERAL)
PROBE_CALLS = 12  # general calls per intent in the lesson probes: the check asks only the few nearest each lesson


def records(seed: int = 0) -> Iterator[dict[str, Any]]:
    """The regression set's records, deterministic per seed; a request drawn twice is pinned once."""
    yield from _distinct(_records(random.Random(f"regression:{seed}"), PINNED_CALLS, CHATS, NATURAL))


def rehearsal_records(seed: int = 0) -> Iterator[dict[str, Any]]:
    """The rehearsal set's records, deterministic per seed: :data:`REHEARSAL_CALLS` general tasks
    per intent over the warm start's wide vocabulary (the first :data:`REHEARSAL_ANSWERS` tasks with their
    answer step too) and :data:`REHEARSAL_CHATS`. A request that is also in the regression set is
    left out."""
    pinned = {asked(r) for r in records(seed)}
    vocab = training_vocabulary(pinned_zones=True)
    made = _records(random.Random(f"rehearsal:{seed}"), REHEARSAL_CALLS, REHEARSAL_CHATS, vocab, REHEARSAL_ANSWERS)
    yield from _distinct(made, pinned)


def probe_records(seed: int = 0) -> Iterator[dict[str, Any]]:
    """The lesson probes' records, deterministic per seed: :data:`PROBE_CALLS` general calls per intent over
    the warm start's wide vocabulary (no answer steps, no chats), none of them a request of the regression
    or the rehearsal set. The lesson check can ask the ones nearest a new lesson beside the pinned turns
    (``learner.gate.lesson_probes_asked``, off by default): the pinned set has three calls per intent, too
    few to hold a look-alike of every lesson (bench run CC: "Convert 25 miles to km." answered in feet
    beside a lesson about "How much is 10 km?", with no distance conversion pinned)."""
    seen = {asked(r) for r in records(seed)} | {asked(r) for r in rehearsal_records(seed)}
    vocab = training_vocabulary(pinned_zones=True)
    yield from _distinct(_records(random.Random(f"probes:{seed}"), PROBE_CALLS, (), vocab, answers=0), seen)


def asked(record: dict[str, Any]) -> str:
    """What a record asks (its messages), as a key: the two sets share none."""
    return json.dumps(record["messages"], sort_keys=True)


def _distinct(records: Iterator[dict[str, Any]], seen: set[str] | None = None) -> Iterator[dict[str, Any]]:
    """``records`` without those whose messages are in ``seen`` or came before."""
    seen = set() if seen is None else set(seen)
    for record in records:
        if (key := asked(record)) not in seen:
            seen.add(key)
            yield record


def _records(rng: random.Random, per_intent: int, chats: tuple[tuple[str, str], ...],
             vocab: Vocabulary, answers: int = ANSWERS) -> Iterator[dict[str, Any]]:
    system = AgentConfig().system_prompt
    profile = load_profile()  # general tasks need no preference: any profile makes the same ones
    with tempfile.TemporaryDirectory(prefix="whet-regression-") as folder:
        tools = BundledTools(Path(folder))
        try:
            for i, intent in enumerate(GENERAL * per_intent):
                task = make_task(intent, rng, profile, vocab=vocab)
                messages = [{"role": "system", "content": system}, {"role": "user", "content": task.text}]
                arguments = json.dumps(dict(task.call.arguments), ensure_ascii=False)
                call_text = f'<tool_call>\n{{"name": "{task.call.name}", "arguments": {arguments}}}\n</tool_call>'
                yield {"messages": messages, "tools": tools.specs, "response": call_text}
                if i < answers:
                    result = tools.call(task.call)
                    call = {"id": f"call_{i}", "type": "function",
                            "function": {"name": task.call.name, "arguments": arguments}}  # fmt: skip
                    followed = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": call["id"], "name": task.call.name, "content": result}]
                    yield {"messages": followed, "tools": tools.specs, "response": answer_for(task, task.call, result)}
            for request, answer in chats:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": request}]
                yield {"messages": messages, "tools": tools.specs, "response": answer}
        finally:
            tools.close()


def line(record: dict[str, Any]) -> str:
    """One record as a line of the shipped files. Keys stay as the servers declare them: the prompt lists
    a tool's parameters in this order, and a model writes a call's arguments in the order its prompt
    lists them (key-sorted, add_note's ``kind`` came before the ``text`` it depends on, and rehearsing
    on such prompts taught calls without ``list_name``)."""
    return json.dumps(record, ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    made = rehearsal_records() if "--rehearsal" in args else probe_records() if "--probes" in args else records()
    for record in made:
        sys.stdout.write(line(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
