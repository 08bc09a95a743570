"""The served form inside the real SGLang 0.5.23 (CPU, simulated rig, three ranks over
gloo; tests/sglang_scenarios.py `served`): routes bind the group's decision with its
size buckets and without argument checks; sizes whose bucket SGLang's own kernel wins
keep SGLang's call; a policy that names only SGLang's own kernels routes nothing; the
decode route hands SGLang's schedule on (a spy in place of FlashMLA's kernel sees the
object SGLang passed); every rank writes its report; the plan JSON carries the buckets."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="needs SGLang (see tests/requirements-nodeps.txt and tests/requirements.txt)")

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "sglang_scenarios.py")
POL = os.path.join(HERE, "policies")
RIG = "sim:h200,sim:rtx-3080,sim:rtx-3080"
BUCKETS = os.path.join(POL, "served_buckets.yaml")
NATIVE = os.path.join(POL, "served_native.yaml")
TIMEOUT = 300


def _env(extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CAPDISPATCH_", "SGLANG_", "TRITON_INTERPRET"))}
    env.update(extra)
    return env


def _start(*args, env):
    return subprocess.Popen([sys.executable, SCENARIOS, *map(str, args)], env=_env(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc) -> dict:
    out, err = proc.communicate(timeout=TIMEOUT)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """SGLang's launcher once (the record every rank reads), then three scheduler processes
    that agree under the bucketed policy, then under the native-only one."""
    sys.path.insert(0, HERE)
    import sglang_fake_models as fake
    root = tmp_path_factory.mktemp("served")
    dsv4 = fake.write(str(root / "dsv4"), fake.DSV4)
    record = str(root / "served.pkl")
    cases = [{"argv": ["--model-path", dsv4, "--skip-tokenizer-init", "--device", "cuda", "--tp-size", "3"],
              "env": {"CAPDISPATCH_SGLANG_DEVICES": RIG}, "pickle": record}]
    (root / "cases.json").write_text(json.dumps(cases))
    _result(_start("launcher", root / "cases.json", env={}))
    reports = root / "reports"
    env = {"CAPDISPATCH_SGLANG_DEVICES": RIG, "CAPDISPATCH_POLICY": BUCKETS, "CAPDISPATCH_REPORT_DIR": str(reports)}
    port = _free_port()
    procs = [_start("served", record, r, r, port, f"{BUCKETS},{NATIVE}", env=env) for r in range(3)]
    return {"ranks": [_result(p) for p in procs], "reports": reports}


def test_a_bucketed_policy_reaches_the_route_as_the_size_dispatcher_without_checks(ranks):
    h200, sm86 = ranks["ranks"][0]["agreements"][0], ranks["ranks"][1]["agreements"][0]
    assert h200["error"] is None and sm86["error"] is None
    # H200: torch (capdispatch, no checks) up to 2 tokens; above, FlashMLA is SGLang's own: its call stays.
    assert h200["bound"]["decode_mla"] == {"dispatcher": True, "name": "decode_mla_by_tokens", "keeps": True,
                                           "buckets": [[2, "torch", "unchecked"], [None, "flashmla", "sglang"]]}
    assert h200["state"]["choices"]["decode_mla"]["action"] == "routed"
    assert h200["state"]["choices"]["decode_mla"]["install"].startswith("installed at sglang.kernels.ops")
    # RTX 3080: FlashMLA cannot run; both buckets are capdispatch's kernels, without checks.
    assert sm86["bound"]["decode_mla"] == {"dispatcher": True, "name": "decode_mla_by_tokens", "keeps": False,
                                           "buckets": [[2, "torch", "unchecked"], [None, "triton", "unchecked"]]}
    # Every other routed op is bound without checks too.
    for r in ranks["ranks"]:
        for op, b in r["agreements"][0]["bound"].items():
            rows = b["buckets"] if b["dispatcher"] else [[None, b["backend"], b["how"]]]
            assert all(how in ("unchecked", "sglang") for _, _, how in rows), (op, b)


def test_sglangs_call_stays_for_the_sizes_its_kernel_wins_and_gets_its_schedule(ranks):
    d = ranks["ranks"][0]["agreements"][0]["decode"]
    assert d["routed"]
    # 1 token: capdispatch's torch kernel (the reference itself), FlashMLA not called.
    assert d["tokens_1"]["library_calls"] == 0 and d["tokens_1"]["out_rel_err"] == 0.0
    # 3 tokens: SGLang's own call, with the schedule object SGLang made.
    assert d["tokens_3"]["library_calls"] == 1 and d["tokens_3"]["same_schedule"] == [True]
    # capdispatch's flashmla adapter at the route: SGLang's schedule reaches FlashMLA through it
    # (heads padded to FlashMLA's 64 by the adapter: it is the adapter's call, not SGLang's).
    a = d["adapter"]
    assert a["library_calls"] == 1 and a["same_schedule"] == [True] and a["library_q"] == [[3, 1, 64, 512]]


def test_a_policy_naming_only_sglangs_own_kernels_keeps_sglangs_calls(ranks):
    h200 = ranks["ranks"][0]["agreements"][1]
    assert h200["error"] is None and h200["policy"] == "served_native.yaml"
    ch = h200["state"]["choices"]
    for op, runs in (("kv_dequant", "triton_fp8"), ("decode_mla", "flashmla"), ("sparse_prefill", "flashmla_sparse"),
                     ("indexer", "deepgemm")):
        assert (ch[op]["action"], ch[op]["runs"]) == ("kept", runs), (op, ch[op])
        assert ch[op]["why"].startswith("SGLang's own ") and f"{runs} is chosen (" in ch[op]["why"], ch[op]["why"]
        assert h200["state"]["routes"][op] is None
    # The decode route the bucketed policy installed is taken back.
    assert ch["decode_mla"]["install"] == "removed"
    assert h200["decode"]["tokens_1"]["library_calls"] == 1 and h200["decode"]["tokens_1"]["same_schedule"] == [True]
    # The 3080s keep routing what their card cannot run.
    assert ranks["ranks"][1]["agreements"][1]["state"]["choices"]["decode_mla"]["action"] == "routed"


def test_every_rank_writes_its_report_and_logs_one_line(ranks):
    paths = set()
    for i, r in enumerate(ranks["ranks"]):
        for when in [r["configure"]] + r["agreements"]:
            rep = when["report"]
            assert rep is not None and os.path.dirname(rep["path"]) == str(ranks["reports"])
            paths.add(rep["path"])
        body = r["agreements"][0]["report"]["body"]
        dev = r["agreements"][0]["state"]["device"]
        assert body["schema"] == 1 and body["gpu_id"] == i
        assert (body["device"]["id"], body["device"]["name"]) == (dev["id"], dev["name"])
        dm = body["ops"]["decode_mla"]
        assert dm["action"] == "routed" and dm["size_key"] == "tokens"
        assert [(b["tokens"], b["backend"]) for b in dm["buckets"]] == [("<=2", "torch"), (">2", dm["backend"])]
        assert dm["route"].endswith("flash_mla_with_kvcache") and dm["install"].startswith("installed at ")
        assert set(dm["canary"]) == {"torch", dm["backend"]}      # simulated cards: no verdict to read
        ag = body["agreement"]
        assert ag["ranks"] == ["rank0:cuda:0", "rank1:cuda:1", "rank2:cuda:2"] and ag["rank"] == i
        assert ag["agreed"] and ag["not_carried_out"] == [] and len(ag["digest"]) == 64
        assert ag["installs"][i]["decode_mla"] == "installed"
        lines = [m for lv, m in r["agreements"][0]["logs"] if lv == "INFO" and f"(gpu_id {i}):" in m]
        assert len(lines) == 1 and lines[0].endswith(f"report {r['agreements'][0]['report']['path']}")
    assert len(paths) == 3                    # one file per rank, rewritten at each step
    # The H200's line names both buckets and how each runs.
    (line,) = [m for lv, m in ranks["ranks"][0]["agreements"][0]["logs"] if lv == "INFO" and "(gpu_id 0):" in m]
    assert "decode_mla=<=2:torch(routed)/>2:flashmla(kept) routed" in line
    digests = {r["agreements"][0]["report"]["body"]["agreement"]["digest"] for r in ranks["ranks"]}
    assert len(digests) == 1                  # every rank computed the same group record


@pytest.fixture(scope="module")
def broken(ranks):
    """The same rig, where rank 1's decode route cannot be installed: agreement with the
    default policy, then under a strict one."""
    record = os.path.join(os.path.dirname(str(ranks["reports"])), "served.pkl")
    env = {"CAPDISPATCH_SGLANG_DEVICES": RIG, "CAPDISPATCH_REPORT_DIR": str(ranks["reports"]) + "-broken",
           "SCENARIO_BREAK": "1:decode_mla"}
    port = _free_port()
    procs = [_start("served", record, r, r, port, f"-,{os.path.join(POL, 'strict.yaml')}", env=env)
             for r in range(3)]
    return [_result(p) for p in procs]


def test_a_rank_whose_route_install_failed_does_not_agree(broken):
    """Rank 1 could not install its decode route: its choice is reported, every rank's
    report says the group is not agreed and names rank 1's decode_mla, the digest with
    the install outcomes is one for the group, rank 0 warns once; under strict every
    rank stops with the same AgreementError."""
    runs = [r["agreements"][0] for r in broken]
    assert all(a["error"] is None for a in runs)
    assert runs[1]["state"]["choices"]["decode_mla"]["action"] == "reported"
    assert runs[1]["state"]["choices"]["decode_mla"]["install"].startswith("failed: ")
    bodies = [a["report"]["body"]["agreement"] for a in runs]
    assert len({b["digest"] for b in bodies}) == 1 and all(b["digest"] != b["plan_digest"] for b in bodies)
    for b in bodies:
        assert not b["agreed"] and b["installs"][1]["decode_mla"].startswith("failed: ")
        assert b["not_carried_out"] == [
            "decode_mla on rank1:cuda:1: capdispatch triton was decided (routed), but its route was not "
            "installed (" + b["installs"][1]["decode_mla"] + ")"]
    said = [m for a in runs for lv, m in a["logs"] if lv == "WARNING" and "did not carry out" in m]
    assert len(said) == 1 and "decode_mla on rank1:cuda:1" in said[0]
    errors = {r["agreements"][1]["error"] for r in broken}
    assert len(errors) == 1
    (e,) = errors
    assert e.startswith("strict: the ranks did not carry out the group decision alike: decode_mla on rank1:cuda:1")
