"""Shaping engine deltas into OpenAI answers: SSE chunks, whole responses, logprobs, usage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import structlog

from pagedserve.actors.engine.protocol import DeltaStream, GenerationDelta
from pagedserve.actors.engine.request_stream import close_all
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.gpu.sample.sampler import TokenLogprobs
from pagedserve.server.errors import OpenAIError, error_body
from pagedserve.server.openai.logprobs_format import LogprobsFormatter
from pagedserve.server.openai.prompts import PromptInput
from pagedserve.server.tools.calling import finish_reason, shape_message
from pagedserve.server.tools.parsers import ToolParser

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
    """Builds the JSON objects of one chat or text completion.

    Choice ``i`` answers prompt ``i // n`` (batched completion prompts, vLLM's index order).
    vLLM's extra fields: completions put ``token_ids``, ``prompt_token_ids`` and
    ``prompt_logprobs`` on each choice, chat puts ``prompt_token_ids`` and ``prompt_logprobs``
    on the answer and ``token_ids`` on the choice; a whole answer has them as ``null`` when not
    asked for, a stream only when asked for.
    """

    request_id: str
    created: int
    model: str
    chat: bool
    fmt: LogprobsFormatter
    prompts: list[PromptInput]
    n: int = 1
    return_token_ids: bool = False  # token ids on the choices, prompt ids on the answer
    echo: bool = False  # completions: the prompt's text (and logprobs) before the output
    chat_echo: str | None = None  # chat: the last assistant message, prefixed to the answer
    prompt_logprobs: bool = False  # the client asked for prompt_logprobs
    want_logprobs: bool = False  # the client asked for logprobs
    tool_parser: ToolParser | None = None  # chat with tools: reads calls out of the text
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: cached_tokens shown

    def prompt_of(self, index: int) -> PromptInput:
        return self.prompts[index // self.n]

    def envelope(self, choices: list[dict], chunk: bool, first: bool = False,
                 prompt_lps: list[TokenLogprobs] | None = None) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}
        if not chunk:  # vLLM's whole answers carry OpenAI's optional keys, as null
            body["service_tier"] = None
            body["system_fingerprint"] = None
        if self.chat and not chunk:
            body["prompt_logprobs"] = self._prompt_logprobs(0, prompt_lps)
            body["prompt_token_ids"] = self._prompt_ids(0)
        elif self.chat and first and self.return_token_ids:
            body["prompt_token_ids"] = self._prompt_ids(0)
        return body

    def _prompt_ids(self, index: int) -> list[int] | None:
        return self.prompt_of(index).token_ids if self.return_token_ids else None

    def _prompt_logprobs(self, index: int, lps: list[TokenLogprobs] | None) -> list | None:
        if not self.prompt_logprobs or lps is None:
            return None
        return self.fmt.prompt(self.prompt_of(index).token_ids, lps)

    def choice(self, index: int, text: str, finish: str | None, token_ids: list[int],
               logprobs: list[TokenLogprobs] | None, chunk: bool, offset: int = 0,
               echo_lps: list[TokenLogprobs | None] | None = None,
               prompt_lps: list[TokenLogprobs] | None = None, first: bool = False) -> dict:
        """One choice. ``echo_lps``: completions echoing the prompt with logprobs, the prompt
        tokens' entries (first ``None``), which come before ``logprobs`` (whose text starts at
        ``offset``); ``first``: the choice's first chunk (it carries the prompt ids)."""
        if self.chat and chunk:
            c: dict[str, Any] = {"index": index, "delta": {"content": text} if text else {}}
        elif self.chat:
            c = {"index": index, "message": whole_message(text)}
        else:
            c = {"index": index, "text": text}
        c["logprobs"] = self._logprobs(index, token_ids, logprobs, offset, echo_lps)
        c["finish_reason"] = finish
        if not chunk or self.return_token_ids:
            c["token_ids"] = token_ids if self.return_token_ids else None
        if not self.chat and not chunk:
            c["prompt_logprobs"] = self._prompt_logprobs(index, prompt_lps)
            c["prompt_token_ids"] = self._prompt_ids(index)
        elif not self.chat and first and self.return_token_ids:
            c["prompt_token_ids"] = self._prompt_ids(index)
        return c

    def _logprobs(self, index: int, token_ids: list[int], lps: list[TokenLogprobs] | None,
                  offset: int, echo_lps: list[TokenLogprobs | None] | None) -> dict | None:
        if self.chat:
            return self.fmt.chat(token_ids, lps) if lps else None
        if echo_lps is None:
            return self.fmt.completion(token_ids, lps, offset) if lps else None
        prompt = self.fmt.completion(self.prompt_of(index).token_ids, echo_lps, 0)
        if lps:
            out = self.fmt.completion(token_ids, lps, offset)
            for key in prompt:
                prompt[key].extend(out[key])
        return prompt

    def echo_logprobs(self, prompt_lps: list[TokenLogprobs] | None,
                      ) -> list[TokenLogprobs | None] | None:
        """The echoed prompt's logprob entries (``None`` first), when echoing with logprobs."""
        if not (self.echo and self.want_logprobs and prompt_lps is not None):
            return None
        return [None, *prompt_lps]

    def echo_text(self, index: int) -> str:
        """What comes before choice ``index``'s output."""
        if self.chat:
            return self.chat_echo or ""
        return self.prompt_of(index).text if self.echo else ""

    def usage(self, completion_tokens: int, cached_tokens: int = 0, chunk: bool = False) -> dict:
        """Token counts; ``prompt_tokens_details`` only with ``--enable-prompt-tokens-details``
        (as vLLM: else ``null`` in a whole answer, absent from a stream's)."""
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        elif not chunk:
            usage["prompt_tokens_details"] = None
        return usage


def whole_message(text: str) -> dict[str, Any]:
    """A whole answer's message with vLLM's keys: OpenAI's optional ones as ``null``, no calls
    as ``[]`` (vLLM's ``ChatMessage``); ``shape_message`` fills in calls."""
    return {"role": "assistant", "content": text, "refusal": None, "annotations": None,
            "audio": None, "function_call": None, "tool_calls": []}


async def merge(streams: list[DeltaStream]) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """Deltas of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, GenerationDelta | None, BaseException | None]] = (
        asyncio.Queue())

    async def pump(i: int, s: DeltaStream) -> None:
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
    cached: list[int] = field(default_factory=list)  # prefix-cache hits, from the first delta
    prompt_lps: list[list[TokenLogprobs] | None] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None  # the first choice's, from its last delta

    def __post_init__(self) -> None:
        self.tokens, self.texts, self.finish = [0] * self.n, [""] * self.n, [None] * self.n
        self.cached, self.prompt_lps = [0] * self.n, [None] * self.n

    def add(self, i: int, d: GenerationDelta) -> None:
        if self.ttft is None and d.token_ids:
            self.ttft = time.monotonic() - self.start
        self.tokens[i] = d.num_output_tokens
        self.texts[i] += d.text
        self.finish[i] = d.finish_reason
        if d.num_cached_tokens:
            self.cached[i] = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_lps[i] = d.prompt_logprobs
        if i == 0 and d.kv_transfer_params is not None:
            self.kv_transfer_params = d.kv_transfer_params

    def cached_tokens(self, n: int) -> int:
        """Prompt tokens the prefix cache held: per prompt, as its first choice found them."""
        return sum(self.cached[::n])

    def end_unfinished(self, reason: str) -> None:
        """The choices still running were ended from outside (``abort``: the shutdown;
        ``error``): say so in the summary, which would otherwise log ``None``."""
        self.finish = [f or reason for f in self.finish]

    def summary(self) -> RequestSummary:
        return RequestSummary(sum(self.tokens), self.finish, self.ttft, self.texts)


class _ChoiceStreams:
    """Per streamed choice: the tokens and logprobs whose text is held back, the characters
    sent, whether its first chunk went out (echo, prompt ids), and its tool-call streamer."""

    def __init__(self, builder: ResponseBuilder, n: int):
        self.builder = builder
        self.tools = [builder.tool_parser.streamer() for _ in range(n)] if builder.tool_parser \
            else []
        self.pending: list[list[int]] = [[] for _ in range(n)]
        self.pending_lp: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        self.shown = [0] * n
        self.started = [False] * n

    def delta(self, i: int, d: GenerationDelta, tally: _Tally) -> dict | None:
        """Choice ``i``'s chunk for ``d`` (already added to ``tally``), or ``None`` while
        nothing can be shown yet (held back for a stop string or a UTF-8 character)."""
        b = self.builder
        self.pending[i].extend(d.token_ids)
        if d.logprobs:
            self.pending_lp[i].extend(d.logprobs)
        prefix, echo_lps = "", None
        if not b.chat and not self.started[i]:
            prefix, echo_lps = b.echo_text(i), b.echo_logprobs(tally.prompt_lps[i])
        text, finish, calls = prefix + d.text, d.finish_reason, None
        if self.tools:  # content and call pieces the tool parser can tell apart by now
            step = self.tools[i].feed(d.text, final=finish is not None)
            text, calls = step.content, step.tool_calls
            finish = finish_reason(finish, self.tools[i].num_calls > 0)
        if not text and not calls and finish is None:
            return None
        c = b.choice(i, text, finish, self.pending[i], self.pending_lp[i] or None, chunk=True,
                     offset=self.shown[i] + len(prefix), echo_lps=echo_lps,
                     first=not self.started[i])
        if calls:
            c["delta"]["tool_calls"] = calls
        self.started[i] = True
        self.shown[i] += len(text)
        self.pending[i], self.pending_lp[i] = [], []
        return c


async def sse_events(builder: ResponseBuilder, streams: list[DeltaStream], on_done: OnDone,
                     include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """SSE ``data:`` payloads. Cancelled by sse-starlette when the client goes away, which
    closes the streams and so aborts the requests. ``continuous_usage`` (usage on every chunk)
    takes effect only with ``include_usage``, as in vLLM."""
    n = len(streams)
    tally = _Tally(n)
    choices = _ChoiceStreams(builder, n)
    continuous_usage = continuous_usage and include_usage

    def usage() -> dict:
        return builder.usage(sum(tally.tokens), tally.cached_tokens(builder.n), chunk=True)

    def chunk(choices: list[dict], first: bool = False) -> str:
        body = builder.envelope(choices, chunk=True, first=first)
        if include_usage:
            body["usage"] = usage() if continuous_usage else None
        return json.dumps(body)

    try:
        for i in range(n):
            if builder.chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}], first=i == 0)
                if builder.chat_echo:
                    yield chunk([builder.choice(i, builder.chat_echo, None, [], None, True)])
                    choices.shown[i] = len(builder.chat_echo)
        async with aclosing(merge(streams)) as deltas:  # closed here, never by the GC
            async for i, d in deltas:
                tally.add(i, d)
                c = choices.delta(i, d, tally)
                if c is not None:
                    yield chunk([c])
        if include_usage:
            body = builder.envelope([], chunk=True)
            body["usage"] = usage()
            yield json.dumps(body)
    except (asyncio.CancelledError, GeneratorExit):  # sse-starlette: the client went away
        log.info("client_disconnected", request_id=builder.request_id)
        raise
    except Exception as e:  # the stream already started: report in-band, then end it
        status = 503 if isinstance(e, EngineShuttingDown) else 500
        tally.end_unfinished("abort" if status == 503 else "error")
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


async def collect(builder: ResponseBuilder, streams: list[DeltaStream],
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
    choices = []
    for i in range(n):
        echo = builder.echo_text(i)
        choices.append(builder.choice(
            i, echo + tally.texts[i], tally.finish[i], token_ids[i], lps[i] or None,
            chunk=False, offset=len(echo), echo_lps=builder.echo_logprobs(tally.prompt_lps[i]),
            prompt_lps=tally.prompt_lps[i]))
    for i, c in enumerate(choices if builder.tool_parser else []):
        called = shape_message(c["message"], builder.tool_parser, tally.texts[i])
        c["finish_reason"] = finish_reason(c["finish_reason"], called)
    body = builder.envelope(choices, chunk=False, prompt_lps=tally.prompt_lps[0])
    body["usage"] = builder.usage(sum(tally.tokens), tally.cached_tokens(builder.n))
    if tally.kv_transfer_params is not None:  # vLLM's P/D field, for the decode instance
        body["kv_transfer_params"] = tally.kv_transfer_params
    on_done(tally.summary())
    return body
