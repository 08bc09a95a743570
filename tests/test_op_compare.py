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
    assert not ok and detail == "3584 of 3584 values differ from the reference bits"


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


CANARY_OPS = [op for op, spec in builtin().ops.items() if spec.canary]


@pytest.mark.parametrize("op", CANARY_OPS)
def test_each_canary_judges_by_its_ops_declared_comparison(op, monkeypatch):
    """A canary's verdict is its op's `Op.compare`: a declared comparison that refuses fails
    the canary on the reference itself, with the comparison's words."""
    import importlib
    reg = builtin()
    spec = reg.ops[op]
    module, _, attr = spec.compare.partition(":")
    calls = []

    def refuses(got, want, args, **how):
        calls.append(how)
        return Comparison(False, "refused by the declared comparison", 1.0, 0.0, "here")
    monkeypatch.setattr(importlib.import_module(module), attr, refuses)
    with pytest.raises(Mismatch, match="refused by the declared comparison") as e:
        spec.load_canary()(reg.backend(op, spec.reference).load(), torch.device("cpu"), 3, spec.reference)
    assert calls and e.value.where == "here"


def _attention():
    from capdispatch.backends.sparse_prefill import reference as R
    from capdispatch.backends.sparse_prefill.inputs import make_case
    gen = torch.Generator().manual_seed(4)
    q, kv, idx, tl, sk = make_case(gen, 4, 16, 160, 128, "cpu", lengths=True, sink=True)
    args = (q, kv, idx, 512 ** -0.5, 512, sk, tl)
    return args, R.sparse_prefill(*args)


def test_the_attention_comparison_catches_one_element_the_norm_averages_away():
    compare = builtin().ops["sparse_prefill"].load_compare()
    args, want = _attention()
    assert compare(want, want, args).ok
    out = want[0].clone()
    row = out[1, 2]
    row[7] += 0.05 * row.float().abs().max()           # 5% of the row's largest value: rows 4e-2
    got = (out,) + tuple(want[1:])
    c = compare(got, want, args)
    assert not c.ok and "row's largest value" in c.detail and c.where == "out[1, 2, 7]"
    assert ((out.float() - want[0].float()).norm() / want[0].float().norm()) < 1e-2   # the norm passes it
    got = (want[0], want[1], want[2].clone().fill_(float("inf")))
    assert "lse" in compare(got, want, args).detail


def test_the_indexer_comparison_wants_minus_inf_past_each_row_with_clean_logits():
    from capdispatch.backends.indexer import reference as R
    from capdispatch.backends.indexer.inputs import make_case
    compare = builtin().ops["indexer"].load_compare()
    c = make_case(torch.Generator().manual_seed(5), 2, 1, 64, 130, [40, 130], device="cpu")
    args = (c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"], True)
    want = R.fp8_paged_mqa_logits(*args)
    assert compare(want, want, args).ok
    got = want.clone()
    got[0, 50] = 0.0                                  # past row 0's 40 positions
    bad = compare(got, want, args)
    assert not bad.ok and "not -inf" in bad.detail and bad.where == "logits[0, 50]"
    assert compare(got, want, args[:7] + (False,)).ok  # unspecified there without clean_logits
    got = want.clone()
    got[1, 3] = float("nan")                          # a valid position never written
    assert not compare(got, want, args).ok


def test_the_moe_comparison_wants_a_fully_masked_token_exactly_zero_and_the_backends_bound():
    from capdispatch.backends.moe import reference as R
    from capdispatch.backends.moe.inputs import make_case
    compare = builtin().ops["moe"].load_compare()
    w, x, tw, ids = make_case(6, E=4, H=128, I=128, K=2, T=4, device="cpu")
    ids[2] = -1
    args = (x, w, tw, ids)
    want = R.moe(*args)
    assert compare(want, want, args).ok
    got = want.clone()
    got[2, 5] = 1e-3
    bad = compare(got, want, args)
    assert not bad.ok and "exactly 0" in bad.detail and bad.where == "out[2, :]"
    off = want.clone()
    off[0] += 0.005 * want.float().abs().max()                 # 0.5% of the largest value per element
    assert compare(off, want, args).ok                         # the op-wide norm bound alone
    assert not compare(off, want, args, backend="torch").ok   # the reference's own: 2e-3
