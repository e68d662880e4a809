"""Every command of README.md and of the documentation site runs as written, on tiny models,
on the CPU (issues 12 and 53). This module holds the harness and the README's test;
``tests/test_docs.py`` runs the site's pages with it.

How a page is run:

* each ```bash block is one bash script (``set -eo pipefail``) and each ```python block one
  Python script, in page order, all in one scratch folder with a private ``$STARONNX_HOME``
  (one folder per page), so a block finds the plan an earlier block wrote, as a reader would;
  the repository's ``models/`` is linked into that folder;
* a marker on the line before a block's fence (an HTML comment, invisible on the site and on
  GitHub) says how to run it: ``<!-- docs-test: skip (reason) -->`` does not run it (a GPU, a Ray
  cluster or a download: :func:`test_skips_are_few_and_said` in test_docs counts them);
  ``<!-- docs-test: background (ready: URL) -->`` starts it in the background (a server), waits
  until URL answers 200, and stops it with SIGTERM after the page's last block, where it must
  exit 0 (the drain). A block whose first line is ``# readme-test: skip (reason)`` is skipped too;
* ``<!-- docs-test: env NAME=VALUE (reason) -->`` on a line of its own sets a variable for
  every block of the page (the GPU guide runs its CUDA workers on the CPU stand-in this way).

What CI changes, all of it listed here so that the pages read as users need them:

* :data:`MODELS`: the model files the pages name are built tiny, with the inputs their
  commands and Python use (``input`` [batch, 3, 224, 224]; ``input_ids`` [batch, seq]);
* :data:`COMMANDS`: whole lines run differently (``make demo`` is ``staronnx demo`` with this
  venv; ``. .venv/bin/activate`` is a no-op because this venv's ``bin/`` leads ``PATH``);
* :data:`SHORTER`: option values per ``staronnx`` subcommand (fewer rates and batch sizes,
  shorter durations), replaced where the page gives them (unless given per model, ``a=...``),
  added where it does not;
* :data:`FLAGS`: flags per subcommand, added where the line gives neither them nor their
  opposite (``calibrate --no-host``: the host probe's seconds of serving, not what a page shows);
* the ports 8000, 8001 and 8002, and 8010-8012 for a page's second server (after
  ``localhost:``, ``127.0.0.1:`` or ``-port``) become free ports, per page.

A failing command fails the test with its page and line number, the command as run, its exit
code and the tail of its output. No command may print a traceback, nor the warning that a
command has no calibrated model for its workers (the page's commands must agree).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx.zoo import inception, transformer_block

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP_MARK = re.compile(r"^#\s*readme-test:\s*skip\b\s*(.*)$")
#: ``<!-- docs-test: KIND REST -->``: a marker on the line before a fence, or an ``env`` line
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*([a-z-]+)\b\s*(.*?)\s*-->\s*$")
#: seconds one block may take before it counts as failed
BLOCK_TIMEOUT = 300
#: seconds a background block (a server) may take to answer its ready URL
READY_TIMEOUT = 180
#: seconds a background block may take to exit after SIGTERM (the server's drain)
STOP_TIMEOUT = 60


# -- the tiny stand-ins for the README's models ----------------------------------------------
def image_model() -> onnx.ModelProto:
    """``model.onnx``: an ImageNet-shaped input (``input`` [batch, 3, 224, 224], as the README's
    Python feeds it), pooled 8x down at once, then a 2-block Inception-style net at 28x28."""
    model = inception(blocks=2, channels=8, size=28)
    graph = model.graph
    inner = graph.input[0].name
    graph.node.insert(0, helper.make_node("MaxPool", ["input"], [inner], name="downsample_input",
                                          kernel_shape=[8, 8], strides=[8, 8]))
    del graph.input[:]
    graph.input.append(helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224]))
    onnx.checker.check_model(model)
    return model


def token_model() -> onnx.ModelProto:
    """``bert.onnx``: token ids ``input_ids`` [batch, seq] (int64, both dims dynamic) into a
    16-wide embedding, then one transformer encoder block."""
    import numpy as np

    model = transformer_block(d_model=16, heads=2, ff=32)
    graph = model.graph
    inner = graph.input[0].name
    table = np.random.default_rng(0).standard_normal((100, 16)).astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(table, "token_embedding"))
    graph.node.insert(0, helper.make_node("Gather", ["token_embedding", "input_ids"], [inner],
                                          name="embed_tokens", axis=0))
    del graph.input[:]
    graph.input.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]))
    onnx.checker.check_model(model)
    return model


#: README file name -> the tiny model CI writes under that name
MODELS: dict[str, Callable[[], onnx.ModelProto]] = {"model.onnx": image_model, "bert.onnx": token_model}

#: README line (a regex on the whole stripped line) -> what CI runs instead, with why
COMMANDS: dict[str, str] = {
    # the Makefile target builds .venv, then runs `.venv/bin/staronnx demo`: the venv is ours
    r"make demo\b.*": "staronnx demo --batches 4",
    # it runs the suite this test belongs to
    r"make test\b.*": "true  # make test runs the suite this test belongs to",
    r"\. \.venv/bin/activate\b.*": "true  # this venv's bin/ is first on PATH already",
}

#: staronnx subcommand -> {option: CI's value}: replaced where given, added where not
SHORTER: dict[str, dict[str, str]] = {
    "demo": {"--batches": "4"},
    # calibrate keeps the README's batch sizes: later commands serve and simulate at them
    "run": {"--requests": "20"},
    "sweep": {"--rates": "20,40", "--batch-sizes": "1,2", "--duration": "1s"},
    "simulate": {"--duration": "2"},
    "optimize-batch": {"--batch-sizes": "1,2", "--sim-duration": "2s", "--verify-duration": "1s",
                       "--max-verify": "2"},
}

#: staronnx subcommand -> flags CI adds where the line gives neither the flag nor its opposite:
#: calibrate's host probe (seconds of serving at a fifth and two fifths of the LP bound per
#: batch size) was 6 of the 7 CPU seconds of each of the pages' eleven calibrations, a tenth
#: of the suite's CPU; tests/test_predictions.py and tests/test_calibrate.py probe the host
FLAGS: dict[str, dict[str, str]] = {"calibrate": {"--no-host": "--host"}}

#: options CI never adds to a line that has the other one (a sweep over the network measures the
#: server's batch size only)
NOT_WITH: dict[str, str] = {"--batch-sizes": "--url"}

_STARONNX = re.compile(r"(?P<cmd>(?:^|(?<=[\s;&|(]))(?:staronnx|python -m staronnx)\s+(?P<sub>[a-z][a-z-]*))")


# -- reading the README ------------------------------------------------------------------------
def _reason(text: str) -> str:
    return text.strip().removeprefix("(").removesuffix(")").strip() or "no reason given"


@dataclass
class Block:
    """One fenced block: its language, the page line of its first content line, its lines, the
    page it comes from, and the marker on the line before its fence (kind, rest), if any."""

    lang: str
    line: int
    lines: list[str] = field(default_factory=list)
    source: str = "README.md"
    marker: tuple[str, str] | None = None

    @property
    def skip(self) -> str | None:
        """The reason given by a ``docs-test: skip (reason)`` marker or a ``# readme-test: skip
        (reason)`` first line, else None."""
        if self.marker is not None and self.marker[0] == "skip":
            return _reason(self.marker[1])
        first = self.lines[0].strip() if self.lines else ""
        m = SKIP_MARK.match(first)
        return _reason(m.group(1)) if m else None

    @property
    def ready_url(self) -> str | None:
        """For a ``docs-test: background (ready: URL)`` block, the URL that says it is up."""
        if self.marker is None or self.marker[0] != "background":
            return None
        m = re.search(r"ready:\s*(\S+?)\)?$", self.marker[1])
        if m is None:
            raise ValueError(f"{self.source} line {self.line}: a background block needs (ready: URL)")
        return m.group(1)


def read_blocks(text: str, langs: tuple[str, ...] = ("bash", "python"), source: str = "README.md") -> list[Block]:
    """The ```bash and ```python blocks of a Markdown text, in order, with their markers."""
    out: list[Block] = []
    current: Block | None = None
    previous = ""
    for number, line in enumerate(text.splitlines(), start=1):
        fence = re.match(r"^\s*```\s*([A-Za-z0-9_+-]*)\s*$", line)
        if fence and current is None:
            m = MARKER.match(previous)
            current = Block(fence.group(1).lower(), number + 1, source=source,
                            marker=(m.group(1), m.group(2)) if m else None)
        elif fence:
            if current.lang in langs:
                out.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
        if current is None:
            previous = line
    return out


def page_env(text: str) -> dict[str, str]:
    """The ``<!-- docs-test: env NAME=VALUE (reason) -->`` settings of a page."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = MARKER.match(line)
        if m and m.group(1) == "env":
            name, _, rest = m.group(2).partition("=")
            out[name.strip()] = rest.split()[0] if rest.split() else ""
    return out


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_map() -> dict[str, str]:
    """The pages' ports 8000 (HTTP), 8001 (gRPC) and 8002 (metrics), and 8010-8012 (a second
    server on the same page) -> free ports, so that pages run side by side and beside other tests."""
    return {str(p): str(free_port()) for p in (8000, 8001, 8002, 8010, 8011, 8012)}


_PORT = re.compile(r"(?:(?<=localhost:)|(?<=127\.0\.0\.1:)|(?<=-port )|(?<=-port=))(80[01][0-2])\b")


def ci_ports(text: str, ports: dict[str, str] | None) -> str:
    """``text`` with the ports of :func:`port_map` replaced (after ``localhost:``,
    ``127.0.0.1:`` or ``-port``)."""
    return _PORT.sub(lambda m: ports.get(m.group(1), m.group(1)), text) if ports else text


def two_groups() -> str:
    """The README's ``cores=1`` (one worker per core: 2 on a laptop, 128 on a big server) as CI
    runs it: two one-PU groups of this process's allowed PUs, so the test holds on any host."""
    pus = sorted(os.sched_getaffinity(0))
    return f"{pus[0]};{pus[-1]}" if len(pus) > 1 else f"{pus[0]}"


def ci_groups(text: str, quote: bool) -> str:
    """``cores=1`` replaced by :func:`two_groups` (quoted for the shell, where ';' ends a command)."""
    groups = two_groups()
    return re.sub(r"(?<![\w=])cores=1\b", f"'{groups}'" if quote else groups, text)


def ci_line(line: str) -> str:
    """One logical shell line as CI runs it (see :data:`COMMANDS`, :data:`SHORTER` and
    :func:`ci_groups`)."""
    line = ci_groups(line, quote=True)
    stripped = line.strip()
    for pattern, instead in COMMANDS.items():
        if re.fullmatch(pattern, stripped):
            return instead
    m = _STARONNX.search(line)
    if m is not None:
        for flag, opposite in FLAGS.get(m.group("sub"), {}).items():
            if not re.search(rf"(?<=\s)(?:{re.escape(flag)}|{re.escape(opposite)})(?=\s|$)", line):
                line = f"{line[:m.end()]} {flag}{line[m.end():]}"  # after the match: m still holds
    if m is None or m.group("sub") not in SHORTER:
        return line
    for option, value in SHORTER[m.group("sub")].items():
        given = re.compile(rf"(?<=\s){re.escape(option)}(?:=|\s+)\S+")
        found = given.search(line)
        if found and "=" in found.group(0)[len(option) + 1:]:
            continue  # a value per model (a=100,b=50): the page keeps it small itself
        if found:
            line = given.sub(f"{option} {value}", line)
        elif NOT_WITH.get(option, "\0") in line:
            continue
        else:
            m = _STARONNX.search(line)
            line = f"{line[:m.end()]} {option} {value}{line[m.end():]}"
    return line


def bash_script(block: Block, ports: dict[str, str] | None = None) -> str:
    """The block as a bash script whose line k is page line ``block.line + k - 2`` (line 1 is
    the prologue); a continued command runs on its first line, blanks stand for the rest. A
    background block's last command is ``exec``'d, so that SIGTERM reaches it (a server drains)
    and its exit code is the block's."""
    out = ["set -eo pipefail; trap 'echo \"readme-test: line $LINENO exited with $?\" >&2' ERR; "
           "trap 'echo \"readme-test: at line $LINENO\" >&2' DEBUG"]
    lines = block.lines
    logical_lines: list[tuple[str, int]] = []
    i = 0
    while i < len(lines):
        logical, n = lines[i], 1
        while logical.rstrip().endswith("\\") and i + n < len(lines):
            logical = logical.rstrip()[:-1].rstrip() + " " + lines[i + n].strip()
            n += 1
        logical_lines.append((ci_ports(ci_line(logical), ports), n))
        i += n
    commands = [k for k, (text, _) in enumerate(logical_lines) if text.strip() and not text.strip().startswith("#")]
    for k, (text, n) in enumerate(logical_lines):
        if block.ready_url is not None and commands and k == commands[-1]:
            text = re.sub(r"^(\s*)", r"\1exec ", text, count=1)
        out.append(text)
        out.extend([""] * (n - 1))
    return "\n".join(out) + "\n"


@dataclass
class Outcome:
    """How one block ran: exit code, output, and the page line that failed (if known)."""

    returncode: int
    output: str
    seconds: float
    failed_line: int | None = None
    block: Block | None = None

    def line_at(self, pos: int) -> int | None:
        """The page line whose command wrote the output at ``pos`` (bash blocks mark each
        command's start in the output)."""
        marks = re.findall(r"readme-test: at line (\d+)", self.output[:pos])
        return self.block.line + int(marks[-1]) - 2 if marks and self.block is not None else None

    @property
    def text(self) -> str:
        """The output without the line marks."""
        return re.sub(r"(?m)^readme-test: at line \d+\n", "", self.output)


def _script(block: Block, workdir: Path, index: int, ports: dict[str, str] | None) -> list[str]:
    """Write the block as a script in ``workdir``; the command that runs it."""
    if block.lang == "bash":
        script = workdir / f".readme-block{index}.sh"
        script.write_text(bash_script(block, ports))
        return ["bash", str(script)]
    script = workdir / f".readme-block{index}.py"
    script.write_text(ci_ports(ci_groups("\n".join(block.lines), quote=False), ports) + "\n")
    return [sys.executable, str(script)]


def run_block(block: Block, workdir: Path, env: dict[str, str], index: int,
              timeout: float = BLOCK_TIMEOUT, ports: dict[str, str] | None = None) -> Outcome:
    """Run one block in ``workdir``; a background job it leaves is stopped with its group."""
    argv = _script(block, workdir, index, ports)
    script = argv[-1]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\nreadme-test: block timed out after {timeout:g} s"
        code = -signal.SIGKILL
    finally:
        try:  # servers or other jobs the block started in the background
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    failed = None
    if block.lang == "bash":
        hits = re.findall(r"readme-test: line (\d+) exited", output)
        if hits:
            failed = block.line + int(hits[0]) - 2
    else:
        hits = re.findall(rf'File "{re.escape(str(script))}", line (\d+)', output)
        if hits:
            failed = block.line + int(hits[-1]) - 1
    return Outcome(code, output, time.monotonic() - t0, failed, block)


@dataclass
class Background:
    """A block running in the background (a server): its process group and its output file."""

    block: Block
    proc: subprocess.Popen[bytes]
    log: Path
    started: float

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> Outcome:
        """SIGTERM to its group; how it exited (a server drains, then exits 0)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
            self.log.open("a").write(f"\nreadme-test: did not exit {STOP_TIMEOUT} s after SIGTERM\n")
        return Outcome(code, self.output(), time.monotonic() - self.started, None, self.block)


def start_background(block: Block, workdir: Path, env: dict[str, str], index: int,
                     ports: dict[str, str] | None) -> tuple[Background, Outcome | None]:
    """Start ``block`` in its own process group and wait until its ready URL answers 200; the
    outcome is None when it is up, else why not (it exited, or never answered)."""
    argv = _script(block, workdir, index, ports)
    log = workdir / f".readme-block{index}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    job = Background(block, proc, log, time.monotonic())
    url = ci_ports(block.ready_url or "", ports)
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return job, Outcome(proc.returncode, job.output(), time.monotonic() - job.started, None, block)
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return job, None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    stopped = job.stop()
    stopped.output += f"\nreadme-test: {url} did not answer 200 within {READY_TIMEOUT} s"
    stopped.returncode = stopped.returncode or 1
    return job, stopped


def failure_report(block: Block, outcome: Outcome, why: str) -> str:
    """Where a block failed, as a reader would look for it in its page."""
    line = outcome.failed_line
    if line is not None and block.line <= line < block.line + len(block.lines):
        page_line = block.lines[line - block.line].strip()
        as_run = ci_line(page_line) if block.lang == "bash" else page_line
        where = f"{block.source} line {line}: {page_line}" + (f"\n  run as: {as_run}" if as_run != page_line else "")
    else:
        where = f"{block.source} {block.lang} block starting at line {block.line}"
    tail = "\n".join(outcome.text.strip().splitlines()[-25:])
    return f"{where}\n  {why} (exit code {outcome.returncode})\n--- output (tail) ---\n{tail}"


def readme_env(workdir: Path) -> dict[str, str]:
    """The caller's environment, with this venv first on PATH and a private STARONNX_HOME."""
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
            "STARONNX_HOME": str(workdir / ".staronnx-home"), "MPLBACKEND": "Agg", "COLUMNS": "120"}


def prepare(workdir: Path) -> None:
    """The page's scratch folder: the tiny stand-in models, and the repository's ``models/``."""
    for name, build in MODELS.items():
        if not (workdir / name).exists():
            onnx.save(build(), str(workdir / name))
    if (ROOT / "models").is_dir() and not (workdir / "models").exists():
        (workdir / "models").symlink_to(ROOT / "models")


def _problem(block: Block, outcome: Outcome) -> str | None:
    """Why a finished block fails the page (an exit code, a traceback, a missing calibration)."""
    if outcome.returncode != 0:
        return failure_report(block, outcome, "failed")
    at = outcome.output.find("Traceback (most recent call last)")
    if at >= 0:
        outcome.failed_line = outcome.failed_line or outcome.line_at(at)
        return failure_report(block, outcome, "printed a traceback")
    m = re.search(r"^staronnx: warning: no calibrated model.*$", outcome.output, re.M)
    if m:
        outcome.failed_line = outcome.line_at(m.start())
        return failure_report(block, outcome, f"the page's commands disagree: {m.group(0)}")
    return None


def check_blocks(blocks: list[Block], workdir: Path, extra_env: dict[str, str] | None = None) -> list[str]:
    """Run ``blocks`` in order in ``workdir``; the reports of those that failed (running stops
    at the first failure: later blocks build on earlier ones). Background blocks are stopped
    after the last block, and must exit 0."""
    prepare(workdir)
    env = {**readme_env(workdir), **(extra_env or {})}
    ports = port_map()
    jobs: list[Background] = []
    failures: list[str] = []
    try:
        for index, block in enumerate(blocks):
            if block.skip is not None:
                print(f"{block.source} line {block.line}: {block.lang} block skipped: {block.skip}")
                continue
            if block.ready_url is not None:
                job, outcome = start_background(block, workdir, env, index, ports)
                print(f"{block.source} line {block.line}: {block.lang} block started in the background "
                      f"in {time.monotonic() - job.started:.1f} s")
                if outcome is not None:
                    return [failure_report(block, outcome, "did not start")]
                jobs.append(job)
                continue
            outcome = run_block(block, workdir, env, index, ports=ports)
            print(f"{block.source} line {block.line}: {block.lang} block ran in {outcome.seconds:.1f} s "
                  f"(exit code {outcome.returncode})")
            problem = _problem(block, outcome)
            if problem is not None:
                return [problem] + [f"--- background output ---\n{j.output()[-3000:]}" for j in jobs]
    finally:
        for job in jobs:
            stopped = job.stop()
            print(f"{job.block.source} line {job.block.line}: background block stopped "
                  f"(exit code {stopped.returncode})")
            if not failures:
                problem = _problem(job.block, stopped)
                if problem is not None:
                    failures.append(problem)
    return failures


def check_page(path: Path, workdir: Path) -> list[str]:
    """Run every block of the Markdown file ``path`` (README.md, a docs page) in ``workdir``."""
    text = path.read_text()
    source = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    return check_blocks(read_blocks(text, source=source), workdir, page_env(text))


# -- the README itself ---------------------------------------------------------------------------
def test_readme_commands_run_as_written(tmp_path):
    blocks = read_blocks(README.read_text())
    assert any(b.lang == "bash" and b.skip is None for b in blocks), "no runnable bash block in README.md"
    failures = check_page(README, tmp_path)
    assert not failures, "\n\n".join(failures)


# -- the harness: it must fail, and say where --------------------------------------------------
FAKE = """# title

```bash
echo one
staronnx sweep plan/ --rates 50:800:50 \\
    --batch-sizes 8 -o r/   # a comment
false   # line 7 fails
echo never
```

```bash
# readme-test: skip (needs a GPU)
exit 3
```

```python
x = 1
raise SystemExit(4)
```
"""


def test_blocks_skip_marker_and_substitutions():
    blocks = read_blocks(FAKE)
    assert [(b.lang, b.line, b.skip) for b in blocks] == [
        ("bash", 4, None), ("bash", 12, "needs a GPU"), ("python", 17, None)]
    script = bash_script(blocks[0]).splitlines()
    assert script[2] == "staronnx sweep --duration 1s plan/ --rates 20,40 --batch-sizes 1,2 -o r/   # a comment"
    assert script[3] == "" and script[4] == "false   # line 7 fails"
    assert ci_line("staronnx sweep plan/ --batch-sizes=1,2,4,8,16 --groups cores=1") == \
        f"staronnx sweep --duration 1s --rates 20,40 plan/ --batch-sizes 1,2 --groups '{two_groups()}'"
    assert two_groups().count(";") == (len(os.sched_getaffinity(0)) > 1)  # two explicit one-PU groups
    assert ci_line("make demo   # builds .venv") == COMMANDS[r"make demo\b.*"]
    assert ci_line("staronnx plan show plan/") == "staronnx plan show plan/"
    assert ci_line("staronnx calibrate plan/ --batch-sizes 1,8") == \
        "staronnx calibrate --no-host plan/ --batch-sizes 1,8"
    assert ci_line("staronnx calibrate plan/ --host") == "staronnx calibrate plan/ --host"


def test_a_failing_line_fails_with_its_readme_line(tmp_path):
    blocks = read_blocks(FAKE.replace("staronnx sweep", "echo staronnx sweep"))
    env = readme_env(tmp_path)
    bash = run_block(blocks[0], tmp_path, env, 0)
    assert bash.returncode == 1 and bash.failed_line == 7
    report = failure_report(blocks[0], bash, "failed")
    assert report.startswith("README.md line 7: false   # line 7 fails")
    assert "never" not in bash.output
    py = run_block(blocks[2], tmp_path, env, 2)
    assert py.returncode == 4
    # a skipped block is not run; the python block's exit fails the whole check at its block
    failures = check_blocks(blocks[1:], tmp_path)
    assert len(failures) == 1 and "README.md python block starting at line 17" in failures[0]
    assert "exit code 4" in failures[0]


def test_a_traceback_names_the_python_line(tmp_path):
    blocks = read_blocks("```python\nimport sys\n\n1 / 0\n```\n")
    outcome = run_block(blocks[0], tmp_path, readme_env(tmp_path), 0)
    assert outcome.returncode == 1 and outcome.failed_line == 4
    assert failure_report(blocks[0], outcome, "failed").startswith("README.md line 4: 1 / 0")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_stand_in_models_are_valid(name):
    model = MODELS[name]()
    names = [i.name for i in model.graph.input]
    assert names == (["input"] if name == "model.onnx" else ["input_ids"])


def test_a_calibration_warning_is_located(tmp_path):
    text = ("```bash\necho ok\n"
            "echo 'staronnx: warning: no calibrated model for part 0 on cpu1: run staronnx calibrate p' >&2\n"
            "echo after\n```\n")
    failures = check_blocks(read_blocks(text), tmp_path)
    assert len(failures) == 1
    assert failures[0].startswith("README.md line 3: echo 'staronnx: warning: no calibrated model"), failures[0]
    assert "the page's commands disagree" in failures[0] and "readme-test: at line" not in failures[0]


def test_markers_ports_and_per_model_values():
    text = ("<!-- docs-test: env STARONNX_CUDA_RUNTIME=host (no GPU in CI) -->\n\n"
            "<!-- docs-test: skip (needs a Ray cluster) -->\n```bash\nray start --head\n```\n\n"
            "<!-- docs-test: background (ready: http://127.0.0.1:8000/v2/health/ready) -->\n"
            "```bash\nstaronnx serve plan/ --http-port 8000 --metrics-port=8002\n```\n"
            "```python\nc = Client('localhost:8001')\n```\n")
    blocks = read_blocks(text, source="docs/x.md")
    assert [(b.skip, b.ready_url, b.source) for b in blocks] == [
        ("needs a Ray cluster", None, "docs/x.md"),
        (None, "http://127.0.0.1:8000/v2/health/ready", "docs/x.md"), (None, None, "docs/x.md")]
    assert page_env(text) == {"STARONNX_CUDA_RUNTIME": "host"}
    ports = {"8000": "1234", "8001": "1235", "8002": "1236"}
    assert bash_script(blocks[1], ports).splitlines()[1] == \
        "exec staronnx serve plan/ --http-port 1234 --metrics-port=1236"
    assert ci_ports("curl localhost:8001/x; --rates 1000:8000:1000", ports) == \
        "curl localhost:1235/x; --rates 1000:8000:1000"
    # a value given per model is the page's own (it keeps it small); a plain one is shortened
    assert "--rates a=10,b=5" in ci_line("staronnx sweep a/ b/ --rates a=10,b=5")
    assert "--rates 20,40" in ci_line("staronnx sweep a/ --rates 10:400:10")


SERVER = """import argparse, http.server, signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # a clean drain, as staronnx serve's
parser = argparse.ArgumentParser()
parser.add_argument("--port")
port = parser.parse_args().port
http.server.HTTPServer(("127.0.0.1", int(port)), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_a_background_block_serves_the_blocks_after_it(tmp_path):
    (tmp_path / "tiny_server.py").write_text(SERVER)
    (tmp_path / "hello.txt").write_text("hello\n")
    text = ("<!-- docs-test: background (ready: http://127.0.0.1:8000/hello.txt) -->\n"
            "```bash\npython tiny_server.py --port 8000\n```\n\n"
            "```bash\ncurl -sf localhost:8000/hello.txt | grep -q hello\n```\n")
    assert check_blocks(read_blocks(text, source="docs/x.md"), tmp_path) == []
    failing = text.replace("grep -q hello", "grep -q bye")
    failures = check_blocks(read_blocks(failing, source="docs/x.md"), tmp_path)
    assert len(failures) >= 1 and failures[0].startswith("docs/x.md line 7: curl"), failures
