"""The face: ``ts.LLM`` (offline), the command line, and the OpenAI-compatible server
(``openai/``, with the engine process it drives). The engine never imports anything here."""
