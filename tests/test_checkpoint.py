"""`dispatch checkpoint`: a random-weight DeepSeek-V4 folder SGLang loads.

A small config.json written here (hidden 256, 8 experts, 4 heads, vocab 512) is cut to 2
layers: the config is cut right, the index lists every tensor once, the names, dtypes and
shapes are the real checkpoint's (the formulas of its published layout, written out here),
the values are finite and scaled 1/sqrt(fan_in), the same seed writes the same bytes; SGLang's
own name mapping (read from each release's source) loads every tensor into a param and
leaves no param unloaded, and its MXFP4 probe says MXFP4; bad input is one line, exit 2,
and nothing is left behind.
"""
import errno
import hashlib
import json
import math
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")

import sglang_weight_names as sgl                            # noqa: E402
from sglang_releases import RELEASES                         # noqa: E402

from capdispatch.dispatch import cli                         # noqa: E402
from capdispatch.models import checkpoint as ck              # noqa: E402
from capdispatch.models import load_model                    # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
    "num_hidden_layers": 4, "num_nextn_predict_layers": 1, "compress_ratios": [4, 128, 0, 4, 0],
    "hidden_size": 256, "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 192, "o_lora_rank": 128, "o_groups": 2,
    "index_n_heads": 4, "index_head_dim": 128, "index_topk": 64, "sliding_window": 128,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3, "moe_intermediate_size": 96,
    "num_hash_layers": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu",
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "compress_rope_theta": 160000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}


def _config(tmp_path, cfg=None, name="small"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL if cfg is None else cfg))
    return str(folder / "config.json")


def _cli(capsys, *args):
    rc = cli.main(["checkpoint", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    cfg = _config(base)
    out = {}
    for key, seed in (("a", 3), ("b", 3), ("c", 4)):
        assert cli.main(["checkpoint", "--model", cfg, "--layers", "2", "--out", str(base / key),
                         "--seed", str(seed), "--format", "json"]) == 0
    return {k: str(base / k) for k in "abc"}


def _tensors(folder):
    from safetensors import safe_open
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(folder, shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return index, out


# ------------------------------------------------------------------ the real checkpoint's layout

def spec(cfg: dict) -> dict:
    """{name: (safetensors dtype, shape)} of DeepSeek-V4's checkpoint for CFG, from its
    published layout: fp8 linears F8_E4M3 + F8_E8M0 scale per 128x128 block; MXFP4 experts
    I8 [out, in/2] + F8_E8M0 [out, in/32]; compressors bf16; mixers, sinks, position biases,
    router bias F32; hash routes I64."""
    H, V, nh, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, ol, og = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    ih, ihd, E, inter = cfg["index_n_heads"], cfg["index_head_dim"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    hc, k = cfg["hc_mult"], cfg["num_experts_per_tok"]
    c = lambda n: -(-n // 128)                                       # noqa: E731
    out = {}

    def fp8(p, o, i):
        out[f"{p}.weight"] = ("F8_E4M3", [o, i])
        out[f"{p}.scale"] = ("F8_E8M0", [c(o), c(i)])

    def fp4(p, o, i):
        out[f"{p}.weight"] = ("I8", [o, i // 2])
        out[f"{p}.scale"] = ("F8_E8M0", [o, i // 32])

    def comp(p, r, d):
        coff = 2 if r == 4 else 1
        out[f"{p}.ape"] = ("F32", [r, coff * d])
        out[f"{p}.wkv.weight"] = out[f"{p}.wgate.weight"] = ("BF16", [coff * d, H])
        out[f"{p}.norm.weight"] = ("BF16", [d])

    def mix(p, part, rows, scales):
        out[f"{p}hc_{part}_fn"] = ("F32", [rows, hc * H])
        out[f"{p}hc_{part}_base"] = ("F32", [rows])
        out[f"{p}hc_{part}_scale"] = ("F32", [scales])

    def block(p, ratio, hashed):
        out[f"{p}.attn.attn_sink"] = ("F32", [nh])
        fp8(f"{p}.attn.wq_a", ql, H)
        out[f"{p}.attn.q_norm.weight"] = ("BF16", [ql])
        fp8(f"{p}.attn.wq_b", nh * hd, ql)
        fp8(f"{p}.attn.wkv", hd, H)
        out[f"{p}.attn.kv_norm.weight"] = ("BF16", [hd])
        fp8(f"{p}.attn.wo_a", og * ol, nh * hd // og)
        fp8(f"{p}.attn.wo_b", H, og * ol)
        if ratio:
            comp(f"{p}.attn.compressor", ratio, hd)
        if ratio == 4:
            fp8(f"{p}.attn.indexer.wq_b", ih * ihd, ql)
            out[f"{p}.attn.indexer.weights_proj.weight"] = ("BF16", [ih, H])
            comp(f"{p}.attn.indexer.compressor", 4, ihd)
        out[f"{p}.attn_norm.weight"] = out[f"{p}.ffn_norm.weight"] = ("BF16", [H])
        mix(f"{p}.", "attn", (2 + hc) * hc, 3)
        mix(f"{p}.", "ffn", (2 + hc) * hc, 3)
        out[f"{p}.ffn.gate.weight"] = ("BF16", [E, H])
        if hashed:
            out[f"{p}.ffn.gate.tid2eid"] = ("I64", [V, k])
        else:
            out[f"{p}.ffn.gate.bias"] = ("F32", [E])
        for e in range(E):
            fp4(f"{p}.ffn.experts.{e}.w1", inter, H)
            fp4(f"{p}.ffn.experts.{e}.w2", H, inter)
            fp4(f"{p}.ffn.experts.{e}.w3", inter, H)
        s = cfg["n_shared_experts"] * inter
        fp8(f"{p}.ffn.shared_experts.w1", s, H)
        fp8(f"{p}.ffn.shared_experts.w2", H, s)
        fp8(f"{p}.ffn.shared_experts.w3", s, H)

    out["embed.weight"] = out["head.weight"] = ("BF16", [V, H])
    out["norm.weight"] = ("BF16", [H])
    mix("", "head", hc, 1)
    for i in range(cfg["num_hidden_layers"]):
        block(f"layers.{i}", cfg["compress_ratios"][i], i < cfg["num_hash_layers"])
    block("mtp.0", 0, False)
    fp8("mtp.0.e_proj", H, H)
    fp8("mtp.0.h_proj", H, H)
    for n in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{n}.weight"] = ("BF16", [H])
    mix("mtp.0.", "head", hc, 1)
    return out


TORCH_NAME = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8",
              torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _scale(s):
    return torch.exp2(s.view(torch.uint8).float() - 127)


def _dequant(name, t, tensors):
    """The dequantised float values of an F8_E4M3 or I8 weight, with its fan-in."""
    s = _scale(tensors[name[:-len("weight")] + "scale"])
    if t.dtype == torch.float8_e4m3fn:
        full = s.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
        return t.float() * full, t.shape[1]
    b = t.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], -1).reshape(t.shape[0], -1)
    return E2M1[codes] * s.repeat_interleave(32, 1), codes.shape[1]


# ------------------------------------------------------------------ 1. what is written

def test_a_small_checkpoint_is_written_in_seconds_with_the_config_cut(written):
    cfg = json.load(open(os.path.join(written["a"], "config.json")))
    assert cfg["num_hidden_layers"] == 2 and cfg["num_nextn_predict_layers"] == 1
    assert cfg["compress_ratios"] == [4, 128, 0]          # the first 2 and the next-n layer's
    assert {k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "compress_ratios")} == \
        {k: v for k, v in SMALL.items() if k not in ("num_hidden_layers", "compress_ratios")}
    assert sorted(os.listdir(os.path.dirname(written["a"]))) == ["a", "b", "c", "small"]   # no temp folder


def test_the_index_lists_every_tensor_once_in_existing_shards(written):
    index, tensors = _tensors(written["a"])
    files = set(index["weight_map"].values())
    assert all(os.path.isfile(os.path.join(written["a"], f)) for f in files)
    assert set(index["weight_map"]) == set(tensors)
    assert len(files) == 4                                # globals, 2 layers, next-n
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # Every name once across the shards, and the index's shard is the one holding it.
    from safetensors import safe_open
    seen = []
    for f in files:
        with safe_open(os.path.join(written["a"], f), "pt") as h:
            seen += [(k, f) for k in h.keys()]
    assert sorted(seen) == sorted(index["weight_map"].items())


def test_names_dtypes_and_shapes_are_the_real_checkpoints(written):
    cfg = json.load(open(os.path.join(written["a"], "config.json")))
    _, tensors = _tensors(written["a"])
    got = {k: (TORCH_NAME[t.dtype], list(t.shape)) for k, t in tensors.items()}
    want = spec(cfg)
    assert set(got) - set(want) == set() and set(want) - set(got) == set()
    assert {k: v for k, v in got.items() if want[k] != v} == {}


def test_values_are_finite_and_scaled_for_their_fan_in(written):
    _, tensors = _tensors(written["a"])
    zero_by_design = re.compile(r"(attn_sink|hc_\w+_base)$")
    for name, t in tensors.items():
        if t.dtype in (torch.float8_e4m3fn, torch.int8):
            x, fan_in = _dequant(name, t, tensors)
        elif name.endswith(".scale"):
            b = t.view(torch.uint8)
            assert int(b.min()) >= 100 and int(b.max()) <= 128, name       # powers of two, no NaN byte
            continue
        elif t.dtype == torch.int64:
            experts = SMALL["n_routed_experts"]
            assert int(t.min()) >= 0 and int(t.max()) < experts, name
            assert all(len(set(row)) == len(row) for row in t.tolist()), name     # distinct per token
            assert torch.bincount(t.flatten(), minlength=experts).min() > 0, name
            continue
        else:
            x, fan_in = t.float(), None
        assert torch.isfinite(x).all(), name
        if zero_by_design.search(name):
            continue
        assert x.abs().max() > 0, name
        if fan_in is not None or (t.dtype == torch.bfloat16 and t.dim() == 2 and name != "embed.weight"):
            fan_in = fan_in or t.shape[1]
            ratio = float(x.std()) * math.sqrt(fan_in)
            assert 0.5 <= ratio <= 2, (name, ratio)
        if name.endswith("norm.weight"):
            assert bool((x == 1).all()), name


def test_the_same_seed_writes_the_same_bytes(written):
    def digest(folder):
        return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
                for f in sorted(os.listdir(folder))}
    assert digest(written["a"]) == digest(written["b"])
    a, c = digest(written["a"]), digest(written["c"])
    assert a["config.json"] == c["config.json"] and a != c


def test_planning_imports_no_torch():
    code = ("import sys; from capdispatch.models import load_model; "
            "from capdispatch.models.checkpoint import plan, source_config; "
            "s = load_model('deepseek-v4-flash'); c, w = source_config('deepseek-v4-flash'); "
            "p = plan(s, c, w, 43); assert 'torch' not in sys.modules; print(p.tensors, p.nbytes)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    tensors, nbytes = map(int, out.stdout.split())
    assert tensors == 69187 and 148 * 2 ** 30 < nbytes < 149 * 2 ** 30     # the published size


def test_the_built_ins_carry_what_sglang_needs_and_cut_right():
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        shape = load_model(name)
        cfg, where = ck.source_config(name)
        p = ck.plan(shape, cfg, where, 3)
        assert p.config["num_hidden_layers"] == 3
        assert p.config["compress_ratios"] == list(shape.compress_ratios[:3] + shape.compress_ratios[shape.layers:])
        assert all(key in p.config for key, *_ in ck.NEEDED)
    flash = ck.plan(load_model("deepseek-v4-flash"), *ck.source_config("deepseek-v4-flash"), 4)
    assert flash.config["routed_scaling_factor"] == 1.5
    # Full width: the model's own sizes, a layer of ~3.3 GiB.
    layer = flash.shards[1]
    assert len(layer.tensors) == 1565 and 3.3 < layer.nbytes / 2 ** 30 < 3.4


# ------------------------------------------------------------------ 2. SGLang's own mapping

@pytest.fixture(scope="module", params=RELEASES)
def sglang(request):
    return request.param, sgl.load(request.param)


def test_sglang_loads_every_tensor_into_a_param_and_every_param(sglang, written):
    release, ns = sglang
    cfg = json.load(open(os.path.join(written["a"], "config.json")))
    tensors = sgl.folder_tensors(written["a"])
    assert sgl.problems(ns, tensors, cfg) == [], release
    # Every tensor lands somewhere (the main model or the draft); the draft skips only the
    # target's own layers, embedding and head.
    main = sgl.route(ns, tensors, cfg, nextn=False)
    draft = sgl.route(ns, tensors, cfg, nextn=True)
    assert {k for k in tensors if main[k] is None and draft[k] is None} == set()
    assert {k for k in tensors if main[k] is None} == {k for k in tensors if k.startswith("mtp.")}


def test_sglang_probes_the_experts_as_mxfp4(sglang, written):
    release, ns = sglang
    assert ns["probe_routed_expert_weight_dtype"](written["a"]) in ("I8", "U8", "F4"), release
    assert ns["probe_routed_expert_weight_dtype"](written["a"]) == "I8"


def test_sglang_accepts_the_full_width_names(sglang):
    release, ns = sglang
    p = ck.plan(load_model("deepseek-v4-flash"), *ck.source_config("deepseek-v4-flash"), 4)
    tensors = {t.name: t.dtype for s in p.shards for t in s.tensors}
    assert sgl.problems(ns, tensors, p.config) == [], release


def test_the_check_fails_on_a_wrong_name_a_missing_tensor_or_dtype(sglang, written):
    _, ns = sglang
    cfg = json.load(open(os.path.join(written["a"], "config.json")))
    good = sgl.folder_tensors(written["a"])
    renamed = dict(good)
    renamed["layers.0.attn.wq_a.weight_x"] = renamed.pop("layers.0.attn.wq_a.weight")
    found = sgl.problems(ns, renamed, cfg)
    assert any("wq_a.weight_x" in p and "not found in params_dict" in p for p in found), found
    assert any("wqkv_a.weight lacks parts ['q']" in p for p in found), found
    dropped = {k: v for k, v in good.items() if k != "layers.1.ffn.gate.bias"}
    assert any("e_score_correction_bias is not initialized" in p for p in sgl.problems(ns, dropped, cfg))
    expert = {k: v for k, v in good.items() if k != "layers.1.ffn.experts.5.w3.scale"}
    assert any("w13_weight_scale_inv lacks parts [\"(5, 'w3')\"]" in p for p in sgl.problems(ns, expert, cfg))
    typo = dict(good)
    typo["layers.0.ffn.experts.0.w4.weight"] = typo.pop("layers.0.ffn.experts.0.w3.weight")
    assert any("experts.0.w4.weight" in p and "not found" in p for p in sgl.problems(ns, typo, cfg))
    # A quantized compressor trips load_weights' compressor assert (it takes bf16 wkv + wgate).
    quantized = dict(good, **{"layers.0.attn.compressor.wkv.scale": "F8_E8M0"})
    assert any("wkv_gate.weight" in p for p in sgl.problems(ns, quantized, cfg))
    wo_a = dict(good, **{"layers.0.attn.wo_a.weight": "BF16"})
    assert any("takes F8_E4M3" in p for p in sgl.problems(ns, wo_a, cfg))
    u8 = dict(good, **{"layers.0.ffn.experts.0.w1.weight": "U8"})
    assert any("takes I8" in p for p in sgl.problems(ns, u8, cfg))


# ------------------------------------------------------------------ 3. bad input

def _one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dispatch: error: ") and "Traceback" not in err, err
    return lines[0]


def test_an_existing_non_empty_out_is_refused_and_untouched(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = _cli(capsys, "--model", _config(tmp_path), "--layers", "2", "--out", str(out))
    assert rc == 2 and "is not empty" in _one_line(err)
    assert os.listdir(out) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["out", "small"]
    (tmp_path / "file").write_text("x")
    rc, _, err = _cli(capsys, "--model", _config(tmp_path, name="s2"), "--layers", "1", "--out", str(tmp_path / "file"))
    assert rc == 2 and "not a folder" in _one_line(err)


def test_an_empty_out_folder_is_filled(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    rc, text, err = _cli(capsys, "--model", _config(tmp_path), "--layers", "1", "--out", str(out))
    assert rc == 0, err
    assert "config.json" in os.listdir(out) and "--skip-tokenizer-init" in text
    assert "do not load the next-n (MTP) draft" in text          # --layers 1 with an MTP layer


@pytest.mark.parametrize("layers,want", [("0", "--layers 0: expected an integer >= 1"),
                                         ("5", "--layers 5: expected 1 to 4"),
                                         ("x", "--layers x: expected an integer >= 1")])
def test_layers_out_of_range_is_refused_before_any_work(tmp_path, capsys, layers, want):
    rc, _, err = _cli(capsys, "--model", _config(tmp_path), "--layers", layers, "--out", str(tmp_path / "o"))
    assert rc == 2 and want in err.strip().splitlines()[-1], err
    assert sorted(os.listdir(tmp_path)) == ["small"]


def test_an_unknown_model_gets_a_did_you_mean(tmp_path, capsys):
    rc, _, err = _cli(capsys, "--model", "deepseek-v4-flsh", "--layers", "2", "--out", str(tmp_path / "o"))
    assert rc == 2 and "did you mean 'deepseek-v4-flash'" in _one_line(err)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("field", ["hc_mult", "rope_scaling", "routed_scaling_factor", "expert_dtype",
                                   "quantization_config"])
def test_a_config_missing_a_needed_field_is_refused_naming_it(tmp_path, capsys, field):
    cfg = {k: v for k, v in SMALL.items() if k != field}
    rc, _, err = _cli(capsys, "--model", _config(tmp_path, cfg), "--layers", "2", "--out", str(tmp_path / "o"))
    line = _one_line(err)
    assert rc == 2 and field in line and "config.json" in line, line
    assert sorted(os.listdir(tmp_path)) == ["small"]


def test_a_config_the_checkpoint_cannot_hold_is_refused(tmp_path, capsys):
    cfg = dict(SMALL, moe_intermediate_size=100)
    rc, _, err = _cli(capsys, "--model", _config(tmp_path, cfg), "--layers", "2", "--out", str(tmp_path / "o"))
    assert rc == 2 and "moe_intermediate_size 100" in _one_line(err)


def test_an_unwritable_parent_is_one_line(tmp_path, capsys, monkeypatch):
    rc, _, err = _cli(capsys, "--model", _config(tmp_path), "--layers", "1", "--out", str(tmp_path / "no" / "o"))
    assert rc == 2 and "does not exist" in _one_line(err)

    def refuse(path, *a, **kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    cfg = _config(tmp_path, name="s2")
    monkeypatch.setattr(ck.writer.os, "mkdir", refuse)        # as a read-only parent answers
    rc, _, err = _cli(capsys, "--model", cfg, "--layers", "1", "--out", str(tmp_path / "o"))
    monkeypatch.undo()
    line = _one_line(err)
    assert rc == 2 and str(tmp_path) in line and "Permission denied" in line, line
    assert not (tmp_path / "o").exists()


def test_a_write_failure_midway_leaves_nothing(tmp_path, capsys, monkeypatch):
    real, calls = ck.writer.write_shard, []

    def failing(path, shard, seed):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, shard, seed)
    monkeypatch.setattr(ck.writer, "write_shard", failing)
    rc, _, err = _cli(capsys, "--model", _config(tmp_path), "--layers", "2", "--out", str(tmp_path / "o"))
    line = _one_line(err)
    assert rc == 2 and "No space left on device" in line and calls[1] in line, line
    assert sorted(os.listdir(tmp_path)) == ["small"]          # no DIR, no temporary folder


def test_no_space_for_the_plan_is_refused_before_writing(tmp_path, capsys, monkeypatch):
    import shutil
    monkeypatch.setattr(ck.writer.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 1000))
    rc, _, err = _cli(capsys, "--model", _config(tmp_path), "--layers", "2", "--out", str(tmp_path / "o"))
    assert rc == 2 and "free; the checkpoint needs" in _one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["small"]


def test_without_torch_one_line_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    rc, _, err = _cli(capsys, "--model", _config(tmp_path), "--layers", "1", "--out", str(tmp_path / "o"))
    assert rc == 2 and "pip install 'capdispatch[torch]'" in _one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["small"]


def test_one_layer_loads_but_its_next_n_draft_does_not(sglang, tmp_path, capsys):
    """Why the command warns against MTP at --layers 1: SGLang's next-n loader takes layer id 0
    when num_hidden_layers is 1, while the remap sends mtp.0.* to layer 1."""
    _, ns = sglang
    assert _cli(capsys, "--model", _config(tmp_path), "--layers", "1", "--out", str(tmp_path / "o"))[0] == 0
    cfg = json.load(open(tmp_path / "o" / "config.json"))
    found = sgl.problems(ns, sgl.folder_tensors(str(tmp_path / "o")), cfg)
    assert found and all(p.startswith("next-n draft: ") for p in found), found
    assert any("model.e_proj.weight is not initialized" in p for p in found)
