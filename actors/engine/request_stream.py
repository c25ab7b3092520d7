"""One request's stream of deltas: the single owner of the request's lifetime.

``AsyncEngine.add_request`` returns a ``RequestStream`` once the scheduler has accepted the
request. The stream reads the request's output queue, detokenizes, applies stop strings and
reports tokens and the end to the stat loggers. The request leaves the ``LIVE`` state exactly
once, by one of two transitions:

- ``_finished``: the scheduler ended it (EOS, stop token, length, error, server abort) and has
  already freed its blocks, so nothing is sent back;
- ``_abort``: the reader ended it (a stop string matched, the reader closed the stream or was
  cancelled, the stream was dropped unread), so ``AbortRequest`` goes to the scheduler, which
  frees the blocks before its next step.

Either transition reports the end to the stat loggers, once. (vLLM V1 splits this between
``AsyncLLM.generate``, which aborts on cancellation, and the per-request state of
``vllm/v1/engine/output_processor.py``; here one object holds both.)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from pagedserve.actors.actor import Actor
from pagedserve.actors.core.request import Request, RequestOutput
from pagedserve.actors.engine.detokenizer import IncrementalDetokenizer
from pagedserve.actors.engine.protocol import BeamSearchHandle, DeltaStream, GenerationDelta
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.actors.messages import AbortRequest, SchedulerMessage
from pagedserve.actors.stats import FinishedRequest, RequestUpdate, StatLogger


class StreamState(enum.Enum):
    LIVE = "live"  # the scheduler holds the request
    FINISHED = "finished"  # the scheduler ended it and let go
    ABORTED = "aborted"  # the reader ended it; AbortRequest sent


class RequestMetrics:
    """Reports one request's tokens (TTFT, then inter-token latency) and its end, as the
    client sees them, to the engine's stat loggers (the server's Prometheus metrics)."""

    __slots__ = ("loggers", "first_token_time", "last_token_time", "num_tokens")

    def __init__(self, loggers: list[StatLogger]):
        self.loggers = loggers
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0

    def tokens(self, request: Request, n: int) -> None:
        if not self.loggers or not n:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            update = RequestUpdate(request.num_prompt_tokens, n,
                                   ttft_s=now - request.arrival_time)
            self.first_token_time = now
        else:
            update = RequestUpdate(0, n, itl_s=now - self.last_token_time)
        self.last_token_time = now
        self.num_tokens += n
        self._send(update)

    def finished(self, request: Request, finish: str | None) -> None:
        if self.loggers:  # no finish reason here means the client went away
            self._send(RequestUpdate(finish_reason=finish or "abort",
                                     e2e_s=time.monotonic() - request.arrival_time,
                                     finished=self._summary(request)))

    def _summary(self, request: Request) -> FinishedRequest:
        """The phases as vLLM splits them: queued → scheduled → first token → last token."""
        cap = request.sampling_params.max_tokens  # None: up to the context, unknown here
        summary = FinishedRequest(request.num_prompt_tokens, self.num_tokens,
                              self.num_tokens if cap is None else cap,
                              n=request.sampling_params.n)
        first, last = self.first_token_time, self.last_token_time
        scheduled = request.scheduled_time
        if first is None or last is None:
            return summary
        if scheduled is not None:
            summary.prefill_s, summary.inference_s = first - scheduled, last - scheduled
        summary.decode_s = last - first
        if self.num_tokens > 1:
            summary.time_per_output_token_s = summary.decode_s / (self.num_tokens - 1)
        return summary

    def _send(self, update: RequestUpdate) -> None:
        for logger in self.loggers:
            logger.record_request(update)


class RequestStream:
    """One request's deltas, read by its request task (``async for``), then closed.

    Reading past the last delta ends the iteration. ``close``/``aclose`` on a live stream
    aborts the request; on an ended one it does nothing, so closing is always safe.
    """

    __slots__ = ("request_id", "state", "_scheduler", "_request", "_detok", "_metrics",
                 "_num_output")

    def __init__(self, scheduler: Actor[SchedulerMessage], request: Request,
                 detok: IncrementalDetokenizer,
                 metrics: RequestMetrics):
        self.request_id = request.request_id
        self.state = StreamState.LIVE
        self._scheduler = scheduler
        self._request = request
        self._detok = detok
        self._metrics = metrics
        self._num_output = 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if self.state is not StreamState.LIVE:
            raise StopAsyncIteration
        try:
            request_output = await self._request.output_queue.get()
            return self._delta(request_output)
        except BaseException:  # cancelled (client gone), or our own failure (detokenizer)
            self._abort(None)  # no-op when the scheduler already ended it
            raise

    def _delta(self, request_output: RequestOutput) -> GenerationDelta:
        """Turn one scheduler output into a delta; ends the stream on its last one.

        Raises:
            EngineShuttingDown: the server aborted the request (shutdown).
            EngineError: the request failed in the engine.
        """
        if request_output.finish_reason == "abort":
            self._finished("abort")
            raise EngineShuttingDown(request_output.error or "request aborted by the server")
        if request_output.finish_reason == "error":
            self._finished("error")
            raise EngineError(request_output.error or "request failed")
        text = self._detok.update(request_output.new_token_ids,
                                  final=request_output.finish_reason is not None)
        # A stop string cuts the tokens too (drafts accepted past it are not the output's).
        n = self._detok.num_kept
        token_ids = request_output.new_token_ids[:n]
        logprobs = request_output.logprobs[:n] if request_output.logprobs is not None else None
        self._num_output += n
        self._metrics.tokens(self._request, n)
        finish = self._detok.stop_reason or request_output.finish_reason
        if request_output.finish_reason is not None:
            self._finished(finish)
        elif finish is not None:  # a stop string matched: the scheduler would run on
            self._abort(finish)
        return GenerationDelta(text, token_ids, finish, self._request.num_prompt_tokens,
                               self._num_output, logprobs, request_output.prompt_logprobs,
                               request_output.num_cached_tokens, self._request.kv_transfer_params
                               if request_output.finish_reason is not None else None,
                               self._detok.stop_string)

    def close(self) -> None:
        """Stop reading: a live request is aborted and its blocks freed."""
        self._abort(None)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:  # dropped unread: free the blocks anyway
        self._abort(None)

    def _finished(self, finish: str | None) -> None:
        """LIVE → FINISHED: the scheduler ended the request and already freed its blocks."""
        if self.state is StreamState.LIVE:
            self.state = StreamState.FINISHED
            self._metrics.finished(self._request, finish)

    def _abort(self, finish: str | None) -> None:
        """LIVE → ABORTED: the reader ended the request; the scheduler frees its blocks.
        ``finish`` is what the client saw (``stop`` for a stop string, ``None``: gone)."""
        if self.state is StreamState.LIVE:
            self.state = StreamState.ABORTED
            self._scheduler.send(AbortRequest(self.request_id))
            self._metrics.finished(self._request, finish)


def close_all(streams: Iterable[DeltaStream | BeamSearchHandle]) -> None:
    """Close every stream or beam search (aborting the requests still live); safe to call more
    than once."""
    for stream in streams:
        stream.close()
