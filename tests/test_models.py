"""The model-shape record: built-ins, config.json loading, SGLang's DeepSeek-V4 sharding,
`dispatch model`."""
import json
import subprocess
import sys

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import capdispatch as cd
from capdispatch.dispatch.errors import BadInput
from capdispatch.errors import CapdispatchError
from capdispatch.models import (Layout, ModelError, RankShape, builtin_entry, builtin_names,
                                load_model)

# The published config.json facts (huggingface.co/deepseek-ai/DeepSeek-V4-{Flash,Pro}).
PUBLISHED = {
    "deepseek-v4-flash": dict(layers=43, hidden=4096, vocab=129280, heads=64, head_dim=512,
                              rope_dim=64, o_groups=8, indexer_heads=64, indexer_dim=128,
                              index_topk=512, window=128, experts=256, experts_per_token=6,
                              moe_intermediate=2048, shared_experts=1, dense_layers=0,
                              hash_layers=3, mtp=1, swiglu_limit=10.0),
    "deepseek-v4-pro": dict(layers=61, hidden=7168, vocab=129280, heads=128, head_dim=512,
                            rope_dim=64, o_groups=16, indexer_heads=64, indexer_dim=128,
                            index_topk=1024, window=128, experts=384, experts_per_token=6,
                            moe_intermediate=3072, shared_experts=1, dense_layers=0,
                            hash_layers=3, mtp=1, swiglu_limit=10.0),
}

# The names the KV and MoE builders code against.
RANK_FIELDS = {"model", "tp", "ep", "dp_attention", "layers", "heads", "head_dim", "indexer_heads",
               "indexer_dim", "index_topk", "window", "next_n", "experts", "experts_total", "topk",
               "hidden", "moe_intermediate", "swiglu_limit", "kv_bytes_per_token"}


def flash_config() -> dict:
    return json.loads(json.dumps(builtin_entry("deepseek-v4-flash")["config"]))


def write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return path


# --- built-ins -------------------------------------------------------------------------------

def test_builtins_are_listed():
    assert {"deepseek-v4-flash", "deepseek-v4-pro"} <= set(builtin_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_loads_with_published_facts(name):
    shape = load_model(name)
    for field, want in PUBLISHED[name].items():
        assert getattr(shape, field) == want, field
    assert shape.nope_dim == 448
    assert len(shape.compress_ratios) == shape.layers + shape.mtp
    assert set(shape.layer_ratios) <= {0, 4, 128}
    assert shape.source.startswith("built-in: https://huggingface.co/deepseek-ai/")
    fmt = {f.kind: f for f in shape.formats}
    assert (fmt["routed_experts"].dtype, fmt["routed_experts"].scale,
            fmt["routed_experts"].block) == ("mxfp4", "e8m0", (1, 32))
    assert (fmt["linear"].dtype, fmt["linear"].scale, fmt["linear"].block) == (
        "fp8_e4m3", "ue8m0", (128, 128))
    assert fmt["unquantized"].dtype == "bf16"


def test_layer_kinds_of_the_builtins():
    flash, pro = load_model("deepseek-v4-flash"), load_model("deepseek-v4-pro")
    assert flash.for_rank().layers_by_ratio == {0: 2, 4: 21, 128: 20}
    assert pro.for_rank().layers_by_ratio == {4: 30, 128: 31}


def test_builtin_name_is_case_insensitive():
    assert load_model("DeepSeek-V4-Flash") == load_model("deepseek-v4-flash")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_json_round_trip_equals_builtin(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    path = write(folder, builtin_entry(name)["config"])
    builtin = load_model(name)
    for arg in (path, str(path), str(folder)):
        shape = load_model(arg)
        assert shape.name == name and shape.source == str(path)
        assert attrs.evolve(shape, name=builtin.name, source=builtin.source) == builtin


# --- bad configs -----------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["num_hidden_layers", "num_attention_heads", "head_dim",
                                 "index_topk", "sliding_window", "n_routed_experts",
                                 "moe_intermediate_size", "o_groups"])
def test_missing_field_is_named(tmp_path, key):
    cfg = flash_config()
    del cfg[key]
    path = write(tmp_path, cfg)
    with pytest.raises(ModelError) as exc:
        load_model(path)
    msg = str(exc.value)
    assert str(path) in msg and f"missing field {key}" in msg


@pytest.mark.parametrize("key,value,valid", [
    ("num_attention_heads", "64", "positive integer"),
    ("num_attention_heads", -64, "positive integer"),
    ("num_hidden_layers", 0, "positive integer"),
    ("n_routed_experts", 2.5, "positive integer"),
    ("num_experts_per_tok", True, "positive integer"),
    ("n_shared_experts", -1, "integer >= 0"),
    ("num_nextn_predict_layers", -1, "integer >= 0"),
    ("num_experts_per_tok", 300, "at most n_routed_experts = 256"),
    ("qk_rope_head_dim", 512, "less than head_dim 512"),
    ("o_groups", 7, "a divisor of num_attention_heads = 64"),
    ("swiglu_limit", -1.0, "positive number"),
    ("swiglu_limit", "10", "positive number"),
    ("compress_ratios", [0, 3], "each one of 0, 4, 128"),
    ("compress_ratios", [0, 2], "each one of 0, 4, 128"),
    ("compress_ratios", [4] * 10, "at least num_hidden_layers = 43 entries"),
    ("compress_ratios", "4", "a list of per-layer ratios"),
    ("model_type", "deepseek_v3", "deepseek_v4"),
    ("num_key_value_heads", 8, "1 (V4 attention is MQA"),
    ("expert_dtype", "int4", "fp4"),
    ("quantization_config", {"fmt": "e4m3"}, "quant_method"),
])
def test_invalid_field_is_named_with_value_and_valid(tmp_path, key, value, valid):
    cfg = flash_config()
    cfg[key] = value
    path = write(tmp_path, cfg)
    with pytest.raises(ModelError) as exc:
        load_model(path)
    msg = str(exc.value)
    assert str(path) in msg and key in msg and valid in msg
    assert repr(value)[:20] in msg


def test_every_single_missing_key_is_an_error_or_loads(tmp_path):
    """Never a KeyError or a traceback: each published key removed either loads (an optional
    field) or is a ModelError naming it."""
    base = flash_config()
    for key in base:
        cfg = dict(base)
        del cfg[key]
        path = write(tmp_path, cfg)
        try:
            load_model(path)
        except ModelError as exc:
            assert key in str(exc)


@pytest.mark.parametrize("text,want", [("{\"a\": 1,,}", ":1:"), ("[1, 2]", "not a JSON object"),
                                       ("", "not valid JSON")])
def test_unreadable_config(tmp_path, text, want):
    path = write(tmp_path, text)
    with pytest.raises(ModelError, match=want):
        load_model(path)


def test_unknown_name_and_folder_without_config(tmp_path):
    with pytest.raises(ModelError, match="did you mean 'deepseek-v4-flash'"):
        load_model("deepseek-v4-flsh")
    with pytest.raises(ModelError, match="without a config.json"):
        load_model(tmp_path)


def test_model_error_is_bad_input():
    assert issubclass(ModelError, BadInput)
    assert issubclass(ModelError, CapdispatchError) and issubclass(ModelError, ValueError)
    assert cd.ModelError is ModelError and cd.load_model is load_model


# --- sharding --------------------------------------------------------------------------------

def test_rank_shape_has_the_contract_fields():
    assert RANK_FIELDS <= {f.name for f in attrs.fields(RankShape)}


@pytest.mark.parametrize("name,tp,ep,dpa,heads,experts,inter", [
    ("deepseek-v4-flash", 1, 1, False, 64, 256, 2048),
    ("deepseek-v4-flash", 8, 1, False, 8, 256, 256),
    ("deepseek-v4-flash", 8, 8, False, 8, 32, 2048),
    ("deepseek-v4-flash", 8, 8, True, 64, 32, 2048),
    ("deepseek-v4-flash", 4, 2, False, 16, 128, 1024),
    ("deepseek-v4-pro", 8, 1, False, 16, 384, 384),
    ("deepseek-v4-pro", 8, 8, True, 128, 48, 3072),
    ("deepseek-v4-pro", 16, 16, False, 8, 24, 3072),
])
def test_rank_shapes(name, tp, ep, dpa, heads, experts, inter):
    r = load_model(name).for_rank(tp, ep, dpa)
    assert (r.model, r.tp, r.ep, r.dp_attention) == (name, tp, ep, dpa)
    assert (r.heads, r.experts, r.moe_intermediate) == (heads, experts, inter)
    facts = PUBLISHED[name]
    # Replicated on every rank, whatever the layout.
    assert (r.indexer_heads, r.indexer_dim, r.index_topk, r.window) == (
        64, 128, facts["index_topk"], 128)
    assert (r.layers, r.hidden, r.topk, r.experts_total, r.head_dim) == (
        facts["layers"], facts["hidden"], 6, facts["experts"], 512)
    assert r.swiglu_limit == 10.0 and r.kv_bytes_per_token == 584
    assert r.indexer_bytes_per_token == 132
    assert r.next_n == 2


def test_next_n_override_and_refusal():
    shape = load_model("deepseek-v4-flash")
    assert shape.for_rank(next_n=4).next_n == 4
    assert attrs.evolve(shape, mtp=0).for_rank().next_n == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ModelError, match="next_n"):
            shape.for_rank(next_n=bad)


@pytest.mark.parametrize("tp,ep,dpa,words,layouts", [
    (3, 1, False, "heads 64 do not divide over tp 3",
     [(1, 1), (2, 1), (4, 1), (8, 1)]),
    (16, 1, False, "o_groups) 8 do not divide over tp 16", [(1, 1), (2, 1), (4, 1), (8, 1)]),
    (8, 3, False, "ep 3 does not divide tp 8", [(8, 1), (8, 2), (8, 4), (8, 8)]),
    (4, 8, False, "ep 8 does not divide tp 4", [(4, 1), (4, 2), (4, 4)]),
    (0, 1, False, "tp 0 is not a rank count", [(1, 1), (2, 1), (4, 1), (8, 1)]),
    (8, 0, False, "ep 0 is not a rank count", [(8, 1), (8, 2), (8, 4), (8, 8)]),
])
def test_refused_layouts_name_numbers_and_working_layouts(tp, ep, dpa, words, layouts):
    shape = load_model("deepseek-v4-flash")
    with pytest.raises(ModelError) as exc:
        shape.for_rank(tp, ep, dpa)
    assert words in str(exc.value)
    assert [(lay.tp, lay.ep) for lay in exc.value.layouts] == layouts
    for lay in exc.value.layouts:
        shape.for_rank(lay.tp, lay.ep, lay.dp_attention)


def _synthetic(heads, groups, experts, inter):
    cfg = flash_config()
    cfg.update(num_attention_heads=heads, o_groups=groups, n_routed_experts=experts,
               moe_intermediate_size=inter, num_experts_per_tok=1)
    from capdispatch.models.config import parse
    return parse(cfg, "synthetic", "synthetic", "synthetic")


def _divisor(n):
    return st.sampled_from([d for d in range(1, n + 1) if n % d == 0])


@st.composite
def models(draw):
    heads = draw(st.sampled_from([1, 3, 12, 16, 24, 64, 128]))
    return _synthetic(heads, draw(_divisor(heads)), draw(st.sampled_from([1, 6, 60, 64, 256, 384])),
                      draw(st.sampled_from([96, 512, 1536, 2048, 3072])))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(models(), st.integers(-1, 20), st.integers(-1, 20), st.booleans())
def test_sharding_laws(shape, tp, ep, dpa):
    try:
        r = shape.for_rank(tp, ep, dpa)
    except ModelError as exc:
        msg = str(exc)
        assert str(tp) in msg or str(ep) in msg
        assert exc.layouts, msg
        for lay in exc.layouts:          # only layouts that work are proposed
            shape.for_rank(lay.tp, lay.ep, lay.dp_attention)
        # ... and SGLang's divisibility rules are what made this one fail.
        attn_tp = 1 if dpa else tp
        assert tp < 1 or ep < 1 or shape.heads % attn_tp or shape.o_groups % attn_tp \
            or tp % ep or shape.experts % ep or shape.moe_intermediate % (tp // ep)
        return
    attn_tp = 1 if dpa else tp
    assert r.heads * attn_tp == shape.heads
    assert r.o_groups * attn_tp == shape.o_groups
    assert r.experts * ep == shape.experts == r.experts_total
    assert r.moe_intermediate * (tp // ep) == shape.moe_intermediate and tp % ep == 0
    assert r.indexer_heads == shape.indexer_heads


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(PUBLISHED)), st.sampled_from([1, 2, 4, 8]))
def test_heads_per_rank_times_tp_is_heads(name, tp):
    shape = load_model(name)
    r = shape.for_rank(tp)
    assert r.heads * tp == shape.heads and r.experts == shape.experts


def test_kv_bytes_per_request():
    r = load_model("deepseek-v4-flash").for_rank(8)
    # 43 sliding-window rings of 128 + 1 rows, 21 c4 layers of 256 rows plus their indexer
    # keys, 20 c128 layers of 8 rows; 584 bytes a row, 132 an indexer key.
    assert r.kv_bytes_per_request(1024) == 43 * 129 * 584 + 21 * 256 * (584 + 132) + 20 * 8 * 584
    assert r.kv_bytes_per_request(0) == 0
    # The KV is one latent per token: the same on every attention rank, whatever the TP.
    assert load_model("deepseek-v4-flash").for_rank(1).kv_bytes_per_request(1024) == \
        r.kv_bytes_per_request(1024)
    with pytest.raises(ModelError, match="context -1"):
        r.kv_bytes_per_request(-1)


def test_layout_record():
    assert str(Layout(8, 8, True)) == "tp 8 ep 8 dp-attention"


# --- the command -----------------------------------------------------------------------------

def test_cli_lists_builtins(run_cli):
    rc, out, err = run_cli("model")
    assert rc == 0, err
    assert "deepseek-v4-flash" in out and "deepseek-v4-pro" in out


def test_cli_text(run_cli):
    rc, out, err = run_cli("model", "deepseek-v4-flash", "--tp", "8")
    assert rc == 0, err
    assert "64 heads x head_dim 512 (448 nope + 64 rope)" in out
    assert "routed_experts: mxfp4, e8m0 scale per 1x32" in out
    assert "per rank at tp 8 ep 1" in out
    assert "attention TP 8 (DP 1): 8 heads x 512" in out
    assert "256 of 256 routed experts, intermediate 256, top-k 6" in out
    assert "next_n 2" in out and "584 B main pool" in out


def test_cli_json(run_cli, tmp_path):
    path = write(tmp_path, builtin_entry("deepseek-v4-pro")["config"])
    rc, out, err = run_cli("model", str(path), "--tp", "8", "--ep", "8", "--dp-attention",
                           "--next-n", "3", "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["model"]["experts"] == 384 and doc["model"]["source"] == str(path)
    assert doc["model"]["formats"]["routed_experts"] == {"dtype": "mxfp4", "scale": "e8m0",
                                                        "block": [1, 32]}
    rank = doc["rank"]
    assert RANK_FIELDS <= set(rank)
    assert (rank["heads"], rank["experts"], rank["moe_intermediate"], rank["next_n"]) == (
        128, 48, 3072, 3)
    assert doc["refusal"] is None


def test_cli_refusal_exits_2(run_cli):
    rc, out, err = run_cli("model", "deepseek-v4-flash", "--tp", "3")
    assert rc == 2
    assert "heads 64 do not divide over tp 3; tp 1, 2, 4, 8 would" in err
    assert "Traceback" not in err and "layers 43" in out
    rc, out, err = run_cli("model", "deepseek-v4-flash", "--tp", "8", "--ep", "3",
                           "--format", "json")
    assert rc == 2
    doc = json.loads(out)
    assert doc["rank"] is None
    assert [lay["ep"] for lay in doc["refusal"]["layouts"]] == [1, 2, 4, 8]


def test_cli_bad_model_exits_2(run_cli, tmp_path):
    rc, _, err = run_cli("model", "no-such-model")
    assert rc == 2 and "neither a built-in model nor an existing file" in err
    cfg = flash_config()
    cfg["num_attention_heads"] = "sixty-four"
    rc, _, err = run_cli("model", str(write(tmp_path, cfg)))
    assert rc == 2 and "num_attention_heads 'sixty-four' is not valid" in err
    assert "Traceback" not in err


def test_no_torch_import():
    code = ("import sys\n"
            "import capdispatch as cd\n"
            "import capdispatch.models\n"
            "cd.load_model('deepseek-v4-pro').for_rank(8, 8, True)\n"
            "from capdispatch.dispatch.cli import main\n"
            "import io, contextlib\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['model', 'deepseek-v4-flash', '--tp', '4']) == 0\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
