"""``staronnx infer``: a dataset in, its outputs out (offline batch inference)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from staronnx.cli.display import QUIET_HELP, _progress, output_console
from staronnx.cli.gpus import CUDA_DEVICES_HELP, THREAD_PER_STREAM_HELP, check_cuda_worker_flags, parse_cuda_devices
from staronnx.signals import Interrupted

console = output_console()


class _Rate(ProgressColumn):
    """Samples per second over the bar's recent window (rich's own speed estimate)."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.0f} samples/s")


def _bar(quiet: bool) -> Progress:
    return _progress(quiet, TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), _Rate(),
                     TextColumn("ETA"), TimeRemainingColumn())


def infer_cmd(
    model: Annotated[Path, typer.Argument(help="An ONNX model file (run whole on every worker) or a plan folder.")],
    inputs: Annotated[Path, typer.Option(
        "--inputs", "-i",
        help="The dataset: an .npz keyed by input name (samples along each input's batch axis, as run "
             "--inputs), a folder of .npz shards (or .npy shards for a one-input model), or a Parquet/Arrow "
             "file or folder with a column per input.")],
    output: Annotated[Path, typer.Option(
        "--output", "-o",
        help="Where the outputs go: a folder of shards (Parquet by default), or one .parquet or .npz file. "
             "One row per sample, its row id in row_id.")],
    batch_size: Annotated[Optional[int], typer.Option(
        help="Samples per batch. Default: measured for throughput on the dataset's first rows.")] = None,
    max_in_flight: Annotated[Optional[int], typer.Option(
        help="Batches queued on the workers at once. Default: two per worker.")] = None,
    shard_rows: Annotated[int, typer.Option(
        help="Rows per output shard: the unit written at once and skipped by --resume.")] = 4096,
    output_format: Annotated[Optional[str], typer.Option(
        "--format", help="parquet or npz. Default: from --output's suffix, Parquet for a folder.")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue the job that wrote --output: its finished shards are kept and their "
                         "rows not run again.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace what an earlier job wrote to --output.")] = False,
    on_error: Annotated[str, typer.Option(
        help="A row that cannot run (wrong shape or dtype, a null, a model error): fail stops the job naming "
             "its row id; skip writes the others and lists it beside its shard.")] = "fail",
    policy: Annotated[str, typer.Option(help="Scheduling policy (heft, dmda, eager, ...).")] = "heft",
    groups: Annotated[str, typer.Option(
        help="CPU groups: auto (a worker per core where their sessions fit in half the available memory, "
             "wider groups where not; one per NUMA node beside CUDA workers), numa, package, cores=N, a PU "
             "list such as 0-3;4-7, or none (CUDA workers only).")] = "auto",
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers per GPU.")] = 0,
    cuda_devices: Annotated[Optional[str], typer.Option(help=CUDA_DEVICES_HELP)] = None,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs/--no-cuda-graphs", help="Capture each batch size as a CUDA graph and replay it.")] = True,
    thread_per_stream: Annotated[bool, typer.Option("--cuda-thread-per-stream", help=THREAD_PER_STREAM_HELP)] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
) -> None:
    """Run every sample of a dataset through a model and write its outputs, in order: streaming
    with bounded memory, every worker of the machine busy, a progress bar with samples/s and
    ETA. Stopped (Ctrl-C, SIGTERM, a crash), it resumes with --resume: no sample lost or
    written twice. Bad rows are reported by row id (--on-error)."""
    # Before pyarrow loads: Arrow's default pool (jemalloc) keeps the pages of every Parquet row
    # group it encoded, which grew a job's peak RSS by 15-20 MiB whatever its window (crnn_ocr:
    # +19 MiB over 20 row groups, against +1 MiB from the C allocator). This process only writes
    # a stream of row groups, where jemalloc's speed buys nothing; a user's own setting stands.
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    from staronnx.infer import InferSpec, infer
    from staronnx.ortutil import quiet_ort_log
    from staronnx.workers.layout import MachineSpec

    spec = InferSpec(batch_size=batch_size, max_in_flight=max_in_flight, shard_rows=shard_rows, on_error=on_error,
                     resume=resume, overwrite=overwrite, output_format=output_format, policy=policy)
    machine = MachineSpec(groups, cuda_streams, parse_cuda_devices(cuda_devices, cuda_streams), cuda_graphs,
                          thread_per_stream)
    check_cuda_worker_flags(cuda_streams, cuda_graphs=cuda_graphs, thread_per_stream=thread_per_stream)
    quiet_ort_log()
    with _bar(quiet) as bar:
        task = bar.add_task("samples", total=None)

        def progress(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        try:
            report = infer(model, inputs, output, spec, machine, progress=progress)
        except Interrupted:
            print(f"staronnx: the finished shards of {output} are kept; the same command with --resume "
                  "continues from the first unfinished one", file=sys.stderr)
            raise
    if report.choice is not None:
        console.print(report.choice.describe(), highlight=False, soft_wrap=True)
    resumed = f" ({report.resumed_rows} written before, kept)" if report.resumed_rows else ""
    skipped = report.skipped
    if report.resumed_rows and report.total_rows is not None and report.resumed_rows >= report.total_rows:
        console.print(f"all {report.total_rows} rows of {report.output} were written before; nothing left to run",
                      highlight=False, soft_wrap=True)
    else:
        console.print(
            f"{report.written} samples written to {report.output} in {report.elapsed_s:.2f} s "
            f"({report.samples_per_s:,.1f} samples/s, batch {report.batch_size}, {report.max_in_flight} in flight "
            f"on {report.workers} worker{'s' if report.workers != 1 else ''}, groups {report.groups})"
            f"{resumed}", highlight=False, soft_wrap=True)
    if skipped:
        ids = ", ".join(str(e["row_id"]) for e in skipped[:10]) + (", ..." if len(skipped) > 10 else "")
        console.print(f"{len(skipped)} row(s) skipped (row ids {ids}); the first: {skipped[0]['error']}; "
                      f"every one is listed in {report.errors_file}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("infer")(infer_cmd)
