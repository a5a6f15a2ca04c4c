"""The learner on a tiny in-process model: trainer step, OPD sign, gate, crash safety, judging to lessons."""

from __future__ import annotations

import json
import os
import random
from collections.abc import AsyncIterator
from contextlib import nullcontext
from pathlib import Path

import anyio
import pytest
import torch

from whet.config.settings import LearnerConfig, LoraConfig
from whet.learner import trainer as trainer_module
from whet.learner.gate import PinnedAction, encode_records
from whet.learner.judge import REQUERY_HINT, WRONG_HINT, RulesJudge
from whet.learner.learner import REPAIR_REACH, TRAINER_STATE, Learner, _answer_form, _answer_window
from whet.learner.model import stop_token_ids
from whet.learner.objective import blamed_tokens, build_objective, objective_from_config
from whet.learner.prompt import hinted_prompt_ids, prompt_text, prompt_with_lessons, relessoned
from whet.learner.registry import AdapterRegistry
from whet.learner.tiny import build_tiny_model
from whet.learner.trainer import Anchor, LoraTrainer, Sample, _pick
from whet.memory.bus import LESSON_ADDED, MemoryBus
from whet.memory.experience import Experience
from whet.memory.store import Store, open_store
from whet.memory.tables import Judgment, Turn, TurnCreate

from tinytrain import memorize

SYSTEM = {"role": "system", "content": "You are whet."}
# float32: these tests compare log-probs with the serving side's to 1e-5 (bfloat16 is checked on its own)
# and one optimizer pass a step (the default is 4), which the tests of passes change themselves
LORA = LoraConfig(rank=4, alpha=8, learning_rate=5e-3, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                  precision="float32", epochs=1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def new_trainer(model: Path, kind: str = "combined", lora: LoraConfig = LORA) -> LoraTrainer:
    objective = build_objective(kind, clip_low=0.2, clip_high=0.28, advantage_clip=5.0, rl_weight=1.0,
                                opd_weight=1.0, kl_weight=0.0)  # fmt: skip
    return LoraTrainer.load(str(model), lora, objective, device="cpu")


def encode_turn(trainer: LoraTrainer, question: str, answer: str) -> tuple[list[dict], list[int], list[int]]:
    messages = [SYSTEM, {"role": "user", "content": question}]
    prompt = trainer.tokenizer.encode(prompt_text(trainer.tokenizer, messages, None), add_special_tokens=False)
    response = trainer.tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    return messages, prompt, response


def sample(trainer: LoraTrainer, turn_id: str, question: str, answer: str, score: int) -> Sample:
    _, prompt, response = encode_turn(trainer, question, answer)
    with torch.no_grad():
        behaviour = trainer.response_logprobs(prompt, response).tolist()
    return Sample(turn_id, prompt, response, behaviour, score)


# ----------------------------------------------------------------------------- trainer


def test_a_training_step_changes_the_lora_weights_and_leaves_the_base_weights_untouched(tiny_model):
    trainer = new_trainer(tiny_model)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    lora = trainer.lora_state()
    batch = [sample(trainer, "t1", "What time is it?", "It is nine.", 1),
             sample(trainer, "t2", "What time is it?", "No idea.", -1)]  # fmt: skip
    stats = trainer.step(batch, baseline=0.0)
    after = trainer.lora_state()
    changed = [k for k in lora if not torch.equal(lora[k], after[k])]
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)  # B starts at zero: the adapter now does something
    for name, param in trainer.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base[name]), name
    assert stats["samples"] == 2 and stats["grad_norm"] > 0


def test_epochs_are_optimizer_passes_over_one_batch(tiny_model):
    """``lora.epochs: 3`` takes three optimizer steps on the same batch: the right answer's
    likelihood rises more than after one pass from the same start, and the statistics say
    the first pass's loss and the last's."""
    gains = {}
    for epochs in (1, 3):
        torch.manual_seed(0)
        trainer = new_trainer(tiny_model, "rl", LORA.model_copy(update={"epochs": epochs}))
        good = sample(trainer, "t1", "What time is it?", "It is nine.", 1)
        before = trainer.mean_logprob(good.prompt_ids, good.response_ids)
        stats = trainer.step([good], baseline=0.0)
        gains[epochs] = trainer.mean_logprob(good.prompt_ids, good.response_ids) - before
        assert {"loss", "loss_first"} <= stats.keys()
    assert gains[1] > 0
    assert gains[3] > 1.5 * gains[1]


def test_rehearsal_items_are_learnt_beside_the_batch(tiny_model):
    """A step with rehearsal items raises their likelihood where the same step without them
    leaves them to drift, and says their loss."""
    keep = encode_turn(new_trainer(tiny_model), "Say hello.", "Hello!")[1:]
    after = {}
    for rehearse in (False, True):
        torch.manual_seed(0)
        trainer = new_trainer(tiny_model, "rl", LORA.model_copy(update={"epochs": 3}))
        before = trainer.mean_logprob(*keep)
        stats = trainer.step([sample(trainer, "t1", "What time is it?", "It is nine.", 1)], baseline=0.0,
                             rehearsal=[keep] if rehearse else ())  # fmt: skip
        after[rehearse] = trainer.mean_logprob(*keep) - before
        assert ("rehearsal_loss" in stats) == rehearse
    assert after[True] > 0 and after[True] > after[False]


def adapter_with_effect(trainer: LoraTrainer) -> None:
    """LoRA's B starts at zero (the adapter does nothing, and A gets no gradient): draw it small, so that
    every LoRA weight has a gradient to compare. Seeded: float32 sums taken in two orders agree to a
    tolerance that depends on the draw, and an unseeded draw followed the tests run before it."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


@pytest.mark.parametrize("in_step", [False, True])
@pytest.mark.parametrize("hindsight,kl_weight", [("action", 0.0), ("token", 0.1), ("distribution", 0.0)])
def test_a_pass_reads_each_reply_the_objective_reads_once_and_gives_its_gradient_over_every_graph_at_once(
        tiny_model, hindsight, kl_weight, in_step, monkeypatch):  # fmt: skip
    """The objective's gradient over every sample's and teacher action's graph at once is what a pass gives,
    reading each reply the objective reads once, a few at a time, the others fixed (:meth:`LoraTrainer._objective`);
    a reply it does not read (a score of 0 without a hint, where no KL term reads every reply) is not read at all.
    ``in_step``: inside a step, where the prompts' keys and values are kept, in batches (two here, the last of one
    reply; :meth:`LoraTrainer._reply_batches`): the same gradient."""
    monkeypatch.setattr(trainer_module, "REPLY_BATCH", 2)
    objective = build_objective("combined", hindsight=hindsight, kl_weight=kl_weight, rl_negative_weight=0.25)
    trainer = LoraTrainer.load(str(tiny_model), LORA.model_copy(update={"max_grad_norm": 1e9}), objective, device="cpu")
    adapter_with_effect(trainer)
    messages, prompt, wrong = encode_turn(trainer, HOME, "In Paris it is 10:00.")
    teacher_prompt = hinted_prompt_ids(trainer.tokenizer, messages, prompt, HOME_HINT)
    samples = [sample(trainer, "t1", "What time is it?", "It is nine.", 1),
               sample(trainer, "t2", "Say hello.", "No.", -1),
               Sample("t3", prompt, wrong, [-2.0] * len(wrong), -1, teacher_prompt_ids=teacher_prompt),
               sample(trainer, "t4", "Good night.", "Night!", 0)]  # fmt: skip
    teacher, actions, reference = trainer._teacher_side(samples)
    assert hindsight != "action" or actions[2]  # the hinted sample has an action to learn
    full = objective.needs_distributions
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    student = [trainer.response_distributions(s.prompt_ids, s.response_ids) for s in samples]
    learnt = None if actions is None else [trainer.response_logprobs(s.prompt_ids, a) if a else torch.zeros(1)
                                           for s, a in zip(samples, actions, strict=True)]  # fmt: skip
    picked = [_pick(d, s.response_ids) for d, s in zip(student, samples, strict=True)]
    loss, _ = objective.loss(trainer._token_batch(samples, 0.0, teacher, actions, reference, picked,
                                                  student if full else None, learnt))  # fmt: skip
    loss.backward()
    expected = [p.grad.clone() for p in params]

    read, batches = [], trainer._reply_batches
    monkeypatch.setattr(trainer, "_reply_batches", lambda items: (read.extend(items), batches(items))[1])
    with trainer._reusing_prompts([s.prompt_ids for s in samples]) if in_step else nullcontext():
        assert bool(trainer._step_caches) == in_step
        stats = trainer._pass(samples, 0.0, teacher, actions, reference, full)  # zeroes the gradients first
    replies = [(s.prompt_ids, s.response_ids) for s in samples]
    acted = [] if actions is None else [(s.prompt_ids, a) for s, a in zip(samples, actions, strict=True) if a]
    assert sorted(read) == sorted(replies[: 3 if kl_weight == 0 else 4] + acted)  # each once; t4 only under the KL
    assert stats["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert any(float(e.abs().sum()) > 0 for e in expected)
    for p, e in zip(params, expected, strict=True):  # batched, the sums run in another order
        torch.testing.assert_close(p.grad, e, rtol=1e-3 if in_step else 1e-4, atol=1e-6 if in_step else 1e-7)


@pytest.mark.parametrize("first", [0.0, 2.0])
def test_rehearsal_backpropagates_item_by_item_the_gradient_of_the_mean_over_all_its_tokens(tiny_model, first):
    """One item's graph at a time (a step's memory does not grow with its rehearsal), and the same
    gradient as the token mean over every item at once, items of different lengths weighed by their tokens;
    with ``first``, plus that times the mean over the items' first tokens (each item counted once)."""
    trainer = new_trainer(tiny_model)
    trainer.reset(None)
    adapter_with_effect(trainer)
    items = [encode_turn(trainer, "Say hello.", "Hello!")[1:],
             encode_turn(trainer, "What is two plus two?", "Two plus two is four, as it always was.")[1:]]  # fmt: skip
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    trainer.model.zero_grad(set_to_none=True)
    each = [trainer.response_logprobs(p, r) for p, r in items]
    whole = torch.cat(each)
    (-0.5 * whole.mean() - first * torch.stack([e[0] for e in each]).mean()).backward()
    expected = [p.grad.clone() for p in params]

    trainer.model.zero_grad(set_to_none=True)
    loss, _ = trainer._rehearse(items, 0.5, first)
    assert loss == pytest.approx(float(-whole.detach().mean()), rel=1e-5)
    assert any(float(e.abs().sum()) > 0 for e in expected)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-7)


def test_inside_a_step_replies_are_read_in_batches_with_what_one_at_a_time_gives(tiny_model, monkeypatch):
    """Inside a step (the prompts' keys and values kept) replies are read :data:`REPLY_BATCH` together, their
    prompts' keys and values stacked left-padded and the replies right-padded: each reply's distributions, and
    rehearsal's gradient with the hold to the base model, are what reading each one alone gives."""
    monkeypatch.setattr(trainer_module, "REPLY_BATCH", 2)  # two batches, the last of one item
    trainer = new_trainer(tiny_model)
    trainer.reset(None)
    adapter_with_effect(trainer)
    items = [encode_turn(trainer, "Say hello.", "Hello there, friend!")[1:],
             encode_turn(trainer, "What is two plus two? Tell me slowly.", "Four.")[1:],
             encode_turn(trainer, "Hi!", "Hi! How can I help?")[1:]]  # fmt: skip
    assert len({len(p) for p, _ in items}) == 3 and len({len(r) for _, r in items}) == 3  # padded both sides
    prompts = [p for p, _ in items]
    with torch.no_grad():
        alone = [trainer.response_distributions(p, r) for p, r in items]
        with trainer._reusing_prompts(prompts):
            batches = list(trainer._reply_batches(items))
    shortest_first = sorted(range(3), key=lambda i: len(items[i][1]))
    assert [[i for i, _ in b] for b in batches] == [shortest_first[:2], shortest_first[2:]]
    for got, want in zip([d for _, d in sorted(x for b in batches for x in b)], alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads, losses = [], []
    for in_step in (False, True):
        trainer.model.zero_grad(set_to_none=True)
        with trainer._holding(items, 0.5), trainer._reusing_prompts(prompts) if in_step else nullcontext():
            losses.append(trainer._rehearse(items, 0.25, 2.0))
        grads.append([p.grad.clone() for p in params])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert any(float(g.abs().sum()) > 0 for g in grads[0])
    for batched, single in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(batched, single, rtol=1e-3, atol=1e-6)


def test_rehearsal_backpropagates_item_by_item_its_likelihood_and_the_kl_from_the_base_model(tiny_model):
    """``rehearsal_kl``: the items' next-token distributions under the base model (adapter off) are read once,
    and each pass adds the weight times the gradient of the token-mean KL(base || adapter) along the replies
    beside the rehearsal's likelihood, both from one graph an item: the same gradient as the two means over
    every item at once."""
    trainer = new_trainer(tiny_model)
    trainer.reset(None)
    adapter_with_effect(trainer)  # the adapter now differs from the base model
    items = [encode_turn(trainer, "Say hello.", "Hello!")[1:],
             encode_turn(trainer, "What is two plus two?", "Two plus two is four, as it always was.")[1:]]  # fmt: skip
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    with torch.no_grad(), trainer.model.disable_adapter():
        base = [trainer.response_distributions(p, r) for p, r in items]

    trainer.model.zero_grad(set_to_none=True)
    dists = [trainer.response_distributions(p, r) for p, r in items]
    kl = torch.cat([(b.exp() * (b - d)).sum(-1) for b, d in zip(base, dists, strict=True)])
    logp = torch.cat([d.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1) for d, (_, r) in zip(dists, items, strict=True)])
    (0.5 * kl.mean() - 0.25 * logp.mean()).backward()
    expected = [p.grad.clone() for p in params]

    trainer.model.zero_grad(set_to_none=True)
    with trainer._holding(items, 0.5):
        nll, mean = trainer._rehearse(items, 0.25)
    # a KL this small (~6e-4) is a difference of nearly equal log-probs, each good to float32's ~1e-7: the
    # trainer reads the base distributions in another order (their shared prefix once), and the two means
    # have differed by a relative 1.04e-4 (a full suite run, stop 68); a wrong item or weight would differ by far more
    assert mean == pytest.approx(float(kl.detach().mean()), rel=1e-3) and mean > 0
    assert nll == pytest.approx(-float(logp.detach().mean()), rel=1e-5)
    assert any(float(e.abs().sum()) > 0 for e in expected)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-7)
    assert trainer._rehearse(items, 0.25)[1] == 0.0  # outside a step nothing is held


def test_a_step_that_holds_its_rehearsal_to_the_base_model_moves_it_less_and_says_the_divergence(tiny_model):
    """Over a step's passes the hold pulls the rehearsal items back towards the base model's distributions,
    which the same step without it leaves to drift; the pass reports the divergence as ``rehearsal_kl``."""
    keep = encode_turn(new_trainer(tiny_model), "Say hello.", "Hello!")[1:]
    drift = {}
    for weight in (0.0, 50.0):
        torch.manual_seed(0)
        trainer = new_trainer(tiny_model, "rl", LORA.model_copy(update={"epochs": 4, "learning_rate": 5e-3}))
        batch = [sample(trainer, "t1", "What time is it?", "It is nine.", 1)]
        stats = trainer.step(batch, baseline=0.0, rehearsal=[keep], rehearsal_weight=0.0, rehearsal_kl=weight)
        assert ("rehearsal_kl" in stats) == (weight > 0)
        with torch.no_grad():
            after = trainer.response_distributions(*keep)
            with trainer.model.disable_adapter():
                base = trainer.response_distributions(*keep)
        drift[weight] = float((base.exp() * (base - after)).sum(-1).mean())
    assert drift[0.0] > 0 and drift[50.0] < 0.75 * drift[0.0]  # here 0.0031 against 0.0050


def test_rehearsal_small_talk_is_the_base_models_own_reply_and_calls_keep_their_text(tiny_model):
    from whet.learner.learner import self_distilled

    trainer = new_trainer(tiny_model)
    _, chat_prompt, written = encode_turn(trainer, "Hello!", "Hello! How can I help you today?")
    _, call_prompt, call = encode_turn(trainer, "Time in Oslo?", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    items = self_distilled(trainer, [(chat_prompt, written), (call_prompt, call)], max_tokens=12)
    assert items[1] == (call_prompt, call)
    assert items[0][0] == chat_prompt
    assert items[0][1] == trainer.teacher_action(chat_prompt, 12) != written


def test_a_step_rehearses_calls_of_the_tools_its_batch_called():
    from whet.learner.learner import rehearsal_draw

    items = [{"now"}, {"calculate"}, set(), {"now"}, {"convert"}, set(), {"now"}, {"add_note"}, set(), set(),
             {"calculate"}, {"convert"}]
    picked = rehearsal_draw(items, 6, {"now"}, "global-0002")
    assert len(picked) == len(set(picked)) == 6
    assert sum("now" in items[i] for i in picked) >= 2  # a third of the draw: calls of the batch's tools
    assert sum(not items[i] for i in picked) >= 2  # and a third small talk
    only_calls = [{"now"}, {"now"}, {"convert"}, {"calculate"}]  # a set with no small talk draws what it has
    assert sorted(rehearsal_draw(only_calls, 4, {"now"}, "v")) == [0, 1, 2, 3]
    assert picked == rehearsal_draw(items, 6, {"now"}, "global-0002")  # a redone step draws the same
    assert len(rehearsal_draw(items, 20, set(), "v")) == len(items)


def test_a_step_rehearses_first_the_calls_that_pass_a_value_its_batch_passed():
    """A batch that taught "How hot is 12 °C?" to mean kelvin passed ``celsius``: the draw's same-tool third
    takes the rehearsal calls that pass it too ("Convert 12 celsius to fahrenheit."), the contrast that
    keeps a unit the request names, and a value many items pass does not crowd out one that few do."""
    from whet.learner.learner import call_values, rehearsal_draw

    assert call_values({"value": 12, "from_unit": "Celsius", "to_unit": "kelvin", "n": "3.5"}) == {"celsius", "kelvin"}
    assert call_values("not valid JSON") == set()
    items = [{"convert"}] * 6 + [set()] * 6 + [{"add_note"}] * 10
    values = [{"km", "miles"}, {"celsius", "fahrenheit"}, {"kg", "pounds"}, {"fahrenheit", "celsius"}, {"cup", "ml"},
              {"gb", "mb"}, *[set()] * 6, *[{"todo", "work"}] * 10]  # fmt: skip
    for seed in ("global-0001", "global-0002", "global-0003"):
        picked = rehearsal_draw(items, 12, {"convert", "add_note"}, seed, values, {"celsius", "kelvin", "todo"})
        assert len(picked) == len(set(picked)) == 12
        assert {1, 3} <= set(picked[:4])  # both calls that pass celsius, among the same-tool third
        assert any(i >= 12 for i in picked[:4])  # and one that passes todo
    # without values the draw is the one it always was
    assert rehearsal_draw(items, 12, {"convert"}, "v") == rehearsal_draw(items, 12, {"convert"}, "v", None, {"celsius"})


def test_a_step_rehearses_answers_read_off_the_results_of_every_tool_in_turn(tiny_model):
    """A sixth of the draw are answers read off a tool's result, one tool's in turn, apart from the small talk
    third: a batch of one user's clock answers rewrote a date sum's answer in their shape (run DX). What an
    item answers from is read off its rendered prompt: the last call's name, with only its result after it."""
    from whet.learner.gate import encode_records
    from whet.learner.learner import _reads, rehearsal_draw
    from whet.world.regression import rehearsal_records

    records = list(rehearsal_records())
    tokenizer = new_trainer(tiny_model).tokenizer
    reads = [_reads(tokenizer, prompt) for prompt, _ in encode_records(records, tokenizer)]
    for record, tool in zip(records, reads, strict=True):
        ends_with_result = record["messages"][-1]["role"] == "tool"
        assert tool == (record["messages"][-2]["tool_calls"][0]["function"]["name"] if ends_with_result else None)
    assert set(filter(None, reads)) == {"now", "calculate", "convert", "add_note", "weekday", "days_between",
                                        "add_to_date"}  # fmt: skip

    items = [{"now"}] * 6 + [set()] * 12 + [set()] * 9
    reads = [None] * 18 + ["now", "now", "now", "add_to_date", "add_to_date", "add_to_date", "weekday", "weekday",
                           "calculate"]  # fmt: skip
    seen = set()
    for seed in ("global-0001", "global-0002", "global-0003", "global-0004"):
        picked = rehearsal_draw(items, 18, {"now"}, seed, reads=reads)
        assert len(picked) == len(set(picked)) == 18
        assert sum(6 <= i < 18 for i in picked[:12]) == 6  # the small talk third holds no answer
        answers = [reads[i] for i in picked[12:15]]
        assert len(set(answers)) == 3 and None not in answers  # three answers, each another tool's
        seen |= set(answers)
    assert seen == {"now", "add_to_date", "weekday", "calculate"}
    # without what the items read, the draw is the one it always was
    assert rehearsal_draw(items, 18, {"now"}, "v") == rehearsal_draw(items, 18, {"now"}, "v", None, set(), None)


def call_ids(trainer: LoraTrainer, name: str, **arguments) -> list[int]:
    text = f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'
    return trainer.tokenizer.encode(text, add_special_tokens=False)


def test_each_teacher_action_is_contrasted_with_the_steps_other_calls_of_its_tool_with_other_arguments(tiny_model):
    trainer = new_trainer(tiny_model)
    lisbon, sydney, tokyo = (call_ids(trainer, "now", timezone=city) for city in ("Lisbon", "Sydney", "Tokyo"))
    miles = call_ids(trainer, "convert", value=5, from_unit="km", to_unit="miles")
    words = trainer.tokenizer.encode("It is late.<|im_end|>", add_special_tokens=False)
    actions = [lisbon, None, sydney, list(lisbon), miles, words, tokyo]

    def at(one, other):  # where the two first differ, and the other's token there
        k = next(k for k, (a, b) in enumerate(zip(one, other, strict=False)) if a != b)
        assert one[:k] == other[:k] and trainer.tokenizer.decode(one[:k]).endswith('"timezone": "')
        return k, other[k]

    pairs = dict(trainer._contrasts(actions))
    assert pairs == {0: [at(lisbon, sydney), at(lisbon, tokyo)], 2: [at(sydney, lisbon), at(sydney, tokyo)],
                     3: [at(lisbon, sydney), at(lisbon, tokyo)], 6: [at(tokyo, lisbon), at(tokyo, sydney)]}  # fmt: skip
    # the other call of a tool with the same arguments, a lone tool and an answer in words contrast nothing
    assert trainer._contrasts([lisbon, list(lisbon), miles, words]) == []


def test_the_contrast_binds_each_value_to_its_own_request_where_the_likelihood_raises_both_everywhere(tiny_model):
    """Two requests of one tool, each with its own value: passes on the teacher actions' likelihood alone raise
    both values on both prompts alike; the contrast raises each request's value above the other's on its own
    prompt, and says so in the step's statistics."""
    def margins(trainer, samples, actions):
        with torch.no_grad():
            home = trainer.response_logprobs(samples[0].prompt_ids, actions[0]).sum() \
                - trainer.response_logprobs(samples[0].prompt_ids, actions[1]).sum()  # fmt: skip
            mum = trainer.response_logprobs(samples[1].prompt_ids, actions[1]).sum() \
                - trainer.response_logprobs(samples[1].prompt_ids, actions[0]).sum()  # fmt: skip
        return float(home), float(mum)

    results = {}
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        objective = build_objective("combined", hindsight="action", contrast_weight=weight)
        trainer = LoraTrainer.load(str(tiny_model), LORA.model_copy(update={"epochs": 6, "learning_rate": 1e-2}),
                                   objective, device="cpu")  # fmt: skip
        adapter_with_effect(trainer)
        actions = [call_ids(trainer, "now", timezone="Lisbon"), call_ids(trainer, "now", timezone="Sydney")]
        samples = []
        mum = "Tell me the hour in the place where my mother lives, please."
        for i, (question, hint) in enumerate(((HOME, HOME_HINT), (mum, "Mum lives in Sydney"))):
            messages, prompt, wrong = encode_turn(trainer, question, "It is ten.")
            samples.append(Sample(f"t{i}", prompt, wrong, [-2.0] * len(wrong), -1,
                                  teacher_prompt_ids=hinted_prompt_ids(trainer.tokenizer, messages, prompt, hint)))
        taught = {s.turn_id: a for s, a in zip(samples, actions, strict=True)}
        trainer._new_actions = lambda these, taught=taught: [taught[s.turn_id] for s in these]
        before = margins(trainer, samples, actions)
        stats = trainer.step(samples, baseline=0.0)
        results[weight] = [after - start for after, start in zip(margins(trainer, samples, actions), before, strict=True)]
        assert ("contrast_pairs" in stats) == (weight > 0)
    assert sum(results[1.0]) > sum(results[0.0]) + 1.0  # nats, over the two requests
    assert min(results[1.0]) > 0  # each request's own value gained on the other's, on its own prompt
    assert stats["contrast_pairs"] == 2


@pytest.mark.parametrize("in_step", [False, True])
def test_a_pass_adds_the_contrast_from_the_same_read_of_each_teacher_action_as_the_objective(tiny_model, in_step,
                                                                                           monkeypatch):  # fmt: skip
    """Each teacher action is read once a pass, and that read gives both its likelihood's term of the objective
    and its contrasts (:meth:`LoraTrainer._contrast_loss`): the pass's gradient is the gradient of the objective
    plus ``contrast_weight`` times the mean contrast, over every graph at once; inside a step, the actions read
    in batches (two here, the last of one row)."""
    monkeypatch.setattr(trainer_module, "REPLY_BATCH", 2)
    objective = build_objective("combined", hindsight="action", contrast_weight=2.0, rl_negative_weight=0.25)
    trainer = LoraTrainer.load(str(tiny_model), LORA.model_copy(update={"max_grad_norm": 1e9}), objective, device="cpu")
    adapter_with_effect(trainer)
    actions = [call_ids(trainer, "now", timezone=city) for city in ("Lisbon", "Sydney", "Asia/Tokyo")]
    samples = []
    for i, question in enumerate((HOME, "What time is it where Mum lives?", "And the time in Tokyo, please?")):
        _, prompt, wrong = encode_turn(trainer, question, "It is ten.")
        samples.append(Sample(f"t{i}", prompt, wrong, [-2.0] * len(wrong), -1))
    contrasts = trainer._contrasts(actions)
    assert len(contrasts) == 3
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    student = [trainer.response_logprobs(s.prompt_ids, s.response_ids) for s in samples]
    read = [trainer.response_distributions(s.prompt_ids, a) for s, a in zip(samples, actions, strict=True)]
    learnt = [_pick(d, a) for d, a in zip(read, actions, strict=True)]
    loss, _ = objective.loss(trainer._token_batch(samples, 0.0, [None] * 3, actions, None, student, None, learnt))
    margins = [torch.nn.functional.softplus(read[i][at, token] - read[i][at, actions[i][at]])
               for i, others in contrasts for at, token in others]  # fmt: skip
    (loss + 2.0 * torch.stack(margins).mean()).backward()
    expected = [p.grad.clone() for p in params]

    with trainer._reusing_prompts([s.prompt_ids for s in samples]) if in_step else nullcontext():
        stats = trainer._pass(samples, 0.0, [None] * 3, actions, None, False, contrasts=contrasts)
    assert stats["contrast_pairs"] == 6
    assert stats["contrast_loss"] == pytest.approx(float(torch.stack(margins).detach().mean()), rel=1e-4)
    assert stats["loss"] == pytest.approx(float(loss.detach()), rel=1e-4)
    assert any(float(e.abs().sum()) > 0 for e in expected)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-3 if in_step else 1e-4, atol=1e-6 if in_step else 1e-7)


def test_sgd_moves_each_adapter_weight_by_its_gradient_where_a_fresh_adamw_moves_each_by_the_learning_rate(
        tiny_model, tmp_path):  # fmt: skip
    """``lora.optimizer: sgd``: one pass changes every LoRA weight by ``lr`` times its (clipped) gradient, so
    the weights the batch barely touches barely move; AdamW's first pass moves each by about ``lr``
    whatever its gradient. A version saved by AdamW resumes under SGD with its weights and a fresh state."""
    moves = {}
    for name in ("sgd", "adamw"):
        torch.manual_seed(0)
        lr = 0.5 if name == "sgd" else 1e-3
        trainer = new_trainer(tiny_model, "rl", LORA.model_copy(update={"optimizer": name, "learning_rate": lr,
                                                                         "max_grad_norm": 1e9}))  # fmt: skip
        adapter_with_effect(trainer)
        good = sample(trainer, "t1", "What time is it?", "It is nine.", 1)
        params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
        before = {n: p.detach().clone() for n, p in params.items()}
        trainer.step([good], baseline=0.0)
        grads = torch.cat([params[n].grad.flatten() for n in params])  # the one pass's gradient
        moved = torch.cat([(params[n].detach() - before[n]).flatten() for n in params])
        moves[name] = (grads, moved, lr)
        if name == "adamw":
            trainer.save(tmp_path / "adamw")
            saved = trainer.lora_state()
    grads, moved, lr = moves["sgd"]
    torch.testing.assert_close(moved, -lr * grads, rtol=1e-3, atol=1e-8)
    grads, moved, lr = moves["adamw"]
    touched = grads.abs() > 1e-6
    ratio = moved[touched].abs() / lr
    assert float(ratio.min()) > 0.5 and float(ratio.max()) < 1.5  # the sign of the gradient, times lr
    assert float(grads[touched].abs().max() / grads[touched].abs().min()) > 100  # though the gradients differ 100x

    again = new_trainer(tiny_model, "rl", LORA.model_copy(update={"optimizer": "sgd"}))
    again.reset(tmp_path / "adamw")
    assert isinstance(again.optimizer, torch.optim.SGD) and not again.optimizer.state_dict()["state"]
    assert all(torch.equal(v, again.lora_state()[k]) for k, v in saved.items())
    again.step([sample(again, "t1", "What time is it?", "It is nine.", 1)], baseline=0.0)


def test_a_repair_pass_learns_the_lost_chats_whole_and_their_first_tokens_beside_the_steps_rehearsal(tiny_model):
    """``LoraTrainer.repair``: one optimizer pass whose gradient is the lost chats' token-mean and first-token
    negative log-likelihood at full weight, plus the step's rehearsal as the step weighs it; no sample."""
    lr = 0.5
    trainer = new_trainer(tiny_model, "rl", LORA.model_copy(update={"optimizer": "sgd", "learning_rate": lr,
                                                                     "max_grad_norm": 1e9}))  # fmt: skip
    trainer.reset(None)
    adapter_with_effect(trainer)
    lost = [encode_turn(trainer, "Good evening! Long day?", "Good evening! What can I do for you?")[1:],
            encode_turn(trainer, "Suggest a song.", "Try this one.")[1:]]  # fmt: skip
    kept = [encode_turn(trainer, "Time in Oslo?", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')[1:]]
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}

    trainer.model.zero_grad(set_to_none=True)
    each = [trainer.response_logprobs(p, r) for p, r in lost]
    rehearsed = trainer.response_logprobs(*kept[0])
    (-torch.cat(each).mean() - torch.stack([e[0] for e in each]).mean()
     - 0.5 * rehearsed.mean() - 2.0 * rehearsed[0]).backward()  # fmt: skip
    expected = torch.cat([params[n].grad.flatten() for n in params])
    before = torch.cat([p.detach().flatten() for p in params.values()])

    stats = trainer.repair(lost, kept, 0.5, 2.0)
    moved = torch.cat([p.detach().flatten() for p in params.values()]) - before
    assert float(expected.abs().sum()) > 0
    torch.testing.assert_close(moved, -lr * expected, rtol=1e-3, atol=1e-8)
    assert stats["repair_loss"] == pytest.approx(float(-torch.cat(each).detach().mean()), rel=1e-5)
    assert "rehearsal_loss" in stats and not trainer.model.training


@pytest.mark.parametrize("passes,counts,repaired", [(0, [], []), (1, [2, 1], [2]), (3, [2, 1, 0], [2, 1])])
def test_the_learner_repairs_while_its_rehearsal_small_talk_opens_near_a_call(tiny_model, tmp_path, passes, counts,
                                                                             repaired):  # fmt: skip
    """``learner.rehearsal.repair_passes``: each of the rehearsal set's small talk whose first token is within
    ``repair_margin`` nats of a tool call's is repaired, up to that many passes, until none is. Calls in the set
    are not checked, nor, after the first check, a chat the step left further than ``REPAIR_REACH`` past the line."""
    config = learner_config(rehearsal={"repair_passes": passes, "repair_margin": 1.5})
    learner = make_learner(config, None, None, tiny_model, tmp_path)  # type: ignore[arg-type]
    trainer = learner._trainer_now()
    call = trainer.tokenizer.encode('<tool_call>\n{"name": "add_note", "arguments": {"text": "x"}}\n</tool_call>',
                                    add_special_tokens=False)  # fmt: skip
    chats = [encode_turn(trainer, q, a)[1:] for q, a in (("Hi!", "Hello!"), ("Long day?", "It was."), ("Ok.", "Ok!"),
                                                         ("Thanks.", "You're welcome!"))]  # fmt: skip
    learner._rehearsal = [*chats, (chats[0][0], call)]
    learner._rehearsal_tools = [set(), set(), set(), set(), {"add_note"}]
    learner._rehearsal_values = [set(), set(), set(), set(), {"x"}]
    # the first two within 1.5 nats of a call; each repair pass mends the nearest; the third within reach, the
    # last beyond it
    odds = [0.3, -1.2, -1.6, -1.5 - REPAIR_REACH - 0.1]
    asked, mended = [], []

    def opening_odds(prompts, token):
        asked.append((list(prompts), token))
        return [odds[[p for p, _ in chats].index(p)] for p in prompts]

    def repair(near, rehearsal, weight, first):
        mended.append(len(near))
        assert near == [c for c, o in zip(chats, odds, strict=True) if o > -1.5] and rehearsal == ["step's"]
        odds[odds.index(max(odds))] = -3.0
        return {}

    trainer.opening_odds, trainer.repair = opening_odds, repair
    assert learner._repair(trainer, ["step's"]) == counts  # type: ignore[list-item]
    assert mended == repaired
    reads = [[p for p, _ in chats]] + [[p for p, _ in chats[:3]]] * len(repaired) if passes else []
    assert [prompts for prompts, _ in asked] == reads
    assert all(token == call[0] for _, token in asked)


def test_forgetting_momentum_zeroes_adamws_running_mean_of_gradients_and_keeps_their_scale(tiny_model):
    trainer = new_trainer(tiny_model)
    trainer.step([sample(trainer, "t1", "Hi?", "Hello!", 1)], 0.0)
    state = [s for s in trainer.optimizer.state.values() if "exp_avg" in s]
    assert state and any(float(s["exp_avg"].abs().sum()) > 0 for s in state)
    scales = [s["exp_avg_sq"].clone() for s in state]
    trainer.forget_momentum()
    assert all(float(s["exp_avg"].abs().sum()) == 0 for s in state)
    assert all(torch.equal(s["exp_avg_sq"], kept) for s, kept in zip(state, scales, strict=True))


def test_the_learner_repairs_the_rehearsal_calls_the_base_writes_that_the_candidate_no_longer_does(tiny_model, tmp_path):
    """``learner.rehearsal.repair_calls``: of the rehearsal set's calls and answers read off a tool's result that
    the base model writes greedily (every watched token ahead of the best other), that many are watched, round
    robin over their tools (a tool's calls and its answers apart) and the closest to a tie first; a repair pass
    runs while any of them is lost (a token no longer ahead), on those items beside the near chats. An answer is
    watched to its last digit, at least its opening: what the gate's greedy check holds it to."""
    config = learner_config(rehearsal={"repair_passes": 3, "repair_margin": 1.0, "repair_calls": 4})
    learner = make_learner(config, None, None, tiny_model, tmp_path)  # type: ignore[arg-type]
    trainer = learner._trainer_now()

    def call(name: str) -> list[int]:
        return trainer.tokenizer.encode(f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>',
                                        add_special_tokens=False)  # fmt: skip

    chat = encode_turn(trainer, "Hi!", "Hello!")[1:]
    prompts = [encode_turn(trainer, q, "x")[1] for q in ("Time?", "Time in Oslo?", "Weekday?", "Day of 2027-01-02?",
                                                            "Weekday of it?", "What time is it?", "Its weekday?")]  # fmt: skip
    names = ["now", "now", "weekday", "weekday", "weekday", "now"]
    calls = [(p, call(n)) for p, n in zip(prompts[:6], names, strict=True)]
    said = "That is a Sunday, the 21st of March 2027, a quiet day for a long walk in the park with friends and family."
    answer = (prompts[6], trainer.tokenizer.encode(said, add_special_tokens=False))
    digits = [i for i, t in enumerate(answer[1]) if any(c.isdigit() for c in trainer.tokenizer.decode([t]))]
    window = digits[-1] + 1
    assert 16 < window < len(answer[1])  # the date lies past the opening, and words follow it
    learner._rehearsal = [chat, *calls, answer]
    learner._rehearsal_tools = [set(), *({n} for n in names), set()]
    learner._rehearsal_reads = [None] * 7 + ["weekday"]
    base = [[2.0, 0.8], [3.0, 1.5], [0.7, 5.0], [-0.1, 4.0], [1.9, 2.0], [0.3, 3.0], [1.2] * window]
    live = {i: list(g) for i, g in enumerate(base)}
    mended, read = [], []

    def reply_gaps(ps, rs):
        read.append(len(ps))
        if len(read) == 1:  # the first read is the base model's, of every call and answer, the answer to its window
            assert ps == prompts and rs == [r for _, r in calls] + [answer[1][:window]]
            return [list(g) for g in base]
        assert [len(r) for p, r in zip(ps, rs, strict=True) if p == answer[0]] == [window]  # read to its window
        return [live[prompts.index(p)] for p in ps]

    def repair(items, rehearsal, weight, first):
        mended.append(sorted(prompts.index(p) for p, _ in items if p in prompts))
        assert answer not in items or items.count(answer) == 1  # trained whole, once
        for p, _ in items:
            if p in prompts:
                live[prompts.index(p)] = [g + 1.0 for g in live[prompts.index(p)]]  # a pass mends by a nat
        return {}

    trainer.reply_gaps, trainer.repair = reply_gaps, repair
    trainer.opening_odds = lambda ps, token: [-5.0] * len(ps)  # the chat and the answer stay far from a call
    forgot = []
    trainer.forget_momentum = lambda: forgot.append(len(mended))
    # watched: now's closest (.8), weekday's closest (.7), weekday's answer (1.2), now's next (1.5); not the calls
    # the base does not write (-.1), nor one it writes by less than the gate's pinned_tie_margin (.3, under .5)
    assert learner._watched_calls(trainer) == [(calls[0], len(calls[0][1])), (calls[2], len(calls[2][1])),
                                               (answer, window), (calls[1], len(calls[1][1]))]  # fmt: skip
    live[0][0], live[2][0], live[6][-1] = -0.5, -1.5, -0.2  # the step tipped two calls and the answer's date
    live[1] = [3.0, REPAIR_REACH + 0.5]  # and moved now's next further ahead: every watched reply is read again
    assert learner._repair(trainer, ["step's"]) == [3, 1, 0]  # type: ignore[list-item]
    assert mended == [[0, 2, 6], [2]] and read == [7, 4, 4, 4]
    assert forgot == [0]  # the step's momentum dropped once, before the first repair pass
    learner.config.rehearsal.repair_calls = 0
    learner._watched = None
    assert learner._watched_calls(trainer) == [] and learner._repair(trainer, []) == [0]  # type: ignore[list-item]


def test_the_repair_watches_each_form_of_a_tools_answers(tiny_model, tmp_path):
    """A tool's answers read off its result are watched by the word they open with (a value's digits are
    no form): two ``add_note`` answers opening "Saved" sit closer to a tie than the one opening "Added", and
    with two watched, one of each is (the forms in turn, by name), so that a step that writes a list's todo in a note's form is seen."""
    config = learner_config(rehearsal={"repair_passes": 1, "repair_calls": 2})
    learner = make_learner(config, None, None, tiny_model, tmp_path)  # type: ignore[arg-type]
    trainer = learner._trainer_now()
    said = ["Saved the note: Maria likes tulips.", "Saved the note: the spare key is in the shed.",
            'Added "call the bank" to your camping list.']
    items = [(encode_turn(trainer, f"Note {i}", "x")[1], trainer.tokenizer.encode(a, add_special_tokens=False))
             for i, a in enumerate(said)]  # fmt: skip
    learner._rehearsal, learner._rehearsal_tools = items, [set()] * 3
    learner._rehearsal_reads = ["add_note"] * 3
    trainer.reply_gaps = lambda ps, rs: [[g] for g in (0.6, 0.7, 2.0)]
    assert learner._watched_calls(trainer) == [(items[2], _answer_window(trainer.tokenizer, items[2][1])),
                                               (items[0], _answer_window(trainer.tokenizer, items[0][1]))]
    assert [_answer_form(trainer.tokenizer, r) for _, r in items] == ["saved", "saved", "added"]
    assert _answer_form(trainer.tokenizer, trainer.tokenizer.encode("2027-02-15 is a Monday.")) == ""


@pytest.mark.anyio
@pytest.mark.parametrize("weight", [0.0, 3.0])
async def test_a_step_anchors_the_openings_of_the_rehearsal_sets_small_talk_by_its_weight(tiny_model, tmp_path, store,
                                                                                      monkeypatch, weight):  # fmt: skip
    """``learner.rehearsal.anchor_weight``: the step is given every item of the rehearsal set whose reply calls no
    tool (chats, answers read off a tool), not only the ones drawn into it, to hold their odds of opening with a
    call, and the calls drawn into it, to hold theirs, at the configured weight; 0: no anchor.
    And ``kl_weight`` reaches the step as configured."""
    given = []
    monkeypatch.setattr(LoraTrainer, "step", lambda self, samples, *a, **k: given.append(a) or {})
    learner = make_learner(learner_config(rehearsal={"anchor_weight": weight, "kl_weight": weight / 2}), store,
                           MemoryBus(), tiny_model, tmp_path)  # fmt: skip
    trainer = learner._trainer_now()
    call = trainer.tokenizer.encode('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', add_special_tokens=False)
    chats = [encode_turn(trainer, q, a)[1:] for q, a in (("Hi!", "Hello!"), ("Long day?", "It was."))]
    learner._rehearsal = [*chats, (chats[0][0], call)]
    learner._rehearsal_tools = [set(), set(), {"now"}]
    learner._rehearsal_values = [set(), set(), set()]
    for q in QUESTIONS:
        await judged_turn(store, new_trainer(tiny_model), q, GOOD, +1, "train")
    await learner.train_ready()
    [(baseline, rehearsal, rehearsal_weight, first, anchor, kl)] = given
    assert kl == weight / 2
    if weight:  # and the step's drawn calls, whose odds of opening with one it holds the other way
        assert (chats[0][0], call) in rehearsal
        assert anchor == Anchor([p for p, _ in chats], call[0], weight, [chats[0][0]])  # the call's first token
    else:
        assert anchor is None


def test_opening_odds_say_how_much_likelier_a_first_token_is_than_any_other(tiny_model):
    trainer = new_trainer(tiny_model)
    prompts = [encode_turn(trainer, q, "")[1] for q in ("Hi!", "What time is it in Oslo?")]
    for prompt, got in zip(prompts, trainer.opening_odds(prompts, 5), strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(trainer.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        greedy = int(logp.argmax())
        other = logp.clone()
        other[5] = -float("inf")
        assert got == pytest.approx(float(logp[5] - other.max()), abs=1e-4)
        assert (got > 0) == (greedy == 5)


def test_a_missing_rehearsal_set_or_lesson_probes_file_is_a_config_error_naming_it(tmp_path):
    from whet.config.settings import ConfigError, WhetConfig
    from whet.learner.learner import check_config

    config = WhetConfig.model_validate({"learner": {"rehearsal": {"set": str(tmp_path / "none.jsonl")}}})
    with pytest.raises(ConfigError, match="learner.rehearsal.set"):
        check_config(config, standalone=False)
    config = WhetConfig.model_validate({"learner": {"gate": {"lesson_probes": str(tmp_path / "none.jsonl")}}})
    with pytest.raises(ConfigError, match="learner.gate.lesson_probes"):
        check_config(config, standalone=False)
    check_config(WhetConfig.model_validate({"learner": {"gate": {"lesson_probes": None}}}), standalone=False)


def test_a_step_from_a_saved_version_drops_its_momentum_when_told(tiny_model, tmp_path):
    """``lora.carry_momentum: false``: AdamW's running mean of gradients starts at zero again, its running scale
    and step count carry on; by default both carry on."""
    trainer = new_trainer(tiny_model)
    trainer.step([sample(trainer, "t1", "Hello?", "Hi there.", 1)], baseline=0.0)
    trainer.save(tmp_path / "v1")
    saved = trainer.optimizer.state_dict()["state"]
    for carry in (True, False):
        again = new_trainer(tiny_model, lora=LORA.model_copy(update={"carry_momentum": carry}))
        again.reset(tmp_path / "v1")
        state = again.optimizer.state_dict()["state"]
        assert state.keys() == saved.keys()
        for k in saved:
            assert torch.equal(state[k]["exp_avg_sq"], saved[k]["exp_avg_sq"]) and state[k]["step"] == saved[k]["step"]
            assert torch.equal(state[k]["exp_avg"], saved[k]["exp_avg"] if carry else torch.zeros_like(saved[k]["exp_avg"]))
    assert any(saved[k]["exp_avg"].any() for k in saved)  # there was a momentum to drop


def test_the_adapter_round_trips_through_save_and_load(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = new_trainer(tiny_model)
    trainer.step([sample(trainer, "t1", "Hello?", "Hi there.", 1)], baseline=0.0)
    trainer.save(tmp_path / "v1")
    assert (tmp_path / "v1" / "adapter_config.json").is_file()
    assert (tmp_path / "v1" / "adapter_model.safetensors").is_file()

    again = new_trainer(tiny_model)
    again.reset(tmp_path / "v1")
    saved, loaded = trainer.lora_state(), again.lora_state()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert again.optimizer.state_dict()["state"], "the optimizer state resumes with the weights"

    # an ordinary peft folder: the serving side loads it the same way
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    served = PeftModel.from_pretrained(base, str(tmp_path / "v1")).eval()
    _, prompt, response = encode_turn(trainer, "Hello?", "Hi there.")
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = served(ids).logits[0, len(prompt) - 1 : -1]
    served_logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    with torch.no_grad():
        assert torch.allclose(served_logp, trainer.response_logprobs(prompt, response), atol=1e-5)

    again.reset(None)  # back to the base weights
    with torch.no_grad():
        assert not torch.allclose(again.response_logprobs(prompt, response), trainer.response_logprobs(prompt, response))


def test_prompts_read_once_a_step_give_the_same_log_probs_and_the_same_one_pass_step(tiny_model, monkeypatch):
    trainer = new_trainer(tiny_model)
    batch = [sample(trainer, "a", "What is 2+2?", "4", 1), sample(trainer, "b", "Hello?", "Hi there.", -1),
             sample(trainer, "c", "Name a colour.", "Blue.", 1)]  # fmt: skip
    trainer.step(batch, 0.0)  # an adapter that is not the identity, so the adapter's keys and values count
    items = [(s.prompt_ids, s.response_ids) for s in batch] + [([5], [6, 7])]  # a one-token prompt too
    with torch.no_grad():
        one_by_one = [float(trainer.response_logprobs(p, r).mean()) for p, r in items]
    assert trainer.mean_logprobs(items) == pytest.approx(one_by_one, abs=1e-5)
    assert len(os.path.commonprefix([s.prompt_ids for s in batch])) > 5  # the shared prefix was used

    # one pass: the reused keys and values are exactly the step's own, so the update is the same
    exact = LORA.model_copy(update={"dropout": 0.0})  # (the default) dropout would make two steps differ anyway
    torch.manual_seed(0)
    reused = new_trainer(tiny_model, lora=exact)
    torch.manual_seed(0)  # the same LoRA initialisation
    fresh = new_trainer(tiny_model, lora=exact)
    reused.step(batch, 0.0, rehearsal=[(batch[0].prompt_ids, batch[0].response_ids)])
    monkeypatch.setattr(fresh, "_prompt_caches", lambda prompts: {})
    fresh.step(batch, 0.0, rehearsal=[(batch[0].prompt_ids, batch[0].response_ids)])
    a, b = reused.lora_state(), fresh.lora_state()
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_train_prompt_reads_the_same_log_probs_and_carries_the_loss_through_the_requests_own_tokens(tiny_model):
    """``lora.train_prompt``: inside a step, only the prefix the prompts share runs without gradients. A lone
    prompt (nothing shared) then gets the plain fine-tuning gradient, prompt tokens and all, which the default
    (the prompt's keys and values without gradients) does not."""
    through = new_trainer(tiny_model, lora=LORA.model_copy(update={"train_prompt": True}))
    batch = [sample(through, "a", "What is 2+2?", "4", 1), sample(through, "b", "Hello?", "Hi there.", -1)]
    through.step(batch, 0.0)  # an adapter that is not the identity, so its effect on the prompt counts
    items = [(s.prompt_ids, s.response_ids) for s in batch]
    with torch.no_grad(), through._reusing_prompts([p for p, _ in items]):
        assert through._step_prefix is not None and len(through._step_prefix[0]) > 5  # the shared prefix
        inside = [float(through.response_logprobs(p, r).mean()) for p, r in items]
    assert inside == pytest.approx(through.mean_logprobs(items), abs=1e-5)

    def gradient(trainer: LoraTrainer, step: bool) -> dict[str, torch.Tensor]:
        prompt, response = items[0]
        trainer.model.zero_grad(set_to_none=True)
        if step:
            with trainer._reusing_prompts([prompt]):
                (-trainer.response_logprobs(prompt, response).sum()).backward()
        else:  # plain fine-tuning: the whole sequence in one graph, the loss on the response's tokens
            logits = trainer.model(torch.tensor([[*prompt, *response]])).logits[0, len(prompt) - 1:-1]
            (-torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).sum()).backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    plain, stepped = gradient(through, False), gradient(through, True)
    assert all(torch.allclose(plain[n], stepped[n], atol=1e-5) for n in plain)
    default = new_trainer(tiny_model)
    default.reset(None)
    default.model.load_state_dict(through.model.state_dict())  # the same adapter, prompts read without gradients
    cached = gradient(default, True)
    assert not all(torch.allclose(plain[n], cached[n], atol=1e-5) for n in plain)


@pytest.mark.parametrize("train_prompt", [False, True])
def test_an_anchor_holds_small_talks_odds_of_opening_with_a_call_where_the_step_found_them(tiny_model, train_prompt):
    """``Anchor``: from the second pass on, each pass pulls down every anchored chat's log-probability of opening
    with the anchor's token where it rose above where the step started (the first pass starts there: no pull)."""
    lora = LORA.model_copy(update={"epochs": 4, "train_prompt": train_prompt})
    chats = ["Good evening! Long day?", "Tell me a joke.", "Nice to meet you."]
    call = '<tool_call>{"name": "now"}</tool_call>'

    def rise(weight: float) -> tuple[float, dict[str, float]]:
        torch.manual_seed(0)  # the same LoRA initialisation for both
        trainer = new_trainer(tiny_model, lora=lora)
        token = trainer.tokenizer.encode(call, add_special_tokens=False)[0]
        prompts = [encode_turn(trainer, chat, "")[1] for chat in chats]
        with torch.no_grad():
            start = [float(trainer._opening(p)[token]) for p in prompts]
        batch = [sample(trainer, "a", "What time is it at home?", call, 1),
                 sample(trainer, "b", "Hi!", "Hello there, how can I help?", -1)]  # fmt: skip
        stats = trainer.step(batch, 0.0, anchor=Anchor(prompts, token, weight))
        with torch.no_grad():
            now = [float(trainer._opening(p)[token]) for p in prompts]
        return sum(n - s for n, s in zip(now, start, strict=True)) / len(prompts), stats

    free, free_stats = rise(0.0)
    held, held_stats = rise(20.0)
    assert "anchor_rise" not in free_stats and "anchor_rise" in held_stats
    assert free > 1e-3 and held < free / 2


def test_an_anchor_holds_requests_odds_of_opening_with_a_call_where_the_step_found_them(tiny_model):
    """``Anchor.calls``: a step that rewards answers in words pulls every request towards answering in words;
    each pass pushes back up every anchored call whose log-probability of opening with the call's token fell."""
    lora = LORA.model_copy(update={"epochs": 4})
    requests = ["What is 39 times 68?", "Add a todo to my work list: buy milk.", "Note that the door code is 4471."]
    call = '<tool_call>{"name": "calculate"}</tool_call>'

    def change(weight: float) -> tuple[float, dict[str, float]]:
        torch.manual_seed(0)
        trainer = new_trainer(tiny_model, lora=lora)
        token = trainer.tokenizer.encode(call, add_special_tokens=False)[0]
        prompts = [encode_turn(trainer, request, "")[1] for request in requests]
        with torch.no_grad():
            start = [float(trainer._opening(p)[token]) for p in prompts]
        batch = [sample(trainer, "a", "What is 12 times 3?", "12 times 3 is 36.", 1),
                 sample(trainer, "b", "Add eggs to my list.", call, -1)]  # fmt: skip
        stats = trainer.step(batch, 0.0, anchor=Anchor([], token, weight, prompts))
        with torch.no_grad():
            now = [float(trainer._opening(p)[token]) for p in prompts]
        return sum(n - s for n, s in zip(now, start, strict=True)) / len(prompts), stats

    free, free_stats = change(0.0)
    held, held_stats = change(20.0)
    assert "anchor_calls" not in free_stats and "anchor_calls" in held_stats and "anchor_rise" not in held_stats
    assert free < -1e-3 and held > free / 2


def test_an_anchor_reads_its_prompts_openings_in_batches_with_the_gradient_one_at_a_time_gives(tiny_model, monkeypatch):
    """A step reads its anchored prompts' openings in batches (their keys and values stacked, left-padded to the
    longest): the same openings, and the same gradient, as reading each prompt alone; the cache of a prompt only
    the anchor reads is not kept beside the stacked one."""
    monkeypatch.setattr(trainer_module, "OPENINGS_BATCH", 2)  # three batches, the last of one prompt
    torch.manual_seed(0)
    trainer = new_trainer(tiny_model)
    for name, weight in trainer.model.named_parameters():
        if "lora_B" in name:  # an adapter that is not the identity
            torch.nn.init.normal_(weight, std=0.05)
    token = trainer.tokenizer.encode('<tool_call>{"name": "now"}</tool_call>', add_special_tokens=False)[0]
    chats = ["Hi!", "Good evening! Long day? I have been walking all afternoon.", "Tell me a joke.", "Thanks."]
    prompts = [encode_turn(trainer, chat, "")[1] for chat in [*chats, "What time is it in Lisbon?"]]
    assert len({len(p) for p in prompts}) > 2  # padded to the longest of each batch
    trained = prompts[2:3]
    anchor = Anchor(prompts[:4], token, 3.0, prompts[4:])
    trainer.model.train()
    with trainer._reusing_prompts(prompts):
        with torch.no_grad():
            alone = [float(trainer._opening(p)[token]) for p in prompts]
        batches = trainer._openings(prompts, trained)
        assert [len(b.prompts) for b in batches] == [2, 2, 1]
        assert set(trainer._step_caches) == {tuple(p[:-1]) for p in trained}
        with torch.no_grad():
            read = [float(x) for b in batches for x in trainer._read_openings(b)[:, token]]
        assert read == pytest.approx(alone, abs=1e-4)
        # from these starts some have risen and some fallen: only a chat that rose, or a call that fell, pulls
        start = [a + d for a, d in zip(alone, [-0.5, 0.5, -0.5, 0.5, 0.5], strict=True)]
        trainer.model.zero_grad(set_to_none=True)
        stats = trainer._anchor(anchor, batches, start)
        batched = {n: w.grad.clone() for n, w in trainer.model.named_parameters() if w.grad is not None}
        trainer.model.zero_grad(set_to_none=True)
        for prompt, before, sign, n in zip(prompts, start, [1, 1, 1, 1, -1], [4, 4, 4, 4, 1], strict=True):
            change = trainer._opening(prompt)[token] - before
            if sign * float(change.detach()) > 0:
                (3.0 * sign * change / n).backward()
        single = {n: w.grad.clone() for n, w in trainer.model.named_parameters() if w.grad is not None}
    assert batched.keys() == single.keys() and batched
    assert all(torch.allclose(batched[n], single[n], atol=1e-6, rtol=1e-3) for n in single)
    changes = [a - b for a, b in zip(alone, start, strict=True)]
    assert stats == pytest.approx({"anchor_rise": sum(changes[:4]) / 4, "anchor_calls": changes[4]}, abs=1e-4)


def test_bfloat16_training_reads_the_same_log_probs_to_a_few_hundredths_and_top_layers_train_alone(tiny_model):
    full = new_trainer(tiny_model)
    fast = LoraTrainer.load(tiny_model, LORA.model_copy(update={"precision": "bfloat16", "layers": 1}), build_objective("combined"),
                            device="cpu")  # fmt: skip
    _, prompt, response = encode_turn(full, "What time is it?", "It is nine.")
    with torch.no_grad():
        assert torch.allclose(fast.response_logprobs(prompt, response), full.response_logprobs(prompt, response),
                              atol=0.05)  # fmt: skip
    assert fast.bf16 and not full.bf16
    trained = {n.split(".layers.")[1].split(".")[0] for n, p in fast.model.named_parameters() if p.requires_grad}
    assert trained == {str(fast.model.config.num_hidden_layers - 1)}  # only the top layer has an adapter


def test_bfloat16_passes_use_weights_cast_once_and_read_and_train_exactly_as_a_cast_at_every_call(tiny_model):
    """The frozen weights are cast to bfloat16 once and swapped in under autocast (:meth:`LoraTrainer._autocast`):
    the same values autocast's own cast gives at every call, so the same log-probs and the same step."""
    def trainer() -> LoraTrainer:
        torch.manual_seed(0)
        return LoraTrainer.load(tiny_model, LORA.model_copy(update={"precision": "bfloat16"}),
                                build_objective("combined"), device="cpu")  # fmt: skip

    cast_once, cast_each_call = trainer(), trainer()
    cast_each_call._casting = True  # as if already inside: autocast alone, casting at every call
    _, prompt, response = encode_turn(cast_once, "What time is it?", "It is nine.")
    sample = Sample(turn_id="t", prompt_ids=prompt, response_ids=response, score=1,
                    behaviour_logprobs=[-1.0] * len(response))  # fmt: skip
    with torch.no_grad():
        assert torch.equal(cast_once.response_logprobs(prompt, response), cast_each_call.response_logprobs(prompt, response))
    for t in (cast_once, cast_each_call):
        t.step([sample], 0.0, rehearsal=[(prompt, response)])
    once, each = cast_once.lora_state(), cast_each_call.lora_state()
    assert once.keys() == each.keys() and all(torch.equal(once[k], each[k]) for k in once)
    assert cast_once._cast and all(w.dtype == torch.bfloat16 for w in cast_once._cast.values())
    linears = [m for m in cast_once.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.dtype == torch.float32 for m in linears)  # swapped back: greedy decoding reads float32
    base = cast_once.model.get_base_model()
    if base.config.tie_word_embeddings:
        assert base.lm_head.weight is base.model.embed_tokens.weight  # still tied


def test_greedy_replies_decode_in_the_served_dtype_when_training_computes_in_bfloat16(tiny_model):
    # the gate's pinned check asks what the served model writes: under bfloat16 autocast a near tie
    # rounds the other way, and a float32 server answers it as the check did not
    served = new_trainer(tiny_model)
    fast = LoraTrainer.load(tiny_model, LORA.model_copy(update={"precision": "bfloat16"}), build_objective("combined"),
                            device="cpu")  # fmt: skip
    prompts = [encode_turn(fast, question, "x")[1] for question in ("What time is it?", "Hello!", "Add milk.")]
    dtypes = []
    hook = fast.model.get_output_embeddings().register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    try:
        replies = fast.greedy_actions(prompts, [12] * len(prompts))
        with torch.no_grad(), fast._autocast():  # the hook sees bfloat16 where autocast is on
            fast.model(torch.tensor([prompts[0]]))
    finally:
        hook.remove()
    assert dtypes[-1] == torch.bfloat16 and set(dtypes[:-1]) == {torch.float32}
    assert replies == served.greedy_actions(prompts, [12] * len(prompts))


HOME, HOME_HINT = "What time is it at home?", "The user meant Lisbon time"


def hint_following_policy(tiny_model: Path, folder: Path) -> Path:
    """A policy that answers "Paris" but, told the user meant Lisbon, answers "Lisbon"."""
    plain = [SYSTEM, {"role": "user", "content": HOME}]
    hinted = [SYSTEM, {"role": "user", "content": HOME + f"\n\n[hint] {HOME_HINT}"}]
    return memorize(tiny_model, folder, [
        (plain, [], {"role": "assistant", "content": "In Paris it is 10:00."}),
        (hinted, [], {"role": "assistant", "content": "In Lisbon it is 09:00."}),
    ], steps=200)  # fmt: skip


def test_opd_pushes_up_the_action_a_hint_makes_more_likely_for_the_teacher(tiny_model, tmp_path):
    question, hint = HOME, HOME_HINT
    taught = hint_following_policy(tiny_model, tmp_path / "taught")
    trainer = new_trainer(taught, kind="opd")
    messages, prompt, response = encode_turn(trainer, question, "In Lisbon it is 09:00.")
    teacher_prompt = hinted_prompt_ids(trainer.tokenizer, messages, prompt, hint)
    assert teacher_prompt is not None and teacher_prompt[: len(prompt) - 8] == prompt[: len(prompt) - 8]
    with torch.no_grad():
        student = trainer.response_logprobs(prompt, response)
        teacher = trainer.response_logprobs(teacher_prompt, response)
    assert float((teacher - student).sum()) > 1.0  # the corrected action gets positive advantage overall

    behaviour = student.tolist()
    corrected = Sample("t1", prompt, response, behaviour, score=0, teacher_prompt_ids=teacher_prompt)
    unhinted = Sample("t2", prompt, response, behaviour, score=0)
    stats = trainer.step([corrected, unhinted], baseline=0.0)
    with torch.no_grad():
        after = trainer.response_logprobs(prompt, response)
    assert stats["adv_mean"] > 0
    assert float(after.sum()) > float(student.sum())


def test_hindsight_action_teaches_the_unhinted_policy_the_action_the_hinted_one_writes(tiny_model, tmp_path):
    question, hint = HOME, HOME_HINT
    taught = hint_following_policy(tiny_model, tmp_path / "taught")
    objective = build_objective("opd", hindsight="action")
    trainer = LoraTrainer.load(str(taught), LORA, objective, device="cpu")
    messages, prompt, wrong = encode_turn(trainer, question, "In Paris it is 10:00.")
    _, _, right = encode_turn(trainer, question, "In Lisbon it is 09:00.")
    teacher_prompt = hinted_prompt_ids(trainer.tokenizer, messages, prompt, hint)
    assert trainer.teacher_action(teacher_prompt, 32) == right  # the hinted policy writes the right action
    with torch.no_grad():
        before = trainer.response_logprobs(prompt, right).sum()
        behaviour = trainer.response_logprobs(prompt, wrong).tolist()
    corrected = Sample("t1", prompt, wrong, behaviour, score=-1, teacher_prompt_ids=teacher_prompt)
    for _ in range(3):
        stats = trainer.step([corrected], baseline=0.0)
    with torch.no_grad():
        after = trainer.response_logprobs(prompt, right).sum()
    assert stats["tokens"] == len(right) and float(after) > float(before) + 1.0
    # a teacher that would write what the student wrote has nothing to teach
    same = Sample("t2", teacher_prompt, right, [0.0] * len(right), score=0, teacher_prompt_ids=teacher_prompt)
    assert trainer.step([same], baseline=0.0)["tokens"] == 0.0


def test_a_wrong_action_with_a_hinted_action_is_pushed_down_only_where_the_two_differ(tiny_model, tmp_path):
    taught = hint_following_policy(tiny_model, tmp_path / "taught")
    trainer = LoraTrainer.load(str(taught), LORA, build_objective("combined", hindsight="action"), device="cpu")
    messages, prompt, wrong = encode_turn(trainer, HOME, "In Paris it is 10:00.")
    _, _, right = encode_turn(trainer, HOME, "In Lisbon it is 09:00.")
    teacher_prompt = hinted_prompt_ids(trainer.tokenizer, messages, prompt, HOME_HINT)
    with torch.no_grad():
        behaviour = trainer.response_logprobs(prompt, wrong).tolist()
    blamed = blamed_tokens(wrong, right)
    assert 0 < sum(blamed) < len(wrong)  # "In" and the end are shared
    corrected = Sample("t1", prompt, wrong, behaviour, score=-1, teacher_prompt_ids=teacher_prompt)
    assert trainer.step([corrected], baseline=0.0)["rl_tokens"] == sum(blamed)
    unhinted = Sample("t2", prompt, wrong, behaviour, score=-1)
    assert trainer.step([unhinted], baseline=0.0)["rl_tokens"] == len(wrong)  # no action: the whole response
    trainer.objective = build_objective("combined", hindsight="action", blame_unhinted=False)
    assert trainer.step([unhinted], baseline=0.0)["rl_tokens"] == 0.0  # ... or, blame_unhinted off, no token
    with torch.no_grad():
        thanked = Sample("t3", prompt, right, trainer.response_logprobs(prompt, right).tolist(), score=1)
    assert trainer.step([thanked], baseline=0.0)["rl_tokens"] == len(right)  # a +1 scores the whole response


# ----------------------------------------------------------------------------- learner around a store


@pytest.fixture
async def store(tmp_path) -> AsyncIterator[Store]:
    store = open_store(f"sqlite:///{tmp_path / 'whet.db'}")
    yield store
    await store.aclose()


def learner_config(**overrides) -> LearnerConfig:
    base = {"batch_size": 4, "batch_timeout_s": 3600, "lora": LORA.model_dump(),
            "gate": {"holdout_fraction": 0.0, "tolerance": 0.0}}  # fmt: skip
    return LearnerConfig.model_validate({**base, **overrides})


def counted_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Training steps that only note how many samples each took (in the list returned)."""
    steps: list[int] = []
    monkeypatch.setattr(LoraTrainer, "step", lambda self, samples, *a, **k: steps.append(len(samples)) or {})
    return steps


def make_learner(config: LearnerConfig, store: Store, bus: MemoryBus, model: Path, root: Path, **kw) -> Learner:
    def trainer() -> LoraTrainer:
        objective = objective_from_config(config.objective)
        return LoraTrainer.load(str(model), config.lora, objective, device="cpu")

    return Learner(config, store, bus, RulesJudge(), AdapterRegistry(store, bus, root), trainer=trainer, **kw)


async def judged_turn(store: Store, encoder: LoraTrainer, question: str, answer: str, score: int, split: str,
                      user: str = "alice", sampled_at: float | None = None, hint: str | None = None,
                      tool_result: str | None = None, judged: bool = True) -> str:  # fmt: skip
    """A recorded, closed turn with a verdict written directly (the split chosen by the test; ``judged``
    false: none, the learner's judge gives it).
    ``sampled_at``: the log-prob the engine recorded for every response token (default: the
    encoder's own, i.e. an on-policy turn). ``tool_result``: the recorded prompt ends with it, as the
    step after a tool call's does (its token ids stay the question's)."""
    session = await store.create_session(user)
    messages, prompt, response = encode_turn(encoder, question, answer)
    if tool_result is not None:
        messages = [*messages, {"role": "tool", "content": tool_result}]
    with torch.no_grad():
        behaviour = encoder.response_logprobs(prompt, response).tolist()
    if sampled_at is not None:
        behaviour = [sampled_at] * len(response)
    turn = await store.add_turn(TurnCreate(
        session_id=session.id, user_id=user, request_id=f"req-{session.id}", step=0, model="tiny",
        prompt_messages=messages, prompt_token_ids=prompt, response_text=answer,
        response_token_ids=response, response_logprobs=behaviour,
    ))  # fmt: skip
    await store.close_turn(turn.id, "feedback", {"score": score, "text": None})
    if not judged:
        return turn.id
    await store.save_judgment(Judgment(turn_id=turn.id, user_id=user, request_id=turn.request_id, score=score,
                                       hint=hint, reason="test", judge="test", split=split, trainable=True))  # fmt: skip
    return turn.id


QUESTIONS = ["What time is it?", "Tell me the time.", "Time now?", "What is the time please?"]
GOOD, BAD = "It is 09:00 in Lisbon.", "I cannot help with that."


async def seed_preferences(store: Store, encoder: LoraTrainer, *, train_scores: tuple[int, int]) -> list[str]:
    """Held-out turns: GOOD +1, BAD -1. Training turns: GOOD and BAD with ``train_scores``."""
    for q in QUESTIONS[:2]:
        await judged_turn(store, encoder, q, GOOD, +1, "holdout")
        await judged_turn(store, encoder, q, BAD, -1, "holdout")
    trained = []
    for q in QUESTIONS:
        trained.append(await judged_turn(store, encoder, q, GOOD, train_scores[0], "train"))
        trained.append(await judged_turn(store, encoder, q, BAD, train_scores[1], "train"))
    return trained


@pytest.mark.anyio
@pytest.mark.parametrize(("scores", "accepted"), [((+1, -1), True), ((-1, +1), False)], ids=["true", "inverted"])
async def test_the_gate_rejects_a_candidate_trained_on_inverted_rewards(tiny_model, tmp_path, store, scores, accepted):
    config = learner_config(batch_size=8, objective={"kind": "rl"},
                            lora={**LORA.model_dump(), "learning_rate": 2e-2})  # fmt: skip
    bus = MemoryBus()
    learner = make_learner(config, store, bus, tiny_model, tmp_path / "adapters")
    await seed_preferences(store, new_trainer(tiny_model), train_scores=scores)
    [version] = await learner.train_ready()
    row = await store.get_adapter(version)
    gate = row.metrics["gate"]
    assert gate["holdout_turns"] == 4 and gate["accepted"] is accepted
    assert row.status == ("live" if accepted else "rejected"), gate
    assert (gate["preference_margin"] > 0) is accepted
    live = await store.live_adapter("global")
    assert (live.id if live else None) == (version if accepted else None)


TIME_TOOL = {"type": "function", "function": {"name": "now", "description": "The time in a city.",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_a_recorded_prompt_relessoned_is_the_prompt_the_agent_would_build_with_the_lessons_it_shows_now(tiny_model):
    tokenizer = new_trainer(tiny_model).tokenizer
    asked = [SYSTEM, {"role": "user", "content": "What time is it back home?"}]

    def served(lessons: list[str]) -> tuple[list[dict], list[int]]:
        messages = prompt_with_lessons(asked, lessons, "unused")
        return messages, tokenizer.encode(prompt_text(tokenizer, messages, [TIME_TOOL]), add_special_tokens=False)

    then = served(["Dad lives in Honolulu."])
    for now in (["The user meant Seoul time.", "Dad lives in Honolulu."], [], ["Dad lives in Honolulu."]):
        assert relessoned(tokenizer, *then, now) == served(now)  # the tool schemas kept as recorded
    assert relessoned(tokenizer, asked[1:], then[1], ["x"]) is None  # no system prompt to put them in
    # ids another tokenizer split differently do not survive decoding: the recorded prompt stays
    at = next(i for i, t in enumerate(then[1]) if len(tokenizer.decode([t])) > 1 and tokenizer.decode([t]).isalpha())
    chars = [i for c in tokenizer.decode([then[1][at]]) for i in tokenizer.encode(c, add_special_tokens=False)]
    split = then[1][:at] + chars + then[1][at + 1:]
    assert tokenizer.decode(split) == tokenizer.decode(then[1]) and relessoned(tokenizer, then[0], split, []) is None


async def one_good_step(learner: Learner, store: Store, model: Path, root: Path) -> tuple[LoraTrainer, dict]:
    """Each of QUESTIONS answered GOOD and thanked, then one step of ``learner`` (adapters under ``root``): an
    encoder of ``model``, and the step's trainer state."""
    encoder = new_trainer(model)
    for q in QUESTIONS:
        await judged_turn(store, encoder, q, GOOD, +1, "train")
    [version] = await learner.train_ready()
    return encoder, json.loads((root / "global" / version / TRAINER_STATE).read_text())


@pytest.mark.anyio
@pytest.mark.parametrize("relesson", [True, False])
async def test_a_step_trains_each_sample_on_the_lessons_its_request_is_shown_now(
    tiny_model, tmp_path, store, monkeypatch, relesson
):
    asked, trained = [], []

    async def recall(user_id: str, query: str) -> list[str]:
        asked.append((user_id, query))
        return [f"The user meant Seoul time ({query})"]

    monkeypatch.setattr(LoraTrainer, "step", lambda self, samples, *a, **k: trained.extend(samples) or {})
    learner = make_learner(learner_config(relesson=relesson), store, MemoryBus(), tiny_model, tmp_path, recall=recall)
    encoder, state = await one_good_step(learner, store, tiny_model, tmp_path)
    assert state["relessoned"] == (4 if relesson else 0)
    prompts = [encoder.tokenizer.decode(s.prompt_ids) for s in trained]
    assert len(prompts) == 4
    if relesson:
        assert sorted(asked) == sorted(("alice", q) for q in QUESTIONS)
        assert sorted(prompts) == sorted(prompt_text(encoder.tokenizer, prompt_with_lessons(
            [SYSTEM, {"role": "user", "content": q}], [f"The user meant Seoul time ({q})"], ""), None) for q in QUESTIONS)
    else:
        assert asked == [] and not any("Seoul" in p for p in prompts)


def now_call(city: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "now", "arguments": {"timezone": city}}) + "\n</tool_call>"


@pytest.mark.anyio
@pytest.mark.parametrize("lessons", [True, False])
async def test_rehearsal_can_show_each_drawn_item_the_lessons_its_request_would_be_shown_now(
    tiny_model, tmp_path, store, monkeypatch, lessons
):
    """learner.rehearsal.lessons: a general request beside the user's lesson that only reads like it is rehearsed
    with that lesson in its prompt too, so that the weights learn to answer it as it asks."""
    asked, rehearsed = [], []
    lesson = "When asked \"Remind me to call Tom.\": the user keeps reminders on the errands list"

    async def recall(user_id: str, query: str) -> list[str]:
        asked.append((user_id, query))
        return [lesson] if "reminders" in query else []

    call = "<tool_call>\n" + json.dumps({"name": "add_note", "arguments": {"text": "buy milk", "list_name": "reminders"}}) \
        + "\n</tool_call>"
    records = [{"messages": [SYSTEM, {"role": "user", "content": "Put buy milk on the reminders list."}], "response": call},
               {"messages": [SYSTEM, {"role": "user", "content": "What time is it in Oslo?"}], "response": now_call("Oslo")}]
    monkeypatch.setattr(LoraTrainer, "step", lambda self, samples, baseline, rehearsal=(), *a, **k:
                        rehearsed.extend(rehearsal) or {})  # fmt: skip
    config = learner_config(rehearsal={"per_step": 2, "lessons": lessons, "anchor_weight": 0.0})
    learner = make_learner(config, store, MemoryBus(), tiny_model, tmp_path, recall=recall,
                           rehearsal=lambda tokenizer: encode_records(records, tokenizer),
                           rehearsal_messages=[r["messages"] for r in records])  # fmt: skip
    encoder, state = await one_good_step(learner, store, tiny_model, tmp_path)
    assert state["rehearsal_lessoned"] == (1 if lessons else 0)
    tok = encoder.tokenizer
    written = {r["messages"][1]["content"]: r for r in records}
    prompts = {tok.decode(p): tok.decode(r) for p, r in rehearsed}
    assert len(prompts) == (3 if lessons else 2) and set(prompts.values()) == {tok.decode(tok.encode(r["response"] + tok.eos_token,
                                                                                   add_special_tokens=False))
                                                           for r in records}  # fmt: skip
    milk = written["Put buy milk on the reminders list."]["messages"]
    assert prompt_text(tok, milk, None) in prompts  # as written, what the gate's pinned turns ask, and ...
    assert (prompt_text(tok, prompt_with_lessons(milk, [lesson], ""), None) in prompts) is lessons  # ... with the lesson
    assert prompt_text(tok, written["What time is it in Oslo?"]["messages"], None) in prompts  # nothing shown: as written
    rehearsal_asked = {q for _, q in asked} & set(written)
    assert rehearsal_asked == (set(written) if lessons else set())
    assert all(user == "alice" for user, _ in asked)


@pytest.mark.anyio
async def test_a_wrong_call_that_copied_a_value_from_a_shown_lesson_trains_no_negative_but_keeps_its_hint(
    tiny_model, tmp_path, store, monkeypatch
):
    trained = []
    sams = "When asked \"What time is it at Sam's place?\": calling now({\"timezone\": \"Tokyo\"}) was right"

    async def recall(user_id: str, query: str) -> list[str]:
        return [sams, "The user keeps notes on the homework list"]

    monkeypatch.setattr(LoraTrainer, "step", lambda self, samples, *a, **k: trained.extend(samples) or {})
    learner = make_learner(learner_config(batch_size=4), store, MemoryBus(), tiny_model, tmp_path, recall=recall)
    encoder = new_trainer(tiny_model)
    home, hint = "What's the time back home?", "The user meant Lisbon time"
    copied = await judged_turn(store, encoder, home, now_call("Tokyo"), -1, "train", hint=hint)
    made_up = await judged_turn(store, encoder, home, now_call("Paris"), -1, "train", hint=hint)
    part_of_a_word = await judged_turn(store, encoder, home, now_call("work"), -1, "train")  # "homework" is not "work"
    right = await judged_turn(store, encoder, "Time at Sam's?", now_call("Tokyo"), +1, "train")
    await learner.train_ready()
    assert {s.turn_id: s.score for s in trained} == {copied: 0, made_up: -1, part_of_a_word: -1, right: +1}
    hinted = {s.turn_id for s in trained if s.teacher_prompt_ids}
    assert hinted == {copied, made_up}  # the copied call's hint still teaches the right one


def _replaying(tiny_model, tmp_path, store, monkeypatch, **config: object):
    """A learner with ``config`` whose steps record their samples (``steps``) and train nothing, and
    ``step(hinted, plain)``: a hinted -1 and a +1 turn, one step on them; its hinted turn, version and state."""
    steps: list[list] = []
    monkeypatch.setattr(LoraTrainer, "step", lambda self, samples, *a, **k: steps.append(list(samples)) or {})
    learner = make_learner(learner_config(batch_size=2, backoff=0, **config), store, MemoryBus(), tiny_model, tmp_path)
    encoder = new_trainer(tiny_model)

    async def step(hinted: str, plain: str, hint: str = "The user meant Lisbon time") -> tuple[str, str, dict]:
        wrong = await judged_turn(store, encoder, hinted, BAD, -1, "train", hint=hint)
        await judged_turn(store, encoder, plain, GOOD, +1, "train")
        [version] = await learner.train_ready()
        return wrong, version, json.loads((tmp_path / "global" / version / TRAINER_STATE).read_text())

    return steps, learner, encoder, step


@pytest.mark.anyio
async def test_a_hint_whose_step_was_turned_away_is_taught_again_beside_later_batches_newest_first(
    tiny_model, tmp_path, store, monkeypatch
):
    steps, learner, encoder, step = _replaying(tiny_model, tmp_path, store, monkeypatch, replay_hints=2, replay_taught=0)
    # an answer read off a tool result trains as a success, its hint dropped: nothing of it to teach again
    read_off = await judged_turn(store, encoder, "Time?", GOOD, -1, "train", hint="The user meant Lisbon time",
                                 tool_result='{"time": "09:00"}')  # fmt: skip
    learner.config.batch_size = 3
    first, v1, state = await step(QUESTIONS[0], QUESTIONS[1])
    assert state["replayed"] == [] and len(steps[-1]) == 3 and read_off in state["batch"]  # nothing turned away yet
    learner.config.batch_size = 2
    await store.update_adapter(v1, status="rejected")
    second, v2, state = await step(QUESTIONS[2], QUESTIONS[3])
    taught = steps[-1]
    assert state["batch"] == [t.turn_id for t in taught[:2]] and second in state["batch"]
    assert state["replayed"] == [first] and taught[2].turn_id == first and taught[2].teacher_prompt_ids
    assert (await store.get_judgment(first)).trained_in == v1  # still consumed by its own step
    await store.update_adapter(v2, status="rejected")
    third, v3, state = await step("Time in Lisbon?", "Clock?")
    assert state["replayed"] == [second, first]  # newest first
    await store.promote_adapter(v3)
    _, v4, state = await step("Lisbon hour?", "Hour?")
    assert state["replayed"] == [second, first] and third not in state["replayed"]  # v3's hint is in the live weights
    assert (await store.get_adapter(v4)).metrics["replayed"] == 2
    learner.config.replay_hints = 0
    _, _, state = await step("Hour in Lisbon?", "Now?")
    assert state["replayed"] == [] and len(steps[-1]) == 2


@pytest.mark.anyio
async def test_replay_taught_trains_the_hints_the_live_lineage_learned_again_beside_each_batch(
    tiny_model, tmp_path, store, monkeypatch
):
    # the user's other requests of a kind, taught again: a step that learns Mum's city must see that back home
    # was Lisbon (bench runs DQ, DT: the weights wrote one learned city into every "time at ..." request)
    steps, _, _, step = _replaying(tiny_model, tmp_path, store, monkeypatch, replay_taught=2)
    _, v1, state = await step(QUESTIONS[0], QUESTIONS[1])
    assert state["replayed"] == [] and len(steps[-1]) == 2  # nothing taught yet
    await store.update_adapter(v1, status="rejected")
    second, v2, state = await step(QUESTIONS[2], QUESTIONS[3])
    assert state["replayed"] == []  # a rejected step's hint is replay_hints' to teach, not this
    await store.promote_adapter(v2)
    third, v3, state = await step("Time in Lisbon?", "Clock?")
    assert state["replayed"] == [second] and steps[-1][2].turn_id == second and steps[-1][2].teacher_prompt_ids
    assert (await store.get_judgment(second)).trained_in == v2  # still v2's: replaying marks nothing
    await store.promote_adapter(v3)
    fourth, v4, state = await step("Lisbon hour?", "Hour?")
    assert state["replayed"] == [third, second]  # newest first, the whole live lineage
    await store.promote_adapter(v4)
    _, _, state = await step("Hour in Lisbon?", "Now?")
    assert state["replayed"] == [fourth, third], "at most replay_taught"
    await store.update_adapter(v4, status="retired")
    await store.promote_adapter(v3)  # a rollback: v4's hint is no longer in the live weights
    _, _, state = await step("Lisbon now?", "Time now?")
    assert state["replayed"] == [third, second]


@pytest.mark.anyio
async def test_replay_spread_takes_the_newest_sample_of_each_hint_before_a_second_of_any(
    tiny_model, tmp_path, store, monkeypatch
):
    # jun asks about home twice in 32 interactions and about distances a dozen times: newest first, the home
    # sample left the replay after a step or two; spread, each value the lineage was taught stays in it
    steps, learner, _, step = _replaying(tiny_model, tmp_path, store, monkeypatch, replay_taught=3,
                                         replay_order="spread")  # fmt: skip
    taught = []
    for question, hint in [("Time at home?", "The user meant Seoul time"), ("How far is 5 km?", "The user meant meters"),
                           ("How far is 7 km?", "The user meant meters"), ("Time for Dad?", "The user meant Honolulu time"),
                           ("How far is 9 km?", "The user meant  Meters")]:  # fmt: skip
        wrong, version, _ = await step(question, "Clock?", hint)
        await store.promote_adapter(version)
        taught.append(wrong)
    home, km5, km7, dad, km9 = taught
    _, _, state = await step("Lisbon now?", "Time now?")
    assert state["replayed"] == [km9, dad, home]  # one of each hint (the same words, however spaced or cased)
    assert [s.turn_id for s in steps[-1][2:]] == [km9, dad, home] and all(s.teacher_prompt_ids for s in steps[-1][2:])
    learner.config.replay_taught = 5
    _, _, state = await step("Lisbon hour?", "Hour?")
    lisbon = state["replayed"][0]
    assert lisbon not in taught and state["replayed"] == [lisbon, km9, dad, home, km7]  # then km's second newest
    learner.config.replay_order = "newest"
    _, _, state = await step("Hour in Lisbon?", "Now?")
    assert state["replayed"][2:] == [km9, dad, km7] and home not in state["replayed"]


@pytest.mark.anyio
async def test_a_lineage_whose_candidates_were_turned_away_waits_for_twice_the_samples_each_time_unless_forced(
    tiny_model, tmp_path, store, monkeypatch
):
    steps = counted_steps(monkeypatch)
    learner = make_learner(learner_config(batch_size=2, batch_timeout_s=0.01, backoff=2), store, MemoryBus(),
                           tiny_model, tmp_path)  # fmt: skip
    encoder = new_trainer(tiny_model)
    asked = iter(range(100))

    async def arrive(n: int) -> None:
        for _ in range(n):
            await judged_turn(store, encoder, f"What time is it in city {next(asked)}?", GOOD, +1, "train")
        await anyio.sleep(0.05)  # past batch_timeout_s

    async def turned_away() -> str:
        [version] = await learner.train_ready()
        await store.update_adapter(version, status="rejected")
        return version

    await arrive(1)
    await turned_away()  # a partial batch, on the timeout
    assert steps == [1]
    await arrive(3)
    status = await learner.status()
    assert (status["busy"], status["deferred"]) == (False, 3), "3 of the 4 samples the step now waits for"
    assert await learner.train_ready() == [] and steps == [1], "no timeout while backing off"
    await arrive(1)
    assert (await learner.status())["busy"] is True
    await turned_away()
    assert steps == [1, 4]  # batch_size * 2
    await arrive(9)
    await turned_away()
    assert steps == [1, 4, 8]  # batch_size * 4
    assert (await learner.status())["deferred"] == 1
    await arrive(8)
    await turned_away()
    assert steps == [1, 4, 8, 8], "at most batch_size * 2**backoff"
    assert await learner.train_ready() == []
    [forced] = await learner.train_ready(force=True)
    assert steps == [1, 4, 8, 8, 1]
    await store.promote_adapter(forced)  # a promotion: the next step is the live version's first
    await arrive(1)
    assert len(await learner.train_ready()) == 1 and steps == [1, 4, 8, 8, 1, 1]
    learner.config.backoff = 0
    await store.update_adapter((await store.live_adapter("global")).id, status="rejected")
    await arrive(1)
    assert len(await learner.train_ready()) == 1 and steps[-1] == 1, "backoff 0: every batch as it comes"


@pytest.mark.anyio
@pytest.mark.parametrize("scope", ["global", "user"])
async def test_a_lineage_asked_to_train_now_trains_what_it_has_waiting_in_one_step_backoff_or_not(
    tiny_model, tmp_path, store, monkeypatch, scope
):
    steps = counted_steps(monkeypatch)
    learner = make_learner(learner_config(batch_size=2, batch_timeout_s=3600, backoff=2, scope=scope), store,
                           MemoryBus(), tiny_model, tmp_path)  # fmt: skip
    encoder = new_trainer(tiny_model)
    asked = iter(range(100))

    async def arrive(n: int, user: str = "alice") -> None:
        for _ in range(n):
            await judged_turn(store, encoder, f"What time is it in city {next(asked)}?", GOOD, +1, "train", user=user)

    await arrive(3)
    [version] = await learner.train_ready()  # a full batch
    await store.update_adapter(version, status="rejected")  # the lineage backs off: 4 samples, no timeout
    assert steps == [2] and (await learner.status())["deferred"] == 1
    assert learner.train_now("alice") == (None if scope == "global" else "alice")
    assert (await learner.status())["busy"] is True, "asked for: its waiting sample is work in hand"
    await arrive(9)
    await arrive(1, user="bob")  # another user's: their own lineage in user scope, alice's in global
    [version] = await learner.train_ready()
    assert steps == [2, 8], "everything waiting, up to batch_size * 2**backoff"
    await store.update_adapter(version, status="rejected")
    assert await learner.train_ready() == [], "asked once: what is left waits as before"
    left = 3 if scope == "global" else 2
    status = await learner.status()
    assert (status["busy"], status["deferred"]) == (scope == "user", left), "bob's own lineage has a batch's timeout"
    learner.train_now("alice")
    made = await learner.train_ready()
    assert steps[2:] == ([3] if scope == "global" else [2]) and len(made) == 1, "only the asking user's lineage"


@pytest.mark.anyio
async def test_an_asked_step_that_fails_is_still_asked_at_the_next_round(tiny_model, tmp_path, store, monkeypatch):
    steps = counted_steps(monkeypatch)
    learner = make_learner(learner_config(batch_size=8), store, MemoryBus(), tiny_model, tmp_path)
    encoder = new_trainer(tiny_model)
    for question in QUESTIONS[:3]:
        await judged_turn(store, encoder, question, GOOD, +1, "train")
    real, failures = learner._train_step, iter([OSError("the store went away")])

    async def flaky(*args: object) -> str:
        if (error := next(failures, None)) is not None:
            raise error
        return await real(*args)

    monkeypatch.setattr(learner, "_train_step", flaky)
    learner.train_now("alice")
    with pytest.raises(OSError):
        await learner.train_ready()
    assert (await learner.status())["busy"] is True
    [_] = await learner.train_ready()
    assert steps == [3], "the ask outlived the failed round"


@pytest.mark.anyio
async def test_a_step_asked_for_takes_the_verdict_being_made_when_it_was_asked(tiny_model, tmp_path, store, monkeypatch):
    steps = counted_steps(monkeypatch)
    learner = make_learner(learner_config(batch_size=8), store, MemoryBus(), tiny_model, tmp_path)
    encoder = new_trainer(tiny_model)
    await judged_turn(store, encoder, "What time is it?", GOOD, +1, "train")
    last = await judged_turn(store, encoder, "Time now?", GOOD, +1, "train", judged=False)
    rules, release = learner.judge, anyio.Event()

    class Slow:  # the judge of the bus's follower, mid-verdict when the step is asked for (a lesson check: ~30 s)
        async def judge(self, *args: object) -> object:
            await release.wait()
            return await rules.judge(*args)

    learner.judge = Slow()

    async def released() -> None:
        await anyio.sleep(0.3)
        release.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner.judge_turn, last)
            await anyio.sleep(0.05)
            learner.train_now("alice")
            tg.start_soon(released)
            [version] = await learner.train_ready()
    assert steps == [2], "the ask came after the last turn closed: its verdict is in the step"
    assert (await store.get_judgment(last)).trained_in == version


@pytest.mark.anyio
async def test_a_hint_that_names_nothing_trains_its_sample_on_the_score_alone(tiny_model, tmp_path, store, monkeypatch):
    # "The user had to ask again: ..." and "The user said it was wrong: ..." say only that the action was
    # wrong: a teacher shown them writes another guess, which the student would learn as the right action
    steps: list[list] = []
    monkeypatch.setattr(LoraTrainer, "step", lambda self, samples, *a, **k: steps.append(list(samples)) or {})
    learner = make_learner(learner_config(batch_size=3, replay_hints=8), store, MemoryBus(), tiny_model, tmp_path)
    encoder = new_trainer(tiny_model)
    asked = await judged_turn(store, encoder, QUESTIONS[0], BAD, -1, "train",
                              hint=REQUERY_HINT + "Is it late at home? Please answer")  # fmt: skip
    wrong = await judged_turn(store, encoder, QUESTIONS[1], BAD, -1, "train", hint=WRONG_HINT + "No, that's not right")
    named = await judged_turn(store, encoder, QUESTIONS[2], BAD, -1, "train", hint="The user meant Lisbon time")
    [version] = await learner.train_ready()
    taught = {s.turn_id: s for s in steps[-1]}
    assert set(taught) == {asked, wrong, named}
    assert taught[asked].teacher_prompt_ids is None and taught[wrong].teacher_prompt_ids is None
    assert taught[asked].score == taught[wrong].score == -1
    assert taught[named].teacher_prompt_ids is not None
    await store.update_adapter(version, status="rejected")  # a step turned away: only a hint that teaches is replayed
    assert [t.id for _, t in await learner._replayed_hints(None, None)] == [named]


@pytest.mark.anyio
async def test_a_pinned_turn_the_base_answers_wrong_is_not_held_against_a_candidate(tiny_model, tmp_path, store,
                                                                                   monkeypatch):  # fmt: skip
    """The gate keeps the skill the model came with: a pinned turn counts as kept by the live version only where
    the base model (adapter off) keeps it too, read once and reused for every later live version."""
    learner = make_learner(learner_config(), store, MemoryBus(), tiny_model, tmp_path)
    trainer = learner._trainer_now()
    regression = [encode_turn(trainer, q, "Hello!")[1:] for q in ("Hi.", "Note that the key is with Tom.", "Hey.")]
    learner._pinned = [PinnedAction.of({"messages": [], "response": "Hello!"})] * len(regression)
    reads = []

    def kept(self, trainer, regression, guesses):
        off = any(getattr(m, "disable_adapters", None) is True for m in trainer.model.modules())
        reads.append("base" if off else "live")
        return ([True, False, True] if off else [True, True, True]), [[0]] * len(regression)

    monkeypatch.setattr(Learner, "_kept", kept)
    _, first, _ = learner._regression_before(trainer, "global-0001", regression)
    assert first == [True, False, True] and sorted(reads) == ["base", "live"]
    _, second, _ = learner._regression_before(trainer, "global-0002", regression)
    assert second == [True, False, True] and reads[2:] == ["live"]  # the base's answers are read once


@pytest.mark.anyio
async def test_a_pinned_call_the_base_makes_by_a_hair_is_not_held_against_a_candidate(tiny_model, tmp_path, store,
                                                                                     monkeypatch):  # fmt: skip
    """A pinned call whose base reply has a token within ``gate.pinned_tie_margin`` nats of another is a near
    tie that any step's noise may tip: the greedy check leaves it out. A pinned call made surely, and a pinned
    answer (the margin is about calls), stay counted; a margin of 0 counts them all."""
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "23 + 24"}}\n</tool_call>'
    pinned = [PinnedAction.of({"messages": [], "response": call})] * 2 + [PinnedAction.of({"messages": [], "response": "Hi!"})]
    gaps = [[3.0, 1.2], [3.0, 0.03], [0.01]]  # surely, by a hair, an answer
    for margin, counted in ((0.5, [True, False, True]), (0.0, [True, True, True])):
        learner = make_learner(learner_config(gate={"pinned_tie_margin": margin}), store, MemoryBus(), tiny_model,
                               tmp_path / str(margin))  # fmt: skip
        trainer = learner._trainer_now()
        regression = [encode_turn(trainer, q, "Hello!")[1:] for q in ("What's 23 plus 24?", "What's 2 plus 2?", "Hi.")]
        learner._pinned = pinned
        monkeypatch.setattr(Learner, "_kept", lambda self, trainer, regression, guesses: (
            [True] * 3, [[i] for i in range(3)]))
        monkeypatch.setattr(LoraTrainer, "reply_gaps", lambda self, prompts, replies: [gaps[r[0]] for r in replies])
        _, kept, _ = learner._regression_before(trainer, None, regression)
        assert kept == counted


def test_reply_gaps_say_how_near_greedy_decoding_is_to_leaving_a_reply(hello_policy):
    """Along the reply the policy writes greedily every token is likelier than any other (gaps above 0); along
    another, the tokens it would not write have gaps below 0."""
    policy, chat = hello_policy
    trainer = new_trainer(policy)
    _, prompt, written = encode_turn(trainer, "Say hello.", "Hello!")
    [greedy] = trainer.greedy_actions([prompt], [len(written) + 4])
    assert greedy == written
    [own, other] = trainer.reply_gaps([prompt, prompt], [written, encode_turn(trainer, "Say hello.", "Goodbye.")[2]])
    assert len(own) == len(written) and min(own) > 0
    assert min(other) < 0


@pytest.fixture(scope="module")
def hello_policy(tiny_model, tmp_path_factory) -> tuple[Path, list[dict]]:
    """The tiny model taught to answer "Say hello." with "Hello!"."""
    chat = [SYSTEM, {"role": "user", "content": "Say hello."}]
    folder = tmp_path_factory.mktemp("hello")
    return memorize(tiny_model, folder, [(chat, [], {"role": "assistant", "content": "Hello!"})]), chat


CALL_FOR_HELLO = '<tool_call>\n{"name": "add_note", "arguments": {"text": "hello"}}\n</tool_call>'


@pytest.mark.anyio
@pytest.mark.parametrize(("checked", "accepted"), [(0, False), (None, True)], ids=["checked", "unchecked"])
async def test_the_gate_rejects_a_candidate_whose_greedy_reply_breaks_a_pinned_turn(
    hello_policy, tmp_path, store, checked, accepted
):
    """A step pushing a tool call onto pinned small talk breaks its greedy reply while the pinned
    reply's likelihood stays within a (here lax) tolerance: the greedy check is what rejects it."""
    policy, chat = hello_policy
    torch.manual_seed(0)  # the adapter's draw: the test's outcome must not hang on the tests before it
    # the anchor, which holds small talk's odds of a call, is off: this is the greedy check's test
    config = learner_config(batch_size=8, objective={"kind": "rl"},
                            lora={**LORA.model_dump(), "learning_rate": 5e-2, "epochs": 4},
                            rehearsal={"anchor_weight": 0.0},
                            gate={"holdout_fraction": 0.0, "regression_tolerance": 100.0,
                                  "regression_total_tolerance": None, "regression_actions_lost": checked})  # fmt: skip
    encoder = new_trainer(policy)
    pinned = encode_turn(encoder, "Say hello.", "Hello!")[1:]
    learner = make_learner(config, store, MemoryBus(), policy, tmp_path / "adapters",
                           regression=lambda tokenizer: [pinned],
                           pinned=[PinnedAction.of({"messages": chat, "response": "Hello!"})])  # fmt: skip
    for _ in range(8):
        # recorded as if sampled with certainty: the importance ratio stays below its clip, so every
        # pass pushes the taught reply up (on-policy, the clip ends a step long before it moves a
        # memorized greedy reply)
        await judged_turn(store, encoder, "Say hello.", CALL_FOR_HELLO, 1, "train", sampled_at=0.0)
    [version] = await learner.train_ready()
    row = await store.get_adapter(version)
    gate = row.metrics["gate"]
    assert row.status == ("live" if accepted else "rejected"), gate["reason"]
    if checked is not None:
        assert gate["regression_actions_kept"] == [1, 0] and gate["regression_actions_lost"] == 1
    else:
        assert gate["regression_actions_kept"] is None


@pytest.mark.anyio
@pytest.mark.parametrize("tolerance", [0.05, 100.0], ids=["likelihood-decides", "greedy-check-decides"])
async def test_a_candidate_the_regression_set_turns_away_is_not_replayed_further(hello_policy, tmp_path, store,
                                                                                monkeypatch, tolerance):
    """The gate's checks must all pass, so once the pinned turns' likelihood alone turns a candidate away, its
    held-out turns are not replayed and its pinned turns not decoded: the decision is the same, its time saved.
    With a lax likelihood tolerance the same candidate is replayed in full, and the greedy check turns it away."""
    policy, chat = hello_policy
    torch.manual_seed(0)
    config = learner_config(batch_size=8, objective={"kind": "rl"},
                            lora={**LORA.model_dump(), "learning_rate": 5e-2, "epochs": 4},
                            rehearsal={"anchor_weight": 0.0},
                            gate={"holdout_fraction": 0.0, "regression_tolerance": tolerance,
                                  "regression_total_tolerance": tolerance if tolerance < 1 else None,
                                  "regression_actions_lost": 0})  # fmt: skip
    encoder = new_trainer(policy)
    pinned = encode_turn(encoder, "Say hello.", "Hello!")[1:]
    learner = make_learner(config, store, MemoryBus(), policy, tmp_path / "adapters",
                           regression=lambda tokenizer: [pinned],
                           pinned=[PinnedAction.of({"messages": chat, "response": "Hello!"})])  # fmt: skip
    decoded = []
    kept = learner._kept
    monkeypatch.setattr(learner, "_kept", lambda *args: decoded.append(1) or kept(*args))
    for _ in range(2):
        await judged_turn(store, encoder, "Say hello.", "Hello!", 1, "holdout")
    for _ in range(8):
        await judged_turn(store, encoder, "Say hello.", CALL_FOR_HELLO, 1, "train", sampled_at=0.0)
    [version] = await learner.train_ready()
    row = await store.get_adapter(version)
    gate = row.metrics["gate"]
    state = json.loads((Path(row.path) / TRAINER_STATE).read_text())
    assert row.status == "rejected", gate
    if tolerance < 1:
        assert gate["reason"].startswith("regression set likelihood fell") and gate["skipped"] == ["holdout", "actions"]
        assert gate["holdout_turns"] == 0 and gate["regression_actions_kept"] is None
        assert len(decoded) == 1  # the live version's greedy check, before the step; none after it
        assert state["skipped"] == ["holdout", "actions"] and state["holdout"] == [] and state["actions"] == []
    else:
        assert "pinned turn(s)" in gate["reason"] and "skipped" not in gate and not state["skipped"]
        assert gate["holdout_turns"] == 2 and gate["regression_actions_kept"] == [1, 0]
        assert len(decoded) == 2


@pytest.mark.anyio
async def test_a_promoted_candidate_is_not_replayed_again_as_the_live_version(hello_policy, tmp_path, store):
    """The regression set's log-probs and greedy checks read after a step, with the candidate's weights, are the
    live version's once the gate promotes it: the next step reuses them (a replay of every pinned turn saved)
    and they are what a fresh replay of the saved adapter reads."""
    policy, chat = hello_policy
    config = learner_config(batch_size=2, gate={"holdout_fraction": 0.0, "regression_tolerance": 100.0,
                                                "regression_total_tolerance": None, "regression_actions_lost": 100})  # fmt: skip
    encoder = new_trainer(policy)
    regression = [encode_turn(encoder, "Say hello.", "Hello!")[1:], encode_turn(encoder, "Say hi.", "Hi!")[1:]]
    learner = make_learner(config, store, MemoryBus(), policy, tmp_path / "adapters",
                           regression=lambda tokenizer: regression,
                           pinned=[PinnedAction.of({"messages": chat, "response": "Hello!"})] * 2)  # fmt: skip
    for _ in range(2):
        await judged_turn(store, encoder, "Say hello.", "Hello there!", 1, "train")
    [version] = await learner.train_ready()
    live = await store.live_adapter("global", None)
    assert live is not None and live.id == version
    trainer = learner._trainer_now()
    trainer.reset(Path(live.path))
    reused = learner._regression_before(trainer, version, regression)
    assert learner._regression_candidate is not None and reused[0] is learner._regression_candidate[1]
    learner._regression_candidate = learner._regression_live = None
    fresh = learner._regression_before(trainer, version, regression)
    assert reused[0] == pytest.approx(fresh[0], abs=1e-5)
    assert reused[1:] == fresh[1:]
    # the base model's log-probs, recorded with the first step (whose live version was the base), are what
    # switching the live adapter off reads: what the gate bounds a lineage's drift from
    state = json.loads((Path(live.path) / TRAINER_STATE).read_text())
    assert state["regression_base"] == [before for _, before, _ in state["regression"]]
    learner._regression_candidate = learner._regression_live = learner._kept_by_base = learner._regression_base = None
    learner._regression_before(trainer, version, regression)
    assert learner._regression_base == pytest.approx(state["regression_base"], abs=1e-5)


class Crash(Exception):
    """Stands in for the process dying at a chosen point of a training step."""


@pytest.mark.anyio
async def test_the_trainer_and_its_greedy_sets_load_when_the_first_sample_arrives_not_at_its_step(
    tiny_model, tmp_path, store
):
    bus, loads = MemoryBus(), []
    learner = make_learner(learner_config(batch_size=8, poll_s=0.1), store, bus, tiny_model, tmp_path,
                           rehearsal=lambda tokenizer: loads.append("rehearsal") or [])  # fmt: skip
    async with anyio.create_task_group() as tg:
        await tg.start(learner.run)
        await anyio.sleep(0.5)
        assert not learner.ready and loads == []  # nothing to train: nothing loaded
        await judged_turn(store, new_trainer(tiny_model), "Hello?", "Hi.", 1, "train")
        with anyio.fail_after(60):
            while not learner.ready or not loads:
                await anyio.sleep(0.05)  # one sample of a batch of 8: loaded before its step
        assert (await learner.status())["steps"] == 0
        trainer = learner._trainer
        await learner.prepare()
        assert learner._trainer is trainer and loads == ["rehearsal"]  # once
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("point", ["before_step", "after_step", "before_publish", "after_save"])
async def test_a_learner_killed_mid_batch_trains_every_turn_exactly_once_after_restart(
    tiny_model, tmp_path, store, point
):
    config = learner_config(batch_size=4)
    root = tmp_path / "adapters"
    encoder = new_trainer(tiny_model)
    turns = []
    for i in range(12):
        turns.append(await judged_turn(store, encoder, QUESTIONS[i % 4], GOOD if i % 2 else BAD, 1 if i % 2 else -1,
                                       "train"))  # fmt: skip
    calls = {"n": 0}

    def die_in_second_step(at: str) -> None:
        if at == point:
            calls["n"] += 1
            if calls["n"] == 2:
                raise Crash(at)

    first = make_learner(config, store, MemoryBus(), tiny_model, root, on_step=die_in_second_step)
    await first.train_ready()  # step 1 completes
    with pytest.raises(Crash):
        await first.train_ready()  # step 2 dies at `point`

    second = make_learner(config, store, MemoryBus(), tiny_model, root)
    await second.recover()
    while await second.train_ready(force=True):
        pass
    # the live lineage, newest to oldest, and the batches its steps trained on
    live = await store.live_adapter("global")
    batches, version = [], live.id
    while version is not None:
        state = json.loads((Path((await store.get_adapter(version)).path) / TRAINER_STATE).read_text())
        batches.extend(state["batch"])
        version = state["parent"]
    assert sorted(batches) == sorted(turns), "each turn trained once, none lost"
    consumed = {t: (await store.get_judgment(t)).trained_in for t in turns}
    assert all(consumed.values())
    assert not list(root.rglob("*.partial"))


async def judging(tmp_path: Path, store: Store, judge=None, **config) -> tuple[MemoryBus, Experience, Learner]:
    """A started bus, the experience recorder on it and a learner that judges without training
    (``config``: more learner settings); close the bus at the end."""
    bus = MemoryBus()
    await bus.start()
    learner = Learner(learner_config(train=False, **config), store, bus, judge or RulesJudge(),
                      AdapterRegistry(store, bus, tmp_path))  # fmt: skip
    return bus, Experience(store, bus), learner


async def time_at_home(store: Store, experience: Experience, timezone: str, result: str, answer: str) -> tuple:
    """(session, call turn, answer turn) of one request: "What time is it at home?", a call of now(timezone)
    whose tool returned ``result``, then ``answer``; the answer's turn is left open for the user's reply."""
    session = await store.create_session("alice")
    asked = [SYSTEM, {"role": "user", "content": "What time is it at home?"}]
    return (session, *await answered_with_now(experience, session.id, "req-1", asked, timezone, result, answer))


async def answered_in_words(experience: Experience, session_id: str, request_id: str, asked: list[dict],
                            answer: str, step: int = 0, user: str = "alice") -> Turn:  # fmt: skip
    """The turn (step ``step``) of ``user``'s request ``request_id`` on ``asked`` answered ``answer`` in words,
    left open."""
    return await experience.record(TurnCreate(session_id=session_id, user_id=user, request_id=request_id,
                                              model="tiny", step=step, prompt_messages=asked, response_text=answer,
                                              response_token_ids=[3], response_logprobs=[-0.3]))  # fmt: skip


async def said(experience: Experience, session_id: str, text: str) -> None:
    """The user's next message, ``text``, closes the session's open turns."""
    await experience.close_open(session_id, "user_message", {"messages": [{"role": "user", "content": text}]})


async def answered_with_now(experience: Experience, session_id: str, request_id: str, asked: list[dict],
                            timezone: str, result: str, answer: str) -> tuple:  # fmt: skip
    """(call turn, answer turn) of alice's request ``request_id`` on ``asked``: a call of now(timezone) whose
    tool returned ``result``, then ``answer``; the answer's turn is left open for the user's reply."""
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": json.dumps({"timezone": timezone})}}
    common = {"session_id": session_id, "user_id": "alice", "request_id": request_id, "model": "tiny"}
    step0 = await experience.record(TurnCreate(**common, step=0, prompt_messages=asked, tool_calls=[call],
                                               response_token_ids=[1, 2], response_logprobs=[-0.1, -0.2]))  # fmt: skip
    await experience.close(step0.id, "tool_result", {"results": [{"role": "tool", "name": "now", "content": result}]})
    called = [*asked, {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "c1", "name": "now", "content": result}]  # fmt: skip
    return step0, await answered_in_words(experience, session_id, request_id, called, answer, step=1)


@pytest.mark.anyio
async def test_a_correction_becomes_a_verdict_with_a_hint_credit_for_the_tool_step_and_a_lesson(tmp_path, store):
    bus, experience, learner = await judging(tmp_path, store)
    session, step0, step1 = await time_at_home(store, experience, "Europe/Paris", "10:00", "It is 10:00.")
    async with bus.subscribe(LESSON_ADDED) as events:
        await learner.catch_up()  # judges the tool step: ran fine, so neutral for now
        assert (await store.get_judgment(step0.id)).score == 0
        await said(experience, session.id, "No, I meant Lisbon time")
        await learner.catch_up()
        event = await anext(aiter(events))
    final, tool_step = await store.get_judgment(step1.id), await store.get_judgment(step0.id)
    assert (final.score, final.hint) == (-1, 'The user meant "Lisbon time"')
    assert (tool_step.score, tool_step.hint, tool_step.judge) == (-1, 'The user meant "Lisbon time"', "credit")
    assert tool_step.trainable and final.trainable
    lesson = await store.get_lesson(event.data["lesson_id"])
    assert lesson.text == 'When asked "What time is it at home?": The user meant "Lisbon time"'
    await bus.aclose()


@pytest.mark.anyio
async def test_a_call_that_ignored_the_correction_gets_no_credit_when_the_user_moves_on(tmp_path, store):
    """The retry after "No, I meant Tokyo time" called now(Tbilisi), then said "Tokyo": the user moved
    on, and the answer is credited, but not the call (nor a lesson saying it was right)."""
    bus, experience, learner = await judging(tmp_path, store)
    session = await store.create_session("alice")
    asked = [SYSTEM, {"role": "user", "content": "What time is it at Sam's place?"},
             {"role": "assistant", "content": "It is 10:31 in Sydney."},
             {"role": "user", "content": "No, I meant Tokyo time, Sam lives in Tokyo."}]  # fmt: skip
    step0, step1 = await answered_with_now(experience, session.id, "req-1", asked, "Tbilisi", "03:32", "It is 03:32 in Tokyo.")
    await said(experience, session.id, "Alright.")
    await learner.catch_up()
    assert (await store.get_judgment(step1.id)).score == 1
    assert (await store.get_judgment(step0.id)).score == 0  # its tool ran; the user's reply does not reach it
    assert await store.list_lessons("alice") == []
    await bus.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("train_corrections", [True, False])
async def test_a_corrections_own_call_trains_only_when_train_corrections_is_on(tmp_path, store, train_corrections):
    """"No, I meant Lisbon time" answered with now(Lisbon), then thanked: with ``train_corrections`` off
    that call is judged (+1) but trains nothing; the answer it led to, and the corrected request, still train."""
    bus, experience, learner = await judging(tmp_path, store, train_corrections=train_corrections)
    session, step0, step1 = await time_at_home(store, experience, "Europe/Paris", "10:00", "It is 10:00.")
    await learner.catch_up()
    correction = {"role": "user", "content": "No, I meant Lisbon time"}
    await said(experience, session.id, correction["content"])
    asked = [SYSTEM, {"role": "user", "content": "What time is it at home?"},
             {"role": "assistant", "content": "It is 10:00."}, correction]  # fmt: skip
    retry, answer = await answered_with_now(experience, session.id, "req-2", asked, "Lisbon", "09:00", "It is 09:00.")
    await said(experience, session.id, "Thanks!")
    await learner.catch_up()
    judged = {t.id: await store.get_judgment(t.id) for t in (step0, step1, retry, answer)}
    assert [judged[t.id].score for t in (step0, step1, retry, answer)] == [-1, -1, 1, 1]
    assert judged[step0.id].trainable and judged[step1.id].trainable and judged[answer.id].trainable
    assert judged[retry.id].trainable is train_corrections
    await bus.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("train_tool_answers", [True, False])
async def test_an_answer_read_off_a_tool_trains_only_when_train_tool_answers_is_on(tmp_path, store, train_tool_answers):
    """now(Lisbon) answered "It is 09:00.", then thanked: both steps are judged +1; with ``train_tool_answers``
    off the answer trains nothing (rewarded, such answers taught requests to be answered in words) and the call
    still does."""
    bus, experience, learner = await judging(tmp_path, store, train_tool_answers=train_tool_answers)
    session, call, answer = await time_at_home(store, experience, "Lisbon", "09:00", "It is 09:00.")
    await said(experience, session.id, "Thanks!")
    await learner.catch_up()
    judged = [await store.get_judgment(t.id) for t in (call, answer)]
    assert [j.score for j in judged] == [1, 1]
    assert judged[0].trainable and judged[1].trainable is train_tool_answers
    await bus.aclose()


@pytest.mark.anyio
async def test_a_call_whose_tool_failed_takes_the_users_correction_as_its_hint(tmp_path, store):
    bus, experience, learner = await judging(tmp_path, store, lessons=False)
    error = "error: Unknown timezone 'Espresso'."
    session, step0, step1 = await time_at_home(store, experience, "Espresso", error, "Sorry.")
    await learner.catch_up()
    assert (await store.get_judgment(step0.id)).hint.startswith("Calling now failed")
    await said(experience, session.id, "No, I meant Lisbon time")
    await learner.catch_up()
    answer, tool_step = await store.get_judgment(step1.id), await store.get_judgment(step0.id)
    assert (answer.score, answer.hint) == (-1, 'The user meant "Lisbon time"')
    assert (tool_step.score, tool_step.hint, tool_step.judge) == (-1, 'The user meant "Lisbon time"', "credit")
    assert "returned an error" in tool_step.reason and tool_step.trainable
    await bus.aclose()


@pytest.mark.anyio
async def test_a_correction_after_the_request_was_asked_again_teaches_its_first_asking_too(tmp_path, store):
    """"Is it late at home?" called now(home), which failed; asked again, answered in words; then "No, I meant
    Lisbon time.": the first asking's call, judged by the re-ask with a hint that names nothing, takes the
    correction's hint, so that its prompt, the question asked afresh, teaches Lisbon. An earlier request of
    the conversation, asked again before it and never corrected, keeps its own verdict."""
    bus, experience, learner = await judging(tmp_path, store, lessons=False, credit_asked=True)
    session = await store.create_session("alice")
    weekday = "Which weekday is 2027-02-15?"
    history = [SYSTEM, {"role": "user", "content": weekday}]
    other = await answered_in_words(experience, session.id, "req-0", history, "It is a Tuesday.")
    again = f"{weekday} Please answer the question."
    await said(experience, session.id, again)
    history += [{"role": "assistant", "content": "It is a Tuesday."}, {"role": "user", "content": again}]
    await answered_in_words(experience, session.id, "req-1", history, "It is a Monday.")
    await said(experience, session.id, "Is it late at home?")
    history += [{"role": "assistant", "content": "It is a Monday."}, {"role": "user", "content": "Is it late at home?"}]
    error = "error: Unknown timezone 'home'."
    call, answer = await answered_with_now(experience, session.id, "req-2", history, "home", error, "Sorry.")
    asked_again = "Is it late at home? Please answer the question."
    await said(experience, session.id, asked_again)
    await learner.catch_up()
    assert (await store.get_judgment(call.id)).hint.startswith(REQUERY_HINT)
    history += [{"role": "assistant", "content": "Sorry."}, {"role": "user", "content": asked_again}]
    reasked = await answered_in_words(experience, session.id, "req-3", history, "It is late.")
    await said(experience, session.id, "No, I meant Lisbon time.")
    await learner.catch_up()
    judged = {t.id: await store.get_judgment(t.id) for t in (other, call, answer, reasked)}
    assert (judged[reasked.id].score, judged[reasked.id].hint) == (-1, 'The user meant "Lisbon time"')
    assert (judged[call.id].score, judged[call.id].hint, judged[call.id].judge) == (-1, 'The user meant "Lisbon time"',
                                                                                   "credit")  # fmt: skip
    assert judged[call.id].trainable
    assert judged[answer.id].hint.startswith(REQUERY_HINT)  # it read the tool's result: it learns from success only
    assert (judged[other.id].score, judged[other.id].hint.startswith(REQUERY_HINT)) == (-1, True)
    await bus.aclose()


@pytest.mark.anyio
async def test_with_credit_asked_off_a_correction_after_a_re_ask_teaches_only_the_re_ask(tmp_path, store):
    """The default: the first asking keeps the verdict the re-ask gave it."""
    bus, experience, learner = await judging(tmp_path, store, lessons=False)
    session = await store.create_session("alice")
    history = [SYSTEM, {"role": "user", "content": "Is it late at home?"}]
    call, _ = await answered_with_now(experience, session.id, "req-1", history, "home", "error: Unknown timezone.", "Sorry.")
    asked_again = "Is it late at home? Please answer the question."
    await said(experience, session.id, asked_again)
    history += [{"role": "assistant", "content": "Sorry."}, {"role": "user", "content": asked_again}]
    reasked = await answered_in_words(experience, session.id, "req-2", history, "It is late.")
    await said(experience, session.id, "No, I meant Lisbon time.")
    await learner.catch_up()
    assert (await store.get_judgment(reasked.id)).hint == 'The user meant "Lisbon time"'
    assert (await store.get_judgment(call.id)).hint.startswith(REQUERY_HINT)
    await bus.aclose()


@pytest.mark.anyio
async def test_a_live_adapter_whose_judged_score_falls_below_its_predecessors_is_rolled_back(tmp_path, store):
    from whet.memory.bus import ADAPTER_PUBLISHED
    from whet.memory.tables import Adapter

    bus = MemoryBus()
    await bus.start()
    config = learner_config(train=False, gate={"rollback_window": 4, "rollback_margin": 0.25})
    learner = Learner(config, store, bus, RulesJudge(), AdapterRegistry(store, bus, tmp_path))
    for version, parent in (("global-0001", None), ("global-0002", "global-0001")):
        await store.add_adapter(Adapter(id=version, path=str(tmp_path / version), parent=parent))
        await store.promote_adapter(version)
    session = await store.create_session("alice")

    async def rated(version: str, score: float) -> str:
        turn = await store.add_turn(TurnCreate(session_id=session.id, user_id="alice", request_id=f"r{score}{version}",
                                               step=0, model="tiny", policy_version=version))  # fmt: skip
        await Experience(store, bus).feedback(turn, score, None)
        return turn.id

    for _ in range(4):
        await learner.judge_turn(await rated("global-0001", 1.0))
    async with bus.subscribe(ADAPTER_PUBLISHED) as events:
        for _ in range(3):
            await learner.judge_turn(await rated("global-0002", -1.0))
        assert (await store.live_adapter("global")).id == "global-0002", "not before the window is full"
        await learner.judge_turn(await rated("global-0002", -1.0))
        event = await anext(aiter(events))
    assert event.data == {"adapter_id": "global-0001", "scope": "global", "user_id": None}
    assert (await store.live_adapter("global")).id == "global-0001"
    retired = await store.get_adapter("global-0002")
    assert retired.status == "retired" and "fell below" in retired.metrics["rolled_back"]
    assert learner.progress.rolled_back == ["global-0002"]
    await bus.aclose()


@pytest.mark.anyio
async def test_a_drop_in_judged_score_that_chance_explains_rolls_nothing_back(tmp_path, store):
    from whet.memory.tables import Adapter

    config = learner_config(train=False, gate={"rollback_window": 16, "rollback_margin": 0.25})
    learner = Learner(config, store, MemoryBus(), RulesJudge(), AdapterRegistry(store, MemoryBus(), tmp_path))
    for version, parent in (("global-0001", None), ("global-0002", "global-0001")):
        await store.add_adapter(Adapter(id=version, path=str(tmp_path / version), parent=parent))
        await store.promote_adapter(version)
    session = await store.create_session("alice")

    async def rated(version: str, scores: list[float]) -> None:
        for i, score in enumerate(scores):
            turn = await store.add_turn(TurnCreate(session_id=session.id, user_id="alice", request_id=f"{version}-{i}",
                                                   step=0, model="tiny", policy_version=version))  # fmt: skip
            await Experience(store, MemoryBus()).feedback(turn, score, None)
            await learner.judge_turn(turn.id)

    # +0.25 then -0.25 over 16 verdicts each: 0.5 lower, beyond the margin, within two standard errors (0.68)
    await rated("global-0001", [1.0] * 10 + [-1.0] * 6)
    await rated("global-0002", [1.0] * 6 + [-1.0] * 10)
    assert (await store.live_adapter("global")).id == "global-0002"
    assert learner.progress.rolled_back == []
    # a further run of failures takes it to -0.75: a drop of 1.0, beyond both
    await rated("global-0002", [-1.0] * 4)
    assert (await store.live_adapter("global")).id == "global-0001"
    assert learner.progress.rolled_back == ["global-0002"]


@pytest.mark.anyio
async def test_per_user_scope_trains_one_lineage_per_user(tiny_model, tmp_path, store):
    config = learner_config(scope="user", batch_size=2)
    learner = make_learner(config, store, MemoryBus(), tiny_model, tmp_path / "adapters")
    encoder = new_trainer(tiny_model)
    for user in ("alice", "bob"):
        await judged_turn(store, encoder, "Time?", GOOD, +1, "train", user=user)
        await judged_turn(store, encoder, "Time?", BAD, -1, "train", user=user)
    made = await learner.train_ready()
    assert sorted(made) == ["user-alice-0001", "user-bob-0001"]
    for user in ("alice", "bob"):
        live = await store.live_adapter("user", user)
        assert live.id == f"user-{user}-0001" and live.user_id == user
        assert Path(live.path).parent == tmp_path / "adapters" / "user" / user
        trained = await store.list_judgments(trained_in=live.id)
        assert {j.user_id for j in trained} == {user}
    assert await store.live_adapter("global") is None


class _FailsOnBoom(RulesJudge):
    """The rules judge, except that it fails on any turn whose answer is "boom" (a row it cannot judge)."""

    async def judge(self, turn, next_state, context):
        if turn.response_text == "boom":
            raise RuntimeError("cannot judge this row")
        return await super().judge(turn, next_state, context)


async def closed_answer(experience: Experience, store: Store, answer: str, reply: str, user: str = "alice") -> str:
    session = await store.create_session(user)
    asked = [SYSTEM, {"role": "user", "content": "What time is it at home?"}]
    turn = await answered_in_words(experience, session.id, f"req-{session.id}", asked, answer, user=user)
    await said(experience, session.id, reply)
    return turn.id


@pytest.mark.anyio
async def test_a_turn_that_cannot_be_judged_is_marked_and_the_catch_up_goes_on(tmp_path, store):
    bus, experience, learner = await judging(tmp_path, store, _FailsOnBoom())
    bad = await closed_answer(experience, store, "boom", "thanks")
    good = await closed_answer(experience, store, "It is 10:00.", "thanks")
    await learner.catch_up()
    marked, judged = await store.get_judgment(bad), await store.get_judgment(good)
    assert marked is not None and marked.judge == "failed" and not marked.trainable
    assert judged is not None and judged.score == 1
    assert (await learner.status())["busy"] is False
    await bus.aclose()


async def exercise_nul_correction(tmp_path, store: Store) -> None:
    bus, experience, learner = await judging(tmp_path, store)
    turn_id = await closed_answer(experience, store, "It is 10:00 in Paris.", "No, I meant Lis\x00bon time")
    await learner.catch_up()
    verdict = await store.get_judgment(turn_id)
    assert verdict.score == -1 and verdict.hint == 'The user meant "Lis\x00bon time"'
    assert [lesson.text for lesson in await store.list_lessons("alice")] == [
        'When asked "What time is it at home?": The user meant "Lis\x00bon time"'
    ]
    assert (await learner.status())["busy"] is False
    await bus.aclose()


@pytest.mark.anyio
async def test_a_correction_with_a_nul_byte_is_judged_and_kept_as_a_lesson_on_sqlite(tmp_path, store):
    await exercise_nul_correction(tmp_path, store)


@pytest.mark.anyio
@pytest.mark.loopback
async def test_a_correction_with_a_nul_byte_is_judged_and_kept_as_a_lesson_on_postgresql(tmp_path, postgres_schema_url):
    store = open_store(postgres_schema_url)
    try:
        await exercise_nul_correction(tmp_path, store)
    finally:
        await store.aclose()


async def replayed_splits(tmp_path: Path, url: str, unlearned: bool = True) -> list[list[str]]:
    """One conversation of alice's (11 requests, each under a fresh random request id, the last a call then
    its answer; when ``unlearned``, one more after the third, sent with ``store: false``) into a fresh store at
    ``url``: each learnt request's sides, in the order they were asked."""
    store = open_store(url)
    bus, experience, learner = await judging(tmp_path, store, gate={"holdout_fraction": 0.5})
    requests = [await closed_answer(experience, store, f"It is {hour}:00.", "thanks") for hour in range(3)]
    if unlearned:
        session = await store.create_session("alice")
        await experience.record(TurnCreate(session_id=session.id, user_id="alice", request_id=f"req-{session.id}",
                                           step=0, model="tiny", prompt_messages=[SYSTEM], response_text="Hi."),
                                learn=False)  # fmt: skip
    requests += [await closed_answer(experience, store, f"It is {hour}:00.", "thanks") for hour in range(3, 10)]
    session, *steps = await time_at_home(store, experience, "Europe/Lisbon", "10:00", "It is 10:00.")
    await said(experience, session.id, "thanks")
    await learner.catch_up()
    sides = [[(await store.get_judgment(turn_id)).split] for turn_id in requests]
    sides.append([(await store.get_judgment(step.id)).split for step in steps])
    await bus.aclose()
    await store.aclose()
    return sides


@pytest.mark.anyio
async def test_the_held_out_requests_follow_the_conversation_not_the_random_request_ids(tmp_path):
    """A seeded benchmark replays one conversation: the same requests are held out in every replay (with random
    request ids they were not, and two runs of one setting trained on different turns), a request sent with
    ``store: false`` takes no place among them, and every step of a request lands on one side."""
    first, second = [await replayed_splits(tmp_path, f"sqlite:///{tmp_path / f'{name}.db'}") for name in ("a", "b")]
    assert first == second == await replayed_splits(tmp_path, f"sqlite:///{tmp_path / 'c.db'}", unlearned=False)
    assert {"holdout", "train"} == {side for sides in first for side in sides}
    assert len(set(first[-1])) == 1


@pytest.mark.anyio
async def test_the_held_out_requests_are_the_same_on_postgresql(tmp_path, postgres_schema_url):
    assert await replayed_splits(tmp_path, postgres_schema_url) == await replayed_splits(tmp_path, f"sqlite:///{tmp_path / 'a.db'}")

@pytest.mark.anyio
async def test_a_training_step_runs_on_learner_threads_while_a_serving_thread_keeps_its_own(
    tiny_model, tmp_path, store
):
    from concurrent.futures import ThreadPoolExecutor

    serving = ThreadPoolExecutor(1)  # stands in for the engine thread: it ran torch before training started
    own = serving.submit(torch.get_num_threads).result()
    configured = own + 2  # a count neither thread has by itself
    seen: dict[str, int] = {}

    def look(at: str) -> None:
        if at == "before_step":
            seen["training"] = torch.get_num_threads()
            seen["serving"] = serving.submit(torch.get_num_threads).result()

    config = learner_config(threads=configured)
    learner = make_learner(config, store, MemoryBus(), tiny_model, tmp_path / "adapters", on_step=look)
    encoder = new_trainer(tiny_model)
    for i in range(4):
        await judged_turn(store, encoder, QUESTIONS[i], GOOD if i % 2 else BAD, 1 if i % 2 else -1, "train")
    assert await learner.train_ready()
    assert seen == {"training": configured, "serving": own}
    assert torch.get_num_threads() == serving.submit(torch.get_num_threads).result() == own  # restored after
    serving.shutdown()


@pytest.mark.anyio
async def test_a_running_step_shows_its_phase_and_each_optimizer_pass_as_work_in_the_status(tiny_model, tmp_path, store):
    """A client that waits on a busy learner (the bench's --idle-timeout) must see a long step advance:
    each phase it begins and each optimizer pass counts as work, and the phase clears when it ends."""
    seen: dict[str, tuple[str | None, int]] = {}
    config = learner_config(lora={**LORA.model_dump(), "epochs": 3})
    learner: Learner | None = None

    def look(at: str) -> None:
        assert learner is not None
        seen[at] = (learner.progress.phase, learner.progress.work)

    learner = make_learner(config, store, MemoryBus(), tiny_model, tmp_path / "adapters", on_step=look)
    assert ((status := await learner.status())["phase"], status["work"]) == (None, 0)
    encoder = new_trainer(tiny_model)
    for i in range(4):
        await judged_turn(store, encoder, QUESTIONS[i], GOOD if i % 2 else BAD, 1 if i % 2 else -1, "train")
    assert await learner.train_ready()
    phase, before = seen["before_step"]
    assert phase == "replay_before" and before >= 2, "start, then replay_before, each begun"
    phase, after = seen["after_step"]
    assert phase == "pinned_after"
    # train, repair, replay_after and pinned_after begun, and the three passes between them
    assert after - before == 4 + 3
    status = await learner.status()
    assert status["phase"] is None and status["work"] == after


def test_greedy_replies_are_the_same_whatever_guess_they_start_from(tiny_model, hello_policy):
    """A guess only saves decoding steps: right, wrong from its first token, right for a while,
    too long or running past its stop, every reply is what plain greedy decoding gives."""
    policy, _ = hello_policy
    for model in (policy, tiny_model):  # one stops on its own ("Hello!"), one runs to the limit
        trainer = new_trainer(model)
        prompts = [encode_turn(trainer, q, "")[1] for q in ("Say hello.", "What time is it?", "Hi")]
        limits = [12, 6, 9]
        plain = trainer.greedy_actions(prompts, limits)
        stops = stop_token_ids(trainer.tokenizer, trainer.model)
        assert any(r[-1] in stops for r in plain) == (model == policy)
        other = (plain[0][0] + 1) % len(trainer.tokenizer)
        cases = [
            [*plain],  # all right
            [[other] * 5] * 3,  # wrong from the first token
            [[*r[:2], (r[2] + 1) % len(trainer.tokenizer), *r[3:]] for r in plain],  # right for two tokens
            [[*r, *r] for r in plain],  # longer than the reply (past its stop, past the limit)
            [[], None, plain[2][:1]],  # nothing, and a right start
        ]
        for guesses in cases:
            assert trainer.greedy_actions(prompts, limits, guesses) == plain, guesses


def test_greedy_replies_decoded_together_are_each_one_decoded_alone(tiny_model, hello_policy, monkeypatch):
    """Replies of prompts of different lengths, decoded in lockstep (padded, masked, each at its own
    positions; a reply that stops or reaches its limit leaves the batch), are the replies each prompt gets
    alone. The tiny model's weights are drawn again, larger, so that its replies follow the whole prompt
    and its positions (as drawn, it repeats the last token): checked to fail with the padding unmasked and
    with every reply at the longest one's position."""
    monkeypatch.setattr(trainer_module, "DECODE_BATCH", 2)  # batches of two, the last of one
    policy, _ = hello_policy
    hello = new_trainer(policy)
    asked = [encode_turn(hello, q, "")[1] for q in ("Say hello.", "What time is it in Lisbon right now?", "Hi")]
    alone = [hello.teacher_action(p, 12) for p in asked]
    assert alone[0][-1] in stop_token_ids(hello.tokenizer, hello.model)  # "Hello!" stops before its limit
    assert hello.greedy_actions(asked, [12] * 3) == alone

    trainer = new_trainer(tiny_model)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weight in trainer.model.named_parameters():
            if "lora_" not in name and weight.dim() == 2:
                weight.normal_(0, 0.3)
    draw = random.Random(0)
    prompts = [[draw.randrange(100, len(trainer.tokenizer)) for _ in range(n)] for n in (3, 60, 9, 120, 25)]
    limits = [12, 7, 9, 3, 10]
    alone = [trainer.teacher_action(p, n) for p, n in zip(prompts, limits, strict=True)]
    assert len({tuple(r) for r in alone}) == len(alone)
    assert trainer.greedy_actions(prompts, limits) == alone
