"""Progress bars for long phases, on a terminal only: a log file or a CI console gets the
plain lines the phases print anyway."""

from __future__ import annotations

import sys
from contextlib import contextmanager


class _Silent:
    def update(self, count: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


@contextmanager
def progress(total: int, description: str):
    """A tqdm bar on stderr when it is a terminal, else an object that ignores updates."""
    if not sys.stderr.isatty():
        yield _Silent()
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=description, leave=False, dynamic_ncols=True) as bar:
        yield bar
