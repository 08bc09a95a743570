"""docs/contributing.md stays true: the op it builds as its example (the fixture package
tests/plugins/newop, with a torch and a Triton backend) appears in `dispatch ops`,
`dispatch explain`, `dispatch verify`, `dispatch bench`, the compile matrix and
`dispatch sglang plan` with no other file changed; `plan --speed` and `dispatch rehearse`
name it as an op the model does not call (and predict it once the model declaration lists
it); its backends are torch custom ops
derived from its one declaration; the package holds exactly the files the guide lists and uses only
public names; every built-in op has the files and declarations the guide lists."""
import ast
import json
import os
import re
import subprocess
import sys

import pytest

from capdispatch.backends import TritonTarget, build
from capdispatch.backends.registry import BUILTIN_OP_PACKAGES
from capdispatch.models import model_calls
from test_speed_plan import _check_steps, _uncalibrated

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NEWOP = os.path.join(HERE, "plugins", "newop")
GUIDE = os.path.join(ROOT, "docs", "contributing.md")


def _cli(*args, interpret=False, stderr=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPDISPATCH_", "TRITON_INTERPRET"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, NEWOP])
    env["CAPDISPATCH_CACHE_DIR"] = os.environ["CAPDISPATCH_CACHE_DIR"]     # the test's own cache
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, "-m", "capdispatch", *args], env=env, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return (p.stdout, p.stderr) if stderr else p.stdout


def _guide_tree() -> set:
    text = open(GUIDE).read()
    block = text.split("<!-- the newop tree:", 1)[1].split("```", 2)[1]
    return {line.split()[0] for line in block.strip().splitlines()}


def test_the_fixture_package_holds_exactly_the_files_the_guide_lists():
    have = {os.path.relpath(os.path.join(d, f), NEWOP).replace(os.sep, "/")
            for d, _, files in os.walk(NEWOP) if "__pycache__" not in d for f in files}
    assert have == _guide_tree()


def test_the_guides_op_declaration_is_the_fixtures():
    """The `Op(...)` the guide shows is the one the fixture declares."""
    text = open(GUIDE).read()
    shown = re.search(r"OPS = \(\n(.*?)\n\)\n", text, re.S).group(1)
    src = open(os.path.join(NEWOP, "capdispatch_newop", "__init__.py")).read()
    assert shown in src


def test_the_fixture_uses_only_public_names_of_capdispatch():
    bad = []
    for d, _, files in os.walk(NEWOP):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("capdispatch"):
                    bad += [f"{f}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                    bad += [f"{f}: {node.module}" for part in node.module.split(".") if part.startswith("_")]
    assert not bad


def test_the_new_op_is_listed_and_explained():
    ops = json.loads(_cli("ops", "--format", "json"))
    assert [b["name"] for b in ops["ops"]["row_scale"]["backends"]] == ["torch", "triton"]
    assert [p["name"] for p in ops["plugins"] if p["ok"]] == ["newop"]
    explained = json.loads(_cli("explain", "--device", "cpu", "--op", "row_scale", "--format", "json"))
    assert explained["ops"]["row_scale"]["per_device"]["cpu"]["backend"] == "torch"


def test_the_new_op_is_benched_from_its_case_and_ladder():
    out = json.loads(_cli("bench", "--device", "cpu", "--op", "row_scale", "--sizes", "1", "--format", "json",
                          interpret=True))
    rows = out["ops"]["row_scale"]["rows"]
    assert {(r["backend"], r["size"], r["ok"]) for r in rows} == {("torch", 1, True), ("triton", 1, True)}
    assert all(r["detail"] == "bit-identical to the reference" for r in rows)


def test_the_new_op_is_verified_by_its_canary():
    out = _cli("verify", "--device", "cpu", "--op", "row_scale", "--all", interpret=True)
    assert re.search(r"row_scale\s+cpu\s+torch\s+pass", out) and re.search(r"row_scale\s+cpu\s+triton\s+pass", out)


def test_the_new_ops_kernels_are_in_the_compile_matrix():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, NEWOP]))
    code = ("from capdispatch.backends import compile_matrix as M\n"
            "print([(j.op, j.kernel) for j in M.jobs_for(M.target('sm_80')) if j.op == 'row_scale'])")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "('row_scale', 'capdispatch_newop.triton_kernels:_row_scale_kernel')" in p.stdout


def test_the_new_op_is_in_the_sglang_plan_reported_with_the_entry_to_add():
    """No knob-map model lists a plugin's op: each rank decides it, and the plan reports it
    (not carried out inside SGLang) with the knob-map entries to add; the rest is planned as before."""
    out, err = _cli("sglang", "plan", "--device", "sim:h200,sim:rtx-3080", "--tp", "2", "--format", "json",
                    stderr=True)
    plan = json.loads(out)
    assert plan["ops"][-1] == "row_scale" and "moe" in plan["ops"]
    for rank in plan["ranks"]:
        row = rank["ops"]["row_scale"]
        assert (row["backend"], row["action"]) == ("torch", "reported")
        assert "op row_scale (plugin 'newop'): DeepseekV4ForCausalLM does not call op 'row_scale' (" in row["why"]
        assert "add it there to have it predicted and rehearsed, and an entry per backend under " \
               "releases[0].backends.row_scale" in row["why"]
        assert rank["ops"]["kv_dequant"]["action"] in ("kept", "routed")
    assert "does not call op 'row_scale'" in err            # said when the knob map is read


def test_plan_speed_names_the_new_op_the_model_does_not_call():
    out = json.loads(_cli("plan", "--model", "deepseek-v4-flash", "--device", "sim:h200", "--tp", "4", "--ep", "4",
                          "--dp-attention", "--speed", "--libs", "sglang-0.5.23", "--format", "json"))
    steps = out["speed"]["steps"]
    _check_steps(steps)         # the model's own ops are predicted (those h200.yaml has times for)
    for r in (r for s in steps for r in s["ranks"]):
        assert "row_scale" not in {o["op"] for o in r["ops"]}
        assert "DeepseekV4ForCausalLM does not call op 'row_scale'" in r["not_called"]["row_scale"]
    text = _cli("plan", "--model", "deepseek-v4-flash", "--device", "sim:h200", "--tp", "4", "--ep", "4",
                "--dp-attention", "--speed", "--libs", "sglang-0.5.23")
    assert "row_scale: not predicted: DeepseekV4ForCausalLM does not call op 'row_scale'" in " ".join(text.split())


def test_plan_speed_predicts_the_new_op_once_the_model_declaration_lists_it():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, NEWOP]))
    code = ("import json, attrs\n"
            "import capdispatch as cd\n"
            "from capdispatch.dispatch import speed\n"
            "from capdispatch.models import ModelShape, OpCalls, model_calls\n"
            "d = model_calls()\n"
            "mine = attrs.evolve(d, calls=d.calls + (OpCalls('row_scale', 'every', (('prefill', 'tokens'),)),))\n"
            "ModelShape.calls = lambda self: mine\n"
            "model = cd.load_model('deepseek-v4-flash'); shapes = model.for_rank(4, 4, True)\n"
            "specs = [cd.probe('sim:h200')]\n"
            "p = cd.plan(specs, shapes=shapes, libs='sglang-0.5.23', log_warnings=False)\n"
            "cal = speed.Calibration('h200', 'row_scale.json', {}, {'row_scale': {'torch': ((1, 0.001), (4096, 0.5))}})\n"
            "out = []\n"
            "for cals in ([cal], []):\n"
            "    rows = speed.predict(model, shapes, specs, {op: g.per_device for op, g in p.ops.items()},\n"
            "                         speed.merged(speed.default_calibrations() + cals))\n"
            "    out.append([(r.phase, [(o.op, o.backend, o.ms, o.how) for o in r.ops if o.op == 'row_scale'],\n"
            "                 r.total is not None, dict(r.not_called)) for r in rows])\n"
            "print(json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    timed, untimed = json.loads(p.stdout)
    # A step is predicted when every op it calls has times (the built-in ops h200.yaml lacks, as
    # a new op is until it is timed on the card, leave theirs unpredicted: tests/test_speed_plan.py).
    missing = _uncalibrated()
    for phase, mine, total, not_called in timed:
        assert not not_called and total == (not (missing & set(model_calls().phase_ops(phase))))
        # Called on every one of Flash's 43 layers in prefill (4096 tokens: 0.5 ms a call), not in decode.
        assert mine == ([["row_scale", "torch", pytest.approx(0.5 * 43), "calibrated"]] if phase == "prefill"
                        else []), timed
    # Without its times the declared op is named, and the prefill steps that call it are not predicted.
    for phase, mine, total, not_called in untimed:
        assert mine == ([["row_scale", "torch", None, "not predicted: h200.yaml has no row_scale times"]]
                        if phase == "prefill" else []), untimed
        if phase == "prefill":
            assert not total


def test_the_rehearsal_names_the_new_op_the_model_does_not_call():
    out = json.loads(_cli("rehearse", "--device", "cpu", "--model", "deepseek-v4-flash", "--layers", "1",
                          "--prompt", "4", "--steps", "1", "--format", "json"))
    assert out["ok"], out["cause"]
    assert "row_scale" not in {o["op"] for r in out["ranks"] for o in r["ops"]}
    assert {o["op"] for r in out["ranks"] for o in r["ops"]} == set(out["not_called"]) ^ set(
        json.loads(_cli("ops", "--format", "json"))["ops"])
    assert "DeepseekV4ForCausalLM does not call op 'row_scale'" in out["not_called"]["row_scale"]


def test_the_new_ops_backends_are_custom_ops_from_its_declaration():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, NEWOP]), TRITON_INTERPRET="1")
    code = ("import torch\n"
            "from capdispatch_newop import kernels, triton_kernels\n"
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "f = torch.ops.capdispatch.row_scale_triton.default\n"
            "print(f._schema)\n"
            "with FakeTensorMode() as m:\n"
            "    y = f(torch.empty(5, 64), torch.empty(5))\n"
            "print(tuple(y.shape), y.dtype)\n"
            "x, w = torch.randn(3, 64), torch.randn(3)\n"
            "print(torch.equal(triton_kernels.row_scale(x, w), kernels.reference(x, w)))\n")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:3] == [
        "capdispatch::row_scale_triton(Tensor x, Tensor w, *, bool checks=True) -> Tensor",
        "(5, 64) torch.float32", "True"]


BUILTIN_FILES = ("__init__.py", "reference.py", "canary.py", "calibration.py")


@pytest.mark.parametrize("pkg", BUILTIN_OP_PACKAGES)
def test_every_builtin_op_folder_has_what_the_guide_lists(pkg):
    folder = os.path.join(ROOT, *pkg.split("."))
    missing = [f for f in BUILTIN_FILES if not os.path.exists(os.path.join(folder, f))]
    assert not missing
    reg = build(plugins=False)
    mine = [op for op in reg.ops.values() if pkg in op.canary]
    assert mine
    for op in mine:
        assert op.case.startswith(f"{pkg}.calibration:") and op.canary.startswith(f"{pkg}.canary:")
        assert op.sizes and op.size is not None and op.compare
        # The compile jobs are those of its Triton kernels: an op with a Triton backend declares them.
        triton = [b.name for b in reg.backends(op.name) if any(isinstance(r, TritonTarget) for r in b.requires)]
        assert op.compile_jobs or not triton, (op.name, triton)


def test_the_guide_names_the_places_that_exist():
    text = open(GUIDE).read()
    for path in re.findall(r"`((?:capdispatch|tests|docs|benchmarks)/[\w./<>-]+\.(?:py|yaml|md|toml))`", text):
        if "<" not in path:
            assert os.path.exists(os.path.join(ROOT, path)), path
    assert "BUILTIN_OP_PACKAGES" in text and "default.yaml" in text


def test_every_op_page_is_linked_from_the_readme():
    import glob
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    pages = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "ops", "*.md")))
    assert pages and [p for p in pages if f"]({p})" not in readme] == []
