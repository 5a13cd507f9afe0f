"""A/B: the target's decode step and verify-16 pass, and the draft pass, with stacked groups (as planned) vs forced separate."""
import statistics, time, torch
from dflash.text.pipeline import Pipeline
from dflash.engine import projections as P
from dflash.engine.target import TargetModel
torch.set_num_threads(2)
pipe = Pipeline.load(None, None, quiet=True)
a = pipe.target
print(a.kernel_info()["measure_s"], "s measuring")
for r in a.kernel_info()["shapes"]:
    print(r["shape"], r["weights"], r["kernels"], r["roles"])
row = a.linears.rows[0]
print("qkv stacked:", row[0].use_stacked, "gate_up:", row[2].use_stacked)
b = TargetModel(a.model, stacking=False)
la, lb = a.draft_layout(pipe.draft), None
lb = b.draft_layout(pipe.draft)
print('draft kv stacked', la.layers[0].kv.use_stacked, 'gate_up', la.layers[0].gate_up.use_stacked)
print("extra MB stacked / separate:", a.linears.extra_bytes / 2**20, b.linears.extra_bytes / 2**20)
ids = pipe.encode_chat([{"role": "user", "content": "Write a Python function that checks whether a number is prime."}])
def step_times(t, n, reps):
    c = t.new_cache(); t.forward(ids, c, [1, 8, 14, 20, 27], logits_to_keep=1)
    base = c.length; out = []
    blk = torch.randint(0, 1000, (1, n))
    for _ in range(reps):
        s = time.perf_counter(); t.forward(blk, c, [1, 8, 14, 20, 27], logits_to_keep=n); out.append(time.perf_counter() - s)
        c.trim(c.length - base) if hasattr(c, "trim") else None
    return out
for n in (1, 2, 4, 8, 16):
    ta, tb = [], []
    for _ in range(5):
        ta += step_times(a, n, 10); tb += step_times(b, n, 10)
    ma, mb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    print(f"n={n}: stacked {ma:.2f} ms  separate {mb:.2f} ms  ratio {ma/mb:.3f}", flush=True)

d = pipe.draft
for C in (1, 4, 17):
    g = torch.Generator().manual_seed(0)
    noise, ctx = torch.randn(1, 16, 576, generator=g), torch.randn(1, C, d.fc.in_features, generator=g)
    pos = torch.arange(C + 16)[None]
    ta, tb = [], []
    with torch.inference_mode():
        for _ in range(5):
            for lay, acc in ((la, ta), (lb, tb)):
                for _ in range(10):
                    s = time.perf_counter(); d(pos, noise_embedding=noise, target_hidden=ctx, layout=lay); acc.append(time.perf_counter() - s)
    ma, mb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    print(f"draft C={C}: stacked {ma:.2f} ms  separate {mb:.2f} ms  ratio {ma/mb:.3f}", flush=True)
