"""`OffloadConfig.transfer`, the one setting of how copies go over the link, and the deprecated booleans it
replaces (accepted for one release, with a DeprecationWarning, mapped onto it)."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest
from fmoe_jax.offload.cache import Mover
from fmoe_jax.offload.config import TRANSFERS, OffloadConfig
from fmoe_jax.offload.transfer import ChunkedJaxMover, JaxMover, ThreadedJaxMover, TimedMover, jax_mover


def test_transfer_defaults_to_direct_copies_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert OffloadConfig().transfer == "direct"
        assert OffloadConfig(transfer="chunked").transfer == "chunked"
    with pytest.raises(
        ValueError, match="transfer must be one of 'direct', 'thread', 'chunked', 'synchronous'"
    ):
        OffloadConfig(transfer="fast")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"chunked_copies": True}, "chunked"),
        ({"transfer_thread": True}, "thread"),
        ({"synchronous_transfers": True}, "synchronous"),
        ({"synchronous_transfers": True, "chunked_copies": True}, "synchronous"),  # it waits for each copy
        ({"chunked_copies": True, "transfer_thread": True}, "chunked"),
        ({"chunked_copies": False}, "direct"),
    ],
)
def test_the_deprecated_booleans_map_onto_transfer_with_a_warning(old, new):
    with pytest.warns(DeprecationWarning, match="pass `transfer` instead"):
        config = OffloadConfig(**old)
    assert config.transfer == new


def test_a_boolean_that_contradicts_transfer_is_refused():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="contradicts"):
        OffloadConfig(transfer="thread", chunked_copies=True)
    with pytest.warns(DeprecationWarning):
        assert OffloadConfig(transfer="chunked", chunked_copies=True).transfer == "chunked"


def test_each_transfer_has_its_mover_and_every_mover_declares_its_capabilities():
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def host(key):
        return (np.full(4, key[1], np.float32),)

    kinds = {
        "direct": JaxMover,
        "synchronous": JaxMover,
        "thread": ThreadedJaxMover,
        "chunked": ChunkedJaxMover,
    }
    assert set(kinds) == set(TRANSFERS)
    for transfer, kind in kinds.items():
        mover = TimedMover(jax_mover(transfer, host, device))
        assert type(mover.inner) is kind and isinstance(mover.inner, Mover)
        handle = mover.start((0, 3))
        mover.wait([handle])
        assert float(mover.result(handle)[0][0]) == 3.0  # a thread's handle is not the arrays: `result` says
        assert mover.load_in(1) > 0  # timed: the hybrid planner may ask
        mover.close()
    with pytest.raises(NotImplementedError, match="TimedMover"):
        JaxMover(host, device).load_in()
