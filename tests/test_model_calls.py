"""The model declaration (capdispatch/models/calls.yaml): what a model calls of the ops, on
which layers and at what size per phase, read once for plan --speed, the rehearsal and the
SGLang knob map, and refused with its file and line when it is wrong."""
from __future__ import annotations

import os

import pytest

import capdispatch as cd
from capdispatch.models import ModelError, calls as C


def test_the_declaration_names_every_builtin_op_once():
    from capdispatch.backends.registry import build
    declared = C.model_calls()
    # Every built-in op is a model op: one the declaration left out would be silently
    # neither predicted nor rehearsed.
    assert declared.ops == tuple(build(plugins=False).ops)
    assert declared.architecture == cd.load_model("deepseek-v4-pro").calls().architecture == C.ARCHITECTURE
    assert os.path.basename(declared.source).startswith("calls.yaml:")


def test_calls_per_forward_and_sizes_per_phase():
    flash = cd.load_model("deepseek-v4-flash")
    shape = flash.for_rank(4, 4, True)
    d = flash.calls()
    # The indexer runs on the c4 layers only: 21 of Flash's 43 (layers 2, 4, ..., 42).
    assert d.get("indexer").per_forward(shape) == 21 == sum(1 for r in flash.layer_ratios if r == 4)
    assert d.get("moe").per_forward(shape) == 43
    # Decode: the step's tokens are requests x next_n; sparse MLA decode one row per request.
    assert d.get("moe").size("decode", 8, 2) == 16 and d.get("decode_mla").size("decode", 8, 2) == 8
    assert d.get("decode_mla").size("prefill", 4096, 2) is None
    assert d.get("kv_dequant").size("decode", 8, 1) is None and d.get("kv_dequant").size("prefill", 64, 2) == 64
    decode = d.phase_ops("decode")
    assert {"kv_quant", "indexer", "decode_mla", "moe"} <= set(decode)
    assert "kv_dequant" not in decode and "sparse_prefill" not in decode
    assert d.get("row_scale") is None and "does not call op 'row_scale'" in d.not_called("row_scale")


def test_an_op_called_twice_per_layer_counts_twice_and_kv_pool_is_read(tmp_path):
    p = tmp_path / "calls.yaml"
    p.write_text("schema: 1\narchitectures:\n  A:\n"
                 "    moe: {layers: every, decode: tokens, per_layer: 2}\n"
                 "    indexer: {layers: compress_ratio 4, prefill: tokens, per_layer: 3, kv_pool: true}\n"
                 "    kv_quant: {layers: every, decode: tokens, kv_pool: false}\n")
    d = C.read(str(p))["A"]
    shape = cd.load_model("deepseek-v4-flash").for_rank(4, 4, True)
    assert d.get("moe").per_forward(shape) == 2 * 43 and d.get("moe").per_layer == 2
    assert d.get("indexer").per_forward(shape) == 3 * 21
    assert d.get("kv_quant").per_forward(shape) == 43 and d.get("kv_quant").per_layer == 1
    # The ops that run whatever the KV-cache dtype: those not on the KV pool.
    assert d.any_kv_cache_dtype == ("moe", "kv_quant")
    # The packaged declaration: the experts off the pool, the KV ops on it.
    packaged = C.model_calls()
    assert "moe" in packaged.any_kv_cache_dtype and "kv_quant" not in packaged.any_kv_cache_dtype


def test_the_knob_map_decides_the_declared_ops_and_lists_none_of_its_own(tmp_path):
    # The ops the plugin decides at a launch are the model declaration's, read from it: a knob
    # map that lists them itself, or names an architecture the declaration lacks, is refused.
    from capdispatch.adapters.sglang import knobs
    for release in knobs.load().releases:
        for arch, model in release.models.items():
            assert model.ops == C.model_calls(arch).ops, (release, arch)
    text = open(knobs.DEFAULT_PATH, encoding="utf-8").read()
    head = "      DeepseekV4ForCausalLM:\n"
    assert head in text
    listed = tmp_path / "listed.yaml"
    listed.write_text(text.replace(head, head + "        ops: [kv_quant]\n", 1))
    with pytest.raises(knobs.KnobsError, match=r"listed.yaml:\d+: .*models.DeepseekV4ForCausalLM: unknown key 'ops'"):
        knobs.load(str(listed))
    other = tmp_path / "other.yaml"
    other.write_text(text.replace(head, "      LlamaForCausalLM:\n", 1))
    with pytest.raises(knobs.KnobsError, match=r"other.yaml:\d+: releases\[0\].models.LlamaForCausalLM: .*declares no "
                                              r"calls of architecture 'LlamaForCausalLM'"):
        knobs.load(str(other))


@pytest.mark.parametrize("body, says", [
    ("    kv_quant: {layers: every, prefill: tokens}\n    kv_qaunt: {layers: every}\n",
     ":5: architectures.A: unknown op 'kv_qaunt'; did you mean 'kv_quant'?"),
    ("    moe: {layers: some, decode: tokens}\n", ":4: architectures.A.moe.layers: 'some' is not valid"),
    ("    moe: {layers: every}\n", ":4: architectures.A.moe: names no phase"),
    ("    moe: {layers: every, decode: rows}\n", ":4: architectures.A.moe.decode: 'rows' is not valid"),
    ("    moe: {layers: every, decode: tokens, scale: [head]}\n", "unknown shape 'head'; did you mean 'heads'?"),
    ("    moe: {layers: every, prefil: tokens}\n", "unknown key 'prefil'; did you mean 'prefill'?"),
    ("    moe: {layers: every, decode: tokens, per_layer: 0}\n",
     ":4: architectures.A.moe.per_layer: 0 is not valid (valid: an integer >= 1"),
    ("    moe: {layers: every, decode: tokens, per_layer: two}\n", "architectures.A.moe.per_layer must be an integer"),
    ("    moe: {layers: every, decode: tokens, kv_pool: maybe}\n", "architectures.A.moe.kv_pool must be true or false"),
])
def test_a_bad_declaration_is_refused_with_its_line(tmp_path, body, says):
    p = tmp_path / "calls.yaml"
    p.write_text("schema: 1\narchitectures:\n  A:\n" + body)
    with pytest.raises(ModelError) as e:
        C.read(str(p))
    assert says in str(e.value) and str(p) in str(e.value)


def test_an_architecture_without_a_declaration_is_refused(tmp_path):
    with pytest.raises(ModelError, match="declares no calls of architecture 'B'.*declared: DeepseekV4ForCausalLM"):
        C.model_calls("B")


def test_docs_models_table_is_the_declaration():
    # docs/models.md shows the declaration as a table: it says what calls.yaml says, row by row.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "models.md"), encoding="utf-8").read()
    table = text.split("## What the model calls", 1)[1].split("\n\n")[2].splitlines()[2:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    want = [[c.op, c.layers, str(c.per_layer), dict(c.sizes).get("prefill", ""), dict(c.sizes).get("decode", ""),
             ", ".join(c.scale), "yes" if c.kv_pool else ""] for c in C.model_calls().calls]
    assert rows == want
