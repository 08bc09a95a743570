"""The command line for a new user: the matrix, whose libraries, probe failures, env,
catalog, --version, help, completion. In-process `main(argv)` where import isolation
does not matter; a fresh process where it does (encoding, completion, torch-free)."""
import argparse
import json
import os
import re
import subprocess
import sys
import types

import pytest

from capdispatch.dispatch import cli
from capdispatch.dispatch.render import Cell, Row, render_matrix, use_color

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RIG = "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080"
ANSI = re.compile(r"\x1b\[")


@pytest.fixture
def dispatch(capsys, clean_env):
    """Run `dispatch ARGS` in this process: (rc, stdout, stderr)."""
    def run(*args):
        try:
            rc = cli.main(list(args))
        except SystemExit as exc:
            rc = exc.code
        out, err = capsys.readouterr()
        return rc, out, err
    return run


# --- the matrix -----------------------------------------------------------------------------

def test_explain_of_a_rig_opens_with_the_matrix(dispatch):
    rc, out, _ = dispatch("explain", "--device", RIG, "--assume-lib", "triton")
    assert rc == 0
    lines = out.splitlines()
    head = "\n".join(lines[:20])
    # Every op and every device is on the first screen, with the backend per cell.
    from capdispatch.backends import builtin
    for op in builtin().ops:
        assert op in head
    for dev in ("sim:rtx-5090", "sim:rtx-3080@1", "sim:rtx-3080@2"):
        assert dev in head
    row = next(line for line in lines[:20] if line.strip().startswith("kv_dequant"))
    assert row.split()[1:] == ["≠", "triton_fp8", "triton_u8*", "triton_u8*"]
    assert "* fallback" in head and "≠ the group's devices run different backends" in head
    assert "libraries: this machine's, with assumptions" in head
    assert not ANSI.search(out)            # piped: no colour
    assert max(len(line) for line in lines) <= 100
    # The traces follow; a card identical to an earlier one is not repeated.
    assert "source: default.yaml" in out
    assert "sim:rtx-3080@2 -> triton_u8  (fallback from triton_fp8; same trace as sim:rtx-3080@1)" in out


def test_brief_prints_the_matrix_alone(dispatch):
    rc, out, _ = dispatch("explain", "--device", RIG, "--assume-lib", "triton", "--brief")
    assert rc == 0
    assert "source:" not in out and "features:" not in out
    assert len(out.splitlines()) < 20 and "moe" in out


def test_matrix_colour_only_on_a_terminal_and_never_under_no_color():
    rows = [Row("kv_dequant", (Cell("triton_fp8"), Cell("triton_u8", "fallback")), diverges=True)]
    coloured = render_matrix(["a", "b"], rows, color=True, width=80, ascii_only=False)
    plain = render_matrix(["a", "b"], rows, color=False, width=80, ascii_only=False)
    assert ANSI.search(coloured) and not ANSI.search(plain)
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured).split() == plain.split()

    class Tty:
        def isatty(self):
            return True
    assert use_color(Tty(), env={}) is True
    assert use_color(Tty(), env={"NO_COLOR": "1"}) is False
    assert use_color(Tty(), env={"TERM": "dumb"}) is False
    assert use_color(None, env={}) is False or sys.stdout.isatty()
    # A narrow terminal never folds a backend name.
    narrow = render_matrix(["a"], [Row("moe", (Cell("flashinfer_cutlass_w4a8"),))], width=20, color=False)
    assert "flashinfer_cutlass_w4a8" in narrow
    ascii_table = render_matrix(["a", "b"], rows, color=False, width=80, ascii_only=True)
    ascii_table.encode("ascii")
    assert "triton_u8*" in ascii_table and "!=" in ascii_table


def test_ascii_output_encoding_is_not_a_traceback(run_cli):
    rc, out, err = run_cli("explain", "--device", "sim:rtx-5090,sim:rtx-3080", "--assume-lib", "triton",
                           "--op", "kv_dequant", env={"PYTHONIOENCODING": "ascii"})
    assert rc == 0, err
    assert "Traceback" not in err
    out.encode("ascii")
    assert "x triton_fp8: feature:fp8_e4m3" in out and "+ triton_u8" in out and "!=" in out


# --- whose libraries ------------------------------------------------------------------------

def test_simulated_devices_without_libs_use_the_default_profile_and_say_so(dispatch):
    rc, out, _ = dispatch("explain", "--device", "sim:rtx-5090", "--op", "decode_mla")
    assert rc == 0
    flat = " ".join(line.strip() for line in out.splitlines())
    assert "libraries (the sglang-0.5.23 profile's (the default for simulated devices)):" in flat
    assert "note: simulated devices, planned with the sglang-0.5.23 profile's libraries" in flat
    assert "--libs local plans with this machine's" in flat
    rc, out, _ = dispatch("explain", "--device", "sim:rtx-5090", "--op", "decode_mla", "--format", "json")
    inv = json.loads(out)["inventory"]
    assert inv["profile"] == "sglang-0.5.23" and inv["default"] is True and "--libs local" in inv["note"]
    assert json.loads(out)["ops"]["decode_mla"]["per_device"]["sim:rtx-5090"]["backend"] == \
        "flashinfer_sparse_mla"


def test_libs_local_plans_simulated_devices_with_this_machines_libraries(dispatch):
    rc, out, _ = dispatch("explain", "--device", "sim:rtx-5090", "--op", "decode_mla", "--libs", "local")
    assert rc == 0
    assert "libraries (this machine's):" in out
    assert "note: simulated devices, but this machine's libraries" in out and "--libs sglang-0.5.23" in out
    rc, out, _ = dispatch("explain", "--device", "sim:rtx-5090", "--op", "decode_mla", "--format", "json",
                          "--libs", "LOCAL")
    inv = json.loads(out)["inventory"]
    assert inv["whose"] == "this machine's" and inv["profile"] is None and "--libs" in inv["note"]
    assert inv["default"] is False


def test_libs_profile_plans_with_the_stacks_versions(dispatch):
    rc, out, _ = dispatch("explain", "--device", "sim:rtx-5090,sim:h200,sim:rtx-3080",
                          "--libs", "sglang-0.5.23", "--format", "json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["inventory"]["whose"] == "the sglang-0.5.23 profile's"
    assert doc["inventory"]["note"] == ""
    assert doc["inventory"]["versions"]["flashinfer-python"] == "0.7.2 (sglang-0.5.23)"
    assert doc["inventory"]["versions"]["torch"] == "2.14.1 (sglang-0.5.23)"
    per = doc["ops"]["decode_mla"]["per_device"]
    assert [per[d]["backend"] for d in ("sim:rtx-5090", "sim:h200", "sim:rtx-3080")] == \
        ["flashinfer_sparse_mla", "flashmla", "triton"]
    # --assume-lib adds to the profile: here it takes FlashInfer away.
    rc, out, _ = dispatch("explain", "--device", "sim:rtx-5090", "--libs", "sglang-0.5.23",
                          "--assume-lib", "flashinfer-python==0.6.0", "--op", "decode_mla", "--format", "json")
    doc = json.loads(out)
    assert doc["ops"]["decode_mla"]["per_device"]["sim:rtx-5090"]["backend"] == "triton_fp8"
    assert doc["inventory"]["whose"] == "the sglang-0.5.23 profile's, with assumptions"


def test_a_profile_lists_only_what_it_ships(dispatch):
    # A library the profile does not list is not installed on the target.
    from capdispatch.capabilities import Inventory
    inv = Inventory.with_assumptions(libs="sglang-0.5.23")
    assert inv.get("sglang-kernel").version == "0.4.10"
    assert inv.get("no-such-lib").installed is False
    assert inv.get("triton").installed and inv.get("triton").version is None


@pytest.mark.parametrize("args,needle", [
    (("--assume-lib", "flashinfer==0.7.2"), "the distribution that installs it is 'flashinfer-python'"),
    (("--assume-lib", "flashinfer-pyton"), "unknown library 'flashinfer-pyton'; did you mean 'flashinfer-python'"),
    (("--assume-lib", "tritn"), "unknown library 'tritn'; did you mean 'triton'"),
    (("--assume-lib", "sglang-0.5.23"), "names a library profile, not a library: use --libs sglang-0.5.23"),
    (("--libs", "sglang-0.5.2"), "unknown library profile 'sglang-0.5.2'; did you mean 'sglang-0.5.23'"),
])
def test_unknown_library_names_are_refused(dispatch, args, needle):
    rc, out, err = dispatch("explain", "--device", "sim:rtx-5090", *args)
    assert rc == 2 and needle in err and out == ""


def test_api_refuses_unknown_library_too(clean_env):
    import capdispatch as cd
    with pytest.raises(cd.BadInput, match="flashinfer-python"):
        cd.resolve("kv_dequant", "sim:rtx-3080", assume_libs=["flashinfer"])


def test_devices_says_whose_libraries(dispatch):
    # The one rule: a simulated device's libraries are the default profile's, unless --libs says.
    rc, out, _ = dispatch("devices", "--device", "sim:rtx-5090", "--format", "json")
    inv = json.loads(out)["inventory"]
    assert rc == 0 and inv["default"] is True and inv["profile"] == "sglang-0.5.23" and "--libs local" in inv["note"]
    rc, out, _ = dispatch("devices", "--device", "sim:rtx-5090", "--libs", "local", "--format", "json")
    assert rc == 0 and json.loads(out)["inventory"]["whose"] == "this machine's"
    rc, out, _ = dispatch("devices", "--device", "sim:rtx-5090")
    assert max(len(line) for line in out.splitlines()) <= 100
    out = " ".join(line.strip() for line in out.splitlines())
    assert "libraries (the sglang-0.5.23 profile's (the default for simulated devices)):" in out
    assert "32.0 GiB, CUDA unknown (simulated; --assume-cuda VER) features:" in out
    rc, out, _ = dispatch("devices", "--device", "sim:rtx-5090", "--assume-cuda", "12.8")
    assert "CUDA 12.8 (simulated)" in " ".join(line.strip() for line in out.splitlines())


# --- probe failures -------------------------------------------------------------------------

def _fake_nvml(error_name):
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass
    err = type(error_name, (NVMLError,), {})
    m.NVMLError = NVMLError
    setattr(m, error_name, err)

    def init():
        raise err("NVML Shared Library Not Found")
    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    return m


@pytest.mark.parametrize("nvml,why", [
    (None, "NVML bindings not installed (pip install nvidia-ml-py"),
    ("NVMLError_LibraryNotFound", "libnvidia-ml.so.1) not found: no NVIDIA driver is installed"),
    ("NVMLError_DriverNotLoaded", "the NVIDIA driver is not loaded"),
])
def test_probe_nvml_that_cannot_run_exits_2_with_why_and_what_to_do(dispatch, monkeypatch, nvml, why):
    monkeypatch.setitem(sys.modules, "pynvml", None if nvml is None else _fake_nvml(nvml))
    rc, out, err = dispatch("devices", "--probe", "nvml")
    assert rc == 2 and out == ""
    assert why in err and "--device sim:NAME" in err and "dispatch catalog" in err
    rc, out, err = dispatch("explain", "--device", "cuda:1", "--probe", "nvml")
    assert rc == 2 and why in err and "--device sim:NAME" in err


def test_cuda_device_without_cuda_says_why(dispatch, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml("NVMLError_LibraryNotFound"))
    monkeypatch.setattr("capdispatch.capabilities.probing._torch_cannot_have_cuda", lambda: True)
    monkeypatch.setattr("capdispatch.capabilities.probing._torch_failure", lambda: "torch 9.9+cpu is a CPU build")
    rc, out, err = dispatch("explain", "--device", "cuda:1")
    assert rc == 2
    assert "cuda:1: cannot read it: NVML: NVML library (libnvidia-ml.so.1) not found" in err
    assert "torch: torch 9.9+cpu is a CPU build" in err and "--device sim:NAME" in err
    # Without --device the fallback to cpu is not silent: the note says why.
    rc, out, err = dispatch("devices")
    assert rc == 0 and out.startswith("cpu ")
    assert "no CUDA device found (NVML: NVML library" in out and "--device sim:NAME" in out


# --- basics ---------------------------------------------------------------------------------

def test_version(dispatch):
    from importlib import metadata

    import capdispatch
    rc, out, _ = dispatch("--version")
    try:
        want = metadata.version("capdispatch")
    except metadata.PackageNotFoundError:
        want = capdispatch.__version__
    assert rc == 0 and out.strip() == f"capdispatch {want}"


def test_sglang_help_works(dispatch):
    rc, out, err = dispatch("sglang", "--help")
    assert rc == 0 and "plan" in out, err
    rc, out, _ = dispatch("--help")
    assert rc == 0 and "sglang" in out and "examples:" in out and "register-python-argcomplete" in out


def _actions(parser, path="dispatch"):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _actions(sp, f"{path} {name}")
        elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)) or not a.help:
            yield path, a


def test_every_option_has_help_and_every_command_examples():
    from capdispatch.adapters.sglang import cli as sglang_cli
    missing = [f"{path} {a.dest}" for parser in (cli._parser(), sglang_cli._parser())
               for path, a in _actions(parser) if not a.help]
    assert missing == []
    p = cli._parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("explain", "devices", "env", "catalog", "policy"):
        assert "examples:" in (sub.choices[name].epilog or ""), name


def test_completion_of_devices_ops_and_backends(tmp_path):
    out = tmp_path / "completions"
    env = dict(os.environ, _ARGCOMPLETE="1", _ARGCOMPLETE_IFS="\n",
               _ARGCOMPLETE_STDOUT_FILENAME=str(out))
    got = {}
    for line in ("dispatch explain --device sim:rtx-5090,sim:rtx-30", "dispatch explain --op kv_",
                 "dispatch explain --set moe=", "dispatch explain --libs sg"):
        subprocess.run([sys.executable, "-m", "capdispatch"], cwd=ROOT, timeout=60, check=True,
                       env=dict(env, COMP_LINE=line, COMP_POINT=str(len(line))))
        got[line.split()[-1]] = {c.strip() for c in out.read_text().split("\n")}
    assert got["sim:rtx-5090,sim:rtx-30"] == {"sim:rtx-5090,sim:rtx-3080", "sim:rtx-5090,sim:rtx-3090"}
    assert got["kv_"] == {"kv_quant", "kv_dequant"}
    assert "moe=triton_w4a16" in got["moe="] and "moe=torch" in got["moe="]
    from capdispatch.capabilities import lib_profiles
    assert got["sg"] == set(lib_profiles.names()) >= {"sglang-0.5.17", "sglang-0.5.23"}


@pytest.mark.parametrize("line,want", [
    ("dispatch sglang ", {"plan"}),
    ("dispatch sglang plan --device sim:rtx-509", {"sim:rtx-5090"}),
    ("dispatch sglang plan --libs lo", {"local"}),
    ("dispatch verify --device cp", {"cpu"}),
    ("dispatch verify --op kv_", {"kv_quant", "kv_dequant"}),
    ("dispatch lock --device sim:h20", {"sim:h200"}),
    ("dispatch lock --op kv_quant,kv_d", {"kv_quant,kv_dequant"}),
    ("dispatch lock --libs de", {"default"}),
    ("dispatch bench --op mo", {"moe"}),
    ("dispatch bench --device cp", {"cpu"}),
    ("dispatch devices --device sim:rtx-508", set()),
    ("dispatch policy ", {"validate", "show", "-h", "--help"}),
])
def test_completion_of_every_command(tmp_path, line, want):
    out = tmp_path / "completions"
    env = dict(os.environ, _ARGCOMPLETE="1", _ARGCOMPLETE_IFS="\n",
               _ARGCOMPLETE_STDOUT_FILENAME=str(out), COMP_LINE=line, COMP_POINT=str(len(line)))
    subprocess.run([sys.executable, "-m", "capdispatch"], cwd=ROOT, timeout=60, check=True, env=env)
    got = {c.strip() for c in out.read_text().split("\n") if c.strip()}
    assert got == want


def test_bare_dispatch_prints_the_help_and_every_command_has_examples(dispatch):
    rc, out, _ = dispatch()
    assert rc == 2 and "usage: dispatch" in out and "examples:" in out and "explain" in out
    rc, out, _ = dispatch("-V")
    assert rc == 0 and out.startswith("capdispatch ")
    for cmd in (["lock"], ["verify"], ["bench"], ["ops"], ["policy", "validate"], ["policy", "show"],
                ["sglang"], ["sglang", "plan"], ["explain"], ["devices"], ["catalog"], ["env"],
                ["rehearse"], ["checkpoint"]):
        rc, out, _ = dispatch(*cmd, "--help")
        assert rc == 0 and "examples:\n  dispatch " in out, cmd


# --- env, catalog ---------------------------------------------------------------------------

def _read_vars():
    """Every CAPDISPATCH_* name the package's source mentions."""
    names = set()
    for base, _, files in os.walk(os.path.join(ROOT, "capdispatch")):
        for f in files:
            if f.endswith(".py"):
                names |= set(re.findall(r"CAPDISPATCH_[A-Z_]+[A-Z]", open(os.path.join(base, f)).read()))
    return names


def test_env_report(dispatch, monkeypatch):
    from capdispatch.dispatch import env_cmd
    assert _read_vars() <= set(env_cmd.VARIABLES)
    monkeypatch.setenv("CAPDISPATCH_SET", "kv_quant=torch")
    monkeypatch.setenv("CAPDISPATCH_STRCT", "1")
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml("NVMLError_LibraryNotFound"))
    rc, out, _ = dispatch("env", "--format", "json")
    assert rc == 0
    r = json.loads(out)
    assert r["capdispatch"]["version"] == cli.version()
    assert r["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert r["variables"]["CAPDISPATCH_SET"] == "kv_quant=torch"
    assert r["variables"]["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES")
    for name in ("TRITON_INTERPRET", "CUDA_DEVICE_ORDER", "CAPDISPATCH_POLICY"):
        assert name in r["variables"]
    assert r["unknown_variables"] == ["CAPDISPATCH_STRCT"]
    assert r["nvml"]["ok"] is False and "not found" in r["nvml"]["error"]
    assert {"torch", "triton", "flashinfer-python", "sgl-flash-mla", "tilelang"} <= set(r["libraries"])
    rc, out, _ = dispatch("env")
    assert "CAPDISPATCH_SET" in out and "'kv_quant=torch'" in out and "(unset)" in out
    assert "reads none of CAPDISPATCH_STRCT" in out and "NVML: NVML library" in out


def test_env_imports_no_torch():
    code = ("import sys; from capdispatch.dispatch import env_cmd; env_cmd.report(); "
            "from capdispatch.dispatch.cli import main; main(['explain', '--device', 'sim:rtx-5090,sim:rtx-3080', '--brief']); "
            "assert 'torch' not in sys.modules and 'rich' in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr


def test_catalog(dispatch):
    from capdispatch.capabilities import catalog
    rc, out, _ = dispatch("catalog")
    assert rc == 0
    for name in catalog.names():
        assert re.search(rf"^{re.escape(name)}\s", out, flags=re.M), name
    assert "aliases: geforce-rtx-3080" in out
    rc, out, _ = dispatch("catalog", "--format", "json")
    rows = {r["key"]: r for r in json.loads(out)["devices"]}
    assert rows["rtx-3080"]["cc"] == "8.6" and rows["rtx-3080"]["sm_count"] == 68
    assert rows["sm_90"]["kind"] == "arch" and "sources" not in rows["h200"]
    rc, out, _ = dispatch("catalog", "--sources", "--format", "json")
    assert "cc" in json.loads(out)["devices"][0]["sources"]


# --- smaller --------------------------------------------------------------------------------

def test_op_takes_commas(dispatch):
    rc, out, _ = dispatch("explain", "--device", "sim:rtx-3080", "--assume-lib", "triton",
                          "--op", "kv_quant,kv_dequant", "--format", "json")
    assert rc == 0 and list(json.loads(out)["ops"]) == ["kv_quant", "kv_dequant"]
    rc, _, err = dispatch("explain", "--device", "sim:rtx-3080", "--op", "kv_quant,kv_deqant")
    assert rc == 2 and "did you mean 'kv_dequant'" in err
    rc, _, err = dispatch("explain", "--device", "sim:rtx-3080", "--op", ",")
    assert rc == 2 and "has an empty entry" in err


def test_mixed_group_flag(dispatch):
    base = ("explain", "--device", RIG, "--assume-lib", "triton", "--op", "kv_dequant", "--format", "json")
    rc, out, _ = dispatch(*base, "--mixed-group", "uniform")
    g = json.loads(out)["ops"]["kv_dequant"]
    assert rc == 0 and g["uniform"] is True
    assert {r["backend"] for r in g["per_device"].values()} == {"triton_u8"}
    assert "--mixed-group" in g["per_device"]["sim:rtx-5090"]["source"]
    # The flag sits above a policy file that says otherwise.
    rc, _, err = dispatch(*base, "--policy", os.path.join(ROOT, "tests", "policies", "uniform.yaml"),
                          "--mixed-group", "error")
    assert rc == 3 and "--mixed-group" in err
    rc, _, err = dispatch(*base, "--mixed-group", "uniformly")
    assert rc == 2 and "invalid choice" in err


def test_divergence_warning_recommends_the_flag(clean_env):
    import capdispatch as cd
    g = cd.resolve_group("kv_dequant", ["sim:rtx-5090", "sim:rtx-3080"], assume_libs=["triton"])
    assert "--mixed-group uniform" in g.warnings[0]


def test_missing_torch_names_the_extra():
    from capdispatch.backends.base import TORCH, Facts
    from capdispatch.capabilities import Inventory, probe
    facts = Facts(probe("cpu"), frozenset(), Inventory.with_assumptions(libs="sglang-0.5.23"))
    assert TORCH.evaluate(facts).ok
    # A target without torch: the message names the extra that installs it.
    from capdispatch.capabilities.lib_profiles import Profile
    bare = Inventory(profile=Profile("bare", "", "", ()))
    check = TORCH.evaluate(Facts(probe("cpu"), frozenset(), bare))
    assert not check.ok and "pip install 'capdispatch[torch]'" in check.message


def test_bench_cli_cold_writes_a_new_file(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_cli_cold
    finally:
        sys.path.pop(0)
    import datetime as dt
    p = bench_cli_cold.result_path(str(tmp_path), dt.datetime(2026, 12, 1, 20, 0, 5, tzinfo=dt.timezone.utc))
    assert os.path.basename(p) == "cli_cold_20261201T200005Z.json"
    src = open(os.path.join(ROOT, "benchmarks", "bench_cli_cold.py")).read()
    assert '"cli_cold.json"' not in src and 'open(path, "x")' in src


# --- the documented examples reproduce ------------------------------------------------------

def _doc_block(path, command):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    start = text.index(f"$ {command}\n") + len(command) + 3
    return text[start:text.index("```", start)].rstrip("\n").splitlines()


def _norm(line):
    return " ".join(line.split())


def test_readme_matrix_reproduces(dispatch):
    cmd = "dispatch explain --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --libs sglang-0.5.23 --brief"
    rc, out, _ = dispatch(*cmd.split()[1:])
    assert rc == 0
    assert out.rstrip("\n").splitlines() == _doc_block("README.md", cmd)


def test_readme_one_op_example_reproduces_and_names_no_library_of_this_machine(dispatch):
    """Simulated and without --libs/--assume-lib: the default profile's libraries, so the
    example prints the same on a torch-free install as on a full one."""
    cmd = "dispatch explain --device sim:rtx-3080 --op kv_dequant"
    rc, out, _ = dispatch(*cmd.split()[1:])
    assert rc == 0
    assert [_norm(x) for x in out.rstrip("\n").splitlines()] == [_norm(x) for x in _doc_block("README.md", cmd)]


def test_no_example_of_explain_rests_on_this_machine_s_torch():
    """`--assume-lib NAME` adds to this machine's libraries: without torch installed, such an
    example exits 3. The examples a new user copies plan simulated cards with the default
    profile (or name --libs) instead."""
    texts = [cli.EPILOG, cli.EXPLAIN_EPILOG, open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8").read()]
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    texts.append(readme)
    for text in texts:
        for line in text.splitlines():
            if "dispatch explain --device sim:" in line:
                assert "--assume-lib" not in line or "--libs" in line, line


def test_explain_counts_a_model_s_ranks_as_plan_does(dispatch):
    """Three cards are three ranks in explain as in plan: V4-Flash's 64 heads refused at tp 3
    by both, and --tp 2 over three cards refused by both, in one wording."""
    for cmd in ("explain", "plan"):
        rc, out, err = dispatch(cmd, "--device", RIG, "--model", "deepseek-v4-flash", "--brief")
        assert rc == (2 if cmd == "explain" else 3)
        assert "heads 64 do not divide over tp 3" in err + out
        rc, out, err = dispatch(cmd, "--device", RIG, "--model", "deepseek-v4-flash", "--tp", "2")
        assert rc == 2 and err.strip() == ("dispatch: error: --tp 2 puts one rank on each card, but --device "
                                           "names 3 card(s); give 2 devices (or one, to use it 2 times)")
    rc, out, _ = dispatch("explain", "--device", "sim:h200", "--model", "deepseek-v4-flash", "--tp", "8",
                          "--format", "json")
    assert rc == 0 and json.loads(out)["shapes"]["tp"] == 8
    rc, out, _ = dispatch("explain", "--device", "sim:h200,sim:h200", "--model", "deepseek-v4-flash",
                          "--format", "json")
    assert rc == 0 and json.loads(out)["shapes"]["tp"] == 2


def test_a_bad_assume_cuda_is_named_by_its_own_flag(dispatch):
    rc, out, err = dispatch("explain", "--device", "sim:h200", "--assume-cuda", "abc")
    assert rc == 2 and out == ""
    assert err.strip().startswith("dispatch: error: bad --assume-cuda 'abc': expected a CUDA toolkit version")


def test_extras_match_the_declared_ranges():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from capdispatch.backends import builtin
    meta = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    assert not any(Requirement(r).name == "torch" for r in meta["dependencies"])
    assert any(Requirement(r).name == "rich" for r in meta["dependencies"])
    extras = {k: {Requirement(r).name: Requirement(r).specifier for r in v}
              for k, v in meta["optional-dependencies"].items()}
    assert "torch" in extras["torch"] and "argcomplete" in extras["completion"]
    # The sglang extra is the plugin's tested range.
    import yaml
    knobs = yaml.safe_load(open(os.path.join(ROOT, "capdispatch", "adapters", "sglang", "knobs.yaml")))
    # The extra admits exactly the tested releases that have a knob-map entry.
    from capdispatch.adapters.sglang import knobs as knob_map
    loaded = knob_map.load()
    for minor in range(14, 26):
        for v in (f"0.5.{minor}", f"0.5.{minor}.post1"):
            has = SpecifierSet(knobs["tested"]).contains(v) and loaded.release(v) is not None
            assert extras["sglang"]["sglang"].contains(v) == has, v
    # The flashinfer extra's floor satisfies every backend's flashinfer-python requirement.
    floor = next(s.version for s in extras["flashinfer"]["flashinfer-python"] if s.operator == ">=")
    reg = builtin()
    specs = [SpecifierSet(r.spec) for op in reg.ops for b in reg.backends(op) for r in b.requires
             if getattr(r, "dist", None) == "flashinfer-python"]
    assert specs and all(s.contains(floor) for s in specs)


def test_bind_without_torch_names_the_extra(clean_env, monkeypatch):
    import capdispatch as cd
    from capdispatch.capabilities import libraries
    real = libraries.metadata.version

    def version(name):
        if name == "torch":
            raise libraries.metadata.PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(libraries.metadata, "version", version)
    with pytest.raises(cd.NoBackendError, match=re.escape("torch is not installed (pip install 'capdispatch[torch]')")):
        cd.bind("kv_dequant", "cpu")


# --- dispatch sglang plan: the matrix and whose libraries ----------------------------------------

SGLANG_DOC_CMD = ("dispatch sglang plan --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --tp 3 "
                  "--libs sglang-0.5.23")


@pytest.fixture
def plan_cmd(dispatch, clean_env):
    for k in ("CAPDISPATCH_SGLANG_DEVICES", "NO_COLOR", "FORCE_COLOR"):
        clean_env.delenv(k, raising=False)

    def run(*args):
        return dispatch("sglang", "plan", *args)
    return run


def _without_local(monkeypatch, dist):
    """This machine without DIST installed (its metadata lookup fails)."""
    from capdispatch.capabilities import libraries
    real = libraries.metadata.version

    def version(name):
        if libraries.canonicalize_name(name) == dist:
            raise libraries.metadata.PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(libraries.metadata, "version", version)


def test_sglang_plan_doc_example_reproduces(plan_cmd):
    from capdispatch.adapters.sglang import versions
    rc, out, _ = plan_cmd(*SGLANG_DOC_CMD.split()[3:])
    assert rc == 0
    got, want = out.rstrip("\n").splitlines(), _doc_block("docs/sglang.md", SGLANG_DOC_CMD)
    # Without SGLang installed the header says the plan uses its knob map; the rest is the same.
    assert (got if versions.installed() else got[1:]) == (want if versions.installed() else want[1:])


def test_sglang_plan_libs_replace_this_machines_libraries(plan_cmd, monkeypatch):
    _without_local(monkeypatch, "flashinfer-python")
    rc, out, _ = plan_cmd("--device", RIG, "--libs", "local", "--format", "json")
    assert rc == 0
    here = json.loads(out)
    assert here["inventory"]["whose"] == "this machine's"
    assert "--libs sglang-0.5.23" in here["inventory"]["note"]
    assert here["ranks"][0]["ops"]["decode_mla"]["backend"] != "flashinfer_sparse_mla"
    rc, out, _ = plan_cmd("--device", RIG, "--libs", "sglang-0.5.23", "--format", "json")
    assert rc == 0
    there = json.loads(out)
    assert there["inventory"]["whose"] == "the sglang-0.5.23 profile's"
    assert there["inventory"]["profile"] == "sglang-0.5.23" and there["inventory"]["note"] == ""
    assert there["inventory"]["versions"]["flashinfer-python"] == "0.7.2 (sglang-0.5.23)"
    # The ranks and the SGLang settings table read the same inventory.
    assert there["ranks"][0]["ops"]["decode_mla"]["backend"] == "flashinfer_sparse_mla"
    sm120 = next(s for s in there["sglang_settings"] if s["name"] == "SGLANG_SM120_FLASHMLA_BACKEND")
    assert sm120["wants"] == {"flashinfer": ["cuda:0"]}
    sm120_here = next(s for s in here["sglang_settings"] if s["name"] == "SGLANG_SM120_FLASHMLA_BACKEND")
    assert "flashinfer" not in sm120_here["wants"]
    # The same decisions as `dispatch explain --libs` for those cards.
    import capdispatch as cd
    p = cd.plan(RIG.split(","), libs="sglang-0.5.23", log_warnings=False)
    for op in ("kv_dequant", "indexer", "sparse_prefill", "decode_mla", "moe"):
        assert [r["ops"][op]["backend"] for r in there["ranks"]] == \
            [r.backend for r in p.ops[op].per_device.values()], op


def test_sglang_plan_assume_lib_adds_to_the_profile(plan_cmd):
    rc, out, _ = plan_cmd("--device", RIG, "--libs", "sglang-0.5.23",
                          "--assume-lib", "flashinfer-python==0.6.0", "--format", "json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["inventory"]["whose"] == "the sglang-0.5.23 profile's, with assumptions"
    assert doc["inventory"]["assumed"] == {"flashinfer-python": "0.6.0"}
    assert doc["ranks"][0]["ops"]["decode_mla"]["backend"] != "flashinfer_sparse_mla"


def test_sglang_plan_unknown_profile_is_bad_input(plan_cmd):
    rc, out, err = plan_cmd("--device", RIG, "--libs", "sglang-0.5.2")
    assert rc == 2 and out == ""
    assert "unknown library profile 'sglang-0.5.2'" in err and "sglang-0.5.23" in err
    assert "Traceback" not in err


def test_sglang_plan_header_says_whose_libraries(plan_cmd, monkeypatch):
    _without_local(monkeypatch, "flashinfer-python")
    rc, out, _ = plan_cmd("--device", RIG)
    assert rc == 0
    head = out.splitlines()[:8]      # the model line wraps
    assert "libraries: the sglang-0.5.23 profile's (the default for simulated devices)" in head
    assert any(line.startswith("note: simulated devices, planned with the sglang-0.5.23 profile's")
               for line in head)
    rc, out, _ = plan_cmd("--device", RIG, "--libs", "local")
    assert rc == 0
    head = out.splitlines()[:8]
    assert "libraries: this machine's" in head
    assert any(line.startswith("note: simulated devices, but this machine's libraries") for line in head)
    rc, out, _ = plan_cmd("--device", RIG, "--libs", "sglang-0.5.23")
    assert "libraries: the sglang-0.5.23 profile's" in out.splitlines()[:8]
    assert "note: simulated" not in out


def test_sglang_plan_opens_with_the_matrix_and_brief_is_the_matrix_and_its_warnings(plan_cmd):
    rc, full, _ = plan_cmd("--device", RIG, "--libs", "sglang-0.5.23")
    assert rc == 0
    rc, brief, _ = plan_cmd("--device", RIG, "--libs", "sglang-0.5.23", "--brief")
    assert rc == 0
    lines = brief.splitlines()
    # The two RTX 3080s decide alike: one column, its header a line taller.
    assert "cuda:1-2 x2" in lines[0] and "cuda:0 (rank 0)" in lines[1] and "RTX 5090, cc 12.0" in lines[2]
    rows = {}     # a table wider than the terminal continues below: a row's parts joined
    for line in lines:
        if line.startswith(" ") and line.split() and line.split()[0] in (
                "kv_quant", "kv_dequant", "indexer", "decode_mla", "moe"):
            rows[line.split()[0]] = rows.get(line.split()[0], "") + line
    assert "triton_u8 (routed)*" in rows["kv_dequant"] and "triton_fp8 (kept)" in rows["kv_dequant"]
    assert "≠" in rows["kv_dequant"] and "≠" not in rows["kv_quant"]
    assert "triton_w4a16 (routed)*" in rows["moe"]
    assert "(routed): capdispatch's kernel at SGLang's call site" in lines
    assert "* fallback: the first preference cannot run on that device" in lines
    # The matrix, whose libraries, and the one warning its caption counts: the divergences' summary.
    caption = lines.index("warnings:") - 2
    assert lines[caption].startswith("libraries: the sglang-0.5.23 profile's") and lines[caption].endswith(
        "; 1 warning(s) below")
    assert " ".join(lines[caption + 3:]).split()[:2] == ["mixed", "group:"]
    assert not any(line.startswith(("rank 0: cuda:0 NVIDIA", "launch (")) for line in lines)
    # The full plan opens with the same matrix, then the tables.
    assert "\n".join(lines[:caption]) in full
    assert full.index(lines[0]) < full.index("launch (main process") < full.index("rank 0: cuda:0 NVIDIA")


def test_sglang_plan_shows_the_probe_reason_and_hint(plan_cmd, monkeypatch):
    import capdispatch as cd

    def no_gpu(dev, via="auto", **kw):
        raise cd.ProbeError(f"{dev}: NVML library not found: no NVIDIA driver is installed",
                            "simulate it: --device sim:NAME")
    monkeypatch.setattr(cd, "probe", no_gpu)
    rc, out, err = plan_cmd("--device", "cuda:0")
    assert rc == 2 and out == ""
    assert "cuda:0: NVML library not found: no NVIDIA driver is installed; simulate it: --device sim:NAME" in err
    assert "Traceback" not in err
