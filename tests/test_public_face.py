"""capdispatch's one public face: `dir(capdispatch)` is `__all__` (and dunders), every name
resolves, and every `cd.X` / `capdispatch.X` the docs and README name exists."""
import importlib
import os
import re
import subprocess
import sys

import pytest
from doc_files import docs as _docs

import capdispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# cd.X or capdispatch.X[.Y...], not inside another dotted name (torch.ops.capdispatch.x, a file path).
NAME = re.compile(r"(?<![\w./-])(cd|capdispatch)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")




def _resolves(path: str) -> bool:
    """capdispatch.PATH names something: a face name, or a module then its attributes."""
    parts = path.split(".")
    if parts[0] in capdispatch.__all__:
        return True
    for i in range(len(parts), -1, -1):
        try:
            obj = importlib.import_module(".".join(["capdispatch", *parts[:i]]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _names():
    out = []
    for doc in _docs():
        for n, line in enumerate(open(os.path.join(ROOT, doc), encoding="utf-8"), 1):
            for m in NAME.finditer(line):
                out.append((doc, n, m.group(1), m.group(2)))
    return out


def test_dir_is_all_and_dunders():
    # Even after submodules were imported (they become attributes of the package).
    import capdispatch.dispatch  # noqa: F401
    import capdispatch.backends  # noqa: F401
    names = {n for n in dir(capdispatch) if not (n.startswith("__") and n.endswith("__"))}
    assert names == set(capdispatch.__all__)


def test_dir_in_a_fresh_process_is_the_face():
    code = "import capdispatch as cd; print(','.join(n for n in dir(cd) if not n.startswith('__')))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().split(",") == sorted(capdispatch.__all__)


@pytest.mark.parametrize("name", capdispatch.__all__)
def test_every_face_name_resolves(name):
    assert getattr(capdispatch, name) is not None


def test_the_checker_flags_a_missing_name():
    assert not _resolves("NoSuchThing") and not _resolves("backends.cases.NoSuch")
    assert _resolves("backends.cases.Case") and _resolves("Plan")


def test_every_name_the_docs_give_exists():
    bad = []
    for doc, n, alias, path in _names():
        ok = path.split(".")[0] in capdispatch.__all__ if alias == "cd" else _resolves(path)
        if not ok:
            bad.append(f"{doc}:{n}: {alias}.{path}")
    assert not bad, "names the docs give that do not exist: " + "; ".join(bad)
    assert len(_names()) > 50        # the scan sees the docs' names
