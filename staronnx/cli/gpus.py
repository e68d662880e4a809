"""``--cuda-devices``: which GPUs the CUDA workers drive, one spelling for every command."""

from __future__ import annotations

from staronnx.errors import StaronnxError

THREAD_PER_STREAM_HELP = ("With --cuda-streams: a driver thread (and a core held back) per stream instead of one "
                          "per GPU (StarPU's STARPU_CUDA_THREAD_PER_WORKER). Without CUDA graphs ONNX Runtime "
                          "launches every kernel from the thread that runs the task, so one driver serialises the "
                          "streams' launches: on an H200, googlenet without graphs read 648 samples/s at batch 1 "
                          "on 4 streams, 4 plain ORT threads 1,625.")
CUDA_DEVICES_HELP = ("GPUs the CUDA workers drive, --cuda-streams workers on each: CUDA ordinals like 0 or "
                     "0,1 or 0-3, or all (every visible GPU). Default: 0.")


def parse_cuda_devices(text: str | None, cuda_streams: int, *, simulated: bool = False) -> tuple[int, ...]:
    """The GPUs ``--cuda-devices`` names (``(0,)`` when not given), or one line saying why not.

    Checked here, before any worker starts: a GPU that does not exist fails each CUDA worker of
    it at start otherwise, after the CPU workers loaded the model. ``simulated``: the GPUs of a
    simulated machine (``staronnx simulate``), which may be more than this one has.
    """
    if text is None:
        return (0,)
    if not cuda_streams:
        raise StaronnxError("--cuda-devices picks the GPUs of the CUDA workers: it needs --cuda-streams N")
    from staronnx.workers.cuda_env import visible_cuda_devices
    from staronnx.workers.layout import cuda_ordinals

    visible = visible_cuda_devices()
    if text.strip().lower() == "all":
        if not visible:
            raise StaronnxError("--cuda-devices all: no GPU is visible here (see `staronnx topology`)")
        return tuple(range(visible))
    devices: list[int] = []
    try:
        for item in (t.strip() for t in text.split(",") if t.strip()):
            first, dash, last = item.partition("-")
            devices.extend(range(int(first), int(last) + 1) if dash else [int(first)])
    except ValueError:
        devices = []
    ordinals = cuda_ordinals(devices)  # the Runtime's own rule
    if ordinals is None:
        raise StaronnxError(f"--cuda-devices takes CUDA ordinals, each once, like 0,1 or 0-3 or all; got {text!r}")
    missing = [d for d in ordinals if d >= visible]
    if missing and not simulated:
        raise StaronnxError(f"--cuda-devices {text}: no GPU {', '.join(map(str, missing))} here ({visible} visible"
                            + (f": 0..{visible - 1})" if visible else ")"))
    return ordinals


def check_cuda_worker_flags(cuda_streams: int, *, cuda_graphs: bool = True, thread_per_stream: bool = False) -> None:
    """Refuse ``--no-cuda-graphs`` and ``--cuda-thread-per-stream`` without ``--cuda-streams``:
    they say how the CUDA workers run, there are none, and the flag was dropped without a word
    (as ``--cuda-devices`` is refused, by :func:`parse_cuda_devices`)."""
    given = [flag for flag, on in (("--no-cuda-graphs", not cuda_graphs),
                                   ("--cuda-thread-per-stream", thread_per_stream)) if on]
    if given and not cuda_streams:
        raise StaronnxError(f"{' and '.join(given)} {'sets' if len(given) == 1 else 'set'} how the CUDA workers run: "
                            f"{'it needs' if len(given) == 1 else 'they need'} --cuda-streams N")


def host_core_name(cuda_streams: int) -> str:
    """The core ``--colocate`` joins, as a command says it: a CUDA driver thread's, or without
    CUDA workers the first CPU worker's (see :mod:`staronnx.workers.colocate`)."""
    return "CUDA driver's core" if cuda_streams else "first CPU worker's core"


def cuda_summary(cuda_streams: int, devices: tuple[int, ...]) -> str:
    """What a command's opening line says of its CUDA workers: ``, 2 CUDA stream(s)``, and on
    which GPUs when not GPU 0 alone (``, 2 CUDA stream(s) on each of GPUs 0,1``)."""
    if not cuda_streams:
        return ""
    if tuple(devices) == (0,):
        return f", {cuda_streams} CUDA stream(s)"
    where = f"GPU {devices[0]}" if len(devices) == 1 else f"each of GPUs {','.join(map(str, devices))}"
    return f", {cuda_streams} CUDA stream(s) on {where}"
