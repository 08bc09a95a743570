"""Where the kernel tests run: on CUDA when present, else Triton's CPU interpreter.

TRITON_INTERPRET is set per test (an autouse fixture that test modules import),
never at import time: a process-wide setting would leak into tests that check
that a decision reads the environment, and into subprocesses they start.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = (not HAS_CUDA and os.environ.get("TRITON_INTERPRET", "1") not in ("", "0")) or (
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if not HAS_CUDA and "TRITON_INTERPRET" not in os.environ:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
