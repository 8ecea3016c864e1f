"""Block keys: 32-byte SHA-256 digests chained over token prefixes.

A key names the KV of one block of ``block_tokens`` tokens *given everything
before it*: key_i = SHA-256(tag ‖ len(namespace) ‖ namespace ‖ key_{i-1} ‖
tokens of block i), with the token ids as fixed-width (uint32) little-endian
integers. Nothing in it depends on the process (no ``hash()``, no
``PYTHONHASHSEED``, no pickling), so every worker, and this worker after a
restart, computes the same bytes for the same tokens: that is what lets a disk
tier survive restarts and peers share blocks. The namespace binds keys to what
makes KV bytes differ for the same tokens (model, dtype, tensor-parallel rank,
LoRA adapter, ...): keys of two namespaces never coincide.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["KEY_BYTES", "ROOT", "chain", "import_key"]

KEY_BYTES = 32
ROOT = bytes(KEY_BYTES)  # the parent of a sequence's first block

# Domain tags: a chained key and an imported key can never be equal, and a
# later version of either scheme gets a new tag rather than colliding with this.
_CHAIN_TAG = b"aioxfer.kv.chain/v1\x00"
_IMPORT_TAG = b"aioxfer.kv.import/v1\x00"
_TOKEN_DTYPE = np.dtype("<u4")


def _ns_prefix(tag: bytes, namespace: bytes | str) -> bytes:
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return tag + len(ns).to_bytes(4, "little") + ns


def chain(
    tokens: Sequence[int] | npt.ArrayLike,
    *,
    block_tokens: int = 16,
    namespace: bytes | str = b"",
    parent: bytes = ROOT,
) -> list[bytes]:
    """The keys of the full blocks of ``tokens`` (a trailing partial block has
    none, as in vLLM and SGLang). ``parent``: the key of the block before
    ``tokens[0]`` (to extend a chain), ``ROOT`` for a sequence's start.

    Token ids must fit in 32 bits (every tokenizer's do); they are hashed as
    little-endian uint32, so a list, a numpy array of any integer dtype and a
    torch tensor's ``.numpy()`` give the same keys."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, not of shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, not {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    n = arr.size // block_tokens
    data = np.ascontiguousarray(arr[: n * block_tokens], dtype=_TOKEN_DTYPE).tobytes()
    stride = block_tokens * _TOKEN_DTYPE.itemsize
    prefix = hashlib.sha256(_ns_prefix(_CHAIN_TAG, namespace))  # hashed once, copied per block
    keys: list[bytes] = []
    key = bytes(parent)
    for i in range(n):
        h = prefix.copy()
        h.update(key)
        h.update(data[i * stride : (i + 1) * stride])
        key = h.digest()
        keys.append(key)
    return keys


def import_key(
    value: int | bytes | str, *, namespace: bytes | str = b"", source: str = "vllm"
) -> bytes:
    """Maps another system's block hash into this key space: a vLLM
    ``BlockHash`` (bytes, or an int from older versions), an SGLang or LMCache
    chunk hash (int, possibly negative), or any str. ``source`` names the
    scheme, so equal values from two systems stay distinct keys.

    The result is as stable as ``value`` is: LMCache's default builtin-hash
    chunk keys change with ``PYTHONHASHSEED``; use its sha256 mode (or vLLM's
    ``sha256_cbor``) where keys must survive restarts."""
    if isinstance(value, bool):
        raise TypeError("a block hash is an int, bytes or str, not a bool")
    if isinstance(value, int):
        # Signed, minimal two's-complement little-endian: every int (Python's
        # are unbounded and LMCache's may be negative) has one encoding.
        width = max(1, (value.bit_length() + 8) // 8)
        body = b"i" + value.to_bytes(width, "little", signed=True)
    elif isinstance(value, bytes | bytearray | memoryview):
        body = b"b" + bytes(value)
    elif isinstance(value, str):
        body = b"s" + value.encode()
    else:
        raise TypeError(f"a block hash is an int, bytes or str, not {type(value).__name__}")
    src = source.encode()
    h = hashlib.sha256(_ns_prefix(_IMPORT_TAG, namespace))
    h.update(len(src).to_bytes(4, "little") + src)
    h.update(body)
    return h.digest()
