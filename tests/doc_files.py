"""The files users read as documentation: README.md and every docs/ page (for the tests
that check what they cite and name)."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def docs():
    """Paths relative to the repository root: README.md, then docs/**/*.md in order."""
    yield "README.md"
    for base, _, files in os.walk(os.path.join(ROOT, "docs")):
        for f in sorted(files):
            if f.endswith(".md"):
                yield os.path.relpath(os.path.join(base, f), ROOT)
