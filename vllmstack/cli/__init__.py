"""The command line's glue: how `tasks.py` declares invoke tasks (the top layer; nothing imports it)."""
