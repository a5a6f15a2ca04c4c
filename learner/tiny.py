"""The untrained tiny model tests use: a Qwen2-shaped causal LM of about 140 thousand
parameters and a byte-level BPE tokenizer learned in a second, with no download.

:func:`build_tiny_model` writes it as an ordinary HF folder (``save_pretrained``) with Qwen2.5's
own chat template (:data:`whet.learner.templates.CHAT_TEMPLATE`): random weights, but real token
ids and log-probs for tests of the serving and learning paths. ``model.id: tiny`` serves it,
built on first use into ``<data_dir>/models/tiny`` (:func:`ensure_tiny_model`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from whet.learner.model import ModelLoadError, staged
from whet.learner.templates import CHAT_TEMPLATE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# like Qwen2.5: single tokens, but not "special", so decoding never drops them
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>'
)

_TOPICS = (
    "weather in Paris", "time in Tokyo", "my calendar tomorrow", "the meeting notes", "a short poem",
    "groceries for the week", "the train to Berlin", "python list comprehension", "a birthday message",
    "the capital of Canada", "how to boil an egg", "the latest report", "files in the project folder",
)
_TOOLS = (
    ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ("send_email", '{"to": "maria@example.com", "subject": "Lunch", "body": "See you at noon."}'),
    ("create_reminder", '{"text": "Pay the electricity bill", "when": "tomorrow 09:00"}'),
    ("web_search", '{"query": "best hiking trails nearby", "max_results": 3}'),
    ("run_python", '{"code": "print(sum(range(10)))"}'),
    ("get_current_time", '{"timezone": "Asia/Tokyo"}'),
    ("search_notes", '{"query": "meeting notes", "limit": 5}'),
    ("read_file", '{"path": "README.md"}'),
    ("remember", '{"fact": "The user prefers short answers."}'),
    ("list_events", '{"date": "2025-01-31"}'),
)
_PROSE = (
    "You are whet, a helpful personal assistant. Use the tools when they help; answer briefly and plainly.",
    "Sure, here is what I found. The answer is below, and I can look up more details if you want.",
    "I could not find that, sorry. Could you tell me which file or date you mean?",
    "The weather is sunny with a light breeze, around twenty degrees, and rain is expected tonight.",
    "It is half past three in the afternoon. Your next meeting starts in forty minutes.",
    "Thanks for the feedback! I will keep my answers shorter from now on.",
    "Here are three ideas: take a walk, call a friend, or read a good book before dinner.",
    "The function returned an error because the argument was missing; I will try again with the path.",
    "Good morning! Today you have a dentist appointment at nine and lunch with Maria at noon.",
    "Remember to water the plants, pay the electricity bill, and send the invoice to the client.",
    "The document explains how the system stores memories, trains adapters, and serves requests.",
    "Searching the web returned several results; the most relevant article was published yesterday.",
    "Your flight departs from gate twelve; boarding begins forty-five minutes before departure.",
    "I summarised the conversation: we agreed on the budget, the schedule, and the next steps.",
    "Please confirm whether you would like me to create the reminder or cancel the request.",
    "The recipe needs flour, sugar, butter, eggs, vanilla, and a pinch of salt; bake for thirty minutes.",
    "Translation: bonjour means hello, merci means thank you, and au revoir means goodbye.",
    "The temperature dropped overnight, so wear a warm jacket, gloves, and a scarf this morning.",
    "According to the database, the customer ordered two laptops, one monitor, and a keyboard.",
    "Error: permission denied while opening the configuration file. Check the folder settings.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps quietly by the window.",
    "Learning happens online: every action is recorded together with the state that followed it.",
    "Would you prefer a detailed explanation, a brief summary, or a list of bullet points?",
    "The library opens at eight, closes at six, and is closed on Sundays and public holidays.",
    "Mathematics: the square root of sixteen is four, and seven multiplied by six is forty-two.",
    "History: the printing press changed how knowledge spread across Europe in the fifteenth century.",
    "The server restarted successfully; all services are healthy and responding within limits.",
    "I have updated your profile with the new address, phone number, and email preferences.",
    "Music recommendation: try some jazz piano, classical guitar, or ambient electronic tracks.",
    "The project deadline moved to Friday, so the review meeting is rescheduled to Thursday afternoon.",
    "Hiking tips: bring water, check the forecast, tell someone your route, and start early.",
    "Your package was shipped this morning and should arrive within three business days.",
    "Health reminder: stretch every hour, drink enough water, and take short breaks from screens.",
)


_TOOL_SPECS = (
    ("get_weather", "Current weather for a city.", {"city": ("string", "City name, e.g. 'Paris'.")}),
    ("convert", "Convert a value between units of the same dimension.", {
        "value": ("number", "The amount to convert."),
        "from_unit": ("string", "Unit of the value, e.g. 'km'."),
        "to_unit": ("string", "Target unit, e.g. 'mi'."),
    }),
    ("add_note", "Save a note for the user and return its id.", {
        "title": ("string", "A short title."),
        "text": ("string", "The body of the note."),
        "tags": ("array", "Optional list of tags."),
    }),
    ("get_current_time", "Get the current time in a timezone or city.", {
        "timezone": ("string", "IANA timezone name such as 'Europe/Lisbon', or a city."),
    }),
    ("list_events", "List calendar events between two dates, at most limit of them.", {
        "start_date": ("string", "First day, as YYYY-MM-DD."),
        "end_date": ("string", "Last day, as YYYY-MM-DD."),
        "limit": ("integer", "Maximum number of events to return."),
        "include_all_day": ("boolean", "Whether to include all-day events."),
    }),
)


def _tool_spec(name: str, description: str, fields: dict[str, tuple[str, str]]) -> str:
    """An OpenAI function spec as the chat template writes it (JSON schema as MCP servers publish it)."""
    properties = {
        key: {"description": text, "title": key.replace("_", " ").title(), "type": kind}
        for key, (kind, text) in fields.items()
    }
    parameters = {
        "type": "object", "properties": properties, "required": list(fields)[:1], "title": f"{name}Arguments"
    }
    function = {"name": name, "description": description, "parameters": parameters}
    return json.dumps({"type": "function", "function": function})


def _corpus() -> list[str]:
    """Chat, tool-spec and tool-call text in the template's own format, for BPE merges."""
    specs = "\n".join(_tool_spec(*spec) for spec in _TOOL_SPECS)
    lines = list(_PROSE)
    # the tools header is in every prompt that has tools: it should cost few tokens
    lines += [f"<|im_start|>system\n{_PROSE[0]}\n\n{_TOOLS_HEADER}\n{specs}\n{_TOOLS_FOOTER}"] * 4
    for i, topic in enumerate(_TOPICS):
        name, args = _TOOLS[i % len(_TOOLS)]
        answer = _PROSE[i % len(_PROSE)]
        call = f'{{"name": "{name}", "arguments": {args}}}'
        result = f'{{"result": "ok", "topic": "{topic}"}}'
        lines.append(
            f"<|im_start|>user\nCan you help me with {topic}?<|im_end|>\n"
            f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
            f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\nHere is what I found about {topic}: {answer}<|im_end|>\n"
        )
    return lines


def build_tokenizer(vocab_size: int = 1024, corpus: Iterable[str] | None = None, template: str = CHAT_TEMPLATE):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with the ChatML specials and chat template.

    ``corpus``: the text to learn merges from (default: a small built-in sample of chat text).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # Qwen2's normalizer and pre-tokenizer: AutoTokenizer loads this folder as a
    # Qwen2Tokenizer (from config.json), which rebuilds them; they must agree.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus() if corpus is None else corpus, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
        model_max_length=32768,
    )


def build_tiny_model(
    out_dir: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_size: int = 1024,
    seed: int = 0,
) -> Path:
    """An untrained model of this shape in ``out_dir`` (created); returns it.

    Random weights: it generates noise, but real noise, with real token ids and
    log-probs, which is what tests of the serving and learning paths need.
    ``vocab_size`` is the BPE target; the model's vocabulary is the tokenizer's
    actual size. Same arguments and torch version, same weights.
    """
    tokenizer = build_tokenizer(vocab_size)
    model = _init_model(tokenizer, hidden_size, num_layers, num_heads, seed, intermediate_size=hidden_size * 2)
    return _save(model, tokenizer, Path(out_dir))


def _init_model(tokenizer, hidden_size: int, num_layers: int, num_heads: int, seed: int, *,
                intermediate_size: int | None = None):
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=32768,  # like Qwen2.5; RoPE costs nothing per position
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without moving the caller's RNG
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    return model


def _save(model, tokenizer, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def ensure_tiny_model(out_dir: Path, *, seed: int = 0) -> Path:
    """``out_dir`` holding the tiny model, built there on first use; returns it.

    Built into a sibling temp folder and renamed into place, so a crash or a
    second process building at the same time never leaves a half-written model.
    """
    out_dir = Path(out_dir).expanduser()
    if (out_dir / "config.json").is_file():
        return out_dir
    if out_dir.is_dir() and any(out_dir.iterdir()):
        problem = f"{out_dir} exists but holds no model (no config.json)"
        raise ModelLoadError(f"{problem}; move it away to rebuild the tiny model")
    if out_dir.is_dir():
        out_dir.rmdir()
    return staged(out_dir, lambda folder: build_tiny_model(folder, seed=seed))
