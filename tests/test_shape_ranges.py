"""Shape ranges as capability data: each backend's declared ShapeRanges, checked at the
edges (inside, exactly at the bound, outside), through the resolver, explain and the CLI."""
import json
import subprocess
import sys

import attrs
import pytest

import capdispatch as cd
from capdispatch.backends import ShapeRange, builtin
from capdispatch.backends.base import SHAPE_FIELDS, Facts
from capdispatch.capabilities import Inventory, derive_features
from capdispatch.dispatch.errors import BadInput
from capdispatch.models import RankShape

FLASH8 = cd.load_model("deepseek-v4-flash").for_rank(8)


def _ranges():
    reg = builtin()
    for op in reg.ops:
        for b in reg.backends(op):
            for r in b.requires:
                if isinstance(r, ShapeRange):
                    yield b, r


RANGES = list(_ranges())


def _edges(r: ShapeRange):
    """(value, expected ok) at the edges of R's rule."""
    out = []
    if r.allowed:
        vals = sorted(r.allowed)
        out += [(v, True) for v in vals]
        out += [(vals[0] - 1, False), (vals[-1] + 1, False)]
        gaps = [v + 1 for v in vals if v + 1 not in r.allowed and v + 1 < vals[-1]]
        out += [(g, False) for g in gaps[:1]]
    if r.min is not None:
        out += [(r.min, True), (r.min - 1, False)]
    if r.max is not None:
        out += [(r.max, True), (r.max + 1, False), (max(r.max - 1, r.min or 1), True)]
    if r.multiple_of:
        m = r.multiple_of
        out += [(m, True), (2 * m, True), (m + m // 2, False), (m - 1, False)]
    return out


def _check(r, value):
    facts = Facts(cd.probe("sim:h200"), derive_features(cd.probe("sim:h200")), Inventory(),
                  shapes=attrs.evolve(FLASH8, **{r.field: value}))
    return r.evaluate(facts)


def test_every_accelerated_backend_declares_ranges():
    declared = {(b.op, b.name) for b, _ in RANGES}
    for want in [("decode_mla", "flashmla"), ("decode_mla", "flashinfer_sparse_mla"),
                 ("decode_mla", "triton"), ("decode_mla", "triton_fp8"),
                 ("sparse_prefill", "flashmla_sparse"), ("sparse_prefill", "triton"),
                 ("indexer", "deepgemm"), ("indexer", "tilelang"), ("indexer", "triton"),
                 ("moe", "flashinfer_cutlass_w4a8"), ("moe", "flashinfer_trtllm_w4a8"),
                 ("moe", "flashinfer_cutlass_w4a16"), ("moe", "marlin_w4a16"),
                 ("moe", "triton_w4a16"), ("moe", "torch")]:
        assert want in declared, want


def test_every_range_names_a_rank_shape_and_a_source():
    fields = {f.name for f in attrs.fields(RankShape)}
    assert set(SHAPE_FIELDS) <= fields
    for b, r in RANGES:
        assert r.field in fields and r.source, (b.name, r)


@pytest.mark.parametrize("backend,rng", RANGES, ids=[f"{b.op}/{b.name}/{r.field}" for b, r in RANGES])
def test_declared_range_at_its_edges(backend, rng):
    for value, ok in _edges(rng):
        c = _check(rng, value)
        assert c.ok is ok, (backend.name, rng.field, value)
        assert c.code == f"shape:{rng.field}"
        assert f"{rng.field} {value}" in c.found
        assert (c.message == "") is ok


# The declared numbers themselves, so a changed declaration is a visible change here.
@pytest.mark.parametrize("op,backend,field,inside,outside", [
    ("decode_mla", "flashmla", "heads", 128, 129),
    ("decode_mla", "flashinfer_sparse_mla", "heads", 128, 129),
    ("decode_mla", "triton", "head_dim", 512, 576),
    ("sparse_prefill", "flashmla_sparse", "heads", 128, 129),
    ("indexer", "deepgemm", "next_n", 2, 3),
    ("indexer", "deepgemm", "indexer_heads", 64, 128),
    ("indexer", "triton", "indexer_heads", 128, 96),
    ("indexer", "tilelang", "indexer_dim", 128, 64),
    ("moe", "flashinfer_cutlass_w4a16", "moe_intermediate", 256, 192),
    ("moe", "marlin_w4a16", "moe_intermediate", 192, 160),
    ("moe", "triton_w4a16", "moe_intermediate", 64, 96),
    ("moe", "torch", "hidden", 32, 48),
])
def test_declared_numbers(op, backend, field, inside, outside):
    b = builtin().backend(op, backend)
    rs = [r for r in b.requires if isinstance(r, ShapeRange) and r.field == field]
    assert rs
    assert all(_check(r, inside).ok for r in rs)
    assert not all(_check(r, outside).ok for r in rs)


def test_declaration_errors():
    with pytest.raises(ValueError, match="states no range"):
        ShapeRange("heads", "src")
    with pytest.raises(ValueError, match="no source"):
        ShapeRange("heads", "", max=4)
    with pytest.raises(ValueError, match="not a rank shape"):
        ShapeRange("hedas", "src", max=4)


def test_without_shapes_no_shape_checks():
    res = cd.resolve("moe", "sim:h200", libs="sglang-0.5.23")
    assert not any(ch.code.startswith("shape:") for c in res.candidates for ch in c.checks)


def test_resolver_rejects_a_backend_outside_its_range():
    # DeepSeek-V4-Pro over 16 ranks with DP attention: 3072 / 16 = 192 expert columns per rank,
    # not a multiple of 128 (FlashInfer), a multiple of 64 (Marlin, Triton).
    pro16 = cd.load_model("deepseek-v4-pro").for_rank(16, 1, True)
    res = cd.resolve("moe", "sim:h200", libs="sglang-0.5.23", shapes=pro16)
    by = {c.backend: c for c in res.candidates}
    assert not by["flashinfer_cutlass_w4a16"].ok
    bad = [ch for ch in by["flashinfer_cutlass_w4a16"].checks if not ch.ok]
    assert [ch.code for ch in bad] == ["shape:moe_intermediate"]
    assert "192" in bad[0].found and "multiple of 128" in bad[0].need
    marlin = [ch for ch in by["marlin_w4a16"].checks if ch.code.startswith("shape:")]
    assert marlin and all(ch.ok for ch in marlin)
    assert res.backend != "flashinfer_cutlass_w4a16"
    # The same card at 8 ranks: 384 per rank, FlashInfer runs.
    res8 = cd.resolve("moe", "sim:h200", libs="sglang-0.5.23",
                      shapes=cd.load_model("deepseek-v4-pro").for_rank(8))
    assert res8.backend == "flashinfer_cutlass_w4a16"


def test_bad_shapes_argument():
    with pytest.raises(BadInput, match="not a rank's shapes"):
        cd.resolve("moe", "sim:h200", shapes={"heads": 8})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "capdispatch", *args], capture_output=True, text=True,
                          timeout=120)


def test_explain_shows_shape_checks():
    p = _cli("explain", "--device", "sim:h200", "--libs", "sglang-0.5.23", "--op", "moe",
             "--model", "deepseek-v4-pro", "--tp", "16", "--dp-attention")
    assert p.returncode == 0, p.stderr
    assert "shapes: deepseek-v4-pro at tp 16 dp-attention" in p.stdout
    assert "shape:moe_intermediate: need moe_intermediate a multiple of 128" in " ".join(p.stdout.split())
    j = _cli("explain", "--device", "sim:h200", "--libs", "sglang-0.5.23", "--op", "moe",
             "--model", "deepseek-v4-pro", "--tp", "16", "--dp-attention", "--format", "json")
    obj = json.loads(j.stdout)
    assert obj["shapes"]["moe_intermediate"] == 192
    cands = obj["ops"]["moe"]["per_device"]["sim:h200"]["candidates"]
    fi = next(c for c in cands if c["backend"] == "flashinfer_cutlass_w4a16")
    assert not fi["ok"] and any(ch["code"] == "shape:moe_intermediate" for ch in fi["checks"])


def test_explain_layout_without_model_is_refused():
    p = _cli("explain", "--device", "sim:h200", "--tp", "8")
    assert p.returncode == 2 and "give --model" in p.stderr
    q = _cli("explain", "--device", "sim:h200", "--model", "deepseek-v4-flash", "--tp", "3")
    assert q.returncode == 2 and "heads 64 do not divide over tp 3" in q.stderr


def test_sglang_plan_shows_shape_checks():
    p = _cli("sglang", "plan", "--device", "sim:h200", "--libs", "sglang-0.5.23",
             "--model", "deepseek-v4-flash", "--tp", "1", "--next-n", "3")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "shapes: deepseek-v4-flash at tp 1" in text
    assert "not runnable: indexer/deepgemm" in text and "need next_n in {1, 2}" in text
    j = json.loads(_cli("sglang", "plan", "--device", "sim:h200", "--libs", "sglang-0.5.23",
                        "--model", "deepseek-v4-flash", "--tp", "1", "--next-n", "3",
                        "--format", "json").stdout)
    assert j["shapes"]["next_n"] == 3
    assert j["ranks"][0]["ops"]["indexer"]["backend"] != "deepgemm"
    assert {(r["op"], r["backend"], r["code"]) for r in j["shape_rejections"]} >= {
        ("indexer", "deepgemm", "shape:next_n")}
    # At next_n 2 DeepGEMM's range admits the shapes.
    ok = json.loads(_cli("sglang", "plan", "--device", "sim:h200", "--libs", "sglang-0.5.23",
                         "--model", "deepseek-v4-flash", "--tp", "1", "--format", "json").stdout)
    assert ok["shape_rejections"] == [] and ok["ranks"][0]["ops"]["indexer"]["backend"] == "deepgemm"


def test_sglang_plan_refuses_seed_rig_layout():
    p = _cli("sglang", "plan", "--device", "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080",
             "--libs", "sglang-0.5.23", "--model", "deepseek-v4-flash", "--tp", "3")
    assert p.returncode == 2
    assert "heads 64 do not divide over tp 3; tp 1, 2, 4, 8 would" in p.stderr
    q = _cli("sglang", "plan", "--device", "sim:h200", "--ep", "2")
    assert q.returncode == 2 and "give --model" in q.stderr


def test_bind_honours_shape_ranges():
    # The torch MoE reference needs hidden a multiple of 32 (one E8M0 scale per 32 weights).
    odd = attrs.evolve(FLASH8, hidden=48)
    with pytest.raises(cd.Unsatisfiable, match="shape:hidden|hidden"):
        cd.bind("moe", "cpu", backend="torch", shapes=odd)
    assert callable(cd.bind("moe", "cpu", backend="torch", shapes=FLASH8))
