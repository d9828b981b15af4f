"""Workloads for the fleet simulator: who sends what, and when.

A workload is conversations. Each conversation picks one of a few system
prompts (shared by every conversation that picks it, so it is the fleet's
common prefix), then runs a number of turns; turn n's prompt is

    system prompt + (user message + answer) of turns 1..n-1 + user message n

so the history grows and, on the replica that served turn n-1, all but the
newest user message is cached. Answers are the engine's own deterministic
tokens (engine.sampling.tokens_between with the request's seed), so the
history the next turn sends is exactly what the replica cached.

Arrivals:
- "users"  closed loop, seed 003's model: `users` people each send a turn,
           wait for the whole answer, think for an exponential `think_time_s`,
           send the next turn; a finished conversation is followed (after a
           think) by a new one. The run starts in steady state: each user's
           first request comes after an exponential think (memoryless, so that
           is the residual of a think already under way), and their current
           conversation is already some turns old (see `new_conversation`),
           with history no replica has cached yet (a cold fleet at peak).
- "poisson" new conversations arrive as a Poisson process at
           `conversation_rate` per second; later turns follow their answers
           after a think, as above.
- "trace"  new conversations start at the given `trace_arrivals` times.
- "bursty" on/off arrivals: Poisson at `conversation_rate` for `burst_on_s`,
           then nothing for `burst_off_s`, repeated (mean rate
           conversation_rate * on / (on + off)); later turns as above.

A conversation ends early when its next prompt plus the output cap would pass
`max_context_tokens` (the engine's max_model_len).
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field
from typing import Literal

from sluice.engine.sampling import (
    GeometricLength,
    LengthDistribution,
    LogNormalLength,
    TokenSpace,
    tokens_between,
    uniform,
)

ArrivalMode = Literal["users", "poisson", "trace", "bursty"]
ARRIVAL_MODES: tuple[ArrivalMode, ...] = ("users", "poisson", "trace", "bursty")
UNKNOWN_ARRIVAL = "unknown arrival mode {mode!r}; known: users, poisson, trace, bursty"
END_ID = 2            # the engine stops a request here when its drawn length is shorter than the cap


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    duration_s: float = 600.0
    arrival: ArrivalMode = "users"
    users: int = 10_000                     # "users": concurrent people (closed loop)
    think_time_s: float = 166.0             # mean read-and-type time after an answer (exponential)
    conversation_rate: float = 1.0          # "poisson": new conversations per second ("bursty": while on)
    burst_on_s: float = 20.0                # "bursty": length of each burst
    burst_off_s: float = 20.0               # "bursty": silence between bursts
    # "poisson": the rate steps from conversation_rate to ramp_factor times it, linearly over ramp_s
    # from ramp_start_s (seed 000: "traffic doubles in five minutes"); 1.0 = a constant rate
    ramp_factor: float = 1.0
    ramp_start_s: float = 0.0
    ramp_s: float = 300.0
    trace_arrivals: tuple[float, ...] = ()  # "trace": start times of conversations
    turns: LengthDistribution = GeometricLength(2.5)
    system_prompt_tokens: int = 400
    num_system_prompts: int = 1
    user_tokens: LengthDistribution = LogNormalLength.from_mean_p95(120, 400)
    output_tokens: LengthDistribution = LogNormalLength.from_mean_p95(350, 1200)
    max_output_tokens: int = 4096           # request_output_len sent with every request
    max_context_tokens: int = 8192          # max_model_len: prompt + cap must fit
    warmup_s: float = 0.0                   # requests arriving earlier are left out of the latency figures
    model_version: str = "llama-3-70b"
    tokens: TokenSpace = field(default_factory=lambda: TokenSpace(vocab_size=128_256, first_normal_id=4))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVAL_MODES:
            raise ValueError(UNKNOWN_ARRIVAL.format(mode=self.arrival))


@dataclass(slots=True)
class Conversation:
    conversation_id: str
    user: int                  # the closed-loop user who owns it (-1 for open-loop arrivals)
    history: array[int]        # every token so far, 4 bytes each: 10,000 conversations of a few
                               # thousand tokens stay small
    turns_left: int
    turn: int = 0


@dataclass(frozen=True, slots=True)
class Turn:
    """One request the workload wants sent."""

    request_id: str
    conversation: Conversation
    prompt: tuple[int, ...]
    max_output_tokens: int
    seed: int


class Workload:
    """Draws conversations and turns; the simulator tells it when answers finish."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._systems = [array("i", tokens_between(config.tokens, config.seed * 1_000_003 + index, 0,
                                                   config.system_prompt_tokens))
                         for index in range(config.num_system_prompts)]
        self._conversations = 0
        self._requests = 0

    def initial_arrivals(self) -> list[tuple[float, Conversation]]:
        """(time, conversation) of every conversation start known up front."""
        config, rng = self.config, self._rng
        if config.arrival == "users":
            return [(self.think_time(), self.new_conversation(user, in_progress=True))
                    for user in range(config.users)]
        if config.arrival == "trace":
            return [(at, self.new_conversation(-1)) for at in config.trace_arrivals if at < config.duration_s]
        starts: list[tuple[float, Conversation]] = []
        peak = config.conversation_rate * max(config.ramp_factor, 1.0)
        on_clock = rng.expovariate(peak)
        while (at := self._wall_time(on_clock)) < config.duration_s:
            # Thinning: a Poisson process at the peak rate, each arrival kept with rate(t) / peak.
            if config.ramp_factor == 1.0 or rng.random() * peak < self.rate_at(at):
                starts.append((at, self.new_conversation(-1)))
            on_clock += rng.expovariate(peak)
        return starts

    def rate_at(self, at: float) -> float:
        """New conversations per second at time `at` (the ramp; bursts aside)."""
        config = self.config
        if at < config.ramp_start_s:
            progress = 0.0
        else:
            progress = min((at - config.ramp_start_s) / config.ramp_s, 1.0) if config.ramp_s > 0 else 1.0
        return config.conversation_rate * (1.0 + (config.ramp_factor - 1.0) * progress)

    def _wall_time(self, on_clock: float) -> float:
        """Poisson arrivals are drawn on a clock that runs only while arrivals are on; "bursty"
        maps that clock onto bursts of `burst_on_s` separated by `burst_off_s` of silence."""
        config = self.config
        if config.arrival != "bursty":
            return on_clock
        burst, into = divmod(on_clock, config.burst_on_s)
        return burst * (config.burst_on_s + config.burst_off_s) + into

    def new_conversation(self, user: int, in_progress: bool = False) -> Conversation:
        """A conversation about to send its first turn; `in_progress` gives it earlier exchanges.

        A request picked at random belongs to turn n with probability ∝ P(turns ≥ n), which
        for geometric turns is the same geometric law, so an in-progress conversation gets
        `turns.quantile(u) − 1` synthetic earlier exchanges (exact for geometric turns, a
        close stand-in otherwise) and, memoryless again, a fresh draw of turns to go.
        """
        config, rng = self.config, self._rng
        index = self._conversations
        self._conversations += 1
        history = array("i", self._systems[index % len(self._systems)] if config.system_prompt_tokens else ())
        if in_progress:
            for _ in range(config.turns.quantile(rng.random()) - 1):
                for lengths in (config.user_tokens, config.output_tokens):
                    seed = rng.getrandbits(63)
                    history.extend(tokens_between(config.tokens, seed, 0, lengths.quantile(uniform(seed))))
        turns = config.turns.quantile(rng.random())
        return Conversation(conversation_id=f"c{index}", user=user, history=history, turns_left=turns)

    def next_turn(self, conversation: Conversation) -> Turn | None:
        """The conversation's next request, or None when it is over (turns spent or context full)."""
        config = self.config
        if conversation.turns_left <= 0:
            return None
        message_seed = self._rng.getrandbits(63)
        length = config.user_tokens.quantile(uniform(message_seed))
        message = tokens_between(config.tokens, message_seed, 0, length)
        prompt_len = len(conversation.history) + len(message)
        cap = min(config.max_output_tokens, config.max_context_tokens - prompt_len)
        if cap < 1:
            return None
        conversation.history.extend(message)
        conversation.turns_left -= 1
        conversation.turn += 1
        self._requests += 1
        return Turn(request_id=f"{conversation.conversation_id}-t{conversation.turn}",
                    conversation=conversation, prompt=tuple(conversation.history), max_output_tokens=cap,
                    seed=self._rng.getrandbits(63))

    def resend(self, turn: Turn) -> Turn:
        """The same prompt as a new request (new id and seed): what a client does after INTERRUPTED."""
        self._requests += 1
        return Turn(request_id=f"{turn.request_id}-resent{self._requests}", conversation=turn.conversation,
                    prompt=turn.prompt, max_output_tokens=turn.max_output_tokens,
                    seed=self._rng.getrandbits(63))

    def answer_finished(self, turn: Turn, num_output_tokens: int) -> None:
        """Append the answer the replica streamed, so the next turn sends it back as history."""
        turn.conversation.history.extend(tokens_between(self.config.tokens, turn.seed, 0, num_output_tokens))

    def think_time(self) -> float:
        return self._rng.expovariate(1.0 / self.config.think_time_s)
