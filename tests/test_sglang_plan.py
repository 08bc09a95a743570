"""`dispatch sglang plan` decides once: for any simulated rig and any --assume-lib
set, every op of every rank is the resolution capdispatch itself gives for those
inputs, and the rank table and the SGLang settings table name the same backend
per device and op. None of this needs SGLang installed, but the last test: with
it, `-- SGLANG ARGS` (SGLang's own resolution, in process) decides the same."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import capdispatch as cd
from capdispatch.dispatch import explain

RIG_ENV = "CAPDISPATCH_SGLANG_DEVICES"
CARDS = ("sim:rtx-5090", "sim:rtx-3080", "sim:h200", "sim:rtx-pro-6000", "sim:sm_86", "sim:b200",
         "sim:rtx-4090", "sim:a100", "sim:sm_120", "sim:h100", "sim:l40s")
# Versions that satisfy the backends' requirements, and versions that do not:
# the plan must follow them everywhere, whatever is installed here.
LIBS = ("sgl-flash-mla==1.0.0", "sgl-flash-mla==0.9.0", "flashinfer-python==0.7.2",
        "flashinfer-python==0.6.0", "tilelang==0.1.12", "tilelang==0.1.0", "sgl-deep-gemm==0.2.3.post2",
        "sgl-deep-gemm==0.1.0", "sglang-kernel==0.4.10", "sglang-kernel==0.3.0")


def _label(kind, name, value):
    return f"{name}={value}" if kind == "field" else f"env {name}={value}"


def _plan(argv):
    from capdispatch.adapters.sglang import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["plan", *argv, "--format", "json"])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", RIG_ENV,
              "SGLANG_DSV4_KV_LAYOUT", "SGLANG_SM120_FLASHMLA_BACKEND", "SGLANG_OPT_USE_TILELANG_INDEXER",
              "SGLANG_OPT_USE_AITER_INDEXER", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH",
              "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL"):
        monkeypatch.delenv(k, raising=False)


def check_one_decision(rig, libs, extra=()):
    argv = ["--device", ",".join(rig), *[a for lib in libs for a in ("--assume-lib", lib)], *extra]
    rc, out, err = _plan(argv)
    assert rc == 0, err
    p = json.loads(out)
    ranks = p["ranks"]
    assert [r["device"]["name"] for r in ranks] == [cd.probe(d).name for d in rig]
    sels = [extra[i + 1] for i, a in enumerate(extra) if a == "--set"]
    pols = [extra[i + 1] for i, a in enumerate(extra) if a == "--policy"]
    # 1. Every decided op of every rank is capdispatch's own resolution for the same
    #    inputs (--assume-lib and --set reach the rank table).
    ops = p["ops"]
    # The API's defaults are the command's: whose libraries follow the one rule (cd.target_libs).
    ref = cd.plan(list(rig), ops, assume_libs=list(libs) or None, selections=sels or None,
                  policy=pols or None, log_warnings=False)
    for r, (pid, _) in zip(ranks, zip(ref.devices, rig)):
        for op in ops:
            c = r["ops"][op]
            if c["backend"] is not None:
                assert c["backend"] == ref.ops[op].per_device[pid.id].backend, (r["rank"], op, libs)
    # 2. The settings table is the rank table's settings, device by device.
    from capdispatch.adapters.sglang import knobs
    release = knobs.load().release(p["sglang"]["version"])
    table = {(x["kind"], x["name"]): x for x in p["sglang_settings"]}
    for r in ranks:
        dev = f"cuda:{r['gpu_id']}"
        for op, c in r["ops"].items():
            entry = release.entry(op, c["backend"])
            want = [s.label for s in entry.settings] if entry is not None and entry.kind == "sglang" else []
            assert (c["setting"] or []) == want, (dev, op, c["backend"])
            for s in (entry.settings if entry is not None and entry.kind == "sglang" else ()):
                row = table[(s.kind, s.name)]
                assert op in row["ops"] and dev in row["wants"].get(s.value, []), (dev, op, s.label, row)
    for (kind, name), row in table.items():
        for value, devs in row["wants"].items():
            for dev in devs:
                r = ranks[[f"cuda:{x['gpu_id']}" for x in ranks].index(dev)]
                assert any(_label(kind, name, value) in (r["ops"][op]["setting"] or []) for op in row["ops"]), \
                    (dev, name, value)
        for dev in row["without"]:
            r = ranks[[f"cuda:{x['gpu_id']}" for x in ranks].index(dev)]
            assert any(r["ops"][op]["action"] == "reported" and r["ops"][op]["setting"] is None
                       for op in row["ops"]), (dev, name)
        # Devices whose rank routes one of the row's ops: named with the routed backend.
        for dev, backend in row["routed"].items():
            r = ranks[[f"cuda:{x['gpu_id']}" for x in ranks].index(dev)]
            assert any(r["ops"][op]["routed"] and r["ops"][op]["backend"] == backend for op in row["ops"]), \
                (dev, name, backend)
            assert f"routed to capdispatch {backend}" in row["why"]
            assert dev not in row["without"]
        assert "no SGLang setting runs" not in row["why"] or row["without"]
    # 3. Every rank reports every op, moe included, with the final schema.
    for r in ranks:
        assert list(r["ops"]) == ops and "moe" in ops
        for c in r["ops"].values():
            assert c["action"] in ("routed", "kept", "reported") and c["routed"] == (c["action"] == "routed")
            assert c["why"]
    return p


def test_the_reported_contradiction_cannot_happen(clean_env):
    """An H200 planned for a machine with an older FlashMLA than this one: the rank
    table and the settings table both say FlashMLA does not run there."""
    p = check_one_decision(["sim:h200"], ["sgl-flash-mla==0.9.0"])
    ops = p["ranks"][0]["ops"]
    assert ops["decode_mla"]["backend"] == "triton_fp8" and ops["decode_mla"]["routed"]
    assert "library:sgl-flash-mla: need sgl-flash-mla>=1.0, found 0.9.0 (assumed)" in ops["decode_mla"]["why"]
    attn = next(x for x in p["sglang_settings"] if x["name"] == "dsv4_attn_backend")
    assert attn["wants"] == {} and attn["without"] == [] and attn["routed"] == {"cuda:0": "triton_fp8"}
    p = check_one_decision(["sim:h200"], ["sgl-flash-mla==1.0.0"])
    assert p["ranks"][0]["ops"]["decode_mla"]["backend"] == "flashmla"
    attn = next(x for x in p["sglang_settings"] if x["name"] == "dsv4_attn_backend")
    assert attn["wants"] == {"flashmla": ["cuda:0"]}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rig=st.lists(st.sampled_from(CARDS), min_size=1, max_size=4),
       libs=st.lists(st.sampled_from(LIBS), max_size=5, unique=True))
def test_rank_and_settings_tables_agree_for_any_rig_and_libraries(clean_env, rig, libs):
    check_one_decision(rig, libs)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rig=st.lists(st.sampled_from(CARDS), min_size=1, max_size=3),
       libs=st.lists(st.sampled_from(LIBS), max_size=4, unique=True),
       sel=st.sampled_from(["decode_mla=flashmla", "moe=marlin_w4a16", "indexer=tilelang",
                            "sparse_prefill=flashmla_sparse", "moe=triton_w4a16", "kv_quant=torch"]))
def test_set_reaches_every_part_of_the_plan(clean_env, rig, libs, sel):
    check_one_decision(rig, libs, ("--set", sel))


def test_policy_and_environment_reach_every_part_of_the_plan(clean_env, monkeypatch, tmp_path):
    pol = tmp_path / "p.yaml"
    pol.write_text("schema: 1\nops:\n  moe: [marlin_w4a16]\n  decode_mla: [triton]\n")
    p = check_one_decision(["sim:h200", "sim:rtx-3080"], ["sglang-kernel==0.4.10"], ("--policy", str(pol)))
    for r in p["ranks"]:
        assert r["ops"]["moe"]["backend"] == "marlin_w4a16"
        assert r["ops"]["moe"]["setting"] == ["moe_runner_backend=marlin"]
        assert r["ops"]["decode_mla"]["backend"] == "triton" and r["ops"]["decode_mla"]["routed"]
    row = next(x for x in p["sglang_settings"] if x["name"] == "moe_runner_backend")
    assert row["action"] == "agree" and row["wants"] == {"marlin": ["cuda:0", "cuda:1"]}
    monkeypatch.setenv("CAPDISPATCH_SET", "moe=torch")
    p = json.loads(_plan(["--device", "sim:h200", "--assume-lib", "sglang-kernel==0.4.10"])[1])
    assert p["ranks"][0]["ops"]["moe"]["backend"] == "torch"
    assert p["ranks"][0]["ops"]["moe"]["action"] == "routed"
    mrb = next(x for x in p["sglang_settings"] if x["name"] == "moe_runner_backend")
    assert mrb["without"] == [] and mrb["routed"] == {"cuda:0": "torch"}


# One process for every case: SGLang's import is the slow part.
_IN_SGLANG = """
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
import sglang_prelude  # noqa: F401  (before SGLang: offline, CPU stand-ins)
from capdispatch.adapters.sglang import cli
out = []
for argv in json.loads(sys.argv[2]):
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = cli.main(["plan", *argv])
    out.append({"rc": rc, "out": buf.getvalue(), "err": err.getvalue()[-2000:]})
print("RESULT " + json.dumps(out))
"""

LIB_CASES = [
    ("sim:rtx-5090,sim:rtx-3080,sim:rtx-3080", ["--libs", "sglang-0.5.23"]),
    ("sim:rtx-5090,sim:rtx-3080,sim:rtx-3080", ["--libs", "sglang-0.5.23", "--assume-lib", "flashinfer-python==0.6.0"]),
    ("sim:h200", ["--libs", "sglang-0.5.23", "--assume-lib", "sgl-flash-mla==0.9.0"]),
    ("sim:h200,sim:rtx-3080", ["--assume-lib", "sgl-deep-gemm==0.2.3.post2", "--assume-lib", "sgl-flash-mla==1.0.0"]),
]


def _decided(p):
    """What the plan decided, per device and op, and per SGLang setting."""
    ranks = {f"cuda:{r['gpu_id']}": {op: (c["backend"], c["action"]) for op, c in r["ops"].items()}
             for r in p["ranks"]}
    table = {x["name"]: (x["action"], x["wants"], x["routed"], x["without"]) for x in p["sglang_settings"]}
    return ranks, table


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="needs SGLang (see tests/requirements-nodeps.txt and tests/requirements.txt)")
def test_libs_and_assume_lib_reach_sglangs_own_resolution_identically(clean_env, tmp_path):
    """`--libs` and `--assume-lib` decide the same backend per device and op (and the same
    SGLang settings table) whether the plan assumes a launch or runs SGLang's own argument
    resolution on `-- SGLANG ARGS`, where the plugin's launch step decides inside SGLang."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import sglang_fake_models as fake
    model = fake.write(str(tmp_path / "dsv4"), fake.DSV4)
    runs = []
    for rig, libs in LIB_CASES:
        n = len(rig.split(","))
        base = ["--device", rig, *libs, "--format", "json"]
        runs.append(base)
        runs.append([*base, "--", "--model-path", model, "--skip-tokenizer-init", "--device", "cuda",
                     "--tp-size", str(n), "--kv-cache-dtype", "fp8_e4m3"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPDISPATCH_", "SGLANG_", "TRITON_INTERPRET"))}
    env["CAPDISPATCH_CACHE_DIR"] = os.environ["CAPDISPATCH_CACHE_DIR"]
    proc = subprocess.run([sys.executable, "-c", _IN_SGLANG, here, json.dumps(runs)], env=env, text=True,
                          capture_output=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    seen = set()
    for (rig, libs), assumed, real in zip(LIB_CASES, results[0::2], results[1::2]):
        assert assumed["rc"] == 0 and real["rc"] == 0, (rig, libs, assumed["err"], real["err"])
        a, r = json.loads(assumed["out"]), json.loads(real["out"])
        assert a["model"]["assumed"] is True and r["model"]["assumed"] is False
        assert r["sglang_resolved"]["kv_cache_dtype"] == "fp8_e4m3"
        assert a["inventory"] == r["inventory"], (rig, libs)
        assert _decided(a) == _decided(r), (rig, libs)
        # The plugin's own launch step inside SGLang's resolution decided the same settings
        # (the V4 layout only where some rank routes a KV or decode op) and SGLang ended
        # with them.
        assert [(x["name"], x["value"]) for x in a["launch"]] == [(x["name"], x["value"]) for x in r["launch"]]
        layout = {x["name"]: x["value"] for x in a["launch"]}.get("SGLANG_DSV4_KV_LAYOUT")
        assert r["sglang_resolved"]["SGLANG_DSV4_KV_LAYOUT"] == layout, (rig, libs)
        seen.add(json.dumps(_decided(a), sort_keys=True))
    assert len(seen) == len(LIB_CASES)     # each case's libraries change the decision
    # The libraries reach the decisions: the older FlashMLA routes the H200's decode, and
    # the older FlashInfer moves the 5090 off SGLang's FlashInfer kernels.
    h200 = json.loads(results[5]["out"])["ranks"][0]["ops"]["decode_mla"]
    assert (h200["backend"], h200["action"]) == ("triton_fp8", "routed")
    r5090 = json.loads(results[3]["out"])["ranks"][0]["ops"]
    assert r5090["decode_mla"]["backend"] != "flashinfer_sparse_mla"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="needs SGLang (see tests/requirements-nodeps.txt and tests/requirements.txt)")
@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is installed here: the placeholder is not needed")
def test_planning_with_sglang_arguments_needs_no_torchvision(clean_env, tmp_path):
    """A CPU planning machine has no torchvision (PyPI's is built for CUDA torch), yet SGLang's
    argument resolution imports it: `dispatch sglang plan -- SGLANG ARGS` runs anyway, in a
    process that never imported the tests' prelude."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import sglang_fake_models as fake
    model = fake.write(str(tmp_path / "dsv4"), fake.DSV4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPDISPATCH_", "SGLANG_", "TRITON_INTERPRET"))}
    env.update(CAPDISPATCH_CACHE_DIR=os.environ["CAPDISPATCH_CACHE_DIR"], HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "capdispatch", "sglang", "plan", "--device", "sim:rtx-3080",
                           "--format", "json", "--", "--model-path", model, "--skip-tokenizer-init",
                           "--device", "cuda", "--tp-size", "1"],
                          env=env, text=True, capture_output=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torchvision" not in proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"]["assumed"] is False


# --------------------------------------------------------------------------------------------
# A profile of another release plans with that release's knob map
# --------------------------------------------------------------------------------------------

def test_a_profile_of_sglang_0517_plans_for_0517_with_its_own_kernels_kept(clean_env):
    rc, out, err = _plan(["--device", "sim:h100", "--libs", "sglang-0.5.17"])
    assert rc == 0, err
    p = json.loads(out)
    assert p["sglang"]["version"] == "0.5.17" and p["sglang"]["installed"] is False
    ops = {op: (e["backend"], e["action"]) for op, e in p["ranks"][0]["ops"].items()}
    # 0.5.17's FlashMLA and DeepGEMM indexer, judged by its knob map's statements, are kept.
    assert ops["decode_mla"] == ("flashmla", "kept") and ops["sparse_prefill"] == ("flashmla_sparse", "kept")
    assert ops["indexer"] == ("deepgemm", "kept")
    # The installed release's map (0.5.23) judges FlashMLA by sgl-flash-mla, which 0.5.17 does not pin.
    rc, out, err = _plan(["--device", "sim:h100", "--libs", "sglang-0.5.23"])
    assert rc == 0 and json.loads(out)["sglang"] == {**p["sglang"], "version": "0.5.23", "installed": True}


def test_sglang_arguments_are_read_by_the_installed_release_only(clean_env):
    rc, out, err = _plan(["--device", "sim:h100", "--libs", "sglang-0.5.17", "--", "--tp", "1"])
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--libs sglang-0.5.17 plans for SGLang 0.5.17" in lines[0] \
        and "installed here (0.5.23)" in lines[0], err


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="needs SGLang (see tests/requirements-nodeps.txt and tests/requirements.txt)")
def test_an_sglang_that_cannot_import_here_is_one_line_naming_it(clean_env, tmp_path):
    """SGLang's import fails on what it needs beside it (0.5.17 beside a newer transformers,
    a missing module): `dispatch sglang plan -- ...` says so in one line, exit 3, no traceback."""
    pkg = tmp_path / "shadow" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('raise ImportError("tokenizers>=0.22 is required\\nTry: pip install -U")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPDISPATCH_", "SGLANG_"))}
    env.update(CAPDISPATCH_CACHE_DIR=os.environ["CAPDISPATCH_CACHE_DIR"],
               PYTHONPATH=os.pathsep.join([str(pkg.parent), os.getcwd()]))
    proc = subprocess.run([sys.executable, "-m", "capdispatch", "sglang", "plan", "--device", "sim:h100",
                           "--", "--tp-size", "1"], env=env, text=True, capture_output=True, timeout=300,
                          cwd=str(tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 3 and proc.stdout == "", proc.stderr
    assert len(lines) == 1 and "cannot be imported here to read the arguments after `--`" in lines[0], lines
    assert "tokenizers>=0.22 is required Try: pip install -U" in lines[0] and "internal error" not in lines[0]
