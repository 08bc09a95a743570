"""Rehearsing a group: one process per rank, each running its own decisions on a small model
with the target model's layer structure and the group's collectives, against one reference.

`rehearse(...)` (runner.py) is the entry; `dispatch rehearse` its command."""
from __future__ import annotations
