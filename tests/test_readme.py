"""Every command of README.md runs as written, on a tiny model, on the CPU (issue 12).

How the README is run:

* each ```bash block is one bash script (``set -eo pipefail``) and each ```python block one
  Python script, in README order, all in one scratch folder with a private
  ``$STARONNX_HOME``, so a block finds the plan an earlier block wrote, as a reader would;
* a block whose first line is ``# readme-test: skip (reason)`` is not run: GPU-only commands,
  long-running servers, downloads. Everything else runs.

What CI changes, all of it listed here so that the README reads as users need it:

* :data:`MODELS`: the model files the README names are built tiny, with the inputs its
  commands and Python use (``input`` [batch, 3, 224, 224]; ``input_ids`` [batch, seq]);
* :data:`COMMANDS`: whole lines run differently (``make demo`` is ``staronnx demo`` with this
  venv; ``. .venv/bin/activate`` is a no-op because this venv's ``bin/`` leads ``PATH``);
* :data:`SHORTER`: option values per ``staronnx`` subcommand (fewer rates and batch sizes,
  shorter durations), replaced where the README gives them, added where it does not.

A failing command fails the test with its README line number, the command as run, its exit
code and the tail of its output. No command may print a traceback, nor the warning that a
command has no calibrated model for its workers (the README's commands must agree).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx.zoo import inception, transformer_block

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP_MARK = re.compile(r"^#\s*readme-test:\s*skip\b\s*(.*)$")
#: seconds one block may take before it counts as failed
BLOCK_TIMEOUT = 300


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

_STARONNX = re.compile(r"(?P<cmd>(?:^|(?<=[\s;&|(]))(?:staronnx|python -m staronnx)\s+(?P<sub>[a-z][a-z-]*))")


# -- reading the README ------------------------------------------------------------------------
@dataclass
class Block:
    """One fenced block: its language, the README line of its first content line, its lines."""

    lang: str
    line: int
    lines: list[str] = field(default_factory=list)

    @property
    def skip(self) -> str | None:
        """The reason given by a ``# readme-test: skip (reason)`` first line, else None."""
        first = self.lines[0].strip() if self.lines else ""
        m = SKIP_MARK.match(first)
        return (m.group(1).strip().removeprefix("(").removesuffix(")") or "no reason given") if m else None


def read_blocks(text: str, langs: tuple[str, ...] = ("bash", "python")) -> list[Block]:
    """The ```bash and ```python blocks of a Markdown text, in order."""
    out: list[Block] = []
    current: Block | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = re.match(r"^\s*```\s*([A-Za-z0-9_+-]*)\s*$", line)
        if fence and current is None:
            current = Block(fence.group(1).lower(), number + 1)
        elif fence:
            if current.lang in langs:
                out.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
    return out


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
    if m is None or m.group("sub") not in SHORTER:
        return line
    for option, value in SHORTER[m.group("sub")].items():
        given = re.compile(rf"(?<=\s){re.escape(option)}(?:=|\s+)\S+")
        if given.search(line):
            line = given.sub(f"{option} {value}", line)
        else:
            m = _STARONNX.search(line)
            line = f"{line[:m.end()]} {option} {value}{line[m.end():]}"
    return line


def bash_script(block: Block) -> str:
    """The block as a bash script whose line k is README line ``block.line + k - 2`` (line 1 is
    the prologue); a continued command runs on its first line, blanks stand for the rest."""
    out = ["set -eo pipefail; trap 'echo \"readme-test: line $LINENO exited with $?\" >&2' ERR; "
           "trap 'echo \"readme-test: at line $LINENO\" >&2' DEBUG"]
    lines = block.lines
    i = 0
    while i < len(lines):
        logical, n = lines[i], 1
        while logical.rstrip().endswith("\\") and i + n < len(lines):
            logical = logical.rstrip()[:-1].rstrip() + " " + lines[i + n].strip()
            n += 1
        out.append(ci_line(logical))
        out.extend([""] * (n - 1))
        i += n
    return "\n".join(out) + "\n"


@dataclass
class Outcome:
    """How one block ran: exit code, output, and the README line that failed (if known)."""

    returncode: int
    output: str
    seconds: float
    failed_line: int | None = None
    block: Block | None = None

    def line_at(self, pos: int) -> int | None:
        """The README line whose command wrote the output at ``pos`` (bash blocks mark each
        command's start in the output)."""
        marks = re.findall(r"readme-test: at line (\d+)", self.output[:pos])
        return self.block.line + int(marks[-1]) - 2 if marks and self.block is not None else None

    @property
    def text(self) -> str:
        """The output without the line marks."""
        return re.sub(r"(?m)^readme-test: at line \d+\n", "", self.output)


def run_block(block: Block, workdir: Path, env: dict[str, str], index: int,
              timeout: float = BLOCK_TIMEOUT) -> Outcome:
    """Run one block in ``workdir``; a background job it leaves is stopped with its group."""
    if block.lang == "bash":
        script = workdir / f".readme-block{index}.sh"
        script.write_text(bash_script(block))
        argv = ["bash", str(script)]
    else:
        script = workdir / f".readme-block{index}.py"
        script.write_text(ci_groups("\n".join(block.lines), quote=False) + "\n")
        argv = [sys.executable, str(script)]
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


def failure_report(block: Block, outcome: Outcome, why: str) -> str:
    """Where a block failed, as a reader would look for it in README.md."""
    line = outcome.failed_line
    if line is not None and block.line <= line < block.line + len(block.lines):
        readme_line = block.lines[line - block.line].strip()
        as_run = ci_line(readme_line) if block.lang == "bash" else readme_line
        where = f"README.md line {line}: {readme_line}" + (f"\n  run as: {as_run}" if as_run != readme_line else "")
    else:
        where = f"README.md {block.lang} block starting at line {block.line}"
    tail = "\n".join(outcome.text.strip().splitlines()[-25:])
    return f"{where}\n  {why} (exit code {outcome.returncode})\n--- output (tail) ---\n{tail}"


def readme_env(workdir: Path) -> dict[str, str]:
    """The caller's environment, with this venv first on PATH and a private STARONNX_HOME."""
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
            "STARONNX_HOME": str(workdir / ".staronnx-home"), "MPLBACKEND": "Agg", "COLUMNS": "120"}


def check_blocks(blocks: list[Block], workdir: Path) -> list[str]:
    """Run ``blocks`` in order in ``workdir``; the reports of those that failed (running stops
    at the first failure: later blocks build on earlier ones)."""
    for name, build in MODELS.items():
        if not (workdir / name).exists():
            onnx.save(build(), str(workdir / name))
    env = readme_env(workdir)
    for index, block in enumerate(blocks):
        if block.skip is not None:
            print(f"README.md line {block.line}: {block.lang} block skipped: {block.skip}")
            continue
        outcome = run_block(block, workdir, env, index)
        print(f"README.md line {block.line}: {block.lang} block ran in {outcome.seconds:.1f} s "
              f"(exit code {outcome.returncode})")
        if outcome.returncode != 0:
            return [failure_report(block, outcome, "failed")]
        at = outcome.output.find("Traceback (most recent call last)")
        if at >= 0:
            outcome.failed_line = outcome.failed_line or outcome.line_at(at)
            return [failure_report(block, outcome, "printed a traceback")]
        m = re.search(r"^staronnx: warning: no calibrated model.*$", outcome.output, re.M)
        if m:
            outcome.failed_line = outcome.line_at(m.start())
            return [failure_report(block, outcome, f"the README's commands disagree: {m.group(0)}")]
    return []


# -- the README itself ---------------------------------------------------------------------------
def test_readme_commands_run_as_written(tmp_path):
    blocks = read_blocks(README.read_text())
    assert any(b.lang == "bash" and b.skip is None for b in blocks), "no runnable bash block in README.md"
    failures = check_blocks(blocks, tmp_path)
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
    assert "the README's commands disagree" in failures[0] and "readme-test: at line" not in failures[0]
