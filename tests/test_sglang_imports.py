"""How the SGLang adapter's modules import each other, read from their source (no imports):
no import circle, at most FLOORS floors (the longest chain of the package's own imports,
lazy ones included), and capdispatch through its faces only: the users' (`import capdispatch as
cd`, or `from capdispatch import NAME` for a name of capdispatch.__all__) and the adapter
authors' (`from capdispatch import extend`, or `from capdispatch.extend import NAME` for a
name of capdispatch.extend.__all__)."""
import ast
import functools
import os

import capdispatch
import capdispatch.extend

FACES = {"capdispatch": set(capdispatch.__all__) | {"extend"}, "capdispatch.extend": set(capdispatch.extend.__all__)}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WING = os.path.join(ROOT, "capdispatch", "adapters", "sglang")
PACKAGE = "capdispatch.adapters.sglang"
FLOORS = 6


def imports(path: str, modules) -> set:
    """The modules of the package that PATH imports (relative or absolute, at any depth)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name if a.name in modules else "__init__" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE):
            rest = node.module[len(PACKAGE):].lstrip(".")
            out.add(rest.split(".")[0] if rest else "__init__")
        elif isinstance(node, ast.Import):
            out.update(a.name[len(PACKAGE) + 1:].split(".")[0] for a in node.names
                       if a.name.startswith(PACKAGE + "."))
    return {m for m in out if m in modules}


def graph(folder: str) -> dict:
    names = [f[:-3] for f in os.listdir(folder) if f.endswith(".py")]
    return {m: imports(os.path.join(folder, m + ".py"), names) - {m} for m in names}


def circles(g: dict) -> list:
    found, state, stack = [], {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(g[u]):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"
    for m in sorted(g):
        if m not in state:
            visit(m)
    return found


def floors(g: dict) -> dict:
    """Module -> its floor: 1 for a module importing none of the package, else one above
    the highest module it imports (the graph has no circle)."""
    @functools.lru_cache(maxsize=None)
    def floor(m):
        return 1 + max((floor(v) for v in g[m]), default=0)
    return {m: floor(m) for m in g}


def test_the_checker_sees_circles_and_floors(tmp_path):
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import x\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    (tmp_path / "d.py").write_text("X = 1\n")
    g = graph(str(tmp_path))
    assert g == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert circles(g) == [["a", "b", "c", "a"]]
    g["c"] = {"d"}
    assert not circles(g) and floors(g) == {"a": 4, "b": 3, "c": 2, "d": 1}


def test_no_import_circle_and_few_floors():
    g = graph(WING)
    assert not circles(g), "import circles: " + "; ".join(" -> ".join(c) for c in circles(g))
    f = floors(g)
    top = max(f.values())
    chain = sorted(f, key=f.get, reverse=True)[0]
    assert top <= FLOORS, f"{top} import floors (at most {FLOORS}); the highest module: {chain}"


def past_the_faces(folder: str) -> list:
    bad = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        path = os.path.join(folder, name)
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                bad += [f"{name}:{node.lineno}: import {a.name}" for a in node.names
                        if a.name.startswith("capdispatch") and (a.name, a.asname) != ("capdispatch", "cd")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("capdispatch"):
                if node.module.startswith(PACKAGE):
                    continue
                if node.module not in FACES or any(a.name not in FACES[node.module] for a in node.names):
                    bad.append(f"{name}:{node.lineno}: from {node.module} import "
                               + ", ".join(a.name for a in node.names))
    return bad


def test_capdispatch_through_its_faces_only():
    bad = past_the_faces(WING)
    assert not bad, "capdispatch past its faces: " + "; ".join(bad)


def test_the_face_checker_sees_a_way_past(tmp_path):
    (tmp_path / "ok.py").write_text("import capdispatch as cd\nfrom capdispatch import extend, plan\n"
                                    "from capdispatch.extend import Reader\n")
    assert not past_the_faces(str(tmp_path))
    (tmp_path / "bad.py").write_text("from capdispatch import bench\nfrom capdispatch.extend import nope\n"
                                     "from capdispatch.dispatch import lock\n")
    assert len(past_the_faces(str(tmp_path))) == 3
