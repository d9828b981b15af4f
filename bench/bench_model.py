"""The real SmolLM2-135M-Instruct behind the engine core: load time, tokens/s and CPU per token.

    .venv/bin/python -m bench.bench_model [--batches 1,4,16] [--tokens 16] [--cold]

One engine (what one replica runs), in process: `batch` requests of ~40-token chat prompts
admitted together, each generating `--tokens` ids (no end_id, so every request runs to
its cap). Prints the decode rate (steps where every request decodes one token), the rate
over the whole run (prefill included) and the process CPU seconds per generated token.
--cold also times the load from the GGUF itself (parse + dequantize), bypassing the cache.
Figures, never a pass/fail: the box is shared.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from sluice.services.tokenization import encode

from sluice.config import load_settings
from sluice.engine.core import EngineCore
from sluice.engine.llama.blas import limit_threads
from sluice.engine.llama.executor import BLAS_THREADS, ModelExecutor
from sluice.engine.llama.weights import load_weights
from sluice.engine.sampling import TokenSpace
from sluice.engine.types import EngineConfig, EngineRequest

TOKENIZER = "smollm2-135m-instruct/tokenizer.json"
QUESTIONS = ("Why do rivers meander?", "What is a run ledger?", "Why must a stream be resumable?",
             "How do tides work?", "What is a prefix cache?", "Why is the sky blue?",
             "What does a scheduler do?", "How do bees make honey?")


def cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def run_batch(executor: ModelExecutor, batch: int, tokens: int) -> dict[str, float]:
    config = EngineConfig(block_size=32, num_blocks=256, max_num_seqs=batch, max_num_tokens=2048,
                          tokens=TokenSpace(49152, 17))
    engine = EngineCore(config, executor=executor)
    for i in range(batch):
        prompt = tuple(encode(TOKENIZER, f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})"))
        engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                         max_output_tokens=tokens))
    generated = decode_tokens = 0
    decode_s = 0.0
    wall, cpu = time.perf_counter(), cpu_s()
    while engine.has_work():
        started = time.perf_counter()
        result = engine.step()
        step_tokens = sum(output.num_new_tokens for output in result.outputs)
        generated += step_tokens
        if result.num_context_requests == 0:
            decode_s += time.perf_counter() - started
            decode_tokens += step_tokens
    wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
    return {"decode_tok_s": decode_tokens / decode_s, "overall_tok_s": generated / wall,
            "cpu_ms_per_token": 1000 * cpu / generated, "generated": generated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--cold", action="store_true", help="also time the load from the GGUF (no cache)")
    parser.add_argument("--blas-threads", type=int, default=BLAS_THREADS,
                        help=f"OpenBLAS threads (default {BLAS_THREADS}, as a replica runs)")
    args = parser.parse_args()
    limit_threads(args.blas_threads)
    if args.cold:
        with tempfile.TemporaryDirectory() as scratch:
            cold = load_weights("", scratch)
        print(f"load from the GGUF (parse + dequantize + write the cache): {cold.load_s:.1f} s")
    weights = load_weights("", load_settings().data_dir() / "models")
    source = "the dequantized cache" if weights.from_cache else "the GGUF"
    print(f"load from {source}: {weights.load_s:.2f} s")
    load = os.getloadavg()[0]
    print(f"BLAS threads {args.blas_threads}, load average {load:.1f} on {os.cpu_count()} cores")
    print("batch  decode tok/s  overall tok/s  CPU ms/token")
    for batch in (int(b) for b in args.batches.split(",")):
        figures = run_batch(ModelExecutor(weights), batch, args.tokens)
        print(f"{batch:>5}  {figures['decode_tok_s']:>12.1f}  {figures['overall_tok_s']:>13.1f}  "
              f"{figures['cpu_ms_per_token']:>12.1f}")


if __name__ == "__main__":
    main()
