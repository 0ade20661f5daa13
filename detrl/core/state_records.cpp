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
// the cache takes its Python path, which sees the change.

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

bool same_layout(const at::Tensor& t, const Layout& l) {
  return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && t.data_ptr() == l.data &&
         t.scalar_type() == l.dtype && t.sizes() == c10::IntArrayRef(l.sizes) &&
         t.strides() == c10::IntArrayRef(l.strides);
}

class SteadyRecords {
 public:
  // names: sorted; tensors, headers (bytes) and views (the cache's uint8 views of their memory) alike;
  // hasher: called on a view, returns an object whose digest() is its 32-byte BLAKE3; state_size: the number
  // of tensors in the state they belong to (the rest are the cache's to take one by one).
  SteadyRecords(const std::vector<py::str>& names, const std::vector<py::object>& tensors,
                const std::vector<py::bytes>& headers, const std::vector<py::object>& views, py::object hasher,
                size_t state_size)
      : names_(names), tensors_(tensors), headers_(headers), views_(views), hasher_(std::move(hasher)),
        state_size_(state_size) {
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
      py::bytes digest = hasher_(views_[i]).attr("digest")();
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
  std::vector<Layout> layouts_;
};

}  // namespace

#ifndef DETRL_BUILT_FOR_TORCH
#define DETRL_BUILT_FOR_TORCH ""  // built on first use, against the torch that is running
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("built_for_torch") = DETRL_BUILT_FOR_TORCH;
  py::class_<SteadyRecords>(m, "SteadyRecords", "the records of a state's tensors written at every step")
      .def(py::init<const std::vector<py::str>&, const std::vector<py::object>&, const std::vector<py::bytes>&,
                    const std::vector<py::object>&, py::object, size_t>(),
           py::arg("names"), py::arg("tensors"), py::arg("headers"), py::arg("views"), py::arg("hasher"),
           py::arg("state_size"))
      .def("records", &SteadyRecords::records, py::arg("state"),
           "each tensor's record in name order, or None where the state differs from the one it was made for")
      .def("__len__", &SteadyRecords::size);
}
