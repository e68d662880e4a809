"""Which flags the user gave: a flag left at its default and one set to the same value read alike
to a command, but only the second is the user's choice (what a refusal may name)."""

from __future__ import annotations

import typer


def given_on_command_line(ctx: typer.Context) -> set[str]:
    """The parameters of the running command that the user gave (not left at their defaults)."""
    sources = {p.name: ctx.get_parameter_source(p.name) for p in ctx.command.params if p.name}
    return {name for name, source in sources.items() if source is not None and source.name != "DEFAULT"}
