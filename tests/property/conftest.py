"""Hypothesis profiles for the property and fuzz tests.

`ci` (the default) keeps every test to a bounded example count so the whole
directory runs in well under a minute; `deep` is for a long local hunt:
HYPOTHESIS_PROFILE=deep python -m pytest tests/property
"""
import os

from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much,
                                                     HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=60, derandomize=True, print_blob=True, **_common)
settings.register_profile("deep", max_examples=5000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
