"""What operators see: Prometheus metrics (``metrics``), evidence records of
degenerate answers (``evidence``), log configuration (``logs``), OpenTelemetry
traces (``tracing``; the SDK side ``otel``, imported only when tracing is on)."""
