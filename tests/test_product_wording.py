"""The product speaks to its users, never of how or where it was developed: the README,
every docs/ page, benchmarks/ (scripts, README, notes; not the historical results/) and
the package's YAML files name no lent machine, carried wheels, output folder of a device
call, development rig or path of a particular machine."""
from __future__ import annotations

import glob
import os
import re

import pytest

from doc_files import ROOT, docs

BANNED = re.compile(
    r"\$OUT\b|\blent\b|carr(y|ied|ying) .{0,20}wheels?|wheels? carried|device time|device calls?\b|"
    r"reachable here|/tmp/|/work/|\bseed(['’]s)? (rig|box|machine|cards?|mixed|OOM)\b|"
    r"\bsession folders?\b|\brun_h200\w*", re.I)


def product_files() -> list:
    """Paths relative to the repository root of what the rule covers."""
    files = list(docs())
    for ext in ("py", "sh", "md", "yaml"):
        files += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks", f"*.{ext}")))
    files += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "capdispatch", "**", "*.yaml"),
                                                                 recursive=True))
    return files


def test_the_product_never_speaks_of_how_it_was_developed():
    hits = [f"{path}:{i}: {line.strip()}" for path in product_files()
            for i, line in enumerate(open(os.path.join(ROOT, path), encoding="utf-8"), 1) if BANNED.search(line)]
    assert hits == [], "wording of how or where the project was developed:\n" + "\n".join(hits)


def test_the_rule_covers_benchmarks_docs_and_the_package_yaml_but_not_old_results():
    files = set(product_files())
    assert {"README.md", "docs/dev/gpu-runs.md", "benchmarks/README.md", "benchmarks/gpu_run.sh",
            "benchmarks/runner.py", "benchmarks/sass_bounds_notes.yaml",
            "capdispatch/policies/default.yaml", "capdispatch/adapters/sglang/knobs.yaml"} <= files
    assert not any(f.startswith("benchmarks/results/") for f in files)


@pytest.mark.parametrize("line", [
    "results come back in $OUT", "on the lent H200", "carry the wheels with the tree", "wheels carried in",
    "what the device time bought", "one device call", "the seed rig's cards", "the seed's mixed rig",
    "the seed's OOM", "a session folder per day", "run_h200_gpu_suite.sh", "see /work/x", "cd /tmp/site",
])
def test_the_rule_catches(line):
    assert BANNED.search(line)


@pytest.mark.parametrize("line", [
    "drawn from the seed and its own coordinates", "the mixed rig (an RTX 5090 beside two RTX 3080s)",
    "--seed 1", "is carried out inside SGLang", "run a new session of the kernel",
])
def test_the_rule_leaves_plain_words_alone(line):
    assert not BANNED.search(line)
