"""One rule for whose libraries plan a group (docs/cli.md#whose-libraries), held together:
the same rig gets the same kernel per op and device from `explain`, `plan --speed`, `lock`,
`sglang plan`, `rehearse`'s planning step and the Python API, and each says whose libraries
it used. Torch-free, the planning commands still plan and the commands that run kernels say
they need torch in one exit-2 line."""
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import capdispatch as cd
from capdispatch.adapters.sglang import cli as sglang_cli
from capdispatch.dispatch import cli, rehearse_cmd
from capdispatch.rehearse import devices as rehearse_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TP3 = str(Path(__file__).parent / "rehearse" / "v4-tp3" / "config.json")   # 48 heads: tp 3 divides
# (devices, model for the shaped decisions, emulated form for rehearse)
RIGS = {
    "pro-6000 x2": (["sim:rtx-pro-6000", "sim:rtx-pro-6000"], "deepseek-v4-flash",
                    "emu:rtx-pro-6000@cpu,emu:rtx-pro-6000@cpu"),
    "mixed": (["sim:rtx-5090", "sim:rtx-3080", "sim:rtx-3080"], TP3,
              "emu:rtx-5090@cpu,emu:rtx-3080@cpu,emu:rtx-3080@cpu"),
}
PROFILE = "the sglang-0.5.23 profile's (the default for simulated devices)"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", "CAPDISPATCH_LOCK",
              "CAPDISPATCH_SGLANG_DEVICES"):
        monkeypatch.delenv(k, raising=False)


def _run(main, *argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _json(main, *argv):
    rc, out, err = _run(main, *argv, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


def _by_position(per_op: dict) -> dict:
    """op -> (backend per group position); None where a command decides nothing (SGLang keeps its own)."""
    return {op: tuple(row) for op, row in per_op.items()}


def _explain(devs, *extra):
    d = _json(cli.main, "explain", "--device", ",".join(devs), *extra)
    assert d["inventory"]["whose"] == PROFILE and d["inventory"]["default"] is True
    return _by_position({op: [r["backend"] for r in g["per_device"].values()] for op, g in d["ops"].items()})


def _lock(devs):
    rc, out, err = _run(cli.main, "lock", "--device", ",".join(devs))
    assert rc == 0, err
    lk = yaml.safe_load(out)
    assert lk["inputs"]["libs"] == ["sglang-0.5.23"]
    # Said to people on stderr (stdout is the lock file), in the one wording.
    assert f"libraries: {PROFILE}" in err.splitlines()
    ops = list(lk["devices"][0]["ops"])
    return _by_position({op: [d["ops"][op]["backend"] for d in lk["devices"]] for op in ops})


def _sglang(devs, *extra):
    d = _json(sglang_cli.main, "plan", "--device", ",".join(devs), *extra)
    assert d["inventory"]["whose"] == PROFILE
    return _by_position({op: [r["ops"][op]["backend"] for r in d["ranks"]] for op in d["ops"]})


def _plan_speed(devs, model):
    rc, out, err = _run(cli.main, "plan", "--model", model, "--device", ",".join(devs), "--speed",
                        "--format", "json")
    assert rc in (0, 3), err          # 3: a rank does not fit its card; the plan is printed either way
    speed = json.loads(out)["speed"]
    assert speed["inventory"]["whose"] == PROFILE and speed["not_predicted"] is None
    out = {}
    for step in speed["steps"]:
        for r in step["ranks"]:
            for o in r["ops"]:
                out.setdefault(o["op"], {}).setdefault(r["rank"], set()).add(o["backend"])
    return {op: tuple(next(iter(ranks[i])) if len(ranks[i]) == 1 else ranks[i] for i in sorted(ranks))
            for op, ranks in out.items()}


def _rehearse(emu, shapes=None):
    p = rehearse_cmd.planned(rehearse_devices.parse_list([emu]), shapes=shapes)
    assert p.whose["whose"] == PROFILE
    return _by_position({op: [r.backend for r in g.per_device.values()] for op, g in p.ops.items()})


def _api(devs, shapes=None):
    p = cd.plan(devs, shapes=shapes, log_warnings=False)
    assert p.whose["whose"] == PROFILE
    via_context = cd.plan_in(cd.context(shapes=shapes), devs, log_warnings=False)
    one = {op: tuple(cd.resolve(op, d, shapes=shapes).backend for d in devs) for op in p.ops} \
        if len(set(devs)) == 1 else None
    got = _by_position({op: [r.backend for r in g.per_device.values()] for op, g in p.ops.items()})
    assert got == _by_position({op: [r.backend for r in g.per_device.values()]
                                for op, g in via_context.ops.items()})
    if one is not None:
        assert got == one
    return got


def _agree(results: dict, ops=None):
    """Every command's backend per op and position equals the first one's, where it decides."""
    (first, want), *rest = results.items()
    for name, got in rest:
        for op, row in got.items():
            for i, b in enumerate(row):
                if b is not None:
                    assert b == want[op][i], (first, name, op, i, want[op], row)


@pytest.mark.parametrize("rig", list(RIGS))
def test_one_rig_one_decision_whatever_asks(rig):
    devs, model, emu = RIGS[rig]
    # Without a model: the commands that take none decide the same (no shape ranges).
    _agree({"explain": _explain(devs), "lock": _lock(devs), "sglang plan": _sglang(devs),
            "rehearse": _rehearse(emu), "api": _api(devs)})
    # With the model's rank shapes.
    tp = str(len(devs))
    shapes = cd.load_model(model).for_rank(len(devs), 1)
    _agree({"explain": _explain(devs, "--model", model, "--tp", tp),
            "plan --speed": _plan_speed(devs, model),
            "sglang plan": _sglang(devs, "--model", model, "--tp", tp),
            "rehearse": _rehearse(emu, shapes), "api": _api(devs, shapes)})


def test_the_rule_picks_the_profile_the_commands_name_and_this_machine_for_real_devices():
    sims = [cd.probe("sim:rtx-5090"), cd.probe("sim:rtx-3080")]
    assert cd.target_libs(sims) == "default"
    assert cd.target_libs(sims, "local") == "local"
    assert cd.target_libs(sims, None, ["triton"]) is None       # assumptions on this machine's
    assert cd.target_libs(sims + [cd.probe("cpu")]) is None       # a real device: this machine's
    assert cd.plan(["sim:rtx-5090", "cpu"], log_warnings=False).whose["whose"] == "this machine's"
    assert cd.plan(["sim:rtx-5090"], libs="local", log_warnings=False).whose["whose"] == "this machine's"


def test_plan_speed_text_says_whose_libraries(capsys):
    rc, out, err = _run(cli.main, "plan", "--model", "deepseek-v4-flash", "--device", "sim:rtx-pro-6000",
                        "--tp", "2", "--speed", "--brief")
    assert rc == 0, err
    lines = out.splitlines()
    assert f"libraries: {PROFILE}" in lines
    assert any(line.startswith("note: simulated devices, planned with the sglang-0.5.23") for line in lines)


def test_lock_says_whose_libraries_on_stderr_and_checking_too(tmp_path):
    f = tmp_path / "rig.lock"
    rc, out, err = _run(cli.main, "lock", "--device", "cpu", "-o", str(f))
    assert rc == 0, err
    assert "libraries: this machine's" in err.splitlines() and out == ""
    rc, out, err = _run(cli.main, "lock", "--check", str(f))
    assert rc == 0, err
    assert "libraries: this machine's" in err.splitlines()


def test_rehearse_text_says_whose_libraries():
    from capdispatch.rehearse.runner import Rehearsal
    r = Rehearsal("m", 1, 1, "gloo", dict(layers=1, hidden=256, vocab=512, heads=64, experts=8,
                                          experts_total=8, topk=6, intermediate=64), 1, (), True,
                  3e-2, None, 1.0)
    p = rehearse_cmd.planned(rehearse_devices.parse_list(["emu:rtx-3080@cpu"]))
    text = rehearse_cmd.render(r, p.whose)
    assert text.splitlines()[1] == f"libraries: {PROFILE}"


def test_sglang_plan_takes_one_device_with_tp_as_that_many_cards(monkeypatch):
    d = _json(sglang_cli.main, "plan", "--device", "sim:h200", "--tp", "2")
    assert [r["gpu_id"] for r in d["ranks"]] == [0, 1]
    assert {r["device"]["name"] for r in d["ranks"]} == {"NVIDIA H200"}
    rc, out, err = _run(sglang_cli.main, "plan", "--device", "sim:h200", "--tp", "2", "--brief")
    assert rc == 0 and "CAPDISPATCH_SGLANG_DEVICES" not in err + out
    # The variable reads the same way: one simulated card stands for every GPU of the launch.
    monkeypatch.setenv("CAPDISPATCH_SGLANG_DEVICES", "sim:h200")
    d = _json(sglang_cli.main, "plan", "--tp", "4")
    assert [r["gpu_id"] for r in d["ranks"]] == [0, 1, 2, 3]
    # A list of several still names the GPU it lacks.
    rc, _, err = _run(sglang_cli.main, "plan", "--device", "sim:h200,sim:h200", "--tp", "3")
    assert rc == 2 and "lists 2 device(s)" in err


# Torch-free: torch and the kernel libraries neither import nor have package metadata.
TORCHLESS = """
import sys, importlib.metadata as md
HIDDEN = {"torch", "triton", "flashinfer-python", "sgl-flash-mla", "sgl-deep-gemm", "sglang",
          "sglang-kernel", "tilelang"}
for m in ("torch", "triton", "tilelang", "flashinfer", "sgl_kernel", "deep_gemm", "flash_mla", "sglang"):
    sys.modules[m] = None
_from_name = md.Distribution.from_name.__func__
def _hidden(cls, name):
    if name.lower().replace("_", "-") in HIDDEN:
        raise md.PackageNotFoundError(name)
    return _from_name(cls, name)
md.Distribution.from_name = classmethod(_hidden)
"""


def _torchless(code):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPDISPATCH_") or k == "CAPDISPATCH_CACHE_DIR"}
    p = subprocess.run([sys.executable, "-c", TORCHLESS + code], capture_output=True, text=True,
                       cwd=ROOT, env=dict(env, PYTHONPATH=ROOT), timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, p.stderr


def _torchless_cli(*argv):
    return _torchless(f"from capdispatch.dispatch.cli import main\nsys.exit(main({list(argv)!r}))")


def test_torch_free_plan_speed_prints_the_memory_plan_and_the_prediction():
    rc, out, err = _torchless_cli("plan", "--model", "deepseek-v4-flash", "--device", "sim:rtx-pro-6000",
                                  "--tp", "2", "--speed", "--brief")
    assert rc == 0, err
    assert "fits" in out.splitlines()[0] and "decode batch 1:" in out and f"libraries: {PROFILE}" in out
    # This machine's libraries (none): the memory plan still prints; the prediction says why not.
    rc, out, err = _torchless_cli("plan", "--model", "deepseek-v4-flash", "--device", "sim:rtx-pro-6000",
                                  "--tp", "2", "--speed", "--brief", "--libs", "local")
    assert rc == 3, err
    assert "fits" in out.splitlines()[0] and "max context" in out
    assert "not predicted: no kernel decided: no backend of" in " ".join(out.split())


@pytest.mark.parametrize("argv, what", [
    (("rehearse", "--device", "emu:rtx-5090@cpu,emu:rtx-3080@cpu", "--model", "deepseek-v4-flash"),
     "dispatch rehearse runs the group's kernels"),
    (("verify", "--device", "cpu"), "dispatch verify runs the backends' canaries"),
    (("bench", "--device", "cpu", "--op", "kv_quant"), "dispatch bench times kernels"),
    (("checkpoint", "--model", "deepseek-v4-flash", "--layers", "1", "--out", "ckpt-never-written"),
     "dispatch checkpoint writes random weights")])
def test_torch_free_commands_that_run_kernels_say_they_need_torch_in_one_line(argv, what):
    rc, out, err = _torchless_cli(*argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and f"{what}, which need torch: torch is not installed" in err


def test_torch_free_readme_resolve_example_decides():
    rc, out, err = _torchless(
        "import capdispatch as cd\n"
        "r = cd.resolve('kv_dequant', 'sim:rtx-3080')\n"
        "print(r.backend, r.fallback)\n"
        "print(cd.resolve_group('kv_dequant', ['sim:rtx-5090', 'sim:rtx-3080']).uniform)\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    assert rc == 0, err
    assert out.split() == ["triton_u8", "True", "False"]
