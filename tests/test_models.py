"""The models whet builds into its data dir: the untrained tiny model tests use (``model.id: tiny``),
built safely on first use, and the default model's folder (``model.id: smollm2``, ``whet model build``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from whet.learner.model import ModelLoadError, model_dir, resolve_source


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
    from whet.runtime.policy import SamplingParams, create_backend

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
