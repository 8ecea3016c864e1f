"""rev34: Agent.register's refusals are RegistrationErrors, also when the
object's own GPU-memory protocol raises (no GPU needed: these fail before
any driver is asked)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import aioxfer
from aioxfer import cuda


class GradTensor:
    """As a torch CUDA tensor that requires grad: its interface refuses."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        raise RuntimeError(
            "Can't get __cuda_array_interface__ on Variable that requires grad. "
            "Use var.detach().__cuda_array_interface__ instead."
        )


class GradCpuTensor:
    """As a torch CPU tensor that requires grad (no buffer protocol)."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (cuda.KDL_CPU, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")


class NoTypestr:
    __cuda_array_interface__ = {"shape": (4,), "data": (0x1000, False), "version": 3}


class BadShape:
    __cuda_array_interface__ = {"shape": None, "typestr": "|u1", "data": (0x1000, False),
                                "version": 3}


@pytest.mark.parametrize("obj", [GradTensor(), GradCpuTensor(), NoTypestr(), BadShape()],
                         ids=["cai-raises", "dlpack-raises", "cai-no-typestr", "cai-bad-shape"])
async def test_register_refusals_of_the_objects_protocol_are_registration_errors(
    make_agent: Callable[..., Awaitable[Any]], obj: Any
) -> None:
    agent = await make_agent("refusals")
    with pytest.raises(aioxfer.RegistrationError, match=f"cannot register {type(obj).__name__}"):
        agent.register(obj)
    assert agent.regions == []
