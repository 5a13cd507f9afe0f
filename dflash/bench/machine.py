"""What machine a result was measured on: written into every benchmark and profile file, since
figures from one CPU say little about another (vendor, vector units, core count)."""

from __future__ import annotations

import os
import platform
import subprocess

import torch


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


def machine_info() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": load, "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
