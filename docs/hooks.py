"""mkdocs hooks: the pages generated from the code and the committed results, and the figures.

* ``reference/cli.md`` from the typer app (:mod:`gen_cli`) and ``benchmarks.md`` from
  ``benchmarks/results/`` (:mod:`gen_results`) are added to the build as generated files, on
  every build, so they can never lag the code; nothing is written into ``docs/``.
* the ``InferenceSession`` options table (:mod:`gen_ort_options`) and what each ``config.pbtxt``
  field does (:mod:`gen_model_config`), read from the code, replace their markers in the guides.
* the figures under ``docs/figures/`` come from a small real run (:mod:`gen_figures`); ``make
  docs`` remakes them every time, and a build that finds one missing (a fresh clone, a plain
  ``mkdocs build``) makes them first.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gen_cli  # noqa: E402
import gen_figures  # noqa: E402
import gen_model_config  # noqa: E402
import gen_ort_options  # noqa: E402
import gen_gpu_table  # noqa: E402
import gen_results  # noqa: E402


def on_pre_build(config: Any) -> None:
    """Make the figures when one is missing (a run of about a minute)."""
    if not all((gen_figures.OUT / name).exists() for name in gen_figures.FIGURES):
        subprocess.run([sys.executable, str(HERE / "gen_figures.py"), "--if-missing"], check=True)


def on_files(files: Files, config: Any) -> Files:
    """Add the generated pages, and the figures made after mkdocs listed docs/."""
    for page, render in ((gen_cli.PAGE, gen_cli.render), (gen_results.PAGE, gen_results.render)):
        old = files.get_file_from_path(page)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, page, content=render()))
    for name in gen_figures.FIGURES:
        path = f"figures/{name}"
        if files.get_file_from_path(path) is None and (gen_figures.OUT / name).exists():
            files.append(File(path, config["docs_dir"], config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Put the tables read from the code (``InferenceSession``'s options, what each
    ``config.pbtxt`` field does) where their markers stand."""
    for module in (gen_ort_options, gen_model_config, gen_gpu_table):
        if module.MARKER in markdown:
            markdown = markdown.replace(module.MARKER, module.render())
    return markdown


#: a Sphinx role left in front of inline code by a docstring (``:func:`x```), as mkdocstrings
#: renders it: ``:func:<code>x</code>``
_ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc|obj):(<code>)~?")


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """The API reference reads without the Sphinx roles its docstrings use for their own tools."""
    return _ROLE.sub(r"\1", html)
