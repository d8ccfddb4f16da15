"""Python entry points of the compiled ``accordion::`` torch ops.

The ops are registered by the extension (``csrc/``); this module gives them documented
Python signatures and the fake (meta) implementations that ``torch.compile`` and
``torch.library.opcheck`` need.
"""

from __future__ import annotations

import torch

from . import _extension

_C = _extension.load()  # registers torch.ops.accordion.*


# Ops with a CPU kernel only so far: on CUDA their codec takes its torch-op path.
_CPU_ONLY = frozenset({"quantize_chunks_ef_", "quantize_chunks_average", "quantize_chunks_settle_", "sign_ef_",
                       "sign_average"})


def has_kernel(t: torch.Tensor, op: str | None = None) -> bool:
    """Whether ``t``'s device has compiled kernels in this build (CPU always; CUDA when the
    extension was built with them), for ``op`` when named (some ops are CPU only so far)."""
    if t.device.type == "cpu":
        return True
    return t.device.type == "cuda" and bool(_C.with_cuda) and op not in _CPU_ONLY


def _check_dense_pair(op: str, grad: torch.Tensor, residual: torch.Tensor) -> None:
    """Checks the dispatcher would turn into an unreadable "no kernel for backend" error.

    The kernels check everything else (shape, dtype, contiguity) with their own messages.
    """
    for name, t in (("grad", grad), ("residual", residual)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}")
    if grad.device != residual.device:
        raise ValueError(f"{op}: grad and residual must be on the same device, got {grad.device} and {residual.device}")


def ef_add_(grad: torch.Tensor, residual: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    """In place: ``residual += grad``; returns ``residual``. With ``finite`` (a 0-d bool tensor
    on the gradient's device), the gradient is added only where it is True: a non-finite
    gradient leaves the error feedback as it was, decided on the device (no host sync)."""
    _check_dense_pair("accordion::ef_add_", grad, residual)
    torch.ops.accordion.ef_add_.default(grad, residual, finite)
    return residual


@torch.library.register_fake("accordion::ef_add_")
def _ef_add_inplace_fake(grad: torch.Tensor, residual: torch.Tensor, finite: torch.Tensor | None = None) -> None:
    torch._check(grad.shape == residual.shape, lambda: "accordion::ef_add_: shapes differ")


def topk_ef(grad: torch.Tensor, residual: torch.Tensor, k: int, finite: torch.Tensor | None = None):
    """Fused TopK with error feedback (see ``reference.topk_select`` and csrc/cpu/topk_ef.cpp).

    ``residual`` (float32, contiguous) becomes ``grad + residual`` with the kept entries
    zeroed. Returns ``(values, indices, g_sq, kept_sq)``: the k kept entries of largest
    magnitude (ties to the lower index) as float32 values and int32 indices, ascending by
    index, and the float64 squared norms of ``grad + residual`` and of its kept part, all on the device. With ``finite`` (as in
    ``ef_add_``) a gradient flagged False is not added: the selection is from the residual.
    """
    _check_dense_pair("accordion::topk_ef", grad, residual)
    _check_int("accordion::topk_ef", "k", k)
    return torch.ops.accordion.topk_ef.default(grad, residual, k, finite)


def topk_ef_many(grads: list[torch.Tensor], residuals: list[torch.Tensor], ks: list[int],
                 finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ef`` for several layers (a bucket) in one call: a fixed number of kernel
    launches however many layers there are. Returns ``(payload, g_sq, kept_sq)``: layer i's
    k_i values (float32) then k_i indices (int32) as bytes in one uint8 payload, at byte
    ``8 * sum(ks[:i])`` (the bytes its bucket's allgather sends), and the float64 squared
    norms per layer. ``finite`` (1-d bool, one flag per layer): where False, that layer's
    residual is left exactly as it was and its values are NaN (its indices are a valid
    selection of the residual alone), so nothing needs undoing for it."""
    grads, residuals, ks = list(grads), list(residuals), [int(k) for k in ks]
    if not grads:  # the dispatcher needs a tensor to pick a kernel
        raise ValueError("accordion::topk_ef_many: grads must hold at least one tensor")
    for i, (g, r) in enumerate(zip(grads, residuals)):
        _check_dense_pair(f"accordion::topk_ef_many (layer {i})", g, r)
    return torch.ops.accordion.topk_ef_many.default(grads, residuals, ks, finite)


def restore_many_if_(residuals: list[torch.Tensor], payload: torch.Tensor, ks: list[int], flags: torch.Tensor) -> None:
    """Undo ``topk_ef_many`` layer by layer where ``flags`` (1-d bool, one per layer, on the
    payload's device) is True: the layer's kept entries go back into its residual. Decided
    on the device (the CPU reads the flags; CUDA masks)."""
    _check_tensor("accordion::restore_many_if_", "flags", flags)
    residuals = list(residuals)
    if residuals:
        torch.ops.accordion.restore_many_if_.default(residuals, payload, [int(k) for k in ks], flags)


def sparse_average(values: torch.Tensor, indices: torch.Tensor, numel: int, world_size: int,
                   dtype: torch.dtype = torch.float32, bad: torch.Tensor | None = None) -> torch.Tensor:
    """Scatter-add every rank's (values, indices) (concatenated in rank order) into a dense
    vector of ``numel`` float32 entries, divide by ``world_size``, return it in ``dtype``.
    An index outside [0, numel) raises; with ``bad`` (a 0-d bool tensor on the values'
    device) it is skipped and sets ``bad`` instead, on the device (no host sync on a GPU)."""
    _check_int("accordion::sparse_average", "numel", numel)
    _check_int("accordion::sparse_average", "world_size", world_size)
    return torch.ops.accordion.sparse_average.default(values, indices, numel, world_size, dtype, bad)


MAX_BUCKET_RANK = 16
"""The highest rank the PowerSGD bucket ops take (csrc/ops.h: a CUDA thread keeps a row's r
sums in registers); a layer at a higher rank goes through the per-layer path."""


def _nonempty(op: str, name: str, tensors) -> list[torch.Tensor]:
    tensors = list(tensors)
    if not tensors:  # the dispatcher needs a tensor to pick a kernel
        raise ValueError(f"{op}: {name} must hold at least one tensor")
    return tensors


def powersgd_p_many(grads: list[torch.Tensor], residuals: list[torch.Tensor], qts: list[torch.Tensor],
                    finite: torch.Tensor | None = None) -> torch.Tensor:
    """PowerSGD's first phase for a bucket in one call: per layer, ``M = grad + e`` into the
    residual (float32, n x m) and ``P = M Q`` (Q^T given, r x m); returns every layer's P
    (n x r) one after the other in one flat float32 tensor: the bucket's P payload. ``finite``
    (1-d bool, one flag per layer): where False the gradient is not added (e stays as it
    was) and that layer's P is NaN. See ``reference.powersgd_p``."""
    residuals = _nonempty("accordion::powersgd_p_many", "residuals", residuals)
    return torch.ops.accordion.powersgd_p_many.default(list(grads), residuals, list(qts), finite)


def powersgd_qt_many(ps: list[torch.Tensor], residuals: list[torch.Tensor]) -> torch.Tensor:
    """Per layer ``Q^T = P^T M`` (r x m) from its P (n x r) and M (the residual), every layer
    one after the other in one flat float32 tensor: the bucket's Q^T payload."""
    residuals = _nonempty("accordion::powersgd_qt_many", "residuals", residuals)
    return torch.ops.accordion.powersgd_qt_many.default(list(ps), residuals)


def powersgd_finish_many_(residuals: list[torch.Tensor], outs: list[torch.Tensor], qts: list[torch.Tensor],
                          ps: list[torch.Tensor], qts_avg: list[torch.Tensor], ok: torch.Tensor | None = None) -> None:
    """Per layer ``out = P Q^T_avg`` (in out's dtype) and the layer's Q^T set to the average.
    With ``ok`` (0-d bool) False, every out is zero and every Q^T is kept, decided on the
    device. The residuals are only read for their shapes (``powersgd_settle_many_`` updates them)."""
    residuals = list(residuals)
    if residuals:
        torch.ops.accordion.powersgd_finish_many_.default(residuals, list(outs), list(qts), list(ps), list(qts_avg), ok)


def powersgd_settle_many_(residuals: list[torch.Tensor], ps: list[torch.Tensor], qts: list[torch.Tensor],
                          flag: torch.Tensor) -> None:
    """Per layer ``e -= P Q^T`` if ``flag`` (0-d bool on their device) is True (the step went
    through), decided on the device: the CPU reads the flag, the CUDA kernel returns at once
    when it is False."""
    _check_tensor("accordion::powersgd_settle_many_", "flag", flag)
    residuals = list(residuals)
    if residuals:
        torch.ops.accordion.powersgd_settle_many_.default(residuals, list(ps), list(qts), flag)


def orthogonalize_(ps: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """Gram-Schmidt on the columns of every (n x r) matrix in ``ps``, in place, in one call."""
    ps = list(ps)
    if ps:  # the dispatcher needs at least one tensor to pick a kernel
        torch.ops.accordion.orthogonalize_.default(ps, float(eps))
    return ps


def fill_if_(tensors: list[torch.Tensor], flag: torch.Tensor, value: float = 0.0) -> None:
    """Fill every tensor in place with ``value`` if ``flag`` (a 0-d bool tensor on their
    device) is True, decided on the device: the CPU kernel reads the flag and touches nothing
    when it is False; the CUDA one masks, so the host never waits for the flag."""
    tensors = list(tensors)
    _check_tensor("accordion::fill_if_", "flag", flag)
    if tensors:  # the dispatcher picks the kernel from the tensors
        torch.ops.accordion.fill_if_.default(tensors, flag, value)


def flush_whole(grad: torch.Tensor, residual: torch.Tensor, dtype: torch.dtype,
                finite: torch.Tensor | None = None) -> torch.Tensor:
    """A layer or flat buffer sent whole, in one pass: ``residual += grad`` (float32 error
    feedback; not where ``finite``, a 0-d bool on their device, is False) and returns a new
    tensor of ``residual`` in ``dtype`` (float32, float16 or bfloat16), NaN everywhere if not
    finite (see ``reference.flush_whole``)."""
    _check_dense_pair("accordion::flush_whole", grad, residual)
    return torch.ops.accordion.flush_whole.default(grad, residual, dtype, finite)


def settle_sent_(residual: torch.Tensor, dtype: torch.dtype, done: torch.Tensor) -> None:
    """After ``flush_whole``'s step, in one pass: if ``done`` (0-d bool on the residual's
    device), ``residual`` keeps only what ``dtype`` rounded away; if the step was skipped,
    all of it (see ``reference.settle_sent``). CPU reads the flag; CUDA's kernel does."""
    _check_tensor("accordion::settle_sent_", "done", done)
    torch.ops.accordion.settle_sent_.default(residual, dtype, done)


def restore_if_(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, flag: torch.Tensor) -> None:
    """``residual[indices] = values`` if ``flag`` (a 0-d bool tensor on their device) is True,
    decided on the device: the CPU kernel reads the flag and touches nothing when it is
    False; the CUDA one writes the entries either way (values, or what they held)."""
    _check_tensor("accordion::restore_if_", "flag", flag)
    torch.ops.accordion.restore_if_.default(residual, indices, values, flag)


def quantize_ef_(grad: torch.Tensor, residual: torch.Tensor, bits: int, chunk: int,
                 finite: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize's encode, fused (csrc/cpu/quantize.cpp): ``residual`` (flat float32) becomes
    ``g = grad + residual`` (not where ``finite`` is False), and this rank's payload is
    returned as uint8 bytes: ``ceil(n / chunk)`` float32 scales ``max|g| / (2^(bits-1) - 1)``
    per chunk, then ``round(g / s)`` half to even as int8 or int16, zero-padded to 4 bytes
    (NaN scales where ``finite`` is False). Bit for bit ``reference.quantize_ef``'s."""
    _check_dense_pair("accordion::quantize_ef_", grad, residual)
    _check_int("accordion::quantize_ef_", "bits", bits)
    _check_int("accordion::quantize_ef_", "chunk", chunk)
    return torch.ops.accordion.quantize_ef_.default(grad, residual, bits, chunk, finite)


def quantize_average(rows: torch.Tensor, numel: int, bits: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """Quantize's decode: the mean over the rows (one rank's payload each, as ``quantize_ef_``
    writes it) of ``q * s``, summed in rank order in float32, in ``dtype``. Bit for bit
    ``reference.quantized_average``'s."""
    _check_tensor("accordion::quantize_average", "rows", rows)
    for name, value in (("numel", numel), ("bits", bits), ("chunk", chunk)):
        _check_int("accordion::quantize_average", name, value)
    return torch.ops.accordion.quantize_average.default(rows, numel, bits, chunk, dtype)


def quantize_payload_bytes(numel: int, bits: int, chunk: int) -> int:
    """The bytes of one rank's payload (csrc/ops.h ``quantize_payload_bytes``)."""
    return 4 * -(-numel // chunk) + -(-numel * bits // 32) * 4


def sign_ef_(x: torch.Tensor, residual: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    """Sign's encode, fused (csrc/cpu/sign.cpp): ``residual`` (flat float32) becomes ``g = x +
    residual`` (not where ``finite`` is False); returns the payload (csrc/ops.h
    ``sign_payload_bytes``) as ``reference.sign_ef`` writes it (the scale to its last bit)."""
    _check_dense_pair("accordion::sign_ef_", x, residual)
    return torch.ops.accordion.sign_ef_.default(x, residual, finite)


def sign_average(rows: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Sign's decode: the mean of the rows' payloads, bit for bit ``reference.sign_average``'s, in ``dtype``."""
    _check_tensor("accordion::sign_average", "rows", rows)
    _check_int("accordion::sign_average", "numel", numel)
    return torch.ops.accordion.sign_average.default(rows, numel, dtype)


def quantize_chunks_ef_(grad: torch.Tensor, residual: torch.Tensor, bits: int, chunk: int, k: int, skip: float,
                        finite: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize's encode with sparse chunks, fused (csrc/cpu/quantize_chunks.cpp): ``residual``
    (flat float32) becomes ``g = grad + residual`` (not where ``finite`` is False), and this
    rank's payload is returned as uint8 bytes (codecs/quantize_chunks.py's layout): its
    ``k_next``, the ``k`` chunks of largest energy (ascending indices), their float32 scales and
    integers (NaN scales where ``finite`` is False). Bit for bit ``reference.quantize_chunks_ef``'s."""
    op = "accordion::quantize_chunks_ef_"
    _check_dense_pair(op, grad, residual)
    for name, value in (("bits", bits), ("chunk", chunk), ("k", k)):
        _check_int(op, name, value)
    if isinstance(skip, bool) or not isinstance(skip, (int, float)):
        raise TypeError(f"{op}: skip must be a number, got {type(skip).__name__}")
    return torch.ops.accordion.quantize_chunks_ef_.default(grad, residual, bits, chunk, k, float(skip), finite)


def quantize_chunks_average(rows: torch.Tensor, numel: int, k: int, bits: int, chunk: int,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize's decode with sparse chunks: ``(mean, k_next)``, the mean over the rows (one
    rank's payload each, as ``quantize_chunks_ef_`` writes it, ``k`` chunks) of their chunks
    dequantized in place, summed in rank order in float32, in ``dtype``; and the next step's k,
    the largest ``k_next`` of any row (1 at least, every chunk at most), a 0-d int64 tensor.
    Bit for bit ``reference.quantized_chunks_average``'s."""
    op = "accordion::quantize_chunks_average"
    _check_tensor(op, "rows", rows)
    for name, value in (("numel", numel), ("k", k), ("bits", bits), ("chunk", chunk)):
        _check_int(op, name, value)
    return torch.ops.accordion.quantize_chunks_average.default(rows, numel, k, bits, chunk, dtype)


def quantize_chunks_settle_(residual: torch.Tensor, indices: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                            chunk: int, done: torch.Tensor) -> None:
    """End of a sparse-chunk step: if ``done``, ``residual -= q * s`` over the chunks sent
    (``indices``, int32 ascending; ``q`` and ``scales`` as the payload holds them); the others
    keep all of g."""
    _check_int("accordion::quantize_chunks_settle_", "chunk", chunk)
    torch.ops.accordion.quantize_chunks_settle_.default(residual, indices, q, scales, chunk, done)


def _check_tensor(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")


def _check_int(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")


@torch.library.register_fake("accordion::topk_ef")
def _topk_ef_fake(grad, residual, k, finite=None):
    torch._check(grad.shape == residual.shape, lambda: "accordion::topk_ef: shapes differ")
    scalar = residual.new_empty((), dtype=torch.float64)
    return (residual.new_empty(k), residual.new_empty(k, dtype=torch.int32), scalar, scalar.clone())


@torch.library.register_fake("accordion::topk_ef_many")
def _topk_ef_many_fake(grads, residuals, ks, finite=None):
    torch._check(len(grads) == len(residuals) == len(ks), lambda: "accordion::topk_ef_many: lengths differ")
    r = residuals[0]
    return (r.new_empty(8 * sum(ks), dtype=torch.uint8), r.new_empty(len(ks), dtype=torch.float64),
            r.new_empty(len(ks), dtype=torch.float64))


@torch.library.register_fake("accordion::restore_many_if_")
def _restore_many_if_fake(residuals, payload, ks, flags):
    return None


@torch.library.register_fake("accordion::sparse_average")
def _sparse_average_fake(values, indices, numel, world_size, dtype, bad=None):
    return values.new_empty(numel, dtype=dtype)


@torch.library.register_fake("accordion::powersgd_p_many")
def _powersgd_p_many_fake(grads, residuals, qts, finite=None):
    return residuals[0].new_empty(sum(r.shape[0] * q.shape[0] for r, q in zip(residuals, qts)))


@torch.library.register_fake("accordion::powersgd_qt_many")
def _powersgd_qt_many_fake(ps, residuals):
    return residuals[0].new_empty(sum(p.shape[1] * r.shape[1] for p, r in zip(ps, residuals)))


@torch.library.register_fake("accordion::powersgd_finish_many_")
def _powersgd_finish_many_fake(residuals, outs, qts, ps, qts_avg, ok=None):
    return None


@torch.library.register_fake("accordion::powersgd_settle_many_")
def _powersgd_settle_many_fake(residuals, ps, qts, flag):
    return None


@torch.library.register_fake("accordion::orthogonalize_")
def _orthogonalize_fake(ps, eps):
    return None


@torch.library.register_fake("accordion::fill_if_")
def _fill_if_fake(tensors, flag, value):
    return None


@torch.library.register_fake("accordion::restore_if_")
def _restore_if_fake(residual, indices, values, flag):
    return None


@torch.library.register_fake("accordion::quantize_ef_")
def _quantize_ef_fake(grad, residual, bits, chunk, finite=None):
    return residual.new_empty(quantize_payload_bytes(residual.numel(), bits, chunk), dtype=torch.uint8)


@torch.library.register_fake("accordion::flush_whole")
def _flush_whole_fake(grad, residual, dtype, finite=None):
    torch._check(grad.shape == residual.shape, lambda: "accordion::flush_whole: shapes differ")
    return torch.empty_like(residual, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.register_fake("accordion::settle_sent_")
def _settle_sent_fake(residual, dtype, done):
    return None


@torch.library.register_fake("accordion::quantize_average")
def _quantize_average_fake(rows, numel, bits, chunk, dtype):
    return rows.new_empty(numel, dtype=dtype)


@torch.library.register_fake("accordion::quantize_chunks_ef_")
def _quantize_chunks_ef_fake(grad, residual, bits, chunk, k, skip, finite=None):
    return residual.new_empty(4 + 8 * k + -(-k * chunk * bits // 32) * 4, dtype=torch.uint8)


@torch.library.register_fake("accordion::quantize_chunks_average")
def _quantize_chunks_average_fake(rows, numel, k, bits, chunk, dtype):
    return rows.new_empty(numel, dtype=dtype), rows.new_empty((), dtype=torch.int64)


@torch.library.register_fake("accordion::quantize_chunks_settle_")
def _quantize_chunks_settle_fake(residual, indices, q, scales, chunk, done):
    return None


@torch.library.register_fake("accordion::sign_ef_")
def _sign_ef_fake(x, residual, finite=None):
    return residual.new_empty(4 + -(-residual.numel() // 32) * 4, dtype=torch.uint8)  # csrc/ops.h sign_payload_bytes


@torch.library.register_fake("accordion::sign_average")
def _sign_average_fake(rows, numel, dtype):
    return rows.new_empty(numel, dtype=dtype)
