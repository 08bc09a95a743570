"""What a command's standard error never holds, whatever text of the input it echoes back.

A refusal quotes the value it refused, so a generated value such as "Traceback" or
"internal error" appears in a correct one-line error; the checks look for the markers
themselves at the start of a line: Python's traceback header and the entry points'
internal-error line.
"""
import re

_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.M)
_INTERNAL = re.compile(r"^[\w.-]+: internal error: ", re.M)


def assert_no_crash(err: str) -> None:
    assert not _TRACEBACK.search(err), err
    assert not _INTERNAL.search(err), err
