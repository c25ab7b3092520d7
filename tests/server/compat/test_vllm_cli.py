"""A ``vllm serve`` command line: harmless vLLM flags accepted, the rest refused with a reason,
errors under ``serve``'s usage, ``--version``, vLLM's ``4k``/``4K`` lengths, and a ``--help``
that loads no tensor library."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from pagedserve.actors.dp.launch import SAFE_PATH
from pagedserve.server.cli import build_parser, package_version
from pagedserve.server.compat import vllm_flags
from pagedserve.server.engine_args import FLAG_CONFIGS, engine_config, flags_of

SERVE_ERROR = "pagedserve serve: error: "
HINT = "see `pagedserve serve --help` for the flags"


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    err = capsys.readouterr().err
    # The error and a hint, no usage dump (argparse's lists every flag: 40 lines).
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 2, err
    assert lines[0].startswith(SERVE_ERROR) and lines[1] == HINT, err
    return lines[0]


def test_harmless_vllm_flags_are_recorded_and_their_values_are_not_the_model():
    args = parse("--trust-remote-code", "--uvicorn-log-level", "warning", "my/model",
                 "--disable-log-requests", "--disable-log-stats", "--swap-space", "4",
                 "--cpu-offload-gb", "0", "--task", "generate", "--port", "9")
    assert args.model_tag == "my/model" and args.port == 9
    assert args.vllm_ignored == ["--trust-remote-code", "--uvicorn-log-level warning",
                                 "--disable-log-requests", "--disable-log-stats",
                                 "--swap-space 4", "--cpu-offload-gb 0",
                                 "--task generate"]
    assert parse().vllm_ignored == []


def test_refused_vllm_flags_say_what_pagedserve_does_instead(capsys):
    assert "reasoning parsers are not supported" in usage_error(capsys, "--reasoning-parser",
                                                                "deepseek_r1")
    assert "weights stay on --device" in usage_error(capsys, "--cpu-offload-gb", "4")
    assert "TLS proxy" in usage_error(capsys, "--ssl-keyfile", "k.pem")
    err = usage_error(capsys, "--quantization", "awq")
    assert "--quantization awq is not supported" in err and "GGUF" in err
    assert "--quantization AWQ is not supported" in usage_error(capsys, "-q=AWQ")


def test_unknown_flags_get_serve_usage_and_the_closest_flag(capsys):
    err = usage_error(capsys, "--max-model-length", "4096")
    assert "unrecognized arguments: --max-model-length" in err
    assert "did you mean --max-model-len?" in err
    # A type error is also serve's, not the top level's.
    assert "--port" in usage_error(capsys, "--port", "eighty")


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedserve {package_version()}"


@pytest.mark.parametrize(("text", "tokens"), [
    ("4k", 4000), ("4K", 4096), ("25.6k", 25600), ("1m", 1_000_000), ("2M", 2 * 2**20),
    ("8192", 8192),
])
def test_max_model_len_takes_vllm_suffixes(text, tokens):
    assert engine_config(parse("--max-model-len", text)).model.max_model_len == tokens


def test_a_fraction_with_a_binary_suffix_is_refused(capsys):
    assert "decimal suffix" in usage_error(capsys, "--max-model-len", "1.5K")


def test_no_vllm_flag_shadows_a_pagedserve_flag():
    ours = {opt for cls in FLAG_CONFIGS for f in flags_of(cls)
            for opt in (f.option, *f.field.metadata.get("aliases", ()))}
    theirs = set(vllm_flags.IGNORED) | set(vllm_flags.REFUSED)
    assert ours and not ours & theirs
    assert set(vllm_flags.HARMLESS_VALUES) <= set(vllm_flags.REFUSED)


def run_cli(*argv: str) -> tuple[int, str, list[str]]:
    """``main(argv)`` in a fresh interpreter: exit code, output, heavy modules it imported."""
    code = ("import json, sys\nfrom pagedserve.server.cli import main\ntry:\n    main(%r)\n"
            "except SystemExit as e:\n    rc = e.code\nprint('IMPORTED', json.dumps(sorted("
            "m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules)))\n"
            "sys.exit(rc)" % list(argv))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent)
    imported = json.loads(proc.stdout.rsplit("IMPORTED ", 1)[1])
    return proc.returncode, proc.stdout + proc.stderr, imported


def test_help_version_and_usage_errors_import_no_tensor_library():
    rc, out, imported = run_cli("serve", "--help")
    assert rc == 0 and "--max-model-len" in out and "--trust-remote-code" in out
    assert imported == []
    rc, out, imported = run_cli("--version")
    assert rc == 0 and imported == []
    rc, out, imported = run_cli("serve", "--reasoning-parser", "deepseek_r1")
    assert rc == 2 and imported == []
    assert out.splitlines()[-2:] == [
        f"{SERVE_ERROR}vLLM's --reasoning-parser is not supported by pagedserve: reasoning "
        "parsers are not supported", HINT], out


def test_serve_names_the_ignored_flags_in_one_warning(tmp_path):
    missing = tmp_path / "absent.gguf"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "pagedserve"), "serve", str(missing),
         "--trust-remote-code", "--uvicorn-log-level", "debug"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "GGUF file not found" in proc.stderr
    warning = [line for line in proc.stderr.splitlines() if "vllm_flags_ignored" in line]
    assert len(warning) == 1
    assert "'--trust-remote-code'" in warning[0] and "'--uvicorn-log-level debug'" in warning[0]


def test_gpu_memory_utilization_on_the_cpu_is_warned_only_when_given():
    from pagedserve.server.cli import warn_cpu_ignores_gpu_memory_utilization

    def events(*argv: str) -> list[dict]:
        with structlog.testing.capture_logs() as logged:
            warn_cpu_ignores_gpu_memory_utilization(parse(*argv))
        return logged

    # Given, even at its default value: a warning naming what works on the CPU.
    (warning,) = events("--device", "cpu", "--gpu-memory-utilization", "0.9")
    assert warning["event"] == "gpu_memory_utilization_ignored" and warning["value"] == 0.9
    assert "--kv-cache-memory-bytes" in warning["hint"]
    assert "$VLLM_CPU_KVCACHE_SPACE" in warning["hint"]
    assert len(events("--device", "cpu", "--gpu-memory-utilization=0.5")) == 1
    assert events("--device", "cpu") == []  # left alone: nothing to say
    assert events("--device", "cuda", "--gpu-memory-utilization", "0.5") == []


def test_start_up_log_names_the_speculative_config_and_the_ignored_flag(tiny_model_dir,
                                                                        tmp_path):
    """A real ``pagedserve serve`` start: the draft model's settings and the CPU warning are
    in its log before it serves."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = json.dumps({"method": "draft_model", "model": str(tiny_model_dir),
                       "num_speculative_tokens": 2})
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, *SAFE_PATH, "-m", "pagedserve.server.cli", "serve",
             str(tiny_model_dir), "--device", "cpu", "--port", str(port), "--max-model-len", "256",
             "--gpu-memory-utilization", "0.5", "--speculative-config", spec],
            stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "serving" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    lines = log_path.read_text().splitlines()
    (warned,) = [ln for ln in lines if "gpu_memory_utilization_ignored" in ln]
    assert "value=0.5" in warned and "--kv-cache-memory-bytes" in warned
    (spec_line,) = [ln for ln in lines if "speculative_decoding" in ln]
    assert "method=draft_model" in spec_line and "num_speculative_tokens=2" in spec_line
    assert f"draft_model={tiny_model_dir}" in spec_line
    serving_at = next(i for i, ln in enumerate(lines) if " serving " in ln)
    assert lines.index(spec_line) < serving_at
