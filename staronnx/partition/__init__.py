"""Cutting ONNX models into weighted, acyclic parts (METIS, linear baseline, placement methods)."""

from staronnx.partition.api import METHODS, parse_input_shapes, parse_shares, partition
from staronnx.partition.spec import PartitionSpec

__all__ = ["partition", "PartitionSpec", "METHODS", "parse_shares", "parse_input_shapes"]
