"""The vLLM side: the backend pool with its transport, health, routing and error
mapping (``pool``), and the scrape of vLLM's own metrics (``scrape``)."""
