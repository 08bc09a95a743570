"""Ends the process at import, as os._exit does: no exception, no cleanup, exit 0."""
import os

os._exit(0)


def register(registry):
    pass
