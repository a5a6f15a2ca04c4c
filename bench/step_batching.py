"""What a weights step costs with one of its parts read in batches and read one at a time.

A weights step reads, every pass, its samples' replies and teacher actions (once each, with their graphs, since
stop 77; before, once without gradients for the objective and once more to carry its gradient into the adapter),
the rehearsal items' replies, and the anchored prompts' openings (the
rehearsal set's small talk, 48 chats and answers read off a tool, and the step's drawn calls: each one's reply's
first token). One at a time each is a short forward and backward pass, much of it per-call overhead on a CPU; the
trainer reads them in batches, each batch's prompts' keys and values stacked, left-padded to the longest:
``--part openings`` the anchor's (``_Openings``), ``--part replies`` the samples', the teacher's actions' and the
rehearsal items' (``LoraTrainer._reply_batches``). This runs the same step twice from the same start, the part
batched and one at a time, and prints both times, their ratio and the step's losses, which must agree:

    python bench/step_batching.py MODEL_DIR [--part replies|openings] [--config F.yaml] [--lora-lr 2e-3] [--threads 1]

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
p.add_argument("--part", choices=("replies", "openings"), default="replies",
               help="what is read in batches in one step and one at a time in the other (default: replies)")
args = p.parse_args()

learner = load_config(args.config).learner
if args.lora_lr is not None:
    learner.lora = learner.lora.model_copy(update={"learning_rate": args.lora_lr})
anchor_weight, kl = learner.rehearsal.anchor_weight or 1.0, learner.rehearsal.kl_weight
batched_openings, reply_batch = trainer_module.LoraTrainer._openings, trainer_module.REPLY_BATCH


def openings_one_at_a_time(self: LoraTrainer, prompts, trained):  # the trainer's own fallback: a batch of one
    return [trainer_module._Openings([p]) for p in prompts]


results = {}
with limited_threads(args.threads):
    for mode in ("batched", "one at a time"):
        alone = mode == "one at a time"
        if args.part == "openings":
            trainer_module.LoraTrainer._openings = openings_one_at_a_time if alone else batched_openings
        else:  # a batch of one reply is read alone, as the trainer's own fallback reads it
            trainer_module.REPLY_BATCH = 1 if alone else reply_batch
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
print(f"{args.part}, one at a time / batched: {slow / fast:.2f}x the step's time ({slow - fast:.1f} s saved a step); "
      f"losses {'agree' if abs(a['loss'] - b['loss']) < 1e-3 else 'DIFFER'} "
      f"({a['loss']:.5f} / {b['loss']:.5f})")
