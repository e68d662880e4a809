"""Option help without a type column for flags.

Typer (0.29) shows every option's value type in ``--help``, flags included: ``--plots
--no-plots <bool>`` and even ``--help <bool>``, which reads as if the flag took a value. A flag
takes none, so its type column should be empty, as Click's own help leaves it. Typer shows an
option's ``metavar`` instead of its type when one is set, so giving every flag an empty
metavar fixes the display without touching how anything parses. :class:`PlainFlagsGroup` does
that for every command and sub-group once, when Click looks them up, so command modules need
not remember ``metavar=""`` on each flag.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperGroup


def plain_flags(command: Any, ctx: Any) -> None:
    """Give every flag of ``command`` (its ``--help`` too, and its sub-commands' when it is a
    group) an empty metavar, unless one was chosen on purpose."""
    params = list(getattr(command, "params", ()))
    get_help = getattr(command, "get_help_option", None)
    help_option = get_help(ctx) if get_help is not None else None
    if help_option is not None:
        params.append(help_option)
    for param in params:
        if getattr(param, "is_flag", False) and getattr(param, "metavar", None) is None:
            param.metavar = ""
    for sub in (getattr(command, "commands", None) or {}).values():
        plain_flags(sub, ctx)


class PlainFlagsGroup(TyperGroup):
    """The ``staronnx`` group: its own flags and every command it resolves print no type."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and getattr(param, "metavar", None) is None:
                param.metavar = ""
        return params

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            plain_flags(command, ctx)
        return command
