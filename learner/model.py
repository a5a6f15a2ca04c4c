"""Loading the base causal LM, for serving and for training alike.

One loader so the learner trains exactly the weights the runtime serves: an HF
model id (from the local cache when offline), a ``save_pretrained`` folder, or a local
``.gguf`` file (converted once into an HF folder in the data directory, since peft and the
trainer need ordinary float weights); ``smollm2`` names the default model and ``tiny`` the
untrained tiny model tests use, both built in the data directory's ``models/`` folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


class ModelLoadError(Exception):
    """The model cannot be loaded; the message says what to pass instead."""


@functools.cache
def _cache_name() -> str:
    """The KV cache's keyword in a model's forward and its attribute on the output: transformers
    5.24 renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def with_cache(cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword argument a model's forward takes it by."""
    return {_cache_name(): cache}


def cache_of(output: Any) -> Any:
    """The KV cache a forward pass returned."""
    return getattr(output, _cache_name())


DEFAULT_MODEL = "smollm2"
TINY_MODEL = "tiny"


def model_dir(data_dir: Path, name: str) -> Path:
    """Where a model whet builds itself (:data:`DEFAULT_MODEL`, :data:`TINY_MODEL`) lives in a data directory."""
    return Path(data_dir).expanduser() / "models" / name


def resolve_source(model_id: str, data_dir: Path) -> str:
    """``model_id`` as something ``from_pretrained`` accepts.

    ``smollm2`` must be built already (``whet serve`` builds it first); ``tiny`` is built on first use.
    """
    if model_id == DEFAULT_MODEL:
        folder = model_dir(data_dir, model_id)
        if (folder / "config.json").is_file():
            return str(folder)
        raise ModelLoadError(
            f"the default model is not built yet in {folder}; `whet serve` builds it on first start, "
            "or run `whet model build`"
        )
    if model_id == TINY_MODEL:
        from whet.learner.tiny import ensure_tiny_model

        return str(ensure_tiny_model(model_dir(data_dir, model_id)))
    if model_id.endswith(".gguf"):
        return str(ensure_converted(Path(model_id).expanduser(), data_dir))
    return model_id


# -- GGUF ----------------------------------------------------------------------------------


def ensure_converted(gguf: Path, data_dir: Path) -> Path:
    """The HF folder converted from the local GGUF file ``gguf``, converted on first use into
    ``<data_dir>/models/gguf/<name>-<key>`` (the key follows the file's path, size and time)."""
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file {gguf} does not exist; pass the path of a .gguf file")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    out = model_dir(data_dir, "gguf") / f"{gguf.stem}-{key}"
    if not (out / "config.json").is_file():
        convert_gguf(gguf, out)
    return out


def load_gguf(gguf: Path) -> tuple[Any, Any]:
    """(tokenizer, float32 model) from a GGUF file, dequantized by transformers (needs ``gguf``).

    transformers flags a model loaded from GGUF as quantized and will not save it, so its weights
    are copied into a fresh model of the same architecture: an ordinary model from here on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelLoadError(f"reading {gguf.name} needs the gguf package: pip install gguf ({exc})") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the GGUF file {gguf}: {exc}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = type(loaded)(config)  # not on the meta device: RoPE's buffers are not in the state dict
    model.load_state_dict(loaded.state_dict())
    return tokenizer, model.to(torch.float32).eval()


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Write the model in ``gguf`` as an ordinary HF folder at ``out_dir`` (staged, then renamed)."""
    tokenizer, model = load_gguf(gguf)
    return save_folder(model, tokenizer, out_dir)


def save_folder(model: Any, tokenizer: Any, out_dir: Path) -> Path:
    """``save_pretrained`` the model and its tokenizer as an ordinary HF folder at ``out_dir`` (staged)."""

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        _drop_quantization(folder / "config.json")

    return staged(Path(out_dir), write)


def staged(out_dir: Path, write: Callable[[Path], Any]) -> Path:
    """Run ``write(folder)`` into a sibling temp folder, then rename it to ``out_dir``: a crash or a
    second process building at the same time never leaves a half-written model there."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        staging.rename(out_dir)
    except OSError:  # someone else finished first (or an unrelated folder is in the way)
        shutil.rmtree(staging, ignore_errors=True)
        if not (out_dir / "config.json").is_file():
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _drop_quantization(config_file: Path) -> None:
    """A converted model's config must not say it is quantized: it would be loaded as GGUF again."""
    data = json.loads(config_file.read_text())
    if data.pop("quantization_config", None) is not None:
        config_file.write_text(json.dumps(data, indent=2) + "\n")


def pick_device(device: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU; otherwise a torch device string (``cuda:1``)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def serving_dtype(dtype: str, device: torch.device) -> str:
    """``auto``: bfloat16 on a CUDA device that computes it natively (:func:`cuda_has_bfloat16`), float32
    elsewhere: on CPU bfloat16 prefilled faster but decoded 2-5x slower on the tiny model (an AVX2 CPU
    without bf16 instructions; README, Speed), and a GPU before Ampere only emulates it.
    ``python bench/dtype.py --device cuda`` measures the two on a GPU at hand."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" and cuda_has_bfloat16(device) else "float32"


def cuda_has_bfloat16(device: torch.device) -> bool:
    """Whether a CUDA device has bfloat16 tensor cores: compute capability 8.0 and up (A100, H100, RTX 30xx
    and later; ROCm's MI200 and later). V100 and T4 (7.x) run bfloat16 through slow emulation."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def load_causal_lm(model_id_or_path: str, device: torch.device, dtype: str = "auto") -> tuple[Any, Any]:
    """(tokenizer, model) on ``device`` in eval mode.

    ``dtype``: ``auto`` (:func:`serving_dtype`) or a torch dtype name. The server and the learner
    both load through here, so the learner recomputes log-probs on the weights that served them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_id_or_path).expanduser()
    local = path.exists() or model_id_or_path.startswith(("/", ".", "~"))
    if local and not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist; pass a folder written by save_pretrained")
    if local and not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} has no config.json; pass a folder saved by save_pretrained")
    source = str(path) if local else model_id_or_path
    torch_dtype = getattr(torch, serving_dtype(dtype, device))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=local, dtype=torch_dtype)
    except OSError as exc:
        if local:
            raise ModelLoadError(f"cannot load the model in {path}: {exc}") from exc
        raise ModelLoadError(
            f"cannot download {model_id_or_path}: offline? pass a local folder "
            f"(or pre-fetch it into the HF cache). Cause: {exc}"
        ) from exc
    return tokenizer, model.to(device).eval()


@contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence two peft warnings that are not ours to act on: it reads transformers' deprecated
    ``is_gradient_checkpointing``, and it notes when its "active" adapter is deleted (whet routes
    adapters per request and never uses peft's active one)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*was active which is now deleted", category=UserWarning)
        yield


def stop_token_ids(tokenizer: Any, model: Any) -> set[int]:
    """The token ids that end a reply: the tokenizer's end of text, the model's generation ends,
    and ChatML's ``<|im_end|>`` where the vocabulary has it."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return {i for i in ids if isinstance(i, int)}
