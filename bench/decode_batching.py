"""What greedy decoding costs, the replies written one at a time and together.

A weights arm's first step self-distils the rehearsal set (:func:`whet.learner.learner.self_distilled`: every
reply that is not a tool call rewritten by the base model, greedy, up to 64 tokens), and every step decodes its
hinted teacher's actions and the gate's pinned replies (:meth:`LoraTrainer.greedy_actions`). One reply at a
time, each token is a one-token forward pass, memory-bound on a CPU; the trainer decodes ``DECODE_BATCH`` replies
in lockstep. This self-distils the shipped rehearsal set both ways from the same model and prints both times,
their ratio and how many replies came out the same:

    python bench/decode_batching.py MODEL_DIR [--threads 1]

Minutes on one core for SmolLM2.
"""
import argparse
import time

from whet.config.settings import load_config
from whet.learner import trainer as trainer_module
from whet.learner.gate import load_regression_set
from whet.learner.learner import rehearsal_path, self_distilled
from whet.learner.objective import objective_from_config
from whet.learner.prompt import TOOL_CALL_OPEN
from whet.learner.trainer import LoraTrainer, limited_threads

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: one core, as a bench arm has)")
args = p.parse_args()

learner = load_config(None).learner
together = trainer_module.DECODE_BATCH
results = {}
with limited_threads(args.threads):
    trainer = LoraTrainer.load(args.model, learner.lora, objective_from_config(learner.objective), device="cpu")
    items = load_regression_set(rehearsal_path(learner.rehearsal.set or "bundled"), trainer.tokenizer)
    for mode, batch in (("together", together), ("one at a time", 1)):
        trainer_module.DECODE_BATCH = batch
        started = time.perf_counter()
        out = self_distilled(trainer, items)
        seconds = time.perf_counter() - started
        written = [r for (_, r), (_, given) in zip(out, items, strict=True) if TOOL_CALL_OPEN not in trainer.tokenizer.decode(given)]
        results[mode] = (seconds, out)
        print(f"{mode:>13}: {seconds:6.1f} s for {len(written)} replies ({sum(map(len, written))} tokens), "
              f"{batch} a batch", flush=True)

(fast, a), (slow, b) = results["together"], results["one at a time"]
same = sum(x == y for x, y in zip(a, b, strict=True))
print(f"one at a time / together: {slow / fast:.2f}x ({slow - fast:.1f} s saved); {same} of {len(a)} items the same")
