# Kept as a record: with hsdp_profile_ab_link.py it produced benchmarks/results/hsdp-profile-1gbit/
# (2026-11-28, at e6d2d8e; was hsdp-profile-1gbit/prof_train.py, run as /tmp/prof_train.py).
# Not maintained and may not run against today's code.
import cProfile, os, sys, runpy
sys.argv = ["accordion_hvd.train", *sys.argv[1:]]
out = os.path.join(os.environ["PROF_DIR"], f"rank{os.environ['RANK']}.prof")
cProfile.run("runpy.run_module('accordion_hvd.train', run_name='__main__')", out)
