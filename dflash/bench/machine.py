"""What machine a result was measured on: written into every benchmark and profile file, since
figures from one CPU say little about another (vendor, vector units, core count). The CPU
detection is the engine's (engine/machine.py), which keys its measured kernels by it."""

from __future__ import annotations

import os
import platform

import torch

from dflash.engine.machine import cpu_flags, cpu_model

__all__ = ["cpu_flags", "cpu_model", "machine_info"]


def machine_info(kernels: dict | None = None) -> dict:
    """`kernels`: the target's chosen kernel table (`TargetModel.kernel_table()`), if any."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    info = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": load, "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if kernels is not None:
        info["kernels"] = kernels
    return info
