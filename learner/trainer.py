"""The LoRA trainer: one optimizer step per batch of judged turns, on the serving base model.

Synchronous torch code, meant to run in a worker thread (or its own process):
the async learner hands it a batch and awaits the result, so the event loop never
waits on a step.

Log-probs are recomputed from the token ids the engine recorded, never from
re-tokenized text; the importance ratio is taken against the engine's own
behaviour log-probs. The teacher of hindsight distillation is the same policy,
evaluated before the update on the recorded prompt with the hint added
(:func:`whet.learner.prompt.hinted_prompt_ids`).

The trainable adapter is peft's ``default`` so that ``save_pretrained`` writes an
ordinary adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
that the runtime loads under its version name. The optimizer state is saved beside
it (``optimizer.pt``, which peft ignores), so a lineage resumes exactly.
"""

from __future__ import annotations

import copy
import ctypes
import inspect
import json
import os
import platform
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from whet.config.settings import LoraConfig
from whet.learner.model import (
    cache_of,
    cuda_has_bfloat16,
    load_causal_lm,
    pick_device,
    quiet_peft,
    stop_token_ids,
    with_cache,
)
from whet.learner.objective import Objective, TokenBatch, blamed_tokens
from whet.learner.prompt import split_tool_calls

ADAPTER_WEIGHTS = "adapter_model.safetensors"
CONTRASTS = 3  # other actions each teacher action is raised above, at most (:meth:`LoraTrainer._contrasts`)
DECODE_BATCH = 8  # replies greedy decoding writes together (:meth:`LoraTrainer._decode`)
OPENINGS_BATCH = 16  # anchored prompts whose reply's first token one forward pass reads (:class:`_Openings`)
OPTIMIZER_STATE = "optimizer.pt"
REPLY_BATCH = 4  # replies one training forward pass reads against their prompts' stacked keys and values (:meth:`LoraTrainer._reply_batches`)


@dataclass(frozen=True)
class Sample:
    """One judged model action, as the engine produced it."""

    turn_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]  # one per response id, recorded at serving time
    score: int  # -1, 0, +1
    teacher_prompt_ids: list[int] | None = None  # the prompt with the hint added; None = no hint

    def __post_init__(self) -> None:
        if not self.response_ids or len(self.response_ids) != len(self.behaviour_logprobs):
            raise ValueError(f"turn {self.turn_id}: needs response token ids and one behaviour log-prob per id")


@dataclass(frozen=True)
class Anchor:
    """Small talk (``prompts``) whose log-probability of opening its reply with ``token`` (a tool call's first
    token) a step may not raise, and requests answered with a call (``calls``) whose log-probability of it a
    step may not lower: every pass adds ``weight`` times the mean rise of the one and the mean fall of the
    other, each from where the step found it."""

    prompts: Sequence[Sequence[int]]
    token: int
    weight: float
    calls: Sequence[Sequence[int]] = ()


@dataclass
class _Openings:
    """A batch of a step's anchored prompts, whose reply's first token every pass reads (:meth:`LoraTrainer._anchor`):
    with ``cache``, all of them in one forward pass, their keys and values (each prompt but its last token, read
    once a step) stacked, each prompt's left-padded to the longest (``mask`` 0 on the padding), and their last
    tokens run against them at their own positions; without, one prompt (:meth:`LoraTrainer._opening`).

    One at a time, a prompt's opening was a one-token forward and backward pass through every layer, nearly all of
    it per-call overhead, and a step read 48 chats and the drawn calls five times (its start and four passes): on one
    core of a Zen 3 EPYC, SmolLM2, 71 s a step one at a time, 27 s in batches (6 s of it stacking; 3 s since
    the stack is padded by pad_sequence), the same openings to 4e-5 nats; a whole step of F's setting 360 s against 318 s (``bench/step_batching.py --part openings``;
    bench/results/RUNS.md, stop 72)."""

    prompts: list[Sequence[int]]
    cache: Any = None  # the stacked keys and values, [B, heads, L, dim] a layer
    mask: torch.Tensor | None = None  # [B, L + 1]
    length: int = 0  # L


@dataclass
class _Decoding:
    """A reply greedy decoding goes on writing (:meth:`LoraTrainer._decode`): ``out`` so far, the keys and values
    of its prompt and of all of ``out`` but the last token, ``length`` tokens in all, and its ``limit``."""

    out: list[int]
    cache: Any
    limit: int
    length: int


class LoraTrainer:
    """A peft LoRA adapter on a causal LM, with its optimizer."""

    def __init__(self, model: Any, tokenizer: Any, lora: LoraConfig, objective: Objective) -> None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model, get_peft_model_state_dict

        self.tokenizer = tokenizer
        self.lora = lora
        self.objective = objective
        depth = model.config.num_hidden_layers
        # logits of the positions a pass needs only: a prompt's (hundreds x the vocabulary, float32) were
        # most of a step's memory and a fifth of its prefill; older model classes lack the argument
        self._keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        top = None if lora.layers is None else list(range(max(0, depth - lora.layers), depth))
        peft_config = PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            layers_to_transform=top,  # the layers below run without gradients: a cheaper backward
            task_type="CAUSAL_LM",
        )
        with quiet_peft():
            self.model = get_peft_model(model, peft_config)
        self.device = next(self.model.parameters()).device
        self.bf16 = use_bfloat16(lora.precision, self.device)
        self._cast: dict[torch.nn.Linear, torch.nn.Parameter] | None = None  # see :meth:`_autocast`
        self._casting = False
        # LoRA starts as the identity (B = 0): this copy is "the base weights" for reset(None)
        self._initial = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}
        self.optimizer = self._new_optimizer()
        self._step_caches: dict[tuple[int, ...], Any] = {}  # prompt keys and values a step reuses
        # with lora.train_prompt, inside a step: the prefix its prompts share and its keys and values
        self._step_prefix: tuple[tuple[int, ...], Any] | None = None
        # inside a step with ``rehearsal_kl``: each rehearsal item's next-token distributions under the base model
        self._base_dists: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        self._base_weight = 0.0
        self.model.eval()

    @classmethod
    def load(cls, source: str, lora: LoraConfig, objective: Objective, *, device: str = "auto",
             dtype: str = "auto") -> LoraTrainer:  # fmt: skip
        """Load the base model (HF id or folder, as the runtime does) and wrap it."""
        tokenizer, model = load_causal_lm(source, pick_device(device), dtype)
        return cls(model, tokenizer, lora, objective)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[self.lora.optimizer]
        return kind(params, lr=self.lora.learning_rate, weight_decay=self.lora.weight_decay)

    # -- state ----------------------------------------------------------------

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The adapter's weights (peft state-dict names), detached copies."""
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def reset(self, adapter_dir: Path | None) -> None:
        """Continue from a saved version (weights and optimizer state), or from the base weights."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if adapter_dir is None:
            weights = self._initial
        else:
            weights = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS), device=str(self.device))
        with quiet_peft():
            set_peft_model_state_dict(self.model, weights)
        self.optimizer = self._new_optimizer()
        saved = Path(adapter_dir) / OPTIMIZER_STATE if adapter_dir is not None else None
        if saved is not None and saved.is_file():
            state = torch.load(saved, map_location=self.device, weights_only=True)
            # a version another optimizer made (learner.lora.optimizer changed): this one starts afresh
            if set(state["param_groups"][0]) == set(self.optimizer.state_dict()["param_groups"][0]):
                self.optimizer.load_state_dict(state)
                if not self.lora.carry_momentum:
                    self.forget_momentum()

    def forget_momentum(self) -> None:
        """Zero AdamW's first moment (the running mean of the gradients), keeping its second (each weight's
        scale): the next update follows its own gradient, not the direction the updates before it went."""
        for kept in self.optimizer.state.values():
            if "exp_avg" in kept:
                kept["exp_avg"].zero_()

    def save(self, out_dir: Path) -> None:
        """Write the adapter (peft safetensors format) and the optimizer state into ``out_dir``."""
        out_dir = Path(out_dir)
        with quiet_peft():
            self.model.save_pretrained(str(out_dir), safe_serialization=True)
        torch.save(self.optimizer.state_dict(), out_dir / OPTIMIZER_STATE)

    # -- log-probs ------------------------------------------------------------

    def response_distributions(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
        """log p(. | prompt, response_<t) under the current adapter, [T, V]; grad follows torch's mode.

        The prompt runs first without gradients and only its keys and values are kept: the loss
        reaches the adapter through the response tokens alone. The prompt is context, not an
        action, and its backward pass (hundreds of tokens against tens) was most of a step's cost.
        Inside :meth:`step` the prompts' keys and values come from :meth:`_prompt_caches`, or, with
        ``lora.train_prompt``, only their shared prefix's do (:meth:`_through_prompt`).
        """
        prompt, response = list(prompt_ids), list(response_ids)
        if self._step_prefix is not None:
            return self._through_prompt(prompt, response)
        cache = None
        with self._autocast():
            if len(prompt) > 1:
                kept = self._step_caches.get(tuple(prompt[:-1]))
                if kept is not None:
                    cache = copy.deepcopy(kept)  # a forward pass appends to the cache it is given
                else:
                    with torch.no_grad():
                        cache = cache_of(self.model(torch.tensor([prompt[:-1]], device=self.device), use_cache=True,
                                                    **self._keep(1)))  # fmt: skip
            tail = torch.tensor([[prompt[-1], *response[:-1]]], device=self.device)  # [1, T]: token i predicts i+1
            logits = self.model(tail, **with_cache(cache), use_cache=cache is not None).logits[0]  # [T, V]
        return torch.log_softmax(logits.float(), dim=-1)  # [T, V]

    def _through_prompt(self, prompt: list[int], response: list[int]) -> torch.Tensor:
        """:meth:`response_distributions` with ``lora.train_prompt``: only the prefix the step's prompts share
        (the system prompt and the tool list, kept in :meth:`_reusing_prompts`) runs without gradients; the
        prompt's own rest (the conversation) runs with the response, so the loss also reaches the adapter through
        the request's tokens: what the request says (home, a person's name, a unit) can be learnt where the
        request says it, not only where the reply is written. Without a shared prefix the whole prompt runs."""
        shared, kept = self._step_prefix or ((), None)
        start, cache = len(shared), copy.deepcopy(kept) if kept is not None else None
        if tuple(prompt[:start]) != shared or len(prompt) <= start:
            start, cache = 0, None  # a prompt without the step's shared prefix: read whole
        with self._autocast():
            ids = torch.tensor([prompt[start:] + response[:-1]], device=self.device)  # [1, L]: token i predicts i+1
            logits = self.model(ids, **with_cache(cache), use_cache=cache is not None,
                                **self._keep(len(response))).logits[0, -len(response):]  # [T, V]
        return torch.log_softmax(logits.float(), dim=-1)  # [T, V]

    def _prompt_caches(self, prompts: Sequence[Sequence[int]]) -> dict[tuple[int, ...], Any]:
        """Keys and values of each prompt (all but its last token), without gradients, under the
        adapter as it is now: the prefix all prompts share (the system prompt and the tool list)
        runs once, then each prompt's own rest.

        A step reuses them in every pass over its batch and for every response scored against the
        same prompt, so the prompts are read once a step rather than once a pass and a response:
        prefill was most of a multi-pass step. In passes after the first, the prompt's keys and
        values are the step's starting adapter's, not the updated one's; the loss reaches the
        adapter through the response tokens alone either way (see :meth:`response_distributions`).
        """
        keys = list(dict.fromkeys(tuple(p[:-1]) for p in prompts if len(p) > 1))
        if not keys:
            return {}
        with torch.no_grad(), self._autocast():
            return dict(zip(keys, self._each_cache(keys), strict=True))

    def _each_cache(self, keys: Sequence[tuple[int, ...]]) -> Iterator[Any]:
        """The keys and values of each token sequence in ``keys`` in turn (None for an empty one): the prefix
        they all share runs once, then each one's own rest. One at a time, so a caller that needs only one
        alive holds only one. Call it without gradients."""
        start, shared = self._shared_prefix(keys)
        for key in keys:
            cache = copy.deepcopy(shared) if shared is not None else None
            rest = key[start:]
            if rest:
                cache = cache_of(self.model(torch.tensor([rest], device=self.device), **with_cache(cache),
                                            use_cache=True, **self._keep(1)))  # fmt: skip
            yield cache

    @contextmanager
    def _reusing_prompts(self, prompts: Sequence[Sequence[int]]) -> Iterator[None]:
        if self.lora.train_prompt:  # only the shared prefix is kept; each prompt's rest runs with gradients
            keys = [tuple(p[:-1]) for p in prompts if len(p) > 1]
            with torch.no_grad(), self._autocast():
                start, shared = self._shared_prefix(keys)
            self._step_prefix = (keys[0][:start] if start else (), shared)
        else:
            self._step_caches = self._prompt_caches(prompts)
        try:
            yield
        finally:
            self._step_caches = {}
            self._step_prefix = None

    def response_logprobs(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
        """log p(response_t | prompt, response_<t) under the current adapter, [T]; grad follows torch's mode."""
        return _pick(self.response_distributions(prompt_ids, response_ids), response_ids)  # [T]

    def _reply_batches(self, items: Sequence[tuple[Sequence[int], Sequence[int]]]
                       ) -> Iterator[list[tuple[int, torch.Tensor]]]:  # fmt: skip
        """:meth:`response_distributions` of each (prompt, response) of ``items``, :data:`REPLY_BATCH` at a time,
        each batch as (an item's index in ``items``, its [T, V]); grad follows torch's mode, and a caller that
        backpropagates a batch before asking for the next holds one batch's graph at a time.

        Inside a step, where each prompt's keys and values are kept (:meth:`_prompt_caches`), the items are taken
        shortest reply first, and a batch's prompts' keys and values are stacked, each left-padded to the longest
        (:func:`_stacked_cache`), and its replies, right-padded to the longest, run in one forward pass at their
        own positions: the padding is masked on the left, and a reply's tokens never see the padding on its
        right, which comes after them. Elsewhere (no kept caches, ``lora.train_prompt``, a model whose cache is
        not of plain layers) one item at a time, in order.

        Why: one at a time, a pass is a few tens of tokens through every layer and the vocabulary, and a step
        reads each sample, teacher action and rehearsal item once a pass. 16 rehearsal items' forward and backward
        passes on one core of a Zen 4 EPYC (SmolLM2, bfloat16): 8.2 s one at a time, 6.4 s four a batch taken
        shortest first, 7.9 s eight a batch; taken in their own order, eight a batch padded 600 tokens to 880 and
        gained nothing (bench/results/RUNS.md, stop 76)."""
        if self._step_prefix is not None or not self._step_caches or len(items) < 2:
            order, size = list(range(len(items))), 1
        else:
            order, size = sorted(range(len(items)), key=lambda i: len(items[i][1])), REPLY_BATCH
        for first in range(0, len(order), size):
            chunk = order[first:first + size]
            caches = [self._step_caches.get(tuple(items[i][0][:-1])) if len(items[i][0]) > 1 else None for i in chunk]
            if len(chunk) < 2 or any(c is None or not _stackable(c) for c in caches):
                yield [(i, self.response_distributions(*items[i])) for i in chunk]
                continue
            lengths = [len(items[i][0]) - 1 for i in chunk]
            rows = [[items[i][0][-1], *items[i][1][:-1]] for i in chunk]  # token t predicts t + 1
            width = max(len(row) for row in rows)
            past = _padding_mask(lengths, self.device)  # [B, L]: the stacked prompts' left padding
            ahead = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows], device=self.device)
            ids = torch.tensor([row + [0] * (width - len(row)) for row in rows], device=self.device)  # [B, W]
            positions = torch.tensor([[n + t for t in range(width)] for n in lengths], device=self.device)
            with self._autocast():
                logits = self.model(ids, **with_cache(_stacked_cache(caches)), use_cache=True,
                                    attention_mask=torch.cat([past, ahead], dim=1), position_ids=positions).logits
            logp = torch.log_softmax(logits.float(), dim=-1)  # [B, W, V]
            yield [(i, logp[j, :len(row)]) for j, (i, row) in enumerate(zip(chunk, rows, strict=True))]

    def _replies(self, items: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        """Each item's [T, V] of :meth:`_reply_batches`, in order, each its own tensor. Call it without gradients."""
        read: dict[int, torch.Tensor] = {}
        for batch in self._reply_batches(items):
            read.update((i, d.clone()) for i, d in batch)
        return [read[i] for i in range(len(items))]

    def teacher_action(self, teacher_prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """The action the policy as it is now takes, greedy, from the hinted prompt: its token ids,
        the end-of-turn token included when it stopped on one (as the engine records them)."""
        return self.greedy_actions([teacher_prompt_ids], [max_new_tokens])[0]

    def greedy_actions(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                       guesses: Sequence[Sequence[int] | None] | None = None,
                       tick: Callable[[], None] | None = None) -> list[list[int]]:  # fmt: skip
        """:meth:`teacher_action` of each prompt, at most ``max_new_tokens[i]`` tokens for the i-th;
        the prefix the prompts share (system prompt and tool list) is read once for all of them.

        ``guesses``: a reply each prompt is likely to get (another adapter's greedy reply, the pinned
        one). One forward pass reads a guess whole and keeps the part the model would have decoded
        itself; decoding goes on, one token at a time, only from where the model leaves it. The
        result is the greedy reply all the same, at the cost of one pass where the guess holds.

        The replies that go on are decoded :data:`DECODE_BATCH` together (:meth:`_decode`), a batch as soon as
        that many are waiting, so that no more prompts' keys and values are held at once: the rehearsal set's
        self-distillation took 68.5 s that way against 180.8 s one reply at a time, the same replies (one core
        of a Zen 4 EPYC, SmolLM2, ``bench/decode_batching.py``). ``tick``: called as each reply is done.

        Decoding runs in the weights' own dtype, the one they serve in, never under ``lora.precision``'s
        bfloat16 autocast: the gate's pinned check asks what the served model would write, and a pinned
        turn near a tie goes the other way under autocast. On a CPU with bfloat16 matmuls a warm-started
        model served in float32 answered "Note that seat 14C on the train." in words, and under autocast
        called ``add_note``: every candidate of two runs was rejected for "losing" that turn."""
        stops = stop_token_ids(self.tokenizer, self.model)
        guesses = guesses if guesses is not None else [None] * len(prompts)
        actions: list[list[int]] = []
        going: list[_Decoding] = []  # replies that go on past their first token
        with torch.no_grad():
            start, shared = self._shared_prefix([tuple(p[:-1]) for p in prompts])
            for prompt, limit, guess in zip(prompts, max_new_tokens, guesses, strict=True):
                cache = copy.deepcopy(shared) if shared is not None else None  # decoding appends to it
                rest = list(prompt[start:])  # the prompt's own rest
                guess = _until_stop(list(guess or [])[:limit], stops)
                step = self.model(torch.tensor([rest + guess], device=self.device), **with_cache(cache),
                                  use_cache=True, **self._keep(len(guess) + 1))  # fmt: skip
                cache = cache_of(step)
                picks = step.logits[0, -(len(guess) + 1):].float().argmax(-1).tolist()
                held = next((j for j, token in enumerate(guess) if picks[j] != token), len(guess))
                if held == len(guess) and guess and (guess[-1] in stops or len(guess) >= limit):
                    out = guess  # the guess held to its end
                else:
                    out = [*guess[:held], picks[held]]
                    if held < len(guess):
                        cache.crop(held - len(guess))  # forget the guess from where it went wrong
                actions.append(out)
                if out[-1] in stops or len(out) >= limit:
                    if tick is not None:
                        tick()
                    continue
                going.append(_Decoding(out, cache, limit, len(prompt) + len(out) - 1))
                if len(going) == DECODE_BATCH or not _stackable(cache):  # at most a batch's caches held
                    self._decode(going, stops, tick)
                    going = []
            if going:
                self._decode(going, stops, tick)
        return actions

    def _decode(self, batch: Sequence[_Decoding], stops: set[int], tick: Callable[[], None] | None = None) -> None:
        """Greedy decoding of ``batch``'s replies in lockstep, one token each a forward pass, until each stops
        or reaches its limit (its ``out`` grows in place). Their keys and values are stacked, each left-padded
        to the longest and masked there, and each token runs at its own reply's position; a reply that is done
        leaves the batch (``tick`` called for it). One reply a pass is memory-bound on a CPU: SmolLM2 decoded 14 tokens/s for one
        sequence and 66/s summed over 8 (issue #9)."""
        live = list(batch)
        if len(live) == 1:  # nothing to pad: no mask, the positions follow the cache
            cache, mask = live[0].cache, None
        else:
            cache = _stacked_cache([d.cache for d in live])
            mask = _padding_mask([d.length for d in live], self.device)
        for d in batch:
            d.cache = None  # the stack holds them now
        while live:
            ids = torch.tensor([[d.out[-1]] for d in live], device=self.device)  # [B, 1]
            padded: dict[str, torch.Tensor] = {}
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
                padded = {"attention_mask": mask,
                          "position_ids": torch.tensor([[d.length] for d in live], device=self.device)}  # fmt: skip
            step = self.model(ids, **with_cache(cache), use_cache=True, **padded, **self._keep(1))
            cache = cache_of(step)
            for d, token in zip(live, step.logits[:, -1].float().argmax(-1).tolist(), strict=True):
                d.out.append(token)
                d.length += 1
            kept = [j for j, d in enumerate(live) if d.out[-1] not in stops and len(d.out) < d.limit]
            for _ in range(len(live) - len(kept) if tick is not None else 0):
                tick()
            if kept and len(kept) < len(live):
                cache.batch_select_indices(torch.tensor(kept, device=self.device))
                mask = mask[kept] if mask is not None else None
            live = [live[j] for j in kept]

    def reply_gaps(self, prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]]) -> list[list[float]]:
        """For each reply read after its prompt, how much likelier each of its tokens is than the best other
        there, in nats (above 0 everywhere: greedy decoding writes that reply; near 0 somewhere: a near tie,
        which the noise of any step may tip). In the weights' own dtype, as :meth:`greedy_actions` decodes."""
        read = [(p, r) for p, r in zip(prompts, replies, strict=True) if r]
        found = []
        for logp, (_, reply) in zip(self._reply_logps(read, served_dtype=True), read, strict=True):  # [T, V] each
            others = logp.scatter(1, torch.tensor(reply, device=self.device)[:, None], float("-inf"))
            found.append((_pick(logp, reply) - others.max(-1).values).tolist())
        gaps = iter(found)
        return [next(gaps) if reply else [] for reply in replies]

    def opening_odds(self, prompts: Sequence[Sequence[int]], token: int) -> list[float]:
        """For each prompt, how much likelier ``token`` is than any other as the reply's first token, in
        nats (log-probability of ``token`` minus the best other's): above 0, greedy decoding opens with it.
        The prompts' shared prefix is read once (:meth:`_each_cache`), each prompt's keys and values
        dropped before the next's."""
        odds = []
        with torch.no_grad(), self._autocast():
            for prompt, cache in zip(prompts, self._each_cache([tuple(p[:-1]) for p in prompts]), strict=True):
                step = self.model(torch.tensor([list(prompt[-1:])], device=self.device), **with_cache(cache),
                                  use_cache=cache is not None, **self._keep(1))  # fmt: skip
                logp = torch.log_softmax(step.logits[0, -1].float(), -1)
                best_other = torch.cat([logp[:token], logp[token + 1:]]).max()
                odds.append(float(logp[token] - best_other))
        return odds

    def mean_logprob(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """The average per-token log-prob of a response: the promotion gate's replay measure."""
        return self.mean_logprobs([(prompt_ids, response_ids)])[0]

    def mean_logprobs(self, items: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[float]:
        """:meth:`mean_logprob` of each (prompt, response), exactly under the adapter as it is now;
        the prefix the prompts share is read once for all of them."""
        return [float(_pick(logp, response).mean()) for logp, (_, response)
                in zip(self._reply_logps(items), items, strict=True)]  # fmt: skip

    def _reply_logps(self, items: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                     served_dtype: bool = False) -> Iterator[torch.Tensor]:  # fmt: skip
        """Log-probabilities over the vocabulary at each response token of each (prompt, response), [T, V],
        without gradients, one item at a time; the prefix the prompts share is read once for all of them.
        Under ``lora.precision``'s autocast, or in the weights' own dtype (``served_dtype``)."""
        with torch.no_grad(), nullcontext() if served_dtype else self._autocast():
            start, shared = self._shared_prefix([tuple(p[:-1]) for p, _ in items])
            for prompt, response in items:
                tokens = [*prompt, *response]
                cache = copy.deepcopy(shared) if shared is not None else None
                ids = torch.tensor([tokens[start:-1]], device=self.device)  # [1, L]: token i predicts i+1
                logits = self.model(ids, **with_cache(cache), use_cache=cache is not None,
                                    **self._keep(len(response))).logits[0, -len(response):]  # fmt: skip
                yield torch.log_softmax(logits.float(), dim=-1)

    def _shared_prefix(self, keys: Sequence[tuple[int, ...]]) -> tuple[int, Any]:
        """(length, keys and values) of the prefix that all of several prompts share (the system prompt
        and the tool list), run once under the adapter as it is now; (0, None) for one prompt or none
        shared. Call it without gradients."""
        common = os.path.commonprefix(list(keys)) if len(keys) > 1 else ()
        if not common:
            return 0, None
        return len(common), cache_of(self.model(torch.tensor([common], device=self.device), use_cache=True,
                                                **self._keep(1)))  # fmt: skip

    def _keep(self, n: int) -> dict[str, int]:
        return {"logits_to_keep": n} if self._keeps else {}

    @contextmanager
    def _autocast(self) -> Iterator[None]:
        """bfloat16 matmuls over float32 weights where the hardware has them (``lora.precision``).

        Autocast casts a weight to bfloat16 at every call, and keeps the cast only for weights that train:
        the frozen base model's were cast whole at every forward pass, which a pass over a few tokens (a
        reply against its prompt's keys and values, the anchor's one-token openings) pays in full: a profile
        of a weights arm's step put 63 of its passes' 159 s in the anchor's openings, and a one-token pass
        against a 501-token cache took 525-602 ms cast at every call, 367-402 ms cast once. So the frozen
        linear layers' weights are cast once, kept (half the model's float32 size again), and swapped in for
        the passes under autocast: the same bfloat16 values the cast gave, so the same results.
        Outside it (greedy decoding, :meth:`reply_gaps`) the float32 weights serve as before."""
        if not self.bf16 or self._casting:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                yield
            return
        if self._cast is None:
            self._cast = {module: torch.nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
                          for module in self.model.modules()
                          if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad
                          and module.weight.dtype == torch.float32}  # fmt: skip
        kept = {module: module.weight for module in self._cast}
        self._casting = True
        try:
            for module, weight in self._cast.items():
                module.weight = weight  # a tied output layer gets its own: the embedding keeps float32
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                yield
        finally:
            for module, weight in kept.items():
                module.weight = weight
            self._casting = False

    # -- the step ---------------------------------------------------------------

    def step(self, samples: Sequence[Sample], baseline: float,
             rehearsal: Sequence[tuple[Sequence[int], Sequence[int]]] = (), rehearsal_weight: float = 1.0,
             rehearsal_first: float = 0.0, anchor: Anchor | None = None,
             rehearsal_kl: float = 0.0, tick: Callable[[], None] | None = None) -> dict[str, float]:  # fmt: skip
        """One training step on ``samples``: ``lora.epochs`` optimizer passes over them (the
        teacher's side, computed once before the first); returns the objective's statistics of
        the last pass, with the first pass's loss as ``loss_first``.

        ``rehearsal``: (prompt ids, response ids) of general skill learnt beside the samples in
        every pass, ``rehearsal_weight`` times their token-mean negative log-likelihood: what a
        batch of one user's requests teaches, it teaches beside what everyone needs kept;
        ``rehearsal_first`` times their first tokens' mean negative log-likelihood besides (the token
        that decides between a tool call and an answer, see :meth:`_rehearse`).

        ``anchor``: small talk whose log-probability of opening with a tool call every pass holds at or below
        where the step found it, and calls whose log-probability of it every pass holds at or above
        (:class:`Anchor`, :meth:`_anchor`).

        ``rehearsal_kl``: every pass also adds this times the ``rehearsal`` items' token-mean KL divergence
        from the base model's (adapter off) next-token distributions to the adapter's, along their replies
        (:meth:`_rehearse`): the whole distribution held where the base model has it, not only the likelihood
        of one reply's tokens.

        ``tick``: called after each optimizer pass (progress, for whoever waits on a slow step)."""
        if not samples:
            raise ValueError("a training step needs at least one sample")
        with self._holding(rehearsal if rehearsal_kl > 0 else (), rehearsal_kl):
            return self._step(samples, baseline, rehearsal, rehearsal_weight, rehearsal_first, anchor, tick)

    def _step(self, samples: Sequence[Sample], baseline: float, rehearsal: Sequence[tuple[Sequence[int], Sequence[int]]],
              rehearsal_weight: float, rehearsal_first: float, anchor: Anchor | None,
              tick: Callable[[], None] | None) -> dict[str, float]:  # fmt: skip
        full = getattr(self.objective, "needs_distributions", False)
        teacher, actions, reference = self._teacher_side(samples)
        contrasts = self._contrasts(actions) if actions is not None and self._contrast_weight > 0 else []
        anchor = anchor if anchor is not None and anchor.weight > 0 and (anchor.prompts or anchor.calls) else None
        held = [*anchor.prompts, *anchor.calls] if anchor else []
        first: float | None = None
        trained = [s.prompt_ids for s in samples] + [p for p, _ in rehearsal]
        with self._reusing_prompts(trained + held):
            openings, token = self._openings(held, trained), anchor.token if anchor else 0  # none without an anchor
            with torch.no_grad():  # each chat's log-probability of opening with a call, as the step found it
                start = [float(x) for batch in openings for x in self._read_openings(batch)[:, token]]
            for _ in range(self.lora.epochs):
                stats = self._pass(samples, baseline, teacher, actions, reference, full, rehearsal, rehearsal_weight,
                                   rehearsal_first, (anchor, openings, start) if anchor else None, contrasts)  # fmt: skip
                first = stats["loss"] if first is None else first
                if tick is not None:
                    tick()
        stats["loss_first"] = float(first if first is not None else 0.0)
        stats["samples"] = float(len(samples))
        return stats

    def _teacher_side(self, samples: Sequence[Sample]) -> tuple[list[torch.Tensor | None], list[list[int] | None] | None,
                                                               list[torch.Tensor] | None]:  # fmt: skip
        """What a step's passes learn towards, from the policy as it is before the step: the hinted
        teacher's distributions (hindsight token or distribution) or its actions (hindsight action),
        and the base model's log-probs when the objective has a KL term."""
        acts = getattr(self.objective, "needs_teacher_actions", False)
        with torch.no_grad():
            teacher = [
                self.response_distributions(s.teacher_prompt_ids, s.response_ids)
                if s.teacher_prompt_ids and not acts
                else None
                for s in samples
            ]
            actions = self._new_actions(samples) if acts else None
            reference = None
            if getattr(self.objective, "kl_weight", 0.0) > 0:
                with self.model.disable_adapter():
                    reference = [self.response_logprobs(s.prompt_ids, s.response_ids) for s in samples]
        return teacher, actions, reference

    def _pass(self, samples: Sequence[Sample], baseline: float, teacher: list[torch.Tensor | None],
              actions: list[list[int] | None] | None, reference: list[torch.Tensor] | None, full: bool,
              rehearsal: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
              rehearsal_weight: float = 1.0, rehearsal_first: float = 0.0,
              anchor: tuple[Anchor, list[_Openings], list[float]] | None = None,
              contrasts: Sequence[tuple[int, list[tuple[int, int]]]] = ()) -> dict[str, float]:  # fmt: skip
        """One optimizer step on ``samples`` against the teacher's side computed by :meth:`step`: the objective
        (:meth:`_objective`, with the teacher actions' ``contrasts``), the anchor, rehearsal. The importance
        ratio stays against the behaviour log-probs, so the clip bounds how far all of a step's passes together
        move the policy on the RL part."""
        self.model.train()
        try:
            self.optimizer.zero_grad(set_to_none=True)
            stats = self._objective(samples, baseline, teacher, actions, reference, full, contrasts)
            if anchor is not None:
                stats.update(self._anchor(*anchor))
            return self._apply(stats, rehearsal, rehearsal_weight, rehearsal_first)
        finally:
            self.model.eval()

    def _objective(self, samples: Sequence[Sample], baseline: float, teacher: list[torch.Tensor | None],
                   actions: list[list[int] | None] | None, reference: list[torch.Tensor] | None, full: bool,
                   contrasts: Sequence[tuple[int, list[tuple[int, int]]]]) -> dict[str, float]:  # fmt: skip
        """Adds the objective's gradient to the adapter's, and the contrast's (:meth:`_contrast_loss`); returns
        the objective's statistics over the whole batch, and the contrast's.

        The objective reads the whole batch at once (its token means run over every sample), but a graph per
        sample and teacher action, all alive at once, took ~250 MB each on SmolLM2 (the response against its
        prompt's keys and values, and its [T, V] distributions): a weights arm's server reached 11 GB in a step
        of 8 samples and 16 rehearsal items. Every term of every objective is one token's, over denominators
        that count tokens, not their values (:meth:`Objective.reads`), so a row's gradient is the same whatever
        the other rows hold. So each row the objective reads, a sample's reply or a teacher action, is read
        once, :data:`REPLY_BATCH` at a time inside a step (:meth:`_reply_batches`): the objective is taken with
        that batch's rows live and every other row as it stands (read, or not yet: zeros), and with the contrasts
        of the batch's actions, which the same read gives, backpropagated and freed before the next batch is
        read. The statistics are then the objective's over every row as read. A row the objective does not read
        (a score of 0 without a hint) is not read at all.

        Why: until stop 77 every row was read once without gradients for the objective, then again to carry the
        gradient the objective left on it into the adapter, and each contrasted teacher action a third time for
        its contrast (bench/results/RUNS.md, stop 77)."""
        taught = actions or [None] * len(samples)
        logp = [torch.zeros(len(s.response_ids), device=self.device) for s in samples]  # [T] each, as read
        dists = [torch.zeros((), device=self.device).expand(len(s.response_ids), self._vocabulary())
                 for s in samples] if full else None  # fmt: skip
        learnt = [torch.zeros(len(a) if a else 1, device=self.device) for a in taught]  # [A] each, as read
        fixed = self._token_batch(samples, baseline, teacher, actions, reference, logp, dists,
                                  None if actions is None else learnt)  # fmt: skip

        def taken(logp: list[torch.Tensor], dists: list[torch.Tensor] | None, learnt: list[torch.Tensor]) -> TokenBatch:
            return replace(fixed, logp=pad_sequence(logp, batch_first=True),
                           student_dist=None if dists is None else pad_sequence(dists, batch_first=True),
                           action_logp=None if actions is None else pad_sequence(learnt, batch_first=True))

        rows, acted = self.objective.reads(fixed)
        others = dict(contrasts)
        where = [(False, i) for i in range(len(samples)) if bool(rows[i])]  # (a teacher action?, its sample)
        where += [(True, i) for i, a in enumerate(taught) if a and (bool(acted[i]) or i in others)]
        read = [(samples[i].prompt_ids, taught[i] if act else samples[i].response_ids) for act, i in where]
        pairs, contrast = sum(len(o) for o in others.values()), 0.0
        for batch in self._reply_batches(read):
            live_logp, live_dists, live_learnt = list(logp), None if dists is None else list(dists), list(learnt)
            margins = torch.zeros((), device=self.device)
            for j, d in batch:  # [T, V]; kept detached as read, for the statistics and the batches after this one
                act, i = where[j]
                picked = _pick(d, read[j][1])
                if act:
                    live_learnt[i], learnt[i] = picked, picked.detach()
                    margins = margins + self._contrast_loss(d, read[j][1], others.get(i, ()))
                else:
                    live_logp[i], logp[i] = picked, picked.detach()
                    if dists is not None and live_dists is not None:
                        live_dists[i], dists[i] = d, d.detach()
            loss, _ = self.objective.loss(taken(live_logp, live_dists, live_learnt))
            if pairs:
                loss = loss + self._contrast_weight * margins / pairs
                contrast += float(margins.detach())
            if loss.requires_grad:
                loss.backward()
        with torch.no_grad():
            _, stats = self.objective.loss(taken(logp, dists, learnt))
        if pairs:
            stats.update({"contrast_loss": contrast / pairs, "contrast_pairs": float(pairs)})
        return stats

    def repair(self, chats: Sequence[tuple[Sequence[int], Sequence[int]]],
               rehearsal: Sequence[tuple[Sequence[int], Sequence[int]]] = (), rehearsal_weight: float = 1.0,
               rehearsal_first: float = 0.0) -> dict[str, float]:  # fmt: skip
        """One more optimizer pass after :meth:`step`, on rehearsal alone: ``chats`` (small talk the step
        brought near a tool call, each with the reply the model gave it before) on their token mean and
        their first tokens at full weight, beside the step's ``rehearsal`` weighed as :meth:`step` weighs
        it. The samples are not in it: what the step taught moves only as far as these chats pull it.

        The prompts are read as a step reads them (:meth:`_reusing_prompts`): the prefix they share once a pass,
        not once an item (each read its whole prompt, system prompt and tool list included, before)."""
        self.model.train()
        try:
            self.optimizer.zero_grad(set_to_none=True)
            with self._reusing_prompts([p for p, _ in [*chats, *rehearsal]]):
                stats = {"repair_loss": self._rehearse(chats, 1.0, 1.0)[0]}
                return self._apply(stats, rehearsal, rehearsal_weight, rehearsal_first)
        finally:
            self.model.eval()

    def _apply(self, stats: dict[str, float], rehearsal: Sequence[tuple[Sequence[int], Sequence[int]]],
               rehearsal_weight: float, rehearsal_first: float) -> dict[str, float]:  # fmt: skip
        """A pass's end: ``rehearsal``'s gradient added (:meth:`_rehearse`), then the optimizer step on the
        gradients gathered, clipped to ``lora.max_grad_norm``; ``stats`` with the rehearsal loss and the norm."""
        if rehearsal and (rehearsal_weight > 0 or rehearsal_first > 0 or self._base_dists):
            stats["rehearsal_loss"], kl = self._rehearse(rehearsal, rehearsal_weight, rehearsal_first)
            if self._base_dists:
                stats["rehearsal_kl"] = kl
        params = [p for p in self.model.parameters() if p.requires_grad]
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, self.lora.max_grad_norm))
        self.optimizer.step()
        return stats

    def _token_batch(self, samples: Sequence[Sample], baseline: float, teacher: list[torch.Tensor | None],
                     actions: list[list[int] | None] | None, reference: list[torch.Tensor] | None,
                     logp: list[torch.Tensor], dists: list[torch.Tensor] | None,
                     learnt: list[torch.Tensor] | None) -> TokenBatch:  # fmt: skip
        """The objective's input: ``logp``, each sample's [T] log-probs of its reply under the policy as it is
        now, and ``dists`` its [T, V] distributions where the objective needs them (None: it does not);
        ``learnt``, each teacher action's [A] log-probs under it (a zero for none)."""
        full = dists is not None
        batch = TokenBatch(
            logp=pad_sequence(list(logp), batch_first=True),  # [B, T]
            old_logp=_padded([s.behaviour_logprobs for s in samples], self.device),  # [B, T]
            mask=_padded([[1.0] * len(s.response_ids) for s in samples], self.device),  # [B, T]
            scores=torch.tensor([float(s.score) for s in samples], device=self.device),  # [B]
            teacher_logp=pad_sequence([_pick(d, s.response_ids) if d is not None
                                       else torch.zeros(len(s.response_ids), device=self.device)
                                       for d, s in zip(teacher, samples, strict=True)], batch_first=True),  # [B, T]
            has_hint=torch.tensor([s.teacher_prompt_ids is not None for s in samples], device=self.device),
            ref_logp=pad_sequence(reference, batch_first=True) if reference is not None else None,
            baseline=baseline,
            student_dist=pad_sequence(list(dists), batch_first=True) if dists is not None else None,  # [B, T, V]
            teacher_dist=pad_sequence([d if d is not None
                                       else torch.zeros(len(s.response_ids), self._vocabulary(), device=self.device)
                                       for d, s in zip(teacher, samples, strict=True)],
                                      batch_first=True) if full else None,  # [B, T, V]
        )
        if actions is not None and learnt is not None:
            batch.action_logp = pad_sequence(list(learnt), batch_first=True)  # [B, A]
            batch.action_mask = _padded([[1.0] * len(a) if a else [0.0] for a in actions], self.device)  # [B, A]
            unhinted = getattr(self.objective, "blame_unhinted", True)
            batch.rl_mask = _padded([blamed_tokens(s.response_ids, a, unhinted) if s.score < 0
                                     else [1.0] * len(s.response_ids)
                                     for s, a in zip(samples, actions, strict=True)], self.device)  # [B, T]
        return batch

    def _vocabulary(self) -> int:
        """How many tokens a distribution of the model's spans (its output layer's rows)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    def _rehearse(self, items: Sequence[tuple[Sequence[int], Sequence[int]]], weight: float,
                  first: float = 0.0) -> tuple[float, float]:  # fmt: skip
        """Adds to the gradients ``weight`` times the gradient of the items' token-mean negative
        log-likelihood, a batch of items at a time (:meth:`_reply_batches`), and ``first`` times the gradient
        of their first tokens' mean negative log-likelihood; inside a step that holds them (:meth:`_holding`), also the held weight times
        the gradient of the held items' token-mean KL(base || adapter) along their replies. Returns the two
        means (the second 0 where none is held: outside a step, as for :meth:`repair`'s chats).

        A reply's first token decides whether it is a tool call (``<tool_call>``) or an answer, and
        that decision is what a batch of one user's calls moves on small talk ("Good evening! Long
        day?" answered with ``add_note``); in the token mean, a chat reply's first token is one of
        some forty.

        Rehearsal's likelihood holds the reply's own tokens; the gate's pinned set is other requests of the
        same kinds, whose replies a step moves through the rest of the distribution. The divergence holds all
        of it, and is 0, with no gradient, where the adapter still agrees with the base model.

        The means over all the items' tokens are sums of one term per item, so each batch's graph is
        built, backpropagated and freed before the next: one batch's activations (its responses
        against their prompts' keys and values, and their [T, V] distributions) are alive at a time, not
        every item's at once beside the samples'. The gradient is the same. Both terms read the item's one
        forward pass: with a pass of its own for the divergence, run DN's weights steps trained for 264 s on
        average; with one, run DP's for 178 s at the same setting (bench/results/RUNS.md, stops 59-60; the
        batches differ)."""
        tokens = sum(len(response) for _, response in items)
        bases = [self._base_dists.get((tuple(p), tuple(r))) for p, r in items]
        held = sum(len(r) for (_, r), base in zip(items, bases, strict=True) if base is not None)
        total = divergence = 0.0
        for batch in self._reply_batches(items):
            loss = torch.zeros((), device=self.device)
            for i, dists in batch:  # [T, V]
                response, base = items[i][1], bases[i]
                logp = _pick(dists, response)  # [T]
                loss = loss - weight * logp.sum() / tokens - first * logp[0] / len(items)
                if base is not None:
                    kl = (base.exp() * (base - dists)).sum()  # []
                    loss = loss + self._base_weight * kl / held
                    divergence += float(kl.detach())
                total -= float(logp.detach().sum())
            loss.backward()
        return total / tokens, divergence / held if held else 0.0

    @contextmanager
    def _holding(self, items: Sequence[tuple[Sequence[int], Sequence[int]]], weight: float) -> Iterator[None]:
        """Inside: :meth:`_rehearse` holds ``items`` to the base model's distributions, read here once with the
        adapter off (the lineage's start, which the gate's likelihood bound measures from). The prompts' shared
        prefix (the system prompt and the tool list) is read once, under the base model too. The distributions
        are kept for the step ([T, V] float32 an item: ~8 MB for a 40-token reply of SmolLM2's 49,152-token
        vocabulary)."""
        if items:
            with torch.no_grad(), self.model.disable_adapter(), self._reusing_prompts([p for p, _ in items]):
                read = self._replies(items)
            self._base_dists = {(tuple(p), tuple(r)): d for (p, r), d in zip(items, read, strict=True)}
            self._base_weight = weight
        try:
            yield
        finally:
            self._base_dists, self._base_weight = {}, 0.0

    def _opening(self, prompt: Sequence[int]) -> torch.Tensor:
        """log p(. | prompt): the distribution of the reply's first token, [V]; grad follows torch's mode."""
        return self.response_distributions(prompt, [0])[0]  # [V]: the one response token is not read

    def _openings(self, prompts: Sequence[Sequence[int]], trained: Sequence[Sequence[int]]) -> list[_Openings]:
        """``prompts`` in batches of :data:`OPENINGS_BATCH` (:class:`_Openings`), their keys and values stacked
        from the step's (:meth:`_reusing_prompts`); the cache of a prompt no ``trained`` one shares is dropped
        from the step's once stacked. Without gradients. One prompt a batch where the step keeps no caches
        (``lora.train_prompt``: each prompt's own rest runs with gradients) or its model's cache is not of
        plain layers (:func:`_stackable`)."""
        caches = [self._step_caches.get(tuple(p[:-1])) for p in prompts]
        if not prompts or not all(_stackable(c) for c in caches if c is not None) or any(
                c is None and len(p) > 1 for p, c in zip(prompts, caches, strict=True)):  # fmt: skip
            return [_Openings([p]) for p in prompts]
        batches = []
        with torch.no_grad():
            for start in range(0, len(prompts), OPENINGS_BATCH):
                chunk, kept = prompts[start:start + OPENINGS_BATCH], caches[start:start + OPENINGS_BATCH]
                mask = _padding_mask([len(p) for p in chunk], self.device)  # the stacked prompts and their last tokens
                batches.append(_Openings(list(chunk), _stacked_cache(kept), mask, mask.shape[1] - 1))
        needed = {tuple(p[:-1]) for p in trained}
        for p in prompts:
            if tuple(p[:-1]) not in needed:
                self._step_caches.pop(tuple(p[:-1]), None)
        return batches

    def _read_openings(self, batch: _Openings) -> torch.Tensor:
        """log p(. | prompt) of each of ``batch``'s prompts, [B, V]; grad follows torch's mode."""
        if batch.mask is None:
            return self._opening(batch.prompts[0])[None]
        ids = torch.tensor([[p[-1]] for p in batch.prompts], device=self.device)  # [B, 1]
        positions = torch.tensor([[len(p) - 1] for p in batch.prompts], device=self.device)  # [B, 1]
        with self._autocast():
            logits = self.model(ids, **with_cache(batch.cache), use_cache=batch.cache is not None,
                                attention_mask=batch.mask, position_ids=positions).logits[:, -1]  # [B, V]
        if batch.cache is not None:  # the pass appended the last tokens' keys and values: take them off again
            for layer in batch.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, :batch.length].detach(), layer.values[:, :, :batch.length].detach()
        return torch.log_softmax(logits.float(), dim=-1)

    def _anchor(self, anchor: Anchor, openings: Sequence[_Openings], start: Sequence[float]) -> dict[str, float]:
        """Adds to the gradients ``anchor.weight`` times the gradient of the mean over ``anchor.prompts`` of how
        far each one's log-probability of opening with ``anchor.token`` rose above its ``start`` (0 where it did
        not rise), and of the mean over ``anchor.calls`` of how far it fell below (0 where it did not fall), one
        batch of ``openings`` (:class:`_Openings`, the prompts in order, small talk first) and its graph at a time.
        Returns each group's mean change, rises and falls alike: ``anchor_rise`` for the small talk,
        ``anchor_calls`` for the calls (where there are any).

        A step that teaches one user's calls moves every short chat towards opening with a call by about the
        same odds (stop 37 measured +1 to +1.5 nats on most of 216 chats), which the gate sees only when a chat
        near the boundary crosses it. A divergence of the whole opening distribution barely sees that: the call
        token holds a few percent of it (a KL anchor held at 0.0004 nats while the chats' odds rose 0.5). This
        holds the call token's own log-probability, where a rise costs in proportion however unlikely it is.

        The calls hold the other way: with small talk held, steps at a higher learning rate moved requests to
        answers in words ("What is 39 times 68?" -> "39 times 68 is 246."), the shape of the answers written
        from tool results that the batches rewarded."""
        talk, calls = len(anchor.prompts), len(anchor.calls)  # ``openings`` hold the small talk, then the calls
        signs = torch.tensor([1.0] * talk + [-1.0] * calls, device=self.device)
        scale = torch.tensor([anchor.weight / max(talk, 1)] * talk + [anchor.weight / max(calls, 1)] * calls,
                             device=self.device)  # each group's mean
        befores, changes, done = torch.tensor(list(start), device=self.device), [], 0
        for batch in openings:  # one batch's graph at a time
            n = len(batch.prompts)
            change = self._read_openings(batch)[:, anchor.token] - befores[done:done + n]  # [B]
            sign = signs[done:done + n]
            pulled = (sign * change.detach() > 0).float()  # a chat nearer a call, or a call further from it
            if bool(pulled.any()):
                (scale[done:done + n] * sign * change * pulled).sum().backward()
            changes.append(change.detach())
            done += n
        moved = torch.cat(changes)  # an anchor holds at least one prompt
        stats = {"anchor_rise": float(moved[:talk].mean())} if talk else {}
        if calls:
            stats["anchor_calls"] = float(moved[talk:].mean())
        return stats

    @property
    def _contrast_weight(self) -> float:
        return float(getattr(self.objective, "contrast_weight", 0.0))

    def _contrasts(self, actions: Sequence[list[int] | None]) -> list[tuple[int, list[tuple[int, int]]]]:
        """For each teacher action that is one tool call, the step's other teacher actions that call the same
        tool with other arguments (up to :data:`CONTRASTS`, the first of each distinct call), each as (the
        position where the two first differ, the other's token there): what its request must not be answered
        with. Pairs of (sample index, those)."""
        calls: list[tuple[str, str] | None] = []
        for action in actions:
            _, parsed, errors = split_tool_calls(self.tokenizer.decode(action)) if action else ("", [], [])
            one = len(parsed) == 1 and not errors
            calls.append((parsed[0][0], json.dumps(parsed[0][1], sort_keys=True)) if one else None)
        pairs = []
        for i, (action, call) in enumerate(zip(actions, calls, strict=True)):
            if action is None or call is None:
                continue
            others: dict[str, tuple[int, int]] = {}
            for other, other_call in zip(actions, calls, strict=True):
                if other is None or other_call is None or other_call[0] != call[0] or other_call == call:
                    continue
                at = len(os.path.commonprefix([action, other]))
                if at < min(len(action), len(other)):  # else one is the other cut short: nothing to choose between
                    others.setdefault(other_call[1], (at, other[at]))
            if others:
                pairs.append((i, list(others.values())[:CONTRASTS]))
        return pairs

    def _contrast_loss(self, logp: torch.Tensor, action: Sequence[int], others: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The sum, over ``others`` (the pairs :meth:`_contrasts` gives a teacher action), of ``softplus(-margin)``:
        ``margin`` the log-probability of the teacher ``action``'s token where the two first differ, minus the
        other's token there, from ``logp`` [A, V], the action read on its sample's own prompt (no hint). The two
        share what comes before that token, so one forward pass of the teacher action reads both, and it is
        where greedy decoding chooses between them. :meth:`_objective` adds the objective's ``contrast_weight``
        times the mean over every pair of the step.

        Why: a step that teaches "back home" -> Lisbon and "where Mum is" -> Sydney, on each action's likelihood
        alone, moves both cities up for every request of the tool (the shared direction is the larger): after a
        promoted weights step on alex, "back home", "Sam's place" and "where Mum is" all read Lisbon -3.57 to
        -3.62 and Sydney -1.86 to -2.08 nats (bench/results/RUNS.md, stop 67). The margin cancels that shared
        direction: on the "home" prompt Lisbon goes up against Sydney, on the "Mum" prompt Sydney against
        Lisbon, and it stops pulling once a request prefers its own value by a few nats."""
        loss = torch.zeros((), device=logp.device)
        for at, token in others:
            loss = loss + torch.nn.functional.softplus(logp[at, token] - logp[at, action[at]])
        return loss

    def _new_actions(self, samples: Sequence[Sample]) -> list[list[int] | None]:
        """The hinted teacher's action for each of ``samples``, or None: no hint, or the teacher would do
        what the student did (then the hint taught nothing to copy). Decoded together (:meth:`greedy_actions`)."""
        hinted = [s for s in samples if s.teacher_prompt_ids]
        written = iter(self.greedy_actions([s.teacher_prompt_ids for s in hinted],
                                           [max(2 * len(s.response_ids), 64) for s in hinted]))  # fmt: skip
        actions = [next(written) if s.teacher_prompt_ids else None for s in samples]
        return [a if a is not None and a != list(s.response_ids) else None for a, s in zip(actions, samples, strict=True)]


def training_threads(configured: int | None) -> int:
    """How many CPU threads a training step uses: ``configured``, else half the usable cores (at least 1)."""
    if configured is not None:
        return configured
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, usable // 2)


@contextmanager
def limited_threads(n: int) -> Iterator[None]:
    """Run the block with at most ``n`` torch intra-op threads in the calling thread.

    torch keeps the count per thread (OpenMP's setting is per thread; a thread reads the global
    value once, when it first runs torch code): the serving engine's thread, already running,
    keeps its own count while a step runs here, and the count is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def release_memory() -> None:
    """Give the memory a step freed back to the operating system (glibc's ``malloc_trim``; a no-op
    elsewhere). A step's autograd graph holds ~0.3 GB a sample on SmolLM2; freed, glibc keeps it in
    the arena of the thread that ran the step, and steps run on whichever worker thread is free: a
    served run reached 23 GB and was killed for memory after eight steps. Trimmed, the process went
    back to 1.3 GB after each step."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


def use_bfloat16(precision: str, device: torch.device) -> bool:
    """Whether training computes in bfloat16 (autocast over float32 weights): ``auto`` = on CUDA devices
    with bfloat16 tensor cores (not V100/T4, which emulate it), and on CPUs with native bfloat16 matmuls
    (AVX512-BF16 / AMX), where it is about twice as fast."""
    if precision != "auto":
        return precision == "bfloat16"
    if device.type == "cuda":
        return cuda_has_bfloat16(device)
    return device.type == "cpu" and bool(torch.backends.mkldnn.is_available()) and _cpu_has_bf16()


def _cpu_has_bf16() -> bool:
    """Native bfloat16 matmuls on this CPU. oneDNN also says yes on x86 CPUs with plain AVX-512 (BW),
    where it emulates them: measured 3x slower than float32 (an AVX-512 Xeon without AVX512-BF16, a
    1024x1024 matmul on one thread: 19 against 56 GFLOP/s), so on x86 it takes AVX512-BF16 or AMX."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return True  # not x86: oneDNN's answer stands
    native = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(bool(check()) for check in native if check is not None)


def cpu_name() -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) ..."; read from /proc/cpuinfo on Linux),
    else what :mod:`platform` knows ("x86_64" at least). Timings name it: whether it has native
    bfloat16 changes training speed twofold (:func:`use_bfloat16`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _stackable(cache: Any) -> bool:
    """Whether ``cache`` holds plain keys and values a layer (transformers' dynamic layers: no sliding window,
    no quantized or offloaded layer), which :meth:`LoraTrainer._openings` can stack along the batch."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


def _stacked_cache(caches: Sequence[Any]) -> Any:
    """One cache of ``caches``' keys and values along the batch, each left-padded with zeros to the longest (None
    for a prompt of one token: all padding); None when every one is None."""
    some = next((c for c in caches if c is not None), None)
    if some is None:
        return None

    def padded(name: str, i: int) -> torch.Tensor:  # [B, heads, length, dim] from each [1, heads, L_j, dim]
        rows = [getattr(c.layers[i], name)[0] if c is not None else getattr(some.layers[i], name)[0, :, :0]
                for c in caches]
        return pad_sequence([r.transpose(0, 1) for r in rows], batch_first=True, padding_side="left").transpose(1, 2)

    return type(some)([(padded("keys", i), padded("values", i)) for i in range(len(some.layers))])


def _padding_mask(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """[B, longest]: each row 0 on the left padding of a sequence ``lengths[i]`` long, 1 on its tokens."""
    width = max(lengths)
    return torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=device)


def _pick(distributions: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """The log-probs of ``ids`` in ``distributions`` [T, V] -> [T]."""
    targets = torch.tensor(list(ids), device=distributions.device)  # [T]
    return distributions.gather(-1, targets[:, None])[:, 0]  # [T]


def _padded(rows: Sequence[Sequence[float]], device: torch.device) -> torch.Tensor:
    return pad_sequence([torch.tensor(list(r), dtype=torch.float32, device=device) for r in rows], batch_first=True)


def _until_stop(tokens: list[int], stops: set[int] | frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    end = next((i for i, t in enumerate(tokens) if t in stops), None)
    return tokens if end is None else tokens[: end + 1]
