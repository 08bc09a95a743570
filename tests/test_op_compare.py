"""Op.compare judges a backend: cases.compared runs it and the op's reference on the same
inputs, an op that returns nothing on the arguments it writes (the caller's are the
backend's), and the rehearsal's check is that comparison."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from capdispatch.backends import Comparison, builtin  # noqa: E402
from capdispatch.backends.canary_checks import Mismatch  # noqa: E402
from capdispatch.backends.cases import compared, written  # noqa: E402
from capdispatch.backends.kv_cache import reference as KV  # noqa: E402
from capdispatch.backends.kv_cache.calibration import quantized_pool, rand_k  # noqa: E402
from capdispatch.rehearse import checks  # noqa: E402

P = 64


def _quant_args(gen):
    k = rand_k(5, gen, "cpu")
    return k, KV.new_pool(2, P, "cpu"), torch.randperm(2 * P, generator=gen)[:5], P


def test_an_op_that_returns_nothing_is_compared_on_what_it_writes():
    op = builtin().ops["kv_quant"]
    assert written(op) == (1,)
    gen = torch.Generator().manual_seed(0)
    args = _quant_args(gen)
    ok = compared(op, KV.kv_quant, args)
    assert ok.out is None and ok.comparison.ok and ok.comparison.detail == "pool byte-identical to the reference"

    def flips(k, pool, loc, page):
        KV.kv_quant(k, pool, loc, page)
        pool.view(-1)[3] ^= 0x01            # one byte unlike the reference's
    args = _quant_args(gen)
    bad = compared(op, flips, args).comparison
    assert not bad.ok and bad.detail == "1 pool bytes differ from the reference" and bad.error == 1.0
    assert bad.where.startswith("pool[")
    with pytest.raises(Mismatch, match=r"^kv_quant: 1 pool bytes differ") as e:
        bad.check("kv_quant")
    assert e.value.tolerance == "exact" and e.value.where == bad.where


def test_an_op_with_results_is_compared_on_them_and_the_rehearsal_checks_by_it():
    gen = torch.Generator().manual_seed(1)
    pool = quantized_pool(2 * P, P, gen, "cpu")
    args = (pool, torch.randint(0, 2 * P, (7,), generator=gen), P)
    out, ok, detail = checks.call_checked("kv_dequant", KV.kv_dequant, args)
    assert ok and detail == "bit-identical to the reference" and out.shape == (7, 1, 512)
    _, ok, detail = checks.call_checked("kv_dequant", lambda *a: KV.kv_dequant(*a) * 1.5, args)
    assert not ok and detail == "differs from the reference"


def test_a_comparison_is_a_frozen_record():
    c = Comparison(True, "same", 0.0, 0.0)
    assert c.check("x") is c
    with pytest.raises(AttributeError):
        c.ok = False
    with pytest.raises(Mismatch, match=r"^x: off by 0.5 \(bound 0.01\)$"):
        Comparison(False, "off by 0.5 (bound 0.01)", 0.5, 1e-2).check("x")


def test_the_rehearsals_ops_and_references_are_the_declarations():
    from capdispatch.models import model_calls
    reg = builtin()
    assert checks.called_ops() == model_calls().ops
    for op in checks.called_ops():
        assert checks.reference(op) is reg.backend(op, reg.ops[op].reference).load()
