"""The OpenAI-compatible HTTP server (``tokenspeed serve``): FastAPI handlers that only
enqueue requests into the one engine loop and read their streams."""
