"""Canaries, the verification cache and the resolver's canary check (CPU).

Backends that break the way real kernels break on a card come from a test plugin
package (tests/plugins/good: a dist-info with a `capdispatch.backends` entry point):
a Triton compile of fp8e4nv for sm_86 (Triton's real refusal), one wrong element in a
thousand, a hang, an abort. Each runs in its own child process; each is recorded with
its class, the next backend wins, and a second process reads the verdicts.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import capdispatch as cd
from capdispatch import proof
from capdispatch.backends import build
from capdispatch.backends.canary_checks import Mismatch
from capdispatch.dispatch import verify as V
from capdispatch.dispatch.resolver import context, resolve_in
from capdispatch.policies import PolicyError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOOD = os.path.join(HERE, "plugins", "good")
BROKEN = os.path.join(HERE, "plugins", "broken")
PLUGS = ("plug_fp8e4nv", "plug_wrong", "plug_hang", "plug_abort")


def _env(tmp_path, *paths) -> dict:
    env = dict(os.environ)
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", "TRITON_INTERPRET"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    env["CAPDISPATCH_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def _policy(tmp_path, body: str) -> str:
    p = tmp_path / "policy.yaml"
    p.write_text(textwrap.dedent(body))
    return str(p)


@pytest.fixture
def plugin_registry(monkeypatch):
    monkeypatch.syspath_prepend(GOOD)
    reg = build()
    assert [p.name for p in reg.plugins if p.ok] == ["testplugin"], reg.plugins
    return reg


def test_broken_plugins_break_nothing_and_are_named(tmp_path):
    env = _env(tmp_path, GOOD, BROKEN)
    p = subprocess.run([sys.executable, "-m", "capdispatch", "ops", "--format", "json"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    plugins = {x["name"]: x for x in obj["plugins"]}
    why = {n: x["message"] for n, x in plugins.items() if not x["ok"]}
    assert "unknown feature 'warp_drive'" in why["bad_feature"]
    assert "kv_dequant/torch: name already registered" in why["duplicate"]
    assert "unknown op 'flash_attention'" in why["unknown_op"]
    assert "register() raised RuntimeError" in why["raises"]
    assert "ModuleNotFoundError" in why["missing_module"]
    assert "import failed" in why["not_callable"]
    assert plugins["testplugin"]["ok"] and len(plugins["testplugin"]["backends"]) == 4
    for name in why:
        assert f"plugin '{name}'" in p.stderr and "skipped" in p.stderr
    names = [b["name"] for b in obj["ops"]["kv_dequant"]["backends"]]
    # default.yaml's list, then the backends it does not name (the plugin's) by name.
    assert names == ["triton_fp8", "triton_u8", "torch", *sorted(PLUGS)]
    # The duplicate plugin's backend did not replace the built-in one.
    torch_b = next(b for b in obj["ops"]["kv_dequant"]["backends"] if b["name"] == "torch")
    assert torch_b["impl"] == "capdispatch.backends.kv_cache.reference:op_kv_dequant"


def test_broken_kernels_are_caught_and_replaced(tmp_path, plugin_registry, caplog):
    env = _env(tmp_path, GOOD)
    pol = _policy(tmp_path, f"ops:\n  kv_dequant: [{', '.join(PLUGS)}, torch]\n")
    ctx = context(policy=pol, registry=plugin_registry, env=env)
    cpu = cd.probe("cpu")
    jobs = {n: V.Job(cpu, "kv_dequant", n) for n in (*PLUGS, "torch")}
    with ThreadPoolExecutor(2) as ex:
        hang = ex.submit(V.run, ctx, [jobs["plug_hang"]], timeout=3)
        rest = ex.submit(V.run, ctx, [jobs[n] for n in ("plug_fp8e4nv", "plug_wrong", "plug_abort", "torch")],
                         timeout=120, workers=4)
        results = {r.job.backend: r.verdict for r in hang.result() + rest.result()}
    v = results["plug_fp8e4nv"]
    assert v.outcome == "compile", v
    assert "fp8e4nv not supported in this architecture" in v.detail
    v = results["plug_wrong"]
    assert v.outcome == "mismatch" and v.max_err and v.max_err > 0 and "[" in v.where, v
    assert results["plug_hang"].outcome == "timeout", results["plug_hang"]
    assert results["plug_abort"].outcome == "crash" and "SIGABRT" in results["plug_abort"].detail
    assert results["torch"].passed, results["torch"]
    for name, verdict in results.items():
        assert proof.lookup(cpu, "kv_dequant", name, registry=plugin_registry, env=env) == verdict

    # This process decides with the verdicts: each broken one rejected by a canary check.
    fresh = context(policy=pol, registry=plugin_registry, env=env)
    res = resolve_in(fresh, "kv_dequant", cpu)
    assert res.backend == "torch" and res.downgraded_from == "plug_fp8e4nv"
    by = {c.backend: c for c in res.candidates}
    for name in PLUGS:
        canary = [ch for ch in by[name].checks if ch.code == "canary"]
        assert canary and not canary[0].ok and canary[0].need.startswith("pass")
        assert canary[0].found.startswith(results[name].outcome), canary
        assert by[name].verification == "failed"
    assert by["torch"].verification == "verified"
    assert any("plug_wrong failed its canary on this card (mismatch" in w for w in res.warnings)

    # A second process reads them.
    p = subprocess.run([sys.executable, "-m", "capdispatch", "explain", "--device", "cpu", "--op", "kv_dequant",
                        "--policy", pol, "--format", "json"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    row = json.loads(p.stdout)["ops"]["kv_dequant"]["per_device"]["cpu"]
    assert row["backend"] == "torch"
    marks = {c["backend"]: c.get("verification") for c in row["candidates"]}
    assert marks == {**{n: "failed" for n in PLUGS}, "torch": "verified", "triton_fp8": "not verified",
                     "triton_u8": "not verified"}
    assert "plug_abort failed its canary on this card (crash" in p.stderr


def test_verify_command(tmp_path):
    """A Triton kernel under the interpreter passes its canary; the verdict is cached for
    the interpreter only."""
    env = {**_env(tmp_path), "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-m", "capdispatch", "verify", "--device", "cpu", "--op", "kv_dequant",
                        "--backend", "triton_u8", "--format", "json"], env=env, capture_output=True, text=True,
                       timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["passed"] and [r["verdict"]["outcome"] for r in obj["results"]] == ["pass"]
    assert obj["results"][0]["verdict"]["seed"] is not None
    assert proof.lookup(cd.probe("cpu"), "kv_dequant", "triton_u8", env=env).passed
    assert proof.lookup(cd.probe("cpu"), "kv_dequant", "triton_u8", env=_env(tmp_path)) is None
    for bad, msg in ((["--device", "sim:h200"], "simulated"), (["--op", "kv_dequant", "--backend", "nope"], "nope")):
        p = subprocess.run([sys.executable, "-m", "capdispatch", "verify", *bad], env=env, capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr


def _verdict(op, backend, outcome="pass", **kw):
    return proof.Verdict(op=op, backend=backend, device="cpu", outcome=outcome, **kw)


def test_cache_corrupt_and_foreign_files_are_not_trusted(tmp_path, caplog):
    env = _env(tmp_path)
    cpu = cd.probe("cpu")
    path = proof.store(cpu, "torch", _verdict("kv_dequant", "torch"), env=env)
    assert proof.lookup(cpu, "kv_dequant", "torch", env=env).passed
    good = path.read_text()
    cases = {
        "torn": good[: len(good) // 2],
        "binary": "\x00\xff garbage",
        "schema": json.dumps({**json.loads(good), "schema": 99}),
        "foreign": json.dumps({**json.loads(good), "card": {**json.loads(good)["card"], "name": "other"}}),
        "verdict": json.dumps({**json.loads(good), "verdict": {"outcome": "maybe"}}),
        "list": "[1, 2]",
    }
    for what, text in cases.items():
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="capdispatch"):
            assert proof.lookup(cpu, "kv_dequant", "torch", env=env) is None, what
            # fail closed: a verdict that cannot be trusted rejects its backend until verified again
            with pytest.raises(cd.NoBackendError, match="its cached verdict cannot be trusted"):
                cd.resolve("kv_dequant", "cpu", env=env)
        warned = [r.getMessage() for r in caplog.records if "ignoring verification cache file" in r.getMessage()]
        assert warned and str(path) in warned[0], (what, caplog.text)
    # An unreadable directory entry (a directory named like a verdict) is skipped too.
    path.unlink()
    path.mkdir()
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert proof.lookup(cpu, "kv_dequant", "torch", env=env) is None


def test_unwritable_cache_warns_and_keeps_the_verdict_in_memory(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    env = {**_env(tmp_path), "CAPDISPATCH_CACHE_DIR": str(blocker)}
    card = proof.open_card(cd.probe("cpu"), env=env)
    b = cd.dispatch.resolver.builtin().backend("kv_dequant", "torch")
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert card.put(b, _verdict("kv_dequant", "torch")) is None
    assert "cannot be written" in caplog.text and card.get(b).passed
    assert proof.lookup(cd.probe("cpu"), "kv_dequant", "torch", env=env) is None


def test_cache_key_separates_software_and_cards(tmp_path):
    env = _env(tmp_path)
    cpu = cd.probe("cpu")
    proof.store(cpu, "torch", _verdict("kv_dequant", "torch", "runtime", detail="boom"), env=env)
    assert not proof.lookup(cpu, "kv_dequant", "torch", env=env).passed
    # Another torch version is another key; so is the interpreter on the CPU.
    other = cd.capabilities.Inventory.with_assumptions(["torch==9.9.9"])
    assert proof.lookup(cpu, "kv_dequant", "torch", env=env, inventory=other) is None
    assert proof.lookup(cpu, "kv_dequant", "torch", env={**env, "TRITON_INTERPRET": "1"}) is None
    # Simulated devices never read it.
    sim = cd.probe("sim:h200")
    assert proof.lookup(sim, "kv_dequant", "torch", env=env) is None
    res = cd.resolve("kv_dequant", "sim:h200", env=env)
    assert all(ch.code != "canary" for c in res.candidates for ch in c.checks)
    assert proof.clear(env)[0].name == "verify" and proof.lookup(cpu, "kv_dequant", "torch", env=env) is None


_WRITER = """
import sys
import capdispatch as cd
from capdispatch import proof
cpu = cd.probe("cpu")
for i in range(int(sys.argv[1])):
    v = proof.Verdict(op="kv_dequant", backend="torch", device="cpu", outcome="pass",
                      detail="x" * 20000, seed=i)
    proof.store(cpu, "torch", v)
    got = proof.lookup(cpu, "kv_dequant", "torch")
    assert got is not None and got.passed, got
"""


def test_two_processes_writing_at_once(tmp_path, caplog):
    env = _env(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, "80"], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    assert not any("ignoring verification cache file" in e for e in errs), errs
    files = list((tmp_path / "cache").rglob("*"))
    assert [f.name for f in files if f.is_file() and f.suffix != ".json"] == ["key"]   # the secret only
    assert proof.lookup(cd.probe("cpu"), "kv_dequant", "torch", env=env).passed


def test_policy_verify_setting(tmp_path):
    env = _env(tmp_path)
    cpu = cd.probe("cpu")
    required = _policy(tmp_path, "verify: required\n")
    with pytest.raises(cd.NoBackendError) as err:
        cd.resolve("kv_dequant", "cpu", policy=required, env=env)
    assert "has not passed its canary on this card (verify: required" in str(err.value)
    proof.store(cpu, "torch", _verdict("kv_dequant", "torch"), env=env)
    assert cd.resolve("kv_dequant", "cpu", policy=required, env=env).backend == "torch"
    proof.store(cpu, "torch", _verdict("kv_dequant", "torch", "crash", detail="killed by SIGSEGV"), env=env)
    with pytest.raises(cd.NoBackendError):
        cd.resolve("kv_dequant", "cpu", env=env)
    off = _policy(tmp_path, "verify: off\n")       # a bare YAML `off`
    res = cd.resolve("kv_dequant", "cpu", policy=off, env=env)
    assert res.backend == "torch" and all(ch.code != "canary" for c in res.candidates for ch in c.checks)
    bad = _policy(tmp_path, "schema: 1\nverify: sometimes\n")
    with pytest.raises(PolicyError) as err:
        cd.resolve("kv_dequant", "cpu", policy=bad, env=env)
    assert f"{bad}:2" in str(err.value) and "off, warn, required" in str(err.value)


def test_verify_decisions_uses_the_cache_and_the_budget(tmp_path):
    env = _env(tmp_path)
    cpu = cd.probe("cpu")
    proof.store(cpu, "torch", _verdict("kv_dequant", "torch"), env=env)
    proof.store(cpu, "torch", _verdict("kv_quant", "torch", "mismatch", max_err=3.0, where="pool[0, 1]"), env=env)
    v = cd.verify_decisions(cpu, {"kv_dequant": "torch", "kv_quant": "torch", "moe": "torch"}, budget_s=0, env=env)
    assert [r.cached for r in v.results] == [True, True, False]
    assert [r.job.op for r in v.failed] == ["kv_quant"] and [r.job.op for r in v.unverified] == ["moe"]
    text = v.describe({"kv_quant": "triton_u8"})
    assert "verified on this card: kv_dequant=torch (cached)" in text
    assert "kv_quant=torch failed its canary on this card (mismatch: max error 3 at pool[0, 1])" in text
    assert "replaced by triton_u8" in text and "not verified within the time budget: moe=torch" in text
    sim = cd.verify_decisions(cd.probe("sim:h200"), {"kv_dequant": "torch"}, env=env)
    assert sim.results == () and "simulated" in sim.describe()


def test_sglang_rank_decides_again_after_a_failed_canary(tmp_path, caplog):
    from capdispatch.adapters.sglang import proof as rank_proof
    env = _env(tmp_path)
    cpu = cd.probe("cpu")
    seen = []

    class Choice:
        def __init__(self, backend):
            self.backend = backend
            self.resolution = None      # no Resolution: no kernel SGLang runs itself

    class Decision:
        def __init__(self, backend):
            self.choices = {"kv_dequant": {"cpu": Choice(backend)}}

    def decide(e):
        """torch first; once its verdict is cached as failed, triton_u8 (as the resolver does)."""
        seen.append(e.get("CAPDISPATCH_VERIFY"))
        v = proof.lookup(cpu, "kv_dequant", "torch", env=env)
        return Decision("triton_u8" if len(seen) > 1 and v is not None and not v.passed else "torch")

    proof.store(cpu, "torch", _verdict("kv_dequant", "torch", "compile", detail="x\nfp8e4nv not supported"), env=env)
    with caplog.at_level(logging.WARNING, logger="capdispatch.sglang"):
        d, text = rank_proof.verified(cpu, decide, env=env, budget_s=0)
    assert d.choices["kv_dequant"]["cpu"].backend == "triton_u8"
    assert seen[0] == "warn" and seen[-1] is None       # trial decisions as `warn`, the last as configured
    assert ("kv_dequant=torch failed its canary on this card (compile: fp8e4nv not supported), replaced by "
            "triton_u8; not verified within the time budget: kv_dequant=triton_u8") == text
    assert "kv_dequant=torch failed its canary on this card" in caplog.text and "running triton_u8" in caplog.text
    proof.store(cpu, "torch", _verdict("kv_dequant", "torch"), env=env)
    seen.clear()
    d, text = rank_proof.verified(cpu, decide, env=env)
    assert text == "verified on this card: kv_dequant=torch" and d.choices["kv_dequant"]["cpu"].backend == "torch"
    d, text = rank_proof.verified(cd.probe("sim:h200"), decide, env=env)
    assert text is None


def test_verify_env_override(tmp_path):
    env = {**_env(tmp_path), "CAPDISPATCH_VERIFY": "required"}
    with pytest.raises(cd.NoBackendError):
        cd.resolve("kv_dequant", "cpu", env=env)
    with pytest.raises(cd.BadInput) as err:
        cd.resolve("kv_dequant", "cpu", env={**env, "CAPDISPATCH_VERIFY": "sure"})
    assert "valid: off, warn, required" in str(err.value)


@pytest.mark.gpu
def test_gpu_every_runnable_backend_passes_its_canary_on_cuda0(tmp_path):
    """On a CUDA machine: every candidate whose requirements hold on cuda:0 passes."""
    env = _env(tmp_path)
    p = subprocess.run([sys.executable, "-m", "capdispatch", "verify", "--device", "cuda:0", "--all",
                        "--format", "json"], env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    obj = json.loads(p.stdout)
    bad = [(r["op"], r["backend"], r["verdict"]) for r in obj["results"] if r["verdict"]["outcome"] != "pass"]
    assert p.returncode == 0 and not bad, bad


# Each op's canary on its torch reference, and on the reference with one element wrong
# or one element never written: in process (the canaries themselves, no child).
def _corrupt(t):
    flat = t.view(-1)
    finite = torch.isfinite(flat.float()).nonzero().flatten()
    i = int(finite[len(finite) * 7 // 13])          # a finite element (a NaN stays NaN)
    v = flat.float()[finite].abs().amax()
    flat[i] = (flat[i].float() + 0.5 * v + 1.0).to(t.dtype)


CANARY_OPS = list(build(plugins=False).ops)     # every built-in op declares a canary


@pytest.mark.parametrize("op", CANARY_OPS)
def test_each_canary_passes_the_reference_and_catches_one_wrong_element(op):
    import random
    reg = cd.dispatch.resolver.builtin()
    canary = reg.ops[op].load_canary()
    ref = reg.backend(op, "torch").load()
    seed = random.SystemRandom().randrange(2**31)
    report = canary(ref, torch.device("cpu"), seed, "torch")
    assert report["tolerance"] and report["checked"] > 0

    def wrong(*args, **kwargs):
        res = ref(*args, **kwargs)
        if op == "kv_quant":
            _corrupt_written_byte(args[1], args[2], args[3])
            return res
        _corrupt(res[0] if isinstance(res, tuple) else res)
        return res

    def lazy(*args, **kwargs):
        out = kwargs.get("out")
        if op == "kv_quant":                   # one written byte left as the pool's poison
            k, pool, loc, ps = args
            tmp = pool.clone()
            ref(k, tmp, loc, ps)
            changed = (tmp != pool).view(-1).nonzero().flatten()
            tmp.view(-1)[changed[len(changed) // 2]] = pool.view(-1)[changed[len(changed) // 2]]
            pool.copy_(tmp)
            return None
        if out is None:
            return wrong(*args, **kwargs)
        kwargs = dict(kwargs, out=None)
        res = ref(*args, **kwargs)
        full = res[0] if isinstance(res, tuple) else res
        keep = out.view(-1)[5].clone()
        out.copy_(full)
        out.view(-1)[5] = keep                 # one element left as the caller's poison
        return (out,) + tuple(res[1:]) if isinstance(res, tuple) else out

    for fn in (wrong, lazy):
        with pytest.raises(Mismatch) as err:
            canary(fn, torch.device("cpu"), seed, "torch")
        assert err.value.where and err.value.tolerance, (op, fn.__name__, str(err.value))


def _corrupt_written_byte(pool, loc, page_size):
    from capdispatch.backends import v4_layout as L
    t = int(loc[len(loc) // 2])
    pool.view(torch.uint8)[t // page_size, (t % page_size) * L.DATA_BYTES + 3] ^= 0x10


def test_required_warns_only_for_backends_that_would_run_but_for_their_canary(tmp_path):
    # On the CPU (no TRITON_INTERPRET) the Triton backends cannot run at all: their missing
    # canary is no news. Under the interpreter they could, and the warning says so.
    env = {k: v for k, v in _env(tmp_path).items() if k != "TRITON_INTERPRET"}
    env["CAPDISPATCH_VERIFY"] = "required"
    cpu = cd.probe("cpu")
    proof.store(cpu, "torch", _verdict("kv_dequant", "torch"), env=env)
    r = cd.resolve("kv_dequant", "cpu", env=env)
    assert r.backend == "torch" and r.warnings == ()
    interp = dict(env, TRITON_INTERPRET="1")
    proof.store(cpu, "torch", _verdict("kv_dequant", "torch"), env=interp)
    r = cd.resolve("kv_dequant", "cpu", env=interp)
    assert r.backend == "torch"
    assert any("kv_dequant=triton_u8 has not passed its canary on this card" in w for w in r.warnings)
    assert not any("triton_fp8" in w for w in r.warnings)    # the CPU lacks fp8 anyway
