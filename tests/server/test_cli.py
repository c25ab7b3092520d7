"""`pagedserve serve`'s flags come from the config dataclasses; the docs' flag table
(docs/serving.md) matches them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedserve.actors.engine.config import EngineConfig
from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
from pagedserve.gpu.config import CacheConfig
from pagedserve.server.cli import build_parser
from pagedserve.server.config import ServerConfig, ServingConfig
from pagedserve.server.engine_args import engine_config, from_args

SERVING_PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def help_flags(capsys: pytest.CaptureFixture[str]) -> dict[frozenset[str], str]:
    """``{option strings: X}`` for every flag of ``serve --help`` ending in ``(default: X)``."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    entries: list[list[str]] = []
    current: list[str] | None = None  # an option's lines: its own, then indented help lines
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):
            current = [line]
            entries.append(current)
        elif line.startswith("   ") and current is not None:
            current.append(line)
        else:
            current = None
    flags = {}
    for entry in entries:
        invocation = entry[0].strip().split("  ")[0]
        options = frozenset(re.findall(r"(?:^|, )(--?[a-z][\w-]*)", invocation))
        if options == {"-h", "--help"}:
            continue
        text = " ".join(" ".join(entry).split())
        match = re.search(r"\(default: (.*)\)$", text)
        flags[options] = match.group(1) if match else f"<no default in {text!r}>"
    return flags


def docs_flags() -> dict[frozenset[str], str]:
    """``{option strings: default}`` from the docs' flag table, backticks dropped."""
    lines = SERVING_PAGE.read_text(encoding="utf-8").splitlines()
    start = lines.index("| flag | default | meaning |") + 2
    flags = {}
    for row in lines[start:]:
        if not row.startswith("|"):
            break
        flag_cell, default_cell = row.strip("|").split("|")[:2]
        options = frozenset(re.findall(r"`(-[^`]*)`", flag_cell))
        flags[options] = " ".join(default_cell.replace("`", "").split())
    return flags


def mismatches(help_: dict[frozenset[str], str], docs: dict[frozenset[str], str]) -> list[str]:
    out = [f"{sorted(o)} not in the docs" for o in help_.keys() - docs.keys()]
    out += [f"{sorted(o)} in the docs, not in --help" for o in docs.keys() - help_.keys()]
    out += [f"{sorted(o)}: --help says {help_[o]!r}, the docs {docs[o]!r}"
            for o in help_.keys() & docs.keys() if help_[o] != docs[o]]
    return out


@pytest.fixture(autouse=True)
def _wide_help_and_no_keys(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse breaks long words at hyphens
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PAGEDSERVE_ADMIN_KEY", raising=False)


def test_every_flag_is_in_the_docs_with_its_default(capsys):
    help_ = help_flags(capsys)
    assert len(help_) >= 29 and help_[frozenset({"--block-size"})] == "16"
    assert help_[frozenset({"--quantization", "-q"})].startswith("gguf for a .gguf model")
    assert help_[frozenset({"--enable-prefix-caching", "--no-enable-prefix-caching"})] == "on"
    assert mismatches(help_, docs_flags()) == []


def test_a_changed_default_shows_in_help_and_breaks_the_docs_match(capsys, monkeypatch):
    monkeypatch.setattr(CacheConfig.__dataclass_fields__["block_size"], "default", 32)
    assert build_parser().parse_args(["serve"]).block_size == 32
    assert mismatches(help_flags(capsys), docs_flags()) == [
        "['--block-size']: --help says '32', the docs '16'"]


def test_no_flags_give_the_dataclass_defaults():
    args = build_parser().parse_args(["serve"])
    assert engine_config(args) == EngineConfig()
    assert from_args(ServerConfig, args) == ServerConfig()
    assert from_args(ServingConfig, args, served_model_name="m") == ServingConfig("m")


def test_flags_reach_their_fields(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_ADMIN_KEY", "adm")
    args = build_parser().parse_args([
        "serve", "tag", "--block-size", "32", "--no-enable-prefix-caching", "-q", "none",
        "--scheduling-policy", "priority", "--speculative-config", '{"num_speculative_tokens": 5}',
        "--structured-output-compile-timeout", "2.5", "--enforce-eager", "--port", "9",
        "--enable-log-requests", "--max-waiting-requests", "7",
    ])
    engine = engine_config(args)
    assert engine.model.model == "tag" and engine.model.quantization == "none"
    assert engine.model.enforce_eager is True
    assert engine.cache.block_size == 32 and engine.cache.enable_prefix_caching is False
    assert engine.scheduler.policy == "priority" and engine.scheduler.max_waiting_requests == 7
    assert engine.scheduler.speculative == SpeculativeConfig(num_speculative_tokens=5)
    assert engine.structured_output.compile_timeout_s == 2.5
    assert from_args(ServerConfig, args).port == 9
    serving = from_args(ServingConfig, args, served_model_name="m")
    assert serving.enable_log_requests is True and serving.admin_key == "adm"
    assert engine_config(build_parser().parse_args(["serve", "tag", "--model", "m"])).model.model \
        == "m"


def test_several_served_model_names_are_parsed_in_order():
    """vLLM's ``nargs='+'``: every name after the flag; the first is the reported one."""
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "org/b", "--port", "9"])
    serving = from_args(ServingConfig, args)
    assert serving.served_model_name == ("a", "org/b") and serving.model_name == "a"
    assert from_args(ServerConfig, args).port == 9


def test_choices_are_enforced(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--block-size", "12"])
    assert e.value.code == 2 and "invalid choice: 12" in capsys.readouterr().err
