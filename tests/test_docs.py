"""The README's commands as written. Its first example, the curl command (only the address
changed), against ``pagedserve serve`` at the default flags, what ``make serve`` runs, answers
"Paris" on every CPU tier this CPU can run (``PAGEDSERVE_CPU_ISA`` caps the tier; the default
dtype and linear mode follow the tier, so each tier is its own arithmetic). Every
``pagedserve ...`` command it shows parses, the ``pagedserve`` it names is where ``make``
puts it, and its table of supported architectures is what the code serves."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagedserve.kernels import cpu_isa
from pagedserve.server.launch import start_server_process

README = Path(__file__).resolve().parents[1] / "README.md"
README_URL = "http://127.0.0.1:8000"


def readme_blocks(lang: str) -> list[str]:
    """The README's fenced code blocks of language ``lang`` (``""``: no language), in order."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", README.read_text(encoding="utf-8"),
                        re.M | re.S)
    return [body for block_lang, body in blocks if block_lang == lang]


def pagedserve_commands() -> list[list[str]]:
    """Every ``pagedserve ...`` command line of the README's shell blocks as argv, from
    ``pagedserve`` on (line continuations joined, comments and ``VAR=value`` prefixes dropped)."""
    commands = []
    for block in readme_blocks("bash") + readme_blocks(""):
        for line in block.replace("\\\n", " ").splitlines():
            if re.match(r"(?:[A-Z_]+=\S*\s+)*pagedserve\s", line):
                argv = shlex.split(line, comments=True)
                commands.append(argv[argv.index("pagedserve"):])
    return commands


def curls() -> list[list[str]]:
    """Every curl command of the README's bash blocks as argv (continuations joined; a
    command's JSON may span lines inside its quotes), in order."""
    out = []
    for block in readme_blocks("bash"):
        for part in re.split(r"^(?=curl )", block.replace("\\\n", " "), flags=re.M)[1:]:
            out.append(shlex.split(part, comments=True))
    return out


def readme_table(heading: str) -> list[list[str]]:
    """The body rows of the first table after the README's line ``heading``, each a list of
    its cells as written (no cell here holds a ``|``)."""
    section = README.read_text(encoding="utf-8").split(f"\n{heading}\n", 1)[1]
    table = re.search(r"^(?:\|.*\n)+", section, re.M)
    assert table, f"no table under {heading!r}"
    rows = [line.strip().strip("|").split("|") for line in table.group(0).splitlines()]
    return [[cell.strip() for cell in row] for row in rows[2:]]  # after the header and |---|


def first_curl() -> list[str]:
    """The README's first curl command as argv."""
    return curls()[0]


def test_the_first_curl_is_greedy_and_bounded():
    """What the Paris test relies on: the example asks for greedy output and a bounded
    length (a request without max_tokens once ran 6.5 minutes)."""
    argv = first_curl()
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["temperature"] == 0 and 0 < body["max_tokens"] <= 128
    assert "France" in body["messages"][-1]["content"]
    assert any(a.startswith(README_URL) for a in argv)  # the address the test replaces


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_the_readme_question_answers_paris_on_every_tier(level, tmp_path):
    if cpu_isa.select_level(level) != level:
        pytest.skip(f"this CPU cannot run the {level} tier (it runs "
                    f"{cpu_isa.select_level(level)} under that cap)")
    log = tmp_path / "server.log"
    with log.open("w") as out:
        try:
            proc, url = start_server_process([], env={**_env(), cpu_isa.ISA_ENV: level},
                                             stdout=out, stderr=subprocess.STDOUT)
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{log.read_text()}")
    try:
        argv = [a.replace(README_URL, url) for a in first_curl()]
        sse = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
        events = [line[len("data: "):] for line in sse.stdout.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]", sse.stdout[-2000:]
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                       for e in events[:-1])
        assert "Paris" in text, f"{level}: {text!r}"
        model = httpx.get(f"{url}/admin/stats", timeout=30).json()["config"]["model"]
        assert model["cpu_isa"] == level  # the cap took: this tier's arithmetic answered
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def _env() -> dict[str, str]:
    """This process's environment without any tier cap (the test sets its own)."""
    return {k: v for k, v in os.environ.items() if k not in (
        cpu_isa.ISA_ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """``pagedserve serve`` at the default flags, the server the README's examples talk to."""
    log = tmp_path_factory.mktemp("readme") / "server.log"
    with log.open("w") as out:
        try:
            proc, url = start_server_process([], env=_env(), stdout=out,
                                             stderr=subprocess.STDOUT)
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{log.read_text()}")
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_every_readme_request_example_runs_as_written_and_is_bounded(default_server):
    """The README's curls against the default server (the KV-connector ones need two servers
    and a connector: tests/server/test_kv_connector.py), and its Python snippet, each with a
    length limit, each answered; ``resp_...`` is the id the curl before it got. Its Python
    snippets: the openai client's, the Agents SDK's and the anthropic client's."""
    ran, last_id = [], None
    for argv in curls()[1:]:
        body = json.loads(argv[argv.index("-d") + 1])
        if "kv_transfer_params" in body:
            continue
        assert "max_tokens" in body or "max_output_tokens" in body, body
        argv = [a.replace(README_URL, default_server).replace("resp_...", str(last_id))
                for a in argv]
        out = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=300,
                                        check=True).stdout)
        assert out.get("error") is None, out
        last_id = out["id"]
        ran.append(out)
    guided, first, follow_up, tools = ran
    person = json.loads(guided["choices"][0]["message"]["content"])
    assert isinstance(person["name"], str) and person["age"] >= 0
    assert first["status"] == follow_up["status"] == "completed"
    assert follow_up["previous_response_id"] == first["id"]
    (call,) = tools["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert "Paris" in json.loads(call["function"]["arguments"])["city"]

    snippets = readme_blocks("python")
    client_snippet, agents_snippet, messages_snippet = (
        next(s for s in snippets if marker in s)
        for marker in ("from openai import OpenAI", "from agents import", "import anthropic"))
    assert all("max_tokens=" in s for s in (client_snippet, agents_snippet, messages_snippet))
    scope: dict = {}
    exec(client_snippet.replace(README_URL, default_server), scope)  # noqa: S102 (our README)
    assert scope["r"].choices[0].message.content
    # Anthropic's client on /v1/messages, the Agents SDK's question: the same answer.
    exec(messages_snippet.replace(README_URL, default_server), scope)  # noqa: S102
    assert "Paris" in scope["m"].content[0].text and scope["m"].stop_reason == "end_turn"
    # The Agents SDK example by the slash-free alias, in a process of its own (run_sync).
    out = subprocess.run([sys.executable, "-c", agents_snippet.replace(README_URL, default_server)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Paris" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_every_pagedserve_command_in_the_readme_parses():
    """Each is accepted by ``pagedserve``'s parser as written (placeholders such as MODEL and
    ./my-llama are models to the parser), and its flags make a valid engine config."""
    from pagedserve.server.cli import build_parser
    from pagedserve.server.engine_args import engine_config

    commands = pagedserve_commands()
    assert len(commands) >= 13 and ["pagedserve", "serve"] in commands
    assert any(c[1] == "proxy" for c in commands)
    for argv in commands:
        args = build_parser().parse_args(argv[1:])
        if args.command == "serve":
            engine_config(args)


def test_the_readme_names_the_pagedserve_that_make_installs():
    """A fresh clone has ``pagedserve`` only in ``.venv/bin`` after ``make serve``: the README
    says so and how to put it on PATH, and the Makefile's venv is that one."""
    text = README.read_text(encoding="utf-8")
    assert "`.venv/bin/pagedserve`" in text and "`source .venv/bin/activate`" in text
    makefile = (README.parent / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^VENV\s*\?=\s*\.venv$", makefile, re.M)
    assert "\t$(VENV)/bin/pagedserve serve $(ARGS)" in makefile


def test_the_supported_architectures_table_lists_what_the_registry_serves():
    """Every ``architectures`` name the registry gives a model class, once, and every GGUF
    ``general.architecture`` the loader reads (``gguf_file.READ_ARCHS``), and no other name:
    the table cannot drift from the code."""
    from pagedserve.gpu import gguf_file
    from pagedserve.gpu.models import registry

    rows = readme_table("### Supported architectures")

    def named(column: int) -> list[str]:
        return [name for row in rows for name in re.findall(r"`([^`]+)`", row[column])]

    assert sorted(named(1)) == sorted(registry.ARCHITECTURES)
    assert set(named(2)) == set(gguf_file.READ_ARCHS)
