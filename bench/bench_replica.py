"""Replica benchmark: a real Triton replica running the engine core, driven over gRPC.

    .venv/bin/python bench/bench_replica.py                       # 70B FP8 on 8 × H100, real time
    .venv/bin/python bench/bench_replica.py --time-scale 0.5 --concurrency 1,16,64

For each concurrency level it sends that many streaming requests at once
(distinct prompts of --prompt tokens, --output tokens each, no end_id) and
prints:

- tokens/s: streamed tokens over the wall time of the level;
- step-time fidelity: the gaps between a request's streamed tokens (each is one
  engine step, as TensorRT-LLM streams) against the cost model's decode step
  for that batch and context, times the time scale. A ratio near 1 means the
  replica keeps the modelled pace; above 1, host overhead (Python, Triton IPC)
  adds to every step;
- CPU per generated token: CPU seconds of the replica's whole process group
  (the Python host, tritonserver and its Python-backend stub) over the tokens
  streamed; and, for comparison, the engine core's own share, measured
  in-process by stepping the same load through `EngineCore` alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import sluice.services.replica_client as rc

from sluice.autoscaler.local import free_ports as free_ports  # re-exported: tests import it from here
from sluice.config.settings import env_overrides
from sluice.replica.engine_api import GenerationRequest
from sluice.replica.engine_core_adapter import CoreEngine, CoreSettings

REPO_ROOT = Path(__file__).resolve().parent.parent

READY_MARKER = "ready model=tensorrt_llm"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class LevelResult:
    concurrency: int
    wall_s: float
    tokens: int
    gaps_s: tuple[float, ...]          # every inter-token gap of every request
    predicted_step_s: float            # mean modelled decode step over the run, scaled
    cpu_s: float
    core_cpu_s: float                  # the same load through EngineCore alone, in-process

    def row(self) -> str:
        gaps = sorted(self.gaps_s)
        p50 = gaps[len(gaps) // 2] if gaps else float("nan")
        p95 = gaps[int(len(gaps) * 0.95)] if gaps else float("nan")
        mean = statistics.fmean(gaps) if gaps else float("nan")
        return (f"{self.concurrency:>6}{self.tokens / self.wall_s:>11,.0f}{p50 * 1e3:>9.2f}{p95 * 1e3:>9.2f}"
                f"{self.predicted_step_s * 1e3:>11.2f}{mean / self.predicted_step_s:>8.2f}"
                f"{self.cpu_s / max(self.tokens, 1) * 1e3:>12.3f}"
                f"{self.core_cpu_s / max(self.tokens, 1) * 1e6:>15.1f}")


def group_cpu_seconds(session: int) -> float:
    """utime + stime of every live process in the session `session` (the replica's process group)."""
    return sessions_cpu_seconds({session})[session]


def sessions_cpu_seconds(sessions: set[int]) -> dict[int, float]:
    """group_cpu_seconds of several sessions, in one pass over /proc."""
    totals = dict.fromkeys(sessions, 0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        session = int(fields[3])               # field 6 (session) after the state field
        if session in totals:
            totals[session] += int(fields[11]) + int(fields[12])
    return {session: total / CLOCK_TICKS for session, total in totals.items()}


def start_replica(settings: dict[str, object], log_path: Path, *, name: str = "bench", pool: str = "bench",
                  ports: Sequence[int] | None = None,
                  module: str = "sluice.replica.serve") -> tuple[subprocess.Popen[bytes], str]:
    """A replica on `ports` (grpc, http, metrics; default free ones); returns it and its gRPC address.
    `module`: bench.wire_replica for the simple engine on the wire without Triton."""
    grpc_port, http_port, metrics_port = ports or free_ports(3)
    env = dict(os.environ)
    entry = {"name": name, "pool": pool, "grpc_address": f"127.0.0.1:{grpc_port}",
             "http_port": http_port, "metrics_port": metrics_port}
    env["SLUICE_REPLICAS"] = json.dumps([entry])
    env.update(env_overrides("replica", settings))
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", module, "--name", name],
                                   cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + 90
    while READY_MARKER not in log_path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_replica(process)
            raise SystemExit(f"the replica did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    return process, f"127.0.0.1:{grpc_port}"


def stop_replica(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def one_request(address: str, request_id: str, prompt: list[int], output: int) -> list[float]:
    arrivals = []
    async for _chunk in rc.stream_generate(address, request_id, prompt, output, seed=len(request_id)):
        arrivals.append(time.perf_counter())
    return [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]


def core_cpu_seconds(settings: CoreSettings, prompts: list[list[int]], output: int) -> float:
    """CPU time of EngineCore alone (streaming outputs, as the host uses it) for the same load."""
    engine = CoreEngine(settings)
    for index, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"core-{index}", tuple(prompt), output, None, index))
    started = time.process_time()
    while engine.has_work():
        engine.step()
    return time.process_time() - started


async def run_level(address: str, pid: int, concurrency: int, prompt_len: int, output: int,
                    settings: CoreSettings, level_index: int) -> LevelResult:
    prompts = [[1000 + level_index * 100_000 + index * prompt_len + t for t in range(prompt_len)]
               for index in range(concurrency)]
    cpu_before = group_cpu_seconds(pid)
    started = time.perf_counter()
    gaps = await asyncio.gather(*(one_request(address, f"l{level_index}-r{index}", prompt, output)
                                  for index, prompt in enumerate(prompts)))
    wall = time.perf_counter() - started
    cpu = group_cpu_seconds(pid) - cpu_before
    cost = settings.cost_model()
    # Steady decode: every request decodes once per step at context prompt + k, k = 1 .. output − 1.
    modelled = [cost.step_time_s(0, [prompt_len + k] * concurrency) for k in range(1, output)]
    return LevelResult(concurrency=concurrency, wall_s=wall, tokens=concurrency * output,
                       gaps_s=tuple(g for request in gaps for g in request),
                       predicted_step_s=statistics.fmean(modelled) * settings.time_scale, cpu_s=cpu,
                       core_cpu_s=core_cpu_seconds(settings, prompts, output))


async def run(args: argparse.Namespace) -> None:
    replica_settings: dict[str, object] = {
        "engine": "core", "model": args.model, "weights": args.weights, "kv": args.kv or args.weights,
        "hardware": args.hardware, "tp": args.tp, "time_scale": args.time_scale, "block_size": 32,
        "max_num_seqs": max(args.concurrency), "max_num_tokens": 8192, "vocab_size": 128_256,
    }
    settings = CoreSettings.from_section(replica_settings)
    with tempfile.TemporaryDirectory() as tmp:
        process, address = start_replica(replica_settings, Path(tmp) / "replica.log")
        try:
            await one_request(address, "warmup", [1, 2, 3], 4)
            print(f"replica: {args.model} {args.weights} on {args.tp} × {args.hardware}, time scale "
                  f"{args.time_scale}; prompts {args.prompt} tokens, {args.output} output tokens each")
            print(f"{'conc':>6}{'tokens/s':>11}{'ITL p50':>9}{'ITL p95':>9}{'predicted':>11}{'ratio':>8}"
                  f"{'CPU ms/tok':>12}{'core us/tok':>15}")
            for index, concurrency in enumerate(args.concurrency):
                result = await run_level(address, process.pid, concurrency, args.prompt, args.output,
                                         settings, index)
                print(result.row(), flush=True)
        finally:
            await rc.close_channels()
            stop_replica(process)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-70b")
    parser.add_argument("--weights", default="fp8")
    parser.add_argument("--kv", default="")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per modelled second")
    parser.add_argument("--concurrency", type=lambda text: [int(x) for x in text.split(",")],
                        default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
