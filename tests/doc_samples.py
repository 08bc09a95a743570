"""The command samples the docs show, regenerated from the commands themselves.

A sample is a fenced block whose first line is `$ dispatch ARGS`, right after the line
MARK in README.md or a docs/ page: its text is what `python -m capdispatch ARGS` prints on
stdout today (simulated devices, pinned library profiles: the same on every machine), so
the ops and backends it lists are the registry's and the policy's, not a copy kept by hand.

    python tests/doc_samples.py            # say which samples differ (exit 1)
    python tests/doc_samples.py --write    # rewrite them

tests/test_readme.py fails when a sample differs and names this command.
"""
import os
import re
import shlex
import subprocess
import sys

if __name__ == "__main__":         # run as a script: doc_files lies beside it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from doc_files import docs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "<!-- sample: python tests/doc_samples.py -->"
REGENERATE = "python tests/doc_samples.py --write"
_BLOCK = re.compile(re.escape(MARK) + r"\n```\n(\$ dispatch (?P<args>[^\n]*))\n(?P<body>.*?)```\n", re.S)


def output(args: str) -> str:
    """What `dispatch ARGS` prints on stdout, run from the repository root with this tree first."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for name in ("COLUMNS", "LINES", "CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_LOCK", "CAPDISPATCH_STRICT"):
        env.pop(name, None)
    p = subprocess.run([sys.executable, "-m", "capdispatch", *shlex.split(args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    return p.stdout


def samples():
    """(doc, line, args, shown text, today's text) of every marked sample."""
    for doc in docs():
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for m in _BLOCK.finditer(text):
            yield doc, text[:m.start()].count("\n") + 2, m["args"], m["body"], output(m["args"])


def write() -> list:
    """Rewrite every marked sample that differs; the docs changed."""
    changed = []
    for doc in docs():
        path = os.path.join(ROOT, doc)
        text = open(path, encoding="utf-8").read()
        new = _BLOCK.sub(lambda m: f"{MARK}\n```\n{m[1]}\n{output(m['args'])}```\n", text)
        if new != text:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(new)
            changed.append(doc)
    return changed


def main(argv) -> int:
    if argv == ["--write"]:
        for doc in write():
            print(f"rewrote {doc}")
        return 0
    if argv:
        print(__doc__.strip().splitlines()[-4], file=sys.stderr)
        return 2
    stale = [f"{doc}:{line}: dispatch {args}" for doc, line, args, shown, now in samples() if shown != now]
    for s in stale:
        print(f"{s}: differs from its output today (run: {REGENERATE})")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
