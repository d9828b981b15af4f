"""The engine core: one step is schedule → execute → postprocess.

    host                          core
    ────                          ────
    add_request / stop  ───────►  waiting queue / free blocks at once
    step()              ───────►  Scheduler.schedule()      (admit, pause, pick chunks)
                                  Executor.execute(batch)   (timing: modelled duration, seed ids;
                                                             model: a real forward + sampling)
                                  postprocess               (advance KV, record ids, finish)
                        ◄───────  StepResult(duration_s, outputs)

The core has no clock: a step's duration is a number the host turns into a
sleep (Triton replica, scaled wall clock) or an event time (simulator, virtual
clock). Outputs are queued and handed back with the step; `take_outputs`
drains the ones produced between steps (a `stop`).

How a request ends. With the timing executor the output length is drawn when
the request is added (engine.sampling) and the "end_id step" is the sample
after it. With a real model the length starts at the cap and the sampled ids
decide: end_id (sampled, not streamed) or a stop sequence (streamed, then
finished) cut it short.

Fast path for the simulator. When every running request is in generation and
nothing can be admitted, the next steps differ only in context length, so
`decode_run_limit()` says how many steps can be applied at once (until the
first request finishes) and `run_decode(k)` applies them with O(batch) work
instead of O(batch × k). Counts and durations equal k single steps; block
ids may differ because each request's new blocks are taken together.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from sluice.engine.cost_model import CostModel
from sluice.engine.executor import Executor, TimingExecutor
from sluice.engine.kv_cache import BlockPool, block_hashes, salted_root
from sluice.engine.sampling import draw_output_length
from sluice.engine.scheduler import ScheduledBatch, Scheduler
from sluice.engine.sequence import SequenceState
from sluice.engine.types import (
    BAD_OUTPUT_LEN,
    CONTEXT_OVER_BUDGET,
    DUPLICATE_REQUEST,
    EMPTY_PROMPT,
    REQUEST_TOO_LARGE,
    DecodeRun,
    EngineConfig,
    EngineRequest,
    EngineRequestError,
    EngineStats,
    FinishReason,
    RequestOutput,
    StepResult,
)

NO_KV_ROOM = "{model} on {tp} × {gpu} leaves no memory for the KV cache"
NO_KV_BLOCKS = "the executor leaves no room for KV blocks; set num_blocks"
ONE_EXECUTOR = "give EngineCore a cost model (timing executor) or an executor, not both"
HOST_TIER_MODELLED = ("the host KV tier is modelled by the timing executor; the model executor keeps no "
                      "host copies of its blocks, so set host_num_blocks to 0")


class EngineCore:
    def __init__(self, config: EngineConfig, cost_model: CostModel | None = None, *,
                 executor: Executor | None = None) -> None:
        """`cost_model` alone: the timing executor over it (today's engine); `executor`: any other."""
        if executor is None:
            assert cost_model is not None, ONE_EXECUTOR
            executor = TimingExecutor(cost_model, config.tokens, materialise=config.stream_tokens)
        else:
            assert cost_model is None, ONE_EXECUTOR
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = executor.kv_capacity_blocks(config.block_size)
        if num_blocks <= 0:
            if cost_model is not None:
                raise ValueError(NO_KV_ROOM.format(model=cost_model.model.name, tp=cost_model.tp,
                                                   gpu=cost_model.hardware.name))
            raise ValueError(NO_KV_BLOCKS)
        self.config = config
        self.cost_model = cost_model
        self.executor = executor
        host_blocks = config.host_num_blocks
        if host_blocks is None:
            host_blocks = 0 if cost_model is None else cost_model.host_kv_capacity_blocks(config.block_size)
        if host_blocks and cost_model is None:
            raise ValueError(HOST_TIER_MODELLED)
        self.pool = BlockPool(num_blocks, config.block_size, host_blocks)
        executor.allocate_kv(num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.pool)
        self._live: dict[str, SequenceState] = {}
        self._outputs: list[RequestOutput] = []
        self._num_steps = 0
        self._finished = 0
        self._busy_s = 0.0
        self._last = (0, 0, 0, 0)    # scheduled, context, generation, context tokens of the last step

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; EngineRequestError (and nothing queued) when it can never be served."""
        self._validate(request)
        output_len = (request.max_output_tokens if request.end_id is None
                      else draw_output_length(self.config.output_length, request.seed,
                                              request.max_output_tokens))
        seq = SequenceState(request, output_len)
        self._live[request.request_id] = seq
        self.scheduler.waiting.append(seq)

    def _validate(self, request: EngineRequest) -> None:
        if request.request_id in self._live:
            raise EngineRequestError(DUPLICATE_REQUEST.format(request_id=request.request_id))
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise EngineRequestError(EMPTY_PROMPT)
        if request.max_output_tokens < 1:
            raise EngineRequestError(BAD_OUTPUT_LEN.format(value=request.max_output_tokens))
        tokens = prompt_len + request.max_output_tokens
        needed = -(-tokens // self.pool.block_size)
        if needed > self.pool.num_blocks:
            raise EngineRequestError(REQUEST_TOO_LARGE.format(
                request_id=request.request_id, needed=needed, tokens=tokens, capacity=self.pool.num_blocks))
        # A paused request recomputes prompt + outputs as one context, so under max_utilization
        # the whole sequence must fit one step when chunking is off.
        context = tokens if self.config.policy == "max_utilization" else prompt_len
        if not self.config.enable_chunked_context and context > self.config.max_num_tokens:
            raise EngineRequestError(CONTEXT_OVER_BUDGET.format(tokens=context,
                                                                budget=self.config.max_num_tokens))

    def stop(self, request_id: str) -> bool:
        """Stop a live request and free its blocks now; False when it is unknown or finished."""
        seq = self._live.pop(request_id, None)
        if seq is None:
            return False
        scheduler = self.scheduler
        if seq in scheduler.running:
            scheduler.running.remove(seq)
            scheduler.release(seq)
        else:
            scheduler.waiting.remove(seq)
            if seq.admitted:
                scheduler.num_paused_waiting -= 1
        self._outputs.append(self._output(seq, (), 0, first=False, reason="stopped"))
        return True

    def has_work(self) -> bool:
        return bool(self._live)

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> StepResult:
        batch = self.scheduler.schedule()
        context_tokens = sum(chunk for _, chunk in batch.chunks)
        execution = self.executor.execute(batch)
        duration = execution.duration_s
        self._postprocess(batch, execution.sampled)
        self._last = (len(batch.decodes) + len(batch.chunks), len(batch.chunks), len(batch.decodes),
                      context_tokens)
        self._num_steps += 1
        self._busy_s += duration
        return StepResult(duration_s=duration, num_context_requests=len(batch.chunks),
                          num_context_tokens=context_tokens, num_generation_requests=len(batch.decodes),
                          num_paused=batch.num_paused, outputs=tuple(self.take_outputs()))

    def _postprocess(self, batch: ScheduledBatch, sampled: Seq[int]) -> None:
        assert not sampled or len(sampled) == len(batch.samplers()), "one sampled id per sampling sequence"
        next_id = iter(sampled)
        for seq in batch.decodes:
            seq.num_computed += 1
            self._sample(seq, next(next_id, None))
        for seq, chunk in batch.chunks:
            seq.num_computed += chunk
            # Computed full context blocks become shareable at once, so a request arriving
            # behind this one reuses the prefix even before this one finishes.
            self.scheduler.register_computed(seq)
            if seq.num_computed == seq.context_len:
                seq.in_context = False
                self._sample(seq, next(next_id, None))

    def _sample(self, seq: SequenceState, token: int | None) -> None:
        index = seq.num_sampled
        seq.num_sampled = index + 1
        if token is not None and index < seq.output_len:
            seq.accept(index, token)
        streamed = index < seq.output_len
        finished = seq.num_sampled == seq.total_samples
        if finished:
            self._finish(seq)
        first = index == 0
        if self.config.stream_tokens:
            ids = (seq.output_ids[index],) if streamed else ()
            if streamed or finished:
                self._outputs.append(self._output(seq, ids, 1 if streamed else 0, first,
                                                  seq.finish_reason() if finished else None))
        elif first or finished:
            self._outputs.append(self._output(seq, (), 1 if streamed else 0, first,
                                              seq.finish_reason() if finished else None))

    def _finish(self, seq: SequenceState) -> None:
        self.scheduler.running.remove(seq)
        self.scheduler.release(seq)
        del self._live[seq.request_id]
        self._finished += 1

    def _output(self, seq: SequenceState, ids: tuple[int, ...], num_new: int, first: bool,
                reason: FinishReason | None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=ids, num_new_tokens=num_new,
            num_output_tokens=seq.num_streamed, first_token=first, finished=reason is not None,
            finish_reason=reason, num_input_tokens=seq.prompt_len,
            kv_cache_reused_blocks=seq.reused_blocks, num_cached_tokens=seq.num_cached_tokens,
        )

    # --- decode runs (the simulator's fast path) --------------------------------------------

    def decode_run_limit(self) -> int:
        """Steps that can be applied at once by `run_decode`: every running request is in
        generation, the queue head cannot be admitted (and stays so while only decodes run),
        no pause is due; bounded by the first finish. 0 when the next step must be `step()`."""
        scheduler = self.scheduler
        running = scheduler.running
        if not running or self.config.stream_tokens:
            return 0
        limit = 1 << 62
        for seq in running:
            if seq.in_context:
                return 0
            limit = min(limit, seq.total_samples - seq.num_sampled)
        decode_need = 0
        if self.config.policy == "max_utilization":
            decode_need = scheduler.decode_block_need()
            # Every request may need ceil(k / block_size) new blocks within k steps.
            per_seq = self.pool.num_free // len(running)
            limit = min(limit, per_seq * self.pool.block_size)
        if scheduler.waiting and scheduler.can_admit(scheduler.waiting[0], decode_need) is not None:
            return 0
        return max(0, limit)

    def decode_run_durations(self, steps: int) -> tuple[float, ...]:
        """Durations of the next `steps` pure-decode steps, without applying them: step j reads
        every running request's KV, which has grown by j tokens each."""
        running = self.scheduler.running
        batch = len(running)
        context = sum(seq.num_computed + 1 for seq in running)
        assert self.cost_model is not None, "decode runs are the timing executor's fast path"
        step_time = self.cost_model.step_time_totals_s
        return tuple(step_time(0, batch, context + j * batch) for j in range(steps))

    def run_decode(self, steps: int) -> DecodeRun:
        """Apply `steps` (≤ decode_run_limit()) generation steps at once."""
        running = list(self.scheduler.running)
        batch = len(running)
        assert steps > 0 and batch > 0, "run_decode needs a pure-decode stretch (see decode_run_limit)"
        durations = self.decode_run_durations(steps)
        block_size = self.pool.block_size
        finishing: list[SequenceState] = []
        for seq in running:
            seq.num_computed += steps
            seq.num_sampled += steps
            missing = -(-seq.num_computed // block_size) - len(seq.block_ids)
            if missing > 0:
                blocks = self.pool.allocate(missing)
                assert blocks is not None, "decode_run_limit left room for the run's blocks"
                seq.block_ids.extend(blocks)
            if seq.num_sampled == seq.total_samples:
                finishing.append(seq)
        ended_by_end_id = 0
        for seq in finishing:
            streamed_last = seq.num_sampled <= seq.output_len
            ended_by_end_id += 0 if streamed_last else 1
            self._finish(seq)
            self._outputs.append(self._output(seq, (), steps if streamed_last else steps - 1, False,
                                              seq.finish_reason()))
        self._num_steps += steps
        self._busy_s += sum(durations)
        self._last = (batch, 0, batch, 0)
        return DecodeRun(step_durations=durations, batch_size=batch,
                         tokens_in_last_step=batch - ended_by_end_id, outputs=tuple(self.take_outputs()))

    # --- observation ------------------------------------------------------------------------

    def cached_prefix_tokens(self, token_ids: Seq[int], cache_salt: int = 0) -> int:
        """Prompt tokens a request with `token_ids` (in scope `cache_salt`) would find cached here
        right now, in either tier (the same cap as admission: at least one token is computed). The
        simulator's oracle router reads this."""
        if not self.config.enable_prefix_reuse:
            return 0
        block_size = self.pool.block_size
        usable = max(0, (len(token_ids) - 1) // block_size)
        hashes = block_hashes(token_ids, block_size, salted_root(cache_salt))[:usable]
        gpu, host = self.pool.lookup_tiers(hashes)
        return (len(gpu) + len(host)) * block_size

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        scheduled, context, generation, context_tokens = self._last
        return EngineStats(
            active=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            paused=self.scheduler.num_paused_waiting, scheduled=scheduled, context=context,
            generation=generation, max_requests=self.config.max_num_seqs,
            total_context_tokens=context_tokens, kv=self.pool.stats(), num_steps=self._num_steps,
            finished_requests=self._finished, busy_s=self._busy_s,
        )
