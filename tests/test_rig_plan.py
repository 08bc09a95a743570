"""`dispatch plan` and models.memory: weights per rank in their stored formats, the V4 KV
pools, the fit against each card, the largest context, and what would fit."""
import json
import subprocess
import sys
import time

import pytest

import capdispatch as cd
from capdispatch.dispatch import rigplan
from capdispatch.dispatch.errors import BadInput
from capdispatch.models import memory as mem

FLASH = cd.load_model("deepseek-v4-flash")
SEED = ["sim:rtx-5090", "sim:rtx-3080", "sim:rtx-3080"]


def _part(parts, name):
    return next(p for p in parts if p.name == name)


def test_routed_experts_are_mxfp4_at_4_25_bits():
    r1 = FLASH.for_rank(1)
    routed = _part(mem.weight_parts(FLASH, r1), "routed experts").bytes
    params = (FLASH.layers + FLASH.mtp) * FLASH.experts * 3 * FLASH.hidden * FLASH.moe_intermediate
    assert routed == int(params * 4.25 / 8)


def test_weights_shard_as_sglang_does():
    w1 = {p.name: p.bytes for p in mem.weight_parts(FLASH, FLASH.for_rank(1))}
    w8 = {p.name: p.bytes for p in mem.weight_parts(FLASH, FLASH.for_rank(8))}
    w8ep = {p.name: p.bytes for p in mem.weight_parts(FLASH, FLASH.for_rank(8, 8))}
    dp = {p.name: p.bytes for p in mem.weight_parts(FLASH, FLASH.for_rank(8, 1, True))}
    assert w8["routed experts"] == pytest.approx(w1["routed experts"] / 8, rel=1e-9)
    assert w8ep["routed experts"] == w8["routed experts"]         # EP x MoE TP: the same share
    assert w8["lm_head"] == pytest.approx(w1["lm_head"] / 8, abs=1)
    assert w8["embedding"] == pytest.approx(w1["embedding"] / 8, abs=1)
    assert dp["embedding"] == w1["embedding"]                     # whole under dp-attention
    assert dp["attention and shared-expert linears"] > w8["attention and shared-expert linears"]
    # bf16 embedding: vocab x hidden x 2 bytes
    assert w1["embedding"] == FLASH.vocab * FLASH.hidden * 2


def test_mtp_layer_counted_only_when_drafting():
    with_mtp = sum(p.bytes for p in mem.weight_parts(FLASH, FLASH.for_rank(1)))
    without = sum(p.bytes for p in mem.weight_parts(FLASH, FLASH.for_rank(1, next_n=1)))
    assert with_mtp > without


def test_checkpoint_total_near_published_size():
    # The DeepSeek-V4-Flash checkpoint's safetensors hold about 160 GB (284B parameters,
    # MXFP4 experts, FP8 linears): the estimate at tp 1 is within a few percent of it.
    total = sum(p.bytes for p in mem.weight_parts(FLASH, FLASH.for_rank(1)))
    assert 150e9 < total < 165e9


def test_kv_parts():
    r = FLASH.for_rank(4)
    kv = mem.kv_parts(FLASH, r, 4096, 3)
    pools = _part(kv, "KV pools").bytes
    assert pools >= r.kv_bytes_per_request(4096) * 3
    # Small contexts pay for whole pages: 3 window rings of 129 rows take 2 pages of 256.
    assert pools <= r.kv_bytes_per_request(4096) * 3 * 1.5
    states = _part(kv, "compress-state rings").bytes
    c4 = list(FLASH.compress_ratios).count(4)
    c128 = list(FLASH.compress_ratios).count(128)
    assert states == 4 * (c4 * 16 * 4 * (512 + 128) * 4 + c128 * 256 * 2 * 512 * 4)
    assert mem.state_ring_rows(4, False) == 8 and mem.state_ring_rows(128, False) == 128
    with pytest.raises(cd.ModelError, match="batch 0 is not valid"):
        mem.kv_parts(FLASH, r, 10, 0)


def test_largest_context_is_exact_at_its_bound():
    r = FLASH.for_rank(8)
    card = 24 * mem.GIB
    budget = rigplan.budget_of(card)
    n = mem.largest_context(FLASH, r, batch=4, card_bytes=card, budget=budget, limit=1 << 20)
    assert 0 < n < 1 << 20
    at = mem.rank_memory(FLASH, r, context=n, batch=4, card_bytes=card).total
    past = mem.rank_memory(FLASH, r, context=n + 1, batch=4, card_bytes=card).total
    assert at <= budget < past


def test_seed_rig_refused_with_numbers_and_layouts():
    specs = [cd.probe(d) for d in SEED]
    from capdispatch.dispatch.group import unique_ids
    p = rigplan.build(FLASH, unique_ids(specs), tp=3)
    assert p.refusal and "heads 64 do not divide over tp 3" in p.refusal
    assert not p.fits and p.ranks == ()
    assert [o.layout.tp for o in p.options] == [1, 2]
    assert not any(o.fits for o in p.options)
    assert p.options[0].devices == ("sim:rtx-5090",)
    text = " ".join(p.suggestions)
    assert "no layout of them loads" in text and "tp 8 needs" in text


def test_fitting_rig_and_budget():
    specs = [cd.probe("sim:h200")] * 4
    from capdispatch.dispatch.group import unique_ids
    p = rigplan.build(FLASH, unique_ids(specs), tp=4, context=65536, batch=8)
    assert p.fits and p.refusal is None and len(p.ranks) == 4
    r = p.ranks[0]
    assert r.budget == int(r.card_bytes * 0.95)
    assert r.largest_context == FLASH.max_context
    assert r.memory.total == r.memory.weight_bytes + r.memory.kv_bytes + r.memory.workspace_bytes


def test_build_bad_input():
    specs = [cd.probe("sim:h200")]
    with pytest.raises(BadInput, match="--tp 2 puts one rank on each card"):
        rigplan.build(FLASH, specs, tp=2)
    with pytest.raises(BadInput, match="--context -1 is not valid"):
        rigplan.build(FLASH, specs, tp=1, context=-1)
    with pytest.raises(BadInput, match="longer than"):
        rigplan.build(FLASH, specs, tp=1, context=FLASH.max_context + 1)
    with pytest.raises(BadInput, match="--batch 0"):
        rigplan.build(FLASH, specs, tp=1, batch=0)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "capdispatch", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_seed_rig():
    p = _cli("plan", "--model", "deepseek-v4-flash", "--device", ",".join(SEED), "--tp", "3", "--brief")
    assert p.returncode == 3, p.stderr
    out = " ".join(p.stdout.split())
    assert "REFUSED by SGLang" in out and "tp 1, 2, 4, 8 would" in out
    assert "the weights alone are 151.2 GiB; these 3 cards hold 52.0 GiB" in out
    j = json.loads(_cli("plan", "--model", "deepseek-v4-flash", "--device", ",".join(SEED),
                        "--format", "json").stdout)
    assert j["layout"]["tp"] == 3 and j["refusal"] and j["fits"] is False
    assert [o["tp"] for o in j["options"]] == [1, 2]


def test_cli_fits_and_errors():
    p = _cli("plan", "--model", "deepseek-v4-flash", "--device", "sim:h200", "--tp", "4")
    assert p.returncode == 0 and "fits" in p.stdout and "rank 3:" in p.stdout
    for args, want in [(("--device", "sim:h200"), "--model"),
                       (("--model", "deepseek-v4-flash", "--device", "sim:h200,sim:h200", "--tp", "3"),
                        "--tp 3 puts one rank"),
                       (("--model", "deepseek-v4-flsh", "--device", "sim:h200"), "did you mean"),
                       (("--model", "deepseek-v4-flash", "--device", "sim:h2000"), "unknown simulated device")]:
        q = _cli("plan", *args)
        assert q.returncode == 2 and want in q.stderr, (args, q.stderr)
        assert "Traceback" not in q.stderr


def test_eight_cards_fast_and_without_torch():
    code = ("import sys, time, io, contextlib\n"
            "from capdispatch.dispatch.cli import main\n"
            "from capdispatch.dispatch import plan_cmd, rigplan\n"
            "t = time.process_time()   # the plan's own CPU time (a busy machine stretches wall time)\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['plan', '--model', 'deepseek-v4-pro', '--device', 'sim:rtx-5090,sim:rtx-3080,"
            "sim:rtx-3080,sim:rtx-4090,sim:h200,sim:h200,sim:h100,sim:b200', '--context', '131072'])\n"
            "print(rc, time.process_time() - t, 'torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    rc, secs, torch = p.stdout.split()
    assert rc == "3" and torch == "False"
    assert float(secs) < 1.0


def test_kv_pools_are_sglang_pages():
    r = FLASH.for_rank(8)
    pools = {p.name: p for p in mem.kv_pools(FLASH, r, 32768, 4)}
    from capdispatch.backends.v4_layout import bytes_per_page
    assert pools["window rings"].shape[1] == bytes_per_page(256)
    assert pools["c4 rows"].shape[1] == bytes_per_page(64)
    assert pools["c128 rows"].shape[1] == bytes_per_page(2)
    assert pools["c4 indexer keys"].shape == (-(-4 * 8192 // 64), 64 * 132)
    assert pools["window rings"].count == FLASH.layers + FLASH.mtp
    kv = {p.name: p.bytes for p in mem.kv_parts(FLASH, r, 32768, 4)}
    assert kv["KV pools"] == sum(p.bytes for p in pools.values() if "states" not in p.name)
    # Paged, it holds at least the rows a request needs, and within 5% of them at this size.
    assert r.kv_bytes_per_request(32768) * 4 <= kv["KV pools"] <= r.kv_bytes_per_request(32768) * 4 * 1.05 * \
        (FLASH.layers + 1) / FLASH.layers


def test_the_v4_row_and_page_sizes_are_the_layouts():
    """The pool row's and the page padding's bytes are declared once, in
    backends/v4_layout.py: the memory estimate, the model shapes and the benchmarks take
    them from there, so no copy of the numbers (as code or as a sentence) drifts from it."""
    import ast
    import os
    import re
    from capdispatch.backends import v4_layout as L
    from capdispatch.models import sharding
    assert L.row_bytes(L.DIM_NOPE, L.DIM_ROPE) == L.TOKEN_BYTES
    assert sharding.kv_bytes_per_token(FLASH) == FLASH.for_rank(1).kv_bytes_per_token == L.TOKEN_BYTES
    assert all(mem.page_bytes(p) == L.bytes_per_page(p) for p in range(1, 300))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sizes = {L.TOKEN_BYTES, L.DATA_BYTES}
    said = {"capdispatch/models/memory.py", "capdispatch/models/sharding.py", "benchmarks/bench_kv_cache.py"}
    paths = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(os.path.join(root, "capdispatch"))
             for f in fs if f.endswith(".py")]
    paths += [os.path.join("benchmarks", f) for f in os.listdir(os.path.join(root, "benchmarks")) if f.endswith(".py")]
    found = []
    for rel in sorted(paths):
        if rel.replace(os.sep, "/") == "capdispatch/backends/v4_layout.py":
            continue
        text = open(os.path.join(root, rel), encoding="utf-8").read()
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value in sizes:
                found.append(f"{rel}:{node.lineno} {node.value}")
        if rel.replace(os.sep, "/") in said:        # their docstrings and comments name the constants
            found += [f"{rel}:{text[:m.start()].count(chr(10)) + 1} says {m[0]}"
                      for m in re.finditer(r"(?<![\w.])(%s)(?![\w.])" % "|".join(map(str, sizes)), text)]
    # The Triton KV kernels hard-code the layout and assert it against v4_layout's constants.
    assert found == ["capdispatch/backends/kv_cache/triton_kernels.py:139 576"], found


def test_measure_memory_writer(tmp_path):
    import importlib.util
    import os
    here = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    sys.path.insert(0, here)
    try:
        spec = importlib.util.spec_from_file_location("measure_memory", os.path.join(here, "measure_memory.py"))
        mm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mm)
    finally:
        sys.path.remove(here)
    result = {"meta": {"device": "NVIDIA H200", "total_bytes": 1, "torch": "x", "cuda": "12.8",
                       "date": "2026-12-03T10:00:00Z", "model": "deepseek-v4-flash", "tp": 8, "ep": 1,
                       "context": 32768, "batch": 4, "page_size": 256, "next_n": 2, "margin": mem.MARGIN_TEXT},
              "pools": [{"pool": "window rings", "tensors": 44, "shape": [3, 149760], "dtype": "uint8",
                         "estimate": 100, "allocated_delta": 100, "device_delta": 2 << 20}],
              "compare": [mm._cmp("KV pools", 100, [{"estimate": 100, "allocated_delta": 100,
                                                     "device_delta": 2 << 20}])]}
    base = mm.write(str(tmp_path), result)
    assert base.endswith("memory_nvidia_h200_20261203T100000")
    md = open(base + ".md").read()
    assert "| KV pools |" in md and "+0.0%" in md
    assert json.load(open(base + ".json"))["compare"][0]["error_vs_allocated"] == 0.0


# ------------------------------------------------------------------ what SGLang makes at load

def _flash_layers(n, **override):
    from capdispatch.models.checkpoint.config import checkpoint_config, source_config
    from capdispatch.models.config import parse
    cfg, where = source_config("deepseek-v4-flash")
    cfg = {**checkpoint_config(cfg, where, FLASH, n), **override}
    return parse(cfg, where, f"flash-{n}", where)


def _measured_load_gib(log):
    """SGLang's own 'Load weight end. ... mem usage=X GB' (GiB: bytes / 2**30) from a served log."""
    import os
    import re
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", log)
    m = re.search(r"Load weight end\..*mem usage=([0-9.]+) GB", open(path, encoding="utf-8").read())
    assert m, path
    return float(m.group(1))


def test_the_weights_plan_of_a_4_layer_flash_checkpoint_is_what_sglang_loaded_on_an_h100():
    """SGLang 0.5.17 loaded the 4-layer full-width checkpoint into 16.40 GiB on an H100 (both
    runs, 2026-12-07); the stored tensors are 1.1 GiB less: the bf16 wo_a and the rope tables."""
    shape = _flash_layers(4)
    rank = shape.for_rank(1, next_n=1)
    parts = {p.name: p.bytes for p in mem.weight_parts(shape, rank)}
    measured = _measured_load_gib("h100-engine-2026-12-07/served/sglang-plugin-off.log")
    assert measured == _measured_load_gib("h100-engine-2026-12-07/served/sglang-plugin-on.log")
    assert abs(sum(parts.values()) / mem.GIB / measured - 1) < 0.01, (sum(parts.values()) / mem.GIB, measured)
    # Two bases (window layers 0-1, compressed layers 2-3), each 256 MiB of complex64 freqs_cis
    # over 1,048,576 positions and 256 MiB of fp32 cos|sin over 65536 x 16.
    assert parts["rope tables"] == 2 * (2 * 256 << 20)
    # The rig plan for an H100 (what the engine rehearsal compares with) is this sum; on a B200
    # SGLang's fp8 wo_a GEMM runs and wo_a stays fp8.
    from capdispatch.capabilities.catalog import simulate
    h100 = rigplan.build(shape, [simulate("h100")], tp=1, next_n=1)
    b200 = rigplan.build(shape, [simulate("b200")], tp=1, next_n=1)
    assert h100.ranks[0].memory.weight_bytes == sum(parts.values())
    assert b200.ranks[0].memory.weight_bytes < h100.ranks[0].memory.weight_bytes


def test_wo_a_stays_fp8_only_where_sglangs_fp8_gemm_runs():
    shape = _flash_layers(4)
    rank = shape.for_rank(1, next_n=1)
    bf16 = {p.name: p.bytes for p in mem.weight_parts(shape, rank)}
    fp8 = {p.name: p.bytes for p in mem.weight_parts(shape, rank, fp8_wo_a=True)}
    rows, cols = shape.heads * shape.head_dim // shape.o_groups, shape.o_groups * shape.o_lora_rank
    scales = -(-rows // 128) * -(-cols // 128) * mem.SCALE_BYTES
    assert bf16["attention and shared-expert linears"] - fp8["attention and shared-expert linears"] == \
        4 * (rows * cols - scales)
    assert "wo_a as bf16" in mem.weight_parts(shape, rank)[1].note
    from capdispatch.capabilities.spec import DeviceSpec
    assert [rigplan.fp8_wo_a(DeviceSpec(id="x", name="x", platform="cuda", cc=cc)) for cc in
            ((8, 6), (9, 0), (10, 0), (12, 0))] == [False, False, True, False]
    assert rigplan.fp8_wo_a(DeviceSpec(id="cpu", name="cpu", platform="cpu")) is False


@pytest.mark.parametrize("override,tables", [
    ({}, 2),
    ({"compress_rope_theta": 10000}, 1),               # one base: one pair of tables
    ({"compress_ratios": [0, 0, 0, 0, 0]}, 1),       # window layers only
])
def test_rope_tables_are_one_pair_per_distinct_base(override, tables):
    shape = _flash_layers(4, **override)
    assert mem.rope_bytes(shape, shape.layer_ratios) == tables * (2 * 256 << 20)


def test_rope_tables_without_yarn_span_max_position_embeddings():
    shape = _flash_layers(2, rope_scaling=None, max_position_embeddings=4096)
    assert shape.rope_original is None and shape.rope_factor == 1.0
    assert mem.rope_bytes(shape, (0,)) == 4096 * 32 * 8 + 4096 * 64 * 4


@pytest.mark.parametrize("override,message", [
    ({"rope_scaling": {"factor": 0, "original_max_position_embeddings": 65536}},
     "rope_scaling.factor 0 is not valid; valid: a positive number up to 1024"),
    ({"rope_scaling": {"factor": 16, "original_max_position_embeddings": -1}},
     "rope_scaling.original_max_position_embeddings -1 is not valid; valid: a positive integer"),
    ({"rope_scaling": "yarn"}, "rope_scaling 'yarn' is not valid; valid: an object"),
    ({"rope_theta": float("nan")}, "rope_theta nan is not valid; valid: a positive number"),
    ({"compress_rope_theta": True}, "compress_rope_theta True is not valid; valid: a positive number"),
])
def test_bad_rope_fields_are_named(override, message):
    from capdispatch.models.errors import ModelError
    with pytest.raises(ModelError) as e:
        _flash_layers(2, **override)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
