"""The face: ``ts.LLM`` (offline), the command line, and (later) the server. The engine
never imports anything here."""
