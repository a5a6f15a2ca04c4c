"""Loading the base causal LM, for serving and for training alike.

One loader so the learner trains exactly the weights the runtime serves: an HF
model id (from the local cache when offline) or a ``save_pretrained`` folder;
``smollm2`` names the default model and ``tiny`` the untrained tiny model tests use,
both built in the data directory's ``models/`` folder.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


class ModelLoadError(Exception):
    """The model cannot be loaded; the message says what to pass instead."""


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
    return model_id


def pick_device(device: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU; otherwise a torch device string (``cuda:1``)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_causal_lm(model_id_or_path: str, device: torch.device, dtype: str = "auto") -> tuple[Any, Any]:
    """(tokenizer, model) on ``device`` in eval mode.

    ``dtype``: ``auto`` = the checkpoint's dtype on CUDA and float32 on CPU, or a torch dtype name.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_id_or_path).expanduser()
    local = path.exists() or model_id_or_path.startswith(("/", ".", "~"))
    if local and not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist; pass a folder written by save_pretrained")
    if local and not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} has no config.json; pass a folder saved by save_pretrained")
    source = str(path) if local else model_id_or_path
    torch_dtype: Any = dtype if dtype != "auto" else ("auto" if device.type == "cuda" else torch.float32)
    if isinstance(torch_dtype, str) and torch_dtype != "auto":
        torch_dtype = getattr(torch, torch_dtype)
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
