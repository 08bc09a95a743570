"""The SGLang releases the adapter's tests run against: the venv's (0.5.23, from
tests/requirements-nodeps.txt) and 0.5.17 in its own folder (tests/requirements-sglang-0.5.17.txt,
installed by the README's test command with `pip install --no-deps --target`). A test of a
release runs SGLang in a fresh process whose path puts that release's folder first."""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDERS = {"0.5.17": os.path.join(HERE, ".releases", "sglang-0.5.17")}
INSTALLED = "0.5.23"
RELEASES = (INSTALLED, *FOLDERS)


def folder(release: str):
    """The folder to put first on sys.path for RELEASE (None: the venv's own SGLang).
    A release whose folder is missing is an error, never a skip: install it as the README says."""
    if release == INSTALLED:
        return None
    path = FOLDERS[release]
    if not os.path.isdir(os.path.join(path, "sglang")):
        raise RuntimeError(f"SGLang {release} is not installed in {path}: run "
                           f"pip install -q --no-deps --target {os.path.relpath(path, os.path.dirname(HERE))} "
                           f"-r tests/requirements-sglang-{release}.txt")
    return path


def package_dir(release: str) -> str:
    """The `sglang` package folder of RELEASE (its source, for tests that read it)."""
    base = folder(release)
    if base is None:
        import importlib.util
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("SGLang is not installed in this environment (tests/requirements-nodeps.txt)")
        return list(spec.submodule_search_locations)[0]
    return os.path.join(base, "sglang")


def env(release: str, env: dict) -> dict:
    """ENV with RELEASE's folder first on PYTHONPATH."""
    base = folder(release)
    if base is None:
        return env
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (base, env.get("PYTHONPATH")) if p)
    return out
