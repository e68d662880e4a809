"""``staronnx demo``: the main job on the embedded default model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from staronnx.fsutil import check_writable

console = Console(log_path=False)


def demo_cmd(
    workdir: Annotated[
        Optional[Path], typer.Option(help="Folder for the model and plans, kept afterwards (default: a "
                                          "temporary folder, removed at the end).")
    ] = None,
    batch: Annotated[int, typer.Option(help="Batch size for verification and runs.")] = 8,
    batches: Annotated[int, typer.Option(help="Batches to run for the timing summary.")] = 20,
    groups: Annotated[Optional[str], typer.Option(help="CPU grouping policy for the runtime.")] = None,
) -> None:
    """Build an Inception-style model, partition it 85/15, verify the parts and run them."""
    from staronnx.demo import run_demo, summary_lines
    from staronnx.errors import StaronnxError

    for flag, value in (("--batch", batch), ("--batches", batches)):
        if value < 1:  # else a division by zero once the model is cut, verified and calibrated
            raise StaronnxError(f"{flag} must be at least 1, got {value}")
    if workdir is not None:
        check_writable(workdir, "--workdir", folder=True)  # now, not after the model is built
        root = workdir
    else:
        root = Path(tempfile.mkdtemp(prefix="staronnx-demo-"))
    try:
        with console.status("demo") as status:
            def say(m: str) -> None:
                status.update(m)
                console.log(m, _stack_offset=2)

            result = run_demo(root, batch=batch, batches=batches, groups=groups, say=say)
        console.rule("staronnx demo")
        for line in summary_lines(result):
            console.print(line, highlight=False)
    finally:
        if workdir is None:  # the model and plans (megabytes) do not outlive the demo
            size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
            shutil.rmtree(root, ignore_errors=True)
            console.print(f"removed the demo's temporary folder {root} ({size / 1e6:.0f} MB); "
                          f"--workdir DIR keeps the model and plans", highlight=False, soft_wrap=True)
    if not result.report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
