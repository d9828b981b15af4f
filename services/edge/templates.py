"""Chat templates from the model registry: OpenAI `messages` → the prompt text admission tokenizes.

Templates are Jinja, the format Hugging Face tokenizers ship theirs in, rendered in an immutable
sandbox (a template is data from the registry, not code we trust) with the variables those
templates expect: `messages` (role, content), `add_generation_prompt`, `raise_exception`.

`ModelCards` keeps each model's card (version, template) for a few seconds, so a chat request costs
no registry read on the hot path. The trade-off: for up to `ttl_s` after an operator moves an
alias, a request may be rendered with the previous version's template (admission pins the run to
the version the alias names then); the cards are re-read when that window ends.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from sluice.ledger.repositories import ModelCard, ModelRepository
from sluice.services.edge.errors import NO_CHAT_TEMPLATE, UNKNOWN_ROLE, InvalidField
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEMPLATE_FAILED = "the chat template of model {model!r} could not render these messages: {detail}"


@dataclass(frozen=True, slots=True)
class Message:
    role: str                        # system | user | assistant (OpenAI's developer → system)
    content: str


def message(role: str, content: str, param: str) -> Message:
    if role not in ROLES:
        raise InvalidField(UNKNOWN_ROLE.format(param=param, role=role), param)
    return Message(ROLES[role], content)


def _raise(message: str) -> None:
    raise TemplateError(message)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env


@functools.lru_cache(maxsize=64)
def _compiled(text: str):  # type: ignore[no-untyped-def]
    return _environment().from_string(text)


def render(card: ModelCard, messages: Sequence[Message]) -> str:
    if card.chat_template is None:
        raise InvalidField(NO_CHAT_TEMPLATE.format(model=card.version), "model")
    try:
        return str(_compiled(card.chat_template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True))
    except TemplateError as error:
        raise InvalidField(TEMPLATE_FAILED.format(model=card.version, detail=error), "messages") from None


class ModelCards:
    """Model cards by name (version or alias), each reused for `ttl_s` seconds."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions = sessions
        self._ttl_s = ttl_s
        self._clock = clock
        self._cards: dict[str, tuple[float, ModelCard]] = {}

    async def get(self, name: str) -> ModelCard | None:
        now = self._clock()
        hit = self._cards.get(name)
        if hit is not None and hit[0] > now:
            return hit[1]
        async with self._sessions() as session:
            card = await ModelRepository(session).card(name)
        if card is not None:      # unknown names are not kept: a model added now is found now
            self._cards[name] = (now + self._ttl_s, card)
        return card

    async def all(self) -> list[ModelCard]:
        async with self._sessions() as session:
            return await ModelRepository(session).cards()
