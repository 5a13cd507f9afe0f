"""What machine the engine runs on, and where it keeps what it measured there.

The engine measures its kernels and its step costs at load (engine/kernels.py,
engine/costmodel.py) and caches them per machine: the CPU model, its vector extensions, the
core count, the torch version and the thread count decide which GEMM path is fast. The
benchmarks write the same facts into every results file (bench/machine.py uses these)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

CACHE_ENV = "DFLASH_CACHE"
NATIVE_ISA_ENV = "DFLASH_NATIVE_ISA"  # caps the native kernels' SIMD code (engine/native.py, csrc/lowbit.h)


def cache_dir() -> Path:
    """Root of dflash's cache: `$DFLASH_CACHE` if set, else ~/.cache/dflash."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash"


def cpu_model() -> str:
    """The CPU's marketing name: /proc/cpuinfo on Linux, sysctl on macOS, else platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The vector extensions that decide which GEMM paths exist (AVX2, AVX-512, AMX, NEON)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "fma")
                                  if f in have)
    except OSError:
        pass
    return ["neon"] if platform.machine() in ("arm64", "aarch64") else []


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy(load: float | None) -> bool:
    """As many runnable tasks as cores, or more: timings taken now are inflated."""
    return load is not None and load >= (os.cpu_count() or 1)


def stale(entry: dict | None) -> bool:
    """A cached measurement taken on a busy machine, while this one is quiet now: measure again."""
    return entry is not None and busy(entry.get("measured_load")) and not busy(load_average())


def machine_key() -> dict:
    """What a measured kernel or cost belongs to: another CPU, core count, torch or thread
    count, or a cap on the native kernels' SIMD code ($DFLASH_NATIVE_ISA) measures again."""
    import torch

    key = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "threads": torch.get_num_threads()}
    if os.environ.get(NATIVE_ISA_ENV):
        key["native_isa"] = os.environ[NATIVE_ISA_ENV]
    return key


def cache_path(kind: str, key: dict) -> Path:
    """cache_dir()/<kind>/<hash of key>.json: one file per machine and measured thing."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / kind / f"{digest}.json"


def read_cached(kind: str, key: dict) -> dict | None:
    """The cached value for `key`, or None (missing, unreadable, or written for another key)."""
    try:
        data = json.loads(cache_path(kind, key).read_text())
    except (OSError, ValueError):
        return None
    return data.get("value") if isinstance(data, dict) and data.get("key") == key else None


def write_cached(kind: str, key: dict, value: dict) -> Path | None:
    """Write atomically (a temp file, then rename); a read-only cache only loses the cache."""
    path = cache_path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        return None
    return path
