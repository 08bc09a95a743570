"""Agreement across processes: 3 gloo ranks on CPU, each with its own simulated card."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

POL = os.path.join(os.path.dirname(__file__), "policies")

WORKER = textwrap.dedent("""
    import json, logging, os, sys
    import torch.distributed as dist
    import capdispatch as cd
    from capdispatch.dispatch.agreement import AgreementError, agree
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    logging.basicConfig(level=logging.WARNING, format="WARNING %(message)s")
    card = ["sim:rtx-5090", "sim:rtx-3080", "sim:rtx-3080"][rank]
    kwargs = {"assume_libs": ["triton"], "ops": ["kv_quant", "kv_dequant"]}
    if os.environ.get("POLICY"):
        kwargs["policy"] = os.environ["POLICY"]
    try:
        p = agree(cd.probe(card), kwargs.pop("ops"), **kwargs)
        print("RESULT " + json.dumps({op: {d: r.backend for d, r in g.per_device.items()}
                                      for op, g in p.ops.items()}), flush=True)
    except AgreementError as exc:
        print("ABORT " + str(exc).replace("\\n", " "), flush=True)
        sys.exit(3)
    finally:
        dist.destroy_process_group()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(policy=None, worker=WORKER, world=3):
    """Start WORLD ranks of WORKER; return (rc, stdout, stderr) per rank."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPDISPATCH_")}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   POLICY=policy or "")
        procs.append(subprocess.Popen([sys.executable, "-c", worker], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]


def test_three_ranks_agree_and_warn_once():
    runs = _launch()
    results = []
    for rc, out, err in runs:
        assert rc == 0, err
        results.append(next(l for l in out.splitlines() if l.startswith("RESULT ")))
    assert len(set(results)) == 1
    decided = json.loads(results[0][len("RESULT "):])
    assert decided["kv_dequant"] == {"rank0:sim:rtx-5090": "triton_fp8",
                                     "rank1:sim:rtx-3080": "triton_u8",
                                     "rank2:sim:rtx-3080": "triton_u8"}
    warnings = [l for _, _, err in runs for l in err.splitlines() if l.startswith("WARNING")]
    # One WARNING per divergent op for the whole group (both KV ops diverge), from rank 0 only.
    assert len(warnings) == 2 and all("different backends" in w for w in warnings)
    assert "WARNING" in runs[0][2] and "WARNING" not in runs[1][2] + runs[2][2]


def test_mixed_group_error_aborts_every_rank_with_one_message():
    runs = _launch(os.path.join(POL, "error.yaml"))
    assert [rc for rc, _, _ in runs] == [3, 3, 3], [err for _, _, err in runs]
    msgs = {next(l for l in out.splitlines() if l.startswith("ABORT ")) for _, out, _ in runs}
    assert len(msgs) == 1 and "mixed_group is error" in msgs.pop()


NCCL_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import capdispatch as cd
    from capdispatch.dispatch.agreement import agree
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    p = agree(cd.probe(f"cuda:{rank}"))
    print("RESULT " + json.dumps({op: {d: r.backend for d, r in g.per_device.items()}
                                  for op, g in p.ops.items()}), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.gpu
def test_real_ranks_agree_over_nccl():
    import torch
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs two CUDA devices")
    runs = _launch(worker=NCCL_WORKER, world=2)
    results = []
    for rc, out, err in runs:
        assert rc == 0, err
        results.append(next(l for l in out.splitlines() if l.startswith("RESULT ")))
    assert len(set(results)) == 1
    decided = json.loads(results[0][len("RESULT "):])
    assert set(decided["kv_dequant"]) == {"rank0:cuda:0", "rank1:cuda:1"}
    print(results[0])
