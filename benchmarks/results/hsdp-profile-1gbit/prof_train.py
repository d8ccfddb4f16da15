import cProfile, os, sys, runpy
sys.argv = ["accordion_hvd.train", *sys.argv[1:]]
out = os.path.join(os.environ["PROF_DIR"], f"rank{os.environ['RANK']}.prof")
cProfile.run("runpy.run_module('accordion_hvd.train', run_name='__main__')", out)
