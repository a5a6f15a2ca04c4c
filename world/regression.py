"""The pinned regression set the promotion gate replays by default (``config/regression.jsonl``).

General skill, as the model must keep it whatever one user teaches: the first action of every
general intent of the assistant world (the right tool call, with the values the request names),
some answers read off a tool's result, and chat requests answered in words without a tool.
A candidate adapter under which these become less likely than under the live one is rejected,
so a user who teaches nonsense (or a flood of wrong feedback) cannot take the general skill
everyone relies on.

The shipped file is this module's output (``python -m whet.world.regression > config/regression.jsonl``);
a test checks that they agree. Each line is ``{"messages", "tools", "response"}`` in OpenAI shapes:
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
from whet.world.conversations import BundledTools, answer_for
from whet.world.tasks import GENERAL, NATURAL, load_profile, make_task

CHATS = (
    ("Hello!", "Hello! How can I help you today?"),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("Tell me a fun fact about giraffes.", "A giraffe's tongue can be about 50 centimetres long."),
    ("Can you suggest a name for a black cat?", "How about Shadow, Midnight or Pepper?"),
)
ANSWERS = 4  # general intents whose answer step is pinned too (the first ones of GENERAL)


def records(seed: int = 0) -> Iterator[dict[str, Any]]:
    """The regression set's records, deterministic per seed."""
    rng = random.Random(f"regression:{seed}")
    system = AgentConfig().system_prompt
    profile = load_profile()  # general tasks need no preference: any profile makes the same ones
    with tempfile.TemporaryDirectory(prefix="whet-regression-") as folder:
        tools = BundledTools(Path(folder))
        try:
            for i, intent in enumerate(GENERAL):
                task = make_task(intent, rng, profile, vocab=NATURAL)
                messages = [{"role": "system", "content": system}, {"role": "user", "content": task.text}]
                arguments = json.dumps(dict(task.call.arguments), ensure_ascii=False)
                call_text = f'<tool_call>\n{{"name": "{task.call.name}", "arguments": {arguments}}}\n</tool_call>'
                yield {"messages": messages, "tools": tools.specs, "response": call_text}
                if i < ANSWERS:
                    result = tools.call(task.call)
                    call = {"id": f"call_{i}", "type": "function",
                            "function": {"name": task.call.name, "arguments": arguments}}  # fmt: skip
                    followed = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": call["id"], "name": task.call.name, "content": result}]
                    yield {"messages": followed, "tools": tools.specs, "response": answer_for(task, task.call, result)}
            for request, answer in CHATS:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": request}]
                yield {"messages": messages, "tools": tools.specs, "response": answer}
        finally:
            tools.close()


def main() -> int:
    for record in records():
        sys.stdout.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
