"""What the engine tells operators: per-step records, per-request updates, live snapshots.

Two producers, one consumer interface (vLLM V1's ``StatLoggerBase``, reduced):

- the scheduler actor, after each step, builds a ``StepStats`` (batch size, prefill and decode
  tokens, duration, queue times of requests scheduled for the first time) and keeps the last
  ones in its ``StepHistory`` for ``/admin/stats``;
- each request task (``AsyncEngine.generate``) reports a ``RequestUpdate`` per output it
  receives (tokens, TTFT, inter-token latency) and one when it ends (finish reason, e2e).

Both hand their records to the ``StatLogger``s registered with the engine (the server's
Prometheus exporter). Loggers are called synchronously from the producing task and must be
cheap and never raise. No scheduler state leaves the scheduler except as these plain records
or as the dict its ``GetStats`` reply carries.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedserve.actors.request import Request


@dataclass(slots=True)
class StepStats:
    """One scheduler step.

    Attributes:
        time: ``time.monotonic()`` when the step's results came back.
        batch_size: requests scheduled in the step.
        num_prefill_tokens: prompt chunks (and recomputed tokens after preemption).
        num_decode_tokens: one per request that fed back its last sampled token.
        num_generated_tokens: tokens sampled in the step.
        duration_s: scheduling plus the forward pass.
        queue_times_s: arrival → first scheduled, for requests scheduled for the first time.
    """

    time: float
    batch_size: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    duration_s: float
    queue_times_s: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def row(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "prefill_tokens": self.num_prefill_tokens,
                "decode_tokens": self.num_decode_tokens,
                "duration_ms": round(self.duration_s * 1000, 3)}


@dataclass(slots=True)
class RequestUpdate:
    """What one request task saw since its previous update.

    Attributes:
        num_prompt_tokens: the prompt's length on the update carrying the first token, else 0
            (a prompt counts once its prefill is done, as vLLM counts it).
        num_generation_tokens: tokens received in this update.
        ttft_s: arrival → first token, on the update carrying the first token.
        itl_s: time since the previous token, on later updates with tokens.
        finish_reason: ``stop``, ``length``, ``abort`` (client gone) or ``error`` on the last
            update, else ``None``.
        e2e_s: arrival → end, on the last update.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None
    finish_reason: str | None = None
    e2e_s: float | None = None


class StatLogger(Protocol):
    def record_step(self, step: StepStats) -> None: ...

    def record_request(self, update: RequestUpdate) -> None: ...


class StepHistory:
    """The last ``maxlen`` steps for the admin view, and token rates over a sliding window.

    Rates keep running sums so a snapshot costs O(steps that left the window), not O(window).
    """

    def __init__(self, maxlen: int = 100, window_s: float = 10.0):
        self.recent: deque[StepStats] = deque(maxlen=maxlen)
        self.window_s = window_s
        self._window: deque[StepStats] = deque()
        self._prefill_sum = 0
        self._generated_sum = 0

    def append(self, step: StepStats) -> None:
        self.recent.append(step)
        self._window.append(step)
        self._prefill_sum += step.num_prefill_tokens
        self._generated_sum += step.num_generated_tokens

    def throughput(self, now: float | None = None) -> dict[str, float]:
        """Prompt (prefill) and generation tokens/s over the last ``window_s`` seconds; falls
        back to zero once the server has been idle for a window."""
        now = time.monotonic() if now is None else now
        while self._window and self._window[0].time < now - self.window_s:
            old = self._window.popleft()
            self._prefill_sum -= old.num_prefill_tokens
            self._generated_sum -= old.num_generated_tokens
        return {
            "window_s": self.window_s,
            "prompt_tokens_per_s": round(self._prefill_sum / self.window_s, 3),
            "generation_tokens_per_s": round(self._generated_sum / self.window_s, 3),
        }

    def rows(self) -> list[dict[str, Any]]:
        return [s.row() for s in self.recent]


def request_row(request: Request, num_blocks: int, now: float) -> dict[str, Any]:
    """One live request for the admin table; never its text or token ids."""
    first = request.first_token_time
    ttft = None if first is None else first - request.arrival_time
    return {
        "id": request.request_id,
        "state": request.status.value,
        "priority": 0,
        "prompt_tokens": request.num_prompt_tokens,
        "output_tokens": len(request.output_token_ids),
        "num_computed_tokens": request.num_computed_tokens,
        "num_blocks": num_blocks,
        # Prefix caching will set this attribute; until then nothing is ever cached.
        "cached_tokens": getattr(request, "num_cached_tokens", 0),
        "num_preemptions": request.num_preemptions,
        "age_s": round(now - request.arrival_time, 3),
        "ttft_s": None if ttft is None else round(ttft, 4),
    }
