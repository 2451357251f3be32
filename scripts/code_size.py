"""Code shape of a package: files over 300 lines, functions over 40 lines, module-level import
circles (issue 27, "code that reads like its job").

    python3 scripts/code_size.py [PACKAGE_DIR] [--list]

Counts every ``.py`` file below ``PACKAGE_DIR`` (default ``kvmgr``): lines as ``wc -l``
counts them, a function's lines from its ``def`` to its last line (``ast``), and the strongly
connected components of the import graph (imports at module level, ``TYPE_CHECKING`` blocks
left out) with more than one module. ``--list`` prints each file and function over the limits.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES, MAX_FUNCTION_LINES = 300, 40


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in node.body if isinstance(node, ast.Try) else [node]:
            if isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[: len(here) - sub.level + 1] + ([base] if base else []))
                for alias in sub.names:
                    full = f"{base}.{alias.name}"
                    out.add(full if full in modules else base)
            elif isinstance(sub, ast.Import):
                out.update(alias.name for alias in sub.names)
    return out & modules


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def main(argv: list[str]) -> int:
    root = Path(next((a for a in argv if not a.startswith("-")), "kvmgr"))
    paths = sorted(root.rglob("*.py"))
    modules = {_module_name(p, root): p for p in paths}
    big_files, big_functions, edges = [], [], {}
    for name, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text)
        if (lines := len(text.splitlines())) > MAX_FILE_LINES:
            big_files.append((lines, str(path)))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big_functions.append((length, f"{path}:{node.lineno} {node.name}"))
        edges[name] = _imports(tree, name, path.name == "__init__.py", set(modules))
    circles = _circles(edges)
    print(f"files over {MAX_FILE_LINES} lines: {len(big_files)}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(big_functions)}")
    print(f"import circles: {len(circles)}")
    if "--list" in argv:
        for lines, where in sorted(big_files, reverse=True) + sorted(big_functions, reverse=True):
            print(f"  {lines:4d}  {where}")
        for circle in circles:
            print("  circle:", " -> ".join(circle))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
