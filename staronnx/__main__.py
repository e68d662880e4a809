"""``python -m staronnx`` runs the CLI."""

from staronnx.cli import main

main()
