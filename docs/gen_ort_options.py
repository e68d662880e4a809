"""The ``InferenceSession`` options table, read from the docstring of the module that defines
``staronnx.InferenceSession`` (``staronnx.compat.session``; ``staronnx.runtime.session`` before).

The table lives once, in the code, next to what it describes; this turns its reStructuredText
rows into a Markdown table for the guide *Replace ONNX Runtime's session*, where the marker
``<!-- ort-options-table -->`` stands (``docs/hooks.py`` substitutes it on every build).
"""

from __future__ import annotations

import re

MARKER = "<!-- ort-options-table -->"
#: how each row's second column starts: a line starting so begins a new row
VERDICTS = ("honoured", "said", "refused", "not read back")


def rows() -> list[tuple[str, str]]:
    """(option, what staronnx does) for every row of the docstring's table."""
    import importlib

    import staronnx

    module = importlib.import_module(staronnx.InferenceSession.__module__)
    lines = (module.__doc__ or "").splitlines()
    borders = [i for i, line in enumerate(lines) if re.fullmatch(r"=+\s+=+", line.strip())]
    if len(borders) < 3:
        raise RuntimeError(f"{module.__name__}'s docstring has no options table")
    split = re.match(r"=+\s+", lines[borders[0]]).end()  # type: ignore[union-attr]
    out: list[list[str]] = []
    for line in lines[borders[1] + 1:borders[2]]:
        left, right = line[:split].strip(), line[split:].strip()
        if right.startswith(VERDICTS) or not out:
            out.append([left, right])
        else:
            glue = "" if out[-1][0].endswith("_") else " "  # a name broken at an underscore
            out[-1][0] = f"{out[-1][0]}{glue}{left}".strip()
            out[-1][1] = f"{out[-1][1]} {right}".strip()
    return [(a, b) for a, b in out]


def _md(text: str) -> str:
    text = text.replace("``", "`").replace("|", "\\|")
    return text


def render() -> str:
    """The Markdown table."""
    body = [f"| {_md(a)} | {_md(b)} |" for a, b in rows()]
    return "\n".join(["| ONNX Runtime's option | in staronnx |", "|---|---|", *body])


if __name__ == "__main__":
    print(render())
