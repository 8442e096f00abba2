"""Operator tools beside the serving path: ``probe`` (is a server corrupting
answers?), ``plot`` (its chart), ``demo`` and ``localvllm`` (a tiny local vLLM with
a poisoned prefix cache, direct vs. through the gateway)."""
