"""The verl backend where verl is not installed: the module imports, registers nothing, and checks its settings."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from pulsesync.errors import ConfigError
from pulsesync.integrations.verl import PulseSyncCheckpointEngine, register


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed here")
def test_without_verl_the_module_imports_and_registers_nothing() -> None:
    assert register() is False


def test_a_misspelt_setting_is_one_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"engine_kwargs\.pulsesync: wait_second: not a setting"):
        PulseSyncCheckpointEngine(bucket_size=1 << 20, wait_second=5)


def test_each_side_names_the_settings_it_lacks() -> None:
    engine = PulseSyncCheckpointEngine(bucket_size=1 << 20, is_master=True)
    with pytest.raises(ConfigError, match=r"pulsesync\.publisher: the actor side needs it"):
        asyncio.run(engine.send_weights(iter([])))

    async def receive() -> None:
        async for _ in engine.receive_weights(0):
            pass

    with pytest.raises(ConfigError, match=r"pulsesync\.subscriber: the rollout side needs it"):
        asyncio.run(receive())


def test_get_weights_before_any_step_names_what_is_missing(tmp_path: Path) -> None:
    from pulsesync.errors import PolicyLagError
    from pulsesync.protocol.signing import write_keypair

    _, public, _ = write_keypair(tmp_path / "keys")
    subscriber = {"store": {"url": (tmp_path / "store").as_uri()}, "trusted_keys": [str(public)]}
    engine = PulseSyncCheckpointEngine(bucket_size=1 << 20, subscriber=subscriber)

    async def cached() -> None:
        async for _ in engine.get_weights():
            pass

    with pytest.raises(PolicyLagError, match="holds no verified step yet"):
        asyncio.run(cached())
    engine.close()
