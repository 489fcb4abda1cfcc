// Tensor attributes of RaggedDTensor read without its `__torch_function__`
// ([Note: tensor attributes without __torch_function__], veragged/placement/tensor.py).
//
// torch's getters of a tensor's attributes (`grad`, `shape`, `device`, ...) first ask whether
// the tensor's class overrides `__torch_function__` and, for ours, call it with the getter;
// torch's DTensor escapes this by disabling `__torch_function__` altogether, which
// RaggedDTensor cannot (it routes ops through it). `veragged._C.SubclassFunctionOff(d)` is a
// descriptor over torch's own getset descriptor `d`: its get calls `d`'s getter with subclasses'
// `__torch_function__` disabled, as `torch._C.DisableTorchFunctionSubclass` does, so torch's
// getter answers (a TorchFunctionMode still sees the read, as it sees torch's DTensor's); its
// set and delete call `d`'s setter, with `__torch_function__` disabled too when made with
// `writes=True`, else as before (the class's `__torch_function__` sees them).

#include <Python.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <structmember.h>

#include <algorithm>

#include "bindings/tensor_attrs.h"

namespace veragged {

namespace {

using at::impl::PythonTorchFunctionTLS;
using at::impl::TorchFunctionDisabledState;

// `torch._C.DisableTorchFunctionSubclass` for the scope.
class SubclassFunctionDisabled {
 public:
  SubclassFunctionDisabled() : old_(PythonTorchFunctionTLS::get_disabled_state()) {
    PythonTorchFunctionTLS::set_disabled_state(
        std::max(old_, TorchFunctionDisabledState::SUBCLASSES_DISABLED));
  }
  ~SubclassFunctionDisabled() { PythonTorchFunctionTLS::set_disabled_state(old_); }
  SubclassFunctionDisabled(const SubclassFunctionDisabled&) = delete;
  SubclassFunctionDisabled& operator=(const SubclassFunctionDisabled&) = delete;

 private:
  TorchFunctionDisabledState old_;
};

struct Attr {
  PyObject_HEAD
  PyObject* descr;  // torch's getset descriptor
  int writes;       // sets and deletes also without `__torch_function__`
};

int attr_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"descr", "writes", nullptr};
  PyObject* descr = nullptr;
  int writes = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", const_cast<char**>(names), &descr,
                                   &writes)) {
    return -1;
  }
  if (Py_TYPE(descr)->tp_descr_get == nullptr) {
    PyErr_Format(PyExc_TypeError,
                 "SubclassFunctionOff: descr must be a descriptor (torch's getset of a tensor "
                 "attribute), got %s", Py_TYPE(descr)->tp_name);
    return -1;
  }
  auto* a = reinterpret_cast<Attr*>(self);
  Py_INCREF(descr);
  Py_XSETREF(a->descr, descr);
  a->writes = writes;
  return 0;
}

void attr_dealloc(PyObject* self) {
  auto* a = reinterpret_cast<Attr*>(self);
  PyTypeObject* type = Py_TYPE(self);
  Py_CLEAR(a->descr);
  type->tp_free(self);
  Py_DECREF(type);
}

PyObject* attr_get(PyObject* self, PyObject* obj, PyObject* type) {
  auto* a = reinterpret_cast<Attr*>(self);
  if (obj == nullptr || obj == Py_None) {  // on the class: torch's descriptor answers
    return Py_TYPE(a->descr)->tp_descr_get(a->descr, nullptr, type);
  }
  SubclassFunctionDisabled guard;
  return Py_TYPE(a->descr)->tp_descr_get(a->descr, obj, type);
}

int attr_set(PyObject* self, PyObject* obj, PyObject* value) {
  auto* a = reinterpret_cast<Attr*>(self);
  descrsetfunc set = Py_TYPE(a->descr)->tp_descr_set;
  if (set == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "attribute is read-only");
    return -1;
  }
  if (!a->writes) return set(a->descr, obj, value);
  SubclassFunctionDisabled guard;
  return set(a->descr, obj, value);
}

PyObject* attr_doc(PyObject* self, void*) {
  return PyObject_GetAttrString(reinterpret_cast<Attr*>(self)->descr, "__doc__");
}

PyMemberDef kAttrMembers[] = {
    {"descr", T_OBJECT, offsetof(Attr, descr), READONLY, "torch's descriptor"},
    {"writes", T_INT, offsetof(Attr, writes), READONLY,
     "whether sets and deletes also skip __torch_function__"},
    {nullptr, 0, 0, 0, nullptr},
};

PyGetSetDef kAttrGetSet[] = {
    {"__doc__", attr_doc, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kAttrSlots[] = {
    {Py_tp_init, reinterpret_cast<void*>(attr_init)},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(attr_dealloc)},
    {Py_tp_descr_get, reinterpret_cast<void*>(attr_get)},
    {Py_tp_descr_set, reinterpret_cast<void*>(attr_set)},
    {Py_tp_members, kAttrMembers},
    {Py_tp_getset, kAttrGetSet},
    {0, nullptr},
};

PyType_Spec kAttrSpec = {
    "veragged._C.SubclassFunctionOff", sizeof(Attr), 0, Py_TPFLAGS_DEFAULT, kAttrSlots,
};

}  // namespace

int add_tensor_attrs(PyObject* module) {
  PyObject* type = PyType_FromSpec(&kAttrSpec);
  if (type == nullptr) return -1;
  if (PyModule_AddObject(module, "SubclassFunctionOff", type) < 0) {
    Py_DECREF(type);
    return -1;
  }
  return 0;
}

}  // namespace veragged
