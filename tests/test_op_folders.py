"""How the folders under capdispatch/backends/ may use each other, read from their source
(no imports): an op folder reaches another folder's modules through public names only,
and the shared kernel packages (sparse_attention, triton_common) import no op folder (a data
format they share, the V4 pool's, lives below them in backends/v4_layout.py)."""
import ast
import os

import pytest

from capdispatch.backends.registry import BUILTIN_OP_PACKAGES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = os.path.join(ROOT, "capdispatch", "backends")
OPS = tuple(p.rsplit(".", 1)[1] for p in BUILTIN_OP_PACKAGES)
SHARED = ("sparse_attention", "triton_common")


def _modules(folder):
    d = os.path.join(BACKENDS, folder)
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".py"))


def _foreign(node, own):
    """The backends folder a relative import inside folder OWN reaches, when not OWN."""
    if not isinstance(node, ast.ImportFrom) or node.level != 2 or not node.module:
        return None
    top = node.module.split(".")[0]
    return top if top != own and os.path.isdir(os.path.join(BACKENDS, top)) else None


def uses(path, own):
    """(line, folder, name) for every name PATH takes from another backends folder: names
    imported from its modules, and attributes read through a module imported from it."""
    tree = ast.parse(open(path).read(), path)
    aliases, out = {}, []
    for node in ast.walk(tree):
        folder = _foreign(node, own)
        if folder is None:
            continue
        for a in node.names:
            if "." in node.module:            # from ..pkg.mod import name
                out.append((node.lineno, folder, a.name))
            else:                             # from ..pkg import mod [as alias]
                aliases[a.asname or a.name] = folder
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            out.append((node.lineno, aliases[node.value.id], node.attr))
    return out


def test_the_checker_sees_private_names(tmp_path, monkeypatch):
    """The rule can fail: a module taking a private name, directly or through an alias."""
    bad = tmp_path / "m.py"
    bad.write_text("from ..sparse_attention import kernels as attn\n"
                   "from ..sparse_prefill.reference import _valid_mask\n"
                   "x = attn._plans\n")
    found = {(f, n) for _, f, n in uses(str(bad), "decode_mla")}
    assert {("sparse_attention", "_plans"), ("sparse_prefill", "_valid_mask")} <= found


@pytest.mark.parametrize("op", OPS)
def test_op_folders_use_other_folders_through_public_names(op):
    bad = [f"{os.path.relpath(p, ROOT)}:{line}: {folder}.{name}"
           for p in _modules(op) for line, folder, name in uses(p, op) if name.startswith("_")]
    assert not bad, "private names of another backends folder: " + "; ".join(bad)


@pytest.mark.parametrize("shared", SHARED)
def test_shared_kernel_packages_import_no_op_folder(shared):
    bad = []
    for p in _modules(shared):
        for node in ast.walk(ast.parse(open(p).read(), p)):
            folder = _foreign(node, shared)
            if folder in OPS:
                bad.append(f"{os.path.relpath(p, ROOT)}:{node.lineno}: {folder}")
    assert not bad, "a shared package imports an op folder: " + "; ".join(bad)


def test_both_attention_ops_launch_the_shared_kernel():
    """sparse_prefill and decode_mla keep no kernel of their own: their triton_kernels.py
    import the sparse_attention kernels and define no @triton.jit function."""
    for op in ("sparse_prefill", "decode_mla"):
        path = os.path.join(BACKENDS, op, "triton_kernels.py")
        src = open(path).read()
        assert "from ..sparse_attention import kernels" in src, op
        assert "@triton.jit" not in src, op
