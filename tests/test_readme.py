"""The README's code runs as a reader would run it: every fenced `python` and `sh` block is preceded by a marker
comment this file reads (docs/TESTING.md, "The README's code") and is executed, with tiny models standing in where
the marker says so, or is marked illustrative with a reason, or is one of the two fresh-machine commands, which
must match what `.ci/run` runs. Python blocks share one namespace in file order; a block that makes an `OpenAI`
client gets a server for the model it names; `python -m chunkwise serve` in a shell block starts in the background
for the lines after it."""
from __future__ import annotations

import ast
import builtins
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from chunkwise.checkpoints import REAL_NAMES

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
ADDRESSES = ("http://127.0.0.1:8000", "http://localhost:8000", "localhost:8000")
MARKER = re.compile(r"<!--\s*(test(?::\s*(?P<opts>[^>]*?))?|illustrative:\s*(?P<why>[^>]*?)|fresh-machine)\s*-->")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    marker: str        # "test", "illustrative", "fresh-machine" or "" (none)
    options: dict
    line: int          # where the block's fence opens, 1-based

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str) -> list[Block]:
    """Every fenced block, with the marker comment on the nearest non-blank line before its fence."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, j = i, i + 1
        while not lines[j].startswith("```"):
            j += 1
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = MARKER.fullmatch(lines[k].strip()) if k >= 0 else None
        marker, options = "", {}
        if mk:
            marker = mk.group(1).split(":")[0]
            options = dict(o.split("=", 1) for o in (mk.group("opts") or "").split()) if marker == "test" else {}
            if marker == "illustrative":
                options = {"why": mk.group("why").strip()}
        out.append(Block(m.group(1), "\n".join(lines[start + 1:j]), marker, options, start + 1))
        i = j + 1
    return out


def indented_code(text: str) -> list[int]:
    """Lines opening an indented code block (four spaces after a blank line, outside fences and lists)."""
    found, fenced, prev = [], False, ""
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not prev.strip() and line.startswith("    ") and line.strip():
            found.append(n)
        prev = line
    return found


README_BLOCKS = blocks(README.read_text())
RUN = [b for b in README_BLOCKS if b.marker == "test"]


def test_every_code_block_says_how_it_is_checked():
    assert README_BLOCKS, "no fenced blocks found"
    for b in README_BLOCKS:
        if b.lang in ("python", "sh", "bash", ""):
            assert b.marker, f"{b.where}: a {b.lang or 'plain'} block without a marker comment"
        if b.marker == "illustrative":
            assert b.options["why"], f"{b.where}: an illustrative block must say why it is not run"
        if b.marker == "test":
            assert set(b.options) <= {"model"} and b.options.get("model", "tiny-text") == "tiny-text", \
                f"{b.where}: unknown test options {b.options}"
    assert indented_code(README.read_text()) == [], "indented code blocks escape the test: fence and mark them"
    assert {b.lang for b in RUN} == {"python", "sh"}


def test_the_fresh_machine_commands_are_what_ci_runs():
    fresh = [b for b in README_BLOCKS if b.marker == "fresh-machine"]
    assert len(fresh) == 2
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh" in ci and all(b.code.startswith("bash scripts/setup.sh && ") for b in fresh)
    pytest_line = [line for line in ci.splitlines() if "-m pytest" in line][-1]   # before it: the CPU benchmarks
    assert ci.rstrip().endswith(pytest_line.strip()), ".ci/run does not end with its test command"
    assert pytest_line.strip() in fresh[1].code, "the README's test command and .ci/run's differ"
    assert "CI=true" in fresh[1].code and "export CI=true" in ci


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (lower case, punctuation dropped, spaces to hyphens)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


def test_every_relative_link_in_the_readme_and_docs_resolves():
    """The README points into docs/ for everything it left out: each link's file and heading must exist."""
    for doc in [README, *sorted((REPO / "docs").glob("*.md"))]:
        body = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", body):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, frag = link.partition("#")
            target = (doc.parent / path) if path else doc
            assert target.exists(), f"{doc.name}: {link} names no file"
            assert not frag or frag in heading_anchors(target.read_text()), f"{doc.name}: {link} names no heading"


def test_the_readme_stays_reference_sized():
    assert len(README.read_text().splitlines()) <= 250


@pytest.fixture(scope="module")
def tiny_text(tiny_chat_ckpt):
    """What `model=tiny-text` stands for: the byte-tokenizer tiny Qwen3 plus a chat template."""
    return tiny_chat_ckpt


def substitute_models(code: str, block: Block, path: Path) -> str:
    if block.options.get("model") != "tiny-text":
        return code
    for name in REAL_NAMES:
        code = code.replace(f'Engine("{name}"', f'Engine({str(path)!r}')
    return code


@contextlib.contextmanager
def server_for(block: Block, tiny_text: Path):
    """An in-thread server for the model a client block names (a real name served by tiny-text), or none."""
    if "OpenAI(" not in block.code:
        yield None
        return
    from chunkwise.engine import Engine
    from chunkwise.serve.cli import serving

    name = re.search(r'model="([^"]+)"', block.code).group(1)
    ckpt = tiny_text if block.options.get("model") == "tiny-text" else name
    with serving(Engine(str(ckpt), dtype="float32", device="cpu"), name) as srv:
        yield srv.url


def with_address(code: str, url: str | None) -> str:
    if url is None:
        return code
    for a in ADDRESSES:
        code = code.replace(a, url)
    return code


def shell_commands(code: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and output lines dropped."""
    cmds, cur = [], ""
    for line in code.split("\n"):
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            cmds.append(re.sub(r"\s+#[^'\"]*$", "", cur).strip())
            cur = ""
    return cmds


def start_server(cmd: str, env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    """The command in the background, its output to `log` (a pipe nobody reads would fill); its address."""
    with open(log, "w") as out:
        proc = subprocess.Popen("exec " + cmd + " --port 0", shell=True, cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"running on (http://\S+)", log.read_text())
        if m:
            return proc, m.group(1)
        time.sleep(0.2)
    stop_server(proc)
    raise AssertionError(f"`{cmd}` never said where it runs:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM, as Ctrl-C's sibling: the documented clean exit is status 0."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run_shell(block: Block, env: dict, tmp: Path) -> None:
    """Each command through bash, `python` meaning this interpreter; a server runs until the block ends."""
    server, url = None, None
    try:
        for cmd in shell_commands(block.code):
            cmd = re.sub(r"^(\.venv/bin/)?python\b", lambda _: sys.executable, cmd)
            cmd = re.sub(r"^curl\b", "curl -sS --fail-with-body --max-time 120", cmd)
            cmd = with_address(cmd, url)
            if " -m chunkwise serve" in cmd:
                server, url = start_server(cmd, env, tmp / f"serve-{block.line}.log")
                continue
            proc = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, f"{block.where}: `{cmd}` exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    finally:
        if server is not None:
            assert stop_server(server) == 0, f"{block.where}: the server did not exit cleanly"


def section_of(block: Block, text: str) -> str:
    """The `## ` heading a block lies under: Python blocks share a namespace within their section only."""
    heads = [line for line in text.split("\n")[:block.line] if line.startswith("## ")]
    return heads[-1] if heads else ""


_TEXT = README.read_text()
SHELL = [b for b in RUN if b.lang == "sh"]
PYTHON = [b for b in RUN if b.lang == "python"]
_namespaces: dict[int, dict] = {}


def block_ids(chosen: list[Block]) -> list[str]:
    """Each block by its section's anchor (`composing-chunks`), numbered from the second block of a section."""
    ids = []
    for b in chosen:
        slug = re.sub(r"[^a-z0-9]+", "-", section_of(b, _TEXT)[3:].lower()).strip("-")
        n = sum(section_of(c, _TEXT) == section_of(b, _TEXT) for c in chosen if c.line < b.line)
        ids.append(slug if n == 0 else f"{slug}-{n + 1}")
    return ids    # a block's line -> the namespace after it ran (its section's session)


def run_python(block: Block, tiny_text: Path) -> dict:
    """The block, in a namespace holding what the earlier Python blocks of its section defined."""
    if block.line in _namespaces:
        return _namespaces[block.line]
    earlier = [b for b in PYTHON if b.line < block.line and section_of(b, _TEXT) == section_of(block, _TEXT)
               and "OpenAI(" not in b.code]
    namespace = dict(run_python(earlier[-1], tiny_text)) if earlier and "OpenAI(" not in block.code else {}
    namespace.setdefault("__name__", "__readme__")
    with server_for(block, tiny_text) as url:
        code = with_address(substitute_models(block.code, block, tiny_text), url)
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(code, block.where, "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{block.where} failed: {type(e).__name__}: {e}") from e
    _namespaces[block.line] = namespace
    return namespace


def bound_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


@pytest.mark.parametrize("block", PYTHON, ids=block_ids(PYTHON))
def test_python_block_uses_only_names_it_or_its_section_defines(block):
    """A reader can paste the section's blocks in order: nothing is left undefined (checked without running)."""
    same = [b for b in PYTHON if b.line <= block.line and section_of(b, _TEXT) == section_of(block, _TEXT)
            and ("OpenAI(" not in b.code or b is block)]
    bound = set(dir(builtins)).union(*(bound_names(ast.parse(b.code)) for b in same))
    used = {n.id for n in ast.walk(ast.parse(block.code)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used <= bound, f"{block.where}: {sorted(used - bound)} used but never defined"


@pytest.mark.parametrize("block", PYTHON, ids=block_ids(PYTHON))
def test_python_block_runs(block, tiny_text):
    run_python(block, tiny_text)


@pytest.mark.parametrize("block", SHELL, ids=block_ids(SHELL))
def test_shell_block_runs(block, tmp_path):
    run_shell(block, {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}, tmp_path)
