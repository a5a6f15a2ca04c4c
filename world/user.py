"""A simulated user with hidden preferences, replying as a person would.

It sees only the assistant's answers (the text the API returned), never tool
calls or internals. Served right, it thanks or moves on; served wrong, it
corrects in a natural sentence that carries what it wanted ("No, I meant
Lisbon time."), or now and then simply asks again. Its choices come from its
own seeded generator, so the same seed and the same answers give the same
conversation.
"""

from __future__ import annotations

import random

from whet.world.tasks import CITIES, DISTANCE_UNITS, LISTS, TEMPERATURE_UNITS, Profile, Task

THANKS = ("Thanks!", "Great, thanks.", "Perfect, thank you.", "Thank you!", "That's right, thanks.")
MOVING_ON = ("Ok.", "Got it.", "Good to know.", "Alright.")
REASK = ("{text} Please answer the question.", "I asked: {text}", "{text}")
GENERAL_CORRECTION = ("That's wrong.", "No, that's not right.", "That's not what I asked.")


class SimulatedUser:
    def __init__(self, profile: Profile, seed: int = 0, interaction: int | None = None) -> None:
        self.profile, self.seed = profile, seed
        self.rng = random.Random(f"{seed}:user:{profile.name}" + ("" if interaction is None else f":{interaction}"))

    def interaction(self, n: int) -> SimulatedUser:
        """The user as they reply in interaction ``n``, with a generator of their own: what they draw there does
        not depend on how many draws the interactions before it took, or on whether those ran at the same time."""
        return SimulatedUser(self.profile, self.seed, n)

    def satisfied(self, task: Task, answer: str) -> bool:
        """Whether the answer, as the user reads it, does what they asked."""
        return not reads_as_failure(answer) and task.answer_ok(answer) and task.mentions_preference(answer)

    def reply(self, task: Task, answer: str) -> str:
        """The user's next message after ``answer`` to ``task``."""
        if self.profile.wrong_feedback_rate > 0 and self.rng.random() < self.profile.wrong_feedback_rate:
            return self.wrong_feedback(task)
        roll = self.rng.random()
        if self.satisfied(task, answer):
            return self.rng.choice(THANKS if roll < self.profile.thanks_rate else MOVING_ON)
        if roll < self.profile.requery_rate:
            return self.rng.choice(REASK).format(text=task.text)
        if task.correction:
            return task.correction
        return self.rng.choice(GENERAL_CORRECTION)

    def wrong_feedback(self, task: Task) -> str:
        """Feedback that ignores what was right: thanks, or a correction that names another value."""
        if self.rng.random() < 0.5:
            return self.rng.choice(THANKS)
        if not task.correction or not task.preference:
            return self.rng.choice(GENERAL_CORRECTION)
        pool = [v for v in _VALUES[task.intent] if v.casefold() != task.preference.casefold()]
        return task.correction.replace(task.preference, self.rng.choice(pool))


def reads_as_failure(answer: str) -> bool:
    """An answer that reports an error, or shows raw tool markup: a person does not take it as
    done, whatever city or time the error message happens to contain."""
    text = answer.casefold()
    return "error" in text or "<tool_" in text or "did not work" in text


# where a wrong correction takes its value from, by personal intent
_VALUES = {"time_home": CITIES, "time_person": CITIES, "distance": DISTANCE_UNITS,
           "temperature": TEMPERATURE_UNITS, "reminder": LISTS}  # fmt: skip
