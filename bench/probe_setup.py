"""What the offline probes of the weights arm (`lora_probe.py`, `weights_drift.py`) share: a profile's bench
requests, and the prompt the agent serves them with (the system prompt and the bundled tools, no lessons)."""

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from whet.config.settings import AgentConfig
from whet.learner.prompt import prompt_text
from whet.runtime.chat_format import parse_tool_calls
from whet.world.conversations import BundledTools
from whet.world.tasks import Profile, Task, ToolUse, World, calls_match, load_profile

# --targets: the projections a probe's LoRA trains
TARGETS = {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "mlp": ["gate_proj", "up_proj", "down_proj"]}  # fmt: skip


@dataclass
class Probe:
    tokenizer: Any
    profile: Profile
    train: list[Task]
    heldout: list[Task]
    general: list[Task]
    tools: list[dict[str, Any]]
    system: str

    @classmethod
    def of(cls, tokenizer: Any, profile: str | None, n: int, heldout: int, general: int = 0) -> "Probe":
        """The profile's (``None``: the default) first ``n`` training requests, held-out and general ones, seed 0."""
        world = World(load_profile(profile), 0)
        return cls(tokenizer, world.profile, world.training_tasks(n), world.heldout_tasks(heldout),
                   world.general_tasks(general), BundledTools(Path(tempfile.mkdtemp())).specs,
                   AgentConfig().system_prompt)  # fmt: skip

    def messages(self, text: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": text}]

    def prompt_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(prompt_text(self.tokenizer, self.messages(text), self.tools), add_special_tokens=False)


def first_call_right(task: Task, reply: str) -> bool:
    """Whether a decoded reply calls what ``task`` wants (its call's arguments as the bench compares them)."""
    _, calls, _ = parse_tool_calls(reply)
    return any(calls_match(task.call, ToolUse(c.name, c.arguments if isinstance(c.arguments, dict) else {}))
               for c in calls)  # fmt: skip
