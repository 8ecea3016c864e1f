"""aioxfer.TransferResult is compiled (_cyx.TransferResult, from a free list:
a frozen slots dataclass was made and freed per request through the generic
heap-type paths). Its public behaviour is the dataclass's: checked here
against a frozen slots dataclass of the same fields, as aioxfer.transfer
declared it before."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

import aioxfer
from aioxfer import _cyx
from aioxfer.transfer import TransferResult


@dataclass(frozen=True, slots=True)
class Old:
    """aioxfer.transfer's TransferResult before it was compiled."""

    nbytes: int
    seconds: float
    path: str
    reroutes: int = 0


def _same_repr(new: object, old: object) -> bool:
    return repr(new) == repr(old).replace("Old(", "TransferResult(", 1)


def test_the_public_name_is_the_compiled_class() -> None:
    assert aioxfer.TransferResult is TransferResult is _cyx.TransferResult
    assert TransferResult.__module__ == "aioxfer.transfer"
    assert TransferResult.__qualname__ == TransferResult.__name__ == "TransferResult"
    assert repr(TransferResult) == "<class 'aioxfer.transfer.TransferResult'>"
    with pytest.raises(TypeError):
        type("Sub", (TransferResult,), {})  # final, as a slots dataclass is in practice


@pytest.mark.parametrize("args, kw", [
    ((4096, 0.25, "shm"), {}),
    ((4096, 0.25, "tcp", 3), {}),
    ((), {"nbytes": 1, "seconds": 2.0, "path": "file", "reroutes": 1}),
    ((1 << 70, 1, "x"), {}),  # not coerced: what was given is kept
])
def test_it_behaves_as_the_dataclass(args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    new, old = TransferResult(*args, **kw), Old(*args, **kw)
    assert _same_repr(new, old)
    assert [f.name for f in dataclasses.fields(new)] == [f.name for f in dataclasses.fields(old)]
    assert [(f.type, f.default) for f in dataclasses.fields(TransferResult)] == [
        (f.type, f.default) for f in dataclasses.fields(Old)]
    assert dataclasses.is_dataclass(new) and dataclasses.is_dataclass(TransferResult)
    assert TransferResult.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert dataclasses.asdict(new) == dataclasses.asdict(old)
    assert dataclasses.astuple(new) == dataclasses.astuple(old)
    assert TransferResult.__match_args__ == Old.__match_args__
    assert hash(new) == hash(old)
    assert str(inspect.signature(TransferResult)) == str(inspect.signature(Old))
    # == over the fields, only with its own class (NotImplemented otherwise)
    assert new == TransferResult(*args, **kw) and not (new != TransferResult(*args, **kw))
    others: list[object] = [old, dataclasses.astuple(new)]
    assert all(new != o for o in others) and new.__eq__(old) is NotImplemented
    other = dataclasses.replace(new, path="elsewhere")
    assert type(other) is TransferResult and other.path == "elsewhere" and other != new
    assert _same_repr(other, dataclasses.replace(old, path="elsewhere"))
    assert new.__replace__(reroutes=9) == dataclasses.replace(new, reroutes=9)  # copy.replace
    for c in (copy.copy(new), copy.deepcopy(new), pickle.loads(pickle.dumps(new))):
        assert type(c) is TransferResult and c == new
    match new:
        case TransferResult(n, s, p, r):
            assert (n, s, p, r) == dataclasses.astuple(old)
        case _:
            pytest.fail("no match")


def test_it_is_frozen() -> None:
    r, o = TransferResult(4096, 0.5, "shm"), Old(4096, 0.5, "shm")
    for name in ("nbytes", "seconds", "path", "reroutes"):
        with pytest.raises(dataclasses.FrozenInstanceError) as new_err:
            setattr(r, name, 1)
        with pytest.raises(dataclasses.FrozenInstanceError) as old_err:
            setattr(o, name, 1)
        assert str(new_err.value) == str(old_err.value)
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(r, name)
    with pytest.raises(AttributeError):
        r.other = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        TransferResult(4096, 0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        assert r < r  # type: ignore[operator]  # (no order, as the dataclass)
    assert r == TransferResult(4096, 0.5, "shm", 0)


def test_a_pickle_of_the_dataclass_loads() -> None:
    """What pickle made of the dataclass (copyreg's __newobj__ of the class,
    then its fields' values as the state) loads as the compiled class."""

    data = pickle.dumps(Old(4096, 0.5, "shm", 2), protocol=2)
    ref = f"c{Old.__module__}\n{Old.__qualname__}\n".encode()
    assert ref in data  # (protocol 2 names the class by a GLOBAL opcode)
    r = pickle.loads(data.replace(ref, b"caioxfer.transfer\nTransferResult\n"))
    assert type(r) is TransferResult and r == TransferResult(4096, 0.5, "shm", 2)


async def test_awaited_transfers_return_it(make_agent: Callable[..., Awaitable[Any]]) -> None:
    """Awaited and drained results (the compiled drain's free-list path, many
    alive at once) and their fields."""
    target = await make_agent("target")
    init = await make_agent("init")
    peer = await init.connect(target.address)
    target.alloc(1 << 20, name="r")
    await peer.refresh()
    local, remote = init.alloc(1 << 20, name="l"), peer.region("r")
    one = await init.write(local[0:4096], remote[0:4096])
    ts = [init.write(local[i * 4096:(i + 1) * 4096], remote[i * 4096:(i + 1) * 4096])
          for i in range(200)]
    results = [await t for t in ts]
    for r in [one, *results]:
        assert type(r) is TransferResult
        assert r.nbytes == 4096 and r.path == peer.path and r.reroutes == 0
        assert type(r.seconds) is float and r.seconds >= 0
        assert repr(r) == (f"TransferResult(nbytes=4096, seconds={r.seconds!r}, "
                           f"path={peer.path!r}, reroutes=0)")
    assert len({id(r) for r in results}) == len(results)
    del results, ts
    again = [await init.read(local[0:4096], remote[0:4096]) for _ in range(100)]
    assert all(r.nbytes == 4096 and r.path == peer.path for r in again)
