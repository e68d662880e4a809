"""Errors a user can act on.

Every failure that stems from what the user gave us (a file, a shape, a share, a flag) is a
:class:`StaronnxError`. The CLI turns these into one line naming the cause and exit code 2, so
scripts can tell "you asked for something impossible" from "staronnx crashed".
"""

from __future__ import annotations


class StaronnxError(Exception):
    """Base of all errors caused by user input or environment, never by a staronnx bug."""

    exit_code: int = 2

    def __init__(self, message: str = "", *, cli: str | None = None) -> None:
        """``message`` speaks the Python API (``force=True``); ``cli``, when the cause is an
        argument, says the same with the command line's option (``--force``), for the CLI."""
        super().__init__(message)
        self.cli_message = cli

    def for_cli(self) -> str:
        """The message as the command line should print it."""
        return self.cli_message if self.cli_message is not None else str(self)


class ModelError(StaronnxError, ValueError):
    """The ONNX model cannot be read, is not ONNX, or cannot be used as given."""


class PartitionError(StaronnxError, ValueError):
    """The partition request is impossible (bad shares, too many parts, ...)."""


class PlanError(StaronnxError, ValueError):
    """A plan folder is missing, incomplete, or does not match what it claims."""


class PartFileError(PlanError):
    """A part's ONNX file in a plan is missing, truncated or no longer what ``plan.json`` lists.

    One class for every command, so a damaged plan gets one answer (partition again) wherever
    it is first read.
    """


class InputError(StaronnxError, ValueError):
    """A feed does not match a signature: wrong name, dtype, rank or fixed dimension."""


class DeviceError(StaronnxError, RuntimeError):
    """A requested device or execution provider is not available on this machine."""
