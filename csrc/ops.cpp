// Schemas of every accordion:: operator, once. Each backend registers its implementations
// beside its kernels: TORCH_LIBRARY_IMPL(accordion, CPU) in cpu/ops_cpu.cpp and, in a build
// with CUDA, TORCH_LIBRARY_IMPL(accordion, CUDA) in cuda/ops_cuda.cpp. The fake (meta)
// implementations that torch.compile and opcheck need are registered from Python
// (accordion_hvd/ops.py).
#include <torch/library.h>

TORCH_LIBRARY(accordion, m) {
  m.def("ef_add_(Tensor grad, Tensor(a!) residual, Tensor? finite=None) -> ()");
  m.def("topk_ef(Tensor grad, Tensor(a!) residual, int k, Tensor? finite=None) -> (Tensor values, Tensor indices, Tensor g_sq, "
        "Tensor kept_sq)");
  m.def("topk_ef_many(Tensor[] grads, Tensor(a!)[] residuals, int[] ks, Tensor? finite=None) -> (Tensor payload, "
        "Tensor g_sq, Tensor kept_sq)");
  m.def("restore_many_if_(Tensor(a!)[] residuals, Tensor payload, int[] ks, Tensor flags) -> ()");
  m.def("sparse_average(Tensor values, Tensor indices, int numel, int world_size, ScalarType dtype, "
        "Tensor(a!)? bad=None) -> Tensor");
  m.def("powersgd_p_many(Tensor[] grads, Tensor(a!)[] residuals, Tensor[] qts, Tensor? finite=None) -> Tensor");
  m.def("powersgd_qt_many(Tensor[] ps, Tensor[] residuals) -> Tensor");
  m.def("powersgd_finish_many_(Tensor(a!)[] residuals, Tensor(b!)[] outs, Tensor(c!)[] qts, Tensor[] ps, "
        "Tensor[] qts_avg, Tensor? ok=None) -> ()");
  m.def("powersgd_settle_many_(Tensor(a!)[] residuals, Tensor[] ps, Tensor[] qts, Tensor flag) -> ()");
  m.def("orthogonalize_(Tensor(a!)[] ps, float eps) -> ()");
  m.def("fill_if_(Tensor(a!)[] tensors, Tensor flag, Scalar value) -> ()");
  m.def("restore_if_(Tensor(a!) residual, Tensor indices, Tensor values, Tensor flag) -> ()");
  m.def("quantize_ef_(Tensor grad, Tensor(a!) residual, int bits, int chunk, Tensor? finite=None) -> Tensor");
  m.def("flush_whole(Tensor grad, Tensor(a!) residual, ScalarType dtype, Tensor? finite=None) -> Tensor");
  m.def("settle_sent_(Tensor(a!) residual, ScalarType dtype, Tensor done) -> ()");
  m.def("quantize_average(Tensor rows, int numel, int bits, int chunk, ScalarType dtype) -> Tensor");
  m.def("quantize_chunks_ef_(Tensor grad, Tensor(a!) residual, int bits, int chunk, int k, float skip, "
        "Tensor? finite=None) -> Tensor");
  m.def("quantize_chunks_average(Tensor rows, int numel, int k, int bits, int chunk, ScalarType dtype) -> "
        "(Tensor mean, Tensor k_next)");
  m.def("quantize_chunks_settle_(Tensor(a!) residual, Tensor indices, Tensor q, Tensor scales, int chunk, "
        "Tensor done) -> ()");
  m.def("sign_ef_(Tensor x, Tensor(a!) residual, Tensor? finite=None) -> Tensor");
  m.def("sign_average(Tensor rows, int numel, ScalarType dtype) -> Tensor");
}
