"""Warm start of the default model: fine-tuning on the world's conversations
(:mod:`whet.world.conversations`); the training loop lands here.

The pieces it will use are here already: :func:`_tokenize` labels the assistant's spans of a
rendered conversation, :func:`_batches` groups rows of similar length, :func:`_pad` makes
tensors of a batch and :func:`_lr_factor` is the warm-up-then-cosine schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Progress = Callable[[str, int, int, dict], None]
"""``progress(stage, done, total, info)``: stage is "convert", "distill", "data" or "train";
info has the loss when training."""


def build_default_model(out_dir: Path, *, seed: int = 0, progress: Progress | None = None) -> Path:
    """Build the default model (``model.id: smollm2``) into ``out_dir``; returns it."""
    raise NotImplementedError("the warm start lands in the next commit")


def _lr_factor(step: int, warmup: int, total: int) -> float:
    import math

    if step < warmup:
        return (step + 1) / warmup
    done = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def _tokenize(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(ids, labels): labels are the ids inside assistant replies (``<|im_end|>`` included), else -100."""
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    spans, opener, at = [], "<|im_start|>assistant\n", 0
    while (start := text.find(opener, at)) >= 0:
        begin = start + len(opener)
        end = text.index("<|im_end|>", begin) + len("<|im_end|>")
        spans.append((begin, end))
        at = end
    ids, labels = encoded["input_ids"], []
    for token, (lo, hi) in zip(ids, encoded["offset_mapping"], strict=True):
        inside = any(b <= lo and hi <= e for b, e in spans)
        labels.append(token if inside else -100)
    return ids, labels


def _batches(rows: list[tuple[list[int], list[int]]], batch_size: int, seed: int) -> list[list]:
    """Batches of similar length (less padding), in a seeded random order."""
    import random

    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    chunk = batch_size * 16
    batches = []
    for i in range(0, len(order), chunk):
        group = sorted(order[i:i + chunk], key=lambda j: len(rows[j][0]))
        batches += [[rows[j] for j in group[k:k + batch_size]] for k in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


def _pad(batch, pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (tokens, targets) in enumerate(batch):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, : len(targets)] = torch.tensor(targets)
        mask[row, : len(tokens)] = 1
    return ids, labels, mask
