"""The guard: a parsed request in, attempts against the upstream, one released answer
out. ``loop`` (the attempt loop: retry, failover, salts, release), ``stream`` (an
upstream stream read and held back), ``request`` (the guarded request parsed),
``budget`` (the retry budget), ``salt`` and ``conversations`` (cache salts, the salt
ladder and what is remembered per conversation), ``shared_state`` and ``redis_lookups``
(that memory shared through Redis, its lookups batched). Free of the web framework: the server layer
turns a release into ASGI."""
