"""The target below fp32 (engine/precision.py, lowbit.py, native.py): the kernels compute what
they claim, give a row the same bits whatever the rows beside it, and so speculative output
equals plain decoding at the same precision, token for token; sampling keeps the law."""

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash.engine import lowbit, native
from dflash.engine.precision import PrecisionError, resolve
from dflash.engine.sampling import SamplingParams
from dflash.engine.target import TargetModel
from dflash.model import dflash_generate
from dflash.testing import chi2_pvalue, exact_law, tiny_draft, tiny_target

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.problem()}")
LOWBIT = ("int4", "int8", "bf16")


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("shape", [(192, 576), (100, 64)])
def test_product_is_the_block_formula_and_rows_do_not_depend_on_their_company(fmt, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) / shape[1] ** 0.5
    blocks = lowbit.quantize(w, fmt)
    assert (blocks.dequantize() - w).abs().max() <= (0.05 if fmt == "q4_1" else 0.005)
    lin = lowbit.QLinear(blocks)
    x = torch.randn(1, 33, shape[1], generator=torch.Generator().manual_seed(1))
    y = lin(x)
    ref = lowbit.reference_product(x, blocks)
    assert y.shape == (1, 33, shape[0])
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    alone = torch.cat([lin(x[:, i:i + 1]) for i in range(33)], dim=1)
    assert torch.equal(alone, y)  # bit for bit
    assert torch.equal(lin(x[:, 3:12]), y[:, 3:12])


def test_gguf_blocks_are_read_as_stored():
    """Q4_1 and Q8_0 blocks as ggml lays them out (scale, offset, nibbles j | j+16 << 4)."""
    rng = np.random.default_rng(0)
    n, k = 16, 64
    d = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float16)
    m = rng.uniform(-1, 0, (n, k // 32)).astype(np.float16)
    u = rng.integers(0, 16, (n, k // 32, 32)).astype(np.uint8)
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8),
                          u[..., :16] | (u[..., 16:] << 4)], axis=-1)
    tensor = SimpleNamespace(name="t", tensor_type=SimpleNamespace(name="Q4_1"), shape=[k, n], data=raw.reshape(n, -1))
    b = lowbit.gguf_blocks(tensor)
    expect = d.astype(np.float32)[..., None] * u + m.astype(np.float32)[..., None]
    assert np.array_equal(b.dequantize().numpy(), expect.reshape(n, k))
    q = rng.integers(-128, 128, (n, k // 32, 32)).astype(np.int8)
    raw8 = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    t8 = SimpleNamespace(name="t", tensor_type=SimpleNamespace(name="Q8_0"), shape=[k, n], data=raw8.reshape(n, -1))
    assert np.array_equal(lowbit.gguf_blocks(t8).dequantize().numpy(), (q * d.astype(np.float32)[..., None]).reshape(n, k))
    with pytest.raises(ValueError, match="Q4_1 and Q8_0"):
        lowbit.gguf_blocks(SimpleNamespace(name="t", tensor_type=SimpleNamespace(name="Q6_K"), shape=[k, n], data=raw))


def test_unpermute_rows_undoes_llamacpps_rotary_permutation():
    heads, dim, k = 3, 8, 4
    w = torch.arange(heads * dim * k).reshape(heads * dim, k)
    permuted = w.reshape(heads, 2, dim // 2, k).transpose(1, 2).reshape(heads * dim, k)  # convert_hf_to_gguf's
    assert torch.equal(permuted[lowbit.unpermute_rows(heads * dim, heads)], w)


def test_attention_matches_sdpa_and_each_row_is_its_own():
    g = torch.Generator().manual_seed(0)
    t, past, heads, groups, dim = 7, 20, 4, 2, 16
    q = torch.randn(t, heads, dim, generator=g)
    k = torch.randn(groups, past + t + 5, dim, generator=g).half()  # a buffer longer than the filled part, fp16
    v = torch.randn(groups, past + t + 5, dim, generator=g).half()  # (the K/V cache's storage)
    tree = torch.tensor([[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0],
                         [1, 0, 1, 0, 1, 0, 0], [1, 1, 0, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    for mask in (None, tree):
        out = torch.ops.dflash_lowbit.attend(q, k, v, past, mask, 0.25)
        visible = torch.ones(t, t, dtype=torch.bool).tril() if mask is None else mask
        full = torch.cat([torch.ones(t, past, dtype=torch.bool), visible], dim=1)
        ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None, :, :past + t].float(),
                                             v[None, :, :past + t].float(),
                                             attn_mask=full, scale=0.25, enable_gqa=True)[0].transpose(0, 1)
        assert (out - ref).abs().max() < 1e-5
    # a tree row sees the prefix and its ancestors: the bits of a one-row call over those slots alone
    for row in range(t):
        slots = list(range(past)) + [past + j for j in range(t) if tree[row, j]]
        kk, vv = k[:, slots], v[:, slots]
        one = torch.ops.dflash_lowbit.attend(q[row:row + 1], kk, vv, len(slots) - 1, None, 0.25)
        assert torch.equal(one[0], torch.ops.dflash_lowbit.attend(q, k, v, past, tree, 0.25)[row])


@pytest.mark.parametrize("precision", LOWBIT)
@pytest.mark.parametrize("family,fuse", [("llama", True), ("llama", False), ("qwen3", True)])
def test_a_verify_pass_gives_each_row_the_bits_of_one_token_steps(precision, family, fuse):
    """Llama layers as one native call or op by op, and Qwen3's (q/k norms: op by op)."""
    model = tiny_target(family)
    target = TargetModel(model, precision=precision, fuse=fuse)
    assert target.precision == precision and target.layout is not None
    assert target.layout.fused == (fuse and family == "llama" and precision != "bf16")
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    whole, steps = target.new_cache(), target.new_cache()
    target.forward(ids[:, :24], whole, None)
    target.forward(ids[:, :24], steps, None)
    logits, _ = target.forward(ids[:, 24:], whole, None, logits_to_keep=16)  # (1, 16, V)
    one = torch.cat([target.forward(ids[:, i:i + 1], steps, None)[0] for i in range(24, 40)], dim=1)
    assert torch.equal(logits, one)
    fp32 = TargetModel(model, precision="fp32").forward(ids, TargetModel(model, precision="fp32").new_cache(), None)[0]
    assert not torch.equal(fp32[:, -16:], logits)  # another precision: other numbers
    assert (fp32[:, -16:] - logits).abs().max() < 0.5 * fp32.abs().max()


@pytest.mark.parametrize("precision", LOWBIT)
@pytest.mark.parametrize("proposer", ["draft", "tree", "hybrid"])
def test_speculative_greedy_equals_plain_greedy_at_the_same_precision(precision, proposer):
    """Long generations (200 tokens) from a random draft, chains and trees: every output token
    equal to plain decoding's at that precision."""
    model = tiny_target("llama", max_position_embeddings=512)
    draft = tiny_draft(model, block_size=8)
    target = TargetModel(model, precision=precision)
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(seed))
        plain = dflash_generate(None, target, ids, 200, block_size=1)
        spec = dflash_generate(draft, target, ids, 200, block_size=8, proposer=proposer)
        assert torch.equal(spec, plain), (precision, proposer, seed)


def test_sampled_tokens_follow_the_int4_targets_law():
    """2000 seeded draws of three tokens against the exact law of the int4 target itself."""
    v = 4
    model = tiny_target("llama", seed=3, vocab_size=v)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked, yet spread enough that a biased sampler shows
    target = TargetModel(model, precision="int4")
    draft = tiny_draft(model, seed=4, layers=1, block_size=4, mask_token_id=0)

    def int4_logits(ids):  # exact_law's model: the int4 target, one sequence at a time
        rows = [target.forward(row[None], target.new_cache(), None)[0] for row in ids]
        return SimpleNamespace(logits=torch.cat(rows))

    params = SamplingParams(1.0)
    prompt = torch.tensor([[1, 3, 2]])
    law = exact_law(_Model(model.config, int4_logits), prompt, params)
    assert law.max() < 0.9
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(v ** 3)
    for _ in range(2000):
        out = dflash_generate(draft, target, prompt, 3, None, 1.0, block_size=4, generator=g)
        a, b, c = out[0, -3:].tolist()
        counts[a * v * v + b * v + c] += 1
    assert chi2_pvalue(counts, law) > 1e-3
    biased = law.clone().view(v, v, v)  # the test has power: a law 5% off is rejected
    biased[..., 0] += 0.05 * biased.sum(-1)
    assert chi2_pvalue(counts, (biased / biased.sum()).flatten()) < 1e-3


class _Model:
    """What exact_law needs of a model: its config and logits of a batch of sequences."""

    def __init__(self, config, fn):
        self.config, self._fn = config, fn

    def __call__(self, ids):
        return self._fn(ids)


def test_precision_names_and_errors():
    model = tiny_target("llama")
    assert resolve("auto", model) == "fp32"  # an fp32 checkpoint runs at fp32
    assert TargetModel(model).layout is None
    with pytest.raises(PrecisionError, match="one of auto, fp32"):
        resolve("int3", model)
    with pytest.raises(PrecisionError, match="static decoder"):
        TargetModel(tiny_target("gemma3"), precision="int4")


@pytest.mark.slow
def test_the_default_target_runs_its_own_gguf_blocks_and_speculation_is_exact():
    """The default pipeline (precision auto): the GGUF's Q4_1 and Q8_0 blocks as shipped (checked
    at load against the dequantised model), and 256-token answers of the shipped draft's chain
    and of hybrid trees equal to plain decoding at that precision."""
    from dflash.text.pipeline import Pipeline

    torch.set_num_threads(2)
    default = Pipeline.load(None, None, quiet=True)  # int4 where the kernels have their fast code
    assert default.target.precision == ("int4" if native.fast_path() else "fp32")
    pipe = default if native.fast_path() else default.with_precision("int4")
    info = pipe.target.precision_info()
    assert pipe.target.precision == "int4" and "its own blocks" in info["source"], info
    assert info["weights"] == {"960x576 q4_1": 30, "576x576 q4_1": 30, "3072x576 q4_1": 30, "576x1536 q4_1": 30,
                               "49152x576 q8_0": 1}
    if sys.platform.startswith("linux"):  # the checked fp32 weights went back to their file
        assert info["fp32_paged_out_mb"] > 500, info
    prompts = ["Write a Python function that merges two sorted lists.", "What is 15% of 240? Show the steps."]
    tokens = 256 if native.fast_path() else 32  # the portable kernels are far slower: a shorter check
    for prompt in prompts if native.fast_path() else prompts[:1]:
        ids = pipe.encode_chat([{"role": "user", "content": prompt}])
        plain = dflash_generate(None, pipe.target, ids, tokens, pipe.stop_token_ids, block_size=1)
        for proposer in ("draft", "hybrid"):
            out = dflash_generate(pipe.draft, pipe.target, ids, tokens, pipe.stop_token_ids, block_size=16,
                                  proposer=proposer, cost_model=pipe.cost_model())
            assert torch.equal(out, plain), (prompt, proposer)


# float32 values around half's edges: rounding ties, the largest finite half and what rounds past
# it, the normal/subnormal boundary, the smallest subnormal and half of it, infinity; and a spread
HALF_EDGES = [0.0, 1.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-11 + 2**-20, 2048.0 + 1.0, 2048.0 + 3.0,
              65504.0, 65519.99, 65520.0, 65536.0, 1e9, float("inf"), 2**-14, 2**-14 - 2**-25, 2**-24,
              2**-25, 2**-25 + 2**-40, 3 * 2**-26, 5 * 2**-26, 1e-30, 0.1, 1 / 3, 3.14159, 123.456, 7e-5]
HALF_EDGES = HALF_EDGES * 2  # each value, then its negative

PORTABLE_CHECK = f"inf = float('inf')\nHALF_EDGES = {HALF_EDGES!r}\n" + """
import sys, torch
from dflash.engine import lowbit, native
from dflash.engine.target import TargetModel
from dflash.model import dflash_generate
from dflash.testing import tiny_draft, tiny_target
assert native.available() and native.simd() == sys.argv[2], native.simd()
w = torch.randn(192, 576, generator=torch.Generator().manual_seed(0))
x = torch.randn(1, 11, 576, generator=torch.Generator().manual_seed(1))
edges = torch.tensor(HALF_EDGES) * torch.tensor([1.0, -1.0]).repeat_interleave(len(HALF_EDGES) // 2)
products = {f: lowbit.QLinear(lowbit.quantize(w, f))(x) for f in ("q4_1", "q8_0")}
torch.save({**products, "half": (edges, torch.ops.dflash_lowbit.half(edges))}, sys.argv[1])
model = tiny_target("llama", max_position_embeddings=512)
target, draft = TargetModel(model, precision="int4"), tiny_draft(model, block_size=8)
ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
plain = dflash_generate(None, target, ids, 120, block_size=1)
for proposer in ("draft", "hybrid"):
    assert torch.equal(dflash_generate(draft, target, ids, 120, block_size=8, proposer=proposer), plain), proposer
"""


@pytest.mark.parametrize("simd", ["avx2", "portable"])
def test_each_kernel_path_is_exact_and_computes_the_same_products(tmp_path, simd):
    """The AVX2 and the portable C++ code (what CPUs without AVX-512 VNNI run; forced here by
    $DFLASH_NATIVE_ISA): speculative output equals plain decoding, and the products are the bits
    of the best code this CPU runs."""
    import os
    import subprocess
    import sys

    if simd == "avx2" and native.simd() not in ("avx512", "avx2"):
        pytest.skip("this CPU has no AVX2 with FMA and F16C")
    out = tmp_path / f"{simd}.pt"
    env = {**os.environ, "DFLASH_NATIVE_ISA": simd}
    run = subprocess.run([sys.executable, "-c", PORTABLE_CHECK, str(out), simd], env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = torch.load(out)
    w = torch.randn(192, 576, generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, 11, 576, generator=torch.Generator().manual_seed(1))
    edges, halves = got.pop("half")
    bits = halves.view(torch.int16)  # the K/V cache's conversion, round to nearest even: torch's, bit for bit
    assert torch.equal(bits, edges.half().view(torch.int16))
    assert torch.equal(bits, torch.ops.dflash_lowbit.half(edges).view(torch.int16))
    for fmt, y in got.items():
        assert torch.equal(lowbit.QLinear(lowbit.quantize(w, fmt))(x), y), fmt


NO_OPENMP_CHECK = """
from dflash.engine import native
from dflash.engine.lowbit import QLinear, quantize
import torch
assert native.available(), native.problem()
w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
print(native.build_dir().name, float(QLinear(quantize(w, "q4_1"))(x).sum()))
"""


@pytest.mark.slow
def test_a_compiler_without_openmp_builds_the_serial_kernels(tmp_path):
    """Apple's clang has no -fopenmp: the build falls back to the serial kernels (same bits)."""
    import os
    import subprocess
    import sys

    cxx = tmp_path / "c++"  # the system compiler, refusing OpenMP
    cxx.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec c++ "$@"\n')
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "DFLASH_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", NO_OPENMP_CHECK], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    name, total = run.stdout.split()
    assert name != native.build_dir(openmp=True).name  # the serial build's own folder
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    assert float(total) == float(lowbit.QLinear(lowbit.quantize(w, "q4_1"))(x).sum())  # the same bits


RELEASE_CHECK = """
import os, torch
from dflash.engine import native
from dflash.engine.lowbit import QLinear, quantize
assert native.available(), native.problem()
torch.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task"))
layer = QLinear(quantize(torch.randn(512, 256, generator=torch.Generator().manual_seed(0)), "q4_1"))
x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
before = tasks()
y = layer(x)  # a parallel region: this thread's OpenMP team starts
started = tasks()
released = native.release_threads()
print(before, started, tasks(), released, torch.equal(layer(x), y))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_threads_ends_this_threads_openmp_team_and_it_comes_back():
    """A server loads the model on one thread and runs it on another; the loading thread's idle
    OpenMP team must go (libgomp stops spinning when it manages more threads than cores)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", RELEASE_CHECK], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    before, started, after, released, same = run.stdout.split()
    if native.build_dir() == native.build_dir(openmp=True):  # the threaded build is loaded
        assert int(started) > int(before) and int(after) < int(started) and released == "True"
    assert same == "True"  # the next region runs (its team comes back), with the same bits
