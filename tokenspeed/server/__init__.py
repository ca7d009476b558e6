"""The OpenAI-compatible server (``tokenspeed serve``): the HTTP processes (``openai/``)
and the engine process they drive, with the typed channel between them."""
