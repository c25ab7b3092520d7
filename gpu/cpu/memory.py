"""Where a CPU server's resident memory goes, and two ways to keep it small.

- ``lazy_zeros``: the KV pool on the CPU is anonymous memory mapped at start and zero by the
  kernel's contract, so its pages become resident only as blocks are first written: a server
  that has served little holds little, however large its budget (``--kv-cache-memory-bytes``,
  or vLLM's ``VLLM_CPU_KVCACHE_SPACE`` in GiB). ``torch.zeros`` would write every page at
  start (vLLM's CPU worker allocates its pool that way, and its RSS starts at the budget).
- ``release_freed_memory``: loading frees the checkpoint's tensors and, with GGUF blocks kept,
  the de-quantized weights no kernel reads; glibc keeps freed heap pages mapped until asked
  (``malloc_trim``), and a resident-memory figure taken after loading would count them.

``resident_breakdown`` is the start-up log's ``memory`` line: resident bytes (``VmRSS`` of
``/proc/self/status``), the weights' bytes, the KV pool reserved and resident (``mincore``
over its pages), and the rest (the Python heap, torch's libraries and buffers).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

import torch
from torch import nn

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are resident only once written (an anonymous mapping;
    page-aligned). The tensor keeps the mapping alive.

    The mapping asks for transparent huge pages (``MADV_HUGEPAGE``; honoured where THP is
    ``always`` or ``madvise``): a KV cache's decode writes one token row per layer per step,
    4 KB apart, so with 4 KB pages every new token of every sequence faulted a fresh page per
    layer and K/V (1.7B model, 32 streams: ~1500 faults, 22 ms of a 360 ms step on a VM). With
    2 MB pages residency grows in 2 MB steps per tensor instead."""
    count = prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: 4 KB pages, as before
            pass
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def release_freed_memory() -> None:
    """Hand the heap pages freed so far back to the OS (glibc's ``malloc_trim``; a no-op on
    other C libraries)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def resident_bytes() -> int | None:
    """This process's resident set (``VmRSS``), or ``None`` where ``/proc`` has no figure."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tensor_resident_bytes(t: torch.Tensor) -> int:
    """Resident bytes of a page-aligned CPU tensor's pages (``mincore``); its size if unknown.
    Pages only read so far map the kernel's shared zero page and count here (not in RSS)."""
    libc_name = ctypes.util.find_library("c")
    size = t.untyped_storage().nbytes()
    if not libc_name or t.data_ptr() % _PAGE:
        return size
    libc = ctypes.CDLL(libc_name, use_errno=True)
    pages = (size + _PAGE - 1) // _PAGE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(size), vec) != 0:
        return size
    return sum(b & 1 for b in bytes(vec)) * _PAGE


def weights_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model computes with: parameters and buffers, GGUF blocks,
    oneDNN-packed weights; a tensor shared by two modules (a tied embedding) counts once."""
    seen: dict[int, int] = {}
    for t in _model_tensors(model):
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN) have no storage
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _model_tensors(model: nn.Module) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    for m in model.modules():
        for name in ("qweight", "packed_weight"):
            t = getattr(m, name, None)
            if isinstance(t, torch.Tensor):
                yield t


@dataclass(slots=True)
class MemoryBreakdown:
    """Bytes: ``rss`` (``None`` without ``/proc``), ``weights``, the KV pool ``reserved`` and
    ``resident`` now, and ``other`` = rss - weights - resident KV."""

    rss: int | None
    weights: int
    kv_reserved: int
    kv_resident: int

    @property
    def other(self) -> int | None:
        return None if self.rss is None else self.rss - self.weights - self.kv_resident

    def as_log(self) -> dict[str, float | None]:
        def mib(n: int | None) -> float | None:
            return None if n is None else round(n / 2**20, 1)

        return {"rss_mib": mib(self.rss), "weights_mib": mib(self.weights),
                "kv_reserved_mib": mib(self.kv_reserved),
                "kv_resident_mib": mib(self.kv_resident), "other_mib": mib(self.other)}


def resident_breakdown(model: nn.Module,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> MemoryBreakdown:
    tensors = [t for kv in kv_caches for t in kv]
    on_cpu = [t for t in tensors if t.device.type == "cpu"]
    return MemoryBreakdown(
        rss=resident_bytes(),
        weights=weights_bytes(model) if next(model.parameters()).device.type == "cpu" else 0,
        kv_reserved=sum(t.nbytes for t in tensors),
        kv_resident=sum(tensor_resident_bytes(t) for t in on_cpu),
    )
