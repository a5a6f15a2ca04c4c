"""Can a LoRA on a model absorb one user's values from the bench's training requests, and at what cost?

An offline probe of the weights arm's capacity, apart from the judge, the hinted teacher and the
gate: the targets are ideal (each of ``--n`` training tasks of the profile, answered with its
right call), trained ``--epochs`` passes in batches of ``--batch``, optionally with ``--rehearse``
items per batch of general skill (the model's own replies to chat requests, and right calls of
general tasks), as ``learner.rehearsal`` does. Prints the share of held-out personal tasks and
general tasks whose first call is right, and of the chat probe answered without a tool call,
before and after (first call only: the answer step is not generated).

    python bench/lora_probe.py MODEL_DIR --targets all --lr 2e-3 --epochs 4 --rehearse 8

``--adapter DIR`` (repeatable) scores saved adapters instead, one after another: the learner's
versions from a kept bench arm (``ARM/data/adapters/global/global-0004``), rejected ones too, on
the same tasks, to see what a step taught apart from whether the gate let it through.

    python bench/lora_probe.py MODEL_DIR --skip-base --adapter ARM/data/adapters/global/global-0004
"""
import argparse
import json
import random
import time

import torch
from probe_setup import TARGETS, Probe, first_call_right

from whet.learner.model import cache_of, load_causal_lm, stop_token_ids, with_cache
from whet.learner.prompt import prompt_text
from whet.world.tasks import CHAT_PROBE

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--targets", default="attn")
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--rank", type=int, default=8)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--layers", type=int, default=None)
p.add_argument("--profile", default=None)
p.add_argument("--n", type=int, default=32)
p.add_argument("--heldout", type=int, default=12)
p.add_argument("--general", type=int, default=8)
p.add_argument("--chat", type=int, default=6)
p.add_argument("--skip-base", action="store_true")
p.add_argument("--rehearse", type=int, default=0)
p.add_argument("--adapter", action="append", default=[], help="a saved adapter folder to score (repeatable)")
args = p.parse_args()

torch.manual_seed(0)
tok, model = load_causal_lm(args.model, torch.device("cpu"), "float32")
stops = stop_token_ids(tok, model)
probe = Probe.of(tok, args.profile, args.n, args.heldout, args.general)
tools, system, profile = probe.tools, probe.system, probe.profile
train, heldout, general = probe.train, probe.heldout, probe.general
chat = list(CHAT_PROBE[: args.chat])
prompt_ids = probe.prompt_ids


def target_ids(task):
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": task.text}]
    head = prompt_text(tok, msgs, tools)
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": task.call.name, "arguments": json.dumps(dict(task.call.arguments), ensure_ascii=False)}}]}
    full = prompt_text(tok, msgs + [call], tools, add_generation_prompt=False)
    assert full.startswith(head)
    ids = tok.encode(full[len(head):], add_special_tokens=False)
    # up to and including <|im_end|>
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return ids[: ids.index(end) + 1]


def reply_ids(user, reply):
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    head = prompt_text(tok, msgs, tools)
    full = prompt_text(tok, msgs + [reply], tools, add_generation_prompt=False)
    ids = tok.encode(full[len(head):], add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return tok.encode(head, add_special_tokens=False), ids[: ids.index(end) + 1]


@torch.no_grad()
def generate(ids, n=80):
    out = model(torch.tensor([ids]), use_cache=True)
    cache, toks = cache_of(out), []
    for _ in range(n):
        t = int(out.logits[0, -1].argmax())
        if t in stops:
            break
        toks.append(t)
        out = model(torch.tensor([[t]]), **with_cache(cache), use_cache=True)
        cache = cache_of(out)
    return tok.decode(toks)


def evaluate(tag):
    model.eval()
    t0 = time.time()
    res = {}
    for name, items in (("heldout", heldout), ("general", general)):
        ok = 0
        for task in items:
            text = generate(prompt_ids(task.text))
            good = first_call_right(task, text)
            ok += good
            if not good and name == "heldout":
                print(f"  miss {task.text!r}: {text[:120]!r}", flush=True)
        res[name] = ok / len(items)
    ok = 0
    for request in chat:
        text = generate(prompt_ids(request), 24)
        ok += "<tool_call>" not in text
    res["chat"] = ok / len(chat)
    print(f"{tag}: {res} ({time.time()-t0:.0f}s)", flush=True)
    return res


if not args.skip_base:
    evaluate("base")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

if args.adapter:
    base = model
    for folder in args.adapter:
        model = PeftModel.from_pretrained(base, folder)
        evaluate(f"adapter {folder}")
        base = model.unload()  # the base weights back, untouched, for the next
    raise SystemExit(0)

targets = TARGETS[args.targets]
depth = model.config.num_hidden_layers
layers = None if args.layers is None else list(range(depth - args.layers, depth))
model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets,
                                         layers_to_transform=layers, task_type="CAUSAL_LM"))
opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr)
rows = [(prompt_ids(t.text), target_ids(t)) for t in train]
rehearsal = []
if args.rehearse:
    from whet.world.conversations import CHAT_PROMPTS
    from whet.world.tasks import GENERAL, NATURAL, make_task
    rrng = random.Random(7)
    model.eval()
    for request in CHAT_PROMPTS[::4][:16]:
        text = generate(prompt_ids(request), 40)
        if "<tool_call>" not in text and text.strip():
            rehearsal.append(reply_ids(request, {"role": "assistant", "content": text.strip()}))
    nchat = len(rehearsal)
    for i in range(24):
        t = make_task(GENERAL[i % len(GENERAL)], rrng, profile, vocab=NATURAL)
        rehearsal.append((prompt_ids(t.text), target_ids(t)))
    print(f"rehearsal: {nchat} chats, {len(rehearsal)-nchat} general calls", flush=True)
print(f"{len(rows)} samples, prompt ~{sum(len(r[0]) for r in rows)//len(rows)} tokens, "
      f"target ~{sum(len(r[1]) for r in rows)//len(rows)} tokens; personal {sum(t.personal for t in train)}", flush=True)
rng = random.Random(0)
for epoch in range(args.epochs):
    t0 = time.time()
    order = list(range(len(rows)))
    rng.shuffle(order)
    model.train()
    for b in range(0, len(order), args.batch):
        opt.zero_grad()
        losses = []
        items = [rows[i] for i in order[b: b + args.batch]] + rng.sample(rehearsal, min(args.rehearse, len(rehearsal)))
        for pr, tg in items:
            with torch.no_grad():
                cache = cache_of(model(torch.tensor([pr[:-1]]), use_cache=True))
            logits = model(torch.tensor([[pr[-1], *tg[:-1]]]), **with_cache(cache), use_cache=True).logits[0]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(tg))
            (loss / len(items)).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], 1.0)
        opt.step()
    print(f"epoch {epoch+1}: loss {sum(losses)/len(losses):.3f} ({time.time()-t0:.0f}s)", flush=True)
evaluate(f"after {args.epochs} epochs targets={args.targets} lr={args.lr} rank={args.rank}")
