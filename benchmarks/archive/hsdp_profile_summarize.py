# Kept as a record: it wrote benchmarks/results/hsdp-profile-1gbit/summary.md from the profiles
# of hsdp_profile_ab_link.py (2026-11-28, at e6d2d8e; was hsdp-profile-1gbit/summarize.py).
# Not maintained: the functions it looks up by name (e.g. hsdp.py's _agree_faults) have since
# moved or gone, so against today's code its columns may read 0.
"""Per-step figures of the profiles hsdp_profile_ab_link.py wrote (/tmp/profl/<method>-<round>/rank<r>.prof):
each function's cumulative time over the run divided by its 90 steps (ms; cProfile's own
overhead included, which inflates Python-heavy code), and its call count.

    .venv/bin/python benchmarks/archive/hsdp_profile_summarize.py /tmp/profl > summary.md
"""
import glob
import pstats
import sys

ROWS = [("hsdp.py", "_send_whole"), ("whole.py", "add_whole"), ("whole.py", "finish_whole"),
        ("hsdp.py", "_write_grad"), ("hsdp.py", "_agree_faults"), ("engine.py", "end_step"),
        ("whole.py", "settle"), ("hsdp.py", "_finish_step"), ("process_group.py", "wait"),
        ("_fsdp_collectives.py", "foreach_reduce"), ("distributed_c10d.py", "all_reduce"),
        ("train.py", "optimizer_step"), ("_tensor.py", "backward")]
print("| run | rank | " + " | ".join(f"{f}:{n} ms (calls)" for f, n in ROWS) + " |")
print("|---|---:|" + "---:|" * len(ROWS))
for d in sorted(glob.glob(f"{sys.argv[1]}/*")):
    for r in range(4):
        st = pstats.Stats(f"{d}/rank{r}.prof").stats
        cells = []
        for fn, name in ROWS:
            hit = [(nc, ct) for (f, _, n), (_, nc, _, ct, _) in st.items() if n == name and f.endswith("/" + fn)]
            nc, ct = hit[0] if hit else (0, 0.0)
            cells.append(f"{ct * 1000 / 90:.1f} ({nc})")
        print(f"| {d.rstrip('/').split('/')[-1]} | {r} | " + " | ".join(cells) + " |")
