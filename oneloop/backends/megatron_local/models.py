"""Model resolution for the local backend: a base-model name → its local Hugging Face directory,
the names it can serve, and what the sampling clients read from that directory (stop tokens,
context length, tokenizer).

A name resolves, in order, through `backend.models` (name → local HF directory), the named tiny
models (`oneloop.tiny.model`, built on first use), or an existing directory path.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# At module level: transformers' lazy attribute import is not thread-safe (two training clients
# created at once, the serve thread and the caller's, failed with "cannot import AutoConfig").
from transformers import AutoConfig, GenerationConfig

from oneloop.errors import CapabilityError


def resolve_model(models: Mapping[str, Path], base_model: str) -> Path:
    """A base-model name → its local Hugging Face directory (`models`, tiny, or a path)."""
    if base_model in models:
        return models[base_model].resolve()
    from oneloop.tiny.model import TINY_MODEL_NAME, build_tiny_model, named_tiny_specs

    if base_model in named_tiny_specs():
        return build_tiny_model(named_tiny_specs()[base_model])
    if Path(base_model).is_dir():
        if not (Path(base_model) / "config.json").is_file():
            raise CapabilityError(
                f"base_model={base_model!r} is a directory without config.json: pass a local "
                "Hugging Face model directory"
            )
        return Path(base_model).resolve()
    raise CapabilityError(
        f"base_model={base_model!r} is not known to the local backend: add it under "
        f"backend.models (name: local HF directory), use {TINY_MODEL_NAME!r}, or pass a path"
    )


def served_model_names(models: Mapping[str, Path]) -> list[str]:
    """Every base-model name the local backend resolves without a path, sorted."""
    from oneloop.tiny.model import named_tiny_specs

    return sorted({*models, *named_tiny_specs()})


def sampling_limits(model_dir: Path | str) -> tuple[tuple[int, ...], int]:
    """`(eos token ids, context length)` of the model in `model_dir`: the default stop tokens and
    the prompt + completion budget of its sampling clients."""
    eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    context = int(AutoConfig.from_pretrained(str(model_dir)).max_position_embeddings)
    return eos_ids, context


def load_tokenizer(model_dir: Path | str) -> Any:
    """The Hugging Face tokenizer of the model in `model_dir`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
