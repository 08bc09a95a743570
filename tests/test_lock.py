"""Lock files: `dispatch lock`, `--check`, `explain --lock`, CAPDISPATCH_LOCK, the API.

Devices are simulated (planning imports no torch), except the verification-state test,
which plans on the CPU device so the verification cache has a card to answer for.
"""
from __future__ import annotations

import json
import logging
import os
import re
import types

import pytest
import yaml

import capdispatch as cd
from capdispatch.capabilities import probe

H200, RTX5090, RTX3080 = "sim:h200", "sim:rtx-5090", "sim:rtx-3080"
ASSUME = ["sgl-deep-gemm==0.2.3.post2", "tilelang==0.1.12", "triton==3.9.0", "torch==2.13.0"]


@pytest.fixture
def env(monkeypatch):
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", "CAPDISPATCH_LOCK"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _plan(devices, **kw):
    kw.setdefault("assume_libs", ASSUME)
    return cd.plan(devices, log_warnings=False, **kw)


def _drift_lines(stderr: str) -> list:
    return [ln for ln in stderr.splitlines() if "lock drift:" in ln]


# --------------------------------------------------------------------------- #
# Writing and reading
# --------------------------------------------------------------------------- #
def test_round_trip(env, tmp_path):
    p = _plan([H200, RTX3080])
    lk = cd.lock.freeze(p, inputs={"assume_lib": ASSUME})
    path = tmp_path / "capdispatch.lock"
    lk.write(path)
    text = path.read_text()
    assert text.startswith("# capdispatch lock file")
    doc = yaml.safe_load(text)
    assert doc["schema"] == 1 and doc["capdispatch"] == cd.__version__
    h200 = doc["devices"][0]
    assert (h200["id"], h200["name"], h200["cc"]) == (H200, "NVIDIA H200", "9.0")
    assert h200["ops"]["indexer"] == {"backend": "deepgemm", "verified": "not verified",
                                      "libraries": {"torch": "2.13.0", "sgl-deep-gemm": "0.2.3.post2"}}
    assert doc["devices"][1]["ops"]["indexer"]["backend"] == "triton"
    back = cd.lock.load(path)
    assert back == lk                                   # line marks and path do not count
    assert back.path == str(path) and back.device(H200).ops["indexer"].line > 0
    assert cd.lock.compare(p, back) == ()


def test_cli_write_and_check_same(run_cli, tmp_path):
    f = str(tmp_path / "capdispatch.lock")
    args = ["--device", f"{H200},{RTX3080}", *sum((["--assume-lib", a] for a in ASSUME), [])]
    rc, _, err = run_cli("lock", *args, "-o", f)
    assert rc == 0, err
    assert "wrote" in err and "2 device(s)" in err
    rc, out, err = run_cli("lock", "--check", f, *args[2:])     # devices: the lock's
    assert rc == 0, err
    assert "match the lock" in out and not _drift_lines(err)


# --------------------------------------------------------------------------- #
# Drift, one kind at a time
# --------------------------------------------------------------------------- #
def test_backend_drift_via_set(run_cli, tmp_path):
    f = str(tmp_path / "capdispatch.lock")
    libs = sum((["--assume-lib", a] for a in ASSUME), [])
    assert run_cli("lock", "--device", RTX5090, *libs, "-o", f)[0] == 0
    rc, _, err = run_cli("lock", "--check", f, "--set", "indexer=triton", *libs)
    assert rc == 3, err
    lines = _drift_lines(err)
    assert len(lines) == 1, err
    assert re.search(rf"lock drift: {RTX5090} indexer: backend was tilelang \(.*capdispatch\.lock:\d+\), "
                     rf"now triton$", lines[0]), lines[0]


def test_library_drift_via_assume_lib(env):
    p = _plan([RTX5090], ops=["indexer"])
    lk = cd.lock.freeze(p)
    newer = [a if not a.startswith("tilelang") else "tilelang==0.1.13" for a in ASSUME]
    drifts = cd.lock.compare(_plan([RTX5090], ops=["indexer"], assume_libs=newer), lk)
    assert [(d.kind, d.device, d.op, d.locked, d.now) for d in drifts] == \
        [("library", RTX5090, "indexer", "tilelang 0.1.12", "tilelang 0.1.13")]
    assert str(drifts[0]).count("\n") == 0


def test_a_library_installed_without_a_version_is_not_locked_as_not_installed(env):
    """The default profile's triton is unpinned: the lock says installed, and a drift names it so."""
    p = cd.plan([RTX3080], ops=["kv_dequant"], log_warnings=False)           # the default profile
    lk = cd.lock.freeze(p)
    (locked,) = [d for d in lk.devices if d.id == RTX3080]
    assert locked.ops["kv_dequant"].libraries["triton"] == "installed (no version)"
    drifts = cd.lock.compare(_plan([RTX3080], ops=["kv_dequant"]), lk)          # triton==3.9.0 assumed
    triton = [(d.locked, d.now) for d in drifts if d.locked.startswith("triton")]
    assert triton == [("triton installed (no version)", "triton 3.9.0")]
    absent = cd.lock.compare(_plan([RTX3080], ops=["kv_dequant"], assume_libs=["torch==2.14.1"], libs="local"), lk)
    assert not any("triton not installed" in d.locked for d in absent)
    assert cd.lock.compare(cd.plan([RTX3080], ops=["kv_dequant"], log_warnings=False), lk) == ()


def test_card_drift(env, tmp_path):
    """Same id, another card: the card line, then each backend that changed with it."""
    was = probe(H200).with_id("cuda:0")
    now = probe(RTX5090).with_id("cuda:0")
    lk = cd.lock.freeze(_plan([was], ops=["indexer", "kv_dequant"]))
    drifts = cd.lock.compare(_plan([now], ops=["indexer", "kv_dequant"]), lk)
    kinds = [(d.kind, d.op) for d in drifts]
    assert kinds == [("card", None), ("backend", "indexer")], drifts
    assert drifts[0].locked == "NVIDIA H200 cc 9.0" and drifts[0].now.startswith("NVIDIA GeForce RTX 5090 cc 12.0")
    # A UUID that differs is a different card even with the same name.
    path = tmp_path / "l.lock"
    lk.write(path)
    path.write_text(path.read_text().replace("uuid: null", "uuid: GPU-1111"))
    same = attrs_evolve(was, uuid="GPU-2222")
    drifts = cd.lock.compare(_plan([same], ops=["indexer", "kv_dequant"]), cd.lock.load(path))
    assert [d.kind for d in drifts] == ["card"] and "GPU-1111" in drifts[0].locked


def attrs_evolve(spec, **kw):
    import attrs
    return attrs.evolve(spec, **kw)


def test_size_buckets_are_locked_and_compared(env, tmp_path):
    pol = tmp_path / "buckets.yaml"
    pol.write_text('ops:\n  decode_mla:\n    - {tokens: "<=16", prefer: [triton_fp8, flashmla]}\n'
                   '    - {prefer: [flashmla, triton_fp8]}\n')
    libs = ASSUME + ["sgl-flash-mla==1.0.0"]
    p = _plan([H200], ops=["decode_mla"], policy=[str(pol)], assume_libs=libs)
    lk = cd.lock.freeze(p)
    path = tmp_path / "capdispatch.lock"
    lk.write(path)
    back = cd.lock.load(path)
    assert back.device(H200).ops["decode_mla"].buckets == ((16, "triton_fp8"), (None, "flashmla"))
    assert set(back.device(H200).ops["decode_mla"].libraries) == {"torch", "sgl-flash-mla", "triton"}
    assert cd.lock.compare(p, back) == ()
    (d,) = cd.lock.compare(_plan([H200], ops=["decode_mla"], assume_libs=libs), back)
    assert (d.kind, d.locked, d.now) == ("buckets", "tokens <= 16: triton_fp8, rest: flashmla", "no buckets")


def test_device_and_op_drift_and_partial(env):
    lk = cd.lock.freeze(_plan([H200, RTX3080], ops=["indexer", "kv_dequant"]))
    drifts = cd.lock.compare(_plan([H200], ops=["indexer"]), lk)
    assert sorted((d.kind, d.device, d.op) for d in drifts) == \
        [("device", RTX3080, None), ("op", H200, "kv_dequant")]
    # One rank of the group, deciding some ops: what it does not decide is no difference.
    assert cd.lock.compare(_plan([H200], ops=["indexer"]), lk, partial=True) == ()
    drifts = cd.lock.compare(_plan([RTX5090], ops=["indexer"]), lk, partial=True)
    assert [(d.kind, d.device) for d in drifts] == [("device", RTX5090)]


# --------------------------------------------------------------------------- #
# Malformed lock files: file:line, exit 2
# --------------------------------------------------------------------------- #
_GOOD = """\
schema: 1
devices:
- id: sim:h200
  name: NVIDIA H200
  cc: '9.0'
  ops:
    indexer:
      backend: deepgemm
      libraries: {torch: 2.13.0}
"""

_BAD = [
    ("yaml", _GOOD.replace("  ops:\n", "  ops: [\n"), 8, "malformed YAML"),
    ("schema", _GOOD.replace("schema: 1", "schema: 2"), 1, "schema 2 is not supported"),
    ("schema type", _GOOD.replace("schema: 1", "schema: true"), 1, "schema must be an integer, found True"),
    ("top key", _GOOD + "devics: []\n", 10, "unknown key 'devics'; did you mean 'devices'?"),
    ("missing", "schema: 1\n", 1, "missing 'devices'"),
    ("device key", _GOOD.replace("  cc:", "  ccc:"), 5, "unknown key 'ccc'"),
    ("backend", _GOOD.replace("backend: deepgemm", "backend: deepgem"), 8,
     "unknown backend 'deepgem'; did you mean 'deepgemm'?"),
    ("op", _GOOD.replace("    indexer:", "    indexr:"), 7, "unknown op 'indexr'"),
    ("list", _GOOD.split("  ops:")[0] + "  ops: [indexer]\n", 6, "ops must be a mapping, not a list"),
    ("tag", _GOOD.replace("name: NVIDIA H200", "name: !!python/name:os.system ''"), 4, "is not allowed"),
    ("seq tag", _GOOD.replace("cc: '9.0'", "cc: !!seq x"), 5, "cc: !!seq 'x' is not a YAML seq"),
    ("map tag", _GOOD.replace("libraries: {torch: 2.13.0}", "libraries: !!map x"), 9,
     "libraries: !!map 'x' is not a YAML map (valid for !!map: a mapping"),
    ("twice", _GOOD + _GOOD.split("devices:\n")[1], 10, "listed twice (first at line 3)"),
    ("bucket", _GOOD + "      buckets:\n      - {upper: '16', backend: triton}\n", 11,
     "bucket upper must be an integer or null, found '16'"),
]


@pytest.mark.parametrize("name,text,line,needle", _BAD, ids=[b[0] for b in _BAD])
def test_malformed_lock_names_file_and_line(env, tmp_path, name, text, line, needle):
    path = tmp_path / "bad.lock"
    path.write_text(text)
    with pytest.raises(cd.LockError) as ei:
        cd.lock.load(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path}:{line}: ") and "\n" not in msg, msg
    assert needle in msg, msg
    assert isinstance(ei.value, cd.BadInput)


def test_write_where_it_cannot_is_bad_input(env, tmp_path):
    lk = cd.lock.freeze(_plan([H200], ops=["indexer"]))
    with pytest.raises(cd.BadInput, match=r"cannot write the lock .*nowhere/x\.lock"):
        lk.write(tmp_path / "nowhere" / "x.lock")


def test_good_text_parses(env, tmp_path):
    path = tmp_path / "good.lock"
    path.write_text(_GOOD)
    lk = cd.lock.load(path)
    assert lk.device(H200).ops["indexer"].libraries == {"torch": "2.13.0"}
    assert lk.device(H200).ops["indexer"].verified == "not verified"


def test_cli_malformed_and_missing_exit_2(run_cli, tmp_path):
    path = tmp_path / "bad.lock"
    path.write_text(dict((b[0], b[1]) for b in _BAD)["backend"])
    rc, _, err = run_cli("lock", "--check", str(path))
    assert rc == 2 and f"{path}:8: " in err and "Traceback" not in err, err
    rc, _, err = run_cli("explain", "--device", H200, "--lock", str(tmp_path / "nope.lock"))
    assert rc == 2 and "no such lock file" in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- #
# CAPDISPATCH_LOCK, strict, explain
# --------------------------------------------------------------------------- #
def test_env_lock_read_at_call_time(env, tmp_path, caplog):
    path = tmp_path / "capdispatch.lock"
    cd.lock.freeze(_plan([RTX5090], ops=["indexer"])).write(path)
    p = _plan([RTX5090], ops=["indexer"], selections={"indexer": "triton"})
    assert cd.lock.check(p) == ()                   # no lock named: nothing to compare
    env.setenv("CAPDISPATCH_LOCK", str(path))       # set after import and after planning
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        drifts = cd.lock.check(p)
    assert [d.kind for d in drifts] == ["backend"]
    assert [r.getMessage() for r in caplog.records if "lock drift" in r.getMessage()] == [str(drifts[0])]
    env.setenv("CAPDISPATCH_STRICT", "1")
    with pytest.raises(cd.LockDriftError) as ei:
        cd.lock.check(p)
    assert isinstance(ei.value, cd.Unsatisfiable) and str(drifts[0]) in str(ei.value)


def test_explain_with_lock_warns_and_strict_exits_3(run_cli, tmp_path):
    f = str(tmp_path / "capdispatch.lock")
    libs = sum((["--assume-lib", a] for a in ASSUME), [])
    assert run_cli("lock", "--device", RTX5090, "--op", "indexer", *libs, "-o", f)[0] == 0
    base = ["explain", "--device", RTX5090, "--op", "indexer", "--set", "indexer=triton", *libs]
    rc, out, err = run_cli(*base, "--format", "json", env={"CAPDISPATCH_LOCK": f})
    assert rc == 0, err
    assert len(_drift_lines(err)) == 1 and "backend was tilelang" in err
    doc = json.loads(out)
    assert doc["ops"]["indexer"]["per_device"][RTX5090]["backend"] == "triton"
    assert [w for w in doc["warnings"] if "lock drift" in w] == [_drift_lines(err)[0].split("capdispatch: ", 1)[1]]
    rc, _, err = run_cli(*base, "--lock", f, "--strict")
    assert rc == 3 and "strict: 1 difference(s) from the lock" in err, err


# --------------------------------------------------------------------------- #
# Verification state, from the verification cache
# --------------------------------------------------------------------------- #
def test_verification_state_from_the_cache(env, tmp_path):
    from capdispatch import proof
    env.setenv("CAPDISPATCH_CACHE_DIR", str(tmp_path / "cache"))
    env.setenv("TRITON_INTERPRET", "1")
    sel = {"kv_dequant": "torch", "kv_quant": "torch"}
    p = cd.plan(["cpu"], ["kv_dequant", "kv_quant"], selections=sel, log_warnings=False)
    spec = p.devices[0]
    proof.store(spec, "torch", proof.Verdict("kv_dequant", "torch", spec.id, "pass"))
    proof.store(spec, "torch", proof.Verdict("kv_quant", "torch", spec.id, "mismatch", max_err=0.5,
                                             where="pool[3, 17]"))
    ops = cd.lock.freeze(p).device("cpu").ops
    assert ops["kv_dequant"].verified == "pass"
    assert ops["kv_quant"].verified.startswith("failed: mismatch") and "pool[3, 17]" in ops["kv_quant"].verified
    env.setenv("CAPDISPATCH_CACHE_DIR", str(tmp_path / "empty"))
    assert cd.lock.freeze(p).device("cpu").ops["kv_dequant"].verified == "not verified"


# --------------------------------------------------------------------------- #
# The SGLang plugin's per-rank check
# --------------------------------------------------------------------------- #
def test_sglang_rank_checks_its_own_card_only(env, tmp_path, caplog):
    from capdispatch.adapters.sglang import rank
    path = tmp_path / "capdispatch.lock"
    gpu0, gpu1 = probe(H200).with_id("cuda:0"), probe(RTX3080).with_id("cuda:1")
    cd.lock.freeze(_plan([gpu0, gpu1], ops=["indexer", "kv_dequant"])).write(path)
    env.setenv("CAPDISPATCH_LOCK", str(path))
    same = types.SimpleNamespace(plan=_plan([gpu1], ops=["indexer"]))
    assert rank.check_lock(same) == ()
    moved = types.SimpleNamespace(plan=_plan([gpu1], ops=["indexer"], selections={"indexer": "torch"}))
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        drifts = rank.check_lock(moved)
    assert [(d.kind, d.device, d.locked, d.now) for d in drifts] == [("backend", "cuda:1", "triton", "torch")]
    assert rank.check_lock(types.SimpleNamespace(plan=None)) == ()
    env.setenv("CAPDISPATCH_STRICT", "1")
    with pytest.raises(cd.LockDriftError):
        rank.check_lock(moved)


def test_importing_capdispatch_reads_no_lock(env, tmp_path):
    """The lock is read when a decision is checked, never at import: a broken lock named in
    the environment does not break `import capdispatch` or planning without a check."""
    import subprocess
    import sys
    bad = tmp_path / "bad.lock"
    bad.write_text("schema: 1\ndevices: [\n")
    code = ("import capdispatch as cd; p = cd.plan(['sim:h200'], ['indexer'], log_warnings=False);"
            "\ntry:\n    cd.lock.check(p)\nexcept cd.LockError as e:\n    print('LOCKERROR', e)")
    e = dict(os.environ, CAPDISPATCH_LOCK=str(bad), PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"LOCKERROR {bad}:3: malformed YAML" in out.stdout, out.stdout + out.stderr


def test_verify_compares_its_decisions_with_the_lock(env, tmp_path):
    """`dispatch verify --lock FILE`: after the canaries, the decisions are made again and
    compared (the run of the canaries themselves is tests/ of `dispatch verify`)."""
    from capdispatch.dispatch.lock import check_after_verify
    path = tmp_path / "capdispatch.lock"
    cd.lock.freeze(_plan([RTX5090], ops=["indexer"])).write(path)
    args = types.SimpleNamespace(lock=str(path), policy=[], set_=["indexer=triton"], op=["indexer"])
    drifts = check_after_verify([probe(RTX5090)], ["indexer"], args)
    assert [(d.kind, d.locked, d.now) for d in drifts] == [("backend", "tilelang", "triton")]
    assert check_after_verify([probe(RTX5090)], ["indexer"], types.SimpleNamespace(
        lock=None, policy=[], set_=[], op=[])) == ()
    env.setenv("CAPDISPATCH_STRICT", "1")
    with pytest.raises(cd.LockDriftError):
        check_after_verify([probe(RTX5090)], ["indexer"], args)
