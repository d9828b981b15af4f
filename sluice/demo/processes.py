"""Launching and stopping the demo's processes: two replicas, the gateway, a routing worker.

Each child runs in its own session (process group) so that killing a replica
takes its tritonserver with it, as losing the machine would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Child:
    label: str
    argv: list[str]
    ready_marker: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_offset: int = 0          # where this start's output begins (the log is appended to)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen([sys.executable, *self.argv], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        assert self.process is not None, f"{self.label} was never started"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_marker in self._output_since_start():
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.process.returncode}; see {self.log_path}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.label} not ready after {timeout_s:.0f} s; see {self.log_path}")

    def _output_since_start(self) -> str:
        with self.log_path.open("rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole group: no goodbye, like a lost machine."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)   # leftovers in the group (tritonserver)
        except ProcessLookupError:
            pass


def replica(name: str, log_dir: Path) -> Child:
    return Child(f"replica {name}", ["-m", "sluice.replica.serve", "--name", name],
                 f"replica {name} ready", log_dir / f"replica-{name}.log")


def gateway(log_dir: Path) -> Child:
    return Child("gateway", ["-m", "sluice.services.main", "--role", "gateway"],
                 "gateway (admission, runs, usage)", log_dir / "gateway.log")


def routing(log_dir: Path) -> Child:
    return Child("routing worker", ["-m", "sluice.services.routing", "--serve-api"], "routing worker",
                 log_dir / "routing.log")
