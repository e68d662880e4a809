"""``staronnx demo``: the main job on the embedded default model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

console = Console(log_path=False)


def demo_cmd(
    workdir: Annotated[
        Optional[Path], typer.Option(help="Folder for the model and plans (default: a temp folder).")
    ] = None,
    batch: Annotated[int, typer.Option(help="Batch size for verification and runs.")] = 8,
    batches: Annotated[int, typer.Option(help="Batches to run for the timing summary.")] = 20,
    groups: Annotated[Optional[str], typer.Option(help="CPU grouping policy for the runtime.")] = None,
) -> None:
    """Build an Inception-style model, partition it 85/15, verify the parts and run them."""
    from staronnx.demo import run_demo, summary_lines

    with console.status("demo") as status:
        result = run_demo(workdir, batch=batch, batches=batches, groups=groups, say=lambda m: (status.update(m), console.log(m, _stack_offset=2)))
    console.rule("staronnx demo")
    for line in summary_lines(result):
        console.print(line, highlight=False)
    if not result.report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
