"""Flags, environment variables and docs generated from settings dataclasses.

A setting is a dataclass field made with `setting(default, help)`. From it:

    flag         --session-ttl-s                (argparse, typed from the annotation)
    environment  SPECMESH_SESSION_TTL_S          (or the field's explicit `env`)
    precedence   flag > environment > default

so a setting is written once, in specmesh/config.py. `python -m tools.settings_doc`
writes the README table and the Helm values schema from the same fields, and a
test fails when they drift.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, Mapping

ENV_PREFIX = "SPECMESH_"


def setting(default: Any, help: str, *, env: str | None = None, choices: tuple | None = None) -> Any:
    """A settings field: its default and why (shown by --help and in the docs), and its allowed values."""
    return dataclasses.field(default=default, metadata={"help": help, "env": env, "choices": choices})


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    type: type                 # int, float, str, bool or tuple (of str)
    optional: bool             # None is allowed (and means "unset")
    default: Any
    help: str
    env: str | None            # None: no environment variable (command options)
    choices: tuple | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, text: str) -> Any:
        """A flag's or variable's text as this setting's type; ValueError names the setting."""
        try:
            if self.type is tuple:
                return tuple(part.strip() for part in text.split(",") if part.strip())
            if self.type is bool:
                lowered = text.strip().lower()
                if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ValueError(text)
                return lowered in ("1", "true", "yes", "on")
            value = self.type(text)
        except ValueError:
            raise ValueError(f"{self.flag} / {self.env or '-'}: expected {self.type.__name__}, got {text!r}") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.flag} / {self.env or '-'}: must be one of {', '.join(self.choices)}, got {text!r}")
        return value


def settings_of(cls, env_prefix: str | None = ENV_PREFIX) -> list[Setting]:
    """The settings of a dataclass, with types resolved from its annotations."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        base, optional = _unwrap(hints[f.name])
        env = f.metadata.get("env") or (env_prefix + f.name.upper() if env_prefix else None)
        out.append(Setting(f.name, base, optional, f.default, f.metadata.get("help", ""), env,
                           f.metadata.get("choices")))
    return out


def _unwrap(hint) -> tuple[type, bool]:
    """`int | None` -> (int, True); `tuple[str, ...]` -> (tuple, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, f"a setting is one type or that type | None, not {hint}"
        return _unwrap(inner[0])[0], True
    if typing.get_origin(hint) is tuple:
        return tuple, False
    assert hint in (int, float, str, bool), f"unsupported setting type {hint}"
    return hint, False


def add_flags(parser: argparse.ArgumentParser, cls, env_prefix: str | None = ENV_PREFIX) -> None:
    """One flag per field. Flags default to None, so an unset flag falls through to the environment."""
    for s in settings_of(cls, env_prefix):
        shown = ",".join(s.default) if s.type is tuple else s.default
        where = f"[{s.env}] " if s.env else ""
        if s.type is bool:
            parser.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{s.help} {where}(default: {shown})")
        else:
            parser.add_argument(s.flag, dest=s.name, type=_flag_type(s), default=None, metavar=s.type.__name__.upper(),
                                help=f"{s.help} {where}(default: {shown})")


def _flag_type(s: Setting):
    def convert(text: str):
        try:
            return s.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = s.type.__name__   # argparse names the type in its error message
    return convert


def build(cls, flags: Mapping[str, Any] | argparse.Namespace | None = None, environ: Mapping[str, str] = os.environ,
          env_prefix: str | None = ENV_PREFIX):
    """`cls` from its defaults, then the environment, then flags that were given (not None)."""
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    values = {}
    for s in settings_of(cls, env_prefix):
        if given.get(s.name) is not None:
            values[s.name] = s.parse(given[s.name]) if isinstance(given[s.name], str) else given[s.name]
        elif s.env and environ.get(s.env):
            values[s.name] = s.parse(environ[s.env])
    return cls(**values)
