"""`sluice`: the command-line client.

    sluice chat "Why do rivers meander?" [--model chat] [--max-tokens 128] [--deadline-ms MS] [--retry]
    sluice runs get RUN
    sluice runs tail RUN [--after N]
    sluice runs cancel RUN
    sluice usage [--from 2026-11-01] [--to 2026-11-30]
    sluice usage export --from D --to D --group-by tenant,model [--format csv|json]   (clients/usage_cli.py)
    sluice usage reconcile [--period 2026-11]
    sluice admin tenants|budget|keys|models|replicas|audit ...   (admin key; clients/admin_cli.py)
    sluice plan BRIEF.yaml ...            (the capacity planner: planner.cli)

The API key comes from --api-key or SLUICE_API_KEY. Addresses come from
--address (one process serving every service), else SLUICE_ADDRESS, else
SLUICE_ADMISSION_ADDRESS / SLUICE_RUNS_ADDRESS / SLUICE_USAGE_ADDRESS (default: the
platform's packaged 127.0.0.1:50051/50052/50053). The CLI reads no platform config.
A TLS gateway: --ca PEM (or SLUICE_CA_FILE) verifies its certificate; --cert/--key (or
SLUICE_CERT_FILE/SLUICE_KEY_FILE) present a client certificate to a mutual-TLS gateway.

A refusal prints the server's message, then a one-line hint from the hints it
attached (e.g. "hint: retry after 300 ms", "hint: lower --max-tokens to 1000");
`chat --retry` waits out a retry-after once and resubmits with the same request key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import grpc
import grpc.aio
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from sluice_client import usage_cli
from sluice_client.admin_cli import add_admin_parser, run_admin
from sluice_client.sdk import API_KEY_ENV, Addresses, SluiceClient, SluiceError, StreamBroken, status_name

from sluice.v1 import admission_pb2, common_pb2, runs_pb2

EXIT_OK = 0
EXIT_RPC_ERROR = 1
EXIT_USAGE = 2
EXIT_RUN_NOT_COMPLETED = 3
CA_FILE_ENV, CERT_FILE_ENV, KEY_FILE_ENV = "SLUICE_CA_FILE", "SLUICE_CERT_FILE", "SLUICE_KEY_FILE"
CERT_AND_KEY = "sluice: --cert and --key go together (a client certificate and its private key)"
CERT_WITHOUT_CA = "sluice: --cert needs --ca (the CA that signed the gateway's certificate)"


def _common(defaults: bool) -> argparse.ArgumentParser:
    """--api-key and --address, accepted before or after the subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    default = None if defaults else argparse.SUPPRESS
    common.add_argument("--api-key", default=default, help=f"API key (default: ${API_KEY_ENV})")
    common.add_argument("--address", default=default,
                        help="one host:port serving every service (default: $SLUICE_ADDRESS, else "
                             "the per-service variables)")
    common.add_argument("--ca", default=default,
                        help=f"TLS: the CA (PEM) that signed the gateway's certificate (${CA_FILE_ENV})")
    common.add_argument("--cert", default=default,
                        help=f"mutual TLS: this client's certificate chain, PEM (default: ${CERT_FILE_ENV})")
    common.add_argument("--key", default=default,
                        help=f"mutual TLS: this client's private key, PEM (default: ${KEY_FILE_ENV})")
    return common


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from --ca/--cert/--key or their variables; None (plaintext) when no CA is given."""
    ca = getattr(args, "ca", None) or os.environ.get(CA_FILE_ENV)
    cert = getattr(args, "cert", None) or os.environ.get(CERT_FILE_ENV)
    key = getattr(args, "key", None) or os.environ.get(KEY_FILE_ENV)
    if bool(cert) != bool(key):
        raise SystemExit(CERT_AND_KEY)
    if not ca:
        if cert:
            raise SystemExit(CERT_WITHOUT_CA)
        return None
    return grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(key).read_bytes() if key else None,
                                        Path(cert).read_bytes() if cert else None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice command-line client",
                                     parents=[_common(defaults=True)])
    commands = parser.add_subparsers(dest="command", required=True)
    later = _common(defaults=False)

    chat = commands.add_parser("chat", help="submit a prompt and stream the answer", parents=[later])
    chat.add_argument("prompt")
    chat.add_argument("--model", default="chat-small",
                      help="model alias or version (default: chat-small, the real SmolLM2-135M-Instruct)")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    chat.add_argument("--top-p", type=float, default=0.0, help="nucleus mass; 0 (default): no cut")
    chat.add_argument("--seed", type=int, default=0, help="same seed, same answer; 0 (default): the prompt's")
    chat.add_argument("--request-key", default=None, help="idempotency key (default: a new one)")
    chat.add_argument("--deadline-ms", type=int, default=0, help="deadline (default: the server's)")
    chat.add_argument("--retry", action="store_true",
                      help="when refused with a retry-after, wait that long and resubmit once")
    chat.add_argument("--show-events", action="store_true", help="print each event as JSON")

    runs = commands.add_parser("runs", help="inspect, follow or cancel a run")
    run_commands = runs.add_subparsers(dest="runs_command", required=True)
    get = run_commands.add_parser("get", help="a run's state and usage", parents=[later])
    get.add_argument("run_id")
    tail = run_commands.add_parser("tail", help="the run's events after a sequence, to its end",
                                   parents=[later])
    tail.add_argument("run_id")
    tail.add_argument("--after", type=int, default=0)
    cancel = run_commands.add_parser("cancel", help="cancel a run", parents=[later])
    cancel.add_argument("run_id")

    usage = commands.add_parser("usage", help="settled usage and reservations in flight", parents=[later])
    usage.add_argument("--from", dest="from_date", default="")
    usage.add_argument("--to", dest="to_date", default="")
    usage_cli.add_usage_commands(usage, later)
    add_admin_parser(commands, later)

    plan = commands.add_parser("plan", help="size a fleet from a brief (capacity planner)", add_help=False)
    plan.add_argument("plan_args", nargs=argparse.REMAINDER)
    return parser


def _json(message: Message) -> str:
    return json.dumps(MessageToDict(message, preserving_proto_field_name=True))


def hint(error: SluiceError) -> str | None:
    """The server's hints as one line of what to change, or None when it sent none."""
    options = []
    if error.retry_after_ms is not None:
        options.append(f"retry after {error.retry_after_ms} ms")
    if error.min_deadline_ms is not None:
        options.append(f"raise --deadline-ms to at least {error.min_deadline_ms}")
    fit = error.max_output_tokens_that_fit
    if fit is not None:
        options.append(f"lower --max-tokens to {fit}" if fit > 0 else "shorten the prompt (no output fits)")
    return "hint: " + " or ".join(options) if options else None


def _print_error(error: grpc.aio.AioRpcError, err: TextIO) -> None:
    print(f"sluice: {error.code().name}: {error.details()}", file=err)
    line = hint(error) if isinstance(error, SluiceError) else None
    if line is not None:
        print(line, file=err)


async def submit_chat(client: SluiceClient, args: argparse.Namespace,
                      err: TextIO) -> admission_pb2.SubmitResponse:
    """Submit `chat`'s run; with --retry, a refusal carrying a retry-after is waited out and the
    same request (same request key: never two runs) submitted once more."""
    request_key = args.request_key or uuid.uuid4().hex

    async def submit() -> admission_pb2.SubmitResponse:
        return await client.submit(args.prompt, model=args.model, max_output_tokens=args.max_tokens,
                                   request_key=request_key, deadline_ms=args.deadline_ms,
                                   temperature=args.temperature, top_p=args.top_p, seed=args.seed)

    try:
        return await submit()
    except SluiceError as error:
        if not args.retry or error.retry_after_ms is None:
            raise
        _print_error(error, err)
        print(f"sluice: retrying once in {error.retry_after_ms} ms", file=err, flush=True)
        await asyncio.sleep(error.retry_after_ms / 1000)
    return await submit()


def _print_event(event: runs_pb2.RunEvent, out: TextIO, as_json: bool) -> None:
    if as_json:
        print(_json(event), file=out, flush=True)
    elif event.type == runs_pb2.EVENT_TYPE_DELTA:
        print(event.text, end="", file=out, flush=True)


def _print_terminal(event: runs_pb2.RunEvent, out: TextIO) -> None:
    usage = event.usage
    detail = f" ({event.detail})" if event.detail else ""
    print(f"\n[{status_name(event.status)}{detail}: {usage.input_tokens} input + {usage.output_tokens} output"
          f" tokens, {usage.cost_micros} micro-USD; {event.sequence} events]", file=out, flush=True)


async def _follow(client: SluiceClient, run_id: str, after: int, out: TextIO, as_json: bool) -> int:
    last: runs_pb2.RunEvent | None = None
    async for event in client.stream(run_id, after):
        _print_event(event, out, as_json)
        last = event
    if last is not None and last.type == runs_pb2.EVENT_TYPE_TERMINAL:
        if not as_json:
            _print_terminal(last, out)
        return EXIT_OK if last.status == common_pb2.RUN_STATUS_COMPLETED else EXIT_RUN_NOT_COMPLETED
    return EXIT_OK


async def _run(args: argparse.Namespace, out: TextIO) -> int:
    addresses = Addresses.single(args.address) if args.address else Addresses.from_env()
    async with SluiceClient(addresses, args.api_key, credentials=credentials(args)) as client:
        if args.command == "chat":
            run = await submit_chat(client, args, sys.stderr)
            print(f"[run {run.run_id} · {run.model_version} · {run.input_tokens} prompt tokens]",
                  file=sys.stderr, flush=True)
            return await _follow(client, run.run_id, 0, out, args.show_events)
        if args.command == "runs" and args.runs_command == "get":
            print(_json(await client.get_run(args.run_id)), file=out)
            return EXIT_OK
        if args.command == "runs" and args.runs_command == "tail":
            return await _follow(client, args.run_id, args.after, out, as_json=True)
        if args.command == "runs" and args.runs_command == "cancel":
            reply = await client.cancel(args.run_id)
            print(f"cancel requested for run {reply.run_id} (status {status_name(reply.status)})", file=out)
            return EXIT_OK
        if args.command == "admin":
            return await run_admin(client, args, out)
        if args.command == "usage" and args.usage_command == "export":
            return await usage_cli.export(client, args, out)
        if args.command == "usage" and args.usage_command == "reconcile":
            return await usage_cli.reconcile(client, args, out)
        if args.command == "usage":
            print(_json(await client.usage(args.from_date, args.to_date)), file=out)
            return EXIT_OK
    raise AssertionError(f"unhandled command {args.command}")


PLANNER_MISSING = ("sluice plan: the capacity planner is part of the platform distribution, not the client:"
                   " pip install sluice")


def _plan(argv: list[str]) -> int:
    """The capacity planner, imported only when asked for: the client distribution does not ship it."""
    try:
        from sluice.planner.cli import main as plan_main
    except ModuleNotFoundError as missing:
        if not (missing.name or "").startswith("sluice"):
            raise
        print(PLANNER_MISSING, file=sys.stderr)
        return EXIT_USAGE
    return int(plan_main(argv) or 0)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stream = out or sys.stdout
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
    args = _parser().parse_args(argv)
    if not (args.api_key or os.environ.get(API_KEY_ENV)):
        print(f"sluice: no API key: pass --api-key or set {API_KEY_ENV}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(_run(args, stream))
    except grpc.aio.AioRpcError as error:
        _print_error(error, sys.stderr)
        return EXIT_RPC_ERROR
    except StreamBroken as error:
        print(f"sluice: {error}; resume with: sluice runs tail {error.run_id} --after {error.after}",
              file=sys.stderr)
        return EXIT_RPC_ERROR


if __name__ == "__main__":
    sys.exit(main())
