"""The CLI reference page, generated from the typer app (never written by hand).

``render()`` walks the Click command tree that typer builds from :data:`staronnx.cli.app` and
writes one section per command: its help, its usage line, and a table of every argument and
option with its value, default and help text. ``docs/hooks.py`` calls it on every
``mkdocs build``, so the page always matches the installed code; ``python docs/gen_cli.py``
prints it. ``tests/test_docs.py`` checks the page against the app command by command.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

#: the site path of the generated page
PAGE = "reference/cli.md"


def command_tree() -> Any:
    """The root Click group of the ``staronnx`` command (typer's vendored Click objects)."""
    import typer.main

    from staronnx.cli import app

    return typer.main.get_command(app)


def walk(command: Any, path: tuple[str, ...] = ("staronnx",)) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every (path, command) of the tree, groups before their commands, in registration order."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            yield from walk(sub, (*path, name))


def params(command: Any) -> list[Any]:
    """The arguments and options a user can give ``command`` (hidden ones left out), ``--help``
    last, as ``--help`` prints them."""
    out = [p for p in command.params if not getattr(p, "hidden", False)]
    return out + [{"opts": ["--help"], "help": "Show the command's help and exit."}]


def option_names(param: Any) -> list[str]:
    """How ``param`` is written on the command line: ``--plots``, ``--no-plots``, ``-o``, or an
    argument's metavar (``PLANDIR...``)."""
    if isinstance(param, dict):
        return list(param["opts"])
    if type(param).__name__.endswith("Argument"):
        return [param.metavar or param.name.upper()]
    return [*param.opts, *param.secondary_opts]


def _cell(text: str) -> str:
    """Plain help text made safe for one Markdown table cell."""
    text = re.sub(r":(?:func|class|meth|data|mod|attr):`~?([^`]+)`", r"`\1`", text)
    text = html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")
    return text


def _type_name(annotation: Any) -> str:
    """A value type as ``--help`` would name it: ``TEXT``, ``PATH``, ``cpu|cuda`` for choices."""
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if origin in (list, tuple) and args:
        return _type_name(args[0]) + " (repeatable)"
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    name = getattr(annotation, "__name__", None) or str(annotation)
    return {"Path": "PATH", "str": "TEXT", "int": "INTEGER", "float": "FLOAT", "bool": "BOOLEAN"}.get(name, name.upper())


def _value(param: Any) -> str:
    """What the option takes: nothing for a flag, else its metavar or type."""
    if isinstance(param, dict) or getattr(param, "is_flag", False):
        return ""
    if param.metavar and type(param).__name__.endswith("Option"):
        return f"`{param.metavar}`"
    return f"`{html.escape(_type_name(getattr(param.type_descriptor, 'annotation', str)))}`"


def _default(param: Any) -> str:
    """The default a user gets by leaving the option out ('' when there is none to show)."""
    if isinstance(param, dict) or getattr(param, "required", False):
        return "required" if getattr(param, "required", False) else ""
    default = param.default
    if default is None or default == [] or default == ():
        return ""
    if getattr(param, "is_flag", False):
        names = option_names(param)
        return f"`{names[0] if default else names[-1]}`" if len(names) > 1 else ("on" if default else "")
    return f"`{default}`"


def usage(path: tuple[str, ...], command: Any) -> str:
    """A usage line: the command, ``[OPTIONS]``, its arguments (and ``COMMAND`` for a group)."""
    args = [p.metavar or p.name.upper() for p in command.params
            if type(p).__name__.endswith("Argument") and not p.hidden]
    tail = ["COMMAND [ARGS]..."] if getattr(command, "commands", None) else []
    return " ".join([*path, "[OPTIONS]", *args, *tail])


def render() -> str:
    """The whole page, Markdown."""
    root = command_tree()
    lines = ["# CLI reference", "",
             "Generated from the `staronnx` command itself (`docs/gen_cli.py` walks the typer app on every "
             "documentation build), so it lists every command and option of the installed version. "
             "`staronnx COMMAND --help` prints the same.", ""]
    entries = list(walk(root))
    lines += ["| command | what it does |", "|---|---|"]
    for path, command in entries[1:]:
        anchor = "-".join(path)
        summary = _cell((command.help or "").strip().split("\n\n")[0])
        lines.append(f"| [`{' '.join(path[1:])}`](#{anchor}) | {summary} |")
    lines.append("")
    for path, command in entries:
        depth = min(len(path), 3)
        anchor = "-".join(path)
        lines += [f"{'#' * (depth + 1)} `{' '.join(path)}` {{#{anchor}}}", ""]
        if command.help:
            lines += [_cell(part) + "\n" for part in command.help.strip().split("\n\n")]
        lines += ["```text", usage(path, command), "```", ""]
        rows = params(command)
        lines += ["| option | value | default | what it does |", "|---|---|---|---|"]
        for param in rows:
            names = ", ".join(f"`{n}`" for n in option_names(param))
            help_text = param["help"] if isinstance(param, dict) else (param.help or "")
            lines.append(f"| {names} | {_value(param)} | {_default(param)} | {_cell(help_text)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
