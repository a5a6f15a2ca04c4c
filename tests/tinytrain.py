"""Test-only: teach a tiny model a few exact conversations, so the real engine acts deterministically.

A random tiny model never emits a well-formed tool call; one fine-tuned on the
exact prompts the server will render (same system prompt, same tool list,
same chat template) reproduces the scripted actions under greedy decoding.
That lets a test drive the real transformers path end to end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def memorize(model_dir: Path, out_dir: Path, conversations: list[tuple[list[dict], list[dict], dict]], *,
             steps: int = 300, lr: float = 3e-3, seed: int = 0) -> Path:
    """Fine-tune ``model_dir`` on (prompt messages, tools, assistant reply) triples; save to ``out_dir``.

    The loss covers only the reply's tokens (the template's rendering of the
    assistant message, through ``<|im_end|>``).
    """
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = [_example(tokenizer, *c) for c in conversations]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum(_loss(model, ids, start) for ids, start in examples) / len(examples)
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _example(tokenizer: Any, messages: list[dict], tools: list[dict], reply: dict) -> tuple[torch.Tensor, int]:
    prompt = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*messages, reply], tools=tools or None, tokenize=False)
    assert full.startswith(prompt), "the chat template must extend the prompt with the reply"
    reply_text = full[len(prompt):].rstrip("\n")  # ends with <|im_end|>
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(reply_text, add_special_tokens=False)["input_ids"]
    return torch.tensor(prompt_ids + reply_ids), len(prompt_ids)


def _loss(model: Any, ids: torch.Tensor, start: int) -> torch.Tensor:
    logits = model(ids[None]).logits[0, :-1]  # [T-1, V]
    targets = ids[1:].clone()  # [T-1]
    targets[: start - 1] = -100  # learn the reply only
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
