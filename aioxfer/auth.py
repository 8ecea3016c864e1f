"""Where an agent's token comes from when the caller gives none.

Secure by default, zero-config on one host: every agent authenticates its
connections with an HMAC challenge (see :mod:`aioxfer.protocol`). Without an
explicit ``token=``, the token is ``$AIOXFER_TOKEN`` if set, else a random
per-user secret kept in a file only this user can read:
``$XDG_RUNTIME_DIR/aioxfer/token`` (a per-user tmpfs on systemd machines), else
``~/.cache/aioxfer/token``. Every agent of one user on one host reads the same
file, so they connect to each other with no configuration, while another user's
process (which cannot read the file) cannot get in. Across hosts, give every
agent the same ``token=`` (or ``AIOXFER_TOKEN``).

Unauthenticated access is possible only by asking for it by name:
``Agent(..., insecure_no_auth=True)``.

No HMAC is keyed on the token itself but on :func:`hmac_key` of it, a
stretched key (scrypt): whoever a client dials receives a proof it could
test token guesses against offline (SECURITY.md, "The order of the
proofs"), and each guess then costs a derivation, not one HMAC.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import secrets
import stat
import threading
from pathlib import Path

from aioxfer.log import get_logger

__all__ = ["KDF_N", "KDF_P", "KDF_R", "KDF_SALT", "SHORT_TOKEN", "TOKEN_ENV", "default_token",
           "hmac_key", "key_if_derived", "key_soon", "token_path"]

TOKEN_ENV = "AIOXFER_TOKEN"
_TOKEN_BYTES = 32

# The stretching of the token into the key of every HMAC (handshake and join
# proofs, the same-host socket names, the NIXL listener's MACs). The salt is
# fixed, not per agent: both sides of a handshake derive the key alone, from
# the token only; it names aioxfer and the KDF's version, so our keys are no
# other program's scrypt of the same secret (an attacker's table for aioxfer
# helps against aioxfer only). Change any of these and the key changes:
# bump metadata.PROTOCOL_VERSION with them. scrypt with N=2**14, r=8, p=1:
# 16 MiB (128 * N * r) and ~40 ms per derivation on a 2-vCPU VM (2026-12,
# OpenSSL through hashlib; 50-100 ms while other processes load it), so an
# offline guess costs that instead of one HMAC (~0.3 us in C); N=2**15
# takes 32 MiB and ~90 ms.
KDF_SALT = b"aioxfer token key, scrypt v1"
KDF_N = 1 << 14
KDF_R = 8
KDF_P = 1
_KDF_MAXMEM = 2 * 128 * KDF_N * KDF_R  # twice what it needs (OpenSSL counts a little more)
_log = get_logger("aioxfer")


# A token shorter than this is warned about once per process (auth.short_token,
# its length only), never refused: see _derive.
SHORT_TOKEN = 16
_lock = threading.Lock()
# Each token's derivation, under way or done (at most _KEEP done ones kept):
# every caller of one token in this process shares it, whichever thread
# started it, so a token is derived once per process.
_derivations: dict[bytes, concurrent.futures.Future[bytes]] = {}
_KEEP = 64


@functools.lru_cache(maxsize=64)
def hmac_key(token: bytes) -> bytes:
    """The key every HMAC over the token uses: scrypt(token, KDF_SALT,
    N=KDF_N, r=KDF_R, p=KDF_P), 32 bytes. Derived once per token per
    process (cached: an agent derives it when it is made, once, never per
    connection; many agents of one token share it), on the caller's thread
    unless a derivation of it is under way already (key_soon): then this
    waits for that one."""
    return _derivation(bytes(token), threaded=False).result()


def key_soon(token: bytes) -> concurrent.futures.Future[bytes]:
    """The key of ``token`` (as hmac_key), derived on a thread of its own
    when no derivation of it has begun in this process: for a caller on an
    event loop's thread, which awaits it (asyncio.wrap_future) rather than
    blocking the loop for the derivation (~45 ms of a core). Done at once
    when it was derived already."""
    return _derivation(bytes(token), threaded=True)


def key_if_derived(token: bytes) -> bytes | None:
    """The key of ``token`` when this process has derived it already, else None
    (nothing is started)."""
    with _lock:
        fut = _derivations.get(bytes(token))
    if fut is None or not fut.done() or fut.exception() is not None:
        return None
    return fut.result()


def _derivation(token: bytes, *, threaded: bool) -> concurrent.futures.Future[bytes]:
    if not token:
        raise ValueError("token must not be empty")
    with _lock:
        fut = _derivations.get(token)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            return fut
        fut = concurrent.futures.Future()
        # Running from now on, so that nobody can cancel it: it is every
        # caller's of this token, and asyncio.wrap_future passes an awaiting
        # task's cancel on to it (a cancelled start() cancelled it: the
        # thread's set_result raised, and every later use of the token in
        # this process raised CancelledError).
        fut.set_running_or_notify_cancel()
        _derivations[token] = fut
        done = [t for t, f in _derivations.items() if f.done()]
        for t in done[:max(0, len(done) - _KEEP)]:
            del _derivations[t]
    if threaded:
        threading.Thread(target=_derive, args=(token, fut), name="aioxfer-token-key",
                         daemon=True).start()
    else:
        _derive(token, fut)
    return fut


def _derive(token: bytes, fut: concurrent.futures.Future[bytes]) -> None:
    if len(token) < SHORT_TOKEN:
        # Warned, not refused: length is no measure of a secret (16
        # characters of a sentence are weak, 12 random bytes are not), a
        # refusal by length would turn away working deployments while
        # vouching for long weak tokens, and scrypt makes each guess cost a
        # derivation whatever the length. The line says the length only.
        _log.warning("auth.short_token", length=len(token), advice=(
            f"a token shorter than {SHORT_TOKEN} bytes: an offline guess costs one scrypt "
            f"(~25 a second on a core), so a short or chosen token may fall; use a random one, "
            f"e.g. secrets.token_hex(32), as the default per-user token is"))
    try:
        key = _scrypt(token)
    except BaseException as exc:  # (MemoryError; a caller waiting gets it)
        fut.set_exception(exc)
        return
    fut.set_result(key)


def _scrypt(token: bytes) -> bytes:
    return hashlib.scrypt(
        token, salt=KDF_SALT, n=KDF_N, r=KDF_R, p=KDF_P, maxmem=_KDF_MAXMEM, dklen=32
    )


def token_path() -> Path:
    """The per-user token file (it may not exist yet)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _private_dir_ok(Path(runtime)):
        return Path(runtime) / "aioxfer" / "token"
    return Path.home() / ".cache" / "aioxfer" / "token"


def default_token() -> bytes:
    """``$AIOXFER_TOKEN``, else this user's token file's secret (created on
    first use with mode 0600 in a 0700 directory). Raises PermissionError when
    the file exists but another user could read or change it."""
    env = os.environ.get(TOKEN_ENV)
    if env:
        return env.encode()
    path = token_path()
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(path.parent, dir_=True)
    secret = secrets.token_hex(_TOKEN_BYTES).encode()
    tmp = path.with_name(f".token.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        # link, not rename: when two agents start at once, the first one's
        # secret wins and the second reads it, so both hold the same token.
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return _read(path)


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        _check_private(path, fd=fd)
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if not data:
        raise PermissionError(f"token file {path} is empty: delete it to have a new one made")
    return data


def _check_private(path: Path, *, fd: int | None = None, dir_: bool = False) -> None:
    st = os.fstat(fd) if fd is not None else os.stat(path)
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
    loose = st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    if loose:
        what = "directory" if dir_ else "token file"
        raise PermissionError(
            f"{what} {path} is accessible to other users (mode {stat.S_IMODE(st.st_mode):o}): "
            f"chmod it to {'700' if dir_ else '600'}"
        )


def _private_dir_ok(path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    )
