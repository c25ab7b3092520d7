"""``pagedserve serve [MODEL]``: flags named as ``vllm serve``'s, served by Hypercorn.

Nothing heavy is imported before the command line is parsed: ``--help``, ``--version`` and usage
errors answer without loading torch or transformers. vLLM's own flags that pagedserve lacks are
accepted with a warning or refused with a reason (``server/compat/vllm_flags.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import ipaddress
import os
import sys

from pagedserve.gpu.cpu.threads import openmp_defaults
from pagedserve.kernels.cpu_isa import cap_torch_env

# First, before the imports below load torch: libgomp (torch's OpenMP, shared by our C++
# kernels) reads its spin-wait settings once, when it is loaded, from the environment; ATen,
# oneDNN and MKL read their ISA caps likewise, so PAGEDSERVE_CPU_ISA caps torch here too.
os.environ.update(openmp_defaults())
try:
    cap_torch_env()
except ValueError:
    pass  # a bad PAGEDSERVE_CPU_ISA is refused, with its message, when the kernels load

from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

import structlog

from pagedserve.actors.dp.config import DataParallelConfig
from pagedserve.actors.log_setup import configure_logging
from pagedserve.gpu.config import CPU_KV_CACHE_ENV, EMBEDDED_SERVED_NAME
from pagedserve.server.compat import vllm_flags
from pagedserve.server.config import ServerConfig, ServingConfig, default_served_names
from pagedserve.server.engine_args import add_serve_flags, engine_config, from_args
from pagedserve.server.generation_config import GenerationDefaults, load_generation_defaults
from pagedserve.server.proxy import add_proxy_parser, proxy_main

log = structlog.get_logger("pagedserve")


def package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "0.0.0+unknown"


class BriefErrors(argparse.ArgumentParser):
    """A usage error is its message and a one-line hint, exit status 2: argparse's usage
    line lists every flag (40 lines for ``serve``), burying the one line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nsee `{self.prog} --help` for the flags\n")


class ServeParser(BriefErrors):
    """The top-level parser; ``parse_args`` reports a ``serve`` command line's unknown
    arguments under ``serve``'s usage (not the top level's), with the closest flag."""

    serve: argparse.ArgumentParser

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        if argv[:1] == ["serve"]:  # before argparse's "invalid choice", which says no more
            vllm_flags.check_quantization(self.serve, argv)
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            target = self.serve if getattr(parsed, "command", None) == "serve" else self
            target.error(_unknown_message(target, extras))
        # The long options written out (a default cannot tell "given" from "left alone").
        parsed.given_flags = frozenset(a.split("=", 1)[0] for a in argv if a.startswith("--"))
        return parsed


def _unknown_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    message = f"unrecognized arguments: {' '.join(extras)}"
    known = [o for a in parser._actions for o in a.option_strings]  # noqa: SLF001
    for flag in (e.split("=")[0] for e in extras if e.startswith("-")):
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8)
        if close:
            return f"{message} (did you mean {close[0]}?)"
    return message


def build_parser() -> ServeParser:
    """``pagedserve serve``: the positional MODEL, then every config's flags (``engine_args``),
    then vLLM's flags that pagedserve lacks (hidden; named in the epilog)."""
    doc = __doc__.split("\n\n")[0].replace("``", "`")
    parser = ServeParser(prog="pagedserve", description=doc)
    parser.add_argument("--version", action="version", version=f"pagedserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=BriefErrors)
    s = sub.add_parser("serve", help="serve a model over the OpenAI API",
                       epilog=vllm_flags.epilog())
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as --model")
    add_serve_flags(s)
    vllm_flags.add_vllm_flags(s)
    parser.serve = s
    add_proxy_parser(sub)  # pagedserve proxy: disaggregated prefill/decode (server/proxy.py)
    return parser


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


def _generation_defaults(model: str | None, args: argparse.Namespace) -> GenerationDefaults:
    """The request defaults of ``--generation-config`` / ``--override-generation-config`` for
    the model being served (logged when there are any, as vLLM does)."""
    from pagedserve.gpu import loader

    try:
        resolved = loader.resolve_model(model)
    except loader.ModelLoadError:
        return GenerationDefaults()  # the engine's start reports it, as for every model error
    embedded = resolved.gguf_file is not None and (
        resolved.default_served_name == EMBEDDED_SERVED_NAME)
    try:
        defaults = load_generation_defaults(args.generation_config,
                                            args.override_generation_config, resolved.path,
                                            embedded)
    except (ValueError, OSError) as e:
        raise SystemExit(f"pagedserve: error: {e}") from None
    if defaults != GenerationDefaults():
        log.info("generation_config", source=args.generation_config, **defaults.sampling,
                 max_tokens=defaults.max_tokens, max_tokens_cap=defaults.max_tokens_cap)
    return defaults


def warn_cpu_ignores_gpu_memory_utilization(args: argparse.Namespace) -> None:
    """``--gpu-memory-utilization`` sizes the KV cache on CUDA only: given for a CPU engine it
    would otherwise be accepted and do nothing, silently."""
    if "--gpu-memory-utilization" not in getattr(args, "given_flags", ()):
        return
    import torch

    if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu":
        return
    log.warning("gpu_memory_utilization_ignored", value=args.gpu_memory_utilization,
                device="cpu", hint=f"it sizes the KV cache on CUDA only; on the CPU use "
                f"--kv-cache-memory-bytes (e.g. 4G) or ${CPU_KV_CACHE_ENV} (GiB)")


async def serve(args: argparse.Namespace) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve

    from pagedserve.actors.dp.launch import run_headless, start_engine
    from pagedserve.server.app import build_app
    from pagedserve.server.launch import hypercorn_config
    from pagedserve.server.shutdown import GracefulShutdown

    server = from_args(ServerConfig, args)
    if args.vllm_ignored:
        log.warning("vllm_flags_ignored", flags=args.vllm_ignored,
                    hint="vLLM flags that change nothing here (pagedserve serve --help names "
                         "them)")
    dp = from_args(DataParallelConfig, args)
    if args.enable_lora and (dp.data_parallel_size > 1 or dp.headless):
        raise ValueError("--enable-lora with data parallelism is not supported yet: serve the "
                         "adapters from one engine (tensor parallelism works)")
    if dp.headless:  # engines only: they register with the API server at the dp address
        if code := await run_headless(engine_config(args), dp, args.log_level):
            raise SystemExit(code)
        return
    warn_cpu_ignores_gpu_memory_utilization(args)
    if args.api_key is None and not _is_loopback(server.host):
        log.warning("no_api_key_on_public_address", host=server.host,
                    hint="anyone who reaches this address can use the server: set --api-key")
    # Before the engine starts: a bad generation config is a usage error, not a minute late.
    generation_defaults = _generation_defaults(engine_config(args).model.model, args)
    engine = await start_engine(engine_config(args), dp, args.log_level)
    # The served name's one home is ServingConfig; the model's own name is only its default.
    served = args.served_model_name or default_served_names(engine.info.served_name)
    serving = from_args(ServingConfig, args, served_model_name=served,
                        chat_template=_read_template(args.chat_template),
                        generation_defaults=generation_defaults)
    app = build_app(engine, serving, server.max_request_body_bytes,
                    access_log=not server.disable_access_log)
    config = hypercorn_config(server.host, server.port)
    shutdown = GracefulShutdown(engine, app, server.shutdown_timeout)  # server/shutdown.py
    shutdown.install()
    base = f"http://{config.bind[0]}"
    log.info("serving", url=f"{base}/v1", model=served)
    key_required = bool(serving.admin_key or serving.api_key)
    log.info("operator_pages", chat=f"{base}/", dashboard=f"{base}/admin",
             metrics=f"{base}/metrics", admin_key_required=key_required)
    try:
        await hypercorn_serve(app, config, shutdown_trigger=shutdown.trigger)
    finally:
        await engine.shutdown()
        log.info("stopped")
    if engine.failure:
        raise SystemExit(f"pagedserve: error: the engine failed: {engine.failure}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "proxy":  # before torch is imported: the proxy only relays
        return proxy_main(args)
    from pagedserve.gpu.loader import ModelLoadError  # after parsing: it imports torch

    try:
        asyncio.run(serve(args))
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        sys.exit(1)
    except SystemExit as e:
        _exit_now(e.code)
    _exit_now(0)


def _exit_now(code: int | str | None) -> None:
    """End the process once ``serve`` has stopped everything (workers and engine processes
    reaped, sockets closed, logs written): skip the interpreter's finalization, which spent
    1.6 s (4-5 s on larger machines) garbage-collecting the modules of torch and transformers
    after the ``stopped`` line (gdb: ``finalize_modules``), so the process exits when it says
    it stopped. A message ``code`` is printed and exits 1, as ``SystemExit`` does."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
