"""What a weights step's anchor costs, its prompts' openings read one at a time and in batches.

``learner.rehearsal.anchor_weight`` holds the rehearsal set's small talk (48 chats and answers read off a tool)
and the step's drawn calls at the odds of opening with a tool call the step found them at: every pass reads each
one's reply's first token. One at a time that is a one-token forward and backward pass a prompt, nearly all of it
per-call overhead; the trainer reads them in batches (``_Openings``: each batch's keys and values stacked,
left-padded to the longest). This runs the same step twice from the same start, once each way, and prints both
times, their ratio and the step's losses, which must agree:

    python bench/anchor_batching.py MODEL_DIR [--config F.yaml] [--lora-lr 2e-3] [--threads 1]

The step is synthetic but of a real step's shape: 16 samples, the rehearsal set's calls taken as the user's turns
(half scored +1, half -1 with a hinted teacher), 16 rehearsal items (5 calls, 11 small talk) held to the base
model by the KL term, every small-talk item anchored, with the settings of ``--config`` (the learner's shipped ones
by default; ``lora.epochs`` passes). Minutes on one core for SmolLM2.
"""
import argparse
import random
import time

import torch

from whet.config.settings import load_config
from whet.learner import trainer as trainer_module
from whet.learner.gate import load_regression_set
from whet.learner.learner import rehearsal_path
from whet.learner.objective import objective_from_config
from whet.learner.prompt import call_opening
from whet.learner.trainer import Anchor, LoraTrainer, Sample, limited_threads

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--config", help="a YAML file overriding config/whet.yaml (its learner settings make the step)")
p.add_argument("--lora-lr", type=float, help="the LoRA learning rate (default: the config's)")
p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: one core, as a bench arm has)")
args = p.parse_args()

learner = load_config(args.config).learner
if args.lora_lr is not None:
    learner.lora = learner.lora.model_copy(update={"learning_rate": args.lora_lr})
anchor_weight, kl = learner.rehearsal.anchor_weight or 1.0, learner.rehearsal.kl_weight
batched = trainer_module.LoraTrainer._openings


def one_at_a_time(self: LoraTrainer, prompts, trained):  # the trainer's own fallback: a batch of one prompt
    return [trainer_module._Openings([p]) for p in prompts]


results = {}
with limited_threads(args.threads):
    for mode, openings in (("batched", batched), ("one at a time", one_at_a_time)):
        trainer_module.LoraTrainer._openings = openings
        torch.manual_seed(0)
        trainer = LoraTrainer.load(args.model, learner.lora, objective_from_config(learner.objective), device="cpu")
        items = load_regression_set(rehearsal_path(learner.rehearsal.set or "bundled"), trainer.tokenizer)
        opening = call_opening(trainer.tokenizer)
        calls = [item for item in items if item[1][0] == opening]
        talk = [item for item in items if item[1][0] != opening]
        rng = random.Random(0)
        samples = []
        for i, (prompt, response) in enumerate(rng.sample(calls, 16)):
            with torch.no_grad():
                behaviour = trainer.response_logprobs(prompt, response).tolist()
            samples.append(Sample(f"t{i}", prompt, response, behaviour, -1 if i % 2 else 1, prompt if i % 2 else None))
        rehearsal = rng.sample(calls, 5) + rng.sample(talk, 11)
        anchor = Anchor([p for p, _ in talk], opening, anchor_weight, [p for p, r in rehearsal if r[0] == opening])
        started = time.perf_counter()
        stats = trainer.step(samples, 0.0, rehearsal, learner.rehearsal.weight, learner.rehearsal.first_token_weight,
                             anchor, kl)  # fmt: skip
        seconds = time.perf_counter() - started
        results[mode] = (seconds, stats)
        print(f"{mode:>13}: step {seconds:6.1f} s ({learner.lora.epochs} passes; {len(samples)} samples, {len(anchor.prompts)}"
              f" chats and {len(anchor.calls)} calls anchored) loss first/last {stats['loss_first']:.5f}/"
              f"{stats['loss']:.5f}, anchor_rise {stats['anchor_rise']:.5f}", flush=True)  # fmt: skip
        del trainer

(fast, a), (slow, b) = results["batched"], results["one at a time"]
print(f"one at a time / batched: {slow / fast:.2f}x the step's time ({slow - fast:.1f} s saved a step); "
      f"losses {'agree' if abs(a['loss'] - b['loss']) < 1e-3 else 'DIFFER'} "
      f"({a['loss']:.5f} / {b['loss']:.5f})")
