"""Moved to :mod:`staronnx.partition.api` (``partition``) and :mod:`staronnx.partition.host`;
kept while runtime/session.py, cli/partition_cmds.py and benchmarks/placement.py import from here."""

from staronnx.partition.api import partition
from staronnx.partition.host import cpu_group_sizes, host_devices, host_transfer

__all__ = ["partition", "cpu_group_sizes", "host_devices", "host_transfer"]
