# Kept as a record: it produced benchmarks/results/hsdp-profile-1gbit/ (ab_link.log, and with
# hsdp_profile_prof_train.py and hsdp_profile_summarize.py its summary.md), run in a worktree at
# e6d2d8e on 2026-11-28 (was hsdp-profile-1gbit/ab_link.py). Not maintained and may not run
# against today's code: it expects /work/runner and /tmp/prof_train.py, and hsdp_step_time's
# TASK and METHODS as they were then.
"""1 Gbit/s A/B of HSDP methods with cProfile of every rank (ad hoc diagnosis)."""
import csv, os, statistics, sys, tempfile
from pathlib import Path
R = Path("/work/runner")
sys.path[:0] = [str(R / "benchmarks"), str(R / "benchmarks" / "cluster")]
import hsdp_step_time as h
from cluster import Cluster
rounds = int(sys.argv[1]); methods = sys.argv[2].split(","); rate = sys.argv[3] if len(sys.argv) > 3 else "1gbit"
os.environ["PYTHONPATH"] = str(R)
with Cluster(2, rate=rate) as c:
    for k in range(rounds):
        for m in (methods if k % 2 == 0 else methods[::-1]):
            prof = Path(f"/tmp/profl/{m}-{k}"); prof.mkdir(parents=True, exist_ok=True)
            os.environ["PROF_DIR"] = str(prof)
            with tempfile.TemporaryDirectory() as tmp:
                args = ["/tmp/prof_train.py", *h.TASK[2:], *h.METHODS[m], "--max-steps", "90", "--logdir", tmp]
                res = c.torchrun(args, timeout=900, per_node=2)
                for r in res.values():
                    assert r.returncode == 0, r.stdout[-3000:]
                walls = [(int(x["step"]), float(x["wall_s"])) for x in csv.DictReader(open(Path(tmp) / "steps.csv"))]
            t = [b - a for (_, a), (s, b) in zip(walls, walls[1:]) if s >= 50]
            print(k, m, "median %.3f" % statistics.median(t), flush=True)
