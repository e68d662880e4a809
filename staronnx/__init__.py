"""staronnx: run ONNX models on every processor of a server at once."""

__version__ = "0.1.0"
