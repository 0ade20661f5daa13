// A boxed dispatcher fallback that does no work: what entering C++ code costs an aten op, against
// entering a Python dispatch mode. `detrl bench perop --cpp-fallback` builds it (torch.utils.cpp_extension)
// and times ops under it, to choose a route for rounding below Python by measurement.
//
// It is registered for DispatchKey::Fake, which torch reserves for a C++ fake-tensor mode that eager code
// does not use. The key sits below autograd and just below Python (Python dispatch modes run first), so
// the ops it sees are those a Python mode sees: composites decomposed, backward ops included. It joins the
// thread's dispatch keys only between enter() and leave(); outside, no tensor carries it and the fallback
// never runs. Inside the fallback the key is excluded while the op runs, as a Python mode is while its
// handler runs, so ops that a kernel calls internally are not seen a second time. A process that loaded
// the probe must not use torch's C++ fake-tensor mode: the probe's fallback would take its ops.
#include <torch/extension.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <memory>

namespace {

int64_t calls = 0;
std::unique_ptr<c10::impl::IncludeDispatchKeyGuard> scope;

void pass_through(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  ++calls;
  c10::impl::ExcludeDispatchKeyGuard inside(c10::DispatchKey::Fake);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake),
                     stack);
}

void enter() {
  TORCH_CHECK(!scope, "the fallback probe's scope is already entered");
  scope = std::make_unique<c10::impl::IncludeDispatchKeyGuard>(c10::DispatchKey::Fake);
}

void leave() { scope.reset(); }

int64_t seen() { return calls; }

}  // namespace

TORCH_LIBRARY_IMPL(_, Fake, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&pass_through>()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enter", &enter, "include the probe's key in this thread's dispatch keys");
  m.def("leave", &leave, "remove it again");
  m.def("seen", &seen, "ops the fallback has passed through so far");
}
