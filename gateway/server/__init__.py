"""The HTTP side: the ASGI application with its routes, path policy and auth
(``app``), the relay that writes a released answer to the client (``relay``), and
the uvicorn protocol with the edge's limits, behind its version gate
(``uvicorn_edge``)."""
