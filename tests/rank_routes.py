"""What a rank installed at SGLang's call sites (the scenarios' rank state), checked without
a hand list of every op: a test names the routes it asserts (which backend a card gets at
which site), and every other op the rank decides is held to the one rule, routed to its own
decision's kernel or to none."""
from __future__ import annotations

from capdispatch.backends.torch_ops import op_name
from capdispatch.models import model_calls


def assert_routes(state: dict, known: dict) -> None:
    """STATE's routes (op -> the custom op's name, or None) are KNOWN for the ops KNOWN
    names; the rank decided exactly the model declaration's ops; every other op's route is
    its decision's kernel when the rank routed it, else none."""
    routes, choices = state["routes"], state["choices"]
    assert set(routes) == set(model_calls().ops) == set(choices), (sorted(routes), sorted(choices))
    assert {op: routes[op] for op in known} == known
    for op in set(routes) - set(known):
        c = choices[op]
        want = op_name(op, c["backend"]) if c["action"] == "routed" else None
        assert routes[op] == want, (op, c, routes[op])


def assert_installs(state: dict, known: dict) -> None:
    """The install lines of STATE's choices: KNOWN's for the ops it names (a missing op: no
    install); every other op has one exactly when the rank routed it."""
    choices = state["choices"]
    assert {op: choices[op]["install"] or None for op in known} == {op: v or None for op, v in known.items()}
    for op in set(choices) - set(known):
        c = choices[op]
        assert bool(c["install"]) == (c["action"] == "routed"), (op, c)
