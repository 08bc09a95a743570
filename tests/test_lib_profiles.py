"""Library profiles are data checked against the real package metadata of their stack."""
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from capdispatch.capabilities import lib_profiles


def _distribution(name: str, version: str):
    """The stack's distribution at VERSION: the venv's, or a release folder the README's test
    command installs (tests/sglang_releases.py); None when neither holds it."""
    import glob
    import os
    import pathlib

    import sglang_releases
    try:
        if Version(metadata.version(name)) == Version(version):
            return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        pass
    folder = sglang_releases.FOLDERS.get(version) if canonicalize_name(name) == "sglang" else None
    infos = glob.glob(os.path.join(folder, f"sglang-{version}.dist-info")) if folder else []
    return metadata.PathDistribution(pathlib.Path(infos[0])) if infos else None


def _pins(dist) -> dict:
    """canonical name -> the exact version the stack's Requires-Dist pins (None: unpinned),
    for the requirements that apply without an extra."""
    out = {}
    for text in dist.requires or ():
        req = Requirement(text)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        exact = [s.version for s in req.specifier if s.operator == "=="]
        out[canonicalize_name(req.name)] = exact[0] if exact else None
    return out


@pytest.mark.parametrize("name", lib_profiles.names())
def test_profile_matches_its_stacks_metadata(name):
    p = lib_profiles.lookup(name)
    stack = Requirement(p.stack)
    want = next(s.version for s in stack.specifier if s.operator == "==")
    dist = _distribution(stack.name, want)
    if dist is None:
        pytest.skip(f"{stack.name} {want} is neither installed nor in a release folder")
    pins = _pins(dist)
    assert p.get(stack.name).version == want
    for lib in p.libraries:
        if lib.name == canonicalize_name(stack.name):
            continue
        if lib.version is not None:
            assert pins.get(lib.name) == lib.version, (lib.name, pins.get(lib.name))
        else:
            # Unpinned: the stack lists it without a pin, or a listed library brings it.
            assert (lib.name in pins and pins[lib.name] is None) or p.get(lib.via) is not None, lib


def test_every_pinned_backend_library_of_the_stack_is_in_the_profile():
    # A library some backend declares and the stack pins must not be left out of the
    # profile (it would read as "not installed" on the target).
    import capdispatch.backends as b
    from capdispatch.dispatch.resolver import library_names
    declared = library_names(b.builtin())
    for name in lib_profiles.names():
        p = lib_profiles.lookup(name)
        stack = Requirement(p.stack)
        found = _distribution(stack.name, next(s.version for s in stack.specifier if s.operator == "=="))
        if found is None:
            pytest.skip(f"{stack} is neither installed nor in a release folder")
        pins = _pins(found)
        for dist in declared & set(pins):
            assert p.get(dist) is not None, (name, dist)


def test_profiles_load_and_unknown_names_suggest():
    assert "sglang-0.5.23" in lib_profiles.names()
    with pytest.raises(lib_profiles.UnknownProfileError, match="did you mean 'sglang-0.5.23'"):
        lib_profiles.lookup("sglang-0.5.32")


def test_every_release_the_tests_run_has_a_profile():
    """SGLang's releases in the adapter's tested range that the suite installs are each a
    profile, checked against that release's own metadata above (never skipped: the README's
    test command installs both)."""
    import sglang_releases
    for release in sglang_releases.RELEASES:
        name = f"sglang-{release}"
        assert name in lib_profiles.names(), name
        assert _distribution("sglang", release) is not None, release
