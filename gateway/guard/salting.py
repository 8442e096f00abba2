"""Which cache salt each attempt gets, and what the guard remembers to choose it.

Per conversation, the salt that last gave a clean answer (``SaltMemory``: the next
turn starts there, not in the poisoned cache) and the rung of the salt ladder a
retry climbs to (``SaltLadder``: every process computes the same one); per answer a
later request continues by id (Responses), its conversation and the pod that holds
it (``AnswerChains``). With ``state.redis_url`` both memories are shared through
Redis (``gateway.guard.shared_state``); else each process keeps its own.
"""

from __future__ import annotations

from gateway.config import Settings
from gateway.guard.attempt import Attempt
from gateway.guard.conversations import AnswerChains, SaltMemory, conversation_key
from gateway.guard.request import GuardedRequest
from gateway.guard.salt import SaltLadder, fresh_salt
from gateway.guard.shared_state import RedisLink, SharedAnswerChains, SharedSaltMemory
from gateway.guard.trace import Trace
from gateway.observe.metrics import Metrics


class Salting:
    def __init__(self, settings: Settings, metrics: Metrics, *, reuse: bool) -> None:
        self.settings = settings.guard.salt_reuse
        self.max_attempts = settings.guard.max_attempts
        self.metrics = metrics
        #: Remembered salts are reused (salt reuse enabled and the guard enforcing).
        self.reuse = reuse and self.settings.enabled
        local_salts = SaltMemory(self.settings)
        local_chains = AnswerChains(self.settings.max_entries)
        self.redis = (
            RedisLink(settings.state, metrics) if settings.state.redis_url is not None else None
        )
        metrics.state_shared_configured.set(1 if self.redis is not None else 0)
        self.shared_salts = (
            SharedSaltMemory(local_salts, self.redis, self.settings) if self.redis else None
        )
        self.salts: SaltMemory | SharedSaltMemory = (
            local_salts if self.shared_salts is None else self.shared_salts
        )
        self.chains: AnswerChains | SharedAnswerChains = (
            SharedAnswerChains(local_chains, self.redis, self.settings.ttl_s)
            if self.redis
            else local_chains
        )
        key = self.settings.key
        self.ladder = SaltLadder(key.get_secret_value().encode() if key is not None else None)

    def fingerprint(self, request: GuardedRequest) -> str | None:
        """The request's conversation: a hash of its leading messages, or for a request
        continuing a stored answer, that answer's conversation."""
        continued = request.api.continues(request.body)
        if continued is not None:  # the history lives in the backend: key on its chain
            return self.chains.conversation_of(continued)
        return conversation_key(request.endpoint, request.body, request.client_salt, self.settings)

    def conversation(self, trace: Trace) -> str | None:
        """The request's conversation fingerprint (None when salts are not reused),
        computed when first needed."""
        if not trace.conversation_known:
            trace.conversation = self.fingerprint(trace.request)
            trace.conversation_known = True
        return trace.conversation

    async def first_salt(self, trace: Trace) -> str | None:
        """The client's salt, or the conversation's remembered clean rung."""
        if self.shared_salts is not None and trace.conversation is not None:
            remembered = await self.shared_salts.lookup(trace.conversation)
        else:
            remembered = self.salts.get(trace.conversation)
        if remembered is None or not self.settings.on_first_attempt:
            return trace.request.client_salt
        salt, trace.rung = remembered
        self.metrics.salt_reuse.labels(trace.model, "first").inc()
        return salt

    def retry_salt(self, trace: Trace, failed: str | None) -> str:
        """The remembered clean rung if it is not the one that just failed, else the
        conversation's next rung (every process computes the same one), else for a
        request with no conversation a fresh random salt.

        The last attempt a request may make always gets a fresh random salt: a
        namespace nobody has used is a cache miss, and a miss cannot load a corrupt
        state. Shared rungs save prefill, but another process may have seen a rung
        go bad that this one still takes for clean (two gateways alternating a
        conversation's turns delivered corrupt answers when every retry climbed the
        ladder: BENCHMARKS.md)."""
        if trace.attempts + 1 >= self.max_attempts:
            return fresh_salt(trace.request.client_salt)
        conversation = self.conversation(trace)
        remembered = self.salts.get(conversation)
        if remembered is not None and remembered[0] != failed:
            self.metrics.salt_reuse.labels(trace.model, "retry").inc()
            salt, trace.rung = remembered
            return salt
        if conversation is None:
            return fresh_salt(trace.request.client_salt)
        trace.rung += 1
        return self.ladder.rung(conversation, trace.request.client_salt, trace.rung)

    def remember(self, attempt: Attempt, trace: Trace) -> None:
        """A clean answer came on ``attempt``'s salt: the conversation's next turn
        starts there (shared through Redis where configured)."""
        salt = attempt.salt
        if salt not in (None, trace.request.client_salt):
            self.salts.remember(self.conversation(trace), salt, trace.rung)

    def forget(self, attempt: Attempt, trace: Trace) -> None:
        """``attempt``'s salt gave a degenerate answer: not reused again."""
        if attempt.salt is not None and attempt.salt != trace.request.client_salt:
            self.salts.forget(self.conversation(trace), attempt.salt)

    def remember_answer(self, answer_id: str, attempt: Attempt, trace: Trace) -> None:
        """An answer a later request may continue by id (Responses): its conversation,
        so the next turn is keyed on the same one, and the pod that holds it."""
        conversation = self.conversation(trace) or self.fingerprint(trace.request)
        self.chains.remember(answer_id, conversation, attempt.backend.identity)
