"""Block compression for the tiers below host memory: byte-shuffle plus lz4 or
zstd, by blosc (the ``blosc`` package: ``pip install aioxfer[kv]``; imported
only when a codec is first used).

The shuffle filter groups the first bytes of every 16-bit value together,
then the second bytes: KV caches in bf16/fp16 have exponent bytes that repeat
far more than whole values do, so shuffled they compress where plain bytes
hardly would. ``typesize`` is the element size (2 for bf16/fp16, 1 for fp8).

``Gate`` decides, per tier, whether compressing pays: the ratio must reach
``min_ratio`` and the compressor must take bytes in at least as fast as the
tier moves them uncompressed (measured on the tier's own plain batches); a
probe batch of the other kind now and then lets it change its mind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["CODECS", "Codec", "Gate", "available"]

CODECS = {"lz4": 1, "zstd": 2}  # the id recorded with each block (0: stored as is)
_NAMES = {v: k for k, v in CODECS.items()}
_LEVELS = {"lz4": 1, "zstd": 1}  # fast levels: a tier codec must keep up with a device

_blosc: Any = None


def _lib() -> Any:
    global _blosc
    if _blosc is None:
        try:
            import blosc
        except ImportError as exc:
            raise ImportError("compression needs the blosc package: pip install "
                              "'aioxfer[kv]' (or blosc)") from exc
        _blosc = blosc
    return _blosc


def available() -> bool:
    try:
        _lib()
    except ImportError:
        return False
    return True


def _address(buf: memoryview) -> int:
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data)


class Codec:
    """One codec: ``compress`` a block (returns the stored bytes) and
    ``decompress_into`` registered memory (no intermediate copy)."""

    def __init__(self, name: str, *, level: int | None = None, typesize: int = 2) -> None:
        if name not in CODECS:
            raise ValueError(f"compress is one of {sorted(CODECS)} or None, not {name!r}")
        if typesize not in (1, 2, 4, 8):
            raise ValueError("typesize is the element size in bytes: 1, 2, 4 or 8")
        self.blosc = _lib()
        self.name = name
        self.id = CODECS[name]
        self.level = _LEVELS[name] if level is None else int(level)
        self.typesize = typesize

    @staticmethod
    def name_of(codec_id: int) -> str:
        return _NAMES.get(codec_id, f"unknown({codec_id})")

    def compress(self, src: memoryview) -> bytes:
        n = len(src)
        b = self.blosc
        # A block that is no whole number of elements goes byte by byte:
        # blosc takes whole elements only, and would leave its tail out.
        ts = self.typesize if n % self.typesize == 0 else 1
        out: bytes = b.compress_ptr(_address(src), n // ts, typesize=ts,
                                    clevel=self.level, shuffle=b.SHUFFLE, cname=self.name)
        return out

    def decompress_into(self, src: memoryview, dst: memoryview) -> int:
        """Decompresses ``src`` into ``dst``; the decompressed length, or -1
        when ``src`` is not a valid compressed block of ``len(dst)`` bytes."""
        b = self.blosc
        if _sizes(src) != (len(dst), len(src)):
            return -1
        try:
            n: int = b.decompress_ptr(src, _address(dst))
        except Exception:
            return -1
        return n


def _sizes(src: memoryview) -> tuple[int, int]:
    """(decompressed, compressed) bytes its blosc header states."""
    if len(src) < 16:
        return -1, -1
    head = bytes(src[:16])
    return int.from_bytes(head[4:8], "little"), int.from_bytes(head[12:16], "little")


class Gate:
    """Whether a tier compresses its next batch (see the module doc)."""

    __slots__ = ("min_ratio", "on", "n", "ratio", "codec_bps", "raw_bps", "probe_raw",
                 "probe_codec")

    def __init__(self, min_ratio: float = 1.15, probe_raw: int = 16,
                 probe_codec: int = 64) -> None:
        self.min_ratio = min_ratio
        self.on = True
        self.n = 0
        self.ratio = 0.0  # EWMA of in/out over compressed batches
        self.codec_bps = 0.0  # EWMA of bytes in per second of compressing
        self.raw_bps = 0.0  # EWMA of bytes per second the tier writes uncompressed
        self.probe_raw = probe_raw
        self.probe_codec = probe_codec

    def compress_next(self) -> bool:
        self.n += 1
        if self.on:
            return self.n % self.probe_raw != 0  # now and then a plain batch: raw speed
        return self.n % self.probe_codec == 0  # now and then a compressed one: may pay again

    @staticmethod
    def _ewma(old: float, new: float) -> float:
        return new if old == 0.0 else 0.8 * old + 0.2 * new

    def note_compressed(self, nbytes_in: int, nbytes_out: int, seconds: float) -> None:
        if nbytes_in <= 0:
            return
        self.ratio = self._ewma(self.ratio, nbytes_in / max(1, nbytes_out))
        self.codec_bps = self._ewma(self.codec_bps, nbytes_in / max(seconds, 1e-9))
        self._decide()

    def note_raw(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0:
            return
        self.raw_bps = self._ewma(self.raw_bps, nbytes / max(seconds, 1e-9))
        self._decide()

    def _decide(self) -> None:
        if self.ratio and self.ratio < self.min_ratio:
            self.on = False
        elif self.ratio and self.raw_bps and self.codec_bps:
            self.on = self.codec_bps >= self.raw_bps
        elif self.ratio:
            self.on = True
