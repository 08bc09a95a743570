"""Benchmarks reach capdispatch through its public face, read from their source (every
import, those inside functions too).

A benchmark imports capdispatch's faces (`import capdispatch as cd`, `from capdispatch import
bench, extend`, then only names of their `__all__`, or `from capdispatch[.bench|.extend]
import NAME` for such a name) and, as the
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
import capdispatch.bench
import capdispatch.extend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
FOLDERS = ("backends", "adapters")


def _subject(module: str) -> bool:
    """capdispatch.backends.<folder>[...] or capdispatch.adapters.<folder>[...]: a kernel
    folder or an adapter package (a directory, not a module directly under backends/)."""
    parts = module.split(".")
    return (len(parts) >= 3 and parts[0] == "capdispatch" and parts[1] in FOLDERS
            and os.path.isdir(os.path.join(ROOT, *parts[:3])))


FACES = {"capdispatch": set(capdispatch.__all__), "capdispatch.bench": set(capdispatch.bench.__all__),
         "capdispatch.extend": set(capdispatch.extend.__all__)}


def _lent(face: str, name: str) -> bool:
    return name in FACES[face] or (name.startswith("__") and name.endswith("__"))


def past_the_face(path: str) -> list:
    """'file:line what' for every way PATH reaches capdispatch other than a face or a subject."""
    where = os.path.relpath(path, ROOT)
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    bad, faces = [], {}          # a local name -> the face it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "capdispatch":
                    faces[a.asname or a.name] = "capdispatch"
                elif a.name.startswith("capdispatch.") and not _subject(a.name):
                    bad.append(f"{where}:{node.lineno} import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "capdispatch":
            for a in node.names:
                face = f"{node.module}.{a.name}"
                if node.module == "capdispatch" and face in FACES:
                    faces[a.asname or a.name] = face
                    ok = True
                elif node.module in FACES:
                    ok = _lent(node.module, a.name) or _subject(face)
                else:
                    ok = _subject(node.module) or _subject(face)
                if not ok:
                    bad.append(f"{where}:{node.lineno} from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in faces and not _lent(faces[node.value.id], node.attr):
            bad.append(f"{where}:{node.lineno} {node.value.id}.{node.attr}")
        # A face namespace (bench.speed, ...) lends its public names only.
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
    "from capdispatch import bench\nbench.speed._private(1)\n",
    "from capdispatch import bench\nbench.build_registry()\n",
    "from capdispatch.bench import nothing_such\n",
    "import capdispatch as cd\ncd.registry\n",
])
def test_the_reader_sees_a_way_past_the_face(tmp_path, src):
    bad = tmp_path / "bench_bad.py"
    bad.write_text(src)
    assert past_the_face(str(bad))


@pytest.mark.parametrize("src", [
    "import capdispatch as cd\ncd.bind\ncd.__version__\n",
    "from capdispatch import bind, bench\nbench.registry.build\n",
    "from capdispatch.bench import cuda_timer\nfrom capdispatch.extend import Reader\n",
    "def f():\n    from capdispatch.backends.moe import triton_kernels as tk\n",
    "from capdispatch.backends import moe\n",
    "from capdispatch.backends.sparse_attention import kernels as K\n",
    "import capdispatch.backends.indexer.layout\n",
    "from capdispatch import bench\nbench.inputs.decode_args\n",
])
def test_the_face_and_kernel_folders_pass(tmp_path, src):
    ok = tmp_path / "bench_ok.py"
    ok.write_text(src)
    assert not past_the_face(str(ok))
