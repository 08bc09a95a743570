"""Fuzzing the lock-file reader: any input reads or raises LockError (exit 2)."""
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from capdispatch.dispatch.lock import LockError, load, parse

_scalars = st.sampled_from(["", "0x_", "-", "~", "true", "1", "9" * 5000, "2001-02-03", "cuda:0",
                            "sim:rtx-3080", "torch", "kv_quant", "8.6"]) | st.text(max_size=10)
_keys = st.sampled_from(["schema", "devices", "capdispatch", "written", "inputs", "id", "name",
                         "cc", "uuid", "ops", "backend", "libraries", "verified", "buckets"])
_trees = st.recursive(_scalars | st.integers() | st.booleans() | st.none(),
                      lambda k: st.lists(k, max_size=3) | st.dictionaries(_keys, k, max_size=4),
                      max_leaves=16)


def _reads_or_refuses(text):
    try:
        parse(text, "fuzz.lock")
    except LockError as exc:
        assert str(exc).startswith("fuzz.lock")


@given(st.binary(max_size=300))
def test_random_bytes(data):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    _reads_or_refuses(text)


@given(st.dictionaries(_keys, _trees, max_size=4))
def test_random_trees(tree):
    _reads_or_refuses(yaml.safe_dump(tree, allow_unicode=True))


@pytest.mark.parametrize("text", ["schema: 0x_\ndevices: []\n", "schema: true\ndevices: []\n",
                                  "[" * 3000 + "]" * 3000, "a: 1\n\x00\n"])
def test_odd_documents(text):
    with pytest.raises(LockError):
        parse(text, "fuzz.lock")


@pytest.mark.parametrize("make", [lambda d: d, lambda d: str(d / "a\0b"), lambda d: "/proc/self/environ",
                                  lambda d: str(d) + "/\ud800", lambda d: d / "absent.lock"])
def test_paths_that_are_not_lock_files(tmp_path, make):
    with pytest.raises(LockError):
        load(make(tmp_path))
