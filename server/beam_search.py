"""``use_beam_search`` on both endpoints (vLLM's request fields): ``n`` is the beam width,
``length_penalty`` and ``early_stopping`` as transformers' ``generate`` takes them, and the
``n`` best hypotheses come back as the choices, best first.

As vLLM does, a beam search is never streamed (``stream: true`` gets the whole answer) and ranks
by the model's raw logprobs (``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``seed`` do not
apply). Fields that would change what is ranked or how it ends, and that the search does not
implement, are refused with a 400 naming the field, rather than ignored.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from pagedserve.actors.beam_group import BeamSearchOutput, BeamSearchStream
from pagedserve.actors.beam_search import BeamSearchParams
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.actors.request_stream import RequestStream
from pagedserve.gpu.sampling_params import SamplingParams
from pagedserve.server.admission import ADMISSION_ERRORS, admission_error, check_priority
from pagedserve.server.errors import OpenAIError
from pagedserve.server.responses import (
    DisconnectWatch,
    RequestSummary,
    ResponseBuilder,
    until_disconnect,
)

# Field → (its value when unused, as the body holds it).
_UNSUPPORTED = {
    "logit_bias": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "min_tokens": 0, "stop": None,
}


def check_beam_search(body: Any, num_prompts: int = 1) -> None:
    """Refuse what a beam search cannot honour (also a batch of prompts, and vLLM's prompt
    logprob fields).

    Raises:
        OpenAIError: 400 naming the first such field.
    """
    if num_prompts != 1:
        raise OpenAIError("use_beam_search takes one prompt, not a list", param="prompt")
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


async def start_beam_search(engine: Any, request_id: str, prompt_ids: list[int], body: Any,
                            params: SamplingParams) -> BeamSearchStream:
    """Queue the search; refusals become HTTP errors (as ``Serving._start``)."""
    check_priority(body, engine.config.scheduler.policy)
    try:
        return await engine.beam_search(
            request_id, prompt_ids, beam_search_params(body, params),
            stop_token_ids=list(body.stop_token_ids), priority=body.priority,
            cache_salt=body.cache_salt)
    except ADMISSION_ERRORS as e:
        raise admission_error(e) from e


async def beam_search_response(watch: DisconnectWatch, stream: BeamSearchStream,
                               builder: ResponseBuilder, skip_special_tokens: bool,
                               on_done: Any) -> Any:
    """The whole answer: one choice per hypothesis, best first (or a 499/5xx)."""

    async def work() -> dict:
        try:
            out = await stream.result()
        except EngineError as e:
            status = 503 if isinstance(e, EngineShuttingDown) else 500
            raise OpenAIError(str(e), status=status) from e
        return _body(builder, out, skip_special_tokens, on_done)

    streams: list[RequestStream] = [stream]  # type: ignore[list-item]  # close + request_id
    answer = await until_disconnect(watch, work(), builder.request_id, streams)
    if isinstance(answer, dict):
        return JSONResponse(answer, headers={"X-Request-Id": builder.request_id})
    return answer


def _body(builder: ResponseBuilder, out: BeamSearchOutput, skip_special_tokens: bool,
          on_done: Any) -> dict:
    echo = builder.echo_text(0)
    texts = [builder.fmt.tokenizer.decode(h.token_ids, skip_special_tokens=skip_special_tokens)
             for h in out.hypotheses]
    choices = [builder.choice(i, echo + text, reason, h.token_ids, None, chunk=False)
               for i, (h, text, reason) in enumerate(zip(out.hypotheses, texts,
                                                         out.finish_reasons))]
    body = builder.envelope(choices, chunk=False)
    num_tokens = sum(len(h.token_ids) for h in out.hypotheses)
    body["usage"] = builder.usage(num_tokens)
    on_done(RequestSummary(num_tokens, list(out.finish_reasons), None, texts))
    return body
