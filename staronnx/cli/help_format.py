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

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from typer.core import TyperGroup, TyperOption

if TYPE_CHECKING:  # the types Typer's classes declare: its vendored Click's, not the ``click`` package's
    from typer._click.core import Command, Context, Parameter


def _untyped(params: Iterable[Any]) -> None:
    """An empty metavar for every flag among ``params`` that has none chosen on purpose."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""


def plain_flags(command: Command, ctx: Context) -> None:
    """Give every flag of ``command`` (its ``--help`` too, and its sub-commands' when it is a
    group) an empty metavar, unless one was chosen on purpose."""
    help_option = command.get_help_option(ctx)
    _untyped([*command.params, *([help_option] if help_option is not None else [])])
    for sub in command.commands.values() if isinstance(command, TyperGroup) else ():
        plain_flags(sub, ctx)


class PlainFlagsGroup(TyperGroup):
    """The ``staronnx`` group: its own flags and every command it resolves print no type
    (Typer's vendored Click: its classes are Typer's, not the ``click`` package's)."""

    def get_params(self, ctx: Context) -> list[Parameter]:
        params = super().get_params(ctx)
        _untyped(params)
        return params

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            plain_flags(command, ctx)
        return command
