"""The CPU-side benchmark tools: the import probe and the offline SASS counter."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _run(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), BENCH, ROOT]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_probe_lists_every_missing_module_of_a_chain(tmp_path):
    """A chain that needs three absent modules, one through `from x.y import Name`, one as a
    base class with keywords, one iterated and used as a decorator: all three are listed in
    one run and the target then imports."""
    pkg = tmp_path / "chainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(textwrap.dedent("""
        from absent_one.sub import Thing
        import absent_two
        from chainpkg import b

        class S(absent_two.Struct, frozen=True):
            pass

        X = [t for t in Thing.members]
    """))
    (pkg / "b.py").write_text(textwrap.dedent("""
        import absent_three

        @absent_three.register
        def f():
            return 1

        assert f() == 1
    """))
    out = _run("""
        import probe_imports as P
        miss, how = P.probe("chainpkg.a")
        print(how)
        print(" ".join(miss))
    """, tmp_path)
    how, miss = out.strip().split("\n")
    assert how == "imported"
    assert miss.split() == ["absent_one", "absent_one.sub", "absent_two", "absent_three"]


def test_probe_reports_what_is_not_a_missing_module(tmp_path):
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('boom')\n")
    out = _run("""
        import probe_imports as P
        print(P.probe("broken_mod"))
    """, tmp_path)
    assert "stopped: RuntimeError: boom" in out


def test_sass_counter_finds_the_moe_main_loops(tmp_path):
    """Compiles the Triton MoE GEMMs for sm_90a offline (Triton ships ptxas and nvdisasm) and
    finds each main loop (a backward branch of a plausible size)."""
    pytest.importorskip("triton")
    out = _run("""
        import sass_moe_triton as S
        S.main(["--cc", "90"])
    """, tmp_path)
    lines = [line for line in out.splitlines() if line.startswith(("gemm1_swiglu", "gemm2"))]
    assert len(lines) == 2, out
    for line in lines:
        n = int(line.split("main loop ")[1].split()[0])
        assert 100 < n < 5000, line
