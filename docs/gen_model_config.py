"""What each ``config.pbtxt`` field does in staronnx, read from :mod:`staronnx.serve.model_config`.

The module that parses a Triton model configuration says in its docstring which fields it
honours (and what each sets) and which it refuses; its :data:`PARAMETERS` list staronnx's own
settings. This turns both into Markdown for the guide *Move from Triton*, where the marker
``<!-- model-config-fields -->`` stands (``docs/hooks.py`` substitutes it on every build), so the
page says what the code does, field by field, as the code changes.
"""

from __future__ import annotations

import re

MARKER = "<!-- model-config-fields -->"
#: where the docstring's field list starts
START = "What is honoured, and what it sets:"


def _markdown(rst: str) -> str:
    """The docstring's reStructuredText inline markup as Markdown."""
    rst = re.sub(r":(?:func|class|mod|meth|data|attr|exc|obj):`~?([^`]+)`", r"`\1`", rst)
    return rst.replace("``", "`")


def render() -> str:
    """The honoured fields, the refused ones, and the ``parameters`` table."""
    from staronnx.serve import model_config

    doc = model_config.__doc__ or ""
    if START not in doc:
        raise RuntimeError(f"staronnx.serve.model_config's docstring no longer says {START!r}")
    fields = _markdown(doc[doc.index(START) + len(START):].strip()).replace("(`PARAMETERS`)", "(the table below)")
    params = "\n".join(f"| `{name}` | {_markdown(what)} |" for name, what in model_config.PARAMETERS.items())
    return (f"Honoured, and what each sets:\n\n{fields}\n\n"
            f"staronnx's own settings, as `parameters {{ key: ... value: {{ string_value: ... }} }}`:\n\n"
            f"| parameter | what it sets |\n|---|---|\n{params}\n")


if __name__ == "__main__":
    print(render())
