"""transformers' GGUF config and tokenizer, read without gguf-py's ``GGUFReader``.

``AutoConfig.from_pretrained(..., gguf_file=)`` and ``AutoTokenizer.from_pretrained(...,
gguf_file=)`` each call transformers' legacy ``load_gguf_checkpoint``, which opens the file
with ``gguf.GGUFReader``; that reader builds numpy objects for every element of the ~100k
tokenizer strings and merges: 3-4 s per call on these 2-core machines for any file with
SmolLM2's vocabulary, 7 s of a 1.7B file's first start. Inside ``fast_reader()`` the legacy
function gets a ``MetadataReader`` instead, built from transformers' own header reader
(``integrations.gguf.reader.read_gguf_metadata``, tens of milliseconds), so the same
transformers code turns the same keys into the same config and tokenizer. Where that reader
is missing (older transformers) or cannot read a file, the legacy path runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

# gguf-py's GGUFValueType codes, as transformers' ``_gguf_parse_value`` reads them.
_UINT32, _FLOAT32, _BOOL, _STRING, _ARRAY = 4, 6, 7, 8, 9
# The one string array a config reads: its length is the vocabulary size where the file has
# no ``{arch}.vocab_size``. The rest (merges, ...) stay counts (the tokenizer reads them itself).
_STRING_ARRAYS = ("tokenizer.ggml.tokens",)


@dataclass(slots=True)
class _Field:
    """One metadata key in ``gguf.ReaderField``'s shape: ``parts[i] for i in data`` are the
    values, ``types`` their value types (``[ARRAY, element type]`` for an array)."""

    parts: list
    data: list[int]
    types: list[int]


@dataclass(slots=True)
class _Tensor:
    name: str


def _scalar_type(value) -> int:
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _UINT32  # any integer code parses as int()
    if isinstance(value, float):
        return _FLOAT32
    if isinstance(value, str):
        return _STRING
    raise TypeError(f"unexpected GGUF metadata value {type(value).__name__}")


def _part(value) -> list | bytes:
    return value.encode() if isinstance(value, str) else [value]


def _field(value) -> _Field:
    if isinstance(value, list):
        kind = _scalar_type(value[0]) if value else _UINT32
        return _Field([_part(v) for v in value], list(range(len(value))), [_ARRAY, kind])
    return _Field([_part(value)], [0], [_scalar_type(value)])


class MetadataReader:
    """What ``load_gguf_checkpoint(path, return_tensors=False)`` reads of a ``GGUFReader``:
    ``fields`` (key → ``_Field``) and ``tensors`` (their ``name`` only).

    Raises:
        ImportError: transformers has no fast header reader.
        ValueError, TypeError: the file's metadata is not what it reads.
    """

    def __init__(self, path, *_args, **_kwargs):
        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, names = read_gguf_metadata(str(path), _STRING_ARRAYS)
        self.fields = {key: _field(value) for key, value in metadata.items()}
        self.tensors = [_Tensor(name) for name in names]


@contextlib.contextmanager
def fast_reader() -> Iterator[None]:
    """Inside the block, transformers' legacy GGUF metadata path reads through
    ``MetadataReader`` (it imports ``gguf.GGUFReader`` when called). Not thread-safe: the
    start-up's one extraction, on one thread."""
    import gguf

    saved = gguf.GGUFReader
    gguf.GGUFReader = MetadataReader
    try:
        yield
    finally:
        gguf.GGUFReader = saved


def read_config_and_tokenizer(folder, name: str):
    """``(config, tokenizer)`` of the GGUF file ``folder/name``, as transformers'
    ``AutoConfig`` / ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` give them.

    Raises:
        whatever transformers raises for a file it cannot read.
    """
    from transformers import AutoConfig, AutoTokenizer

    def read():
        return (AutoConfig.from_pretrained(folder, gguf_file=name),
                AutoTokenizer.from_pretrained(folder, gguf_file=name))

    try:
        with fast_reader():
            return read()
    except Exception as e:  # any mismatch with what the legacy reader expects: its own path
        log.info("gguf_fast_metadata_failed", file=name, error=f"{type(e).__name__}: {e}")
    return read()
