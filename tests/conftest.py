import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_cli():
    """Run `python -m capdispatch ARGS` in a fresh process; return (rc, stdout, stderr)."""
    def run(*args, env=None):
        e = dict(os.environ)
        e.pop("CAPDISPATCH_POLICY", None)
        e.pop("CAPDISPATCH_SET", None)
        e.pop("CAPDISPATCH_STRICT", None)
        e.pop("CAPDISPATCH_LOCK", None)
        e.update(env or {})
        p = subprocess.run([sys.executable, "-m", "capdispatch", *args], capture_output=True,
                           text=True, env=e, cwd=ROOT, timeout=120)
        return p.returncode, p.stdout, p.stderr
    return run


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", "CAPDISPATCH_LOCK", "TRITON_INTERPRET"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.fixture(autouse=True)
def _private_verification_cache(tmp_path_factory, monkeypatch):
    """Every test reads and writes canary verdicts in a cache of its own, never the user's."""
    monkeypatch.setenv("CAPDISPATCH_CACHE_DIR", str(tmp_path_factory.mktemp("capdispatch-cache")))
