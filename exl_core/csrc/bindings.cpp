// Python module entry of exl_core._C. Ops are not bound here: each kernel file registers its
// own schema with TORCH_LIBRARY_FRAGMENT(exl_core, m) and its implementation with
// TORCH_LIBRARY_IMPL(exl_core, CPU|CUDA, m), so adding a kernel never touches this file.
// Importing the module loads the shared library, which runs those registrations.
#include <Python.h>

static struct PyModuleDef exl_core_module = {PyModuleDef_HEAD_INIT, "_C", "exl_core native kernels",
                                             -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&exl_core_module);
  if (m == nullptr) return nullptr;
#ifdef EXL_CORE_CUDA
  PyModule_AddIntConstant(m, "HAS_CUDA", 1);
#else
  PyModule_AddIntConstant(m, "HAS_CUDA", 0);
#endif
  return m;
}
