"""The candidate launch tables of the sparse-attention kernels (sparse_attention/launch_table.py
CANDIDATE_TABLES, CANDIDATE_TABLES_99KB), through the same ``tables_as`` scope the
candidate benchmark times them with:

* every distinct tile of every candidate table against the ops' torch references, on
  fresh random inputs (seed in the message), with tail sizes (20 heads against 16/32/64-head
  tiles, index lists of 40 and 24 entries against 16/32/64-row blocks), -1 and
  out-of-range ids, top-k lengths, a sink, a lonely query, split-K and one-pass decode,
  both codecs, and an ``out=`` poisoned with NaN that must be fully overwritten
  (on the CPU under the Triton interpreter; with CUDA on the GPU);
* every candidate entry compiled offline for the targets that would get it, within their
  opt-in shared memory: the card tables for sm_90a, the 99 KB tables for sm_80, sm_86,
  sm_89 and sm_120a (native fp8 only from sm_89).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

from triton_env import HAS_CUDA, INTERPRET, _triton_interpreter  # noqa: E402,F401 (autouse fixture)
from attention_checks import SCALE, new_seed  # noqa: E402

from capdispatch.backends.decode_mla import reference as DR  # noqa: E402
from capdispatch.backends.decode_mla.inputs import make_case as decode_case  # noqa: E402
from capdispatch.backends.sparse_attention import launch_table as LT  # noqa: E402
from capdispatch.backends.sparse_prefill import reference as PR  # noqa: E402
from capdispatch.backends.sparse_prefill.inputs import make_case as prefill_case  # noqa: E402

_runs = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"


def _tables():
    out = [(f"card:{n}", t) for n, (_, t) in LT.CANDIDATE_TABLES.items()]
    return out + [(f"99kb:{n}", t) for n, (_, t) in LT.CANDIDATE_TABLES_99KB.items()]


def _tiles(kinds):
    """(BLOCK_H, BLOCK_N, DIRECT) -> a table that has only that tile for KINDS: one case per
    distinct tile and decode (DIRECT: the uint8 codec's direct e4m3 -> bf16 decode)."""
    seen = {}
    for name, table in _tables():
        for kind in kinds:
            for c in table[kind]:
                seen.setdefault((c["BLOCK_H"], c["BLOCK_N"], bool(c.get("DIRECT", False))), name)
    return sorted(seen.items())


def _only(cfg):
    c = dict(cfg)
    c.pop("max_tokens", None)
    c.pop("max_splits", None)
    return {k: (c,) for k in LT.KINDS}


def _decode_tk():
    from test_decode_mla import _tk
    return _tk()


def _prefill_tk():
    from test_sparse_prefill import _tk
    return _tk()


def _check(got, want, msg, n_stats):
    from attention_checks import OUT_RTOL, assert_stats_close, rel_err
    assert bool(torch.isfinite(got[0]).all()), f"{msg}: non-finite output"
    e = rel_err(got[0].cpu(), want[0].cpu())
    assert e <= OUT_RTOL, f"{msg}: out relative error {e:.3g} > {OUT_RTOL}"
    for i in range(1, 1 + n_stats):
        assert_stats_close(got[i].cpu(), want[i].cpu(), f"{msg} stat {i}")


@_runs
@pytest.mark.parametrize("tile,source", _tiles(("decode", "decode_split")), ids=lambda v: str(v))
@pytest.mark.parametrize("native", [False, True])
def test_decode_candidate_tiles_match_reference(tile, source, native):
    tk = _decode_tk()
    from capdispatch.backends.sparse_attention import kernels as K
    if native and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native fp8 needs cc >= 8.9")
    if native and tile[2]:
        pytest.skip("the native-fp8 codec ignores DIRECT")
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    b, s_q, h = 3, 1, 20
    q, pool, idx, ps, kw = decode_case(gen, b, s_q, h, "cpu", topk=40, extra=(4, 6, 24), lengths=True,
                                       sink=True, lonely=(1,))
    want = DR.decode_mla(q, pool, idx, ps, SCALE, **kw)
    mv = lambda t: t.to(DEVICE) if torch.is_tensor(t) else t  # noqa: E731
    q, pool, idx = mv(q), mv(pool), mv(idx)
    kw = {k: mv(v) for k, v in kw.items()}
    cfg = dict(BLOCK_H=tile[0], BLOCK_N=tile[1], num_warps=4, num_stages=1, DIRECT=tile[2])
    with K.tables_as(f"test {tile}", _only(cfg), on_cpu=True):
        for splits in (None, 3):
            msg = f"tile {tile} (from {source}) native={native} splits={splits} seed={seed}"
            ws = torch.full((b, s_q, h, 512), 0x7FC1, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
            got = tk._launch(q, pool, idx, ps, SCALE, kw["topk_length"], kw["attn_sink"], kw["extra_pool"],
                             kw["extra_indices"], kw["extra_page_size"], kw["extra_topk_length"], ws, native,
                             num_splits=splits)
            assert got[0].data_ptr() == ws.data_ptr(), msg
            _check(got, want, msg, 1)


@_runs
@pytest.mark.parametrize("tile,source", _tiles(("prefill",)), ids=lambda v: str(v))
def test_prefill_candidate_tiles_match_reference(tile, source):
    tk = _prefill_tk()
    from capdispatch.backends.sparse_attention import kernels as K
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    s, h = 5, 20
    q, kv, idx, tl_, sk = prefill_case(gen, s, h, 64, 40, "cpu", lengths=True, sink=True, lonely=(2,))
    want = PR.sparse_prefill(q, kv, idx, SCALE, 512, sk, tl_)
    mv = lambda t: t.to(DEVICE) if torch.is_tensor(t) else t  # noqa: E731
    cfg = dict(BLOCK_H=tile[0], BLOCK_N=tile[1], num_warps=4, num_stages=1)
    msg = f"tile {tile} (from {source}) seed={seed}"
    ws = torch.full((s, h, 512), 0x7FC1, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    with K.tables_as(f"test {tile}", _only(cfg), on_cpu=True):
        got = tk.sparse_prefill(mv(q), mv(kv), mv(idx), SCALE, 512, mv(sk), mv(tl_), out=ws)
    assert got[0].data_ptr() == ws.data_ptr(), msg
    _check(got, want, msg, 2)


def test_tables_as_keys_plans_and_ends_with_its_block():
    """A plan made inside a ``tables_as`` block is keyed by the table, and the block leaves
    no table behind."""
    pytest.importorskip("triton")
    from capdispatch.backends.sparse_attention import kernels as K
    assert K.table_key() == ()
    table = _only(dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1))
    with K.tables_as("x", table, on_cpu=True):
        assert K.table_key() == (("table", "x", True),)
        assert K.device_configs(torch.device("cpu"), "decode", 4) == table["decode"]
    assert K.table_key() == ()
    assert K.device_configs(torch.device("cpu"), "decode", 4) == (LT.INTERP_CONFIG,)


def test_candidate_tables_are_well_formed():
    """Every table names every kind, and each entry carries a tile, warps and stages; the
    card tables keep the measured single-token entry first for split decode."""
    for name, table in _tables():
        assert set(table) == set(LT.KINDS), name
        for kind in LT.KINDS:
            assert table[kind], (name, kind)
            for c in table[kind]:
                assert set(c) - {"max_tokens", "max_splits", "DIRECT"} == \
                    {"BLOCK_H", "BLOCK_N", "num_warps", "num_stages"}, (name, c)
                assert c.get("DIRECT", False) in (False, True) and not (kind == "prefill" and "DIRECT" in c), \
                    (name, kind, c)
                assert 1 <= c.get("max_splits", 1) <= LT.MAX_SPLITS, (name, c)
                assert LT.table_configs(table, kind, 4096) or kind == "decode_split", (name, kind)


# --------------------------------------------------------------------------- #
# Offline compiles (no GPU): each candidate entry for the targets that would get it
# --------------------------------------------------------------------------- #
def _compile_jobs():
    jobs, seen = [], set()

    def add(cc, mode, cfg, splits):
        c = {k: v for k, v in cfg.items() if k not in ("max_tokens", "max_splits")}
        key = (cc, mode, tuple(sorted(c.items())), splits)
        if key not in seen:
            seen.add(key)
            jobs.append((cc, mode, c, mode != 0, splits))

    def norm(c):
        return tuple(sorted((k, v) for k, v in c.items() if k != "max_splits"))
    measured = {norm(c) for t in LT.MEASURED_CONFIGS.values() for k in t for c in t[k]}
    portable = {norm(c) for k in LT.PORTABLE_CONFIGS for c in LT.PORTABLE_CONFIGS[k]}
    known = measured | portable
    for _, (_, table) in LT.CANDIDATE_TABLES.items():
        for kind, splits in (("prefill", 1), ("decode", 1), ("decode_split", 4)):
            for c in table[kind]:
                if norm(c) not in known:
                    add(90, 0 if kind == "prefill" else 2, c, splits)
    for _, (_, table) in LT.CANDIDATE_TABLES_99KB.items():
        for kind, splits in (("prefill", 1), ("decode", 1), ("decode_split", 4)):
            for c in table[kind]:
                if norm(c) in known:
                    continue
                if kind == "prefill":
                    for cc in (80, 86, 89, 120):
                        add(cc, 0, c, 1)
                elif splits == 1:
                    for cc in (80, 86, 120):
                        add(cc, 1, c, 1)
                    for cc in (89, 120):
                        add(cc, 2, c, 1)
                else:
                    add(86, 1, c, splits)
                    add(89, 2, c, splits)
    return jobs


@pytest.mark.parametrize("cc", [80, 86, 89, 90, 120])
def test_candidate_entries_compile_within_shared_memory(cc):
    """Every candidate entry builds (ptxas included) for the targets that would get it,
    within their opt-in shared memory: the card tables for sm_90a, the 99 KB tables for
    sm_80, sm_86, sm_89 and sm_120a. One target per test: a target's builds take minutes."""
    pytest.importorskip("triton")
    from test_sparse_prefill import SMEM_OPTIN, compile_offline
    jobs = [j for j in _compile_jobs() if j[0] == cc]
    assert jobs
    res = compile_offline(jobs)
    for job, r in zip(jobs, res):
        assert "error" not in r, (job, r)
        assert r["ptxas_rc"] == 0, (job, r["log"])
        assert r["regs"] <= 255, (job, r)
        assert r["shared"] <= SMEM_OPTIN[job[0]], (job, r)
    print("\n".join(f"sm_{cc} kv_mode {j[1]} splits {j[4]} {j[2]}: shared {r['shared']} B, regs {r['regs']}, "
                    f"spills {r['spill']}" for j, r in zip(jobs, res)))


def test_split_cap_bounds_the_plan():
    """A table entry's ``max_splits`` caps the split planner (fewer partials to merge)."""
    pytest.importorskip("triton")
    from capdispatch.backends.sparse_attention import kernels as K
    assert K.plan_splits(8, 10, 132) > 4          # uncapped: 8 tokens spread over more ranges
    for cap in (1, 2, 4):
        assert 1 <= K.plan_splits(8, 10, 132, cap) <= cap


def _bench_module():
    import importlib
    import os
    import sys
    bdir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bdir not in sys.path:
        sys.path.insert(0, bdir)
    return importlib.import_module("bench_attention_candidates")


def test_candidates_benchmark_arguments_tables_and_report(tmp_path):
    """The benchmark (CPU side): bad arguments are usage errors, each table set is the
    current table plus every candidate, and the report carries the targets table with
    card, versions and date."""
    B = _bench_module()
    for bad in (["--decode-tokens", "0"], ["--budget-s", "-1"], ["--tiles", "nope"],
                ["--tiles", "card", "--tables", "hp16w16"]):   # a 99 KB table, not a card one
        with pytest.raises(SystemExit) as e:
            B.parse_args(bad)
        assert e.value.code == 2, bad
    assert [t[0] for t in B.tables("card")] == ["current"] + list(LT.CANDIDATE_TABLES)
    assert [t[0] for t in B.tables("card", ["s4"])] == ["current", "s4"]
    assert [t[0] for t in B.tables("99kb", [])] == ["current"]
    assert B.parse_args(["--tables", "s4", "hp16w16"]).tables == ["s4", "hp16w16"]
    assert [t[0] for t in B.tables("99kb")] == ["current"] + list(LT.CANDIDATE_TABLES_99KB)
    assert (B.decode_target(1), B.decode_target(64), B.decode_target(128), B.decode_target(4096)) == \
        (1.3, 1.3, None, 1.5)
    meta = dict(device="NVIDIA H200", date="2026-12-03T12:00:00+00:00", torch="2.11.0+cu130", triton="3.6.0",
                cuda="13.0", compute_capability="9.0", seed=7, heads=64, copy_gbps=4200.0, bf16_tflops=700.0,
                capture_max_bs=256, elapsed_s=100.0, budget_s=300.0,
                tables={t: {n: w for n, w, _ in B.tables(t)} for t in ("card", "99kb")})
    rows = [dict(op="decode_mla", size=8, tiles="card", backend="triton_fp8", table="w16", ms=0.02, graph=True,
                 correct=True, over_flashmla=1.4, frac_compute=0.01, frac_memory=0.1, launches=[]),
            dict(summary=True, op="decode_mla", size=8, tiles="card", backend="triton_fp8", best="w16",
                 best_ms=0.02, current_ms=0.022, flashmla_ms=0.0141, value=1.42, target=1.3, met=False)]
    B.write(str(tmp_path), meta, rows)
    md = (tmp_path / "attention_candidates_nvidia_h200_20261203T120000.md").read_text()
    assert "NVIDIA H200" in md and "triton 3.6.0" in md and "2026-12-03" in md
    assert "| decode_mla | 8 | card | triton_fp8 | w16 | 0.0200 | 0.0220 | 0.0141 | 1.42x FlashMLA | <= 1.3x | no |" \
        in md
