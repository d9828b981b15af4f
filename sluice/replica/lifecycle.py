"""Leave nothing behind: tritonserver, its Python-backend stub and their shared memory.

A replica is three processes: this Python host, the tritonserver pytriton
spawns, and Triton's `triton_python_backend_stub` (which relays requests to
the host). What goes wrong without help (measured on pytriton 0.7 / Triton 2.x):

- Host SIGKILLed alone (OOM killer, `kill -9 <pid>`): pytriton spawns
  tritonserver with PR_SET_PDEATHSIG=SIGTERM; tritonserver's graceful shutdown
  then waits forever on the stub, which waits on the dead host, so both live
  on and hold the replica's ports (a restart fails "port in use").
  `wrap_tritonserver_pdeathsig` makes the death signal SIGKILL; the stub then
  notices its parent is gone (it polls every 300 ms) and exits.
- SIGTERM while a stream is in flight: pytriton's stop() waits for every
  request to finish (a 100k-token request: many minutes). `serve` bounds the
  stop and then SIGKILLs its own descendants (`kill_descendants`).
- The stub ignores SIGTERM and SIGINT; its parent check first takes a mutex in
  shared memory, so a tritonserver killed while holding it leaves the stub
  blocked for good (the orphans seen on the dev box: ppid 1, all threads in
  futex wait). Only SIGKILL ends it; killing the replica's process group with
  SIGKILL does (the stub is in the group).
  The SIGKILL death signal above can trigger this too (about 1 host kill in 4
  on the dev box), so at start a replica also ends such orphans of replicas
  that are gone (`kill_orphaned_stubs`).
- Every replica gets a 4 MiB region /dev/shm/pytrtion<host pid>-...; only a
  clean tritonserver exit unlinks it, so each killed replica leaked one.
  `remove_stale_shm_regions` deletes those whose host pid is gone, at start.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOG = logging.getLogger("replica")

SHM_DIR = Path("/dev/shm")
_REGION = re.compile(r"^pytrtion(\d+)-")       # pytriton's shm-region-prefix-name: pytrtion<pid>-<hex>
WRAPPER_NAME = "tritonserver-pdeathsig"
STUB_NAME = "triton_python_backend_stub"
_WRAPPER = """#!/bin/sh
# Written by replica/lifecycle.py: die with the replica host (SIGKILL, not pytriton's SIGTERM).
exec {setpriv} --pdeathsig KILL -- "$(dirname "$0")/tritonserver" "$@"
"""


def pid_alive(pid: int, proc: Path = Path("/proc")) -> bool:
    """A running process (a zombie, killed but not yet reaped by its parent, counts as dead)."""
    try:
        state = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stale_shm_regions(shm_dir: Path = SHM_DIR, alive: Callable[[int], bool] = pid_alive) -> list[Path]:
    """pytriton shared-memory regions whose owning replica process no longer exists."""
    if not shm_dir.is_dir():
        return []
    stale = []
    for path in sorted(shm_dir.iterdir()):
        match = _REGION.match(path.name)
        if match and not alive(int(match.group(1))):
            stale.append(path)
    return stale


def remove_stale_shm_regions(shm_dir: Path = SHM_DIR, alive: Callable[[int], bool] = pid_alive) -> int:
    removed = 0
    for path in stale_shm_regions(shm_dir, alive):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass                                   # another replica starting now removed it first
    return removed


def remove_own_shm_regions(pid: int | None = None, shm_dir: Path = SHM_DIR) -> None:
    """After tritonserver is gone: its region, if it could not unlink it itself."""
    prefix = f"pytrtion{os.getpid() if pid is None else pid}-"
    for path in shm_dir.glob(prefix + "*"):
        path.unlink(missing_ok=True)


def orphaned_stubs(proc: Path = Path("/proc"), alive: Callable[[int], bool] = pid_alive) -> list[int]:
    """Python-backend stubs whose replica host is dead and whose tritonserver is gone.

    A stub's argv is `model.py <shm prefix pytrtion<host pid>-...> <sizes> <sizes> <tritonserver pid> ...`.
    """
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [arg.decode(errors="replace") for arg in (entry / "cmdline").read_bytes().split(b"\0")]
            if not argv[0].endswith("/" + STUB_NAME) or len(argv) < 6:
                continue
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            host = _REGION.match(argv[2])
            if host and not alive(int(host.group(1))) and ppid != int(argv[5]):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def kill_orphaned_stubs() -> int:
    killed = 0
    for pid in orphaned_stubs():
        try:
            os.kill(pid, signal.SIGKILL)        # it ignores SIGTERM (see the module doc)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Every live descendant of `pid` (children first), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may contain spaces and parentheses; fields resume after the last ")".
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        kids = [kid for parent in frontier for kid in children.get(parent, [])]
        found.extend(kids)
        frontier = kids
    return found


def kill_descendants() -> list[int]:
    """SIGKILL everything this process spawned (tritonserver and the stub), stub first."""
    victims = descendants(os.getpid())
    for pid in reversed(victims):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


def wrap_tritonserver_pdeathsig(triton: Any) -> bool:
    """Make the tritonserver that `triton.run()` is about to spawn die by SIGKILL with this process.

    pytriton runs `<workspace>/tritonserver/bin/tritonserver` with PDEATHSIG=SIGTERM from a
    preexec hook; a wrapper script beside it re-sets the signal with util-linux `setpriv` and
    execs the real binary (same pid, so pytriton's process handle and Triton's stub parent
    check are unaffected). Returns False, changing nothing, where `setpriv` is missing.
    """
    setpriv = shutil.which("setpriv")
    server = getattr(triton, "_triton_server", None)
    path = getattr(server, "_server_path", None)
    if setpriv is None or server is None or path is None:
        LOG.warning("tritonserver keeps pytriton's SIGTERM death signal (setpriv %s, server path %s)",
                    setpriv, path)
        return False
    wrapper = Path(path).with_name(WRAPPER_NAME)
    wrapper.write_text(_WRAPPER.format(setpriv=setpriv))
    wrapper.chmod(0o755)
    server._server_path = wrapper
    return True
