"""A test-only vLLM scheduler that reproduces the field corruption inside real vLLM.

Start vLLM with ``--scheduler-cls poison_scheduler.PoisonScheduler`` (this folder
on PYTHONPATH). A request whose prefill *hit the prefix cache* is "poisoned" when
the hash of any block it reused falls under ``VG_POISON_RATE`` (0..1): Mamba
state is cumulative, so every extension of a poisoned chain is poisoned too. Its
sampled tokens are then rewritten, as the bug does:

* ``bang``: every token becomes id 0, which decodes to ``!`` (NaN logits);
* ``eos``: the first token becomes EOS, so the answer is empty with finish "stop".
* ``nan``: real NaNs, not a rewrite. When the request is scheduled, the last
  prefix-cache block it reuses has its cached KV overwritten with NaN in every
  layer (``_fill_nan``), so vLLM's own forward pass attends to NaN, its logits are
  NaN, its sampler picks token 0 (``!``: argmax over all-NaN logits returns index
  0, greedy or sampled, whose ``probs / q`` is NaN too) and, with
  ``VLLM_COMPUTE_NANS_IN_LOGITS=1``, its own counter ``vllm:corrupted_requests``
  counts the request. The block stays NaN in the prefix cache, and the blocks the
  request computes after it are NaN from the second layer on, so every unsalted
  request that reuses the chain is poisoned again; a salted one hashes to other
  blocks and is clean: the field behaviour, from the numerics up. The real bug's
  corrupt state is a Mamba/GDN layer's recurrent state, loaded once at the last
  reused block; this tiny model is attention-only, so the NaN sits in that block's
  KV instead. What follows (NaN activations, NaN logits, token 0) is the same.
  The scheduler names the block (``SchedulerOutput.vg_nan_blocks``, an attribute
  that rides the output's pickle to the worker process); the worker
  (``--worker-cls poison_scheduler.PoisonWorker``, vLLM's CPU worker) writes the
  NaN into its KV cache tensors before it runs that step.

``VG_POISON_KINDS`` (``bang,eos`` by default) lists the kinds; the block hash picks
one. A request may override both with ``"vllm_xargs": {"vg_poison_rate": 0.5,
"vg_poison_kinds": "bang"}``, so one test server serves clean and poisoned tests.

**The faithful model** (``vg_source_rate``, ``vg_propagate``): what the real bug
does, per vLLM's hybrid cache. Only the recurrent (Mamba) state at the *last*
block a prefill reuses is loaded, so a request is poisoned exactly when that block
holds a corrupt state. A block's state is corrupt two ways: it is a *source*
(written over draft positions that verification rejected: each cached block with
probability ``vg_source_rate``, chosen from its hash), or, with ``vg_propagate``,
it was computed by a request that had loaded a corrupt state (every block after
that request's hit is then corrupt too, so the conversation's next unsalted turn
is poisoned again). Another salt's namespace has other block hashes and is not
affected. Differences from the real bug: the source choice is a hash draw, not a
real rejected draft, and a corrupt state always yields the chosen symptom.
The legacy ``vg_poison_rate`` (a hit is poisoned if *any* block it reuses is)
stays for the older tests.

``"vg_poison_unsalted_only": true`` limits the poisoning to requests without a
``cache_salt`` (salted namespaces stay clean however often they hit).

``"vllm_xargs": {"vg_poison_after": N}`` corrupts an unsalted generation after N
healthy tokens (``_corrupt_mid_generation``: corruption that starts mid-way).

``"vllm_xargs": {"vg_loop_after": N, "vg_loop_unit": K}`` makes an unsalted
generation fall into a loop after N healthy tokens: from then on it repeats its last
K tokens (``_loop_mid_generation``).

``"vllm_xargs": {"vg_poison_all": "bang"}`` poisons a request whether or not it hit
the cache: a backend broken for everyone (a bad kernel or weights), where a salted
retry comes back degenerate too. It models no cache mechanism, only "retries do
not help", which is what the gateway's retry budget must recognise.
Because the decision depends on the cached block's hash, the corruption rate
tracks the hit rate, a request with a fresh ``cache_salt`` misses every
poisoned block and comes back clean, and a poisoned chain stays poisoned for
every request that reuses it: the field behaviour.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.worker.cpu_worker import CPUWorker

log = logging.getLogger("vllm.poison_scheduler")

_CLEAN = ""


def _uniform(data: bytes) -> float:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2**64


def _kv_caches(vllm_config: Any) -> list[Any]:
    """The KV cache tensor of every attention layer, as the CPU model runner reaches
    them (``static_forward_context``: one per layer, block index first)."""
    import torch

    context = vllm_config.compilation_config.static_forward_context
    tensors: dict[int, Any] = {}
    for layer in context.values():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, list):
            kv = kv[0] if kv else None
        if isinstance(kv, torch.Tensor) and kv.numel():
            tensors.setdefault(kv.data_ptr(), kv)
    return list(tensors.values())


class PoisonScheduler(AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Block hashes whose cached state was computed from a corrupt one (insertion
        #: ordered: the oldest go first past a million).
        self._corrupt_states: dict[bytes, None] = {}
        self.poison_rate = float(os.environ.get("VG_POISON_RATE", "0"))
        self.poison_kinds = [
            k for k in os.environ.get("VG_POISON_KINDS", "bang,eos").split(",") if k
        ]
        log.warning(
            "PoisonScheduler active: rate=%s kinds=%s (TEST ONLY)",
            self.poison_rate,
            self.poison_kinds,
        )

    def add_request(self, request: Any) -> None:
        """``"vllm_xargs": {"vg_log_prompt": <tag>}``: the request's prompt token ids and
        whether it is salted go to the log, tagged (what a test checks a gateway asked
        vLLM for, e.g. a continuation's prompt)."""
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        tag = extra.get("vg_log_prompt")
        if tag is not None:
            log.warning(
                "vg_prompt tag=%s salted=%s ids=%s",
                tag,
                bool(getattr(request, "cache_salt", None)),
                ",".join(map(str, request.prompt_token_ids or [])),
            )
        super().add_request(request)

    def _faithful_kind(self, request: Any, extra: dict[str, Any], kinds: list[str]) -> str:
        """The faithful model: the state at the last reused block decides."""
        stats = request.prefill_stats
        cached = int(getattr(stats, "num_local_cached_tokens", 0) or 0) if stats else 0
        block_size = int(self.block_size)
        blocks = cached // block_size if block_size else 0
        hashes = request.block_hashes
        if blocks <= 0 or blocks > len(hashes):
            return _CLEAN
        last = bytes(hashes[blocks - 1])
        source_rate = float(extra.get("vg_source_rate", 0.0))
        corrupt = last in self._corrupt_states or _uniform(b"source" + last) < source_rate
        if not corrupt:
            return _CLEAN
        if extra.get("vg_propagate"):
            # Every later block of this prompt is computed from the corrupt state.
            for later in hashes[blocks:]:
                self._corrupt_states[bytes(later)] = None
            while len(self._corrupt_states) > 1_000_000:
                self._corrupt_states.pop(next(iter(self._corrupt_states)))
        return kinds[int(_uniform(b"kind" + last) * len(kinds))]

    def _poison_kind(self, request: Any) -> str:
        stats = request.prefill_stats
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        if "vg_source_rate" in extra:
            names = [k for k in str(extra.get("vg_poison_kinds", "")).split(",") if k]
            return self._faithful_kind(request, extra, names or self.poison_kinds)
        broken = str(extra.get("vg_poison_all", ""))
        if broken in ("bang", "eos"):
            return broken
        rate = float(extra.get("vg_poison_rate", self.poison_rate))
        kinds = [k for k in str(extra.get("vg_poison_kinds", "")).split(",") if k]
        kinds = kinds or self.poison_kinds
        if stats is None or rate <= 0:
            return _CLEAN
        # "vg_poison_unsalted_only": poisoned blocks only in the default (unsalted)
        # namespace, so every salted retry is clean, however often it hits its own
        # cache: the field's picture of one poisoned chain, made deterministic.
        if extra.get("vg_poison_unsalted_only") and getattr(request, "cache_salt", None):
            return _CLEAN
        cached = int(getattr(stats, "num_local_cached_tokens", 0) or 0)
        block_size = int(self.block_size)
        blocks = cached // block_size if block_size else 0
        if blocks <= 0 or blocks > len(request.block_hashes):
            return _CLEAN
        # Recurrent state is cumulative: a state computed from a poisoned block is
        # poisoned too, so a hit is poisoned if any block it reuses is.
        for block_hash in request.block_hashes[:blocks]:
            if _uniform(b"rate" + bytes(block_hash)) < rate:
                return kinds[int(_uniform(b"kind" + bytes(block_hash)) * len(kinds))]
        return _CLEAN

    def _kind_of(self, request: Any) -> str:
        kind = getattr(request, "_vg_poison", None)
        if kind is None:
            kind = request._vg_poison = self._poison_kind(request)
        return str(kind)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """A poisoned ``nan`` request has the last block it reuses named for the worker,
        which fills it with NaN before the step that first reads it
        (``PoisonWorker``)."""
        output = super().schedule(*args, **kwargs)
        poisoned = []
        for new in output.scheduled_new_reqs:
            request = self.requests.get(new.req_id)
            if request is not None and self._kind_of(request) == "nan":
                block = self._last_reused_block(new.block_ids, int(new.num_computed_tokens))
                if block is not None:
                    poisoned.append(block)
        if poisoned:
            output.vg_nan_blocks = poisoned
        fresh = self._fresh_blocks(output)
        if fresh:
            output.vg_fresh_blocks = fresh
        return output

    def _fresh_blocks(self, output: Any) -> list[int]:
        """The blocks this step hands to a request for KV it has yet to compute (not
        its prefix-cache hits): the worker clears them when a NaN may have been left
        in them (``PoisonWorker``). A preempted request that resumes is left out (its
        new blocks include its hits, which may hold the poison on purpose)."""
        size = int(self.block_size)
        fresh = []
        for new in output.scheduled_new_reqs:
            group = new.block_ids[0] if new.block_ids else []
            fresh += [int(block) for block in group[int(new.num_computed_tokens) // size :]]
        cached = output.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if blocks and req_id not in cached.resumed_req_ids:
                fresh += [int(block) for block in blocks[0]]
        return fresh

    def _last_reused_block(self, block_ids: Any, cached_tokens: int) -> int | None:
        blocks = cached_tokens // int(self.block_size)
        group = block_ids[0] if block_ids else []
        if blocks <= 0 or blocks > len(group):
            return None
        return int(group[blocks - 1])

    def _update_request_with_output(
        self, request: Any, new_token_ids: list[int], is_stale: bool = False
    ) -> tuple[list[int], bool]:
        kind = self._kind_of(request)
        new_token_ids = self._corrupt_mid_generation(request, new_token_ids)
        new_token_ids = self._loop_mid_generation(request, new_token_ids)
        if kind == "bang":
            new_token_ids = [0] * len(new_token_ids)
        elif kind == "eos" and new_token_ids:
            eos = request.sampling_params.eos_token_id
            if eos is not None:
                new_token_ids = [eos]
        return super()._update_request_with_output(request, new_token_ids, is_stale)

    def _corrupt_mid_generation(self, request: Any, new_token_ids: list[int]) -> list[int]:
        """``"vg_poison_after": N``: an unsalted generation turns to token 0 (``!``)
        after N healthy output tokens, whatever the cache.

        It models corruption that starts in the middle of a generation, as the field
        reports from the async accepted-count race (vLLM #51571/#53919: with async
        scheduling and speculative decoding a step can read a stale count of
        accepted draft tokens, and the generation goes bad from there). Where it
        differs: the real race does not care about ``cache_salt``; here a salted
        request is immune, so that a salted continuation of the healthy text comes
        back clean and the gateway's recovery of a released stream is observable."""
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        after = extra.get("vg_poison_after")
        if after is None or getattr(request, "cache_salt", None) or not new_token_ids:
            return new_token_ids
        healthy = max(0, int(after) - int(request.num_output_tokens))
        return new_token_ids[:healthy] + [0] * (len(new_token_ids) - healthy)

    def _loop_mid_generation(self, request: Any, new_token_ids: list[int]) -> list[int]:
        """``"vg_loop_after": N, "vg_loop_unit": K``: an unsalted generation repeats
        its last K tokens over and over once it has N, whatever the cache.

        It models the loops the field reports beside the ``!`` runs (an n-gram or a
        token repeated to the length limit after a healthy start). Where it differs:
        a real loop comes out of the model's corrupt state and need not be exact;
        here the repeated tokens are rewritten in, exactly, and a salted request is
        immune (so a salted continuation from before the loop comes back clean)."""
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        after = extra.get("vg_loop_after")
        if after is None or getattr(request, "cache_salt", None) or not new_token_ids:
            return new_token_ids
        after, unit = int(after), int(extra.get("vg_loop_unit", 3))
        so_far = list(request.output_token_ids)
        out = []
        for token in new_token_ids:
            position = len(so_far)
            if position >= after >= unit:
                token = so_far[after - unit + (position - after) % unit]
            so_far.append(token)
            out.append(token)
        return out


class PoisonWorker(CPUWorker):
    """vLLM's CPU worker, which writes NaN into the KV cache blocks the scheduler named
    (``vg_nan_blocks``) before it runs the step: the ``nan`` poison.

    Once it has, a block freed and handed to another request may still hold NaN in
    the slots that request has not written yet, and this CPU build's attention reads
    a block's slots past the sequence's end in whole tiles (masked, but a masked
    score times a NaN value is NaN): a clean, salted request turned to '!' part-way.
    GPU kernels never read those slots, so the worker clears every block a request
    gets fresh (``vg_fresh_blocks``) before the step that writes it: the poison stays
    where the model puts it (the cached chain), and nowhere else."""

    _nan_written = False

    def execute_model(self, scheduler_output: Any) -> Any:
        blocks = getattr(scheduler_output, "vg_nan_blocks", None)
        fresh = getattr(scheduler_output, "vg_fresh_blocks", None)
        if blocks or (fresh and self._nan_written):
            caches = _kv_caches(self.vllm_config)
            if not caches:
                log.error("PoisonWorker: no KV cache found; 'nan' poisons nothing")
            clear = fresh if fresh and self._nan_written else []
            for kv in caches:
                for block in clear:
                    kv[block].zero_()
                for block in blocks or ():
                    kv[block].fill_(float("nan"))
            self._nan_written = self._nan_written or bool(blocks)
        return super().execute_model(scheduler_output)
