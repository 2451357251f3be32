"""Every ```python block in README.md and docs/**/*.md runs.

Each block runs in a fresh namespace, in a temporary working directory, under a timeout. A block
that needs a CUDA GPU carries the comment ``# doc: no-run (needs a CUDA GPU)``: it runs only where
torch sees a GPU, and is otherwise reported as skipped (``pytest -rs`` lists it) and counted by
``test_no_run_blocks``. A
block listed in ``KNOWN_BROKEN`` is a strict xfail: it must fail, so a fix shows up (XPASS) and
the entry is then deleted.
"""

from __future__ import annotations

import linecache
import re
from pathlib import Path

import pytest

import kvmgr

ROOT = Path(__file__).resolve().parent.parent
#: The opt-out marker; only for blocks that need a CUDA GPU (the test checks the reason).
NO_RUN = "# doc: no-run"
#: (file, the block's first line of code) -> why it fails today. Delete an entry once fixed.
#: Keyed by content, not line number, so editing a page above the block does not break the list.
KNOWN_BROKEN: dict[tuple[str, str], str] = {}


def _first_line(code: str) -> str:
    return next((ln.strip() for ln in code.splitlines() if ln.strip()), "")


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")


def _blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line of the opening fence, info string, code)`` for each fenced block of ``path``."""
    blocks: list[tuple[int, str, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence, info = match["indent"], match["fence"], match["info"].strip()
        start, body = i + 1, []
        i += 1
        while i < len(lines):
            end = lines[i].strip()
            if end.startswith(fence[0] * len(fence)) and not end.strip(fence[0]):
                break
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append((start, info, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _python_blocks() -> list[tuple[str, int, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = []
    for path in files:
        for line, info, code in _blocks(path):
            if info.split()[:1] in (["python"], ["py"]):
                found.append((path.relative_to(ROOT).as_posix(), line, code))
    return found


BLOCKS = _python_blocks()


def test_blocks_found() -> None:
    # The extractor works: the README's round trip and the guides' blocks are seen.
    files = {name for name, _, _ in BLOCKS}
    assert "README.md" in files
    assert "docs/guides/serving-loop.md" in files
    assert len(BLOCKS) >= 10, BLOCKS


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "line", "code"), BLOCKS, ids=[f"{name}:{line}" for name, line, _ in BLOCKS]
)
def test_block_runs(
    name: str, line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if NO_RUN in code:
        reason = code[code.index(NO_RUN) :].splitlines()[0]
        assert "GPU" in reason, f"{name}:{line}: a block may opt out only when it needs a GPU"
        if not _has_cuda():
            pytest.skip(f"{name}:{line}: {reason}")
    if (name, _first_line(code)) in KNOWN_BROKEN:
        with pytest.raises(Exception):  # noqa: B017 - any failure is the known one
            _run(name, line, code, tmp_path, monkeypatch)
        pytest.xfail(f"{name}:{line}: {KNOWN_BROKEN[name, _first_line(code)]}")
    _run(name, line, code, tmp_path, monkeypatch)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run(name: str, line: int, code: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(cwd)  # a block that writes files writes them here
    filename = f"{name}:{line}"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # tracebacks
    compiled = compile(code, filename, "exec")
    exec(compiled, {"__name__": "__main__"})  # a fresh namespace per block


def test_known_broken_exist() -> None:
    # Every KNOWN_BROKEN entry still names a python block (else it is stale).
    where = {(name, _first_line(code)) for name, _, code in BLOCKS}
    assert set(KNOWN_BROKEN) <= where, set(KNOWN_BROKEN) - where


def test_no_run_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    # Reports how many blocks are not run, and where; only GPU blocks may opt out.
    skipped = [(name, line) for name, line, code in BLOCKS if NO_RUN in code]
    with capsys.disabled():
        print(f"\n{len(skipped)} of {len(BLOCKS)} doc blocks need a GPU and were not run:")
        for name, line in skipped:
            print(f"  {name}:{line}")
    assert len(skipped) < len(BLOCKS)


def test_api_reference_covers_public_names() -> None:
    # Every name kvmgr exports appears in a `::: ` directive of docs/api/ (by its kvmgr name
    # or inside a documented module).
    text = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "api").glob("*.md"))
    directives = set(re.findall(r"^::: ([\w.]+)", text, flags=re.MULTILINE))
    documented_modules = {d for d in directives if d.count(".") >= 1}
    missing = []
    for name in kvmgr.__all__:
        if name.startswith("__"):
            continue
        if f"kvmgr.{name}" in directives:
            continue
        module = getattr(kvmgr, name).__module__ if name[0].isupper() else None
        if module in documented_modules:  # e.g. the errors, documented as kvmgr.errors
            continue
        missing.append(name)
    assert not missing, f"not in docs/api/: {missing}"
    for module in ("kvmgr.testing", "kvmgr.metrics", "kvmgr.policy"):
        assert module in directives, module
