"""``use_beam_search`` on both endpoints (vLLM's request fields): ``n`` is the beam width,
``length_penalty`` and ``early_stopping`` as transformers' ``generate`` takes them, and the
``n`` best hypotheses come back as the choices, best first. A completion's list of prompts runs
one search per prompt, side by side (vLLM's ``beam_search`` per prompt): prompt ``p``'s
hypotheses are choices ``p * n`` to ``p * n + n - 1``.

As vLLM does, a beam search is never streamed (``stream: true`` gets the whole answer) and ranks
by the model's raw logprobs (``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``seed`` do not
apply). Fields that would change what is ranked or how it ends, and that the search does not
implement, are refused with a 400 naming the field, rather than ignored.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import JSONResponse

from pagedserve.actors.beam.search import BeamSearchOutput, BeamSearchParams
from pagedserve.actors.engine.protocol import BeamSearchHandle
from pagedserve.actors.engine.request_stream import close_all
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.server.disconnect import DisconnectWatch, until_disconnect
from pagedserve.server.errors import OpenAIError
from pagedserve.server.openai.admission import ADMISSION_ERRORS, admission_error, check_priority
from pagedserve.server.openai.output import RequestSummary, ResponseBuilder

# Field → (its value when unused, as the body holds it).
_UNSUPPORTED = {
    "logit_bias": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "min_tokens": 0, "stop": None,
}


def check_beam_search(body: Any) -> None:
    """Refuse what a beam search cannot honour (also vLLM's prompt logprob fields).

    Raises:
        OpenAIError: 400 naming the first such field.
    """
    for name in ("prompt_logprobs", "logprob_token_ids"):
        if getattr(body, name, None) is not None:
            raise OpenAIError(f"{name} is not supported with use_beam_search", param=name)
    for name, unused in _UNSUPPORTED.items():
        value = getattr(body, name, unused)
        if value != unused and value not in ([], {}, ""):
            raise OpenAIError(f"{name} is not supported with use_beam_search", param=name)
    logprobs = getattr(body, "logprobs", None)
    if logprobs is not None and logprobs is not False:  # completions' 0 asks for them too
        raise OpenAIError("logprobs is not supported with use_beam_search", param="logprobs")
    spec, param = body.structured_outputs_params()
    if spec is not None:
        raise OpenAIError("guided decoding is not supported with use_beam_search", param=param)


def beam_search_params(body: Any, params: SamplingParams) -> BeamSearchParams:
    """The search the body asks for; ``params`` carries the checked ``max_tokens``."""
    if params.max_tokens is None:  # _sampling_params always sets it
        raise ValueError("beam search needs max_tokens")
    return BeamSearchParams(beam_width=body.n, max_tokens=params.max_tokens,
                            length_penalty=body.length_penalty,
                            early_stopping=body.early_stopping, ignore_eos=body.ignore_eos)


async def start_beam_searches(engine: Any, request_id: str, prompts: list[list[int]],
                              body: Any, params: list[SamplingParams]) -> list[BeamSearchHandle]:
    """Queue one search per prompt (ids ``request_id-p`` for a list); all accepted, or none
    kept and the refusal an HTTP error (as ``Serving._start``)."""
    check_priority(body, engine.config.scheduler.policy)
    streams: list[BeamSearchHandle] = []
    try:
        for p, (prompt_ids, sp) in enumerate(zip(prompts, params, strict=True)):
            streams.append(await engine.beam_search(
                request_id if len(prompts) == 1 else f"{request_id}-{p}", prompt_ids,
                beam_search_params(body, sp), stop_token_ids=list(body.stop_token_ids),
                priority=body.priority, cache_salt=body.cache_salt))
    except ADMISSION_ERRORS as e:
        close_all(streams)
        raise admission_error(e) from e
    except BaseException:
        close_all(streams)  # type: ignore[arg-type]
        raise
    return streams


async def beam_search_response(watch: DisconnectWatch, searches: list[BeamSearchHandle],
                               builder: ResponseBuilder, skip_special_tokens: bool,
                               on_done: Any) -> Any:
    """The whole answer: per prompt, one choice per hypothesis, best first (or a 499/5xx)."""

    async def work() -> dict:
        try:
            outs = await asyncio.gather(*(s.result() for s in searches))
        except EngineError as e:
            close_all(searches)  # the other prompts' searches end with this one
            status = 503 if isinstance(e, EngineShuttingDown) else 500
            raise OpenAIError(str(e), status=status) from e
        return _body(builder, outs, skip_special_tokens, on_done)

    answer = await until_disconnect(watch, work(), builder.request_id, searches)
    if isinstance(answer, dict):
        return JSONResponse(answer, headers={"X-Request-Id": builder.request_id})
    return answer


def _body(builder: ResponseBuilder, outs: list[BeamSearchOutput], skip_special_tokens: bool,
          on_done: Any) -> dict:
    choices, texts, reasons, num_tokens = [], [], [], 0
    for p, out in enumerate(outs):
        pairs = zip(out.hypotheses, out.finish_reasons, strict=True)
        for i, (h, reason) in enumerate(pairs):
            index = p * builder.n + i
            text = builder.fmt.tokenizer.decode(h.token_ids,
                                                skip_special_tokens=skip_special_tokens)
            choices.append(builder.choice(index, builder.echo_text(index) + text, reason,
                                          h.token_ids, None, chunk=False))
            texts.append(text)
            reasons.append(reason)
            num_tokens += len(h.token_ids)
    body = builder.envelope(choices, chunk=False)
    body["usage"] = builder.usage(num_tokens)
    on_done(RequestSummary(num_tokens, reasons, None, texts))
    return body
