"""What operators see: Prometheus metrics (``metrics``), evidence records of
degenerate answers (``evidence``), log configuration (``logs``)."""
