"""Derive argparse flags from a dataclass config: one flag per field, help = the field's
``metadata["help"]`` (as ``transformers.HfArgumentParser`` does).

Example: ``max_new_tokens: int = field(default=256, metadata={"help": "hard cap on generated
tokens"})`` becomes ``--max-new-tokens INT (default 256): hard cap on generated tokens``.
Enums become choices; ``list[str]``/``tuple[str, ...]`` take several values; bools get
``--x/--no-x``. A field without help is an error when the parser is built, so a flag can
never reach ``--help`` undocumented (help is never read from source comments, which are
absent where only bytecode is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import typing


def field_help(cls, f: dataclasses.Field) -> str:
    """The help text of field ``f`` of ``cls``; raises TypeError when it has none."""
    help_ = f.metadata.get("help")
    if not isinstance(help_, str) or not help_.strip():
        raise TypeError(f"{cls.__name__}.{f.name} has no help: declare it as field(default=..., "
                        'metadata={"help": "..."}) to derive a CLI flag from it')
    return help_.strip()


def add_fields(parser: argparse.ArgumentParser, cls, exclude: tuple[str, ...] = (),
               defaults: dict | None = None) -> None:
    """Add one flag per dataclass field of ``cls`` (except ``exclude``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        text = field_help(cls, f)
        tp = hints[f.name]
        default = (defaults or {}).get(f.name, f.default if f.default is not dataclasses.MISSING
                                       else f.default_factory())  # type: ignore[misc]
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{text} (default: {default.value if isinstance(default, enum.Enum) else default})"
        origin = typing.get_origin(tp)
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif inspect.isclass(tp) and issubclass(tp, enum.Enum):
            parser.add_argument(flag, type=tp, choices=list(tp), default=default, help=help_,
                                metavar="{" + ",".join(m.value for m in tp) + "}")
        elif origin in (list, tuple):
            elem = typing.get_args(tp)[0] if typing.get_args(tp) else str
            parser.add_argument(flag, nargs="*", type=elem, default=default, help=help_)
        else:
            base = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if origin else tp
            parser.add_argument(flag, type=base, default=default, help=help_)


def from_args(cls, args: argparse.Namespace, **override):
    """Build ``cls`` from parsed args (fields absent from ``args`` keep their defaults)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in override:
            kwargs[f.name] = override[f.name]
        elif hasattr(args, f.name):
            val = getattr(args, f.name)
            kwargs[f.name] = tuple(val) if isinstance(f.default, tuple) and isinstance(val, list) else val
    return cls(**kwargs)
