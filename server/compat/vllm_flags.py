"""``vllm serve`` flags that pagedserve lacks: accepted with a warning, or refused with a reason.

A command line written for ``vllm serve`` should either start pagedserve or stop with a message
that says what to do instead; never stop at the first unknown flag, nor take a flag's value for
MODEL. Two kinds:

- harmless (``IGNORED``): they tune something pagedserve does not have or does one way only
  (uvicorn's logging, the frontend process, remote code: pagedserve runs its own model
  code). They are parsed with their value, and ``serve`` logs one ``vllm_flags_ignored``
  warning naming them;
- refused (``REFUSED``): they ask for behaviour pagedserve does not have (
  TLS, another tokenizer, quantized checkpoints): ``serve`` exits with the
  flag and what pagedserve does instead, and a one-line hint (``cli.BriefErrors``).

A flag's value that makes it harmless (``--cpu-offload-gb 0``, ``--task generate``)
is in ``HARMLESS_VALUES``. Names are vLLM's (``vllm/engine/arg_utils.py``,
``vllm/entrypoints/openai/cli_args.py``); none is a pagedserve flag (a test holds them apart).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

# flag -> how many values it takes (0: a switch).
IGNORED: dict[str, int | str] = {
    "--trust-remote-code": 0,  # the model code is ours (Llama, Mistral, Qwen2)
    "--disable-log-requests": 0,  # request text is never logged unless --enable-log-requests
    "--disable-log-stats": 0,
    "--uvicorn-log-level": 1,  # pagedserve serves with Hypercorn; --log-level sets our level
    "--disable-fastapi-docs": 0,
    "--disable-frontend-multiprocessing": 0,  # one process, asyncio actors
    "--enable-chunked-prefill": 0,  # always on
    "--no-enable-chunked-prefill": 0,  # always on: long prompts are split by the token budget
    "--swap-space": 1,  # no CPU swap: a preempted request is recomputed
    "--max-log-len": 1,
    "--download-dir": 1,  # the Hugging Face cache ($HF_HOME) is used
    "--load-format": 1,
    "--tokenizer-mode": 1,
    "--max-seq-len-to-capture": 1,
    "--worker-use-ray": 0,
    "--disable-custom-all-reduce": 0,
    "--disable-async-output-proc": 0,
}

# flag -> (how many values it takes, what pagedserve does instead).
REFUSED: dict[str, tuple[int | str, str]] = {
    "--reasoning-parser": (1, "reasoning parsers are not supported"),
    "--tokenizer": (1, "the model's own tokenizer is always used"),
    "--ssl-keyfile": (1, "pagedserve speaks plain HTTP: put a TLS proxy in front"),
    "--ssl-certfile": (1, "pagedserve speaks plain HTTP: put a TLS proxy in front"),
    "--root-path": (1, "serve at / behind a proxy that strips the prefix"),
    "--cpu-offload-gb": (1, "weights stay on --device"),
    "--revision": (1, "pass a local folder or the hub id's default revision"),
    "--allowed-origins": (1, "no CORS headers are sent: serve browsers from the same origin "
                             "(the built-in chat page) or through a proxy"),
    "--task": (1, "use --runner generate|pooling (and --convert embed) instead"),
}

HARMLESS_VALUES: dict[str, frozenset[str]] = {
    "--task": frozenset({"auto", "generate"}),
    "--cpu-offload-gb": frozenset({"0"}),
}

# --quantization methods of vLLM's: pagedserve's own flag takes gguf or none only.
VLLM_QUANTIZATION = frozenset({
    "awq", "awq_marlin", "gptq", "gptq_marlin", "fp8", "bitsandbytes", "compressed-tensors",
    "marlin", "squeezellm", "deepspeedfp", "experts_int8", "fbgemm_fp8", "modelopt", "hqq",
    "ipex", "torchao", "auto-round", "inc", "mxfp4", "gptq_bitblas", "awq_bitblas",
})
QUANTIZATION_INSTEAD = (
    "pagedserve runs unquantized checkpoints (in --dtype) and .gguf files "
    "(Q4_0 ... Q8_0 and Q4_K/Q5_K/Q6_K blocks kept quantized on the CPU: "
    "--quantization gguf); "
    "serve the unquantized model or a GGUF of it"
)

IGNORED_DEST = "vllm_ignored"


class _Ignored(argparse.Action):
    """Records ``--flag [value]`` in ``namespace.vllm_ignored``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        shown = option_string if values in (None, [], True) else f"{option_string} {values}"
        getattr(namespace, IGNORED_DEST).append(shown)


class _Refused(argparse.Action):
    """Exits with the flag and what pagedserve does instead (``self.help`` is
    suppressed, so the reason travels in ``const``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        text = values if isinstance(values, str) else " ".join(values or [])
        if text in HARMLESS_VALUES.get(option_string or "", ()):
            getattr(namespace, IGNORED_DEST).append(f"{option_string} {text}")
            return
        parser.error(f"vLLM's {option_string} is not supported by pagedserve: {self.const}")


def _nargs(n: int | str) -> dict[str, Any]:
    return {"nargs": 0} if n == 0 else {"nargs": None if n == 1 else n}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``IGNORED`` and ``REFUSED`` to ``parser``, hidden from ``--help`` (its
    epilog names them)."""
    parser.set_defaults(**{IGNORED_DEST: []})
    for flag, n in IGNORED.items():
        parser.add_argument(flag, action=_Ignored, dest="_vllm_" + flag.lstrip("-"),
                            help=argparse.SUPPRESS, **_nargs(n))
    for flag, (n, instead) in REFUSED.items():
        parser.add_argument(flag, action=_Refused, const=instead,
                            dest="_vllm_" + flag.lstrip("-"), help=argparse.SUPPRESS,
                            **_nargs(n))


def epilog() -> str:
    return ("vLLM flags accepted and ignored (with a warning): " + ", ".join(IGNORED)
            + ". vLLM flags refused with what pagedserve does instead: " + ", ".join(REFUSED)
            + ".")


def check_quantization(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Refuse a vLLM quantization method by name, saying what pagedserve serves instead
    (argparse's ``invalid choice`` would not)."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in ("--quantization", "-q"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if value.lower() in VLLM_QUANTIZATION:
            parser.error(f"--quantization {value} is not supported: {QUANTIZATION_INSTEAD}")
