"""The resolver's laws, stated over generated devices, libraries, policies and selections."""
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import capdispatch as cd
from capdispatch.backends import builtin
from capdispatch.capabilities import catalog
from capdispatch.dispatch.group import resolve_group_in, unique_ids
from capdispatch.dispatch.resolver import context, known_device_names, resolve_in
from capdispatch.policies import MIXED_GROUP, ON_UNSUPPORTED, PolicyError, parse

REG = builtin()
OPS = list(REG.ops)
DEVICES = [f"sim:{n}" for n in catalog.names()] + ["cpu"]
DISTS = sorted({r.dist for op in OPS for b in REG.backends(op) for r in b.requires
                if hasattr(r, "dist")})


@st.composite
def assumed_libs(draw):
    """Per library: this machine's, assumed present (no version), or assumed too old."""
    out = []
    for dist in DISTS:
        how = draw(st.sampled_from(["machine", "present", "ancient"]))
        if how == "present":
            out.append(dist)
        elif how == "ancient":
            out.append(f"{dist}==0.0.1")
    return out


def _backend_lists(op):
    names = [b.name for b in REG.backends(op)]
    return st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True)


_match = st.one_of(
    st.fixed_dictionaries({"cc": st.sampled_from(["8.0", "8.6", "8.9", "9.0", "12.0", ">=8.9",
                                                  "<8.9", ">=12.0,<13.0", "!=9.0", "==12.*"])}),
    st.fixed_dictionaries({"name": st.sampled_from(sorted(known_device_names()))}),
    st.fixed_dictionaries({"id": st.sampled_from(DEVICES + ["sim:rtx-3080@1", "cuda:0"])}),
)


@st.composite
def policies(draw):
    doc = {"schema": 1}
    if draw(st.booleans()):
        doc["mixed_group"] = draw(st.sampled_from(MIXED_GROUP))
    if draw(st.booleans()):
        doc["on_unsupported"] = draw(st.sampled_from(ON_UNSUPPORTED))
    ops = draw(st.lists(st.sampled_from(OPS), unique=True, max_size=3))
    if ops:
        doc["ops"] = {op: draw(_backend_lists(op)) for op in ops}
    entries = []
    for _ in range(draw(st.integers(0, 3))):
        eops = draw(st.lists(st.sampled_from(OPS), unique=True, min_size=1, max_size=2))
        entries.append({"match": draw(_match), "ops": {op: draw(_backend_lists(op)) for op in eops}})
    if entries:
        doc["devices"] = entries
    return yaml.safe_dump(doc)


@st.composite
def selections(draw):
    ops = draw(st.lists(st.sampled_from(OPS), unique=True, max_size=2))
    return {op: draw(st.sampled_from([b.name for b in REG.backends(op)])) for op in ops}


def _context(policy_text, sels, libs, strict):
    pf = parse(policy_text, "gen.yaml", REG, known_devices=known_device_names())
    return context(policy=pf, selections=sels or None, assume_libs=libs, strict=strict, env={})


@settings(max_examples=60)
@given(policies(), selections(), assumed_libs(), st.booleans(), st.sampled_from(DEVICES),
       st.sampled_from(OPS))
def test_one_device_laws(policy_text, sels, libs, strict, device, op):
    ctx = _context(policy_text, sels, libs, strict)
    plain = context(assume_libs=libs, env={})     # no policy, no selection
    spec = cd.probe(device)
    try:
        res = resolve_in(ctx, op, spec)
    except cd.NoBackendError as exc:
        # Nothing runs: then nothing runs without the policy either.
        assert all(not c.ok for c in exc.candidates)
        with pytest.raises(cd.NoBackendError):
            resolve_in(plain, op, spec)
        return
    except cd.StrictFallbackError:
        assert ctx.strict_effective
        return
    registered = [b.name for b in REG.backends(op)]
    # Candidates are a permutation of the op's registered backends.
    assert sorted(c.backend for c in res.candidates) == sorted(registered)
    assert len(res.candidates) == len(registered)
    # The winner is runnable: every one of its checks holds, and it is the first that does.
    win = next(c for c in res.candidates if c.backend == res.backend)
    assert win.ok and win.checks and all(ch.ok for ch in win.checks)
    assert res.backend == next(c.backend for c in res.candidates if c.ok)
    # A policy never makes an impossible kernel run: runnability is the policy-free verdict.
    base = {c.backend: c.ok for c in resolve_in(plain, op, spec).candidates}
    assert {c.backend: c.ok for c in res.candidates} == base
    # A selection that could run is what runs.
    if op in sels and base[sels[op]]:
        assert res.backend == sels[op] and not res.fallback
    # Deterministic: the same inputs give the same decision and trace.
    assert resolve_in(_context(policy_text, sels, libs, strict), op, spec).to_dict() == res.to_dict()


@settings(max_examples=40)
@given(policies(), assumed_libs(), st.lists(st.sampled_from(DEVICES), min_size=1, max_size=4),
       st.sampled_from(OPS))
def test_uniform_runs_one_backend_every_device_can_run(policy_text, libs, devices, op):
    doc = yaml.safe_load(policy_text)
    doc["mixed_group"] = "uniform"
    ctx = _context(yaml.safe_dump(doc), {}, libs, False)
    specs = unique_ids([cd.probe(d) for d in devices])
    try:
        g = resolve_group_in(ctx, op, specs)
    except cd.NoBackendError as exc:
        assert all(not c.ok for c in exc.candidates)
        return
    except cd.StrictFallbackError:
        assert ctx.strict_effective
        return
    except cd.Unsatisfiable:
        # No backend is runnable on every device.
        runnable = [{c.backend for c in resolve_in(ctx, op, s).candidates if c.ok} for s in specs]
        assert not set.intersection(*runnable)
        return
    chosen = {r.backend for r in g.per_device.values()}
    assert g.uniform and len(chosen) == 1
    backend = chosen.pop()
    for r in g.per_device.values():
        assert next(c for c in r.candidates if c.backend == backend).ok
    assert list(g.per_device) == [s.id for s in specs]


@settings(max_examples=100)
@given(policies())
def test_generated_valid_policies_load(policy_text):
    """The generator writes only valid policies: each must load (never PolicyError)."""
    parse(policy_text, "gen.yaml", REG, known_devices=known_device_names())


@settings(max_examples=100)
@given(policies(), st.integers(0, 10_000), st.sampled_from(["x", "", "0x_", "[", "~", "true"]))
def test_a_corrupted_policy_loads_or_is_a_policy_error(policy_text, where, junk):
    where %= max(1, len(policy_text))
    text = policy_text[:where] + junk + policy_text[where:]
    try:
        parse(text, "gen.yaml", REG, known_devices=known_device_names())
    except PolicyError as exc:
        assert str(exc).startswith("gen.yaml")
