"""`whet demo-model build`: a model folder the server loads with its normal loading code."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest


def whet(*args: str) -> subprocess.CompletedProcess:
    """The CLI in its own process (it configures logging for the process, as a real run does)."""
    return subprocess.run([sys.executable, "-m", "whet.runtime.cli", *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "model"
    done = whet("demo-model", "build", "--size", "tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"built {out}" in done.stdout and "training" in done.stderr  # the progress bar
    return out


def test_build_writes_an_ordinary_hf_folder_with_the_demo_template(built):
    from transformers import AutoConfig, AutoTokenizer

    names = {p.name for p in built.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert AutoConfig.from_pretrained(built).model_type == "qwen2"
    tokenizer = AutoTokenizer.from_pretrained(built)
    tools = [{"type": "function", "function": {"name": "now", "description": "Current time.",
                                               "parameters": {"type": "object", "properties": {"timezone": {}}}}}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert "# Tools\n- now(timezone)\n" in text and text.endswith("<|im_start|>assistant\n")


def test_build_refuses_to_overwrite_a_model_without_force(built):
    done = whet("demo-model", "build", "--size", "tiny", "--out", str(built))
    assert done.returncode == 1 and "pass --force to rebuild it" in done.stderr
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


def test_training_reports_every_step_and_the_loss_falls(tmp_path):
    from whet.learner.demo_model import SIZES, build_demo_model

    losses: list[float] = []
    build_demo_model(tmp_path / "m", size="tiny", steps=12, progress=lambda s, d, t, info: losses.extend(
        [info["loss"]] if s == "train" else []))
    assert len(losses) == SIZES["tiny"].copy_steps + 12  # the copying warm-up, then the conversations
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3  # SFT learns something even at this size
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 2


def test_serve_with_a_non_model_folder_where_the_demo_goes_is_one_error_line(tmp_path):
    data = tmp_path / "data"
    (data / "demo-model-tiny").mkdir(parents=True)
    (data / "demo-model-tiny" / "notes.txt").write_text("not a model")
    config = tmp_path / "whet.yaml"
    config.write_text(f"data_dir: {data}\nmodel: {{demo_size: tiny}}\nmemory: {{embedder: hashing}}\n")
    done = whet("serve", "--config", str(config))
    assert done.returncode == 1 and "holds no model" in done.stderr and "move it away" in done.stderr
    assert "Traceback" not in done.stderr
