"""The environment is read with the GIL held (nat23's rule), also when a CUDA
call is the process's first use of the native code (nat24).

The CUDA driver's path ($AIOXFER_CUDA_DRIVER) is read when the driver is
first loaded. A cyx CUDA call that releases the GIL (cuda_pointer,
cuda_describe, cuda_export, cuda_alloc, cuda_free, cuda_copy) and is the
first use of the engine in the process (no engine made, no probe) loaded it
there: the library's first environment snapshot, 17 getenv calls, ran with
the GIL released, beside any Python thread writing os.environ (putenv may
free what getenv returned). A child process runs each call first, with an
LD_PRELOAD getenv that reports every AIOXFER_/AXF_ lookup made while the
calling thread does not hold the GIL (PyGILState_Check).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_SPY = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

char *getenv(const char *name)
{
    static char *(*real)(const char *);
    static int (*gil)(void);
    if (!real)
        real = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
    if (!gil)
        gil = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
    if ((!strncmp(name, "AIOXFER_", 8) || !strncmp(name, "AXF_", 4)) && gil && !gil()) {
        char line[160];
        int n = snprintf(line, sizeof line, "NOGIL getenv %s\n", name);
        if (n > 0)
            (void)!write(2, line, (size_t)n);
    }
    return real(name);
}
"""

# Each call first in a fresh process; arguments that reach the driver's load
# (it fails: the path names nothing, every call then raises).
CALLS = [
    "cuda_pointer(0x10000, 16)",
    "cuda_describe(0x10000, 16)",
    "cuda_export(0x10000)",
    "cuda_alloc(0, 4096)",
    "cuda_free(0x10000)",
    "cuda_copy(0x10000, 0x20000, 16)",
]


@pytest.fixture(scope="module")
def spy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("spy")
    (d / "spy.c").write_text(_SPY)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "spy.so"), str(d / "spy.c"),
                    "-ldl"], check=True)
    return d / "spy.so"


@pytest.mark.parametrize("call", CALLS)
def test_first_cuda_call_reads_the_environment_with_the_gil(spy: Path, tmp_path: Path,
                                                            call: str) -> None:
    code = (
        "import aioxfer._cyx as c\n"
        f"try:\n    c.{call}\nexcept Exception as exc:\n    print('raised', type(exc).__name__)\n"
        "print('done')\n"
    )
    env = dict(os.environ, LD_PRELOAD=str(spy),
               AIOXFER_CUDA_DRIVER=str(tmp_path / "no-such-libcuda.so"))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout, (r.stdout, r.stderr)
    nogil = [line for line in r.stderr.splitlines() if line.startswith("NOGIL")]
    assert nogil == [], nogil


def test_spy_sees_a_lookup_without_the_gil(spy: Path, tmp_path: Path) -> None:
    """The control: the spy does report a lookup made with the GIL released
    (os.getenv holds it; a C getenv from a thread that never took it)."""
    code = (
        "import ctypes, threading\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.getenv.restype = ctypes.c_char_p\n"
        # ctypes releases the GIL around a foreign call (CDLL, not PyDLL)
        "libc.getenv(b'AIOXFER_CTYPES')\n"
        "pylib = ctypes.PyDLL(None)\n"
        "pylib.getenv.restype = ctypes.c_char_p\n"
        "pylib.getenv(b'AIOXFER_PYDLL')\n"
    )
    env = dict(os.environ, LD_PRELOAD=str(spy))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    nogil = [line for line in r.stderr.splitlines() if line.startswith("NOGIL")]
    assert "NOGIL getenv AIOXFER_CTYPES" in nogil, r.stderr
    assert "NOGIL getenv AIOXFER_PYDLL" not in nogil, r.stderr
