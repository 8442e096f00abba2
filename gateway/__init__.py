"""vllm-guard: a response-guarding OpenAI-compatible gateway for vLLM."""

__version__ = "0.1.0"
