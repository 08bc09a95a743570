"""Benchmarks reach capdispatch through its public face, read from their source (every
import, those inside functions too).

A benchmark imports `capdispatch` (`import capdispatch as cd`, then only names of
`capdispatch.__all__`, or `from capdispatch import NAME` for such a name) and, as the
subject it measures, the modules of a kernel folder under capdispatch/backends/ (an op
folder such as `backends.moe`, or a shared kernel folder such as `backends.sparse_attention`,
`backends.triton_common`) or of an adapter (`adapters.sglang`, whose routes it times).
Nothing else of the house: not calibrate, dispatch, models, proof, policies, nor the
modules directly under backends/ (registry, torch_ops, launch_limits, ...); what a
benchmark needs of them is a face name.
"""
import ast
import glob
import os

import pytest

import capdispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
FOLDERS = ("backends", "adapters")


def _subject(module: str) -> bool:
    """capdispatch.backends.<folder>[...] or capdispatch.adapters.<folder>[...]: a kernel
    folder or an adapter package (a directory, not a module directly under backends/)."""
    parts = module.split(".")
    return (len(parts) >= 3 and parts[0] == "capdispatch" and parts[1] in FOLDERS
            and os.path.isdir(os.path.join(ROOT, *parts[:3])))


def _face(name: str) -> bool:
    return name in capdispatch.__all__ or (name.startswith("__") and name.endswith("__"))


def past_the_face(path: str) -> list:
    """'file:line what' for every way PATH reaches capdispatch other than the face or a subject."""
    where = os.path.relpath(path, ROOT)
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    bad, faces = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "capdispatch":
                    faces.add(a.asname or a.name)
                elif a.name.startswith("capdispatch.") and not _subject(a.name):
                    bad.append(f"{where}:{node.lineno} import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "capdispatch":
            for a in node.names:
                if node.module == "capdispatch":
                    ok = _face(a.name) or _subject(f"capdispatch.{a.name}")
                else:
                    ok = _subject(node.module) or _subject(f"{node.module}.{a.name}")
                if not ok:
                    bad.append(f"{where}:{node.lineno} from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in faces and not _face(node.attr):
            bad.append(f"{where}:{node.lineno} {node.value.id}.{node.attr}")
        # A face namespace (cd.speed_model, ...) lends its public names only.
        elif (isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
              and node.value.value.id in faces and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append(f"{where}:{node.lineno} {node.value.value.id}.{node.value.attr}.{node.attr}")
    return bad


def _benchmarks():
    return sorted(glob.glob(os.path.join(BENCH, "*.py")))


def test_benchmarks_use_only_the_face():
    assert len(_benchmarks()) > 10          # the scan sees the benchmarks
    bad = [b for path in _benchmarks() for b in past_the_face(path)]
    assert not bad, "benchmark imports past the face: " + "; ".join(bad)


@pytest.mark.parametrize("src", [
    "from capdispatch.calibrate import inputs as CI\n",
    "def f():\n    from capdispatch.backends.registry import builtin\n",
    "import capdispatch.dispatch.speed\n",
    "from capdispatch import dispatch\n",
    "from capdispatch.backends import launch_limits as LL\n",
    "import capdispatch as cd\ncd.dispatch.resolve\n",
    "import capdispatch as cd\ncd.speed_model._private(1)\n",
])
def test_the_reader_sees_a_way_past_the_face(tmp_path, src):
    bad = tmp_path / "bench_bad.py"
    bad.write_text(src)
    assert past_the_face(str(bad))


@pytest.mark.parametrize("src", [
    "import capdispatch as cd\ncd.bind\ncd.__version__\n",
    "from capdispatch import bind, registry\n",
    "def f():\n    from capdispatch.backends.moe import triton_kernels as tk\n",
    "from capdispatch.backends import moe\n",
    "from capdispatch.backends.sparse_attention import kernels as K\n",
    "import capdispatch.backends.indexer.layout\n",
    "import capdispatch as cd\ncd.calibration_inputs.decode_args\n",
])
def test_the_face_and_kernel_folders_pass(tmp_path, src):
    ok = tmp_path / "bench_ok.py"
    ok.write_text(src)
    assert not past_the_face(str(ok))
