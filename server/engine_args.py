"""``pagedserve serve``'s flags, built from the config dataclasses' fields (the idea of vLLM's
``EngineArgs.add_cli_args`` in ``vllm/engine/arg_utils.py``): a new flag is one field.

A field is a flag when its ``metadata`` has ``help``; its default is the field's default, its
type the field's annotation (``int``, ``float``, ``str``; ``X | None`` is ``X``). A ``bool``
field is a switch: ``--x`` when off by default, ``--x/--no-x`` when on by default (else it could
not be turned off). Other metadata keys:

``flag``
    the option when it is not ``--`` + the field's name with dashes (``--scheduling-policy``);
    the parsed value is ``args.<option with underscores>`` either way.
``aliases``
    more option strings (``("-q",)``).
``choices``
    the values accepted.
``nargs``
    argparse's ``nargs`` (``"+"``: one or more values, a list).
``parse``
    ``str -> value``; a ``ValueError`` it raises is the usage error's message.
``human_int``
    the value may carry vLLM's suffixes (``human_readable_int`` in ``vllm/engine/arg_utils.py``):
    ``k``/``m``/``g``/``t`` multiply by powers of 1000 (``25.6k`` = 25600), ``K``/``M``/``G``/``T``
    by powers of 1024 (``4K`` = 4096, whole numbers only).
``env``
    an environment variable whose value, when set, is the default (read when the parser is
    built).
``default_text``
    how ``--help`` and the docs show a default that is not a plain value ("the model's").

``--help`` ends every flag's help with ``(default: X)``; the docs' flag table (docs/serving.md)
shows the same ``X`` (``tests/server/test_cli.py`` holds them equal).
"""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.dp.config import DataParallelConfig
from pagedserve.actors.structured_output.config import StructuredOutputConfig
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.gpu.lora.config import LoRAConfig
from pagedserve.server.config import ServerConfig, ServingConfig

if TYPE_CHECKING:  # the engine imports torch: --help and usage errors must not wait for it
    from pagedserve.actors.engine.config import EngineConfig

# Every dataclass that has flags, in --help's order (one argument group each).
FLAG_CONFIGS: tuple[type, ...] = (
    ModelConfig, CacheConfig, ParallelConfig, DataParallelConfig, SchedulerConfig,
    LoRAConfig, StructuredOutputConfig, ServingConfig, ServerConfig,
)

C = TypeVar("C")


@dataclass(slots=True, frozen=True)
class Flag:
    """One field as a flag: ``option`` (``--block-size``), ``dest`` (``block_size``)."""

    field: Field
    type: Any  # the annotation, ``None`` unwrapped
    option: str
    dest: str

    @property
    def default(self) -> Any:
        """The parser's default: the environment variable's value when set, else the field's
        (``None`` for a field without one, whose value is resolved at start-up)."""
        default = None if self.field.default is MISSING else self.field.default
        env = self.field.metadata.get("env")
        return os.environ.get(env, default) if env else default

    def shown_default(self) -> str:
        """The ``X`` of ``(default: X)``."""
        meta = self.field.metadata
        if "default_text" in meta:
            return meta["default_text"]
        default = self.field.default
        if isinstance(default, bool):
            return "on" if default else "off"
        return "none" if default is None or default is MISSING else str(default)


def flags_of(cls: type) -> list[Flag]:
    """The fields of ``cls`` that are flags, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if "help" not in f.metadata:
            continue
        option = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        out.append(Flag(f, _unwrap_optional(hints[f.name]), option,
                        option.lstrip("-").replace("-", "_")))
    return out


def _unwrap_optional(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add the flags of ``cls`` to ``parser``, in a group named after it."""
    group = parser.add_argument_group(cls.__name__)
    for flag in flags_of(cls):
        meta = flag.field.metadata
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": flag.default}
        if flag.type is bool:
            kwargs["action"] = (argparse.BooleanOptionalAction if flag.field.default
                                else "store_true")
        elif "parse" in meta:
            kwargs["type"] = _usage_errors(meta["parse"])
        elif meta.get("human_int"):
            kwargs["type"] = _usage_errors(human_readable_int)
        elif flag.type in (int, float):
            kwargs["type"] = flag.type
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if "nargs" in meta:
            kwargs["nargs"] = meta["nargs"]
        action = group.add_argument(flag.option, *meta.get("aliases", ()), **kwargs)
        # Set after: BooleanOptionalAction would append a "(default: True)" of its own.
        action.help = f"{meta['help']} (default: {flag.shown_default()})".replace("%", "%%")


def _usage_errors(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ``ValueError`` turned into a usage error that shows its message."""

    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse_flag.__name__ = parse.__name__
    return parse_flag


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def human_readable_int(text: str) -> int:
    """``4k`` → 4000, ``25.6k`` → 25600, ``4K`` → 4096, ``131072`` → 131072 (vLLM's rules).

    Raises:
        ValueError: not a number, or a fraction with a binary suffix.
    """
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"invalid integer {text!r} (suffixes: k/m/g/t = 1000s, K/M/G/T = 1024s)")
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ValueError(f"{text!r}: a fraction needs a decimal suffix (k/m/g/t), "
                         f"e.g. {number}{suffix.lower()}")
    return int(number) * _BINARY.get(suffix, 1)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of every config in ``FLAG_CONFIGS``."""
    for cls in FLAG_CONFIGS:
        add_config_flags(parser, cls)


def from_args(cls: type[C], args: argparse.Namespace, **resolved: Any) -> C:
    """``cls`` from its flags' parsed values; ``resolved`` sets fields the CLI works out
    itself (the model from the positional MODEL, the served name once the model is loaded)."""
    values = {flag.field.name: getattr(args, flag.dest) for flag in flags_of(cls)}
    return cls(**(values | resolved))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from parsed ``serve`` flags (``--model`` wins over MODEL).

    Raises:
        ValueError: LoRA limits that cannot work (``LoRAConfig.check``).
    """
    from pagedserve.actors.engine.config import EngineConfig

    lora = from_args(LoRAConfig, args)
    if lora.enable_lora:
        lora.check()
    lora_on = lora if lora.enable_lora else None
    return EngineConfig(
        model=from_args(ModelConfig, args, model=args.model or args.model_tag, lora=lora_on),
        cache=from_args(CacheConfig, args),
        parallel=from_args(ParallelConfig, args),
        scheduler=from_args(SchedulerConfig, args,
                            max_loras=lora.max_loras if lora.enable_lora else 0),
        structured_output=from_args(StructuredOutputConfig, args),
    )
