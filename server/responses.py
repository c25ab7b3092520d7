"""Shaping engine deltas into OpenAI answers: SSE chunks, whole responses, logprobs, usage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse
from transformers import PreTrainedTokenizerBase

from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.actors.request_stream import GenerationDelta, RequestStream, close_all
from pagedserve.gpu.sampler import TokenLogprobs
from pagedserve.server.errors import OpenAIError, error_body

log = structlog.get_logger(__name__)



@dataclass(slots=True)
class RequestSummary:
    """How one response ended, for the request log (one entry per choice where a list).

    Attributes:
        num_output_tokens: over all choices.
        finish_reasons: ``None`` for a choice that never finished (client gone, error).
        ttft_s: request start → first token of any choice.
        texts: each choice's text.
    """

    num_output_tokens: int
    finish_reasons: list[str | None]
    ttft_s: float | None
    texts: list[str]


OnDone = Callable[[RequestSummary], None]


@dataclass(slots=True)
class ResponseBuilder:
    """Builds the JSON objects of one chat or text completion."""

    request_id: str
    created: int
    model: str
    chat: bool
    tokenizer: PreTrainedTokenizerBase
    prompt_token_ids: list[int] | None  # set when the client asked for token ids
    num_prompt_tokens: int
    echo: str | None = None
    _token_text: dict[int, str] = field(default_factory=dict)

    def envelope(self, choices: list[dict], chunk: bool, first: bool = False) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}
        if self.prompt_token_ids is not None and (first or not chunk):
            body["prompt_token_ids"] = self.prompt_token_ids
        return body

    def choice(self, index: int, text: str, finish: str | None, token_ids: list[int],
               logprobs: list[TokenLogprobs] | None, chunk: bool, offset: int = 0) -> dict:
        if self.chat and chunk:
            c: dict[str, Any] = {"index": index, "delta": {"content": text} if text else {}}
        elif self.chat:
            c = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            c = {"index": index, "text": text}
        c["logprobs"] = self.logprobs(token_ids, logprobs, offset) if logprobs else None
        c["finish_reason"] = finish
        if self.prompt_token_ids is not None:
            c["token_ids"] = token_ids
        return c

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.num_prompt_tokens + completion_tokens}

    def _text(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id])
        return self._token_text[token_id]

    def logprobs(self, token_ids: list[int], lps: list[TokenLogprobs], offset: int) -> dict:
        """Chat: ``{"content": [...]}``; completions: ``tokens/token_logprobs/top_logprobs``."""
        if self.chat:
            content = []
            for t, lp in zip(token_ids, lps):
                tok = self._text(t)
                content.append({
                    "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {"token": self._text(i), "logprob": v,
                         "bytes": list(self._text(i).encode())}
                        for i, v in zip(lp.top_ids, lp.top_logprobs)],
                })
            return {"content": content}
        tokens = [self._text(t) for t in token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {
            "tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
                             for lp in lps],
            "text_offset": offsets,
        }


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """Deltas of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, GenerationDelta | None, BaseException | None]] = (
        asyncio.Queue())

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for d in s:
                queue.put_nowait((i, d, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                remaining -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()


@dataclass(slots=True)
class _Tally:
    """Per-choice progress, for usage, logs and text offsets."""

    n: int
    start: float = field(default_factory=time.monotonic)
    ttft: float | None = None
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens, self.texts, self.finish = [0] * self.n, [""] * self.n, [None] * self.n

    def add(self, i: int, d: GenerationDelta) -> None:
        if self.ttft is None and d.token_ids:
            self.ttft = time.monotonic() - self.start
        self.tokens[i] = d.num_output_tokens
        self.texts[i] += d.text
        self.finish[i] = d.finish_reason

    def summary(self) -> RequestSummary:
        return RequestSummary(sum(self.tokens), self.finish, self.ttft, self.texts)


async def sse_events(builder: ResponseBuilder, streams: list[RequestStream], on_done: OnDone,
                     include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """SSE ``data:`` payloads. Cancelled by sse-starlette when the client goes away, which
    closes the streams and so aborts the requests."""
    n = len(streams)
    tally = _Tally(n)
    pending: list[list[int]] = [[] for _ in range(n)]  # tokens whose text is held back
    pending_lp: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    usage_field = include_usage or continuous_usage

    def chunk(choices: list[dict], first: bool = False) -> str:
        body = builder.envelope(choices, chunk=True, first=first)
        if usage_field:
            body["usage"] = builder.usage(sum(tally.tokens)) if continuous_usage else None
        return json.dumps(body)

    try:
        for i in range(n):
            if builder.chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}], first=i == 0)
            elif builder.echo is not None:
                yield chunk([builder.choice(i, builder.echo, None, [], None, chunk=True)],
                            first=i == 0)
        async with aclosing(merge(streams)) as deltas:  # closed here, never by the GC
            async for i, d in deltas:
                pending[i].extend(d.token_ids)
                if d.logprobs:
                    pending_lp[i].extend(d.logprobs)
                offset = len(tally.texts[i])
                tally.add(i, d)
                if not d.text and d.finish_reason is None:
                    continue  # nothing to show yet (held back for a stop string or a char)
                yield chunk([builder.choice(i, d.text, d.finish_reason, pending[i],
                                            pending_lp[i] or None, chunk=True, offset=offset)])
                pending[i], pending_lp[i] = [], []
        if include_usage:
            body = builder.envelope([], chunk=True)
            body["usage"] = builder.usage(sum(tally.tokens))
            yield json.dumps(body)
    except (asyncio.CancelledError, GeneratorExit):  # sse-starlette: the client went away
        log.info("client_disconnected", request_id=builder.request_id)
        raise
    except Exception as e:  # the stream already started: report in-band, then end it
        status = 503 if isinstance(e, EngineShuttingDown) else 500
        if status == 503:
            log.info("stream_ended_by_shutdown", request_id=builder.request_id)
        else:
            log.exception("stream_failed", request_id=builder.request_id)
        yield json.dumps(error_body(f"{type(e).__name__}: {e}" if not isinstance(e, EngineError)
                                    else str(e), status))
    finally:
        close_all(streams)
    on_done(tally.summary())
    yield "[DONE]"


async def collect(builder: ResponseBuilder, streams: list[RequestStream],
                  on_done: OnDone) -> dict:
    """The whole (non-streamed) answer."""
    n = len(streams)
    tally = _Tally(n)
    token_ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    try:
        async with aclosing(merge(streams)) as deltas:
            async for i, d in deltas:
                tally.add(i, d)
                token_ids[i].extend(d.token_ids)
                lps[i].extend(d.logprobs or [])
    except EngineError as e:
        status = 503 if isinstance(e, EngineShuttingDown) else 500
        raise OpenAIError(str(e), status=status) from e
    finally:
        close_all(streams)
    echo = builder.echo or ""
    choices = [builder.choice(i, echo + tally.texts[i], tally.finish[i], token_ids[i],
                              lps[i] or None, chunk=False, offset=len(echo)) for i in range(n)]
    body = builder.envelope(choices, chunk=False)
    body["usage"] = builder.usage(sum(tally.tokens))
    on_done(tally.summary())
    return body


class DisconnectWatch:
    """Watches one request's ASGI ``receive`` for ``http.disconnect`` from the moment the body
    has been read, so that a client that leaves while its request still waits for the
    scheduler (busy with a step) is noticed then, and its request aborted in the very mailbox
    drain that would have admitted it: no step ever computes for it (issue 16's mass
    cancellation). ``stop`` it before another reader (sse-starlette) takes ``receive`` over."""

    def __init__(self, request: Request):
        self.gone = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    def stop(self) -> None:
        self._task.cancel()


async def until_disconnect(watch: DisconnectWatch, work: Awaitable[Any], request_id: str,
                           streams: list[RequestStream] | None = None) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts the requests it
    started or was starting: ``AsyncEngine.add_request`` aborts when cancelled), close
    ``streams``, and answer 499 (nobody reads it)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(watch.gone.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()  # its own cleanup closes the streams, which aborts the requests
            await asyncio.gather(task, return_exceptions=True)
            close_all(streams or [])
            log.info("client_disconnected", request_id=request_id)
    if task.cancelled():
        return JSONResponse(error_body("client disconnected", 499), status_code=499)
    return task.result()
