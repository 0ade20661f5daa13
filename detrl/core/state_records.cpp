// The records of a state's tensors that a training step writes every time, taken in one call.
//
// A commitment hashes every state tensor (detrl/formats/commit.py: a record is the tensor's header, then the
// BLAKE3 of its bytes). Most of a model's tensors are written at every step (weights and optimizer moments),
// so the digest cache keeps no copy of them to compare and rehashes them through a view of their memory it
// keeps (commit.DigestCache's steady tensors). Checked and hashed one by one in Python, that bookkeeping cost
// about 2.5 us a tensor inside a training loop, as much as the hashing itself on a small model's 72 tensors.
// SteadyRecords holds one such set: it checks, here, that each name still holds the same tensor object with
// the same memory, dtype, sizes and strides its view was taken for, then calls the hasher the cache uses on
// each view. The records are the bytes commit.tensor_record gives; where a check fails it returns None, and
// the cache takes its Python path, which sees the change. Where the cache takes every NaN as one (rules
// revision 13), it tests each tensor for a NaN here (a pass a tenth of the hash's cost) and, only where it
// finds one, hashes what its Python function canonical gives (commit.nans_canonical).
//
// same_listing is the check of commit.StateTensorCache, which keeps the state's tensor list between
// commitments: whether the dictionaries the list was read from still hold the very objects they held.

#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <vector>

namespace py = pybind11;

namespace {

struct Layout {
  const void* data;
  at::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
};

// Whether the n words at p hold a NaN: bits but the sign above `largest`, the largest that are not one. No
// early exit, so that the loop vectorises.
template <typename Word>
bool any_above(const void* p, size_t n, Word magnitude, Word largest) {
  const Word* w = static_cast<const Word*>(p);
  unsigned found = 0;
  for (size_t i = 0; i < n; ++i) found |= (w[i] & magnitude) > largest;
  return found != 0;
}

// Whether a contiguous CPU tensor holds a NaN (the dtypes of commit._NANS; any other has none to take).
bool has_nan(const at::Tensor& t) {
  const void* p = t.data_ptr();
  const size_t n = static_cast<size_t>(t.numel());
  switch (t.scalar_type()) {
    case at::kDouble: return any_above<uint64_t>(p, n, 0x7FFFFFFFFFFFFFFFull, 0x7FF0000000000000ull);
    case at::kComplexDouble: return any_above<uint64_t>(p, 2 * n, 0x7FFFFFFFFFFFFFFFull, 0x7FF0000000000000ull);
    case at::kFloat: return any_above<uint32_t>(p, n, 0x7FFFFFFFu, 0x7F800000u);
    case at::kComplexFloat: return any_above<uint32_t>(p, 2 * n, 0x7FFFFFFFu, 0x7F800000u);
    case at::kHalf: return any_above<uint16_t>(p, n, 0x7FFF, 0x7C00);
    case at::kBFloat16: return any_above<uint16_t>(p, n, 0x7FFF, 0x7F80);
    case at::ScalarType::Float8_e5m2: return any_above<uint8_t>(p, n, 0x7F, 0x7C);
    case at::ScalarType::Float8_e4m3fn: return any_above<uint8_t>(p, n, 0x7F, 0x7E);
    default: return false;
  }
}

bool same_layout(const at::Tensor& t, const Layout& l) {
  return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && t.data_ptr() == l.data &&
         t.scalar_type() == l.dtype && t.sizes() == c10::IntArrayRef(l.sizes) &&
         t.strides() == c10::IntArrayRef(l.strides);
}

class SteadyRecords {
 public:
  // names: sorted; tensors, headers (bytes) and views (the cache's uint8 views of their memory) alike;
  // hasher: called on a view, returns an object whose digest() is its 32-byte BLAKE3; state_size: the number
  // of tensors in the state they belong to (the rest are the cache's to take one by one); canonical: None, or
  // called on a view and its tensor where the tensor holds a NaN, returns the bytes to hash instead.
  SteadyRecords(const std::vector<py::str>& names, const std::vector<py::object>& tensors,
                const std::vector<py::bytes>& headers, const std::vector<py::object>& views, py::object hasher,
                size_t state_size, py::object canonical)
      : names_(names), tensors_(tensors), headers_(headers), views_(views), hasher_(std::move(hasher)),
        state_size_(state_size), canonical_(std::move(canonical)) {
    const size_t n = names_.size();
    if (tensors_.size() != n || headers_.size() != n || views_.size() != n)
      throw std::invalid_argument("SteadyRecords: names, tensors, headers and views differ in length");
    layouts_.reserve(n);
    for (const auto& obj : tensors_) {
      if (!THPVariable_Check(obj.ptr())) throw std::invalid_argument("SteadyRecords: not a tensor");
      const at::Tensor& t = THPVariable_Unpack(obj.ptr());
      layouts_.push_back({t.data_ptr(), t.scalar_type(), t.sizes().vec(), t.strides().vec()});
    }
  }

  // Each tensor's record, in name order, if `state` (name -> tensor) has state_size tensors and holds each of
  // these names, with the same tensor object and the layout it had; else None.
  py::object records(const py::dict& state) const {
    const size_t n = names_.size();
    if (static_cast<size_t>(PyDict_Size(state.ptr())) != state_size_) return py::none();
    for (size_t i = 0; i < n; ++i) {
      PyObject* t = PyDict_GetItem(state.ptr(), names_[i].ptr());  // borrowed; null where absent
      if (t != tensors_[i].ptr() || !same_layout(THPVariable_Unpack(t), layouts_[i])) return py::none();
    }
    py::list out(n);
    for (size_t i = 0; i < n; ++i) {
      const bool canonical = !canonical_.is_none() && has_nan(THPVariable_Unpack(tensors_[i].ptr()));
      py::object bytes = canonical ? canonical_(views_[i], tensors_[i]) : views_[i];
      py::bytes digest = hasher_(bytes).attr("digest")();
      char* header = nullptr;
      char* hashed = nullptr;
      Py_ssize_t header_size = 0, digest_size = 0;
      PyBytes_AsStringAndSize(headers_[i].ptr(), &header, &header_size);
      PyBytes_AsStringAndSize(digest.ptr(), &hashed, &digest_size);
      PyObject* record = PyBytes_FromStringAndSize(nullptr, header_size + digest_size);
      if (record == nullptr) throw py::error_already_set();
      std::memcpy(PyBytes_AS_STRING(record), header, static_cast<size_t>(header_size));
      std::memcpy(PyBytes_AS_STRING(record) + header_size, hashed, static_cast<size_t>(digest_size));
      PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), record);  // steals the reference
    }
    return out;
  }

  size_t size() const { return names_.size(); }

 private:
  std::vector<py::str> names_;
  std::vector<py::object> tensors_;
  std::vector<py::bytes> headers_;
  std::vector<py::object> views_;
  py::object hasher_;
  size_t state_size_;
  py::object canonical_;
  std::vector<Layout> layouts_;
};

PyObject* defaultdict_type = nullptr;  // collections.defaultdict (an optimizer's state)

// One dictionary that commit.StateTensorCache kept: the same size, and at each position the very key and
// value it held (identity, never ==). Only a dict or a defaultdict, whose iteration order PyDict_Next
// gives; any other mapping is "changed", and the cache reads the state afresh.
bool same_dict(PyObject* dict, const py::list& sizes, Py_ssize_t& d, const py::list& keys,
               const py::list& values, Py_ssize_t& k) {
  if (dict == nullptr || !(PyDict_CheckExact(dict) || Py_TYPE(dict) == (PyTypeObject*)defaultdict_type)) return false;
  if (d >= PyList_GET_SIZE(sizes.ptr())) return false;
  const Py_ssize_t size = PyLong_AsSsize_t(PyList_GET_ITEM(sizes.ptr(), d++));
  if (size == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (PyDict_Size(dict) != size || k + size > PyList_GET_SIZE(keys.ptr()) || k + size > PyList_GET_SIZE(values.ptr()))
    return false;
  Py_ssize_t pos = 0;
  PyObject *key = nullptr, *value = nullptr;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    if (key != PyList_GET_ITEM(keys.ptr(), k) || value != PyList_GET_ITEM(values.ptr(), k)) return false;
    ++k;
  }
  return true;
}

// commit.StateTensorCache._unchanged's check in one call: every module still of its kept class, and the
// dictionaries the state's tensor list is read from (each module's _modules, _parameters and _buffers, each
// optimizer's state, then the per-parameter dicts kept from it) still of the kept sizes, holding the kept
// keys and values, in order. Inside a training loop the same check in Python cost about 0.09 ms of a small
// model's step (it runs cold there).
bool same_listing(const py::list& modules, const py::list& classes, const py::tuple& optimizers,
                  const py::list& per_parameter, const py::list& sizes, const py::list& keys, const py::list& values) {
  const Py_ssize_t n = PyList_GET_SIZE(modules.ptr());
  if (PyList_GET_SIZE(classes.ptr()) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if ((PyObject*)Py_TYPE(PyList_GET_ITEM(modules.ptr(), i)) != PyList_GET_ITEM(classes.ptr(), i)) return false;
  }
  Py_ssize_t d = 0, k = 0;
  auto attribute_dict = [&](PyObject* owner, const char* name) {
    PyObject* dict = PyObject_GetAttrString(owner, name);  // a new reference, or null with an error set
    if (dict == nullptr) {
      PyErr_Clear();  // no such attribute: changed
      return false;
    }
    const bool same = same_dict(dict, sizes, d, keys, values, k);
    Py_DECREF(dict);
    return same;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* module = PyList_GET_ITEM(modules.ptr(), i);
    for (const char* name : {"_modules", "_parameters", "_buffers"}) {
      if (!attribute_dict(module, name)) return false;
    }
  }
  for (const auto& opt : optimizers) {
    if (!attribute_dict(opt.ptr(), "state")) return false;
  }
  for (const auto& dict : per_parameter) {
    if (!same_dict(dict.ptr(), sizes, d, keys, values, k)) return false;
  }
  return d == PyList_GET_SIZE(sizes.ptr()) && k == PyList_GET_SIZE(keys.ptr());
}

}  // namespace

#ifndef DETRL_BUILT_FOR_TORCH
#define DETRL_BUILT_FOR_TORCH ""  // built on first use, against the torch that is running
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("built_for_torch") = DETRL_BUILT_FOR_TORCH;
  py::class_<SteadyRecords>(m, "SteadyRecords", "the records of a state's tensors written at every step")
      .def(py::init<const std::vector<py::str>&, const std::vector<py::object>&, const std::vector<py::bytes>&,
                    const std::vector<py::object>&, py::object, size_t, py::object>(),
           py::arg("names"), py::arg("tensors"), py::arg("headers"), py::arg("views"), py::arg("hasher"),
           py::arg("state_size"), py::arg("canonical") = py::none())
      .def("records", &SteadyRecords::records, py::arg("state"),
           "each tensor's record in name order, or None where the state differs from the one it was made for")
      .def("__len__", &SteadyRecords::size);
  defaultdict_type = py::object(py::module_::import("collections").attr("defaultdict")).release().ptr();  // kept
  m.def("same_listing", &same_listing, py::arg("modules"), py::arg("classes"), py::arg("optimizers"),
        py::arg("per_parameter"), py::arg("sizes"), py::arg("keys"), py::arg("values"),
        "whether the dictionaries a state's tensor list was read from hold what they held (by identity)");
}
