"""Cutting ONNX models into weighted, acyclic parts (METIS, linear baseline, placement methods)."""

from staronnx.partition.api import METHODS, parse_input_shapes, parse_shares, partition

__all__ = ["partition", "METHODS", "parse_shares", "parse_input_shapes"]
