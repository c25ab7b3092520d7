"""Scheduler settings, named as vLLM's flags."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.actors.spec_decode import SpeculativeConfig


@dataclass(slots=True)
class SchedulerConfig:
    """Attributes:
    max_num_seqs: running requests at most.
    max_num_batched_tokens: tokens computed in one step at most (prefill chunks + decodes).
    policy: ``fcfs`` or ``priority`` (request field ``priority``, lower runs earlier).
    max_waiting_requests: new requests are refused (HTTP 503) while this many wait;
        ``None`` = unbounded.
    speculative: n-gram speculative decoding (``--speculative-config``); ``None`` = off.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    max_waiting_requests: int | None = None
    speculative: SpeculativeConfig | None = None
