"""`python -m sluice.replica.serve --name r0`: one Triton replica serving `tensorrt_llm`.

Triton comes from the nvidia-pytriton wheel. The model is decoupled: an async
generator callable yields one response per newly generated token, and since
pytriton runs each call as a task on one event loop (and a decoupled execute()
returns at once), many requests stream together from one engine loop.

Cancellation follows TensorRT-LLM: a request with the same request id and
stop=true aborts the running one (whose stream then ends with the empty final
response) and itself returns at once with no outputs. pytriton does not pass
gRPC cancellation or the Triton request id to the callable, hence the id also
travels as a request parameter (replica.protocol.REQUEST_ID_PARAM).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import sysconfig
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sluice.config import Settings
from sluice.config.bootstrap import start_process
from sluice.config.settings import LOOPBACK_HOSTS, ReplicaTlsSection
from sluice.replica import lifecycle
from sluice.replica.contract import prompt_and_cap, sampling, stop_words
from sluice.replica.engine_api import Engine, EngineRequestError, GenerationRequest
from sluice.replica.generator import GeneratorConfig, SimpleGenerator, prompt_seed
from sluice.replica.host import EngineHost, RequestIdInUse, take_ready
from sluice.replica.metrics import ReplicaMetrics
from sluice.replica.protocol import (
    ERR_BATCH,
    ERR_MISSING,
    MODEL_NAME,
    REQUEST_ID_PARAM,
)

LOG = logging.getLogger("replica")
ERR_PORT_IN_USE = "replica {name}: {kind} port {port} on {host} is already in use (another replica running?)"
ERR_UNKNOWN_ENGINE = "[replica].engine must be \"simple\" or \"core\", got {!r}"
STRICT = "tensorrt_llm"                  # [replica].interface: the pinned backend's interface (contract.py)
ERR_ENGINE_CONFIG = "[replica] settings for engine {engine!r} are invalid: {error}"
DEFAULT_ENGINE = "core"                  # as config/sluice.toml; used when [replica].engine is absent
ERR_UNKNOWN_REPLICA = "no [[replicas]] entry named {!r} in the config (known: {})"
ERR_PLAINTEXT_OFF_LOOPBACK = (
    "refusing plaintext gRPC on {address}: configure [replica_tls] cert_file/key_file"
    " (or set [tls].plaintext_off_loopback = true to accept the risk)")
ERR_NO_PORTS = "[[replicas]] entry {name!r} needs http_port and metrics_port to be served here"
ERR_TRITON_START = "replica {name}: tritonserver could not start: {error}"
EXIT_STARTUP_FAILED = 2
STOP_TIMEOUT_S = 5.0                     # SIGTERM: wait this long for Triton to stop, then kill it
ERR_STOP_TIMEOUT = "Triton did not stop within {seconds:.0f}s (requests still streaming); killed it"
ERR_TRITON_EXITED = "tritonserver exited during startup (its log lines above say why)"


class StartupError(RuntimeError):
    """The replica cannot start; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    name: str
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    generator: GeneratorConfig | None    # the simple engine's settings (None: another engine)
    workspace: Path | None = None        # pytriton workspace (model store, sockets); None: a temp dir
    section: Mapping[str, Any] = field(default_factory=dict)   # raw [replica] table (engine choice)
    model_cache: Path | None = None      # where a model executor caches dequantized weights
    tls: Mapping[str, Any] = field(default_factory=dict)   # TritonConfig's grpc_* TLS keywords ({}: none)


def settings_from_config(config: Settings, name: str) -> ReplicaSettings:
    """The entry's own `replica = {…}` table (e.g. `executor = "model"`) overrides `[replica]` for it,
    so one config serves replicas of different models."""
    entry = next((e for e in config.replicas if e.name == name), None)
    if entry is None:
        raise StartupError(ERR_UNKNOWN_REPLICA.format(name, ", ".join(e.name for e in config.replicas)))
    if entry.http_port is None or entry.metrics_port is None:
        raise StartupError(ERR_NO_PORTS.format(name=name))
    host, _, grpc_port = entry.grpc_address.rpartition(":")
    host = host or "127.0.0.1"
    section = config.replica_section_for(entry).model_dump()
    if not (config.replica_tls.cert_file or host in LOOPBACK_HOSTS or config.tls.plaintext_off_loopback):
        raise StartupError(ERR_PLAINTEXT_OFF_LOOPBACK.format(address=entry.grpc_address))
    return ReplicaSettings(name=name, host=host, http_port=entry.http_port,
                           grpc_port=int(grpc_port), metrics_port=entry.metrics_port,
                           generator=generator_config(section),
                           workspace=config.data_dir() / "replicas" / f"{name}-{grpc_port}",
                           section=section, model_cache=config.data_dir() / "models",
                           tls=triton_tls(config.replica_tls))


def triton_tls(section: ReplicaTlsSection) -> dict[str, Any]:
    """[replica_tls] as TritonConfig keywords: TLS on Triton's gRPC endpoint, mutual with a client CA."""
    if not section.cert_file:
        return {}
    options: dict[str, Any] = {"grpc_use_ssl": True, "grpc_server_cert": Path(section.cert_file),
                               "grpc_server_key": Path(section.key_file)}
    if section.client_ca_file:
        options.update(grpc_use_ssl_mutual=True, grpc_root_cert=Path(section.client_ca_file))
    return options


def generator_config(section: Mapping[str, Any]) -> GeneratorConfig | None:
    """The simple engine's settings; None when `[replica].engine` picks another engine (whose
    keys, e.g. output_length = "lognormal", the simple engine need not understand)."""
    if str(section.get("engine", DEFAULT_ENGINE)) != "simple":
        return None
    defaults = GeneratorConfig()
    try:
        return GeneratorConfig(
            vocab_size=int(section.get("vocab_size", defaults.vocab_size)),
            first_normal_id=int(section.get("first_normal_id", defaults.first_normal_id)),
            output_length=str(section.get("output_length", defaults.output_length)),
            min_fraction=float(section.get("min_fraction", defaults.min_fraction)),
            token_delay_s=float(section.get("token_delay_ms", defaults.token_delay_s * 1000)) / 1000.0,
            max_batch=int(section.get("max_batch", defaults.max_batch)),
        )
    except (ValueError, AssertionError) as exc:
        raise StartupError(ERR_ENGINE_CONFIG.format(engine="simple", error=exc)) from None


def ensure_libpython_on_library_path() -> None:
    """Triton's Python backend stub links against libpythonX.Y.so; pyenv keeps it off the default path.

    pytriton copies os.environ when it spawns tritonserver, so setting it here
    (before Triton starts) is enough; no re-exec of this process is needed.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir:
        return
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir not in current.split(":"):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else libdir


def check_ports_free(settings: ReplicaSettings) -> None:
    for kind, port in (("http", settings.http_port), ("grpc", settings.grpc_port),
                       ("metrics", settings.metrics_port)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((settings.host, port))
            except OSError as exc:
                raise StartupError(ERR_PORT_IN_USE.format(name=settings.name, kind=kind, port=port,
                                                          host=settings.host)) from exc


def _fresh_workspace(path: Path | None) -> str | None:
    """A fixed per-replica workspace, so a killed replica's copy of tritonserver (~20 MB) is
    reused on restart instead of piling up under ~/.cache/pytriton. The port check has already
    shown that no live replica uses it."""
    if path is None:
        return None
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def _scalar(data: Mapping[str, NDArray[Any]], name: str, default: Any = None) -> Any:
    if name not in data:
        if default is None:
            raise EngineRequestError(ERR_MISSING.format(name))
        return default
    return data[name].reshape(-1)[0].item()


def parse_request(data: Mapping[str, NDArray[Any]], request_id: str) -> GenerationRequest:
    """Turn TRT-LLM style tensors (batch dim first) into a GenerationRequest; raises on bad input."""
    prompt, cap = prompt_and_cap(data)
    temperature, top_p = sampling(data)
    end_id = int(data["end_id"].reshape(-1)[0]) if "end_id" in data else None
    seed = int(data["random_seed"].reshape(-1)[0]) if "random_seed" in data else prompt_seed(prompt)
    stops = stop_words(data["stop_words_list"]) if "stop_words_list" in data else ()
    salt = int(data["cache_salt_id"].reshape(-1)[0]) if "cache_salt_id" in data else 0
    return GenerationRequest(request_id=request_id, prompt_ids=prompt, max_new_tokens=cap,
                             end_id=end_id, seed=seed, temperature=temperature, top_p=top_p,
                             stop_sequences=stops, cache_salt=salt)


def _token_response(token_ids: tuple[int, ...], num_input_tokens: int,
                    kv_reused: int) -> dict[str, NDArray[Any]]:
    # Shapes carry the batch dim first: output_ids [batch, beam, tokens], the rest [batch, 1].
    return {
        "output_ids": np.asarray(token_ids, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.asarray([[len(token_ids)]], dtype=np.int32),
        "num_input_tokens": np.asarray([[num_input_tokens]], dtype=np.int32),
        "kv_cache_reused_blocks": np.asarray([[kv_reused]], dtype=np.int32),
    }


class TensorrtLlmModel:
    """The decoupled infer callable bound as `tensorrt_llm`."""

    def __init__(self, host: EngineHost) -> None:
        self._host = host

    async def __call__(self, requests: list[Any]) -> AsyncIterator[list[dict[str, NDArray[Any]]]]:
        from pytriton.exceptions import PyTritonBadParameterError

        if len(requests) != 1:
            raise PyTritonBadParameterError(ERR_BATCH.format(len(requests)))
        request = requests[0]
        request_id = str((request.parameters or {}).get(REQUEST_ID_PARAM) or "")
        if bool(_scalar(request.data, "stop", False)):
            if request_id:
                self._host.abort(request_id)
            return                                  # no outputs: just the empty final response
        try:
            generation = parse_request(request.data, request_id or f"anon-{uuid.uuid4().hex}")
            queue = self._host.submit(generation)
        except (EngineRequestError, RequestIdInUse) as exc:
            raise PyTritonBadParameterError(str(exc)) from None
        streaming = bool(_scalar(request.data, "streaming", False))   # TensorRT-LLM's default: off
        finished = False
        held: list[int] = []                       # non-streaming: everything goes in one response
        num_input_tokens, kv_reused = len(generation.prompt_ids), 0
        try:
            while not finished:
                outputs, finished = await take_ready(queue)
                fresh: list[int] = []
                for item in outputs:
                    num_input_tokens, kv_reused = item.num_input_tokens, item.kv_cache_reused_blocks
                    fresh.extend(item.new_token_ids)
                if streaming and fresh:
                    yield [_token_response(tuple(fresh), num_input_tokens, kv_reused)]
                else:
                    held.extend(fresh)
        finally:
            if not finished:
                self._host.forget(generation.request_id)
        if held:
            yield [_token_response(tuple(held), num_input_tokens, kv_reused)]


def bind_model(triton: Any, model: TensorrtLlmModel) -> None:
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    def i32(name: str, shape: tuple[int, ...], optional: bool = False) -> Tensor:
        return Tensor(name=name, dtype=np.int32, shape=shape, optional=optional)

    triton.bind(
        model_name=MODEL_NAME,
        infer_func=model,
        inputs=[
            i32("input_ids", (-1,)),
            i32("input_lengths", (1,)),
            i32("request_output_len", (1,)),
            Tensor(name="streaming", dtype=np.bool_, shape=(1,), optional=True),
            i32("end_id", (1,), optional=True),
            Tensor(name="stop", dtype=np.bool_, shape=(1,), optional=True),
            # Sent by the client (written against the strict interface); the counters come anyway.
            Tensor(name="exclude_input_in_output", dtype=np.bool_, shape=(1,), optional=True),
            Tensor(name="return_perf_metrics", dtype=np.bool_, shape=(1,), optional=True),
            Tensor(name="random_seed", dtype=np.uint64, shape=(1,), optional=True),
            Tensor(name="temperature", dtype=np.float32, shape=(1,), optional=True),
            Tensor(name="runtime_top_p", dtype=np.float32, shape=(1,), optional=True),
            i32("stop_words_list", (2, -1), optional=True),
            # The trust scope's salt (TensorRT-LLM's cache_salt_id; see replica/README.md).
            Tensor(name="cache_salt_id", dtype=np.uint64, shape=(1,), optional=True),
        ],
        outputs=[
            i32("output_ids", (-1, -1)),
            i32("sequence_length", (-1,)),
            i32("num_input_tokens", (1,)),
            i32("kv_cache_reused_blocks", (1,)),
        ],
        # max_batch_size=1: every call carries one request, so streams never advance in lockstep.
        config=ModelConfig(batching=True, max_batch_size=1, decoupled=True,
                           batcher=DynamicBatcher(max_queue_delay_microseconds=0)),
        strict=False,
    )


def build_engine(settings: ReplicaSettings) -> Engine:
    """`[replica].engine`: "core" (engine/ via the adapter) or "simple" (replica/generator.py)."""
    kind = str(settings.section.get("engine", DEFAULT_ENGINE))
    if kind == "simple":
        return SimpleGenerator(settings.generator or GeneratorConfig())
    if kind == "core":
        from sluice.replica.engine_core_adapter import build_engine_from_section

        try:
            cache = str(settings.model_cache) if settings.model_cache is not None else ""
            return build_engine_from_section(settings.section, cache)
        except (ValueError, TypeError, AssertionError, FileNotFoundError) as exc:
            raise StartupError(ERR_ENGINE_CONFIG.format(engine=kind, error=exc)) from None
    raise StartupError(ERR_UNKNOWN_ENGINE.format(kind))


def process_alive(pid: int) -> bool:
    """Whether `pid` runs, from /proc alone: no wait, no lock of anyone's (an exited child not yet
    reaped is a zombie, state Z: not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _run_until_ready(triton: Any, name: str, workspace: Path | None) -> None:
    """triton.run(), but end the process at once when tritonserver exits during startup.

    pytriton itself only notices after its 120 s readiness timeout. run() must
    stay on the main thread: pytriton spawns tritonserver with
    PR_SET_PDEATHSIG, which fires when the *thread* that spawned it exits. So a
    daemon watcher polls the server process and, if it is gone before ready,
    reports and exits (pytriton's own stop() would block on the stuck run()).
    """
    ready = threading.Event()

    def watch() -> None:
        pid: int | None = None
        while not ready.wait(0.2):
            if pid is None:
                # pytriton internals (guarded): the server object and its `sh` process handle once spawned.
                server = getattr(triton, "_triton_server", None)
                pid = getattr(getattr(server, "_tritonserver_running_cmd", None), "pid", None)
                continue
            # Not sh's is_alive(): the thread whose poll sees the exit runs pytriton's exit callback
            # (Triton.stop(), which waits on the stuck run()), so a watcher that saw it first hung
            # there and never exited (seen under load: the test's 60 s ran out).
            if not process_alive(pid) and not ready.is_set():
                print(f"ERROR: {ERR_TRITON_START.format(name=name, error=ERR_TRITON_EXITED)}",
                      file=sys.stderr, flush=True)
                if workspace is not None:
                    shutil.rmtree(workspace, ignore_errors=True)
                os._exit(EXIT_STARTUP_FAILED)

    threading.Thread(target=watch, name="triton-start-watch", daemon=True).start()
    try:
        triton.run()
    finally:
        ready.set()


def serve(settings: ReplicaSettings, started_at: float) -> int:
    check_ports_free(settings)
    engine = build_engine(settings)
    ensure_libpython_on_library_path()
    # Our tensors are a few bytes: pytriton's shared-memory TensorStore costs a round trip to its
    # block-manager process per response and capped streaming near 1k responses/s on 2 cores;
    # base64 over its zmq socket is cheaper. Read by pytriton here and in the backend stub.
    os.environ.setdefault("PYTRITON_NO_TENSORSTORE", "1")
    from pytriton.triton import Triton, TritonConfig

    from sluice.replica import pytriton_fixes

    pytriton_fixes.apply()
    # What killed replicas left behind (replica/lifecycle.py): hung Python-backend stubs, /dev/shm.
    stubs, regions = lifecycle.kill_orphaned_stubs(), lifecycle.remove_stale_shm_regions()
    if stubs or regions:
        LOG.warning("removed what killed replicas left: %d orphaned stub processes, %d shared-memory regions",
                    stubs, regions)
    metrics = ReplicaMetrics(start_time=started_at)
    metrics.serve(settings.metrics_port, settings.host)
    metrics.update(engine.stats())
    host = EngineHost(engine, on_stats=metrics.update)
    triton_config = TritonConfig(
        http_address=settings.host, http_port=settings.http_port,
        grpc_address=settings.host, grpc_port=settings.grpc_port,
        allow_metrics=False,           # Triton's own metrics port would collide between replicas
        exit_timeout_secs=2, log_verbose=0,
        # Let clients keepalive-ping every ~2 s so a vanished replica is noticed within seconds
        # (gRPC's server default would answer frequent pings with GOAWAY too_many_pings).
        grpc_keepalive_permit_without_calls=True,
        grpc_http2_min_recv_ping_interval_without_data=1000,
        grpc_http2_max_ping_strikes=0,
        **settings.tls,
    )
    triton = Triton(config=triton_config, workspace=_fresh_workspace(settings.workspace))
    _die_with_this_process(triton)
    try:
        if str(settings.section.get("interface", STRICT)) == STRICT:
            from sluice.replica.strict_model import StrictTensorrtLlmModel, bind_strict_model

            strict = StrictTensorrtLlmModel(host, block_size=engine.stats().kv_tokens_per_block,
                                            on_finished=metrics.request_finished)
            bind_strict_model(triton, strict, bool(settings.section.get("cache_salt_id", True)))
        else:
            bind_model(triton, TensorrtLlmModel(host))
        _run_until_ready(triton, settings.name, settings.workspace)
    except Exception as exc:
        triton.stop()
        raise StartupError(ERR_TRITON_START.format(name=settings.name, error=exc)) from exc

    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    print(f"replica {settings.name} ready model={MODEL_NAME} grpc={settings.host}:{settings.grpc_port} "
          f"http={settings.http_port} metrics={settings.metrics_port} "
          f"startup_s={time.time() - started_at:.2f}", flush=True)
    while not stopping.is_set() and triton.is_alive():
        stopping.wait(0.5)
    alive = triton.is_alive()
    code = 0 if alive or stopping.is_set() else 1
    stopper = threading.Thread(target=triton.stop, name="triton-stop", daemon=True)
    stopper.start()
    stopper.join(STOP_TIMEOUT_S)
    if stopper.is_alive():
        # pytriton's stop() waits for every in-flight request to finish; their clients see the
        # connection drop instead (replica lost), as if the machine had gone.
        print(f"replica {settings.name}: {ERR_STOP_TIMEOUT.format(seconds=STOP_TIMEOUT_S)}", flush=True)
        lifecycle.kill_descendants()
    lifecycle.remove_own_shm_regions()
    print(f"replica {settings.name} stopped", flush=True)
    if stopper.is_alive():
        os._exit(code)                 # the blocked stop() thread and pytriton's would hold the exit
    return code


def _die_with_this_process(triton: Any) -> None:
    """Swap in the SIGKILL death-signal wrapper once pytriton has laid out its tritonserver copy
    (inside triton.run(), before it spawns the server); see replica/lifecycle.py."""
    initialize = getattr(triton, "_initialize_server", None)
    if initialize is None:
        LOG.warning("pytriton changed (no _initialize_server): tritonserver keeps its SIGTERM death signal")
        return

    def initialize_then_wrap() -> None:
        initialize()
        lifecycle.wrap_tritonserver_pdeathsig(triton)

    triton._initialize_server = initialize_then_wrap


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()
    parser = argparse.ArgumentParser(description="Serve one Triton replica (tensorrt_llm interface).")
    parser.add_argument("--name", required=True, help="the [[replicas]] entry to serve, e.g. r0")
    args = parser.parse_args(argv)
    config = start_process("replica", level=logging.WARNING, stream=sys.stdout)
    try:
        settings = settings_from_config(config, args.name)
        return serve(settings, started_at)
    except StartupError as exc:
        print(f"ERROR: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
