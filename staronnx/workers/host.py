"""Moved to :mod:`staronnx.partition.host`; kept while benchmarks/placement.py imports from here."""

from staronnx.partition.host import host_devices, host_transfer

__all__ = ["host_devices", "host_transfer"]
