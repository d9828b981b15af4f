"""replica.lifecycle: what a killed replica leaves behind is found and removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from sluice.replica.lifecycle import (
    WRAPPER_NAME,
    descendants,
    orphaned_stubs,
    pid_alive,
    remove_stale_shm_regions,
    wrap_tritonserver_pdeathsig,
)


def test_shm_regions_of_dead_replicas_are_removed_and_live_or_foreign_ones_kept(tmp_path: Path) -> None:
    for name in ("pytrtion100-aa-1", "pytrtion200-bb-2", "pytrtion300-cc-3", "PostgreSQL.1", "psm_1"):
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_shm_regions(tmp_path, alive=lambda pid: pid == 200)
    assert removed == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["PostgreSQL.1", "psm_1", "pytrtion200-bb-2"]


def test_descendants_finds_children_and_grandchildren() -> None:
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
              "print('ok', flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        found = descendants(os.getpid())
        assert child.pid in found
        grandchildren = [pid for pid in found if pid != child.pid and pid in descendants(child.pid)]
        assert len(grandchildren) == 1
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()


class _Server:
    def __init__(self, path: Path) -> None:
        self._server_path = path


class _Triton:
    def __init__(self, path: Path) -> None:
        self._triton_server = _Server(path)


def test_the_tritonserver_wrapper_execs_the_real_binary_with_a_sigkill_death_signal(tmp_path: Path) -> None:
    real = tmp_path / "tritonserver"          # stands in for the binary: prints its death signal and args
    real.write_text(f"#!{sys.executable}\n"
                    "import ctypes, sys\n"
                    "signal = ctypes.c_int()\n"
                    "ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(signal))  # PR_GET_PDEATHSIG\n"
                    "print(signal.value, sys.argv[1:])\n")
    real.chmod(0o755)
    triton = _Triton(real)
    assert wrap_tritonserver_pdeathsig(triton) is True
    wrapper = triton._triton_server._server_path
    assert wrapper == tmp_path / WRAPPER_NAME
    result = subprocess.run([str(wrapper), "--http-port", "1 2"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"{signal.SIGKILL.value} ['--http-port', '1 2']"


def fake_process(proc: Path, pid: int, ppid: int, argv: list[str]) -> None:
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "stat").write_text(f"{pid} (x y) S {ppid} {pid} {pid} 0")
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_a_stub_is_orphaned_when_its_host_is_dead_and_its_tritonserver_gone(tmp_path: Path) -> None:
    stub = "/ws/tritonserver/backends/python/triton_python_backend_stub"

    def args(host: int, server: int) -> list[str]:
        return [stub, "/tmp/f/1/model.py", f"pytrtion{host}-ab-cd", "4194304", "1048576", str(server), "/ws"]

    fake_process(tmp_path, 11, 1, args(host=10, server=9))       # host 10 dead, tritonserver 9 gone
    fake_process(tmp_path, 21, 20, args(host=19, server=20))     # tritonserver 20 still its parent
    fake_process(tmp_path, 31, 1, args(host=30, server=29))      # host 30 alive (its server just died)
    fake_process(tmp_path, 41, 1, ["/usr/bin/python", "x", "pytrtion40-ab", "1", "2", "3"])
    assert orphaned_stubs(tmp_path, alive=lambda pid: pid == 30) == [11]


def test_a_zombie_counts_as_dead(tmp_path: Path) -> None:
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "stat").write_text("5 (python) Z 1 5 5 0")
    (tmp_path / "6").mkdir()
    (tmp_path / "6" / "stat").write_text("6 (tritonserver) S 1 6 6 0")
    assert (pid_alive(5, tmp_path), pid_alive(6, tmp_path), pid_alive(7, tmp_path)) == (False, True, False)
