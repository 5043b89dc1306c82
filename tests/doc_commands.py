"""Run the shell commands of a markdown file as written, in a copy of the repository.

A command block is a fenced code block whose info string is `bash`, `sh` or `shell`;
other blocks (python, json, text, console transcripts) are not run, and neither are
indented blocks (so a command meant to be run goes in a fenced block: tests/test_docs.py
checks that no indented block starts with one). Blocks run in document order, each as
`bash -euo pipefail` in the root of one sandbox (a copy of the repository's files, with
the compiled ops linked in), so a block sees what earlier ones wrote, and nothing is
written to the checkout. Directives are HTML comments (not shown when the markdown is
rendered) on the lines just above a block:

    <!-- doc-test: skip REASON -->      not run; the reason is required (network, GPU, hours)
    <!-- doc-test: skip-command TEXT | REASON -->
                                        the block's commands that contain TEXT are not run (a
                                        command: a line with its backslash continuations);
                                        the rest run as written. TEXT must match one
    <!-- doc-test: instead COMMAND -->  COMMAND runs in its place: the documented size cap,
                                         e.g. a shipped sample copied where the block downloads
    <!-- doc-test: setup COMMAND -->    COMMAND runs first (what a reader is assumed to have)
    <!-- doc-test: fresh -->            this block and the next ones run in a new sandbox
                                         (alternatives that write the same paths)

The cap on steps and sizes, the same for every command: in the sandbox `python`,
`python3` and `torchrun` are shims through tests/doc_cap.py, which appends to every
`bert.py train|eval|sweep` the overrides with which it trains at most DOC_STEPS steps past
where it starts and evaluates at most 64 samples, and says so in one line; the rest of
each command runs as written. `make` runs with the custom ops taken as built (`make -o
ops`: the suite builds them once, and the sandbox links them in), with the sandbox's
`python3`.

`run_markdown(path, workdir)` runs every block of one file and raises AssertionError on
the first that fails, naming the file, its line, the command and the end of its output.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELLS = {"bash", "sh", "shell"}
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(skip-command|skip|instead|setup|fresh)(?![\w-])\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    text: str
    skip: str | None = None
    instead: str | None = None
    setup: str | None = None
    fresh: bool = False
    skip_commands: tuple[tuple[str, str], ...] = ()  # (text, reason)

    @property
    def command(self) -> str | None:
        """What runs: the block (less its skipped commands), or its stand-in; None when skipped."""
        if self.skip is not None:
            return None
        body = self.instead if self.instead is not None else self.text
        if self.skip_commands:
            body = "\n".join(c for c in commands(body) if not any(text in c for text, _ in self.skip_commands))
        return f"{self.setup}\n{body}" if self.setup else body


def commands(text: str) -> list[str]:
    """The commands of a block: each line with its backslash continuations."""
    out: list[str] = []
    continued = False
    for line in text.split("\n"):
        if continued:
            out[-1] += "\n" + line
        else:
            out.append(line)
        continued = line.endswith("\\")
    return out


@dataclass(frozen=True)
class Ran:
    block: Block
    sandbox: Path
    output: str
    seconds: float


def shell_blocks(path: str | Path) -> list[Block]:
    """The command blocks of a markdown file with their directives."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    pending: dict = {}
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        d = _DIRECTIVE.search(lines[i])
        if d:
            kind, arg = d.group(1), d.group(2)
            if kind == "skip" and not arg:
                raise ValueError(f"{path}, line {i + 1}: a doc-test skip must say why")
            if kind in ("instead", "setup") and not arg:
                raise ValueError(f"{path}, line {i + 1}: doc-test {kind} needs a command")
            if kind == "skip-command":
                text, bar, reason = (part.strip() for part in arg.partition("|"))
                if not (text and bar and reason):
                    raise ValueError(f"{path}, line {i + 1}: doc-test skip-command needs TEXT | REASON")
                pending["skip_commands"] = (*pending.get("skip_commands", ()), (text, reason))
            else:
                pending[kind] = True if kind == "fresh" else arg
        elif m:
            fence, info = m.group(2), m.group(3).lower()
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(fence):
                end += 1
            if info in SHELLS:
                block = Block(path, i + 1, "\n".join(lines[i + 1:end]), **pending)
                for text, _ in block.skip_commands:
                    if "<<" in block.text:
                        raise ValueError(f"{path}, line {i + 1}: skip-command cannot cut a block with a here-document")
                    if not any(text in c for c in commands(block.text)):
                        raise ValueError(f"{path}, line {i + 1}: doc-test skip-command {text!r} matches no command")
                blocks.append(block)
            elif pending:
                raise ValueError(f"{path}, line {i + 1}: doc-test directive above a {info or 'plain'} block")
            pending = {}
            i = end
        elif lines[i].strip() and pending:
            raise ValueError(f"{path}, line {i + 1}: a doc-test directive must come just before its block")
        i += 1
    return blocks


def make_sandbox(directory: Path) -> Path:
    """A copy of the repository's tracked files (`git add` a new one) under `directory`,
    with the built custom ops linked in and `python` on PATH being this interpreter."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    directory.mkdir(parents=True)
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, directory / name)
    lib = ROOT / "custom_ops" / "lib"
    if lib.is_dir():
        (directory / "custom_ops" / "lib").symlink_to(lib, target_is_directory=True)
    return directory


def _shim(path: Path, body: str) -> None:
    if not path.exists():
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)


def _environment(bin_dir: Path) -> dict:
    """The sandbox's environment: this interpreter as `python`, the shims that cap a
    bert.py command (tests/doc_cap.py), `make` without rebuilding the ops."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    # Scripts, not links: a virtual environment's interpreter linked from elsewhere would
    # not find its pyvenv.cfg and would run without the environment's packages.
    python, cap = shlex.quote(sys.executable), shlex.quote(str(ROOT / "tests" / "doc_cap.py"))
    for name in ("python", "python3"):
        _shim(bin_dir / name, f'case "$*" in *bert.py*) exec {python} {cap} {python} "$@";; esac\nexec {python} "$@"')
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun:
        _shim(bin_dir / "torchrun", f'exec {python} {cap} {shlex.quote(torchrun)} "$@"')
    make = shutil.which("make")
    if make:
        _shim(bin_dir / "make", f'exec {shlex.quote(make)} -o ops "$@"')
    # A new reader's shell: no pytest, no PYTHONPATH, and no make variables (PYTHON=...)
    # inherited from the make that runs the suite.
    drop = ("PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTHON")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k not in drop}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_markdown(path: str | Path, workdir: str | Path, *, timeout: float = 300) -> list[Ran]:
    """Run every command block of `path` (see the module docstring) in sandboxes under
    `workdir`; the sandboxes are kept for the caller to check what the commands wrote."""
    workdir = Path(workdir)
    env = _environment(workdir / "bin")
    sandboxes = 0
    sandbox = None
    ran: list[Ran] = []
    for block in shell_blocks(path):
        if sandbox is None or block.fresh:
            sandboxes += 1
            sandbox = make_sandbox(workdir / f"sandbox{sandboxes}")
        command = block.command
        if command is None:
            continue
        start = time.perf_counter()
        try:
            p = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=sandbox, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output or ""
            raise AssertionError(f"{path}, line {block.line}: the block ran past {timeout} s:\n{command}\n"
                                 f"{out[-3000:]}") from None
        if p.returncode != 0:
            raise AssertionError(f"{path}, line {block.line}: exit status {p.returncode} from\n{command}\n"
                                 f"--- output (end) ---\n{p.stdout[-3000:]}")
        ran.append(Ran(block, sandbox, p.stdout, time.perf_counter() - start))
    return ran
