"""The ``tokenspeed`` command: generate, chat, bench, bench-serve, inspect and serve."""
