"""On a real GPU: torch and NVML report the same facts; NVML leaves CUDA uninitialised."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _cli(*args):
    p = subprocess.run([sys.executable, "-m", "capdispatch", *args], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_torch_and_nvml_agree():
    via_nvml = json.loads(_cli("devices", "--probe", "nvml", "--format", "json"))["devices"]
    via_torch = json.loads(_cli("devices", "--probe", "torch", "--format", "json"))["devices"]
    assert len(via_nvml) == len(via_torch) >= 1
    for a, b in zip(via_nvml, via_torch):
        assert (a["probe"], b["probe"]) == ("nvml", "torch")
        for key in ("id", "name", "cc", "sm_count", "smem_optin_per_block", "features"):
            assert a[key] == b[key], key
        assert abs(a["memory"] - b["memory"]) <= 0.02 * b["memory"]


def test_nvml_probe_does_not_initialise_cuda():
    code = ("import capdispatch as cd, json; s = cd.probe('cuda:0', via='nvml'); "
            "import torch; print(json.dumps([s.cc_str, s.sm_count, torch.cuda.is_initialized()]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    cc, sms, initialised = json.loads(p.stdout.strip().splitlines()[-1])
    assert initialised is False and sms > 0


def test_explain_on_the_real_card_follows_its_facts():
    doc = json.loads(_cli("explain", "--device", "cuda:0", "--op", "kv_quant", "--op", "kv_dequant",
                          "--format", "json"))
    dev = doc["devices"][0]
    want = "triton_fp8" if "fp8_e4m3" in dev["features"] else "triton_u8"
    for g in doc["ops"].values():
        assert g["per_device"]["cuda:0"]["backend"] == want
