"""Placeholder, filled in below."""

import typer


def register(app: typer.Typer) -> None:
    pass
