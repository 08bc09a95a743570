"""Library profiles are data checked against the real package metadata of their stack."""
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from capdispatch.capabilities import lib_profiles


def _pins(stack: str) -> dict:
    """canonical name -> the exact version the stack's Requires-Dist pins (None: unpinned),
    for the requirements that apply without an extra."""
    out = {}
    for text in metadata.requires(stack) or ():
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
    try:
        installed = metadata.version(stack.name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{stack.name} is not installed")
    if Version(installed) != Version(want):
        pytest.skip(f"{stack.name} {installed} is installed, the profile describes {want}")
    pins = _pins(stack.name)
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
        stack = Requirement(p.stack).name
        try:
            pins = _pins(stack)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{stack} is not installed")
        for dist in declared & set(pins):
            assert p.get(dist) is not None, (name, dist)


def test_profiles_load_and_unknown_names_suggest():
    assert "sglang-0.5.23" in lib_profiles.names()
    with pytest.raises(lib_profiles.UnknownProfileError, match="did you mean 'sglang-0.5.23'"):
        lib_profiles.lookup("sglang-0.5.32")
