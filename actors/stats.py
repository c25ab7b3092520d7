"""What the engine tells operators: per-step records, per-request updates, live snapshots.

Two producers, one consumer interface (vLLM V1's ``StatLoggerBase``, reduced):

- the scheduler actor, after each step, builds a ``StepStats`` (batch size, prefill and decode
  tokens, duration, queue times of requests scheduled for the first time) and keeps the last
  ones in its ``StepHistory`` for ``/admin/stats``;
- each request task (``RequestStream``) reports a ``RequestUpdate`` per output it receives
  (tokens, TTFT, inter-token latency) and one when it ends (finish reason, e2e).

Both hand their records to the ``StatLogger``s registered with the engine (the server's
Prometheus exporter). Loggers are called synchronously from the producing task and must be
cheap and never raise.

Live snapshots are typed too (the split of vLLM's ``vllm/v1/metrics/stats.py``): the
scheduler's ``GetStats`` reply is a ``StatsSnapshot`` (``SchedulerStats``, ``KVCacheStats``,
the recent ``StepStats``, a ``Throughput``), built in the actor's own task from plain values;
``AsyncEngine.get_stats`` adds the model and the settings (``EngineStats``). Values are raw
(seconds, fractions); rounding and JSON keys belong to the HTTP edge
(``server/admin/stats_json.py``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve.actors.core.request import Request

if TYPE_CHECKING:
    from pagedserve.gpu.model_info import ModelInfo


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
        finished: the whole request's figures, on the last update (vLLM's per-request
            histograms).
        pooling: a pooling request's one update (``actors/engine/pooling.py``): its prompt and its
            end, counted apart from generation requests.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None
    finish_reason: str | None = None
    e2e_s: float | None = None
    finished: FinishedRequest | None = None
    pooling: bool = False


@dataclass(slots=True)
class FinishedRequest:
    """One ended request, as vLLM's ``FinishedRequestStats`` (``vllm/v1/metrics/stats.py``).

    Attributes:
        num_prompt_tokens, num_generation_tokens: its prompt and output lengths.
        max_tokens: the output cap it ran under (``max_tokens``; without one, its output length).
        prefill_s: first scheduled → first token; ``None`` without a token.
        decode_s: first token → last token; ``None`` without a token.
        inference_s: first scheduled → last token; ``None`` if never scheduled or no token.
        time_per_output_token_s: ``decode_s`` over the tokens after the first; ``None`` for
            fewer than two tokens.
        n: the client request's ``n`` (``SamplingParams.n``): on the first of its engine
            requests; 0 on the others, which ``request_params_n`` leaves out.
    """

    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int
    n: int = 1
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None
    time_per_output_token_s: float | None = None


class StatLogger(Protocol):
    def record_step(self, step: StepStats) -> None: ...

    def record_request(self, update: RequestUpdate) -> None: ...


@dataclass(slots=True)
class Throughput:
    """Token rates over the last ``window_s`` seconds of steps, in tokens/s."""

    window_s: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float


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

    def throughput(self, now: float | None = None) -> Throughput:
        """Prompt (prefill) and generation tokens/s over the last ``window_s`` seconds; falls
        back to zero once the server has been idle for a window."""
        now = time.monotonic() if now is None else now
        while self._window and self._window[0].time < now - self.window_s:
            old = self._window.popleft()
            self._prefill_sum -= old.num_prefill_tokens
            self._generated_sum -= old.num_generated_tokens
        return Throughput(self.window_s, self._prefill_sum / self.window_s,
                          self._generated_sum / self.window_s)


@dataclass(slots=True)
class RequestStats:
    """One live (waiting or running) request, for the admin table; never its text or tokens.

    Attributes:
        state: the ``RequestStatus`` value (``waiting``, ``running``, ``preempted``).
        priority: as sent; lower runs earlier under the ``priority`` policy.
        num_cached_tokens: prompt tokens found in the prefix cache at its last admission.
        num_blocks: KV blocks it holds now.
        age_s: arrival → the snapshot.
        ttft_s: arrival → first token, once there is one (a pooling request: its vector).
        kind: ``generate`` or ``pooling``.
    """

    request_id: str
    state: str
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_blocks: int
    num_cached_tokens: int
    num_preemptions: int
    age_s: float
    ttft_s: float | None
    kind: str = "generate"

    @classmethod
    def of(cls, request: Request, num_blocks: int, now: float) -> RequestStats:
        first = request.first_token_time
        return cls(
            request.request_id, request.status.value, request.priority,
            request.num_prompt_tokens, len(request.output_token_ids),
            request.num_computed_tokens, num_blocks, request.num_cached_tokens,
            request.num_preemptions, now - request.arrival_time,
            None if first is None else first - request.arrival_time,
            "generate" if request.pooling_params is None else "pooling",
        )


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding's running totals, as vLLM's ``spec_decode`` metrics count them
    (``vllm/v1/spec_decode/metrics.py``).

    Attributes:
        num_drafts: verify passes of one request that had at least one draft.
        num_draft_tokens, num_accepted_tokens: drafts scored and accepted, in tokens.
        drafted_per_pos, accepted_per_pos: the same per draft position (0 = the first draft).
        draft_seconds: time spent proposing (n-gram lookup in the scheduler, the draft
            model's passes in the runner); verify_seconds: the runner's steps that verified
            drafts (target forward and rejection sampling).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verify: ``num_drafted`` drafts, the first ``num_accepted`` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.drafted_per_pos) < num_drafted:
            grow = num_drafted - len(self.drafted_per_pos)
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(num_drafted):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < num_accepted

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Share of the drafts at each position that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify pass yields on average: the accepted drafts plus the one sampled
        (vLLM's "mean acceptance length"); 0 before any."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self, extra_draft_seconds: float = 0.0) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.drafted_per_pos), list(self.accepted_per_pos),
                               self.draft_seconds + extra_draft_seconds, self.verify_seconds)


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's queues and running totals (``*_total``: since start).

    Attributes:
        num_waiting_for_grammar: guided requests parked while their grammar compiles.
        num_draft_tokens, num_accepted_tokens: speculative decoding's drafts scored and
            accepted, in tokens (also in ``spec_decode``, with the rest of its figures).
        num_computed_tokens_total: tokens run through the model (prefill + decode).
        requests: the waiting and running requests, running first.
        num_beam_forks_total: beams forked by beam searches (each shares its parent's blocks
            and copies at most its last partial block).
        max_batches_in_flight: most steps the executor held at once (``actors/core/inflight.py``).
        num_scheduled_ahead_total: requests put in a step while in another one in flight.
    """

    num_running: int
    num_waiting: int
    num_waiting_for_grammar: int
    num_preemptions_total: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_steps_total: int
    num_computed_tokens_total: int
    policy: str
    requests: list[RequestStats] = field(default_factory=list)
    num_beam_forks_total: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    max_batches_in_flight: int = 0
    num_scheduled_ahead_total: int = 0
    kv_transfer: KVTransferStats | None = None  # with a KV connector only
    # --enable-lora: adapter name -> requests running / waiting with it; ``max_lora``
    # (vLLM's label) is --max-loras, 0 without LoRA.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    max_lora: int = 0
    # Pooling requests (``--runner pooling``), apart from generation: live now (also in
    # num_running / num_waiting) and finished with their vector since start.
    num_pooling_running: int = 0
    num_pooling_waiting: int = 0
    num_pooling_finished_total: int = 0


@dataclass(slots=True)
class KVTransferStats:
    """A KV connector's work on this instance (``actors/kv/transfer.py``), in prompt tokens and
    requests: tokens loaded vs computed, loads that failed, requests parked for a remote load,
    and finished requests whose blocks are held for a consumer (with the blocks they hold)."""

    connector: str
    role: str
    num_loaded_prompt_tokens_total: int = 0
    num_computed_prompt_tokens_total: int = 0
    num_failed_loads_total: int = 0
    num_waiting_for_remote_kvs: int = 0
    num_held_requests: int = 0
    num_held_blocks: int = 0
    num_hold_timeouts_total: int = 0


@dataclass(slots=True)
class KVCacheStats:
    """The KV block pool and the prefix cache (queries and hits in prompt tokens).

    Attributes:
        num_cached_blocks: blocks indexed by the prefix cache (held or free).
        usage: held blocks / all blocks (0 idle, 1 full).
        num_shared_blocks: blocks held by more than one request now (a prefix several running
            requests share, beams of one beam search).
        num_copied_blocks_total: copy-on-write copies since start (a beam that diverged
            copied its last partial block).
        sliding_window: the window in tokens past which running requests' blocks are
            released (every layer has one), else None.
        num_released_blocks_total: blocks so released since start.
        max_blocks_in_use: the most blocks held at once since start.
    """

    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_shared_blocks: int = 0
    num_copied_blocks_total: int = 0
    sliding_window: int | None = None
    num_released_blocks_total: int = 0
    max_blocks_in_use: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0


@dataclass(slots=True)
class StatsSnapshot:
    """The scheduler actor's ``GetStats`` reply."""

    scheduler: SchedulerStats
    kv_cache: KVCacheStats
    steps: list[StepStats]
    throughput: Throughput


@dataclass(slots=True)
class EngineStats:
    """``AsyncEngine.get_stats``: the scheduler's snapshot plus what the engine knows.

    Attributes:
        model: the loaded model.
        config: the settings in force (``AsyncEngine.effective_config``).
        time: wall clock of the snapshot (``time.time()``).
    """

    scheduler: SchedulerStats
    kv_cache: KVCacheStats
    steps: list[StepStats]
    throughput: Throughput
    model: ModelInfo
    config: dict[str, Any]
    time: float
