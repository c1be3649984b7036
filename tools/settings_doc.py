"""The configuration reference, generated from the settings classes: `relaygr settings`.

Every setting is a field of a pydantic-settings class read from ``RELAYGR_<FIELD>``; this command
prints them all as the Markdown page ``docs/configuration.md`` (variable, default, accepted values,
meaning), so the page cannot drift from the code: a test compares the committed page with it.

Primitives:
- ``SETTINGS_CLASSES``: the classes documented, each with its section title and source file.
- ``settings_page() -> str``: the whole page.
- ``field_row(name, field) -> str``: one table row; ``default_text`` and ``values_text`` its cells.
- ``add_arguments(parser)`` / ``run(args)``: the command (``--check PAGE`` compares instead of printing).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from relaygr.infra.settings import Settings
from relaygr.streams.config import PipelineSettings

#: (section title, class, source file): the order of the page.
SETTINGS_CLASSES: tuple[tuple[str, type[BaseSettings], str], ...] = (
    ("Deployment, Kafka clients and security", Settings, "infra/settings.py"),
    (
        "The cascade: model, budget, trigger, prefix store, ranking worker",
        PipelineSettings,
        "streams/config.py",
    ),
)

#: Variables read outside the settings classes: by `./dev` and by docker-compose.yml.
OTHER_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("RELAYGR_VENV", "`.venv`", "`./dev`: the virtualenv folder it creates and uses."),
    ("RELAYGR_WHEELS", "`.whl`", "`./dev device-check`: wheels to install from when a package is missing."),
    (
        "RELAYGR_COMPOSE_BOOTSTRAP",
        "`kafka:9092`",
        "`docker compose`: the brokers the cascade's services use (the `cluster` profile's three nodes).",
    ),
)

HEADER = """# Configuration

This page is for looking up any setting: each is an environment variable with the `RELAYGR_`
prefix, read by every stage, tool and command (pydantic-settings; case-insensitive). It is
generated from the settings classes by `relaygr settings > docs/configuration.md`, and a test
checks that this page equals what that command prints: change a setting in its class, not here.
`relaygr up`, the demo and the experiments hand the settings they choose to the processes they
start; a variable set in the environment applies to everything else.
"""


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (annotation, False)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _bounds(field: FieldInfo) -> str:
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    parts = []
    for meta in field.metadata:
        for attr, sign in signs.items():
            value = getattr(meta, attr, None)  # pydantic keeps Field(ge=...) as annotated_types metadata
            if value is not None:
                parts.append(f"{sign} {value:g}")
    return ", ".join(parts)


def values_text(field: FieldInfo) -> str:
    """What the variable accepts: the choices of a Literal, else the type and its bounds."""
    annotation, optional = _unwrap_optional(field.annotation)
    if typing.get_origin(annotation) is Literal:
        text = " | ".join(f"`{choice}`" for choice in typing.get_args(annotation))
    else:
        names = {bool: "true/false", int: "integer", float: "number", str: "text", Path: "path"}
        text = names.get(annotation, getattr(annotation, "__name__", str(annotation)))
        if annotation.__name__ == "SecretStr":
            text = "text (secret: printed as `**********`)"
        bounds = _bounds(field)
        text = f"{text} {bounds}" if bounds else text
    return f"{text}, or unset" if optional else text


def default_text(field: FieldInfo) -> str:
    """The default as a reader needs it: a factory's rule (its docstring), never this machine's path."""
    if field.default_factory is not None:
        rule = (field.default_factory.__doc__ or "").strip().splitlines()
        return rule[0] if rule else "computed at start"
    value = field.default
    if value is None:
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    # A table cell: one line, its pipes escaped, and <prefix> shown rather than read as HTML.
    return " ".join(text.split()).replace("|", "\\|").replace("<", "\\<")


def field_row(name: str, field: FieldInfo) -> str:
    variable = f"`RELAYGR_{name.upper()}`"
    cells = [variable, default_text(field), values_text(field), field.description or ""]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def settings_page() -> str:
    lines = [HEADER]
    for title, cls, source in SETTINGS_CLASSES:
        lines += [f"## {title}", "", f"`{cls.__name__}` in `{source}`.", ""]
        lines += ["| variable | default | values | meaning |", "|---|---|---|---|"]
        lines += [field_row(name, field) for name, field in cls.model_fields.items()]
        lines.append("")
    lines += ["## Outside the settings classes", "", "| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {default} | {meaning} |" for name, default, meaning in OTHER_VARIABLES]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (__doc__ or "").strip().split("\n\nPrimitives")[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--check",
        type=Path,
        metavar="PAGE",
        help="compare PAGE (e.g. docs/configuration.md) with the generated page instead of printing "
        "it; exit 1 if they differ",
    )


def run(args: argparse.Namespace) -> int:
    page = settings_page()
    if args.check is None:
        sys.stdout.write(page)
        return 0
    try:
        committed = args.check.read_text()
    except OSError as e:
        print(f"relaygr settings: cannot read {args.check}: {e.strerror}", file=sys.stderr)
        return 2
    if committed != page:
        print(
            f"{args.check} differs from the settings: regenerate it with `relaygr settings`", file=sys.stderr
        )
        return 1
    print(f"{args.check} matches the settings")
    return 0
