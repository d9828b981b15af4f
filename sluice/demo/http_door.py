"""The demo's HTTP step: the same run through the OpenAI door, and a `curl -N` resume.

The official `openai` package, pointed at the gateway's HTTP edge, sends step 1's request again
with step 1's request key as its Idempotency-Key: admission finds the same run (same tenant, key
and payload), so the streamed answer is step 1's answer, read from the same event log, with no
second reservation. Then curl resumes step 2's run after its drop point with Last-Event-ID.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from openai import AsyncOpenAI

from sluice.ledger.seed import DEMO_API_KEY


@dataclass(frozen=True, slots=True)
class EarlierRun:
    request_key: str
    model: str
    prompt: str
    cap: int
    text: str                        # the answer as the gRPC door streamed it


async def same_answer_through_openai(base_url: str, run: EarlierRun, say: Callable[[str], None]) -> None:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=DEMO_API_KEY, max_retries=0)
    stream = await client.completions.create(
        model=run.model, prompt=run.prompt, max_tokens=run.cap, stream=True,
        stream_options={"include_usage": True}, extra_headers={"Idempotency-Key": run.request_key})
    pieces: list[str] = []
    usage, object_id = None, ""
    async for chunk in stream:
        object_id = chunk.id
        pieces.extend(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    text = "".join(pieces)
    say(f"   openai.completions.create(stream=True, Idempotency-Key=step 1's key) → {object_id}")
    say(f"   > {text!r}"[:220])
    counts = f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion" if usage else "no"
    say(f"   the same answer as step 1: {text == run.text}; usage {counts} tokens (one run, one reservation)")
    await client.close()


def curl_resume(base_url: str, run_id: str, after: int, say: Callable[[str], None]) -> None:
    argv = ["curl", "-sN", "-H", f"Authorization: Bearer {DEMO_API_KEY}", "-H", "Accept: text/event-stream",
            "-H", f"Last-Event-ID: {after}", f"{base_url}/v1/runs/{run_id}/events"]
    say(f"   $ curl -N -H 'Accept: text/event-stream' -H 'Last-Event-ID: {after}'"
        f" {base_url}/v1/runs/{run_id}/events")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        say(f"   curl failed: {error}")
        return
    frames = [frame for frame in out.split("\n\n") if frame.strip()]
    ids = [int(line[4:]) for frame in frames for line in frame.splitlines() if line.startswith("id: ")]
    for frame in frames[:2]:
        say("   " + frame.replace("\n", "\n   ")[:200])
    say(f"   ... {len(frames)} events, ids {ids[0]}..{ids[-1]}: exactly the events after {after}"
        if ids else "   (no events)")
