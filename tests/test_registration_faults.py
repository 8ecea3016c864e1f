"""Registration faults from Python: a bad size or name for ``Agent.alloc`` is a
typed error that leaks no memfd; overlapping and double registrations,
double deregistration."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from conftest import wait_until, within

import aioxfer


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("nbytes", [1 << 63, 1 << 64])
async def test_alloc_past_off_t_is_a_registration_error_and_leaks_no_memfd(
    make_agent: Callable[..., Awaitable[Any]], nbytes: int
) -> None:
    agent = await make_agent("big")
    before = open_fds()
    with pytest.raises(aioxfer.RegistrationError):
        agent.alloc(nbytes)
    assert open_fds() == before
    assert agent.regions == []


@pytest.mark.parametrize("nbytes", [1.5, "4096", None])
async def test_alloc_of_a_non_integer_size_is_a_type_error(
    make_agent: Callable[..., Awaitable[Any]], nbytes: Any
) -> None:
    agent = await make_agent("nonint")
    before = open_fds()
    with pytest.raises(TypeError):
        agent.alloc(nbytes)  # never silently 1 byte (int(1.5)) or a parsed string
    assert open_fds() == before and agent.regions == []
    assert agent.alloc(np.int64(4096)).nbytes == 4096  # integers of any kind still do


async def test_alloc_takes_any_name_register_takes(
    make_agent: Callable[..., Awaitable[Any]]
) -> None:
    agent = await make_agent("names")
    a = agent.register(bytearray(64), name="kv\x00a")
    b = agent.alloc(4096, name="kv\x00b")  # memfd_create refused the NUL in its label
    assert (agent.region("kv\x00a"), agent.region("kv\x00b")) == (a, b)


async def test_overlapping_and_double_registration_and_double_deregistration(
    make_agent: Callable[..., Awaitable[Any]]
) -> None:
    agent = await make_agent("overlap")
    buf = bytearray(1 << 16)
    whole = agent.register(buf)
    again = agent.register(buf)  # the same memory twice: two regions, two keys
    half = agent.register(memoryview(buf)[4096:8192])  # a range inside it
    assert len({whole.rid, again.rid, half.rid}) == 3 and whole.key != again.key
    whole.numpy()[:] = 0
    half.numpy()[:] = 7  # one memory: seen through every region over it
    assert bytes(whole.memoryview[4096:4098]) == b"\x07\x07"
    first = agent.deregister(again)
    second = agent.deregister(again)  # twice: no error, a wait of the same release
    await within(first)
    await within(second)
    with pytest.raises(aioxfer.ClosedResourceError):
        again[0:1]
    assert whole[0:1].length == 1  # the other registrations are untouched
    for r in (whole, half):
        agent.deregister(r)
    await wait_until(lambda: agent.statistics().native_regions == 0, what="regions freed")
