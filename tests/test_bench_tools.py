"""The CPU-side benchmark tools: the import probe and the offline SASS counter."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The benchmark modules import triton: on the CPU its jitted helpers are built in the mode
# of its first import, so that import happens under the interpreter, as in the kernel tests.
from triton_env import _triton_interpreter  # noqa: E402,F401 (autouse fixture)

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


def test_tiles_option_parses_and_names_its_own_series(tmp_path):
    """--tiles: card (default) or 99kb; a 99kb run keeps only the Triton backends and is a
    results series of its own (results_dir parses it apart from the card's own series)."""
    out = _run("""
        import bench_attention as A, bench_indexer as I, bench_kv_cache as KV, bench_moe as M
        import results_dir as RD, tile_modes as T
        assert A.parse_args([]).tiles == "card" and A.parse_args([]).peer_max_tokens == 512
        a = A.parse_args(["--tiles", "99kb", "--graphs", "--peer-max-tokens", "32"])
        assert (a.tiles, a.peer_max_tokens) == ("99kb", 32)
        assert A.parse_args(["--tiles", "99kb", "--tune"]).tune       # the sweep under the 99 KB limit
        for bad in (["--tiles", "88kb"], ["--peer-max-tokens", "-1"]):
            try:
                A.parse_args(bad)
            except SystemExit as e:
                assert e.code == 2, bad
            else:
                raise AssertionError(bad)
        assert M.parse_args(["--tiles", "99kb"]).backends == ["triton_w4a16"]
        assert M.parse_args([]).backends == list(M.DEFAULT_BACKENDS)
        i = I.parse_args(["--tiles", "99kb", "--backends", "triton"])
        assert i.backends == ["torch", "triton"], i.backends     # the reference that checks it
        assert KV.parse_args(["--tiles", "99kb"]).tiles == "99kb"
        dev = "NVIDIA H200"
        for fn, kind in ((A.series, "attention"), (M.series, "moe"), (I.series, "indexer"), (KV.series, "kv_cache")):
            own, small = fn(dev, "card"), fn(dev, "99kb")
            assert own == kind + "_nvidia_h200" and small == own + "_99kb", (own, small)
            assert RD.parse_run(small + "_20261202T020000.json") == (small, "20261202T020000")
        t = T.target("99kb")
        assert (t.capability, t.shared_bytes) == ((8, 6), 101376) and T.target("card") is None
        assert T.label("99kb") == "99 KB tiles (as sm_86/sm_89/sm_120 get them)"
        print("ok")
    """, tmp_path)
    assert "ok" in out


def test_attention_99kb_report(tmp_path):
    """A 99kb attention report: its own file name, the label on every row, the entry that ran
    and the one skipped with their compiled facts."""
    out = _run(f"""
        import os
        import bench_attention as B, tile_modes as T
        meta = dict(device="NVIDIA H200", date="2026-12-02T02:00:00+00:00", torch="2.11", triton="3.6",
                    cuda="13.0", compute_capability="9.0", seed=1, heads=64, copy_gbps=4273.0,
                    bf16_tflops=709.0, availability={{"decode_mla": {{"triton_fp8": None}}}},
                    tiles="99kb", tiles_label=T.LABEL_99KB, shared_limit=101376, peer_max_tokens=512)
        launches = [dict(kernel="_sparse_mla_kernel", config=dict(BLOCK_H=32, BLOCK_N=16, num_warps=8, num_stages=1),
                         shared_bytes=140000, registers=255, spills=0, fits=False),
                    dict(kernel="_sparse_mla_kernel", config=dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1),
                         shared_bytes=50000, registers=168, spills=0, fits=True)]
        rows = [dict(op="decode_mla", shape=dict(tokens=4096), backend="triton_fp8", ms=9.0, graph_ms=8.9,
                     correct=True, frac_roofline=0.05, bound="compute", tiles=T.LABEL_99KB, launches=launches)]
        B._write({str(tmp_path)!r}, meta, rows, [])
        names = sorted(os.listdir({str(tmp_path)!r}))
        assert names == ["attention_nvidia_h200_99kb_20261202T020000.json",
                         "attention_nvidia_h200_99kb_20261202T020000.md"], names
        print(open(os.path.join({str(tmp_path)!r}, names[1])).read())
        print("DESCRIBE", T.describe(T.launch_rows([]) or launches, 101376))
    """, tmp_path)
    assert "# Attention ops on NVIDIA H200: 99 KB tiles (as sm_86/sm_89/sm_120 get them)" in out
    assert "| decode_mla | tokens=4096 | triton_fp8 (99 KB tiles (as sm_86/sm_89/sm_120 get them)) | 9.0000 |" in out
    assert ("| decode_mla | tokens=4096 | triton_fp8 | _sparse_mla_kernel | BLOCK_H=32 BLOCK_N=16 num_warps=8 "
            "num_stages=1 | 140000 | 255 | 0 | no: over the limit, skipped |") in out
    assert "| 50000 | 168 | 0 | yes |" in out
    assert "skipped (over 101376 B)" in out and ": ran" in out


def test_attention_report_has_the_flashmla_bar_and_the_sglang_peer(tmp_path):
    out = _run(f"""
        import os
        import bench_attention as B
        meta = dict(device="NVIDIA H200", date="2026-12-02T02:00:00+00:00", torch="2.11", triton="3.6",
                    cuda="13.0", compute_capability="9.0", seed=1, heads=64, copy_gbps=4273.0,
                    bf16_tflops=709.0, availability={{"decode_mla": {{"triton_fp8": None}}}}, peer_max_tokens=512)
        s1, s4k = dict(tokens=1), dict(tokens=4096)
        rows = [dict(op="decode_mla", shape=s1, bar="x", triton_fp8_graph_ms=0.021, flashmla_graph_ms=0.0175,
                     ratio=0.021 / 0.0175, target=1.2, met=True),
                dict(op="decode_mla", shape=s1, backend=B.PEER_NAME, not_a_backend=True, ms=0.31, graph_ms=0.303,
                     correct=True, out_rel_err=2.5e-3, over_triton_fp8=14.4),
                dict(op="decode_mla", shape=s4k, backend=B.PEER_NAME, not_a_backend=True,
                     skipped="not timed above --peer-max-tokens 512"),
                dict(op="decode_mla", shape=s1, adapter_bar="x", adapter_graph_ms=0.0130, flashmla_graph_ms=0.0122,
                     ratio=0.0130 / 0.0122, target=1.1, met=True)]
        B._write({str(tmp_path)!r}, meta, rows, [])
        md = [f for f in os.listdir({str(tmp_path)!r}) if f.endswith(".md")][0]
        assert md.startswith("attention_nvidia_h200_2026"), md
        print(open(os.path.join({str(tmp_path)!r}, md)).read())
    """, tmp_path)
    assert "| decode_mla | tokens=1 | 0.0210 | 0.0175 | 1.20x | yes |" in out
    assert "| decode_mla | tokens=1 | 0.3100 | 0.3030 | True (2.5e-03) | 14.4x |" in out
    assert "skipped | | | | not timed above --peer-max-tokens 512 |" in out
    assert "one `capdispatch.batch()`" in out and "| decode_mla | tokens=1 | 0.0130 | 0.0122 | 1.07x | yes |" in out


def test_99kb_reports_of_moe_indexer_kv_cache(tmp_path):
    """The other three kernel benchmarks' 99kb reports: their own series, the label on the
    rows, the entries with their facts, and a kernel over the limit shown as the card's failure."""
    out = _run(f"""
        import os
        import bench_indexer as I, bench_kv_cache as KV, bench_moe as M, tile_modes as T
        d = {str(tmp_path)!r}
        ok = dict(kernel="_k", config=dict(BLOCK=64, num_warps=4), shared_bytes=32768, registers=80, spills=0, fits=True)
        over = dict(kernel="_k", config=dict(BM=128, num_warps=8), shared_bytes=110592, registers=None, spills=None,
                    fits=False)
        common = dict(device="NVIDIA H200", date="2026-12-02T02:00:00+00:00", torch="2.11", triton="3.6", cuda="13.0",
                      compute_capability="9.0", seed=1, tiles="99kb", tiles_label=T.LABEL_99KB, shared_limit=101376)
        I._write(d, dict(common, versions={{}}, copy_gbps=4000.0, matmul_tflops=1500.0, matmul_dtype="fp8",
                         not_run={{}}, tolerance="t"),
                 [dict(kind="decode", shape=[64, 1, 16384], backend="triton", ms=0.08, correct=True, max_abs_err=0.0,
                       max_err_over_abs_sum=0.0, bytes=1, flops=1, roofline_ms=0.02, bound="memory",
                       frac_roofline=0.25, launches=[ok]),
                  dict(kind="prefill", shape=[4096, 28672], backend="triton_u8", error="OutOfResources: x",
                       launches=[over])], [], I.accounting())
        KV._write(d, dict(common, page_size=256, copy_gbps=4000.0, sglang="not timed with --tiles"),
                  [dict(tokens=262144, slots="random", page_size=256, backend="triton_fp8", op="kv_quant", ms=0.1,
                        gbps=3500.0, frac_copy=0.87, correct=True, launches=[ok]),
                   dict(tokens=262144, slots="random", page_size=256, backend="triton_u8", op="kv_dequant",
                        error="OutOfResources: x", correct=False, launches=[over])])
        res = dict(meta=dict(device="NVIDIA H200", date_utc="x", torch="t", triton="3", cuda="13", seed=1,
                             shape=dict(E=64, H=4096, I=2048, topk=6), packed_bytes_per_expert=5, copy_GBps=1.0,
                             bf16_TFLOPs=2.0, skipped={{}}, tiles="99kb", tiles_label=T.LABEL_99KB, shared_limit=101376),
                   rows=[dict(tokens=4096, experts_touched=64, roofline_ms=1.0, bound_by="flops",
                              backends=dict(triton_w4a16=dict(error="OutOfResources: x", ok=False, launches=[over])))])
        open(os.path.join(d, "moe.md"), "w").write(M.to_markdown(res))
        for n in sorted(os.listdir(d)):
            if n.endswith(".md"):
                print("FILE", n)
                print(open(os.path.join(d, n)).read())
    """, tmp_path)
    assert "FILE indexer_nvidia_h200_99kb_20261202T020000.md" in out
    assert "FILE kv_cache_nvidia_h200_99kb_20261202T020000.md" in out
    label = "99 KB tiles (as sm_86/sm_89/sm_120 get them)"
    assert f"| decode | [64, 1, 16384] | triton ({label}) | 0.0800 |" in out
    assert f"| 262144 | random | kv_quant | triton_fp8 ({label}) | 0.1000 |" in out
    assert f"triton_w4a16 ({label}) us (% roofline)" in out
    assert out.count("| 110592 | — | — | no: the card fails here |") == 3
    assert out.count("| 32768 | 80 | 0 | yes |") == 2


def test_occupancy_from_registers_shared_memory_and_warps():
    sys.path.insert(0, BENCH)
    try:
        import sass_tools as ST
    finally:
        sys.path.remove(BENCH)
    # 255 registers round to 8192 per warp: 8 warps per SM, one 8-warp block.
    assert ST.occupancy(255, 0, 8) == ST.Occupancy(blocks=1, warps=8, limiter="registers")
    assert ST.occupancy(128, 0, 4) == ST.Occupancy(blocks=4, warps=16, limiter="registers")
    # 100 KB + the 1 KB reservation twice fit in 228 KB, three times do not.
    assert ST.occupancy(32, 100 * 1024, 4) == ST.Occupancy(blocks=2, warps=8, limiter="shared memory")
    assert ST.occupancy(16, 0, 1).limiter == "blocks" and ST.occupancy(16, 0, 1).blocks == 32
    assert ST.occupancy(16, 0, 16) == ST.Occupancy(blocks=4, warps=64, limiter="warps")
    assert ST.by_class({"HGMMA.64x64x16.F32.BF16": 2, "HMMA.16816.F32.BF16": 3, "LDGSTS.E.128": 1,
                        "IMAD.WIDE": 4, "F2FP.BF16.F32.PACK_AB": 5, "WEIRDOP": 1}) == dict(
        ST.by_class({}), tensor_wgmma=2, tensor_mma=3, global_load=1, int_alu=4, conversion=5, other=1)


def test_sass_tools_find_a_tiny_kernels_loop(tmp_path):
    """A tiny loop kernel compiled for sm_90a: resources parsed from ptxas, the loop found,
    its loads and float multiply-adds counted, no tensor-core ops."""
    pytest.importorskip("triton")
    (tmp_path / "tiny_kernel.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def tiny(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            acc = tl.zeros((BLOCK,), tl.float32)
            for k in range(0, n, BLOCK):
                acc = acc * 0.5 + tl.load(x_ptr + k + offs)
            tl.store(out_ptr + offs, acc)
    """))
    out = _run("""
        import json
        import sass_tools as ST
        from tiny_kernel import tiny
        ck = ST.compile_kernel(tiny, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, {"BLOCK": 128},
                               num_warps=4, num_stages=1, cc=90)
        n, mix = ST.main_loop(ck.sass)
        print(json.dumps(dict(regs=ck.regs, spills=ck.spill_stores, smem=ck.smem, n=n, cls=ST.by_class(mix),
                              mma=ST.ptx_mma_kinds(ck.ptx), occ=ST.occupancy(ck.regs, ck.smem, 4).warps)))
    """, tmp_path)
    import json
    r = json.loads(out.strip().splitlines()[-1])
    assert 0 < r["regs"] <= 64 and r["spills"] == 0, r
    assert 0 < r["n"] < 200, r
    assert r["cls"]["global_load"] >= 1 and r["cls"]["fp32"] >= 1, r
    assert r["cls"]["tensor_wgmma"] == r["cls"]["tensor_mma"] == 0 and r["mma"] == {"wgmma": 0, "mma.sync": 0}, r
    assert r["occ"] == 64, r


def test_sass_bounds_brackets_and_report(tmp_path):
    """derive(): equal issue and memory clocks reach the copy ceiling with overlap and half
    of it without; the report of a run renders every analysed row's facts and reading."""
    sys.path.insert(0, BENCH)
    try:
        import sass_bounds as SB
        import sass_tools as ST
    finally:
        sys.path.remove(BENCH)
    per_clock = SB.COPY_GBPS * 1e9 / SB.SMS / SB.CLOCK_HZ      # bytes per SM clock at the copy rate
    row = dict(row="moe_decode", op="moe", kernel="_k", variant="v", num_warps=4, num_stages=1, regs=128,
               spill_stores=0, spill_loads=0, smem=1024, occupancy=dict(blocks=4, warps=16, limiter="registers"),
               ptx_mma={"wgmma": 0, "mma.sync": 1}, kernel_instructions=500, kernel_classes=ST.by_class({}),
               loop_instructions=400, loop_classes=ST.by_class({"LOP3.LUT": 399, "HMMA.16816.F32.BF16": 1}),
               loop_top=[["LOP3.LUT", 399]], loop_mix={"LOP3.LUT": 399, "HMMA.16816.F32.BF16": 1},
               estimate=dict(weight_bytes=400 * per_clock))
    d = SB.derive(row)
    assert d["issue_clocks"] == 400 and abs(d["memory_clocks"] - 400) < 1e-6
    assert abs(d["copy_bracket"][0] - 1.0) < 1e-9 and abs(d["copy_bracket"][1] - 0.5) < 1e-9
    row["derived"] = d
    md = SB.markdown(dict(date="2026-12-02T00:00:00Z", triton="3.9.0", timed_with="3.6.0"), [row],
                     SB.load_notes())
    assert "Offline analysis: a proxy" in md and "### moe `triton_w4a16`, 1 / 8 / 64 tokens" in md
    assert "399 integer" in md and "1 mma.sync tensor ops" in md and "**Reading.**" in md
    assert set(SB.load_notes()) <= set(SB.ISSUE)


def test_serving_profile_report_and_no_cuda(tmp_path):
    """profile_serving_gpu: its report lists kernels and operators per call; without CUDA
    it says so and exits 2 (no traceback)."""
    out = _run("""
        import profile_serving_gpu as P
        meta = dict(device_name="NVIDIA H200", date="d", torch="t", triton="t", iters=50)
        md = P.markdown(meta, [dict(op="decode_mla", backend="triton_fp8",
                                    kernels_per_call={"_sparse_mla_kernel": 1.0, "_combine_kernel": 1.0},
                                    cpu_ops_per_call=[dict(name="aten::empty", calls=4.0, self_us=6.5)])])
        assert "`_sparse_mla_kernel` x1, `_combine_kernel` x1" in md and "| `aten::empty` | 4 | 6.5 |" in md
        import torch
        if not torch.cuda.is_available():
            assert P.main([]) == 2
        print("ok")
    """, tmp_path)
    assert out.strip().endswith("ok")


def test_overhead_report_has_the_host_path_column(tmp_path):
    """bench_overhead's report: a Triton row's host path without launches (serving with
    every launch a no-op) sits beside bare and serving, with what it means."""
    out = _run("""
        import bench_overhead as B
        meta = dict(gpu_present=True, gpu="NVIDIA H200", date="d", cpu="x", cpu_count=16, torch_threads=16,
                    python="3.12", torch="2.11", triton="3.6", cuda="13.0", device="cuda:0", repeats=5,
                    iters=60, seed=1, load_average=None,
                    dispatch_floor_us=dict(python=0.07, custom_op=1.8, bucket_dispatcher=0.5, bucket_direct=0.1))
        row = dict(op="decode_mla", backend="triton_fp8", bare_kind="Triton launcher", bound_us=147.7,
                   serving_us=125.6, bare_us=69.2, host_us=40.0, ratio=147.7 / 69.2, serving_ratio=125.6 / 69.2)
        md = B.report(meta, [row])
        assert "| decode_mla | triton_fp8 | Triton launcher | 69.2 | 147.7 | 125.6 | 78.5 | 2.13 | 1.82 | 40.0 |" in md, md
        assert "Host path without launches" in md and "host path without launches 40.0 us" in B._line(row)
        assert "over two no-op kernels: 0.50 us against 0.10 us" in md and "0.40 us of its own per call" in md
        print("ok")
    """, tmp_path)
    assert out.strip().endswith("ok")


def test_moe_report_with_graph_times(tmp_path):
    """bench_moe --graphs: the roofline fraction comes from the graph replay, the eager
    median follows it, a failed capture is named in its cell, and --graphs parses."""
    out = _run("""
        import bench_moe as M
        assert M.parse_args(["--graphs"]).graphs and not M.parse_args([]).graphs
        meta = dict(device="NVIDIA H200", date_utc="x", torch="t", triton="3", cuda="13", seed=1,
                    shape=dict(E=64, H=4096, I=2048, topk=6), packed_bytes_per_expert=5, copy_GBps=1.0,
                    bf16_TFLOPs=2.0, skipped={}, tiles="card", tiles_label="card", shared_limit=None, graphs=True)
        rows = [dict(tokens=1, experts_touched=6, roofline_ms=0.02, bound_by="bytes", backends=dict(
                    triton_w4a16=dict(ms=0.05, eager_ms=0.17, graph_ms=0.05, ok=True, fraction_of_roofline=0.4),
                    torch=dict(ms=10.0, eager_ms=10.0, graph_ms=None, ok=True, fraction_of_roofline=0.002))),
                dict(tokens=8, experts_touched=33, roofline_ms=0.1, bound_by="bytes", backends=dict(
                    triton_w4a16=dict(ms=0.3, eager_ms=0.3, graph_ms=None, graph_error="RuntimeError: capture",
                                      ok=True, fraction_of_roofline=1 / 3)))]
        print(M.to_markdown(dict(meta=meta, rows=rows)))
    """, tmp_path)
    assert "| 1 | 6 | 20.0 | bytes | 50.0 (40.0%; eager 170.0) | 10000.0 (0.2%) |" in out, out
    assert "300.0 (33.3%; graph capture failed: RuntimeError: capture)" in out, out
    assert "replays from a CUDA graph" in out


def test_every_benchmark_takes_its_out_folder_from_results_dir():
    """--out DIR (the folder a run writes into) is declared once, results_dir.add_out; an
    --out a script declares itself must be a FILE (compile_matrix's table). The shared
    piece gives the results folder whatever the working directory, or none, or requires it."""
    import argparse
    import ast
    import glob
    own = []
    for path in sorted(glob.glob(os.path.join(BENCH, "*.py"))):
        if path.endswith("results_dir.py"):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--out"):
                meta = {k.arg: getattr(k.value, "value", None) for k in node.keywords}.get("metavar")
                if meta != "FILE":
                    own.append(f"{os.path.basename(path)}:{node.lineno}")
    assert not own, "--out declared outside results_dir.add_out: " + ", ".join(own)
    sys.path.insert(0, BENCH)
    try:
        import results_dir as R
    finally:
        sys.path.remove(BENCH)
    p = argparse.ArgumentParser()
    R.add_out(p)
    assert p.parse_args([]).out == R.RESULTS and os.path.isabs(R.RESULTS)
    assert p.parse_args(["--out", "x"]).out == "x"
    p = argparse.ArgumentParser()
    R.add_out(p, default=None)
    assert p.parse_args([]).out is None
    p = argparse.ArgumentParser()
    R.add_out(p, required=True)
    with pytest.raises(SystemExit):
        p.parse_args([])
