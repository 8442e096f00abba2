"""Byte-level formats the gateway reads and writes: SSE framing (``sse``), JSON
scanned without parsing it whole (``jsonscan``), vLLM's own event bytes read on the
fast path (``vllm_events``). No I/O, no gateway types: the bottom layer."""
