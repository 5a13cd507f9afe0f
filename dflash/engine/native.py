"""The engine's own CPU kernels (csrc/): low-bit products and attention whose rows do
not depend on how many rows a call has. Built once per machine with the system's C++ compiler
through torch's extension loader (`python -m dflash.engine.native build`, or the first use),
into ~/.cache/dflash/native-<hash>; where no compiler is present they are absent and the
engine runs its torch kernels (`available()` says which, `problem()` why).

    torch.ops.dflash_lowbit.qmm(x, u, d, m, n, bits)    # (..., K) fp32 -> (..., N) fp32
    torch.ops.dflash_lowbit.attend(q, k, v, past, mask, scale)
    torch.ops.dflash_lowbit.quantize(x)                 # int8 per row and 32-value block
    torch.ops.dflash_lowbit.llama_forward(...)          # every Llama layer in one call (csrc/layer.cpp)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from dflash.engine import machine

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("half.cpp", "qmm.cpp", "attend.cpp", "layer.cpp", "ops.cpp")  # and lowbit.h, which they share
NAME = "dflash_lowbit"
FLAGS = ["-O3", "-ffp-contract=off", "-std=c++17"]  # no contraction: the float order is the source's
# at::parallel_for (an inline template in torch's headers) runs threads only in code compiled with
# OpenMP, else serially; a compiler without OpenMP (Apple's clang) builds the serial kernels
OPENMP = ["-fopenmp"]


class _State:
    """The outcome of the one build attempt of this process (the library, or why not)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tried = False
        self.error: str | None = None
        self.openmp = True  # the loaded build's (the one tried first, until a build loads)


_STATE = _State()


def build_dir(openmp: bool | None = None) -> Path:
    """Where this source, compiled for this torch and Python (with OpenMP or not; None: as the
    loaded build), lives on this machine."""
    openmp = _STATE.openmp if openmp is None else openmp
    text = b"".join((CSRC / name).read_bytes() for name in SOURCES + ("lowbit.h",))
    flags = FLAGS + (OPENMP if openmp else [])
    digest = hashlib.sha256(text + torch.__version__.encode() + " ".join(flags).encode()
                            + sys.version.encode()).hexdigest()[:12]
    return machine.cache_dir() / f"native-{digest}"


def _compiler_problem() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH)"
    try:
        import ninja  # noqa: F401  (torch's loader drives the build with it)
    except ImportError:
        if shutil.which("ninja") is None:
            return "ninja is not installed (pip install ninja)"
    return None


def load(verbose: bool = False) -> bool:
    """Build (once per machine) and load the kernels; True when `torch.ops.dflash_lowbit` is ready."""
    with _STATE.lock:
        if _STATE.tried:
            return _STATE.error is None
        _STATE.tried = True
        _STATE.error = _compiler_problem()
        if _STATE.error is None:
            for openmp in (True, False):  # the threaded build, else the serial one
                _STATE.error = _build(openmp, verbose)
                if _STATE.error is None:
                    _STATE.openmp = openmp
                    break
        return _STATE.error is None


def _build(openmp: bool, verbose: bool) -> str | None:
    """Build and load the library (with OpenMP or not); None, or why it failed."""
    try:
        from torch.utils import cpp_extension

        out = build_dir(openmp)
        out.mkdir(parents=True, exist_ok=True)
        if shutil.which("ninja") is None:  # the pip package's binary (torch's loader runs `ninja`)
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        extra = OPENMP if openmp else []
        cpp_extension.load(NAME, [str(CSRC / name) for name in SOURCES], extra_cflags=FLAGS + extra,
                           extra_ldflags=list(extra), build_directory=str(out), is_python_module=False,
                           verbose=verbose)  # copies: the loader may add to its lists
        return None
    except Exception as e:  # a failed build leaves the engine on its torch kernels
        return f"the build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"


def available() -> bool:
    """The kernels are built and loaded (building them now if this process has not tried)."""
    return load()


def problem() -> str | None:
    """Why the kernels are not available (None when they are)."""
    load()
    return _STATE.error


def simd() -> str:
    """The SIMD code the kernels run on this CPU: "avx512" (AVX-512 VNNI), "avx2" (AVX2 with FMA
    and F16C: the products; attention and the layers' other ops run the portable code) or
    "portable" (C++ alone); "" when the kernels are not available. $DFLASH_NATIVE_ISA=avx2 or
    =portable caps it (how the tests run each path on one CPU)."""
    return str(torch.ops.dflash_lowbit.simd()) if available() else ""


def fast_path() -> bool:
    """The kernels run SIMD code here (AVX-512 VNNI or AVX2), not their portable C++ alone."""
    return simd() in ("avx512", "avx2")


SIMD_NAMES = {"avx512": "AVX-512 VNNI", "avx2": "AVX2", "portable": "portable C++", "": "not built"}


def release_threads() -> bool:
    """End the OpenMP threads that the calling thread's parallel regions started (they return
    when it runs one again); True when it ended some. A server loads and measures its model on
    one thread and runs it on another: libgomp keeps a team of threads per such thread, and once
    it manages more threads than there are cores it stops spinning between parallel regions, so
    every region of the running thread sleeps and wakes (measured on 2 cores: 40% fewer tokens/s
    one request at a time, 25% fewer batched). The loading thread hands its team back before the
    worker starts (serve/worker.py)."""
    return available() and bool(torch.ops.dflash_lowbit.release_threads())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] not in (["build"], ["path"]):
        print("usage: python -m dflash.engine.native build|path", file=sys.stderr)
        return 2
    if args[0] == "path":
        print(build_dir())
        return 0
    if not load(verbose=False):
        print(f"dflash: the native kernels are not available: {_STATE.error}", file=sys.stderr)
        return 1
    print(f"dflash: native kernels ready in {build_dir()} ({SIMD_NAMES[simd()]} code, "
          f"{'threaded (OpenMP)' if _STATE.openmp else 'one thread: the compiler has no OpenMP'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
