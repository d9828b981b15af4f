"""`python -m bench` (`make bench`): every benchmark that needs no running stack, in turn.

Each prints figures and ratios measured side by side in one run; none fails on
timing. bench.bench_run_path needs a running Sluice (see its docstring).
"""

from __future__ import annotations

import subprocess
import sys
import time

BENCHES = [
    ("admission Submit latency (real PostgreSQL)", ["-m", "bench.bench_submit", "-n", "1000"]),
    ("what tracing and metrics add per Submit and per run", ["-m", "bench.bench_telemetry"]),
    ("prompt tokenization: the library against remembered pieces", ["-m", "bench.bench_tokenize"]),
    ("prompt ids in PostgreSQL: pglz, lz4, uncompressed", ["-m", "bench.bench_prompt_storage"]),
    ("routing policies on the fleet simulator + decision cost", ["-m", "bench.bench_router"]),
    ("replica: engine core behind real Triton", ["bench/bench_replica.py", "--concurrency", "1,8"]),
    ("routing worker's per-token paths: replica reads, the driver loop", ["-m", "bench.bench_data_path"]),
    ("fleet simulator: seed 003's fleet, 10 simulated minutes", ["-m", "sim", "--preset", "seed003"]),
]


def main() -> int:
    failures = 0
    for title, argv in BENCHES:
        print(f"\n=== {title}: python {' '.join(argv)}", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, *argv])
        print(f"=== exit {code}, {time.monotonic() - started:.0f} s wall", flush=True)
        failures += code != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
