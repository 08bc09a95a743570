"""The house's import graph, read from the source (every import, those inside functions
too): no circle between rooms, and no arrow running up a floor.

A room is a sub-package of capdispatch (an adapter, an op folder or a shared kernel
folder under backends/ counts as its own room); a module directly under capdispatch/ or
capdispatch/backends/ belongs to that package's room. The command line (dispatch/cli.py
and dispatch/*_cmd.py) is its own room on the top floor: it runs every other room. The
faces (capdispatch/__init__.py for users, capdispatch/extend.py for plugin and adapter
authors, capdispatch/bench.py for benchmarks) stand just above dispatch, whose names they
lend. FLOORS lists
the rooms from the bottom: a room may import its own floor's rooms (without a circle) and
any floor below.
"""
import ast
import os
import sys

import pytest

from capdispatch.backends.registry import BUILTIN_OP_PACKAGES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "capdispatch")

# The op folders are the registry's built-in op packages: one floor, read from the registry.
OP_FOLDERS = tuple(pkg.removeprefix("capdispatch.") for pkg in BUILTIN_OP_PACKAGES)

FLOORS = (
    ("errors", "safe_io", "processes", "version"),
    ("marked_yaml",),                                 # the one marked YAML reader
    ("capabilities",),
    ("backends",),                                    # declarations, registry, base, v4_layout
    ("backends.triton_common",),
    ("backends.sparse_attention",),
    OP_FOLDERS,                                       # the registry's op packages (decode_mla reads sparse_prefill's checks)
    ("policies", "calibrate", "proof", "models"),
    ("dispatch",),
    ("capdispatch", "extend", "bench"),               # the faces: users, plugin and adapter authors, benchmarks
    ("rehearse", "adapters", "adapters.sglang"),      # they use the face
    ("dispatch commands", "__main__"),
)


def _modules():
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def room(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "capdispatch"
    if parts[0] == "dispatch" and len(parts) > 1 and (parts[1] == "cli" or parts[1].endswith("_cmd")):
        return "dispatch commands"
    if parts[0] in ("backends", "adapters") and len(parts) > 1 and os.path.isdir(os.path.join(PKG, *parts[:2])):
        return ".".join(parts[:2])
    return parts[0]


def imports(modules):
    """(module, imported module, line) for every import of one capdispatch module by another,
    those inside functions and under TYPE_CHECKING too: a relative import resolved, and
    `from pkg import name` taken as the submodule pkg.name where that is a module."""
    for name, path in modules.items():
        pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    yield name, t, node.lineno


def arrows(modules) -> set:
    """(from room, to room, 'module:line') for every import of one capdispatch module by another."""
    return {(room(name), room(t), f"{name}:{line}") for name, t, line in imports(modules)
            if room(t) != room(name)}


def module_arrows(modules) -> set:
    """(module, imported module, 'module:line'), one per pair (its first line)."""
    first = {}
    for name, t, line in imports(modules):
        first[(name, t)] = min(line, first.get((name, t), line))
    return {(a, b, f"{a}:{line}") for (a, b), line in first.items()}


def _floor(r: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if r in rooms:
            return i
    raise AssertionError(f"room {r} has no floor in FLOORS: add it")


def _circles(edges) -> list:
    graph = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
    seen, found = set(), []

    def walk(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in seen:
                walk(nxt, path + [nxt])
        seen.add(node)
    for start in sorted(graph):
        walk(start, [start])
    return found


def test_every_room_has_a_floor():
    for r in {room(m) for m in _modules()}:
        _floor(r)


def test_no_arrow_runs_up():
    up = sorted(f"{where}: {a} -> {b}" for a, b, where in arrows(_modules()) if _floor(b) > _floor(a))
    assert not up, "imports running up the house: " + "; ".join(up)


def test_no_circle_between_rooms():
    assert not _circles(arrows(_modules()))


def _said(circles, edges) -> list:
    where = {(a, b): w for a, b, w in edges}
    return [" -> ".join(c) + " (" + ", ".join(where[(x, y)] for x, y in zip(c, c[1:])) + ")"
            for c in circles]


def test_no_circle_between_modules():
    """Module by module, every import counted (inside functions, under TYPE_CHECKING): a
    module never needs, however late, one that needs it."""
    edges = module_arrows(_modules())
    found = _said(_circles(edges), edges)
    assert not found, "import circles between modules: " + "; ".join(found)


def test_the_module_circle_finder_sees_late_and_from_imports(tmp_path):
    """The check can fail: a circle closed by an import inside a function, through
    `from package import module`, is found and named with its lines."""
    mods = dict(_modules())
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from . import b_mod\n")
    b.write_text("def f():\n    from .a_mod import x\n")
    mods["capdispatch.a_mod"], mods["capdispatch.b_mod"] = str(a), str(b)
    edges = module_arrows(mods)
    found = _said(_circles(edges), edges)
    assert any("capdispatch.a_mod -> capdispatch.b_mod -> capdispatch.a_mod" in f
               and "capdispatch.b_mod:2" in f for f in found), found


@pytest.mark.parametrize("src, found", [
    ("from ..dispatch import resolver\n", ("capabilities", "dispatch")),
    ("def f():\n    from capdispatch.backends.kv_cache import reference\n", ("capabilities", "backends.kv_cache")),
])
def test_the_reader_sees_an_arrow_up(tmp_path, src, found):
    """The rule can fail: a module-level or a function-level import of a higher room."""
    mods = dict(_modules())
    bad = tmp_path / "bad.py"
    bad.write_text(src)
    mods["capdispatch.capabilities.bad"] = str(bad)
    edges = arrows(mods)
    assert any((a, b) == found for a, b, _ in edges)
    assert any(_floor(b) > _floor(a) for a, b, _ in edges)


def test_the_circle_finder_finds_one():
    assert _circles({("a", "b", ""), ("b", "a", "")})


def _private_uses(modules) -> list:
    """'module:line name' for every private name one room takes from another: imported by
    name, or read as an attribute of a module imported from it."""
    bad = []
    for name, path in modules.items():
        pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        tree = ast.parse(open(path).read(), path)
        aliases = {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                target = f"{base}.{a.name}"
                owner = target if target in modules else base
                while owner and owner not in modules:
                    owner = owner.rpartition(".")[0]
                if not owner or room(owner) == room(name):
                    continue
                if a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append(f"{name}:{node.lineno} {base}.{a.name}")
                elif target in modules:
                    aliases[a.asname or a.name] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{name}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    return bad


def test_no_room_takes_another_rooms_private_names():
    """A helper used across rooms is public in its home (did_you_mean, cached_verdict, ...)."""
    assert not _private_uses(_modules())


def test_the_private_name_reader_sees_both_forms(tmp_path):
    mods = dict(_modules())
    bad = tmp_path / "bad.py"
    bad.write_text("from ..policies.loader import _mark\nfrom ..backends import compile_matrix as M\nM._mod('x')\n")
    mods["capdispatch.dispatch.bad"] = str(bad)
    found = _private_uses(mods)
    assert any("capdispatch.policies.loader._mark" in f for f in found)
    assert any("capdispatch.backends.compile_matrix._mod" in f for f in found)


def test_adapters_use_only_the_faces():
    """An adapter imports capdispatch as `import capdispatch as cd` (or a face name from it)
    and `capdispatch.extend` (the adapter authors' face), never another submodule, and
    nothing of capdispatch outside its own package."""
    bad = []
    for name, path in _modules().items():
        if room(name) != "adapters.sglang":
            continue
        pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                if not ".".join(up).startswith("capdispatch.adapters.sglang"):
                    bad.append(f"{name}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("capdispatch."):
                if not node.module.startswith(("capdispatch.adapters.sglang", "capdispatch.extend")):
                    bad.append(f"{name}:{node.lineno} {node.module}")
            elif isinstance(node, ast.Import):
                bad += [f"{name}:{node.lineno} {a.name}" for a in node.names
                        if a.name.startswith("capdispatch.") and not a.name.startswith("capdispatch.adapters.sglang")]
    assert not bad, "adapter imports past the face: " + "; ".join(bad)


# Imports inside functions keep torch and friends (and the modules that import them) out of
# planning; the standard library, attrs and yaml cost nothing worth deferring and belong at
# a module's top: none is imported inside a function.
LATE_LIGHT_CEILING = 0
LIGHT = set(sys.stdlib_module_names) | {"attrs", "yaml"}


def late_light_imports(modules) -> list:
    """'module:line name' for every import of the standard library, attrs or yaml made
    inside a function."""
    out = []
    for name, path in modules.items():
        for fn in ast.walk(ast.parse(open(path).read(), path)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in fn.body:
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Import):
                        names = [a.name for a in sub.names]
                    elif isinstance(sub, ast.ImportFrom) and not sub.level:
                        names = [sub.module]
                    else:
                        continue
                    out += [f"{name}:{sub.lineno} {n}" for n in names if n.split(".")[0] in LIGHT]
    return sorted(set(out))


def test_light_imports_inside_functions_do_not_grow():
    found = late_light_imports(_modules())
    assert len(found) <= LATE_LIGHT_CEILING, (
        f"{len(found)} imports of the standard library, attrs or yaml inside functions (at most "
        f"{LATE_LIGHT_CEILING}); move new ones to the module's top: " + "; ".join(found))


def test_the_late_import_counter_sees_one(tmp_path):
    late = tmp_path / "late.py"
    late.write_text("import json\n\ndef f():\n    import os\n    from yaml import safe_load\n    import torch\n")
    assert late_light_imports({"capdispatch.late": str(late)}) == ["capdispatch.late:4 os",
                                                                    "capdispatch.late:5 yaml"]
