"""The README's and the documentation pages' commands as written, and the site's build.

The README's first example, the curl command (only the address changed), against
``pagedserve serve`` at the default flags, what ``make serve`` runs, answers "Paris" on every CPU
tier this CPU can run (``PAGEDSERVE_CPU_ISA`` caps the tier; the default dtype and linear mode
follow the tier, so each tier is its own arithmetic). Every request example of the README and
the pages (docs/, in the site's order) runs against that server, every ``pagedserve ...``
command they show parses, the ``pagedserve`` the README names is where ``make`` puts it, the
table of supported architectures (docs/models.md) is what the code serves, the README stays
one page, and ``mkdocs build --strict`` builds the site with no warning."""

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

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_URL = "http://127.0.0.1:8000"


def pages() -> list[Path]:
    """The README, then the site's pages in its navigation's order (mkdocs.yml's ``nav``)."""
    nav = re.findall(r"^  - [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return [README, *(DOCS / name for name in nav)]


def doc_blocks(lang: str) -> list[str]:
    """The fenced code blocks of language ``lang`` (``""``: no language) of every page, in
    order; a block shown twice (the README's first request, again on the getting-started
    page) counts once."""
    out: list[str] = []
    for page in pages():
        blocks = re.findall(r"^```(\w*)\n(.*?)^```$", page.read_text(encoding="utf-8"),
                            re.M | re.S)
        out += [body for block_lang, body in blocks if block_lang == lang and body not in out]
    return out


def pagedserve_commands() -> list[list[str]]:
    """Every ``pagedserve ...`` command line of the pages' shell blocks as argv, from
    ``pagedserve`` on (line continuations joined, comments and ``VAR=value`` prefixes dropped)."""
    commands = []
    for block in doc_blocks("bash") + doc_blocks(""):
        for line in block.replace("\\\n", " ").splitlines():
            if re.match(r"(?:[A-Z_]+=\S*\s+)*pagedserve\s", line):
                argv = shlex.split(line, comments=True)
                commands.append(argv[argv.index("pagedserve"):])
    return commands


def curls() -> list[list[str]]:
    """Every curl command of the pages' bash blocks as argv (continuations joined; a
    command's JSON may span lines inside its quotes), in order."""
    out = []
    for block in doc_blocks("bash"):
        for part in re.split(r"^(?=curl )", block.replace("\\\n", " "), flags=re.M)[1:]:
            out.append(shlex.split(part, comments=True))
    return out


def page_table(page: Path, heading: str) -> list[list[str]]:
    """The body rows of the first table after the line ``heading`` of ``page``, each a list of
    its cells as written (no cell here holds a ``|``)."""
    section = page.read_text(encoding="utf-8").split(f"\n{heading}\n", 1)[1]
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
    """The pages' curls against the default server (the KV-connector ones need two servers
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

    snippets = doc_blocks("python")
    client_snippet, agents_snippet, messages_snippet = (
        next(s for s in snippets if marker in s)
        for marker in ("from openai import OpenAI", "from agents import", "import anthropic"))
    assert all("max_tokens=" in s for s in (client_snippet, agents_snippet, messages_snippet))
    scope: dict = {}
    exec(client_snippet.replace(README_URL, default_server), scope)  # noqa: S102 (our docs)
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

    rows = page_table(DOCS / "models.md", "## Supported architectures")

    def named(column: int) -> list[str]:
        return [name for row in rows for name in re.findall(r"`([^`]+)`", row[column])]

    assert sorted(named(1)) == sorted(registry.ARCHITECTURES)
    assert set(named(2)) == set(gguf_file.READ_ARCHS)


def test_the_readme_is_one_page_and_points_to_the_docs():
    """What a newcomer needs on one screen or two; every page of the site is linked from it."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert "make serve" in text and "make test" in text and "make docs" in text
    for page in pages()[1:]:
        assert f"(docs/{page.name})" in text, page.name


def test_the_site_builds_with_no_warning(tmp_path):
    """``mkdocs build --strict`` (what ``make docs`` runs): a broken link or anchor, a page
    left out of the navigation or an unknown extension fails it. Offline: nothing is fetched."""
    pytest.importorskip("mkdocs", reason="make docs (and make test) install mkdocs into .venv")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    assert {p.name for p in pages()[1:]} == {p.name for p in DOCS.glob("*.md")}
    for page in pages()[1:]:
        built = tmp_path / "site" / ("" if page.stem == "index" else page.stem) / "index.html"
        assert built.exists(), built
