"""The compile matrix (capdispatch/backends/compile_matrix.py) in CI: every (kernel,
variant) a target's policy can choose compiles offline for its tightest target and fits
its shared memory; the checker itself flags the fp8e4nv failure and an oversized tile."""
import json
import os
import subprocess
import sys

import pytest

from capdispatch.backends import compile_matrix as M

sys.path.insert(0, os.path.dirname(__file__))
# The tests here read the kernel modules' tables in this process (jobs_for imports them);
# under the fixture they are imported the way every other CPU test imports them (for the
# interpreter), so a later test never inherits compiled kernels from this file. The
# compiles themselves run in a fresh process without TRITON_INTERPRET.
from triton_env import _triton_interpreter  # noqa: E402,F401 (autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import attrs
from capdispatch.backends import compile_matrix as M

def emit(tag, row):
    print(json.dumps(dict(attrs.asdict(row), ok=row.ok, tag=tag)), flush=True)

for row in M.run(cover=True):
    emit("cover", row)
sm86, sm89, sm90 = M.target("sm_86"), M.target("sm_89"), M.target("sm_90")
# Forced onto sm_86, which its policy never gives them: the native-fp8 codec and the H200's tile.
fp8 = next(j for j in M.jobs_for(sm89) if j.op == "kv_cache" and j.variant == "fp8")
emit("fp8_on_sm86", M.compile_job(fp8, sm86))
big = next(j for j in M.jobs_for(sm90) if j.op == "sparse_prefill")
emit("big_tile_on_sm86", M.compile_job(big, sm86))
"""


@pytest.fixture(scope="module")
def rows():
    """One fresh process without TRITON_INTERPRET compiles each (kernel, variant, target) once."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=1800)
    if p.returncode != 0 and "ptxas" in p.stderr.lower() and "not found" in p.stderr.lower():
        pytest.skip("Triton's bundled ptxas is not available here")
    assert p.returncode == 0, p.stderr[-3000:]
    out = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert out, p.stderr[-3000:]
    return out


def _keys(t):
    return {j.key for j in M.jobs_for(t)}


def test_policy_variants_follow_the_fp8_feature_and_the_tables():
    """No native-fp8 variant below cc 8.9; the H200's measured tiles only on sm_90; the
    limits are the catalog's opt-in shared memory."""
    ts = {k: M.target(k) for k in M.TARGETS}
    assert {k: t.smem for k, t in ts.items()} == {
        "sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_100": 232448, "sm_120": 101376}
    for k, t in ts.items():
        fp8 = [j for j in M.jobs_for(t) if "fp8" in j.variant.split()]
        assert bool(fp8) == (t.cc >= (8, 9)), (k, [j.variant for j in fp8])
        big = [j for j in M.jobs_for(t) if "h64n64" in j.variant]
        assert bool(big) == (k == "sm_90"), k
    assert [t.arch for t in ts.values()] == ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a"]


def test_covering_set_covers_every_kernel_variant():
    every = set().union(*(_keys(M.target(k)) for k in M.TARGETS))
    cover = M.covering_set()
    assert {j.key for _, j in cover} == every
    for t, j in cover:   # each on the tightest target that can choose it
        for k in M.TARGETS:
            other = M.target(k)
            if j.key in _keys(other):
                assert (t.smem, t.number) <= (other.smem, other.number), (j.key, t.key, k)
    # Every op that declares compile jobs (Op.compile_jobs) has its kernels in the cover.
    from capdispatch.backends import builtin
    declared = [op for op in builtin().ops.values() if op.compile_jobs]
    assert declared
    want = {j.op for op in declared for k in M.TARGETS for j in op.load_compile_jobs()(M.target(k))}
    assert {j.op for _, j in cover} == want


def test_every_choosable_kernel_compiles_and_fits(rows):
    cover = [r for r in rows if r["tag"] == "cover"]
    assert len(cover) == len(M.covering_set())
    bad = [f"{r['target']} {r['kernel']} {r['variant']}: {r['error'] or 'smem %s > %s' % (r['smem'], r['limit'])}"
           for r in cover if not r["ok"]]
    assert not bad, "\n".join(bad)
    for r in cover:
        assert r["regs"] is not None and 0 < r["regs"] <= 255, r
        assert r["spills"] is not None, r


def test_checker_flags_fp8_forced_onto_sm86(rows):
    r = next(r for r in rows if r["tag"] == "fp8_on_sm86")
    assert not r["ok"] and "fp8e4nv" in r["error"], r


def test_checker_flags_an_oversized_tile_on_sm86(rows):
    r = next(r for r in rows if r["tag"] == "big_tile_on_sm86")
    assert r["error"] is None and r["smem"] > r["limit"] == 101376 and not r["ok"], r
