"""The one place that turns ``model.backend`` into a :class:`~whet.runtime.policy.PolicyBackend`.

It sits beside the entrypoints that read config (``whet serve``, the app's lifespan), so the
Protocol's module imports none of its implementations and they import it one way only.
"""

from __future__ import annotations

from pathlib import Path

from whet.config.settings import ModelConfig
from whet.runtime.policy import BackendError, PolicyBackend


def create_backend(model: ModelConfig, data_dir: Path) -> PolicyBackend:
    """The backend ``model`` configures.

    ``id: smollm2`` (transformers) serves the default model from ``data_dir/models/smollm2``;
    ``id: tiny`` the untrained tiny model, built into ``data_dir/models/tiny`` on first use.
    """
    if model.backend == "transformers":
        from whet.learner.model import ModelLoadError, resolve_source
        from whet.runtime.hf import TransformersBackend

        try:
            source = resolve_source(model.id, data_dir)
        except ModelLoadError as exc:  # not built yet, or a folder in the way
            raise BackendError(str(exc)) from None
        return TransformersBackend(
            source,
            device=model.device,
            dtype=model.dtype,
            workers=model.workers,
            model_name=model.name,
            max_context_tokens=model.max_context_tokens,
        )
    if not model.base_url:
        raise BackendError(
            f"model.base_url is required for the {model.backend} backend (e.g. http://127.0.0.1:8001/v1)"
        )
    from whet.runtime.remote import OpenAIBackend, VllmBackend

    kind = VllmBackend if model.backend == "vllm" else OpenAIBackend
    return kind(model.base_url, model.api_key, model.id, timeout=model.request_timeout, model_name=model.name)
