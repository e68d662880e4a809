"""ModelInfer's answer written onto the wire by :mod:`staronnx.serve.grpc_wire` reads back, with
protobuf's own parser (the one tritonclient uses), as the message protobuf would have written:
outputs of every size (lengths written in one to four varint bytes), an empty entry for an output
in shared memory, response parameters, and the same answer inside a stream response."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _check(call: str) -> None:
    """Run ``_grpc_wire_checks.<call>`` in a fresh interpreter (see that module's docstring)."""
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import _grpc_wire_checks as c; c.{call}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("rows", [0, 1, 31, 32, 4096, 300_000])
def test_answer_reads_back_as_protobufs_message(rows: int) -> None:
    _check(f"answer_reads_back_as_protobufs_message({rows})")


def test_stream_error_is_written_as_it_is() -> None:
    _check("stream_error_is_written_as_it_is()")
