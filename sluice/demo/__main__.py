"""The Sluice demo: a streamed answer, a disconnect and resume, a cancel, a worker
loss, a follow-up turn served from the prefix cache, the usage report, and the HTTP edge
(the same answer through the official openai package, a curl resume by Last-Event-ID), on
real PostgreSQL, Kafka, Triton and gRPC processes.

`make demo` seeds the ledger first; run alone, this expects `make seed` done.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid

from sluice_client.sdk import Addresses, SluiceClient, status_name

from sluice.config import Settings
from sluice.config.bootstrap import start_process
from sluice.demo.http_door import EarlierRun, curl_resume, same_answer_through_openai
from sluice.demo.processes import Child, gateway, replica, routing
from sluice.ledger.seed import DEMO_API_KEY
from sluice.v1 import runs_pb2

# The real SmolLM2-135M-Instruct the default replicas compute on CPU (config: [[replicas]] r0, r1),
# so the answers read as English; outputs stay short so the demo runs in about a minute on 2 cores.
MODEL = "chat-small"
PROMPT = "Explain in one paragraph why a stream must be resumable by cursor."
LONG_CAP = 400          # long enough to interrupt mid-stream
# Event 2 is the first token's delta, always its own event (the first token is published at once);
# later deltas are coalesced (up to 200 ms or 32 tokens by default), so a short answer may end
# within a handful of events and a later cursor might never be reached.
DROP_AFTER = 2
ANSWER_CAP = 40


def say(text: str = "") -> None:
    print(text, flush=True)


def usage_line(event: runs_pb2.RunEvent) -> str:
    usage = event.usage
    return (f"{status_name(event.status)}: {usage.input_tokens} input + {usage.output_tokens} output tokens, "
            f"${usage.cost_micros / 1e6:.6f}" + (f" ({event.detail})" if event.detail else ""))


async def streamed_answer(client: SluiceClient) -> EarlierRun:
    say("1. A streamed answer  (what `sluice chat` does)")
    key = f"demo-{uuid.uuid4().hex[:8]}"
    run = await client.submit(PROMPT, model=MODEL, max_output_tokens=ANSWER_CAP, request_key=key)
    say(f"   run {run.run_id}: model {run.model_version}, {run.input_tokens} prompt tokens, "
        f"cap {run.max_output_tokens}")
    retry = await client.submit(PROMPT, model=MODEL, max_output_tokens=ANSWER_CAP, request_key=key)
    say(f"   a retried submit with the same request key returns the same run: "
        f"{retry.run_id == run.run_id} (deduplicated={retry.deduplicated})")
    text = []
    async for event in client.stream(run.run_id):
        if event.type == runs_pb2.EVENT_TYPE_DELTA:
            text.append(event.text)
        elif event.type == runs_pb2.EVENT_TYPE_TERMINAL:
            say(f"   > {''.join(text)!r}"[:220])
            say(f"   {usage_line(event)}; {event.sequence} events")
    return EarlierRun(key, MODEL, PROMPT, ANSWER_CAP, "".join(text))


async def disconnect_and_resume(client: SluiceClient, drop_after: int = DROP_AFTER) -> str:
    say(f"2. Disconnect after event {drop_after}, then resume by cursor")
    run = await client.submit(PROMPT, model=MODEL, max_output_tokens=24)
    first = []
    call = client.stream_once(run.run_id)
    async for event in call:
        first.append(event.sequence)
        if event.sequence == drop_after:
            call.cancel()           # the client drops the connection
            break
    say(f"   first connection saw events {first[0]}..{first[-1]}, then dropped")
    resumed = [event async for event in client.stream(run.run_id, after=drop_after)]
    sequences = [event.sequence for event in resumed]
    expected = list(range(drop_after + 1, resumed[-1].sequence + 1))
    verdict = "no gap, no duplicate" if sequences == expected else f"MISMATCH: {sequences}"
    say(f"   Stream(after={drop_after}) replayed and followed events "
        f"{sequences[0]}..{sequences[-1]}: {verdict}")
    say(f"   {usage_line(resumed[-1])}")
    return run.run_id


async def cancel_mid_stream(client: SluiceClient, cancel_after: int = 8) -> None:
    say(f"3. Cancel mid-stream (after event {cancel_after})")
    run = await client.submit(PROMPT, model=MODEL, max_output_tokens=LONG_CAP)
    async for event in client.stream(run.run_id):
        if event.sequence == cancel_after:
            answer = await client.cancel(run.run_id)
            say(f"   Cancel committed while the run was {status_name(answer.status)}")
        if event.type == runs_pb2.EVENT_TYPE_TERMINAL:
            say(f"   stream ended with {usage_line(event)} of a {LONG_CAP}-token cap; "
                "the rest of the reservation is released")


async def worker_loss(client: SluiceClient, replicas: dict[str, Child], kill_after: int = 10) -> None:
    say(f"4. Worker loss: the replica serving a run is killed (SIGKILL) after event {kill_after}")
    run = await client.submit(PROMPT, model=MODEL, max_output_tokens=LONG_CAP)
    killed_at = 0.0
    victim = ""
    async for event in client.stream(run.run_id):
        if event.sequence == kill_after:
            victim = (await client.get_run(run.run_id)).replica
            replicas[victim].kill()
            killed_at = time.monotonic()
            say(f"   killed replica {victim}")
        if event.type == runs_pb2.EVENT_TYPE_TERMINAL:
            say(f"   {time.monotonic() - killed_at:.1f} s later the stream ended: {usage_line(event)}")
    final = await client.get_run(run.run_id)
    say(f"   ledger: {status_name(final.status)}, {final.usage.output_tokens} output tokens charged, "
        f"last sequence {final.last_sequence}; not regenerated — a retry is a new submit with a new id")
    replicas[victim].start()
    replicas[victim].wait_ready()
    say(f"   replica {victim} restarted")


SYSTEM_PROMPT = ("You are Sluice's demo assistant. Answer briefly, cite the design contract, and say "
                 "what you would measure before changing anything. ") * 4


async def follow_up_turn(client: SluiceClient) -> None:
    say("5. A follow-up turn goes where its prefix is cached  (prefix_aware routing)")
    conversation = f"demo-conv-{uuid.uuid4().hex[:6]}"
    history = SYSTEM_PROMPT + "\nUser: What is a run ledger?\nAssistant:"
    first = await client.submit(history, model=MODEL, max_output_tokens=16, conversation_id=conversation)
    deltas = [e async for e in client.stream(first.run_id) if e.type == runs_pb2.EVENT_TYPE_DELTA]
    answer = "".join(event.text for event in deltas)
    turn_one = await client.get_run(first.run_id)
    second = await client.submit(history + answer + "\nUser: And why resume by cursor?\nAssistant:",
                                 model=MODEL, max_output_tokens=16, conversation_id=conversation)
    _ = [event async for event in client.stream(second.run_id)]
    turn_two = await client.get_run(second.run_id)
    say(f"   turn 1 on {turn_one.replica}: {turn_one.input_tokens} prompt tokens, "
        f"{turn_one.cached_input_tokens} from cache")
    say(f"   turn 2 on {turn_two.replica}: {turn_two.input_tokens} prompt tokens, "
        f"{turn_two.cached_input_tokens} from cache (billed at the cached-input price)")


async def usage_report(client: SluiceClient) -> None:
    say("6. Usage report  (what `sluice usage` shows)")
    report = await client.usage()
    say(f"   tenant {report.tenant}: settled by model and day")
    for row in report.rows:
        s = row.settled
        say(f"   {row.day}  {row.model_version:<14} runs {row.runs:>4}  input {s.input_tokens:>7}  "
            f"output {s.output_tokens:>7}  ${s.cost_micros / 1e6:.6f}")
    t = report.settled_total
    say(f"   settled total: {t.input_tokens} input, {t.output_tokens} output, ${t.cost_micros / 1e6:.6f}")
    f = report.in_flight
    say(f"   in flight: {f.runs} runs reserving {f.reserved_tokens} tokens "
        f"(${f.reserved_cost_micros / 1e6:.6f}); budget {report.budget_tokens} tokens")


async def http_edge(config: Settings, first: EarlierRun, resumable: str) -> None:
    base_url = f"http://{config.http.listen}"
    say(f"7. The HTTP edge ({base_url}): the same run through the OpenAI door, and a curl resume")
    await same_answer_through_openai(base_url, first, say)
    curl_resume(base_url, resumable, DROP_AFTER, say)


async def scenario(config: Settings, replicas: dict[str, Child]) -> None:
    addresses = Addresses(config.admission.listen, config.runs.listen, config.usage.listen)
    async with SluiceClient(addresses, api_key=DEMO_API_KEY) as client:
        first = await streamed_answer(client)
        say()
        resumable = await disconnect_and_resume(client)
        say()
        await cancel_mid_stream(client)
        say()
        await worker_loss(client, replicas)
        say()
        await follow_up_turn(client)
        say()
        await usage_report(client)
        if config.http.enabled:
            say()
            await http_edge(config, first, resumable)


def main() -> int:
    config = start_process("demo", level=logging.WARNING)
    log_dir = config.data_dir() / "logs" / "demo"
    replicas = {spec.name: replica(spec.name, log_dir) for spec in config.replicas}
    children = [*replicas.values(), gateway(log_dir), routing(log_dir)]
    say(f"Sluice demo — logs in {log_dir}")
    started = time.monotonic()
    try:
        for child in children:
            child.start()
        for child in children:
            child.wait_ready()
        say(f"up: replicas {', '.join(replicas)}, gateway, routing worker "
            f"({time.monotonic() - started:.1f} s)\n")
        asyncio.run(scenario(config, replicas))
        return 0
    finally:
        for child in reversed(children):
            child.stop()


if __name__ == "__main__":
    sys.exit(main())
