"""Line numbers the docs cite (`default.yaml:20`) point at what they are cited for: the
key on the cited line of the built-in policy is named on the citing line or just above it."""
import os
import re

import pytest
from doc_files import docs as _docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "capdispatch", "policies", "default.yaml")
CITE = re.compile(r"default\.yaml:(\d+)")




def _citations():
    for doc in _docs():
        lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().splitlines()
        for i, line in enumerate(lines):
            for m in CITE.finditer(line):
                yield doc, i, int(m.group(1)), lines


@pytest.mark.parametrize("doc,i,n,lines", list(_citations()),
                         ids=lambda v: v if isinstance(v, (str, int)) else "")
def test_cited_default_yaml_lines_hold_what_they_are_cited_for(doc, i, n, lines):
    policy = open(DEFAULT, encoding="utf-8").read().splitlines()
    assert 1 <= n <= len(policy), f"{doc}:{i + 1}: default.yaml has {len(policy)} lines, not {n}"
    m = re.match(r"\s*(?:-\s*)?(\w+):", policy[n - 1])
    assert m, f"{doc}:{i + 1}: default.yaml:{n} holds no key: {policy[n - 1]!r}"
    key = m.group(1)
    assert key not in ("ops", "devices"), (f"{doc}:{i + 1} cites default.yaml:{n}, the "
                                           f"{key!r} section's header, not a value in it")
    context = "\n".join(lines[max(0, i - 12):i + 1])
    # A `match:` line is cited by what it matches.
    want = re.search(r"\{(\w+):", policy[n - 1]).group(1) if key == "match" else key
    assert want in context, (f"{doc}:{i + 1} cites default.yaml:{n} ({policy[n - 1].strip()!r}) "
                             f"where {want!r} is not named")
