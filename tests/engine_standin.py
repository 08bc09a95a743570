"""A stand-in for `python -m sglang.launch_server` in the engine rehearsal's tests: the
subset of SGLang's HTTP API the rehearsal uses (/health, /server_info, /generate with
input_ids, return_logprob and top_logprobs_num) and, where SGLang's plugin loader would load
capdispatch (SGLANG_PLUGINS unset or naming it), one rank report per rank in the plugin's
own naming and schema. STANDIN_MODE: ok (default), die (exits at start, naming TP0), refuse (the plugin's launch
step refuses an emulated rank, as SGLang's launcher prints it), hang
(never ready), crash (dies at the first /generate). With the plugin on: STANDIN_FLIP=K
(the token at position K becomes the runner-up, a near tie), STANDIN_FAR=K (a token that is
no alternative), STANDIN_SHIFT=X (every logprob moved by X; STANDIN_REF_SHIFT=X: in the reference
run, the plugin on with CAPDISPATCH_SET naming torch), STANDIN_ARGS=FILE (each start's arguments
appended, a line each; STANDIN_REF_IGNORED=1: the reference run's report keeps the
routed kernel), STANDIN_KV_DTYPE=D (the
kv_cache_dtype /server_info reports), STANDIN_ROUTED=1 (the report
routes kv_dequant), STANDIN_NO_REPORT=1; STANDIN_ALWAYS_REPORT=1 writes reports with the
plugin off too. A rank whose CAPDISPATCH_SGLANG_DEVICES entry is emu:CARD@cuda:N reports that
emulation (STANDIN_EMU=wrong: another card's, none: none, nofacts: no launch facts installed). STANDIN_PIDS=FILE: this process's and a child's pid, for the cleanup tests."""
import argparse
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--model-path")
p.add_argument("--port", type=int)
p.add_argument("--host")
p.add_argument("--tp-size", type=int, default=1)
p.add_argument("--base-gpu-id", type=int, default=0)
args, _ = p.parse_known_args()
env = os.environ
if env.get("STANDIN_ARGS"):
    with open(env["STANDIN_ARGS"], "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:], "set": env.get("CAPDISPATCH_SET")}) + "\n")
MODE = env.get("STANDIN_MODE", "ok")
allowed = [x for x in env.get("SGLANG_PLUGINS", "").split(",") if x]
PLUGIN = not allowed or "capdispatch" in allowed

if env.get("STANDIN_PIDS"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(env["STANDIN_PIDS"], "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")

if MODE == "refuse":        # the plugin's launch step refuses, in SGLang's launcher (no TP tag)
    print("Traceback (most recent call last):\n  File \"launch_server.py\", line 1, in <module>\n"
          "capdispatch.errors.Unsatisfiable: capdispatch: rank 0 (emu:rtx-5090@cuda:0): indexer's route for "
          "the NVIDIA GeForce RTX 5090 is fp8_paged_mqa_logits_torch_sm120, but SGLang on the NVIDIA H100 80GB "
          "HBM3 (cc 9.0) calls fp8_paged_mqa_logits_torch: the card's route is never called there, and telling "
          "SGLang the card's architecture would run SGLang's own kernels for cc 12.0 on cc 9.0; emulate a card "
          "whose SGLang call sites are the device's", flush=True)
    sys.exit(1)

if MODE == "die":
    print("[2026-12-07 06:00:00 TP0] Scheduler hit an exception: RuntimeError: stand-in fails at start", flush=True)
    sys.exit(1)


def emulated(g):
    """What the plugin's report says of rank G's emulation: its CAPDISPATCH_SGLANG_DEVICES
    entry `emu:CARD@cuda:N` (STANDIN_EMU=wrong: another card; none: nothing said)."""
    listed = [x for x in env.get("CAPDISPATCH_SGLANG_DEVICES", "").split(",") if x]
    text = listed[g] if g < len(listed) else ""
    if not text.startswith("emu:") or env.get("STANDIN_EMU") == "none":
        return None
    card, _, on = text[4:].partition("@")
    if env.get("STANDIN_EMU") == "wrong":
        card = "rtx-5090"
    facts = None if env.get("STANDIN_EMU") == "nofacts" else {"device": on, "card": card, "cc": "8.6"}
    return {"card": card, "name": f"stand-in {card}", "cc": "8.6", "on": on, "device": "stand-in card",
            "device_cc": "9.0", "facts": facts, "note": "stand-in"}


def write_reports():
    from capdispatch.adapters.sglang import report
    routed = env.get("STANDIN_ROUTED") == "1"
    # The reference run: the plugin takes CAPDISPATCH_SET's kv_dequant=torch (STANDIN_REF_IGNORED: it does not).
    ref = "kv_dequant=torch" in env.get("CAPDISPATCH_SET", "") and env.get("STANDIN_REF_IGNORED") != "1"
    dequant = "torch" if ref else "triton_u8"
    for r in range(args.tp_size):
        g = args.base_gpu_id + r
        ops = {"kv_quant": {"backend": "triton_fp8", "runs": "sglang", "action": "kept", "install": None,
                            "route": None},
               "kv_dequant": {"backend": dequant if routed else "triton_fp8",
                              "runs": dequant if routed else "sglang",
                              "action": "routed" if routed else "kept",
                              "install": "installed at sglang.x.dequant" if routed else None,
                              "route": "sglang.x.dequant" if routed else None}}
        if env.get("STANDIN_EXTRA_OP"):     # a plugin's op no model declares: decided, reported
            ops[env["STANDIN_EXTRA_OP"]] = {"backend": "torch", "runs": None, "action": "reported", "install": None,
                                            "route": None}
        body = {"schema": report.SCHEMA, "gpu_id": g, "device": {"name": "stand-in card"}, "ops": ops,
                "agreement": {"agreed": True, "not_carried_out": []}, "emulated": emulated(g)}
        path = report.report_path(g, env)
        os.makedirs(path.parent, exist_ok=True)
        path.write_text(json.dumps(body))


if (PLUGIN and env.get("STANDIN_NO_REPORT") != "1") or env.get("STANDIN_ALWAYS_REPORT") == "1":
    write_reports()
time.sleep(0.3)


def reply(ids, n):
    base = sum(ids) * 31
    toks, lps, top = [], [], []
    for k in range(n):
        t, lp = (base + 7 * k) % 1000 + 3, -0.1 - 0.01 * k
        alt = [[lp, t, None], [lp - 0.02, t + 1, None]]
        if PLUGIN and env.get("STANDIN_FLIP") == str(k):
            t, lp = t + 1, lp - 0.01
        if PLUGIN and env.get("STANDIN_FAR") == str(k):
            t = t + 500
        reference = PLUGIN and "=torch" in env.get("CAPDISPATCH_SET", "")
        if reference and env.get("STANDIN_REF_SHIFT"):
            lp += float(env["STANDIN_REF_SHIFT"])
        elif PLUGIN and not reference and env.get("STANDIN_SHIFT"):
            lp += float(env["STANDIN_SHIFT"])
        toks.append(t)
        lps.append([lp, t, None])
        top.append(alt)
    return {"output_ids": toks, "meta_info": {"output_token_logprobs": lps, "output_top_logprobs": top,
                                              "completion_tokens": n}}


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj=None):
        data = b"" if obj is None else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._send(503 if MODE == "hang" else 200)
        elif self.path == "/server_info":
            kv = env.get("STANDIN_KV_DTYPE", "fp8_e4m3") if PLUGIN else "fp8_e4m3"
            self._send(200, {"version": "0.0.0-standin", "kv_cache_dtype": kv, "moe_runner_backend": "auto",
                             "nccl_port": os.getpid(), "internal_states": [{"memory_usage": {
                "weight": 5.0, "kvcache": 2.0, "token_capacity": 100000, "graph": {}}}]})
        else:
            self._send(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if MODE == "crash":
            print("[2026-12-07 06:00:01 TP0] RuntimeError: stand-in crashes in a forward", flush=True)
            os._exit(3)
        sp = body["sampling_params"]
        assert sp["temperature"] == 0 and body["return_logprob"] is True
        time.sleep(0.002 * sp["max_new_tokens"])
        self._send(200, reply(body["input_ids"], sp["max_new_tokens"]))


ThreadingHTTPServer((args.host, args.port), H).serve_forever()
