"""Move the test files into folders that mirror kvmgr's packages (issue 27: "tests/ mirrors the
packages"), and prove that pytest collects exactly the same tests afterwards.

    python3 scripts/mirror_tests.py            # plan only: what would move, what is unmapped
    python3 scripts/mirror_tests.py --apply    # git mv, fix paths, verify collection
    python3 scripts/mirror_tests.py --apply --no-verify   # skip the two collection runs

Run it from the repository root on a clean working tree (it refuses otherwise, so that
``git reset --hard`` undoes it). With ``--apply`` it:

1. checks the plan before touching anything: every mapped file exists; basenames stay unique
   under ``tests/`` (test modules are imported by basename: ``tests/`` has no ``__init__.py``,
   pytest's default ``prepend`` import mode); test files that import one another are listed;
2. runs ``pytest --collect-only -q`` and records every node id;
3. ``git mv``s each mapped file to ``tests/<folder>/`` and adds the ``sys.path`` lines below
   to ``tests/conftest.py``;
4. rewrites the moved files' ``Path(__file__)`` references to the repository root or to
   ``tests/`` (``parents[1]`` -> ``parents[2]``, ``Path(__file__).parent`` -> ``parents[1]``
   where it means the folder of the helpers); an unknown ``__file__`` use stops the run;
5. rewrites ``tests/test_x.py`` mentions in scripts, docs, the package, examples and tests
   (not in history: ``BENCHMARKS.md``, ``notes/``, ``docs/results/``);
6. collects again and compares the node ids, mapped to their new paths: equal sets, or exit 1.

No ``__init__.py`` and no new conftest: ``tests/conftest.py`` stays at the root (pytest puts
``tests/`` on ``sys.path`` before collecting, so the helpers that stay there, ``vllm_support.py``,
``tiers_server.py``, ``ranks_support.py``, ``mounts.py``, ..., and its ``pytest_plugins`` stay
importable by their plain names), and step 3 adds to it a few lines that put every folder under
``tests/`` on ``sys.path`` too: a test file that imports another (``from test_pinning import
FakeRegistrar``) finds it by name in any folder, in any collection order, as when they shared
one folder. Test files not in ``MAPPING`` (written after it) stay at ``tests/`` and are listed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

# test file -> folder under tests/ ("" = stays at the root: tests of the library as a whole).
# Decided by what each file imports and exercises (the kvmgr package it mostly tests).
MAPPING: dict[str, str] = {
    # the library as a whole: its public entry points, its CLI, its docs, bad input anywhere
    "test_bad_input.py": "",
    "test_cli.py": "",
    "test_config.py": "",
    "test_docs_snippets.py": "",
    "test_new_user.py": "",
    # kvmgr/bench
    "test_bench_pin.py": "bench",
    "test_tiers_bench.py": "bench",
    "test_vllm_bench.py": "bench",
    # kvmgr/events
    "test_events.py": "events",
    "test_events_vllm.py": "events",
    "test_events_zmq.py": "events",
    # examples/
    "test_example_engine.py": "examples",
    "test_example_hybrid.py": "examples",
    # kvmgr/groups
    "test_groups_index.py": "groups",
    "test_groups_manager.py": "groups",
    "test_groups_spec.py": "groups",
    "test_groups_workload.py": "groups",
    # kvmgr/integrations/vllm
    "test_vllm_backend.py": "integrations/vllm",
    "test_vllm_backend_manager.py": "integrations/vllm",
    "test_vllm_backend_worker.py": "integrations/vllm",
    "test_vllm_harness.py": "integrations/vllm",
    "test_vllm_policies.py": "integrations/vllm",
    "test_vllm_tiers.py": "integrations/vllm",
    # kvmgr/kernels
    "test_c128.py": "kernels",
    "test_copy_blocks.py": "kernels",
    "test_copy_kernel.py": "kernels",
    "test_dsv4_vllm_parity.py": "kernels",
    "test_launch.py": "kernels",
    "test_mla_insert.py": "kernels",
    # kvmgr/manager
    "test_backpressure.py": "manager",
    "test_manager.py": "manager",
    "test_manager_engines.py": "manager",
    "test_state_machine.py": "manager",
    "test_manager_tiers.py": "manager",
    "test_manager_v2.py": "manager",
    "test_reliability.py": "manager",
    # kvmgr/models
    "test_dsv4_state.py": "models",
    # kvmgr/policy
    "test_policy.py": "policy",
    "test_policy_fast_evict.py": "policy",
    "test_policy_learned.py": "policy",
    "test_policy_online.py": "policy",
    "test_policy_reference.py": "policy",
    # kvmgr/pool
    "test_allocator.py": "pool",
    "test_layout.py": "pool",
    # kvmgr/scheduler
    "test_queue.py": "scheduler",
    "test_scheduler_split.py": "scheduler",
    # kvmgr/sim
    "test_sim.py": "sim",
    "test_sim_hybrid.py": "sim",
    "test_sim_multi.py": "sim",
    # kvmgr/testing
    "test_stress.py": "testing",
    "test_testing_kit.py": "testing",
    # kvmgr/tiers
    "test_tiers_blob.py": "tiers",
    "test_tiers_cancel.py": "tiers",
    "test_tiers_cluster.py": "tiers",
    "test_tiers_config.py": "tiers",
    "test_tiers_disk.py": "tiers",
    "test_tiers_disk_faults.py": "tiers",
    "test_tiers_shared.py": "tiers",
    "test_tiers_shared_faults.py": "tiers",
    # kvmgr/transfer
    "test_cuda_engine.py": "transfer",
    "test_duplex.py": "transfer",
    "test_staged.py": "transfer",
    "test_staged_gpu.py": "transfer",
    "test_deferred_stores.py": "scheduler",
    "test_host_engine.py": "transfer",
    "test_layerwise.py": "transfer",
    "test_layerwise_fake_cuda.py": "transfer",
    "test_layerwise_gpu.py": "transfer",
    "test_pin_plan.py": "transfer",
    "test_pinning.py": "transfer",
    "test_plan.py": "transfer",
    # kvmgr/transport
    "test_ranks.py": "transport",
    "test_ranks_stateful.py": "transport",
}

# Where mentions of a test file's path are history, not instructions: left as written.
HISTORY = ("BENCHMARKS.md", "notes/", "docs/results/", "CHANGELOG")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".cfg", ".ini", ".txt", ""}

_ROOT_REF = re.compile(r"Path\(__file__\)(\.resolve\(\))?(\.parents\[(\d)\]|(\.parent)+)")
_OWN_FILE = re.compile(r"(?<![.\w])__file__")
_TEST_IMPORT = re.compile(r"^\s*(?:from|import)\s+(test_\w+)", re.M)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def _plan() -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """``(moves: name -> folder, unmapped test files, problems, notes)`` for the tree as it is."""
    present = sorted(p.name for p in TESTS.glob("test_*.py"))
    moves = {n: MAPPING[n] for n in present if MAPPING.get(n)}
    unmapped = [n for n in present if n not in MAPPING]
    problems = [f"{n}: in MAPPING but not in tests/" for n in MAPPING if not (TESTS / n).exists()]
    names = [p.name for p in TESTS.rglob("*.py")]
    problems += [
        f"{n}: two files of this name under tests/" for n in set(names) if names.count(n) > 1
    ]
    notes = []
    for name in present:
        for imported in sorted(set(_TEST_IMPORT.findall((TESTS / name).read_text()))):
            here, there = MAPPING.get(name, ""), MAPPING.get(f"{imported}.py", "")
            if (TESTS / f"{imported}.py").exists() and here != there:
                notes.append(
                    f"{name} ({here or '.'}) imports {imported} ({there or '.'}): found through "
                    "the conftest's sys.path lines"
                )
    return moves, unmapped, problems, notes


_CONFTEST_LINES = """
# The test files live in folders that mirror kvmgr's packages (scripts/mirror_tests.py); they
# import one another and the helpers here by their plain names, as when they shared one folder.
sys.path[:0] = sorted({str(p.parent) for p in Path(__file__).parent.glob("*/**/test_*.py")})
"""


def _extend_conftest() -> None:
    """Put every folder under ``tests/`` on ``sys.path`` from ``tests/conftest.py`` (once)."""
    path = TESTS / "conftest.py"
    text = path.read_text()
    if "scripts/mirror_tests.py" in text:
        return
    tree = ast.parse(text)
    names = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    froms = {
        (n.module, a.name) for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names
    }
    wanted = ["import sys\n"] if "sys" not in names else []
    wanted += ["from pathlib import Path\n"] if ("pathlib", "Path") not in froms else []
    last_import = max(
        n.end_lineno or n.lineno for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)
    )
    lines = text.splitlines(keepends=True)
    lines[last_import:last_import] = wanted
    text = "".join(lines)
    anchor = text.index("\n", text.index("pytest_plugins")) + 1
    path.write_text(text[:anchor] + _CONFTEST_LINES + text[anchor:])
    with contextlib.suppress(FileNotFoundError):  # sort the two imports as the lint wants
        subprocess.run(["ruff", "check", "-q", "--fix", "--select", "I", str(path)], check=False)


def _collect() -> set[str]:
    """Node ids that ``pytest --collect-only -q`` prints (it exits 0 or 5: none collected)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode not in (0, 5):
        sys.exit(f"collection failed (exit {out.returncode}):\n{out.stdout[-4000:]}{out.stderr}")
    return {line for line in out.stdout.splitlines() if "::" in line}


def _fix_file_refs(path: Path, depth: int) -> list[str]:
    """Rewrite ``Path(__file__)`` climbs in a file moved ``depth`` folders down; what remains
    unknown (a ``__file__`` use this does not understand) is returned."""
    text = path.read_text()

    def climb(match: re.Match[str]) -> str:
        up = int(match.group(3)) + 1 if match.group(3) else match.group(0).count(".parent")
        resolve = match.group(1) or ""
        return f"Path(__file__){resolve}.parents[{up - 1 + depth}]"

    lines, unknown = [], []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        if _OWN_FILE.search(line) and not line.lstrip().startswith("#"):  # not module.__file__
            line = _ROOT_REF.sub(climb, line)
            if _OWN_FILE.search(_ROOT_REF.sub("", line)):
                unknown.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
        lines.append(line)
    path.write_text("".join(lines))
    return unknown


def _fix_mentions(moves: dict[str, str]) -> list[str]:
    """Rewrite ``tests/<name>`` to ``tests/<folder>/<name>`` in tracked text files."""
    pattern = re.compile(r"\btests/(" + "|".join(re.escape(n) for n in moves) + r")\b")
    changed = []
    for rel in _git("ls-files").splitlines():
        path = ROOT / rel
        if rel.startswith(HISTORY) or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = pattern.sub(lambda m: f"tests/{moves[m.group(1)]}/{m.group(1)}", text)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apply", action="store_true", help="move the files (default: plan)")
    parser.add_argument("--no-verify", action="store_true", help="skip the collection check")
    args = parser.parse_args(argv)
    moves, unmapped, problems, notes = _plan()
    for name, folder in moves.items():
        print(f"  tests/{name} -> tests/{folder}/{name}")
    print(f"{len(moves)} to move, {len(MAPPING) - len(moves)} stay at tests/ by the mapping")
    if unmapped:
        print("not in MAPPING (they stay at tests/):", ", ".join(unmapped))
    for note in notes:
        print("note:", note)
    if problems:
        print("refused, nothing moved:\n  " + "\n  ".join(problems))
        return 1
    if not args.apply:
        return 0
    if _git("status", "--porcelain", "--untracked-files=no").strip():
        print("refused: commit or stash your changes first (git reset --hard then undoes this)")
        return 1
    before = set() if args.no_verify else _collect()
    unknown = []
    for name, folder in moves.items():
        (TESTS / folder).mkdir(parents=True, exist_ok=True)
        _git("mv", f"tests/{name}", f"tests/{folder}/{name}")
        unknown += _fix_file_refs(TESTS / folder / name, depth=len(Path(folder).parts))
    _extend_conftest()
    changed = _fix_mentions(moves)
    print(f"moved {len(moves)} files; path mentions rewritten in {len(changed)} files")
    if unknown:
        print("uses of __file__ to check by hand:\n  " + "\n  ".join(unknown))
        return 1
    if args.no_verify:
        return 0
    after = _collect()
    renamed = {
        re.sub(
            r"^tests/([^/:]+\.py)",
            lambda m: f"tests/{moves[m.group(1)]}/{m.group(1)}" if m.group(1) in moves else m[0],
            node,
        )
        for node in before
    }
    if renamed != after:
        print(f"collection differs: {len(before)} before, {len(after)} after")
        for node in sorted(renamed - after)[:20]:
            print("  lost:", node)
        for node in sorted(after - renamed)[:20]:
            print("  new: ", node)
        print("undo: git reset --hard")
        return 1
    print(f"collection unchanged: {len(before)} tests before, {len(after)} after")
    _git("add", "-A", ".")
    print("staged; review with git status, then commit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
