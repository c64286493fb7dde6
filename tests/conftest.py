"""Test configuration: Hypothesis profiles; HYPOTHESIS_PROFILE=thorough for long local runs."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
