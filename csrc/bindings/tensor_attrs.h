// The _C module's Python type: tensor attributes read without `__torch_function__`
// (tensor_attrs.cpp).
#pragma once

#include <Python.h>

namespace veragged {

// Adds `SubclassFunctionOff` to the `veragged._C` module; -1 with a Python error on failure.
int add_tensor_attrs(PyObject* module);

}  // namespace veragged
