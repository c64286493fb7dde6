"""Test configuration: Hypothesis profiles (HYPOTHESIS_PROFILE=thorough for long local runs), shared servers."""

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.support.servers import moto_server

settings.register_profile("default", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server (server mode) on 127.0.0.1 for the whole session."""
    with moto_server() as endpoint:
        yield endpoint
