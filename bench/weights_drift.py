"""What does a weights step teach one user, against how far it moves the gate's pinned set? Offline.

The weights arm (`lora`) has stayed at its base since stop 49: its lineage reaches the gate's likelihood
bound (`learner.gate.regression_total_tolerance`, 0.08 nats/token below the base model on
`config/regression.jsonl`) after two promoted steps. This measures a learner setting on both sides of that
at once, without the server, the judge's timing or the gate's decisions:

- samples: the profile's first `--n` training requests, answered greedily by the model (the first reply
  of a request, as served with no lessons); a right call is +1 (thanks), a wrong one -1 with the hint the
  rules judge takes from the user's correction (requests without one: no hint);
- steps of 8 in order, by the learner's own trainer (`LoraTrainer.step`), with its rehearsal draw from
  `config/rehearsal.jsonl` (small talk self-distilled) and its anchor, every step promoted;
- after each step: the pinned set's mean log-prob change from the base model (what the gate's bound reads),
  over the pinned calls and the other replies apart, its worst item; the pinned turns the base answers as
  pinned (greedily) that the step's weights no longer do (what the gate's greedy check counts, near ties
  included); and the held-out requests' first calls right (the bench's held-out phrasings); after the last,
  the trained requests' own first calls.

    python bench/weights_drift.py MODEL_DIR [--profile config/profiles/jun.yaml] [--kl 1.0] [--lr 5e-4] [--opd-weight 4] [--contrast 1]

Prints one line a step; `--out F` writes the (drift, held-out) curve as JSON. One core: ~2 min for the
base's readings, then ~5-6 min a step (SmolLM2, AVX-512 BF16).
"""
import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
from probe_setup import TARGETS, Probe, first_call_right

from whet.config.settings import LoraConfig, ObjectiveConfig
from whet.learner.gate import load_pinned_turns, load_regression_set
from whet.learner.judge import correction_hint
from whet.learner.learner import _called, _called_values, pinned_checks, rehearsal_draw, self_distilled
from whet.learner.objective import objective_from_config
from whet.learner.prompt import call_opening, hinted_prompt_ids
from whet.learner.trainer import Anchor, LoraTrainer, Sample

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--profile", default=None)
p.add_argument("--n", type=int, default=32)
p.add_argument("--lr", type=float, default=5e-4)
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--optimizer", default="adamw")
p.add_argument("--layers", type=int, default=None)
p.add_argument("--targets", default="all")
p.add_argument("--rehearse", type=int, default=16)
p.add_argument("--kl", type=float, default=0.0, help="learner.rehearsal.kl_weight: hold the rehearsal to the base model")
p.add_argument("--nll", type=float, default=1.0)
p.add_argument("--anchor", type=float, default=1.0)
p.add_argument("--opd-weight", type=float, default=None,
               help="learner.objective.opd_weight: the hinted teacher's action against the RL term and the rehearsal")
p.add_argument("--contrast", type=float, default=0.0,
               help="learner.objective.contrast_weight: each teacher action against the step's others of its tool")
p.add_argument("--heldout", type=int, default=24)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--replay", action="store_true", help="every step retrains all hinted samples so far")
p.add_argument("--replay-all", action="store_true", help="every step retrains every sample so far (as learner.replay_kept did, stop 58)")
p.add_argument("--out", default=None)
args = p.parse_args()

torch.manual_seed(0)
lora = LoraConfig(learning_rate=args.lr, epochs=args.epochs, optimizer=args.optimizer, layers=args.layers,
                  target_modules=TARGETS[args.targets])
objective = ObjectiveConfig(contrast_weight=args.contrast, **({} if args.opd_weight is None else {"opd_weight": args.opd_weight}))
trainer = LoraTrainer.load(args.model, lora, objective_from_config(objective), device="cpu")
tok = trainer.tokenizer
probe = Probe.of(tok, args.profile, args.n, args.heldout)
train, heldout = probe.train, probe.heldout
root = Path(__file__).resolve().parents[1] / "config"
regression = load_regression_set(root / "regression.jsonl", tok)
pinned_calls = [bool(_called(tok, r)) for _, r in regression]
turns = load_pinned_turns(root / "regression.jsonl")
pinned = [turn.action for turn in turns]
regression_texts = [turn.messages[-1]["content"][:70] for turn in turns]
assert len(turns) == len(regression)
rehearsal = self_distilled(trainer, load_regression_set(root / "rehearsal.jsonl", tok))
r_tools = [_called(tok, r) for _, r in rehearsal]
r_values = [_called_values(tok, r) for _, r in rehearsal]
talk = [pr for (pr, _), t in zip(rehearsal, r_tools, strict=True) if not t]
opening = call_opening(tok)


def first_calls(tasks):
    """(right, prompt ids, reply ids, reply text) of each task's greedy first reply."""
    prompts = [probe.prompt_ids(t.text) for t in tasks]
    outs = trainer.greedy_actions(prompts, [64] * len(prompts))
    texts = [tok.decode(o) for o in outs]
    return [(first_call_right(t, text), pr, o, text) for t, pr, o, text in zip(tasks, prompts, outs, texts, strict=True)]


t0 = time.time()
base_reg = trainer.mean_logprobs(regression)
print(f"base regression mean {sum(base_reg)/len(base_reg):.4f} ({time.time()-t0:.0f}s)", flush=True)


def pinned_kept():
    """Whether the weights answer each pinned turn, greedily, as it pins (the gate's greedy check)."""
    return pinned_checks(trainer, pinned, regression)[0]


base_kept = pinned_kept()


def report(tag, reg=None, kept=None):
    """``reg``, ``kept``: the pinned set's readings and greedy checks when already read (the base's)."""
    t0 = time.time()
    reg = trainer.mean_logprobs(regression) if reg is None else reg
    kept = pinned_kept() if kept is None else kept
    lost = [i for i, (b, k) in enumerate(zip(base_kept, kept, strict=True)) if b and not k]
    d = [a - b for a, b in zip(reg, base_reg, strict=True)]
    h = first_calls(heldout)
    miss = Counter((t.text, txt[:90]) for t, (ok, _, _, txt) in zip(heldout, h, strict=True) if not ok)
    calls = [x for x, c in zip(d, pinned_calls, strict=True) if c]
    others = [x for x, c in zip(d, pinned_calls, strict=True) if not c]
    print(f"[{tag}] drift {sum(d)/len(d):+.4f} (pinned calls {sum(calls)/max(len(calls), 1):+.4f}, "
          f"replies without a call {sum(others)/max(len(others), 1):+.4f}) worst {min(d):+.3f} (item {d.index(min(d))}) "
          f"heldout {sum(x[0] for x in h)}/{len(h)} pinned turns lost {len(lost)} of {sum(base_kept)} ({time.time()-t0:.0f}s)",
          flush=True)  # fmt: skip
    for i in lost:
        print(f"    lost pinned {i}: {regression_texts[i]}", flush=True)
    for (q, a), n in sorted(miss.items()):
        print(f"    {n} {q} -> {a}", flush=True)
    return {"drift": sum(d) / len(d), "items": d, "heldout": sum(x[0] for x in h) / len(h), "pinned_lost": lost}


report("base", base_reg, base_kept)
# the samples, answered by the base
answers = first_calls(train)
samples = []
for i, (t, (ok, pr, o, _)) in enumerate(zip(train, answers, strict=True)):
    lp = trainer.response_logprobs(pr, o).tolist()
    hint = None if ok or not t.correction else correction_hint(t.correction)
    teacher = hinted_prompt_ids(tok, probe.messages(t.text), pr, hint) if hint else None
    samples.append(Sample(f"t{i}", pr, o, lp, 1 if ok else -1, teacher))
print(f"samples: {sum(s.score > 0 for s in samples)} right, {sum(s.score < 0 for s in samples)} wrong, "
      f"{sum(s.teacher_prompt_ids is not None for s in samples)} hinted", flush=True)
# what the steps are taught to write: the hinted teacher's greedy action (learner.objective.hindsight: action)
hinted = [(t, s) for t, s in zip(train, samples, strict=True) if s.teacher_prompt_ids]
actions = trainer.greedy_actions([s.teacher_prompt_ids for _, s in hinted], [64] * len(hinted))
print(f"hinted teachers' actions right: {sum(first_call_right(t, tok.decode(a)) for (t, _), a in zip(hinted, actions, strict=True))}"
      f"/{len(hinted)}", flush=True)
curve = []
for step in range(args.steps):
    batch = samples[8 * step: 8 * step + 8]
    if args.replay_all:
        batch = batch + samples[: 8 * step]
    elif args.replay:
        batch = batch + [s for s in samples[: 8 * step] if s.teacher_prompt_ids]
    tools_called = set().union(*(_called(tok, s.response_ids) for s in batch))
    picked = rehearsal_draw(r_tools, args.rehearse, tools_called, f"step{step}", r_values, set())
    reh = [rehearsal[i] for i in picked]
    calls = [pr for pr, r in reh if r and r[0] == opening]
    anchor = Anchor(talk, opening, args.anchor, calls) if args.anchor else None
    t0 = time.time()
    stats = trainer.step(batch, 0.0, reh, args.nll, 0.0, anchor, args.kl)
    print(f"step {step+1}: {len(batch)} samples, {time.time()-t0:.0f}s, "
          + " ".join(f"{k}={v:.3f}" for k, v in stats.items() if k in ("loss", "rehearsal_loss", "rehearsal_kl", "grad_norm")), flush=True)
    curve.append(report(f"step {step+1}"))
trained = first_calls(train)  # the requests the steps trained on, as the last step left them
print(f"trained requests' first calls right: {sum(ok for ok, *_ in answers)}/{len(train)} before, "
      f"{sum(ok for ok, *_ in trained)}/{len(train)} after", flush=True)
for t, (ok, _, _, txt), (was, *_) in zip(train, trained, answers, strict=True):
    if t.personal:
        print(f"    {'right' if was else 'wrong'} -> {'right' if ok else 'wrong'}: {t.text} -> {txt[:90]!r}", flush=True)
if args.out:
    Path(args.out).write_text(json.dumps({"args": vars(args), "curve": curve}))
