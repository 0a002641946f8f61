"""Options defined once, as pydantic-settings models: each field is a flag (`--max-num-seqs`) and a
variable (`TRTSERVE_MAX_NUM_SEQS`), its description the flag's help, its constraints the checks. A
flag given wins over the variable, the variable over the field's default. Command-line parsers are
generated from the fields (`add_flags`), and a bad value, from either side, is one error line naming
the flag or the variable (`load`)."""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Literal

from pydantic import ValidationError, create_model
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, SettingsConfigDict

from trtserve.errors import TrtServeError

PREFIX = "TRTSERVE_"


class Settings(BaseSettings):
    # extra="forbid": a misspelled option passed in code is an error; TRTSERVE_* variables that no field
    # names (TRTSERVE_CACHE, TRTSERVE_DEBUG) are not read by these models at all
    model_config = SettingsConfigDict(env_prefix=PREFIX, frozen=True, extra="forbid", env_ignore_empty=True)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def variable(name: str) -> str:
    return PREFIX + name.upper()


def _base(annotation):
    """int for `int | None`; the annotation itself otherwise."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def add_flags(parser, cls: type[Settings], skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls`. Defaults stay out of the namespace (argparse.SUPPRESS), so that
    `load` can tell a given flag from a variable or a default."""
    for name, field in cls.model_fields.items():
        if name in skip:
            continue
        kind = _base(field.annotation)
        help_text = field.description or ""
        if field.default is not None and kind is not bool:
            help_text += f" (default {field.default})"
        if kind is bool:
            parser.add_argument(flag(name), action="store_true", default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is Literal:
            parser.add_argument(flag(name), choices=typing.get_args(kind), default=argparse.SUPPRESS,
                                help=help_text)
        else:
            parser.add_argument(flag(name), type=kind, default=argparse.SUPPRESS, help=help_text,
                                metavar=_metavar(name, kind))


def _metavar(name: str, kind) -> str:
    if kind is int:
        return "N"
    if kind is float:
        return "MS" if name.endswith("_ms") else "S" if name.endswith("timeout") else "X"
    return name.upper().split("_")[-1]


def given(args: argparse.Namespace | dict, cls: type[Settings]) -> dict:
    """The fields of `cls` that `args` (a parsed namespace) holds."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    return {name: values[name] for name in cls.model_fields if name in values}


def load(cls: type[Settings], args: argparse.Namespace | dict | None = None, **values):
    """`cls` from the flags in `args` (and `values`), the TRTSERVE_* variables and the defaults;
    TrtServeError with one line naming the first bad flag or variable."""
    values = {**(given(args, cls) if args is not None else {}), **values}
    try:
        return cls(**values)
    except ValidationError as exc:
        raise TrtServeError(_one_line(exc.errors()[0], values, cls)) from None


def only(cls: type[Settings], *names: str) -> type[Settings]:
    """A settings model of some of `cls`'s fields (to read one variable without the others)."""
    # a model's own fields always have an annotation: pydantic types it as optional
    return create_model(f"{cls.__name__}Part", __base__=Settings,  # type: ignore[call-overload]
                        **{name: (cls.model_fields[name].annotation, cls.model_fields[name]) for name in names})


def _one_line(error: ErrorDetails, values: dict, cls: type[Settings]) -> str:
    name = str(error["loc"][0]) if error.get("loc") else "?"
    kind, ctx = error["type"], error.get("ctx") or {}
    if name in values:  # a flag (or a value passed in code)
        where, fix = flag(name), ""
    else:
        where, fix = f"{variable(name)}={os.environ.get(variable(name), error.get('input'))!r}", ": fix or unset it"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = next(iter(ctx.values()))
        what: str | None = {"greater_than_equal": "must not be negative" if bound == 0 else f"must be at least {bound}",
                "greater_than": "must be positive" if bound == 0 else f"must be more than {bound}",
                "less_than_equal": f"must be at most {bound}", "less_than": f"must be less than {bound}"}[kind]
        return f"{where} {what}{fix}"
    if name in values:
        return f"{where}: {error['msg']}"
    what = {"int_parsing": "is not an integer", "float_parsing": "is not a number",
            "bool_parsing": "is not true or false"}.get(kind)
    if kind == "literal_error" and name in cls.model_fields:
        what = f"is not one of {', '.join(map(str, typing.get_args(_base(cls.model_fields[name].annotation))))}"
    return f"{where} {what or error['msg']}{fix}"
