"""The TCP ports a process tree listens on (psutil), for the tests that check what a run or a
Ray head exposes."""

from __future__ import annotations

import psutil


def listening_sockets(pid: int) -> dict[str, list]:
    """`"pid command line"` -> the listening addresses (`.ip`, `.port`) of the process `pid` and
    of every descendant; a process that exits while it is read is left out."""
    root = psutil.Process(pid)
    listening: dict[str, list] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(process.cmdline()) or process.name()
            listening[f"{process.pid} {name}"] = [c.laddr for c in process.net_connections("tcp")
                                                  if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return listening
