"""CPU checks of benchmarks/bench_moe_breakdown.py and moe_peer_sglang.py: argument errors,
the byte model, the peer's routing table against a plain loop, the Markdown report."""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_moe_breakdown as B  # noqa: E402
import moe_peer_sglang as P  # noqa: E402
from capdispatch.backends.moe import reference as R  # noqa: E402


def test_candidates_parse_and_name_the_valid_ones():
    assert B.parse_candidates("all") == list(B.CANDIDATES)
    assert B.parse_candidates("none") == []
    assert B.parse_candidates("split4,prefetch") == ["split4", "prefetch"]
    with pytest.raises(SystemExit, match="--candidates: unknown split3; valid: all, none"):
        B.parse_candidates("split3")


def test_gemm_bytes_are_the_routed_experts_weights():
    per_expert = 3 * B.H * B.I * (0.5 + 1 / 32)
    g1, f1 = B.traffic("gemm1", 1, 6, 6, 1, 1)
    g2, f2 = B.traffic("gemm2", 1, 6, 6, 1, 1)
    assert g1 + g2 == pytest.approx(6 * per_expert + 1 * B.H * 2 + 6 * B.I * 2 + 6 * B.I * 2 + 6 * B.H * 4)
    assert f1 + f2 == 6 * 1 * 6 * B.H * B.I
    assert B.traffic("gemm1", 1, 6, 6, 4, 1)[0] > g1       # split partials are extra bytes


@pytest.mark.parametrize("T,K,E,BM", [(1, 6, 64, 16), (5, 4, 6, 16), (37, 6, 8, 16), (100, 6, 16, 64)])
def test_peer_routing_table_matches_a_plain_loop(T, K, E, BM):
    g = torch.Generator().manual_seed(T * 7 + E)
    _, ids = R.random_routing(T, K, E, gen=g, mask_frac=0.3, skew=0.5)
    sorted_ids, blocks, post = P.align(ids, E, BM)
    flat = ids.reshape(-1).tolist()
    want, want_blocks = [], []
    for e in range(E):
        r = [i for i, v in enumerate(flat) if v == e]
        if r:
            n = -(-len(r) // BM) * BM
            want += r + [len(flat)] * (n - len(r))
            want_blocks += [e] * (n // BM)
    assert sorted_ids.numel() == len(flat) + E * (BM - 1)
    assert sorted_ids[:len(want)].tolist() == want and bool((sorted_ids[len(want):] == len(flat)).all())
    assert blocks[:len(want_blocks)].tolist() == want_blocks and bool((blocks[len(want_blocks):] == -1).all())
    assert post.tolist() == [len(want)]


def test_peer_weights_have_the_same_bytes_per_weight():
    g = torch.Generator().manual_seed(0)
    w13, s13, w2, s2 = P.random_int4_weights(2, 128, 64, g, "cpu")
    nbytes = sum(t.numel() * t.element_size() for t in (w13, s13, w2, s2))
    assert nbytes == 2 * 3 * 128 * 64 * (0.5 + 1 / 32)
    q = P.dequant(torch.tensor([[0x8F, 0x01] * 32], dtype=torch.uint8), torch.ones(1, 2, dtype=torch.bfloat16))
    assert q[0, :4].tolist() == [7.0, 0.0, -7.0, -8.0]


def test_markdown_report_renders_every_section():
    launch = dict(kernel="_gemm1_swiglu_kernel", part="gemm1", us=30.0, launches=1.0, bytes=5.3e7, flops=1e8,
                  GBps=1766.0, frac_copy=0.4, frac_matmul=0.001)
    cfg = dict(config="table", tiles=[16] * 9 + [1, 1, 0], us=70.0, frac_roofline=0.27, launches=[launch],
               launch_count=4, kernels_us_sum=65.0, profiled_from="graph replays")
    res = dict(meta=dict(device="Card", compute_capability="9.0", torch="t", triton="3", cuda="13", python="3.12",
                         seed=1, seconds=1.0, date="2026-12-03", packed_bytes_per_expert=13369344,
                         shape=dict(route_skew=0.5), served="served",
                         tile_modes={"card": dict(label="this card's own tiles", shared_limit=None),
                                     "99kb": dict(label="99 KB tiles", shared_limit=101376)},
                         ceilings=dict(copy_GBps=dict(median=4000.0, min=3900.0, max=4100.0, spread_pct=5.0,
                                                      runs=[4000.0] * 5),
                                       bf16_TFLOPs=dict(median=700.0, min=690.0, max=710.0, spread_pct=2.9,
                                                        runs=[700.0] * 3), copy_note="fresh")),
               checks=[dict(tokens=1, config="table", ok=True, norm_rel=1e-4, why=""),
                       dict(tokens=1, config="table 99kb", ok=True, norm_rel=1e-4, why="", launches=[
                           dict(kernel="_gemm2_kernel", config=dict(BM=16, num_warps=4), shared_bytes=16640,
                                registers=113, spills=0, fits=True)])],
               targets=B.targets([dict(tokens=1, bound_by="bytes", configs=[cfg], peer=[
                   dict(config="m16", us=308.0, best=True)])]),
               peer=dict(status="cannot run", why="ImportError: x"),
               rows=[dict(tokens=1, experts_touched=6, roofline_us_bytes=19.0, roofline_us_flops=0.1,
                          bound_by="bytes", configs=[cfg], peer=[])],
               sass=[dict(config="table@1", cc=90, kernel="gemm1", constexprs=dict(BM=16, BN=32), num_warps=4,
                          num_stages=3, regs=103, spill_stores=0, smem=16512, blocks_per_sm=4, warps_per_sm=16,
                          occupancy_limiter="registers", main_loop_instructions=348)])
    md = B.to_markdown(res)
    for text in ("copy 4000 GB/s median of 5", "| 1 | 6 | 19.0 (bytes) | table | 70.0 | 27.0% | 4 | 65.0 |",
                 "`_gemm1_swiglu_kernel` | 30.0", "Status: cannot run — ImportError: x", "| table@1 | 90 | gemm1 |",
                 "`table 99kb`: 99 KB tiles (every launch compiled and checked against 101376 B",
                 "| 1 | table | 70.0 | bytes | 27.0% | >= 60% | no | 308.0 | 0.23x |",
                 "| 1 | table 99kb | _gemm2_kernel | BM=16 num_warps=4 | 16640 | 113 | 0 | yes |"):
        assert text in md, text


def test_defaults_run_no_candidate_and_both_table_sets():
    assert B.DEFAULT_CANDIDATES == "none" and B.parse_candidates(B.DEFAULT_CANDIDATES) == []
    assert B.tile_modes_of("both") == ["card", "99kb"]
    assert B.tile_modes_of("99kb") == ["99kb"]
    with pytest.raises(SystemExit, match="--tiles: unknown 98kb; valid: both, card, 99kb"):
        B.tile_modes_of("98kb")
    assert B.TILE_SETS == ("both", "card", "99kb")


def test_configs_have_each_table_set_then_candidates_on_this_cards_tiles():
    from capdispatch.backends.moe.launch_table import tiles_for
    got = B.configs_for(1, ["split2"], tiles_for, ["card", "99kb"])
    assert [(label, mode) for label, _, mode in got] == [("table", "card"), ("table 99kb", "99kb"),
                                                          ("split2", "card")]
    assert got[0][1] == got[1][1] and (got[2][1].SK1, got[2][1].SK2) == (2, 2)
    assert [label for label, _, _ in B.configs_for(4096, ["split2"], tiles_for, ["card"])] == ["table"]
    # The SASS list compiles each distinct tiles once, whatever the table sets.
    assert [label for label, _ in B.sass_configs([1, 4096], ["split2"])] == ["table@1", "split2@1", "table@4096"]


def _row(T, bound, us_table, frac, peer_us=None):
    cfgs = [dict(config="table", us=us_table, frac_roofline=frac), dict(config="table 99kb", us=us_table,
                                                                        frac_roofline=frac),
            dict(config="split2", us=1.0, frac_roofline=0.99), dict(config="table 99kb", skipped="failed its check")]
    peer = [dict(config="p", us=peer_us, best=True)] if peer_us else []
    return dict(tokens=T, bound_by=bound, configs=cfgs, peer=peer)


def test_targets_take_the_sizes_bound_and_the_peers_best():
    t = B.targets([_row(1, "bytes", 67.0, 0.28, peer_us=308.6), _row(4096, "flops", 4966.7, 0.56)])
    assert [(r["tokens"], r["config"]) for r in t] == [(1, "table"), (1, "table 99kb"), (4096, "table"),
                                                       (4096, "table 99kb")]
    assert t[0]["goal"] == 0.60 and not t[0]["met"] and t[0]["vs_peer"] == pytest.approx(67.0 / 308.6)
    assert t[2]["goal"] == 0.55 and t[2]["met"] and t[2]["peer_us"] is None
