"""The Python API: ``ts.LLM`` (offline generation, chat, streaming), its prompts, sampling
defaults and outputs. The command line and the server build on it; the engine never
imports anything here."""
