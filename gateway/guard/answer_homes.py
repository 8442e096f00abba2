"""Where a stored answer lives: the pod a follow-up, a GET or a cancel of an answer
id must reach (Responses' ``previous_response_id``), for the guarded and the
unguarded routes alike.

Remembered by this process or, with Redis, by any (``AnswerChains``); else found by
asking every healthy backend for the id, and remembered.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Mapping

from gateway.apis import ApiAdapter
from gateway.errors import BadRequest
from gateway.guard.conversations import AnswerChains
from gateway.guard.shared_state import SharedAnswerChains
from gateway.observe.metrics import Metrics
from gateway.upstream.pool import Backend, BackendPool

#: How long an answer id that no backend held is not asked for again, and how many
#: such ids are remembered (at most MAX_NOT_FOUND x MAX_ANSWER_ID_CHARS: 1 MiB).
NOT_FOUND_MEMORY_S = 30.0
MAX_NOT_FOUND = 4096
#: An answer id the gateway looks for: vLLM's own (``resp_`` and 16 hex digits) or
#: one a client chose (vLLM's ``request_id`` field), within this length and these
#: characters. Anything else is refused before a pod is asked (each unknown id
#: costs a GET per pod, and is remembered).
MAX_ANSWER_ID_CHARS = 256
_ANSWER_ID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_ANSWER_ID_CHARS}}}")


class AnswerHomes:
    def __init__(
        self, pool: BackendPool, chains: AnswerChains | SharedAnswerChains, metrics: Metrics
    ) -> None:
        self.pool = pool
        self.chains = chains
        self.metrics = metrics
        #: Answer ids no healthy backend held when asked, and when that was: asked
        #: again only after NOT_FOUND_MEMORY_S (a client repeating an unknown id
        #: would otherwise cost a GET on every pod per request).
        self._not_found: OrderedDict[str, float] = OrderedDict()

    async def find(
        self,
        api: ApiAdapter,
        answer_id: str,
        headers: Mapping[str, str],
        *,
        param: str | None = "previous_response_id",
    ) -> Backend | None:
        """The healthy backend that stores the answer ``answer_id``; None when no
        backend holds it (the request goes where routing sends it, and vLLM answers
        its 404), or when there is one backend (routing has no other choice).
        Raises BadRequest for an id no server gives (``MAX_ANSWER_ID_CHARS``)."""
        if _ANSWER_ID.fullmatch(answer_id) is None:
            raise BadRequest(
                f"answer id is not one a server gives: at most {MAX_ANSWER_ID_CHARS} "
                "letters, digits and '_.:-'",
                param=param,
            )
        chain = await self.chains.lookup(answer_id)
        if chain is not None and (known := self.pool.healthy_with_identity(chain.backend)):
            self.metrics.answer_homes.labels("remembered").inc()
            return known
        path = api.stored_path(answer_id)
        if path is None or sum(b.healthy for b in self.pool.backends) < 2:
            return None
        asked_at = self._not_found.get(answer_id)
        now = time.monotonic()
        if asked_at is not None and now - asked_at < NOT_FOUND_MEMORY_S:
            self.metrics.answer_homes.labels("not_found").inc()
            return None
        found, not_held = await self.pool.first_holding(path, headers)
        source = "asked" if found else "not_found" if not_held else "unanswered"
        self.metrics.answer_homes.labels(source).inc()
        if found is None and not not_held:
            return None  # a pod that could not say may hold it: asked again next time
        if found is None:
            self._not_found[answer_id] = now
            self._not_found.move_to_end(answer_id)
            while len(self._not_found) > MAX_NOT_FOUND:
                self._not_found.popitem(last=False)
        else:
            self._not_found.pop(answer_id, None)
            conversation = chain.conversation if chain is not None else None
            self.chains.remember(answer_id, conversation, found.identity)
        return found
