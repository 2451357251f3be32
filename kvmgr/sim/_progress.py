"""Progress of ``kvmgr simulate``: a rich bar on a terminal, plain lines otherwise.

Private to ``kvmgr.sim`` (``cli`` and ``multi_cli``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["LineProgress", "progress_display"]


class LineProgress:
    """Progress as plain lines on stderr, for runs without a terminal (pipes, CI logs).

    The subset of ``rich.progress.Progress`` the command uses (``add_task``, ``update``,
    ``advance``, a context manager). A line is printed at every further tenth of the total and
    whenever ``every_s`` seconds passed since the last line: ``simulate: 4,812/12,031
    requests (40%), 0:01:07``.
    """

    def __init__(self, *, every_s: float = 30.0, stream: Any = None) -> None:
        self._every_s = every_s
        self._stream = stream
        self._tasks: dict[int, list[Any]] = {}  # id -> [description, total, done, tenth]
        self._start = self._last = time.monotonic()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: int) -> int:
        self._tasks[len(self._tasks)] = [description, max(int(total), 1), 0, 0]
        return len(self._tasks) - 1

    def advance(self, task: int, advance: int = 1) -> None:
        self.update(task, completed=self._tasks[task][2] + advance)

    def update(self, task: int, *, completed: int) -> None:
        entry = self._tasks[task]
        description, total, _done, tenth = entry
        entry[2] = completed
        now = time.monotonic()
        new_tenth = 10 * completed // total
        if new_tenth > tenth or now - self._last >= self._every_s:
            entry[3] = max(tenth, new_tenth)
            self._last = now
            elapsed = int(now - self._start)
            print(
                f"simulate: {completed:,}/{total:,} {description} ({completed / total:.0%}), "
                f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}",
                file=self._stream or sys.stderr,
                flush=True,
            )


def progress_display(console: Console, quiet: bool) -> Any:
    """A rich progress bar on a terminal, plain lines otherwise, nothing with ``--quiet``."""
    if not quiet and not console.is_terminal:
        return LineProgress()
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
        transient=True,
    )
