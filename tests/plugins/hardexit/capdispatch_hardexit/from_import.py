"""Ends the process at import through a name imported from os."""
from os import _exit

_exit(0)


def register(registry):
    pass
