// The Python module accordion_hvd._C. Loading it registers the accordion:: torch ops (static
// initializers in the other translation units); its attributes tell the package what was
// built, so a stale or mismatched build is refused at import instead of misbehaving.
#include <pybind11/pybind11.h>

#ifndef ACCORDION_SOURCE_HASH
#define ACCORDION_SOURCE_HASH "unknown"
#endif
#ifndef ACCORDION_TORCH_VERSION
#define ACCORDION_TORCH_VERSION "unknown"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "accordion_hvd compiled kernels (registered as torch.ops.accordion.*)";
  m.attr("source_hash") = ACCORDION_SOURCE_HASH;
  m.attr("torch_version") = ACCORDION_TORCH_VERSION;
#ifdef ACCORDION_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
