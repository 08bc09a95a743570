"""The command-line reliability trial: generated hostile command lines through `dispatch`.

Each case runs alone, in a fresh temporary HOME (its cache and TMPDIR inside), under a
wall timeout, tagged by a marker variable so that every process it leaves is found in
/proc afterwards. A case is classified as an internal error (exit 1, "internal error" or a
Traceback), a hang, a leftover process or temp folder, a wrong exit code, a multi-line
error, an echo of huge input or raw control characters in the output.

    python tests/trial/cli_trial.py --count 3000 --seed 7 --out trial.md
    python tests/trial/cli_trial.py --quick --out trial.md

Not collected by pytest (its name does not start with test_); it is run by hand.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.set_int_max_str_digits(0)
ROOT = Path(__file__).resolve().parents[2]
MARK = "CLI_TRIAL_CASE"
BASE_CONFIG = json.loads((ROOT / "tests" / "rehearse" / "v4-tp3" / "config.json").read_text())
FAST_S, SLOW_S = 20, 90

# Characters no message should print raw: C0 and C1 controls but newline and tab, DEL,
# and the bidirectional overrides and isolates.
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u202a-\u202e\u2066-\u2069]")

# A Python warning a library prints at import (SGLang's on a CPU machine): not the error line.
PY_WARNING = re.compile(r"\S+\.py:\d+: \w*Warning: ")
HUGE = "9" * 5000
HOSTILE_TEXT = ["", " ", "\x1b[31mred\x1b[0m", "a\u202eb", "\x07bell", "x\ry", "\udcff",
                "é" * 3, "名前", "-", "--", ",", ",,", "a" * 100_000, "../../etc", "~",
                "$HOME", "*", "\t", "‮cpu"]
HOSTILE_NUMS = ["-1", "0", "-0", "", " ", "nan", "NaN", "inf", "-inf", "1e3", "1.5", "0x10",
                "+", "١٢", "1_0", HUGE, str(10 ** 18), str(-10 ** 18), "1e309", "abc",
                "\x1b[2J", "5\u202e", "9" * 400, "  3 "]
DEVICES_OK = ["sim:rtx-5090", "sim:rtx-3080", "sim:h200", "sim:h100", "sim:b200", "sim:sm_86",
              "sim:sm_90", "cpu"]
DEVICES_BAD = ["sim:bogus", "cuda:0", "cuda:-1", "cuda:" + str(10 ** 18), "sim:", "sim:sm_",
               "sim:sm_9999", "emu:rtx-5090@cpu", "", ",", "gpu", "sim:" + "x" * 100_000,
               "sim:rtx\x1b-5090", "sim:\u202eh200", "cuda:1e3", "sim:sm_-1", "cpu,"]
OPS_OK = ["kv_quant", "kv_dequant", "indexer", "sparse_prefill", "decode_mla", "moe"]
LIBS_OK = ["sglang-0.5.23", "local", "sglang-0.5.17"]
MODELS_OK = ["deepseek-v4-flash", "deepseek-v4-pro"]


class Case:
    """One command line: argv (with {tmp} for the case's folder), env additions, files to make,
    what a correct answer is ('ok': exit 0, 'bad': exit 2, 'any'), and how it is driven."""

    def __init__(self, cls, argv, *, expect="any", env=None, files=None, timeout=FAST_S,
                 sig=None, after=None, slow=False):
        self.cls, self.argv, self.expect = cls, list(argv), expect
        self.env, self.files = dict(env or {}), list(files or [])
        self.timeout, self.sig, self.after, self.slow = timeout, sig, after, slow


# ---------------------------------------------------------------- files a case makes
# Each entry: (relative path, kind, payload); kind: text, bytes, dir, fifo, link, mode.

def _yaml_inputs(rng):
    """(text, expect) of a policy file: valid ones and hostile ones."""
    good = ["schema: 1\nmixed_group: warn\n", "schema: 1\nops:\n  kv_quant: [torch]\n",
            "schema: 1\nverify: off\n", "schema: 1\nmixed_group: uniform\non_unsupported: downgrade\n"]
    bad = [
        "schema: 1\nops: &a [torch]\nmixed_group: *a\n",
        "a: &a [" + ",".join(["x"] * 50) + "]\nb: &b [" + ",".join(["*a"] * 50) + "]\n"
        "c: &c [" + ",".join(["*b"] * 50) + "]\nd: [" + ",".join(["*c"] * 50) + "]\n",
        "schema: 1\nops: !!python/object:os.system x\n", "schema: !!seq x\n", "schema: !!map x\n",
        "schema: 1\nops: !!binary AAAA\n", "!!set {a, b}\n", "schema: 1\nmixed_group: " + "w" * 200_000 + "\n",
        "[" * 10_000 + "]" * 10_000, "schema: 1\n" + "ops:\n  kv_quant: [torch]\n" * 2,
        "schema: 2\n", "schema: 1\nmixed_groop: warn\n", "schema: 1\nops:\n  kv_quant: [bogus]\n",
        "\ufeffschema: 1\n", "schema: 1\n\x1b[2Jmixed_group: warn\n", "schema: 1\nmixed_group: \u202ewarn\n",
        "schema: 1\ndevices:\n  - match: {cc: 8.60}\n    ops: {kv_quant: [torch]}\n",
        "schema: 1\ndevices:\n  - match: {cc: " + HUGE + "}\n    ops: {kv_quant: [torch]}\n",
        "\t schema: 1\n", ": : :\n", "schema: 1\nops: {kv_quant: [torch]}\n" + "#" * 2_000_000,
        "schema: .nan\n", "schema: 1e400\n", "schema: 1\n<<: {mixed_group: warn}\n", "- 1\n- 2\n", "~\n",
        "schema: 1\nverify: " + "\x00" + "\n",
    ]
    if rng.random() < 0.25:
        return rng.choice(good), "ok"
    return rng.choice(bad), "any"


def _path_variant(rng, name, text):
    """(files, path argument, expect) for a path option: a file of TEXT or a hostile path."""
    kind = rng.choice(["file"] * 6 + ["fifo", "dir", "link", "loop", "missing", "devnull",
                                      "devzero", "dangling", "bytes", "empty", "unicode"])
    p = "{tmp}/in/" + name
    if kind == "file":
        return [(f"in/{name}", "text", text)], p, None
    if kind == "fifo":
        return [(f"in/{name}", "fifo", None)], p, "bad"
    if kind == "dir":
        return [(f"in/{name}", "dir", None)], p, "bad"
    if kind == "link":
        return [(f"in/real-{name}", "text", text), (f"in/{name}", "link", f"real-{name}")], p, None
    if kind == "loop":
        return [(f"in/{name}", "link", name)], p, "bad"
    if kind == "missing":
        return [], p + ".missing", "bad"
    if kind == "devnull":
        return [], "/dev/null", "bad"
    if kind == "devzero":
        return [], "/dev/zero", "bad"
    if kind == "dangling":
        return [(f"in/{name}", "link", "nowhere")], p, "bad"
    if kind == "bytes":
        return [(f"in/{name}", "bytes", bytes(rng.randrange(256) for _ in range(600)))], p, "bad"
    if kind == "empty":
        return [(f"in/{name}", "text", "")], p, "any"
    return [(f"in/\u202e\x1b{name}", "text", text)], "{tmp}/in/\u202e\x1b" + name, None


def _config_text(rng):
    """(text, expect) of a config.json: the test model's, or one mutated at a field."""
    cfg = json.loads(json.dumps(BASE_CONFIG))
    r = rng.random()
    if r < 0.12:
        return json.dumps(cfg), "ok"
    if r < 0.3:
        whole = ["", "{", "null", "[]", "[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000,
                 "\ufeff" + json.dumps(cfg), json.dumps(cfg).replace("4096", HUGE, 1), "NaN",
                 json.dumps(cfg) + "x", "\xff\xfe", json.dumps({**cfg, "x": "y" * 3_000_000})]
        t = rng.choice(whole)
        return t, "any" if t.startswith("\ufeff") or '"x": "y' in t else "bad"
    field = rng.choice([k for k in cfg if k not in ("architectures", "torch_dtype")])
    value = rng.choice([int(HUGE), 10 ** 300, -1, 0, "4096", [], {}, None, True, 1.5, float("nan"),
                        float("inf"), [[[[[[[[1]]]]]]]], "\u202e", 2 ** 63, 10 ** 6, 7])
    if field == "num_hidden_layers" and rng.random() < 0.4:
        cfg["num_hidden_layers"] = 10 ** 6
        cfg["compress_ratios"] = [4] * 10 ** 6
    else:
        cfg[field] = value
    return json.dumps(cfg, allow_nan=True), "any"


# ---------------------------------------------------------------- generators per class

def _pick(rng, good, bad, p_bad=0.5):
    if rng.random() < p_bad:
        return rng.choice(bad), True
    return rng.choice(good), False


def _devices(rng, n_max=4):
    n = rng.randint(1, n_max)
    if rng.random() < 0.3:
        return ",".join(rng.choice(DEVICES_OK + DEVICES_BAD) for _ in range(n)), "any"
    return ",".join(rng.choice(DEVICES_OK[:-1]) for _ in range(n)), None


# Forms Python's int() reads and the command line accepts as that number (docs/verification.md,
# "The command-line trial"): not bad input by themselves.
INT_FORMS = {"١٢": 12, "1_0": 10, "  3 ": 3}


def _nums(rng, good):
    v, bad = _pick(rng, good, HOSTILE_NUMS, 0.5)
    return v, bad and v not in INT_FORMS


def _common_decision(rng, argv, files):
    """Options explain and lock share: ops, --set, --libs, --assume-lib, --assume-cuda, --policy."""
    bad = False
    if rng.random() < 0.3:
        v, b = _pick(rng, OPS_OK + ["kv_quant,moe"], ["bogus", "", "kv_quant,,moe", "Kv_Quant", "\x1bmoe",
                                                      "x" * 100_000], 0.4)
        argv += ["--op", v]; bad |= b
    if rng.random() < 0.2:
        v, b = _pick(rng, ["kv_quant=torch", "moe=torch", "kv_quant=triton_u8"],
                     ["kv_quant=bogus", "bogus=torch", "=", "kv_quant", "kv_quant=", "kv_quant=torch=x",
                      "moe=\u202etorch", "k" * 100_000 + "=torch"], 0.5)
        argv += ["--set", v]; bad |= b
    if rng.random() < 0.25:
        v, b = _pick(rng, LIBS_OK, ["bogus", "", "sglang-9.9.9", "sglang-0.5.23\x1b", "l" * 100_000], 0.4)
        argv += ["--libs", v]; bad |= b
    if rng.random() < 0.2:
        v, b = _pick(rng, ["triton", "flashinfer-python==0.7.2", "triton==3.2.0"],
                     ["bogus", "triton==", "==1", "triton==x.y.z", "triton==" + HUGE, "triton>=3",
                      "\x1btriton", ""], 0.5)
        argv += ["--assume-lib", v]; bad |= b
    if rng.random() < 0.15:
        v, b = _pick(rng, ["12.8", "12.4", "13.0"], ["nan", "-1", "", "12", "abc", HUGE, "1e309", "12.8.1.1.1"], 0.6)
        argv += ["--assume-cuda", v]
        bad |= b and v not in ("12",)
    if rng.random() < 0.2:
        text, ex = _yaml_inputs(rng)
        f, p, pex = _path_variant(rng, "policy.yaml", text)
        files += f
        argv += ["--policy", p]
        if pex == "bad":
            bad = True
        elif ex != "ok":
            return "any"
    return "bad" if bad else None


def gen_explain(rng):
    argv, files = ["explain"], []
    devs, dex = _devices(rng)
    argv += ["--device", devs]
    ex = _common_decision(rng, argv, files)
    if rng.random() < 0.3:
        argv += ["--mixed-group", rng.choice(["allow", "warn", "uniform", "error", "bogus", ""])]
        ex = ex or "any"
    if rng.random() < 0.3:
        m = _model_arg(rng, files)
        argv += ["--model", m[0]]
        tp, b = _nums(rng, ["1", "2", "4", "8", "4096", "4097"])
        argv += ["--tp", tp]
        ex = "bad" if b else (ex or "any")
    if rng.random() < 0.15:
        argv += ["--next-n", rng.choice(HOSTILE_NUMS + ["1", "2"])]
        ex = ex or "any"
    argv += rng.choice([[], ["--brief"], ["--format", "json"], ["--format", "xml"], ["-v", "--brief"]])
    if "xml" in argv:
        ex = "bad"
    return Case("explain", argv, expect=ex or ("any" if dex else "any"), files=files)


def _model_arg(rng, files):
    r = rng.random()
    if r < 0.45:
        return rng.choice(MODELS_OK), "ok"
    if r < 0.55:
        return rng.choice(["bogus", "", "\x1bdeepseek", "m" * 100_000, "deepseek-v4-flash\u202e"]), "bad"
    text, ex = _config_text(rng)
    f, p, pex = _path_variant(rng, "config.json", text)
    files += f
    if rng.random() < 0.3 and p.startswith("{tmp}/in/config.json"):
        p = "{tmp}/in"                        # the folder holding it
    return p, pex or ex


def gen_model(rng):
    files = []
    argv = ["model"]
    m, ex = _model_arg(rng, files)
    argv.append(m)
    if rng.random() < 0.7:
        tp, b = _nums(rng, ["1", "2", "4", "8", "16", "4096", "4097", "3"])
        argv += ["--tp", tp]
        ex = "bad" if b else ("any" if ex == "ok" else ex)
    if rng.random() < 0.4:
        ep, b = _nums(rng, ["1", "2", "8", "3"])
        argv += ["--ep", ep]
        ex = "bad" if b else ("any" if ex == "ok" else ex)
    if rng.random() < 0.2:
        argv += ["--next-n", rng.choice(HOSTILE_NUMS + ["1", "2", "64"])]
        ex = "any" if ex != "bad" else ex
    if rng.random() < 0.2:
        argv.append("--dp-attention")
    if rng.random() < 0.3:
        argv += ["--format", "json"]
    return Case("model", argv, expect=ex, files=files)


def gen_plan(rng):
    files = []
    devs, dex = _devices(rng, 3)
    argv = ["plan", "--device", devs]
    m, ex = _model_arg(rng, files)
    argv += ["--model", m]
    ex = ex if ex == "bad" else "any"
    for flag, good in (("--tp", ["1", "2", "4", "8", "4096"]), ("--ep", ["1", "2", "8"]),
                       ("--context", ["1", "8192", "131072", "1048576"]), ("--batch", ["1", "8", "64"]),
                       ("--prefill", ["1", "4096"]), ("--next-n", ["1", "2"])):
        if rng.random() < 0.3:
            v, b = _nums(rng, good)
            argv += [flag, v]
            if b and v not in ("1e3", "  3 "):
                ex = "bad" if v not in ("1_0",) else "any"
    if rng.random() < 0.3:
        argv.append("--speed")
        if rng.random() < 0.5:
            argv += ["--libs", rng.choice(LIBS_OK + ["bogus"])]
    if rng.random() < 0.1:
        text = rng.choice([json.dumps({"x": 1}), "schema: 1\n", "{" * 1000, "", "[]"])
        f, p, _ = _path_variant(rng, "calib.json", text)
        files += f
        argv += ["--calibration", p]
    argv += rng.choice([[], ["--brief"], ["--format", "json"]])
    return Case("plan --speed" if "--speed" in argv else "plan", argv, expect=ex, files=files)


def _lock_text(rng):
    return rng.choice([
        "", "schema: 1\n", "[]\n", "devices: &a {x: *a}\n", "!!python/object:os.system x\n",
        "schema: !!seq x\n", "a: " + "b" * 300_000 + "\n", "\x1b[2J\u202e\n", "{" * 5000,
        "# capdispatch lock file\nschema: 1\ndevices: {}\n", "schema: 1\ndevices:\n  cpu:\n    kv_quant: torch\n",
        "schema: 1\ndevices:\n  sim:rtx-5090:\n    decisions: {kv_quant: {backend: bogus}}\n",
    ])


def gen_lock(rng):
    files = []
    argv = ["lock"]
    devs, _ = _devices(rng, 3)
    if rng.random() < 0.5:
        f, p, _ = _path_variant(rng, "rig.lock", _lock_text(rng))
        files += f
        argv += ["--check", p]
        if rng.random() < 0.5:
            argv += ["--device", devs]
        ex = "any"
    else:
        argv += ["--device", devs]
        ex = _common_decision(rng, argv, files) or "any"
        target = rng.choice(["{tmp}/out.lock", "-", "{tmp}/in", "{tmp}/in/file", "{tmp}/link.lock",
                             "/dev/full", "{tmp}/missing/dir/x.lock", "{tmp}/\u202e\x1b.lock", ""])
        if target == "{tmp}/in/file":
            files.append(("in/file", "dir", None))
        if target == "{tmp}/link.lock":
            files.append(("victim", "dir", None))
            files.append(("link.lock", "link", "victim/x"))
        if target == "{tmp}/in":
            files.append(("in/x", "text", "x"))
        argv += ["-o", target]
    return Case("lock --check" if "--check" in argv else "lock", argv, expect=ex, files=files)


def gen_policy(rng):
    files = []
    text, ex = _yaml_inputs(rng)
    f, p, pex = _path_variant(rng, "p.yaml", text)
    files += f
    sub = rng.choice(["validate", "show"])
    argv = ["policy", sub, p] if sub == "validate" else ["policy", "show", "--policy", p]
    return Case("policy " + sub, argv, expect=pex or ex, files=files)


def gen_env_var(rng):
    """A bad CAPDISPATCH_* value under a cheap command."""
    name = rng.choice(["CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", "CAPDISPATCH_VERIFY",
                       "CAPDISPATCH_CACHE_DIR", "CAPDISPATCH_LOCK", "CAPDISPATCH_REPORT_DIR",
                       "CAPDISPATCH_IMPORT_TIMEOUT", "CAPDISPATCH_DEBUG", "CAPDISPATCH_SGLANG_DEVICES",
                       "CAPDISPATCH_REQUIRE_REHEARSAL", "CAPDISPATCH_REHEARSE_FAULT", "CUDA_VISIBLE_DEVICES"])
    value = rng.choice(HOSTILE_TEXT[:-2] + HOSTILE_NUMS + ["{tmp}/in", "{tmp}/fifo", "{tmp}/x:{tmp}/y",
                                                           "maybe", "1:kv_quant:wrong", "99:kv_quant:wrong"])
    value = value.replace("\udcff", "x")
    files = [("in/a", "text", "x"), ("fifo", "fifo", None)]
    cmd = rng.choice([["explain", "--device", "sim:rtx-5090", "--brief"], ["env"], ["devices"], ["ops"],
                      ["lock", "--device", "sim:h200"], ["sglang", "plan", "--device", "sim:rtx-5090"],
                      ["policy", "show"], ["catalog"], ["env", "--format", "json"]])
    return Case("env-var " + cmd[0], cmd, expect="any", env={name: value}, files=files)


def gen_sglang(rng):
    files = []
    argv = ["sglang", "plan"]
    ex = "any"
    if rng.random() < 0.7:
        devs, _ = _devices(rng, 3)
        argv += ["--device", devs]
    if rng.random() < 0.4:
        tp, b = _nums(rng, ["1", "2", "4"])
        argv += ["--tp", tp]
        ex = "bad" if b else ex
    if rng.random() < 0.3:
        m, mex = _model_arg(rng, files)
        argv += ["--model", m]
        ex = "bad" if mex == "bad" else ex
    if rng.random() < 0.05:                 # SGLang's own import: tens of seconds a case
        argv += ["--"] + rng.choice([["--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--tp", "2"],
                                     ["--tp", str(10 ** 18)], ["--tp", "nan"], ["--bogus"],
                                     ["--model-path", "\x1b" + "x" * 100_000], ["--attention-backend", "bogus"]])
    env = {}
    if rng.random() < 0.3:
        target = rng.choice(["victim-link", "afile", "fifo", "new"])
        files += [("victim", "dir", None), ("victim-link", "link", "victim"), ("afile", "text", "x"),
                  ("fifo", "fifo", None)]
        env["CAPDISPATCH_REPORT_DIR"] = "{tmp}/" + target
    # with SGLang arguments after --, SGLang itself is imported to resolve them (tens of seconds)
    return Case("sglang plan", argv, expect=ex, env=env, files=files,
                after="victim-empty" if env else None, timeout=SLOW_S if "--" in argv else FAST_S)


def gen_checkpoint(rng):
    files = []
    m, mex = _model_arg(rng, files)
    layers = rng.choice(HOSTILE_NUMS + ["0", str(10 ** 6), "44"])
    out = rng.choice(["{tmp}/afile", "{tmp}/full", "{tmp}/victim-link", "{tmp}/fifo", "/dev/null",
                      "{tmp}/\u202e\x1bdir/x", ""])
    files += [("afile", "text", "x"), ("full/x", "text", "x"), ("victim", "dir", None),
              ("victim-link", "link", "victim"), ("fifo", "fifo", None)]
    argv = ["checkpoint", "--model", m, "--layers", layers, "--out", out]
    if rng.random() < 0.3:
        argv += ["--seed", rng.choice(HOSTILE_NUMS)]
    return Case("checkpoint", argv, expect="bad", files=files, after="victim-empty")


def gen_env_cmd(rng):
    env = {}
    for _ in range(rng.randint(0, 3)):
        env[rng.choice(["CAPDISPATCH_POLICY", "CAPDISPATCH_DEBUG", "CAPDISPATCH_CACHE_DIR", "NO_COLOR",
                        "FORCE_COLOR", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET"])] = \
            rng.choice(HOSTILE_TEXT[:-2]).replace("\udcff", "x")
    return Case("env", ["env"] + rng.choice([[], ["--format", "json"], ["--format", "bad"]]),
                expect="any", env=env)


def gen_bench(rng):
    argv = ["bench", "--device", rng.choice(["cpu", "sim:h200", "cuda:0", "sim:bogus", ""])]
    ex = "bad"
    sizes = rng.choice(["0", "-1", "", ",", "1," * 5000, HUGE, str(10 ** 18), "1e3", "nan", "1,,2", "2**40",
                        str(2 ** 40), str(2 ** 31), "65536", "\x1b1", "1.5"])
    argv += ["--sizes", sizes, "--op", rng.choice(OPS_OK + ["bogus"])]
    for flag in ("--noise", "--warmup", "--rep", "--threshold", "--seed", "--layers", "--cuda-graph-max-bs"):
        if rng.random() < 0.15:
            argv += [flag, rng.choice(HOSTILE_NUMS)]
    files = []
    if rng.random() < 0.2:
        text, _ = _yaml_inputs(rng)
        files.append(("in/p.yaml", "text", text))
        argv += ["--write-policy", "{tmp}/in/p.yaml"]
    if rng.random() < 0.2:
        argv += ["--model", rng.choice(MODELS_OK), "--tp", rng.choice(HOSTILE_NUMS + ["1"])]
    # sizes the docs allow on the CPU are bounded: a huge one must be refused, not attempted
    # "1,,2" is read as 1,2 and times for real: the slow timeout
    return Case("bench", argv, expect="any" if sizes in ("65536", "1,,2") else ex, files=files, timeout=SLOW_S)


def gen_bench_ok(rng):
    op = rng.choice(["kv_quant", "kv_dequant"])
    return Case("bench (runs)", ["bench", "--device", "cpu", "--op", op, "--sizes", "1,16",
                                 "--profile", "small"], expect="ok", timeout=SLOW_S, slow=True)


def gen_verify_args(rng):
    argv = ["verify", "--device", rng.choice(["cpu", "sim:h200", "cuda:0", "sim:bogus", "", "cpu,cpu"])]
    for flag in ("--timeout", "--jobs"):
        if rng.random() < 0.6:
            argv += [flag, rng.choice(["nan", "inf", "-1", "0", "", "1e-9", HUGE, str(10 ** 18), "abc", "1e309"])]
    if rng.random() < 0.3:
        argv += ["--backend", rng.choice(["bogus", "", "\x1bx", "b" * 100_000])]
    if rng.random() < 0.3:
        argv += ["--op", rng.choice(["bogus", "", ",,"])]
    files = []
    if rng.random() < 0.3:
        f, p, _ = _path_variant(rng, "rig.lock", _lock_text(rng))
        files += f
        argv += ["--lock", p]
    argv += ["--op", "kv_quant"] if "--op" not in argv else []
    # every case has at least one bad value among device/timeout/jobs/backend/op/lock, or is a sim
    return Case("verify (args)", argv, expect="any", files=files, timeout=60)


def _cache_files(rng):
    """A verify cache under HOME whose secret file is hostile (bad mode, link, truncated, ...)."""
    kind = rng.choice(["mode644", "mode640", "link", "truncated", "empty", "huge", "dir", "fifo", "dangling",
                       "dirmode777", "ok"])
    base = "home/.cache/capdispatch/verify"
    files = [(base, "dir", None)]
    if kind in ("mode644", "mode640"):
        files += [(f"{base}/key", "text", "ab" * 32), (f"{base}/key", "mode", 0o644 if kind == "mode644" else 0o640)]
    elif kind == "link":
        files += [("secret", "text", "ab" * 32), (f"{base}/key", "link", "../../../../secret")]
    elif kind == "truncated":
        files += [(f"{base}/key", "text", "ab" * 5), (f"{base}/key", "mode", 0o600)]
    elif kind == "empty":
        files += [(f"{base}/key", "text", ""), (f"{base}/key", "mode", 0o600)]
    elif kind == "huge":
        files += [(f"{base}/key", "text", "a" * 2_000_000), (f"{base}/key", "mode", 0o600)]
    elif kind == "dir":
        files += [(f"{base}/key", "dir", None)]
    elif kind == "fifo":
        files += [(f"{base}/key", "fifo", None)]
    elif kind == "dangling":
        files += [(f"{base}/key", "link", "nowhere")]
    elif kind == "dirmode777":
        files += [(base, "mode", 0o777)]
    return kind, files


def gen_verify_run(rng):
    kind, files = _cache_files(rng)
    argv = ["verify", "--device", "cpu", "--op", rng.choice(["kv_quant", "kv_dequant"]), "--jobs", "1"]
    sig = None
    if rng.random() < 0.4:
        sig = (rng.choice(["TERM", "HUP", "INT", "KILL", "INT-group"]), rng.choice([0.5, 1.5, 3.0]))
    return Case(f"verify (runs, key {kind})", argv, expect="any" if sig else "ok", files=files,
                timeout=SLOW_S, sig=sig, slow=True)


def gen_rehearse_args(rng):
    argv = ["rehearse"]
    r = rng.random()
    if r < 0.3:                                   # engine sglang: argument errors only
        argv += ["--engine", "sglang", "--device", rng.choice(["cpu", "cuda:0", "emu:rtx-5090@cpu", ""])]
        argv += ["--model", rng.choice(["{tmp}/missing", "{tmp}/afile", "{tmp}/fifo", "deepseek-v4-flash",
                                        "{tmp}/empty"])]
        for flag in ("--port", "--timeout", "--start-timeout", "--requests", "--steps", "--out"):
            if rng.random() < 0.3:
                argv += [flag, rng.choice(HOSTILE_NUMS + ["{tmp}/afile", "{tmp}/victim-link", "70000"])]
        if rng.random() < 0.3:
            argv += ["--", rng.choice(["--tp", "--bogus", "--model-path", "--port"]), rng.choice(HOSTILE_NUMS)]
        files = [("afile", "text", "x"), ("fifo", "fifo", None), ("empty", "dir", None), ("victim", "dir", None),
                 ("victim-link", "link", "victim")]
        return Case("rehearse --engine sglang (args)", argv, expect="bad", files=files, after="victim-empty")
    devs = rng.choice(["cpu,cpu", "cpu", "emu:rtx-5090@cpu,emu:rtx-3080@cpu", "cuda:0", "emu:bogus@cpu",
                       "emu:rtx-5090@cuda:0", "", "cpu," * 5000, "sim:h200"])
    argv += ["--device", devs, "--model", rng.choice(MODELS_OK + ["bogus", "{tmp}/fifo"])]
    bad_val = None
    flags = ["--tp", "--ep", "--layers", "--hidden", "--vocab", "--experts", "--intermediate", "--prompt",
             "--steps", "--seed", "--timeout", "--start-timeout", "--libs", "--port", "--out"]
    for flag in rng.sample(flags, rng.randint(0, 2)):
        v = rng.choice(HOSTILE_NUMS + ["bogus"]) if flag == "--libs" else rng.choice(HOSTILE_NUMS)
        argv += [flag, v]
        bad_val = v
    # one value no rehearsal accepts, so that none starts ranks here (that is gen_rehearse_run's)
    argv += [rng.choice(flags[:9] + ["--timeout", "--start-timeout"]),
             rng.choice(["-1", "nan", "inf", "", HUGE, str(10 ** 18), "abc", "1e309", "\x1b[2J", "0x10"])]
    env = {}
    if rng.random() < 0.2:
        env["CAPDISPATCH_REHEARSE_FAULT"] = rng.choice(["9:kv_quant:wrong", "1:bogus:wrong", "1:kv_quant:x",
                                                        "x", "", "1:kv_quant:wrong:extra", "-1:moe:wrong"])
    files = [("fifo", "fifo", None)]
    del bad_val
    # a value of HOSTILE_NUMS may be acceptable for --seed (0, -1, 10**18, ...) and start a real
    # rehearsal: allow that, bounded by the slow timeout
    return Case("rehearse (args)", argv, expect="any", env=env, files=files, timeout=SLOW_S)


def gen_rehearse_run(rng):
    sig = (rng.choice(["TERM", "HUP", "INT", "KILL", "INT-group"]), rng.choice([2.0, 5.0, 9.0, 14.0]))
    env = {}
    if rng.random() < 0.2:
        env["CAPDISPATCH_REHEARSE_FAULT"] = "1:kv_quant:wrong"
    return Case("rehearse (signal)", ["rehearse", "--device", "cpu,cpu", "--model", "deepseek-v4-flash"],
                expect="any", env=env, timeout=SLOW_S, sig=sig, slow=True)


def gen_misc(rng):
    argv = rng.choice([["devices", "--probe", rng.choice(["nvml", "torch", "bogus", ""])],
                       ["ops", rng.choice(["--format", "--bogus"]), rng.choice(["json", "x"])],
                       ["catalog", "--format", rng.choice(["json", "text", "x", ""])],
                       [rng.choice(["bogus", "", "\x1b[2J", "x" * 100_000, "explain\u202e"])],
                       ["explain", "--device"], ["--version"], ["-V"], ["sglang"], ["sglang", "bogus"],
                       ["policy"], ["policy", "validate"], ["explain", "--bogus", "x" * 1000]])
    return Case(argv[0] if argv[0] in ("devices", "ops", "catalog") else "misc", argv, expect="any")


# share per 1,000 cases; the slow ones (a real verify, bench or rehearsal) are few
CLASSES = [(gen_explain, 170), (gen_model, 150), (gen_plan, 140), (gen_lock, 90), (gen_policy, 80),
           (gen_env_var, 80), (gen_sglang, 70), (gen_checkpoint, 40), (gen_env_cmd, 20), (gen_bench, 40),
           (gen_verify_args, 30), (gen_rehearse_args, 40), (gen_misc, 30),
           (gen_verify_run, 5), (gen_rehearse_run, 2), (gen_bench_ok, 2)]


def generate(rng, count):
    gens, weights = zip(*CLASSES)
    return [rng.choices(gens, weights)[0](rng) for _ in range(count)]


# ---------------------------------------------------------------- running one case

def _make(tmp: Path, files):
    for rel, kind, payload in files:
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if kind == "text":
            p.write_bytes(payload.encode("utf-8", "surrogateescape"))
        elif kind == "bytes":
            p.write_bytes(payload)
        elif kind == "dir":
            p.mkdir(parents=True, exist_ok=True)
        elif kind == "fifo":
            if not p.exists():
                os.mkfifo(p)
        elif kind == "link":
            if not p.is_symlink():
                os.symlink(payload, p)
        elif kind == "mode":
            os.chmod(p, payload)


def _default_signals():
    # A trial started in the background (nohup, `&`) ignores SIGINT and SIGHUP, and an ignored
    # signal stays ignored across exec: each case starts as from a terminal instead.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _fill(s: str, tmp: Path) -> str:
    return s.replace("{tmp}", str(tmp))


def _marked(tag: str):
    """Pids of live processes whose environment carries TAG."""
    needle = f"{MARK}={tag}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{d}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != b"Z":
            out.append(int(d))
    return out


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _inputs_of(case):
    return case.argv + list(case.env.values()) + [p for _, k, p in case.files if k == "text" and p]


def _echoes(case, text) -> bool:
    for s in _inputs_of(case):
        if len(s) <= 300:
            continue
        for at in (0, len(s) // 2, len(s) - 301):
            if s[at:at + 301] in text:
                return True
    return False


def run_case(case, idx, python, pythonpath):
    tmp = Path(tempfile.mkdtemp(prefix="cli-trial-"))
    home, ttmp = tmp / "home", tmp / "t"
    home.mkdir()
    ttmp.mkdir()
    _make(tmp, case.files)
    tag = f"{os.getpid()}-{idx}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "XDG_CACHE_HOME": str(home / ".cache"), "TMPDIR": str(ttmp), "LANG": "C.UTF-8",
           "PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1", "TRITON_INTERPRET": "1", MARK: tag}
    env.update({k: _fill(v, tmp) for k, v in case.env.items()})
    argv = [python, "-m", "capdispatch"] + [_fill(a, tmp) for a in case.argv]
    found = []
    t0 = time.monotonic()
    with open(tmp / "stdout", "wb") as so, open(tmp / "stderr", "wb") as se:
        try:
            proc = subprocess.Popen(argv, stdout=so, stderr=se, stdin=subprocess.DEVNULL, env=env,
                                    cwd=tmp, start_new_session=True, preexec_fn=_default_signals)
        except (ValueError, OSError) as exc:       # an argument the OS cannot pass: not a case
            return None, [], str(exc)
        if case.sig:
            name, after = case.sig
            try:
                proc.wait(after)
            except subprocess.TimeoutExpired:
                if name == "INT-group":
                    os.killpg(proc.pid, signal.SIGINT)
                else:
                    os.kill(proc.pid, getattr(signal, "SIG" + name))
        try:
            rc = proc.wait(case.timeout if not case.sig else 30)
        except subprocess.TimeoutExpired:
            found.append("hang")
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
    secs = time.monotonic() - t0
    out = (tmp / "stdout").read_bytes().decode("utf-8", "replace")
    err = (tmp / "stderr").read_bytes().decode("utf-8", "replace")
    left = _marked(tag)
    deadline = time.monotonic() + (10 if case.sig else 3)
    while left and time.monotonic() < deadline:        # ranks watching their parent need a moment
        time.sleep(0.2)
        left = _marked(tag)
    if left:
        found.append("leftover process")
        _kill(left)
    # torch's compile cache (torch's default place is under TMPDIR; SGLang's import makes it)
    temps = sorted(t for t in os.listdir(ttmp) if not t.startswith("torchinductor_"))
    if temps and not (case.sig and case.sig[0] == "KILL"):
        found.append("leftover temp folder")
    text = out + err
    if "hang" not in found:
        if rc == 1 or "internal error" in text or "Traceback" in text:
            found.append("internal error")
        if case.expect == "bad" and rc in (0, 3):
            found.append("wrong exit code")
        if case.expect == "ok" and rc != 0:
            found.append("wrong exit code")
        if rc == 2:
            lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("WARNING")
                     and not PY_WARNING.match(ln) and not ln.startswith("  warnings.warn")]
            if len(lines) > 1:
                found.append("multi-line error")
            if not lines:
                found.append("exit 2 without a message")
    # `dispatch env --format json` carries each variable's value whole: it is the data asked for
    if _echoes(case, err if case.cls.startswith("env") and "json" in case.argv else text):
        found.append("echo of huge input")
    if RAW.search(text):
        found.append("raw control characters")
    if case.after == "victim-empty" and (tmp / "victim").is_dir() and any((tmp / "victim").iterdir()):
        found.append("wrote through a symlink")
    if case.cls == "model" and secs > 3.0 and "hang" not in found:
        found.append("slow model answer")
    detail = {"rc": rc, "seconds": round(secs, 2), "stderr": _shorten(err.replace(str(tmp), "<tmp>")),
              "temps": temps[:5]}
    _rmtree(tmp)
    return rc, found, detail


def _shorten(s, n=400):
    s = s.strip()
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


def _rmtree(p: Path):
    for root, dirs, files in os.walk(p, topdown=False):
        for f in files:
            try:
                os.unlink(os.path.join(root, f))
            except OSError:
                pass
        for d in dirs:
            q = os.path.join(root, d)
            try:
                os.unlink(q) if os.path.islink(q) else os.rmdir(q)
            except OSError:
                pass
    try:
        os.rmdir(p)
    except OSError:
        pass


def show(case) -> str:
    """The case as a shell line, long values cut, placeholders kept."""
    def cut(s):
        s = s if len(s) <= 80 else f"{s[:40]}...<{len(s)} chars>"
        return shlex.quote(s.encode("unicode_escape").decode("ascii") if RAW.search(s) or not s.isprintable()
                           else s)
    env = " ".join(f"{k}={cut(v)}" for k, v in case.env.items())
    files = ", ".join(f"{rel}:{kind}" for rel, kind, _ in case.files)
    line = " ".join(["dispatch"] + [cut(a) for a in case.argv])
    if case.sig:
        line += f"   [SIG{case.sig[0]} after {case.sig[1]} s]"
    return (env + " " if env else "") + line + (f"   (files: {files})" if files else "")


def _versions(python):
    code = ("import sys, platform; import importlib.metadata as m; "
            "print(platform.python_version(), m.version('torch'), m.version('triton'))")
    try:
        return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return []


def summary(args, results, skipped, elapsed, done=True) -> str:
    per_class = collections.Counter()
    per_cmd = collections.defaultdict(collections.Counter)
    ran = collections.Counter()
    for case, rc, found, _ in results:
        ran[case.cls] += 1
        for f in found:
            per_class[f] += 1
            per_cmd[case.cls][f] += 1
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    v = _versions(args.python) + ["?", "?", "?"]
    kinds = ["internal error", "hang", "leftover process", "leftover temp folder", "wrong exit code",
             "multi-line error", "exit 2 without a message", "echo of huge input", "raw control characters",
             "wrote through a symlink", "slow model answer"]
    lines = [f"# CLI reliability trial{'' if done else ' (partial)'}", "",
             f"- command: `python tests/trial/cli_trial.py --count {args.count} --seed {args.seed}"
             f"{' --quick' if args.quick else ''} --out FILE`",
             f"- seed {args.seed}, {len(results)} command lines run ({skipped} the OS could not pass), "
             f"one at a time, {elapsed / 60:.1f} min",
             f"- date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu} "
             f"({os.cpu_count()} cores); Python {v[0]}, torch {v[1]}, triton {v[2]}; "
             f"TRITON_INTERPRET=1; uid {os.getuid()}", "",
             "## Findings per class", "", "| class | cases |", "|---|---|"]
    lines += [f"| {k} | {per_class.get(k, 0)} |" for k in kinds]
    lines += ["", "## Cases per command", "", "| command | cases | findings |", "|---|---|---|"]
    for cls in sorted(ran):
        f = ", ".join(f"{k} {n}" for k, n in sorted(per_cmd[cls].items())) or "-"
        lines.append(f"| {cls} | {ran[cls]} | {f} |")
    lines += ["", "## Every finding", ""]
    n = 0
    for case, rc, found, detail in results:
        if found:
            n += 1
            lines.append(f"{n}. **{', '.join(found)}** (exit {rc}, {detail['seconds']} s): `{show(case)}`")
            if detail["stderr"]:
                lines.append("   stderr: `" + detail["stderr"].encode("unicode_escape").decode("ascii")
                             .replace("`", "'")[:400] + "`")
            if detail["temps"]:
                lines.append(f"   left in TMPDIR: {detail['temps']}")
    if not n:
        lines.append("none")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="200 cases, no slow ones")
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--pythonpath", default=str(ROOT), help="where capdispatch is imported from")
    ap.add_argument("--only", help="run only the classes whose name contains this")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    count = 200 if args.quick else args.count
    cases = generate(rng, count)
    if args.quick:
        cases = [c for c in cases if not c.slow]
    if args.only:
        cases = [c for c in cases if args.only in c.cls]
    results, skipped = [], 0
    t0 = time.monotonic()
    log = open(args.out + ".log", "w")
    for i, case in enumerate(cases):
        rc, found, detail = run_case(case, i, args.python, args.pythonpath)
        if rc is None:
            skipped += 1
            continue
        results.append((case, rc, found, detail))
        if found:
            log.write(f"{i} {found} rc={rc} {show(case)}\n  {detail['stderr'][:300]!r}\n")
            log.flush()
        if (i + 1) % 100 == 0:
            Path(args.out).write_text(summary(args, results, skipped, time.monotonic() - t0, done=False))
            print(f"{i + 1}/{len(cases)} {time.monotonic() - t0:.0f} s", flush=True)
    Path(args.out).write_text(summary(args, results, skipped, time.monotonic() - t0))
    bad = sum(1 for r in results for f in r[2] if f in ("internal error", "hang", "leftover process"))
    print(f"{len(results)} cases, {sum(1 for r in results if r[2])} with findings; "
          f"internal errors, hangs and leftovers: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
