"""The documentation site (issue 53): it builds with ``mkdocs build --strict`` (no broken link,
no missing page), its generated references match the code, few of its blocks are skipped, and
every other block runs as written (``tests/test_readme.py`` holds the harness; the pages that
start a server run in ``tests/test_docs_serve.py``, on another xdist worker).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_readme import README, ROOT, check_page, read_blocks

DOCS = ROOT / "docs"
#: how many blocks README and the site may leave unrun, together
SKIP_BUDGET = 8


def pages() -> list[Path]:
    """Every Markdown page of the site (generated pages exist only in the build)."""
    return sorted(p for p in DOCS.rglob("*.md") if "figures" not in p.parts)


def starts_a_server(page: Path) -> bool:
    return "docs-test: background" in page.read_text()


def page_id(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


@pytest.mark.parametrize("page", [p for p in pages() if not starts_a_server(p)], ids=page_id)
def test_page_commands_run_as_written(page, tmp_path):
    failures = check_page(page, tmp_path)
    assert not failures, "\n\n".join(failures)


def test_skips_are_few_and_said():
    skipped = [(b.source, b.line, b.skip) for path in [README, *pages()]
               for b in read_blocks(path.read_text(), source=path.relative_to(ROOT).as_posix()) if b.skip]
    listing = "\n".join(f"{source} line {line}: {why}" for source, line, why in skipped)
    print(listing)
    assert len(skipped) <= SKIP_BUDGET, f"{len(skipped)} skipped blocks (at most {SKIP_BUDGET}):\n{listing}"
    assert all(why != "no reason given" for _, _, why in skipped), listing


# -- the site -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with ``mkdocs build --strict`` (a warning fails it)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_site_builds_strict_with_every_page(site):
    for page in pages():
        rel = page.relative_to(DOCS).with_suffix("")
        html = site / ("index.html" if rel.name == "index" and rel.parent == Path(".") else rel / "index.html")
        if rel.name == "index" and rel.parent != Path("."):
            html = site / rel.parent / "index.html"
        assert html.exists(), f"{page_id(page)} was not built ({html})"
    for generated in ("reference/cli", "benchmarks"):
        assert (site / generated / "index.html").exists(), generated
    for figure in ("plan.png", "perfmodel.png", "gantt.png", "sweep.png"):
        assert (site / "figures" / figure).stat().st_size > 10_000, figure


def command_tree() -> dict[str, list[str]]:
    """``staronnx`` as typer builds it: command path -> the names of its arguments and options
    (walked here, independently of the page's generator)."""
    import typer.main

    from staronnx.cli import app

    out: dict[str, list[str]] = {}

    def walk(command, path: str) -> None:
        names = []
        for param in command.params:
            if param.hidden:
                continue
            if type(param).__name__.endswith("Argument"):
                names.append(param.metavar or param.name.upper())
            else:
                names += [*param.opts, *param.secondary_opts]
        out[path] = sorted([*names, "--help"])
        for name, sub in getattr(command, "commands", {}).items():
            if not sub.hidden:
                walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "staronnx")
    return out


def page_commands(markdown: str) -> dict[str, list[str]]:
    """The CLI reference page read back: each command's heading -> the names in its table."""
    out: dict[str, list[str]] = {}
    current = None
    for line in markdown.splitlines():
        heading = re.match(r"^#+ `(staronnx[^`]*)`", line)
        if heading:
            current = heading.group(1)
            out[current] = []
        elif current and line.startswith("| `") :
            first = line.split(" | ")[0].removeprefix("| ")
            out[current] += re.findall(r"`([^`]+)`", first)
    return {k: sorted(v) for k, v in out.items()}


def test_cli_reference_lists_every_command_and_option(site):
    sys.path.insert(0, str(DOCS))
    try:
        import gen_cli
    finally:
        sys.path.remove(str(DOCS))
    on_page = page_commands(gen_cli.render())
    assert on_page == command_tree()
    built = (site / "reference" / "cli" / "index.html").read_text()
    for path, names in command_tree().items():
        assert f'id="{path.replace(" ", "-")}"' in built, path
        for name in names:
            assert f"<code>{name}</code>" in built or f"<code>{name.replace('<', '&lt;')}</code>" in built, (path, name)


def test_api_reference_covers_all(site):
    import staronnx

    source = (DOCS / "reference" / "api.md").read_text()
    built = (site / "reference" / "api" / "index.html").read_text()
    for name in staronnx.__all__:
        assert re.search(rf"^::: staronnx\.(?:[\w.]+\.)?{name}$", source, re.M), name
        assert re.search(rf'id="staronnx\.(?:[\w.]+\.)?{name}"', built), f"{name} is not rendered in the API reference"
    assert ":func:<code>" not in built and ":class:<code>" not in built


def test_results_page_is_made_from_the_committed_files(tmp_path):
    sys.path.insert(0, str(DOCS))
    try:
        import gen_results
    finally:
        sys.path.remove(str(DOCS))
    assert "No committed results yet" in gen_results.render(tmp_path / "absent")
    results = tmp_path / "results"
    results.mkdir()
    (results / "gpu-h100-2026-12-07.json").write_text(
        '{"date": "2026-12-07", "device": "NVIDIA H100", "rows": [{"batch": 1, "ort4": 1625.5, "staronnx": 1992}]}')
    (results / "serve.csv").write_text("clients,throughput\n16,26.5\n")
    page = gen_results.render(results)
    assert "| date | 2026-12-07 |" in page and "| device | NVIDIA H100 |" in page
    assert "| batch | ort4 | staronnx |" in page and "| 1 | 1,626 | 1992 |" in page
    assert "| clients | throughput |" in page and "| 16 | 26.5 |" in page
