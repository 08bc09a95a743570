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


def test_attention_report_keeps_comparison_rows_apart(tmp_path):
    """bench_attention's report: the 'FlashMLA as SGLang calls it' row is listed without a
    roofline, and the served-default table appears only when that row was measured."""
    out = _run(f"""
        import json, os
        import bench_attention as B
        meta = dict(device="NVIDIA H200", date="2026-11-29T22:36:30+00:00", torch="2.11", triton="3.6",
                    cuda="13.0", compute_capability="9.0", seed=1, heads=64, copy_gbps=4273.0,
                    bf16_tflops=709.0, availability={{"decode_mla": {{"flashmla": None, "triton_fp8": None}}}})
        shape = dict(tokens=1)
        rows = [dict(op="decode_mla", shape=shape, backend="triton_fp8", ms=0.2, graph_ms=0.0157, correct=True,
                     frac_roofline=0.001, bound="compute"),
                dict(op="decode_mla", shape=shape, backend="flashmla (kernel as SGLang calls it)", ms=0.03,
                     graph_ms=0.0122, correct=True, not_a_backend=True),
                dict(op="decode_mla", shape=shape, served_default="flashmla as SGLang calls it",
                     fastest_backend_graph="triton_fp8", served_over_fastest_graph=0.0122 / 0.0157)]
        B._write({str(tmp_path)!r}, meta, rows, [])
        md = [f for f in os.listdir({str(tmp_path)!r}) if f.endswith(".md")][0]
        print(open(os.path.join({str(tmp_path)!r}, md)).read())
    """, tmp_path)
    assert "| decode_mla | tokens=1 | flashmla (kernel as SGLang calls it) | 0.0300 | 0.0122 | | | output True |" in out
    assert "| decode_mla | tokens=1 | flashmla as SGLang calls it | triton_fp8 | 0.78 |" in out


def test_bench_verify_reads_dispatch_verify_json():
    """benchmarks/bench_verify.py reads what `dispatch verify --format json` writes: rows
    built from capdispatch's own Result.to_dict, cold and warm matched per backend."""
    sys.path.insert(0, BENCH)
    try:
        import bench_verify as bv
    finally:
        sys.path.remove(BENCH)
    from capdispatch.capabilities import probe
    from capdispatch.dispatch.verify import Job, Result
    from capdispatch.proof import Verdict
    dev = probe("cpu")

    def body(walls):
        res = [Result(Job(dev, "kv_dequant", b), Verdict("kv_dequant", b, "cpu", outcome,
                      detail="" if outcome == "pass" else "CompilationError: fp8e4nv not supported\nmore",
                      seconds={"load": w / 2, "run": w / 4, "wall": w}))
               for b, outcome, w in walls]
        return {"rc": 0, "wall": sum(w for _, _, w in walls), "body": {"schema": 1, "passed": False,
                "results": [r.to_dict() for r in res]}}

    cold = body([("triton_fp8", "compile", 9.0), ("torch", "pass", 2.0)])
    warm = body([("triton_fp8", "compile", 3.0), ("torch", "pass", 1.5)])
    table = bv.rows(cold, warm)
    assert [(r["backend"], r["outcome"], r["cold_wall"], r["warm_wall"], r["compile_est"]) for r in table] == \
        [("triton_fp8", "compile", 9.0, 3.0, 6.0), ("torch", "pass", 2.0, 1.5, 0.5)]
    meta = {"device": "cpu", "card": "x", "date": "d", "versions": {"torch": "2"}, "cold": ["triton"],
            "cold_wall": 11.0, "cold_rc": 3, "warm_wall": 4.5, "ops": "all"}
    text = bv.render(meta, table)
    assert "**11.0 s** (target 60 s: met); exit 3" in text
    assert "| kv_dequant | triton_fp8 | compile: CompilationError: fp8e4nv not supported | 9.0 | 4.5 | 2.2 | 3.0 | 6.0 |" in text


def test_overhead_bench_measures_the_bucket_dispatcher(tmp_path):
    """bench_overhead.py on the CPU with the Triton interpreter (two kv_dequant backends
    run): the per-backend rows, and the size-bucket dispatcher row built from a policy
    whose buckets pick different backends, in the JSON and the Markdown report."""
    import json
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_overhead.py"), "--device", "cpu", "--op",
                        "kv_dequant", "--iters", "2", "--repeats", "1", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (js,) = out.glob("overhead_*.json")
    data = json.loads(js.read_text())
    ran = {row["backend"] for row in data["rows"] if "skipped" not in row}
    assert {"torch", "triton_u8"} <= ran
    (b,) = data["buckets"]
    assert b["op"] == "kv_dequant" and b["small"] != b["big"] and b["dispatcher_us"] > 0 and b["direct_us"] > 0
    md = js.with_suffix(".md").read_text()
    assert "Size-bucket dispatcher" in md and f"<=16: {b['small']}, else {b['big']}" in md
