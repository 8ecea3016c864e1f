"""Contiguity of CUDA arrays described by __cuda_array_interface__ / __dlpack__:
the stride of a size-1 dimension is never stepped over, so any value there is
still one C-order block (a transposed column vector: shape (1, N), strides
(1, 1)), as numpy's own flags say; an empty array is refused as empty, not as
strided. Parsed only: no GPU or driver is needed."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from aioxfer import cuda


class CaiArray:
    """Device memory described by the CUDA array interface, as CuPy/PyTorch do."""

    def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...] | None,
                 typestr: str = "<f4", ptr: int = 0x7F00_0000_0000) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (ptr, False),
            "version": 3, "strides": strides, "stream": None,
        }


class _DLManaged(ctypes.Structure):
    _fields_ = [("tensor", cuda._DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class StridedDLPack:
    """A CUDA DLPack producer with a real "dltensor" capsule, strides in elements."""

    def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...] | None,
                 bits: int = 32, ptr: int = 0x7F00_0000_0000) -> None:
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(shape))(*(strides or ()))
        self._m = _DLManaged()
        t = self._m.tensor
        t.data = ptr
        t.device.device_type = cuda.KDL_CUDA
        t.ndim = len(shape)
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, bits, 1
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if strides is not None:
            t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))

    def __dlpack_device__(self) -> tuple[int, int]:
        return (cuda.KDL_CUDA, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._m), b"dltensor", None)


# (shape, strides in elements): contiguous, whatever a size-1 dimension says
CONTIGUOUS = [
    ((1, 8), (1, 1)),       # a column vector transposed (numpy: x.T of shape (8, 1))
    ((1, 8), (0, 1)),       # a broadcast leading dimension of size 1
    ((8, 1), (1, 1)),
    ((8, 1), (1, 99)),
    ((2, 1, 4), (4, 1, 1)),
    ((2, 1, 4), (4, 7, 1)),
    ((1, 1, 1), (5, 6, 7)),  # one element: no layout at all
    ((4, 8), (8, 1)),        # plainly C-contiguous
]
STRIDED = [
    ((4, 8), (1, 4)),        # Fortran order
    ((2, 1, 4), (8, 1, 1)),  # a gap between the rows
    ((1, 8), (8, 2)),        # every other element
]


def test_numpy_agrees_on_the_cases() -> None:
    # The cases mean what they say: numpy's own C-contiguity flag (with the
    # memory to back them, strides in bytes).
    for shape, strides in CONTIGUOUS + STRIDED:
        base = np.zeros(64, dtype=np.float32)
        view = np.lib.stride_tricks.as_strided(base, shape, tuple(4 * s for s in strides))
        assert view.flags.c_contiguous == ((shape, strides) in CONTIGUOUS), (shape, strides)


@pytest.mark.parametrize("shape,strides", CONTIGUOUS)
def test_cai_size_one_dimension_strides_ignored(shape: tuple[int, ...],
                                                strides: tuple[int, ...]) -> None:
    m = cuda.inspect(CaiArray(shape, tuple(4 * s for s in strides)))
    assert m == cuda.GpuMemory("cuda", 0x7F00_0000_0000, 4 * int(np.prod(shape)), False)


@pytest.mark.parametrize("shape,strides", CONTIGUOUS)
def test_dlpack_size_one_dimension_strides_ignored(shape: tuple[int, ...],
                                                   strides: tuple[int, ...]) -> None:
    m = cuda.inspect(StridedDLPack(shape, strides))
    assert m == cuda.GpuMemory("cuda", 0x7F00_0000_0000, 4 * int(np.prod(shape)), False)


@pytest.mark.parametrize("shape,strides", STRIDED)
def test_strided_still_refused(shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    with pytest.raises(cuda.NotContiguous):
        cuda.inspect(CaiArray(shape, tuple(4 * s for s in strides)))
    with pytest.raises(cuda.NotContiguous):
        cuda.inspect(StridedDLPack(shape, strides))


def test_empty_refused_as_empty_whatever_its_strides() -> None:
    # no element: the strides describe nothing; the refusal says why it is
    # really refused
    for shape, strides in (((0, 8), (1, 4)), ((8, 0), (3, 3)), ((0,), (2,))):
        with pytest.raises(ValueError, match="empty") as ei:
            cuda.inspect(CaiArray(shape, tuple(4 * s for s in strides)))
        assert not isinstance(ei.value, cuda.NotContiguous)
        with pytest.raises(ValueError, match="empty") as ei:
            cuda.inspect(StridedDLPack(shape, strides))
        assert not isinstance(ei.value, cuda.NotContiguous)


def test_strides_of_the_wrong_length_refused() -> None:
    with pytest.raises(cuda.NotContiguous):
        cuda.inspect(CaiArray((4, 8), (4,)))


def test_no_strides_means_c_order() -> None:
    assert cuda.inspect(CaiArray((4, 8), None)) is not None
    assert cuda.inspect(StridedDLPack((4, 8), None)) is not None
