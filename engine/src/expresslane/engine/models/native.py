"""Build a C kernel once per machine and load it through ctypes (the CPU step's native kernels).

The engine's CPU kernels (models/attention.py's live attention, models/cpu_linear.py's row-invariant linear) are
small C sources compiled by the host's C compiler into a per-user cache, keyed by the source, the compiler, the
flags and this CPU's feature flags (a cache shared between hosts must not hand a -march=native build to a CPU
without those instructions), and loaded with ctypes. The runtime image carries g++; where no compiler is found
`NativeKernel.load` raises and the caller decides what runs instead (and says so once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

#: Not -ffast-math: linking with it adds crtfastmath.o, whose constructor sets flush-to-zero / denormals-are-zero
#: in the MXCSR of the whole process when the library loads (every later float op of torch, numpy and Python
#: itself then flushes subnormals; found by hypothesis in a CI run). The reassociation a kernel's sums need, where
#: it wants it, is asked for by that kernel's own flags.
BASE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")


def kernel_cache_dir() -> Path:
    root = os.environ.get("EXPRESSLANE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "expresslane", "kernels")
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return Path(root)
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"expresslane-kernels-{os.getuid()}"


def cpu_flags() -> str:
    """This CPU's feature flags (the build cache's key)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or g++) on PATH")
    return cc


def build(name: str, source: str, flags: Sequence[str], libs: Sequence[str] = ()) -> ctypes.CDLL:
    """Compile `source` with `flags` (and link `libs`) into the kernel cache unless built already; load it."""
    cc = compiler()
    key = hashlib.sha256("\0".join([source, cc, *flags, *libs, sys.platform, os.uname().machine,
                                    cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = kernel_cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"{name}_{key}.so"
    if not lib.exists():
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src, so = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            proc = subprocess.run([cc, *flags, "-o", str(so), str(src), *libs], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-800:]}")
            os.replace(so, lib)  # atomic: a concurrent builder's result is as good
    return ctypes.CDLL(str(lib))


class NativeKernel:
    """One C function of a kernel source, built on first use (thread-safe), or None where it cannot be built
    (warned once, naming what runs instead)."""

    def __init__(self, name: str, source: str, symbol: str, argtypes: list, *, flags: Sequence[str],
                 libs: Sequence[str] = (), instead: str) -> None:
        self.name, self.source, self.symbol, self.argtypes = name, source, symbol, argtypes
        self.flags, self.libs, self.instead = tuple(flags), tuple(libs), instead
        self._lock = threading.Lock()
        self._fn = None  # the loaded function, False once loading failed

    def load(self):
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    try:
                        fn = getattr(build(self.name, self.source, self.flags, self.libs), self.symbol)
                        fn.restype = ctypes.c_int
                        fn.argtypes = self.argtypes
                        self._fn = fn
                    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                        logger.warning("expresslane: the native CPU kernel %s could not be built (%s); %s",
                                       self.name, e, self.instead)
                        self._fn = False
        return self._fn or None
