"""A plugin backend of a served op that the SGLang knob map has no entry for
(tests/plugins/unmapped: decode_mla/plug_unmapped): the knob map still loads, names the
backend and the entry to add, and a decision for it is reported, not carried out; a
built-in backend without an entry stays an error of the packaged map
(test_sglang_units.py)."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UNMAPPED = os.path.join(HERE, "plugins", "unmapped")

SCRIPT = r"""
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
from capdispatch.adapters.sglang import decide, knobs, gpus
release = knobs.load().release("0.5.23")
env = dict(os.environ)
if release.unmapped:
    env["CAPDISPATCH_SET"] = "decode_mla=plug_unmapped"
env[gpus.SIM_ENV] = "sim:h200"
d = decide.decide(gpus.devices([0], env=env), ("decode_mla", "kv_dequant"), release, env=env,
                  assume_libs=["torch"])
print(json.dumps({"unmapped": [[u.op, u.backend, u.plugin, u.message] for u in release.unmapped],
                  "choices": {op: [c.resolution.backend, c.action, c.why]
                              for op, per in d.choices.items() for c in per.values()}}))
"""


def _run(*paths):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPDISPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def test_a_plugin_backend_missing_from_the_knob_map_is_named_and_the_rest_loads():
    out, err = _run(UNMAPPED)
    [[op, backend, plugin, message]] = out["unmapped"]
    assert (op, backend, plugin) == ("decode_mla", "plug_unmapped", "unmapped")
    assert "no entry for decode_mla backend plug_unmapped (plugin 'unmapped')" in message
    assert 'add `plug_unmapped: {none: true, why: "..."}`' in message
    assert "under releases[0].backends.decode_mla (" in message and "knobs.yaml:" in message
    assert message in err                       # said once, when the map is loaded
    backend, action, why = out["choices"]["decode_mla"]
    assert (backend, action, why) == ("plug_unmapped", "reported", message)
    # The other ops are decided and carried out as before.
    assert out["choices"]["kv_dequant"][1] in ("kept", "routed")


def test_without_the_plugin_nothing_is_unmapped():
    out, err = _run()
    assert out["unmapped"] == [] and "no entry for" not in err
    assert out["choices"]["decode_mla"][1] != "reported"
