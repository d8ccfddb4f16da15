# Kept as a record: it produced benchmarks/results/hsdp-hook-cost/README.md (ad hoc, 2026-11-28,
# commits ee05a31 and 012b11a). Not maintained and may not run against today's code: it wraps
# engine internals by name (e.g. StepEngine._probe_window, HSDPHook._agree_faults), which have
# since moved or gone.
"""Per-step host time of our HSDP hook's parts, settled route (ad hoc)."""
import sys, time, collections, statistics, os
sys.path.insert(0, os.environ.get("REPO", "/work/main") + "/benchmarks")
import torch, torch.distributed as dist
from hsdp_step_time import TASK, METHODS
from accordion_hvd.cli import data, options, task as tasks
from accordion_hvd.cli.frontends import FSDPFrontEnd
from accordion_hvd import hsdp
from accordion_hvd.engine import engine as eng, whole
from accordion_hvd.cli.frontends import FSDPFrontEnd

acc = collections.defaultdict(float)
def timed(cls, name, key=None):
    f = getattr(cls, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key or name] += time.perf_counter() - t
    setattr(cls, name, w)
for n in ["_reduced", "_finish_step", "_agree_faults", "_send_whole"]:
    timed(hsdp.HSDPHook, n)
for n in ["end_step", "add_whole", "finish_whole"]:
    timed(eng.StepEngine, n)
timed(whole.WholeBuffers, "settle", "whole.settle")
timed(whole.WholeBuffers, "add", "whole.add")
from accordion_hvd.comm import process_group as pg
from accordion_hvd import step_faults, controller, counters
timed(pg.ProcessGroupChannel, "allreduce_mean_async", "ar_async")
timed(pg.ProcessGroupChannel, "wait", "pg.wait")
timed(step_faults.StepFaults, "settle", "faults.settle")
timed(step_faults.StepFaults, "poll", "faults.poll")
timed(controller.RegimeController, "end_step", "controller.end_step")
timed(eng.StepEngine, "apply_levels")
timed(eng.StepEngine, "_probe_window")
timed(counters.Counters, "gradient", "counters")
timed(counters.Counters, "floats", "counters")
timed(counters.Counters, "wire", "counters")
timed(FSDPFrontEnd, "step", "front.step")
_wg = hsdp.HSDPHook._write_grad
def _wgw(*a):
    t=time.perf_counter(); _wg(*a); acc["_write_grad"] += time.perf_counter()-t
hsdp.HSDPHook._write_grad = staticmethod(_wgw)

method = sys.argv[1]; steps = int(sys.argv[2])
front = FSDPFrontEnd("cpu", nodes=2)
rank, size = front.rank, front.size
cli = options.parse_args(TASK[2:]); corpus = tasks.load_data(cli)
def batches():
    e = 0
    while True:
        yield from data.shard_batches(corpus.train, cli.batch_size, rank, size, e, cli.seed); e += 1
torch.manual_seed(0)
model = tasks.make_model(cli, corpus); opt = tasks.make_optimizer(cli.optimizer, model, cli.lr)
comp = options.make_compression(options.parse_args([*TASK[2:], *METHODS[method]]))
front.reduce_dtype = "bfloat16" if method == "ours-bf16" else None
net, opt = front.wrap(model, opt, comp, torch.device("cpu"))
src = batches()
per = []
for s in range(steps):
    acc.clear()
    x, y = next(src)
    t0 = time.perf_counter()
    tasks.loss_of(net(x), y).backward()
    t1 = time.perf_counter()
    front.step(opt, comp); opt.zero_grad()
    t2 = time.perf_counter()
    per.append(dict(acc, backward=t1 - t0, step=t2 - t0, opt=t2 - t1))
if rank in (0, 1):
    last = per[-20:]
    keys = sorted({k for p in last for k in p})
    print(f"rank {rank} {method}: median ms over last 20 steps: " +
          ", ".join(f"{k} {1000*statistics.median(p.get(k, 0) for p in last):.2f}" for k in keys), flush=True)
front.close()
