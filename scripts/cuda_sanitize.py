"""Runs every CUDA kernel of accordion_hvd once per code path, small, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python3 scripts/cuda_sanitize.py
    compute-sanitizer --tool racecheck python3 scripts/cuda_sanitize.py

Paths covered: TopK with the candidate list and without it (a constant tensor), with ties
cut at the threshold, k = 0, 1 and n, misaligned (scalar) and aligned (vector) inputs, every
gradient dtype; a bucket's TopK (more layers than one launch's table, a non-finite layer)
and its restore; the decode with overlapping ranks and a bad index; Gram-Schmidt with r <= 8
and r > 8; the error update; PowerSGD's four bucket phases (ranks 1-16, a non-finite layer,
16-bit outputs, a settle flag of each value); a layer sent whole and settled; Quantize's sparse
chunks (encode, decode with a bad chunk index, settle; chunks of 512, 100 and 4096, the
running sum over several blocks). Prints one line per case and checks each result against the
CPU kernel, so a sanitizer report can be matched to a case.
"""

import sys

import torch

import accordion_hvd as acc


def topk_case(name, grad, residual, k):
    cpu = acc.ops.topk_ef(grad, residual.clone(), k)
    gpu = acc.ops.topk_ef(grad.cuda(), residual.cuda(), k)
    torch.cuda.synchronize()
    assert torch.equal(cpu[1], gpu[1].cpu()), name
    print(f"ok topk_ef {name} n={grad.numel()} k={k}", flush=True)


def powersgd_bucket():
    dims = [(1, 5, 1), (64, 27, 2), (300, 7, 3), (128, 1152, 16)] * 9  # 36 layers: two launches' tables
    grads = [torch.randn(n * m, dtype=torch.float16) for n, m, _ in dims]
    residuals = [torch.randn(n, m) for n, m, _ in dims]
    qts = [torch.randn(r, m) for n, m, r in dims]
    finite = torch.tensor([i != 5 for i in range(len(dims))])
    res_gpu = [e.cuda() for e in residuals]
    p = acc.ops.powersgd_p_many([g.cuda() for g in grads], res_gpu, [q.cuda() for q in qts], finite.cuda())
    torch.testing.assert_close(p.cpu(), acc.ops.powersgd_p_many(grads, residuals, qts, finite), rtol=1e-4, atol=1e-3,
                               equal_nan=True)
    ps, offset = [], 0
    for n, m, r in dims:
        ps.append(p[offset:offset + n * r].view(n, r).nan_to_num())
        offset += n * r
    qt = acc.ops.powersgd_qt_many(ps, res_gpu)
    qt_avgs, offset = [], 0
    for n, m, r in dims:
        qt_avgs.append(qt[offset:offset + r * m].view(r, m))
        offset += r * m
    outs = [torch.empty(n * m, device="cuda", dtype=torch.bfloat16) for n, m, _ in dims]
    qts_gpu = [q.cuda() for q in qts]
    for ok in (False, True):
        acc.ops.powersgd_finish_many_(res_gpu, outs, qts_gpu, ps, qt_avgs, torch.tensor(ok, device="cuda"))
    for flag in (False, True):
        acc.ops.powersgd_settle_many_(res_gpu, ps, qts_gpu, torch.tensor(flag, device="cuda"))
    torch.cuda.synchronize()
    print("ok powersgd_p_many, _qt_many, _finish_many_, _settle_many_", flush=True)


def main():
    """``--only buckets,whole,chunks``: only those groups (the GPU check's phase 1: the bucket
    ops, and the kernels added since the first GPU run)."""
    assert acc.with_cuda and torch.cuda.is_available(), "needs a GPU and a build with CUDA kernels"
    torch.manual_seed(0)
    groups = {"buckets": (topk_bucket, powersgd_bucket), "whole": (whole,), "chunks": (quantize_chunks,)}
    if sys.argv[1:2] == ["--only"]:
        for name in sys.argv[2].split(","):
            for case in groups[name]:
                case()
        return
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        g, r = torch.randn(20_011).to(dtype), torch.randn(20_011)
        for k in (0, 1, 200, 20_011):
            topk_case(f"normal {dtype}", g, r, k)
    buf = torch.randn(5_001)
    topk_case("misaligned", buf[1:], torch.zeros(5_000), 50)
    topk_case("constant (no candidate list)", torch.full((9_000,), 0.25), torch.zeros(9_000), 4_000)
    topk_case("ties at the threshold", torch.randint(-2, 3, (30_000,)).float(), torch.zeros(30_000), 7_000)

    topk_bucket()
    powersgd_bucket()
    single_ops()
    whole()
    quantize_chunks()


def whole():
    for dtype in (torch.float16, torch.bfloat16):
        g, e = torch.randn(10_001), torch.randn(10_001)
        e_gpu = e.cuda()
        out = acc.ops.flush_whole(g.cuda(), e_gpu, dtype, torch.tensor(True, device="cuda"))
        acc.ops.settle_sent_(e_gpu, dtype, torch.tensor(True, device="cuda"))
        want = acc.ops.flush_whole(g, e, dtype, torch.tensor(True))
        acc.ops.settle_sent_(e, dtype, torch.tensor(True))
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), want) and torch.equal(e_gpu.cpu(), e)
        print(f"ok flush_whole, settle_sent_ {dtype}", flush=True)


def quantize_chunks():
    from accordion_hvd.codecs import quantize_chunks as sparse
    for n, chunk, k in ((20_011, 512, 9), (300_000, 100, 700), (9_000, 4096, 3), (5, 512, 1)):
        g, e = torch.randn(n), torch.randn(n) * 0.1
        e_gpu, done = e.cuda(), torch.tensor(True, device="cuda")
        payload = acc.ops.quantize_chunks_ef_(g.cuda(), e_gpu, 8, chunk, k, 0.05, done)
        _, indices, scales, q = sparse.unpack(payload, k, chunk, 8)
        acc.ops.quantize_chunks_settle_(e_gpu, indices, q, scales, chunk, done)
        rows = torch.stack([payload, payload])
        mean, k_next = acc.ops.quantize_chunks_average(rows, n, k, 8, chunk, torch.float32)
        bad = rows.clone()
        bad[1, 4:8] = torch.tensor([10 ** 6], dtype=torch.int32).view(torch.uint8).cuda()  # skipped, not written
        acc.ops.quantize_chunks_average(bad, n, k, 8, chunk, torch.float32)
        want = acc.ops.quantize_chunks_ef_(g, e, 8, chunk, k, 0.05)
        torch.cuda.synchronize()
        assert torch.equal(payload.cpu(), want), (n, chunk)
        print(f"ok quantize_chunks_ef_, _average, _settle_ n={n} chunk={chunk} k={k}", flush=True)


def topk_bucket():
    grads = [torch.randn(n) for n in (1, 7, 5_000, 20_011)] * 9  # 36 layers: two launches' tables
    ks = [g.numel() // 10 for g in grads]
    finite = torch.tensor([i != 2 for i in range(len(grads))])
    res_cpu = [torch.randn_like(g) for g in grads]
    res_gpu = [r.cuda() for r in res_cpu]
    cpu = acc.ops.topk_ef_many(grads, res_cpu, ks, finite)
    gpu = acc.ops.topk_ef_many([g.cuda() for g in grads], res_gpu, ks, finite.cuda())
    acc.ops.restore_many_if_(res_gpu, gpu[0], ks, finite.cuda())
    acc.ops.restore_many_if_(res_cpu, cpu[0], ks, finite)
    torch.cuda.synchronize()
    assert torch.equal(cpu[0], gpu[0].cpu()) and all(torch.equal(a, b.cpu()) for a, b in zip(res_cpu, res_gpu))
    print("ok topk_ef_many, restore_many_if_", flush=True)


def single_ops():
    values = torch.randn(3 * 500)
    indices = torch.cat([torch.randperm(2_000)[:500] for _ in range(3)]).to(torch.int32)
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(acc.ops.sparse_average(values, indices, 2_000, 3, dtype),
                           acc.ops.sparse_average(values.cuda(), indices.cuda(), 2_000, 3, dtype).cpu())
        print(f"ok sparse_average {dtype}", flush=True)
    try:
        acc.ops.sparse_average(values.cuda(), torch.full_like(indices, 5_000).cuda(), 2_000, 3)
        raise AssertionError("a bad index was accepted")
    except RuntimeError:
        print("ok sparse_average refuses a bad index", flush=True)

    ps = [torch.randn(n, r, device="cuda") for n, r in ((1, 1), (300, 4), (1_000, 8), (700, 12))]
    acc.ops.orthogonalize_(ps)
    torch.cuda.synchronize()
    print("ok orthogonalize_", flush=True)
    e = torch.randn(10_001, device="cuda")
    acc.ops.ef_add_(torch.randn(10_001, device="cuda", dtype=torch.float16), e)
    torch.cuda.synchronize()
    print("ok ef_add_", flush=True)


if __name__ == "__main__":
    main()
