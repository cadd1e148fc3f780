"""What a process holds, read from Linux's /proc: resident memory, open file descriptors and
threads of a process and its descendants (tensor-parallel ranks), and which process listens on
a loopback port (a `--url` server's pid). Nothing here needs psutil or root for one's own
processes; another user's process, or a system without /proc, reads as None."""
from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
# /proc/net/tcp's state column: 0A is LISTEN.
TCP_LISTEN = "0A"


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (children, their children, ...), from each process's parent id."""
    parents: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name is in parentheses and may hold spaces: the fields after it are fixed.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return sorted(out)


def process_sample(pid: int) -> dict | None:
    """RSS bytes, open fds and threads of `pid`, and of it with its descendants (`total`); None
    when the process is gone or not readable."""
    def one(p: int) -> dict:
        status = _status(p)
        return {"pid": p, "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
                "fds": len(os.listdir(PROC / str(p) / "fd")), "threads": int(status["Threads"])}

    try:
        main = one(pid)
    except (OSError, KeyError, ValueError):
        return None
    children = []
    for child in descendants(pid):
        try:
            children.append(one(child))
        except (OSError, KeyError, ValueError):  # it ended between the listing and the read
            continue
    every = [main, *children]
    return {**{k: main[k] for k in ("rss_bytes", "fds", "threads")},
            "total": {k: sum(p[k] for p in every) for k in ("rss_bytes", "fds", "threads")},
            "children": children}


def listening_pid(port: int) -> int | None:
    """The process with a TCP socket listening on `port` (IPv4 or IPv6), among those this user may read."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(entry.name)
        except OSError:  # another user's process, or one that ended
            continue
    return None
