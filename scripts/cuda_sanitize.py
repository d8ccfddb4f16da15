"""Runs every CUDA kernel of accordion_hvd once per code path, small, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python3 scripts/cuda_sanitize.py
    compute-sanitizer --tool racecheck python3 scripts/cuda_sanitize.py

Paths covered: TopK with the candidate list and without it (a constant tensor), with ties
cut at the threshold, k = 0, 1 and n, misaligned (scalar) and aligned (vector) inputs, every
gradient dtype; the decode with overlapping ranks and a bad index; Gram-Schmidt with r <= 8
and r > 8; the error update. Prints one line per case and checks each result against the
CPU kernel, so a sanitizer report can be matched to a case.
"""

import torch

import accordion_hvd as acc


def topk_case(name, grad, residual, k):
    cpu = acc.ops.topk_ef(grad, residual.clone(), k)
    gpu = acc.ops.topk_ef(grad.cuda(), residual.cuda(), k)
    torch.cuda.synchronize()
    assert torch.equal(cpu[1], gpu[1].cpu()), name
    print(f"ok topk_ef {name} n={grad.numel()} k={k}", flush=True)


def main():
    assert acc.with_cuda and torch.cuda.is_available(), "needs a GPU and a build with CUDA kernels"
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        g, r = torch.randn(20_011).to(dtype), torch.randn(20_011)
        for k in (0, 1, 200, 20_011):
            topk_case(f"normal {dtype}", g, r, k)
    buf = torch.randn(5_001)
    topk_case("misaligned", buf[1:], torch.zeros(5_000), 50)
    topk_case("constant (no candidate list)", torch.full((9_000,), 0.25), torch.zeros(9_000), 4_000)
    topk_case("ties at the threshold", torch.randint(-2, 3, (30_000,)).float(), torch.zeros(30_000), 7_000)

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
    e, a = torch.randn(10_001, device="cuda"), torch.randn(10_001, device="cuda")
    acc.ops.error_update_(e, a, torch.bfloat16)
    acc.ops.ef_add_(torch.randn(10_001, device="cuda", dtype=torch.float16), e)
    torch.cuda.synchronize()
    print("ok error_update_, ef_add_", flush=True)


if __name__ == "__main__":
    main()
