"""``pagedserve serve [MODEL]``: flags named as ``vllm serve``'s, served by Hypercorn."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys

from pagedserve.gpu.cpu_threads import openmp_defaults

# First, before the imports below load torch: libgomp (torch's OpenMP, shared by our C++
# kernels) reads its spin-wait settings once, when it is loaded, from the environment.
os.environ.update(openmp_defaults())

import structlog

from pagedserve.actors.config import SchedulerConfig
from pagedserve.actors.engine import AsyncEngine, EngineConfig
from pagedserve.actors.spec_decode import SpeculativeConfig, parse_speculative_config
from pagedserve.actors.structured_output import StructuredOutputConfig
from pagedserve.gpu.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, ModelConfig
from pagedserve.gpu.loader import ModelLoadError
from pagedserve.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES

log = structlog.get_logger("pagedserve")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        return help_text if "default" in help_text else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.replace("``", "`"))
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve", help="serve a model over the OpenAI API",
        formatter_class=_HelpFormatter,
    )
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file, a Hugging Face folder or hub id; none = the embedded "
                        "SmolLM2-135M-Instruct")
    s.add_argument("--model", default=None, help="same as the positional MODEL")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind")
    s.add_argument("--served-model-name", default=None,
                   help="name clients send as `model` (default: HuggingFaceTB/SmolLM2-135M-"
                        "Instruct for the embedded model, else the model as given)")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activations, KV cache and weights not kept quantized (see "
                        "--quantization); auto = bfloat16 on CUDA and on "
                        "CPUs with AMX/AVX512-BF16, else float32")
    s.add_argument("--quantization", "-q", default=None, choices=["gguf", "none"],
                   help="gguf: keep a .gguf model's Q4_0/Q4_1/Q8_0 weights quantized and "
                        "multiply them in place, in float32 (CPU only; refused elsewhere and "
                        "for non-GGUF models); none: de-quantize to --dtype at load; default: "
                        "gguf for a .gguf model on the CPU, else none")
    s.add_argument("--seed", type=int, default=0, help="global random seed")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's")
    s.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128],
                   help="tokens per KV block")
    s.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help=f"KV cache budget in bytes (CPU default {DEFAULT_CPU_KV_CACHE_BYTES})")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory to use (CUDA)")
    s.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="force the number of KV blocks")
    s.add_argument("--max-num-seqs", type=int, default=256, help="running requests at most")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step at most (chunked prefill splits longer prompts)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share KV blocks of common prompt prefixes")
    s.add_argument("--prefix-caching-hash-algo", default="sha256", choices=["sha256", "xxhash"],
                   help="block hash for prefix caching (xxhash: 128-bit xxh3, faster)")
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs, or priority (request field `priority`, lower runs earlier)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="refuse new requests with 503 while this many wait (default: no limit)")
    s.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}\' (default: off)')
    s.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require `Authorization: Bearer <key>` on every route but /health "
                        "(default: $PAGEDSERVE_API_KEY, else none)")
    s.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests may take to finish after SIGTERM")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="log prompt and output text (never logged otherwise)")
    s.add_argument("--chat-template", default=None,
                   help="Jinja chat template (file path or inline) overriding the tokenizer's")
    s.add_argument("--admin-key", default=os.environ.get("PAGEDSERVE_ADMIN_KEY"),
                   help="bearer key for /admin/stats, /admin/events and /metrics (default: "
                        "$PAGEDSERVE_ADMIN_KEY; unset = the API key, if any, else open)")
    s.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="device; default: CUDA when present")
    s.add_argument("--structured-output-compile-timeout", type=float, default=5.0,
                   help="seconds a guided-decoding grammar may take to compile before the "
                        "request gets a 400")
    s.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly, no CUDA graphs for decode steps")
    s.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log level")
    return parser


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def configure_logging(level: str) -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model or args.model_tag, dtype=args.dtype,
                          max_model_len=args.max_model_len, seed=args.seed, device=args.device,
                          enforce_eager=args.enforce_eager, quantization=args.quantization),
        cache=CacheConfig(block_size=args.block_size,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          num_gpu_blocks_override=args.num_gpu_blocks_override,
                          enable_prefix_caching=args.enable_prefix_caching,
                          prefix_caching_hash_algo=args.prefix_caching_hash_algo),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  policy=args.scheduling_policy,
                                  max_waiting_requests=args.max_waiting_requests,
                                  speculative=args.speculative_config),
        structured_output=StructuredOutputConfig(
            compile_timeout_s=args.structured_output_compile_timeout),
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_template(value: str | None) -> str | None:
    if value is None or "{" in value:
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


async def serve(args: argparse.Namespace) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve

    from pagedserve.server.app import build_app
    from pagedserve.server.launch import hypercorn_config
    from pagedserve.server.serving import ServingConfig

    if args.api_key is None and not _is_loopback(args.host):
        log.warning("no_api_key_on_public_address", host=args.host,
                    hint="anyone who reaches this address can use the server: set --api-key")
    engine = await AsyncEngine.start(engine_config(args))
    served = args.served_model_name or engine.info.served_name
    serving = ServingConfig(served, _read_template(args.chat_template), args.scheduling_policy,
                            args.enable_log_requests, api_key=args.api_key,
                            admin_key=args.admin_key)
    app = build_app(engine, serving, args.max_request_body_bytes)
    config = hypercorn_config(args.host, args.port)
    stop = asyncio.Event()

    async def drain_then_stop() -> None:
        """SIGTERM: refuse new requests, let running ones finish for --shutdown-timeout
        seconds, abort the rest, then let Hypercorn close (flushing the last stream events)."""
        await stop.wait()
        log.info("shutdown_started", timeout_s=args.shutdown_timeout)
        app.draining = True
        await engine.drain(args.shutdown_timeout)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    base = f"http://{config.bind[0]}"
    log.info("serving", url=f"{base}/v1", model=served)
    key_required = bool(args.admin_key or getattr(args, "api_key", None))
    log.info("operator_pages", chat=f"{base}/", dashboard=f"{base}/admin",
             metrics=f"{base}/metrics", admin_key_required=key_required)
    try:
        await hypercorn_serve(app, config, shutdown_trigger=drain_then_stop)
    finally:
        await engine.shutdown()
        log.info("stopped")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        asyncio.run(serve(args))
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
