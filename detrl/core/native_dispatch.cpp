// The native side of verifiable precision's rounding: the ops that need no Python, handled below Python.
//
// Under the rounding mode (detrl/core/rounding.py) every aten op enters Python, about 3-5 us before any
// work. Most ops of a training step need none of what the mode does in Python: views and copies (KEEP)
// only move values; correctly rounded IEEE ops (EXACT: add, mul, div, sqrt, fills, casts) and the fused
// updates split into them (detrl/core/fused.py) need only their FP64 result rounded to FP32; a logged op
// (ELEMENTWISE, or a REDUCTION whose unit needs no more than its output, or mm's) needs an op position,
// and log entries where an element lies near an FP32 midpoint. This file runs and rounds those ops in C++,
// their entries written by the C kernel's pass (detrl/core/_roundkernel.c, through its C API); every other
// op goes to the Python mode.
//
// How: a boxed dispatcher fallback on DispatchKey::Fake (reserved for a C++ fake-tensor mode that eager
// code does not use). Fake sits just below Python, so while a step runs, Fake is included in the thread's
// dispatch keys and Python is excluded: every op reaches this fallback first, with composites decomposed
// and backward ops included, as the Python mode would see them. For each operator the Python side says
// once which route it takes (`resolve`, cached here by operator); per call, only what depends on the
// arguments is checked here (a float32 or half argument: a Python "island"; alpha != 1: a fused op; pow's
// exponent). An op for Python is redispatched to the Python key with Python allowed again and Fake
// excluded, so the mode's handler, and every op it runs, behaves exactly as without this file, except a
// decomposition's machine-dependent steps, which the handler hands back here (nest).
//
// A process that uses this must not use torch's C++ fake-tensor mode at the same time.
#include <torch/extension.h>
#include <torch/library.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "roundkernel.h"

namespace py = pybind11;

namespace {

// Routes, as detrl/core/native.py's Route names them.
enum Route : int {
  PYTHON = 0,
  KEEP = 1,
  EXACT = 2,
  EXACT_IF_ALPHA_ONE = 3,
  CAST = 4,
  LOGGED = 5,  // an ELEMENTWISE op: rounded here when no element is near a midpoint, else by Python
  LOGGED_REDUCTION = 6,  // a REDUCTION measured at its output's channel scale: the same, with that unit
  LOGGED_MM = 7,         // aten.mm: the same, with its unit from its inputs (scale.reduction_scale)
  EXACT_IF_SQUARE = 8,   // pow(x, 2) (rules revision 2): EXACT; any other exponent: LOGGED
  // a sum whose elements exact in every order need no entry (rules revision 2): LOGGED_REDUCTION, except
  // that an output with a near element leaves their entries out: a plain CPU sum or embedding gradient here
  // (the kernel's exact_sums, exact_embedding_sums), else in the mode, which gets the call's arguments
  LOGGED_SUM = 9,
  // fused ops computed as separate IEEE steps (detrl/core/fused.py), then rounded as EXACT
  SPLIT_ADD = 10, SPLIT_SUB = 11, SPLIT_ADDCMUL = 12, SPLIT_ADDCDIV = 13, SPLIT_LERP = 14,
  // convolution_backward: its input gradient at each sample's and channel's scale (scale's
  // _sample_channel_scale), its weight and bias gradients at their channel scale; with the kernel only
  LOGGED_CONV = 15,
  // decompose.py's batch norm, its backward and log-softmax's backward, written out here (decomposed)
  DECOMPOSED_BATCH_NORM = 16, DECOMPOSED_BATCH_NORM_BACKWARD = 17, DECOMPOSED_LOG_SOFTMAX_BACKWARD = 18,
  // ... and layer norm, its backward (with the C kernel: its exact rows) and softmax's backward
  DECOMPOSED_LAYER_NORM = 19, DECOMPOSED_LAYER_NORM_BACKWARD = 20, DECOMPOSED_SOFTMAX_BACKWARD = 21,
  // a sum or a mean from rules revision 5 (scale.TERMS_SCALED): its unit from its terms
  // (scale._terms_scale) as an (elements, 1) product's, a row factor per element and one column factor;
  // aten.sum.dim_IntList as LOGGED_SUM besides; with the kernel only
  LOGGED_TERMS = 22,
  // convolution_backward from rules revision 6: each gradient at the larger of its own scale and its terms'
  // unit (scale._conv_terms_scale), as row factors over (outer, 1, inner); with the kernel only
  LOGGED_CONV_TERMS = 23,
  // GELU and the backwards of GELU and SiLU from rules revision 11 (oprules.GRADIENT_SCALED_FROM_11): their
  // unit from their first argument (scale._gradient_scale), as an (elements, 1) product's, a row factor per
  // element and one column factor; with the kernel only
  LOGGED_BY_FIRST = 24,
  // (internal) a unit of row factors over (outer, 1, inner) with column factor 1: an input gradient's
  LOGGED_ROWS = 100,
  // (internal) each element's T given: an op in its first argument's units, as one row of one-element channels
  LOGGED_EACH = 101,
};

bool is_split(int route) { return route >= SPLIT_ADD && route <= SPLIT_LERP; }

constexpr auto kOurs = c10::DispatchKey::Fake;
// Keys below ours: where an op we handle goes on.
const c10::DispatchKeySet kBelowOurs(c10::DispatchKeySet::FULL_AFTER, kOurs);
// Ours and every key above: excluded while this file runs torch ops of its own (autograd, the Python mode
// and this fallback must not see them, as the Python mode's own ops are not seen).
const c10::DispatchKeySet kOursAndAbove = c10::DispatchKeySet(c10::DispatchKeySet::FULL) ^ kBelowOurs;

// What the Python side decided about one operator.
struct Entry {
  int route = PYTHON;
  bool in_place = false;  // a split op's in-place overload
  double tau = 0.0;       // LOGGED: its threshold, in FP32 spacings (at the element, or the channel scale)
  py::object name;        // LOGGED: its op name, for the step's list of logged ops
  py::object func;        // LOGGED: its OpOverload, for the mode's logged rounding
  bool float32_exact = false;  // EXACT: a float32 island of it may run natively (oprules.FLOAT32_EXACT)
  bool classed = false;        // LOGGED: its threshold depends on the call's class (Thresholds.per_class)
  bool sum_dims = false;       // LOGGED_SUM: aten.sum.dim_IntList, whose exact elements the kernel finds
  bool embedding = false;      // LOGGED_SUM: aten.embedding_dense_backward, likewise (over the rows it names)
  bool exact_products = false; // a convolution whose calls exact in every order need no entry (rules revision 3)
  bool mean = false;           // LOGGED_TERMS: a mean, whose unit is its sum's over the terms' count
};

// The routes of the operators seen, kept across steps (the Python side clears it when thresholds or the
// profile change).
// A call's thresholds: one, or one per rounded output (rules revision 4).
using Taus = std::vector<double>;

struct Table {
  py::object resolve;  // (qualified name, overload) -> (route, in_place, tau, short name, OpOverload, ...)
  bool negative_zeros = false;  // a reduction's tiny negative values take part in the near test (oprules)
  bool finite_extremes = false;  // rules revision 12: a call with FP64's largest finite number goes to the mode
  bool nans_unlogged = false;  // rules revision 16: a NaN never takes part in the near test
  // The near test's flags for the C kernel's near_pass and for near_flag (NEAR_NEGATIVE_ZEROS, NEAR_NO_NANS).
  int near_flags() const { return (negative_zeros ? 1 : 0) | (nans_unlogged ? 2 : 0); }
  // a verifiable step's table: results no rule rounds (complex, sparse) are refused; a plain step's
  // (native.random_route: its random ops to the stream's mode, every other op run as it is) refuses nothing
  bool refuses = true;
  std::unordered_map<const void*, Entry> entries;  // by the operator's schema (one per operator)
  // The thresholds of classed ops' calls, by call key (call_key), as the mode gave them: one, or one per
  // rounded output (rules revision 4). The class is a function of the call's arguments, and the table's
  // thresholds are fixed.
  std::unordered_map<std::string, Taus> class_taus;
};

// Without the C kernel, logged outputs of more elements than this go to the mode, whose torch reference is
// vectorised: a Python call costs a few microseconds, the scalar test here about a nanosecond an element.
constexpr int64_t kLargeOutput = 8192;

// One step on this thread.
// Calls of logged ops whose shape class calibration has measured enough (detrl/core/calibrate.py: it
// declines to measure them again), by a key finer than the class: the operator and every argument's
// dtype, layout, sizes and strides, and every other argument's value. The class is a function of the
// call's arguments and its count only grows, so a key once declined is declined for good.
// Each with its class's own thresholds where it has them (final: a declined class is measured no more),
// else NaN: the op's live threshold.
struct Declined {
  std::unordered_map<std::string, Taus> keys;
};

struct Step {
  Table* table = nullptr;
  bool logs = false;        // LOGGED ops may be rounded here: recording
  // In a calibration step (else null): the calls known declined, and the calibrator's hooks:
  // tally() -> (calls, declined) so far; declined_call(name) -> the op's live threshold, counting the call
  // as the calibrator counts one it declines.
  Declined* declined = nullptr;
  py::object tally, declined_call;
  // (names) -> None: the logged ops rounded here since the last call take the next op positions, in order.
  // They wait in `pending` (each op's name, the table's own str) and go over in one call, not one each:
  // taking the GIL and calling Python for every op cost about 1 us of a logged op's few. Whatever numbers
  // an op in Python first hands them over (flush_numbers): the entries callback below, the mode's logged
  // rounding on any thread (autograd's device threads take the Python route), and leave().
  py::object numbered;
  std::mutex pending_mutex;  // a device thread's mode may flush while this thread runs
  std::vector<PyObject*> pending;
  // (OpOverload, elementwise, tensor, args, tau) -> None: the mode's logged rounding (args: what its unit
  // or its exact elements need: a matrix product's two inputs, a sum's arguments, else empty)
  py::object round_logged;
  // The C kernel's entry pass, or null (not built, or switched off: then the mode's logged rounding takes
  // an output with a near element); with it, (name, indices, up, pinned indices, pinned values, short
  // indices, short bits) -> None: a logged op rounded here takes the next op position and its entries.
  const DetrlKernelApi* kernel = nullptr;
  py::object entries;
  // () -> None or (tau, its class's own): the threshold the mode gave the last logged call it rounded
  py::object learned;
  // Depth inside the mode's decompositions (RoundingMode._nested): their sums and exps come back here
  // (nest), and their outputs are parts of the decomposed op's, not counted as rounded.
  int nested = 0;
  // (delta) -> None: RoundingMode._nested += delta, around a decomposition written out here (decomposed),
  // so that a step of it the mode takes (a sum with a near element) counts as its part there too
  py::object nesting;
  int64_t rounded = 0;             // elements rounded here (StepStats.rounded_elements)
  int64_t native_ops = 0;
  int64_t python_ops = 0;
  int64_t entry_ops = 0;  // logged outputs whose entries were taken here
  int64_t one_pass = 0;   // split ops computed and rounded in one pass (split_in_one_pass)
};

thread_local Step* current = nullptr;

// Every entered step, on any thread: the mode's logged rounding hands their pending numbers over first.
std::mutex live_mutex;
std::vector<Step*> live_steps;

// A logged op rounded here takes the next op position (Step::numbered). No GIL needed.
void number_later(Step* step, const py::object& name) {
  std::lock_guard<std::mutex> lock(step->pending_mutex);
  step->pending.push_back(name.ptr());
}

// Hands the step's pending numbers to the Python side. The GIL must be held.
void flush_numbers(Step* step) {
  py::list names;
  {
    std::lock_guard<std::mutex> lock(step->pending_mutex);
    if (step->pending.empty()) return;
    names = py::list(step->pending.size());
    for (size_t i = 0; i < step->pending.size(); ++i) {
      names[i] = py::reinterpret_borrow<py::object>(step->pending[i]);
    }
    step->pending.clear();
  }
  step->numbered(names);
}

// flush_numbers of every entered step (the mode's, before it numbers an op). The GIL must be held. Each
// step is looked up again before its flush: the Python call of the one before may let another thread leave
// its scope (which takes the GIL too) and end it.
void flush_all_numbers() {
  std::vector<Step*> steps;
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    steps = live_steps;
  }
  for (Step* step : steps) {
    {
      std::lock_guard<std::mutex> lock(live_mutex);
      if (std::find(live_steps.begin(), live_steps.end(), step) == live_steps.end()) continue;
    }
    flush_numbers(step);
  }
}

const Entry& entry_of(Table* table, const c10::OperatorHandle& op) {
  const void* key = &op.schema();
  auto found = table->entries.find(key);
  if (found != table->entries.end()) return found->second;
  Entry e;
  {
    py::gil_scoped_acquire gil;
    const auto& name = op.operator_name();
    py::tuple r = table->resolve(name.name, name.overload_name);
    e.route = r[0].cast<int>();
    e.in_place = r[1].cast<bool>();
    e.tau = r[2].cast<double>();
    e.name = r[3];
    e.func = r[4];
    e.float32_exact = r[5].cast<bool>();
    e.classed = r[6].cast<bool>();
    e.sum_dims = name.name == "aten::sum" && name.overload_name == "dim_IntList";
    e.embedding = name.name == "aten::embedding_dense_backward";
    e.mean = name.name == "aten::mean";
    e.exact_products = r[7].cast<bool>();
  }
  return table->entries.emplace(key, std::move(e)).first->second;
}

bool narrow(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

// A tensor argument, or a tensor in a list argument, whose dtype `kind` accepts.
bool tensor_of(const c10::IValue& v, bool (*kind)(c10::ScalarType)) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    return t.defined() && kind(t.scalar_type());
  }
  if (v.isTensorList() || v.isOptionalTensorList() || v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (e.isTensor() && e.toTensor().defined() && kind(e.toTensor().scalar_type())) return true;
    }
  }
  return false;
}

// An argument of a dtype `kind` accepts: a tensor, a tensor in a list, or dtype=.
bool argument_of(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first,
                 bool (*kind)(c10::ScalarType)) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& v = stack[first + i];
    if (tensor_of(v, kind)) return true;
    if (v.isInt() && args[i].name() == "dtype" && kind(static_cast<c10::ScalarType>(v.toInt()))) return true;
  }
  return false;
}

bool complex_type(c10::ScalarType t) { return c10::isComplexType(t); }

// A complex tensor argument (or list element), a complex number or a complex dtype=: an op for the Python
// mode's detrl/core/complexes.py (islands.narrow_dtype sees the tensors and dtypes; a complex number with
// real tensors gives a complex result, which the mode computes again as complexes.py says).
bool complex_argument(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first) {
  for (size_t i = first; i < stack.size(); ++i) {
    if (stack[i].isComplexDouble()) return true;
  }
  return argument_of(schema, stack, first, complex_type);
}

// The Python mode's islands.narrow_dtype, as a yes/no: a float32 or half tensor argument, or dtype=.
bool has_narrow_argument(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first) {
  return argument_of(schema, stack, first, narrow);
}

// A number float32 holds exactly (a float32 kernel converts its numbers to float32 first; the FP64 twin
// of an island computes with them as they are).
bool float32_holds(const c10::IValue& v) {
  if (v.isDouble()) {
    const double d = v.toDouble();
    return static_cast<double>(static_cast<float>(d)) == d;  // not NaN: its payload is the kernel's to pass on
  }
  if (v.isInt()) {
    const int64_t i = v.toInt();
    return i > -(int64_t{1} << 24) && i < (int64_t{1} << 24);
  }
  return v.isBool();
}

// Every element of a dense CPU float tensor is finite (neither NaN nor infinite).
template <typename T>
bool all_finite(const T* x, int64_t n) {
  T bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += x[i] - x[i];  // 0 for a finite value, NaN otherwise
  return bad == 0;
}

// A float32 island the route may compute natively in float32 (an op of oprules.FLOAT32_EXACT): finite
// float32 tensors, bool tensors, finite FP64 tensors of one or more dimensions (they make the result FP64,
// computed from exact conversions, as the twins are), 0-dim tensors and numbers whose value float32 holds
// (a float32 kernel converts them to float32 first), no narrow dtype= and no string (div's rounding mode).
// Finite, because which NaN an op passes on (its sign and payload) is the kernel's choice, and a float32
// kernel's need not be an FP64 one's: an op on finite values makes no NaN but the one default NaN. Anything
// else takes the Python mode's FP64 twins.
bool float32_island(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first) {
  auto tensor_ok = [](const at::Tensor& t) {
    if (!t.defined()) return true;
    const auto type = t.scalar_type();
    if (type == c10::ScalarType::Bool) return true;
    const bool dense = t.is_cpu() && t.is_contiguous();
    if (type == c10::ScalarType::Float) return dense && all_finite(t.const_data_ptr<float>(), t.numel());
    if (type == c10::ScalarType::Double && t.dim() != 0)
      return dense && all_finite(t.const_data_ptr<double>(), t.numel());
    if (t.dim() != 0 || !t.is_cpu()) return false;
    if (type == c10::ScalarType::Double) return float32_holds(c10::IValue(*t.const_data_ptr<double>()));
    if (type == c10::ScalarType::Long) return float32_holds(c10::IValue(*t.const_data_ptr<int64_t>()));
    return false;
  };
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& v = stack[first + i];
    if (v.isTensor()) {
      if (!tensor_ok(v.toTensor())) return false;
    } else if (v.isTensorList() || v.isOptionalTensorList() || v.isList()) {
      for (const auto& x : v.toListRef()) {
        if (x.isTensor() ? !tensor_ok(x.toTensor()) : !(x.isNone() || x.isInt() || float32_holds(x))) return false;
      }
    } else if (v.isDouble() || v.isInt() || v.isBool()) {
      if (args[i].name() == "dtype" ? narrow(static_cast<c10::ScalarType>(v.toInt())) : !float32_holds(v))
        return false;
    } else if (v.isString() || v.isComplexDouble() || v.isSymInt() || v.isSymFloat() || v.isObject()) {
      return false;
    }
  }
  return true;
}

// A number argument is exactly 1 (fused.py's `factor == 1`, where the factor is an int, float or bool);
// -1: another type (complex, symbolic), which the Python mode decides.
int is_one(const c10::IValue& v) {
  if (v.isInt()) return v.toInt() == 1;
  if (v.isDouble()) return v.toDouble() == 1.0;
  if (v.isBool()) return v.toBool() ? 1 : 0;
  return -1;
}

// oprules.squares: the call's exponent is the number 2 (an int or a float; not a bool, not symbolic).
bool exponent_is_two(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() != "exponent") continue;
    const auto& v = stack[first + i];
    return (v.isInt() && v.toInt() == 2) || (v.isDouble() && v.toDouble() == 2.0);
  }
  return false;
}

// An argument that is FP64's largest finite number, either sign: a number, or a one-element FP64 CPU tensor
// (oprules.fp32_extremes, which the mode applies: rules revision 12 takes it as FP32's).
bool fp64_extreme_argument(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first) {
  constexpr double extreme = std::numeric_limits<double>::max();
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& v = stack[first + i];
    if (v.isDouble() && std::fabs(v.toDouble()) == extreme) return true;
    if (!v.isTensor()) continue;
    const auto& t = v.toTensor();
    if (t.defined() && t.scalar_type() == c10::ScalarType::Double && t.numel() == 1 && t.layout() == c10::kStrided &&
        t.device().is_cpu() && t.has_storage() && std::fabs(*t.const_data_ptr<double>()) == extreme)
      return true;
  }
  return false;
}

// alpha (where the schema has one) is exactly 1: an add or sub that is neither fused nor split.
bool alpha_is_one(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t first) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == "alpha") return is_one(stack[first + i]) == 1;
  }
  return true;
}

void collect(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isTensorList() || v.isOptionalTensorList() || v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (e.isTensor()) out.push_back(e.toTensor());
    }
  }
}

bool plain_cpu(const at::Tensor& t) { return t.is_cpu() && !t.is_conj() && !t.is_neg(); }

// A result no rule rounds (islands.unroundable): sparse, or complex (a view of one included).
bool unroundable(const at::Tensor& t) { return t.defined() && (t.layout() != c10::kStrided || t.is_complex()); }

// Raises the mode's error for such a result (islands.UnroundableResult), as the mode would.
[[noreturn]] void refuse(const Entry& e, const at::Tensor& t) {
  py::gil_scoped_acquire gil;
  py::module_::import("detrl.core.islands").attr("refuse_result")(e.func, t);
  throw std::logic_error("detrl.core.islands.refuse_result returned");
}

// A defined, strided FP64 CPU tensor that is no lazy conjugate or negation, with memory to read (a "zero
// tensor" has none; inside a step none is made: composites.zeros).
bool plain_double(const at::Tensor& t) {
  return t.defined() && t.scalar_type() == c10::ScalarType::Double && t.layout() == c10::kStrided && plain_cpu(t) &&
         !t._is_zerotensor();
}

// An output the mode rounds: a non-empty FP64 tensor (other dtypes and empty ones it leaves as they are), with
// memory to read.
bool rounded_output(const at::Tensor& t) {
  return t.defined() && t.scalar_type() == c10::ScalarType::Double && t.numel() > 0 && !t._is_zerotensor();
}

// Vector builds of the loops over an output, as in the C kernel: each element is computed exactly as the
// scalar code computes it (no fast-math, no FMA contraction); the loader picks an AVX-512 clone where the CPU
// has it, else an AVX2 one.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

VECTOR_CLONES void round_dense(double* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<double>(static_cast<float>(p[i]));
}

// Elements rounded as a step's output (not inside a decomposition: the mode counts only the decomposed op's).
void count_rounded(Step* step, int64_t n) {
  if (step->nested == 0) step->rounded += n;
}

// A strided view's elements are runs of `run` elements side by side in memory (its innermost dims that are
// dense), one run at each offset `starts` lists (in elements from its data pointer). Rounding and the
// elementwise near test take an element as it is, wherever it lies, so a view (an LSTM's gates, four
// column blocks of one matrix) is rounded and tested in place instead of through a dense copy written back.
struct Runs {
  int64_t run = 1;
  std::vector<int64_t> starts;
};

// The runs of a plain FP64 CPU tensor, or false where they are shorter than kShortRun (a transposed matrix:
// a run of one element each, for which the dense copy is faster) or more than numel / kShortRun.
constexpr int64_t kShortRun = 16;
bool runs_of(const at::Tensor& t, Runs& r) {
  const int64_t dims = t.dim();
  int64_t d = dims - 1;
  r.run = 1;
  for (; d >= 0; --d) {  // the dense innermost dims (size-1 dims have no stride to keep)
    if (t.size(d) != 1 && t.stride(d) != r.run) break;
    r.run *= t.size(d);
  }
  if (r.run < kShortRun) return false;
  r.starts.assign(1, 0);
  for (; d >= 0; --d) {  // each outer dim repeats the runs so far at its stride
    const int64_t n = t.size(d), stride = t.stride(d), before = static_cast<int64_t>(r.starts.size());
    for (int64_t i = 1; i < n; ++i) {
      for (int64_t j = 0; j < before; ++j) r.starts.push_back(r.starts[static_cast<size_t>(j)] + i * stride);
    }
  }
  return true;
}

// Each run of t's elements to the nearest FP32 value, in place.
void round_runs(const at::Tensor& t, const Runs& r) {
  double* p = t.data_ptr<double>();
  for (const int64_t start : r.starts) round_dense(p + start, r.run);
}

// RoundingMode._round_exact: an FP64 tensor to the nearest FP32 value, in place.
void round_exact(Step* step, const at::Tensor& t) {
  if (!rounded_output(t)) return;
  Runs runs;
  if (plain_cpu(t) && t.is_contiguous()) {
    round_dense(t.data_ptr<double>(), t.numel());
  } else if (plain_cpu(t) && runs_of(t, runs)) {
    round_runs(t, runs);
  } else {
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    t.copy_(t.to(c10::ScalarType::Float));
  }
  count_rounded(step, t.numel());
}

// rounding.near_midpoint's test of one element x against its threshold t: x - t and x + t round to
// different FP32 values, and x takes part: its FP32 rounding is not zero or, with bit 1 of tiny (a
// reduction's from rules revision 7), x is a negative value that rounds to -0; with bit 2 (rules revision
// 16), x is not a NaN (the C kernel's near_flag and its flags). Without a branch, so that the loops vectorise.
inline int near_flag(double x, double t, int tiny) {
  return (static_cast<float>(x - t) != static_cast<float>(x + t)) &
         ((static_cast<float>(x) != 0.0f) | ((tiny & 1) & (x < 0.0))) & (((tiny >> 1) ^ 1) | (x == x));
}

// Whether any element of a dense FP64 buffer lies within T of an FP32 midpoint, T at the element as
// rounding.near_midpoint computes it: clamp(|x| tau 2**-23, tau 2**-149, tau 2**104). The same IEEE
// double and float operations as the reference and the C kernel (no fast-math, no FMA contraction).
VECTOR_CLONES bool any_near(const double* x, int64_t n, double tau, int tiny) {
  const double c1 = tau * 0x1p-23, lo = tau * 0x1p-149, hi = tau * 0x1p104;
  int any = 0;
  for (int64_t i = 0; i < n; ++i) {
    double t = std::fabs(x[i]) * c1;
    t = t < lo ? lo : t;
    t = t > hi ? hi : t;
    any |= near_flag(x[i], t, tiny & 2);
  }
  return any != 0;
}

// 2**floor(log2(d)) of a non-negative double, by clearing its mantissa (scale._power_of_two).
double power_of_two(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  bits &= 0x7FF0000000000000ULL;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// Whether any element of a dense FP64 buffer laid out (outer, channels, inner) lies within T of an FP32
// midpoint, T per channel at the output's scale as rounding.scale_spacing and the C kernel compute it:
// max(2**floor(log2(float(max |x|))) 2**-23, 2**-149) tau. A channel holding a NaN or an infinity has no
// finite T: reported as near, so the mode decides.
bool any_near_channels(const double* x, int64_t outer, int64_t channels, int64_t inner, double tau,
                       int tiny) {
  std::vector<double> amax(static_cast<size_t>(channels), 0.0);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t c = 0; c < channels; ++c) {
      const double* row = x + (o * channels + c) * inner;
      double m = amax[c], bad = 0.0;
      for (int64_t i = 0; i < inner; ++i) {
        double r = std::fabs(row[i]);
        bad += r - r;  // 0 for a finite value, NaN for a NaN or an infinity
        m = r > m ? r : m;
      }
      if (bad != bad) return true;
      amax[c] = m;
    }
  }
  for (int64_t c = 0; c < channels; ++c) {
    double d = power_of_two(static_cast<double>(static_cast<float>(amax[c]))) * 0x1p-23;
    if (d < 0x1p-149) d = 0x1p-149;
    amax[c] = d * tau;  // now T of channel c
  }
  int any = 0;
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t c = 0; c < channels; ++c) {
      const double* row = x + (o * channels + c) * inner;
      const double t = amax[c];
      for (int64_t i = 0; i < inner; ++i) {
        any |= near_flag(row[i], t, tiny);
      }
      if (any) return true;
    }
  }
  return false;
}

// Per row of a strided FP64 matrix (rows x cols): scale.unit_factors, max(2**floor(log2(max |row|)),
// 2**-149) * times. False where a row holds a NaN or an infinity (its factor is infinite: the mode decides).
bool unit_factors(const at::Tensor& m, double times, std::vector<double>& out) {
  const int64_t rows = m.size(0), cols = m.size(1), rs = m.stride(0), cs = m.stride(1);
  const double* x = m.data_ptr<double>();
  out.assign(static_cast<size_t>(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double amax = 0.0, bad = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      double v = std::fabs(x[r * rs + c * cs]);
      bad += v - v;
      amax = v > amax ? v : amax;
    }
    if (bad != bad) return false;
    double p = power_of_two(amax);
    out[r] = (p < 0x1p-149 ? 0x1p-149 : p) * times;
  }
  return true;
}

// A matrix product's inputs, for its unit (scale.reduction_scale: row factors of a, column factors of b).
struct Product {
  at::Tensor a, b;  // (M, K) and (K, N), FP64 on the CPU
};

// scale.terms_factor(K) = 2**(floor(log2 K) // 2), floor(log2 K) from the bit length (K >= 1).
double terms_factor(int64_t k) {
  const int log2k = 63 - __builtin_clzll(static_cast<unsigned long long>(k));
  return std::ldexp(1.0, log2k / 2);
}

// A matrix product's unit as scale.reduction_scale gives it: row[i] from a's row i, col[j] from b's column
// j times 2**-23 terms_factor(K). False where a factor is infinite (a NaN or an infinity): the mode decides.
bool product_unit(const Product& p, std::vector<double>& rows, std::vector<double>& cols) {
  return unit_factors(p.a, 1.0, rows) && unit_factors(p.b.t(), 0x1p-23 * terms_factor(p.a.size(1)), cols);
}

// A matrix product's T at an element of row factor r and column factor c: max(r c, 2**-149) tau (scale.Scale).
inline double product_threshold(double r, double c, double tau) {
  const double t = r * c;
  return (t < 0x1p-149 ? 0x1p-149 : t) * tau;
}

// Whether any element of the dense product out (M, N) lies within its T of an FP32 midpoint.
VECTOR_CLONES bool any_near_row(const double* row, double r, const double* cols, int64_t n, double tau, int tiny) {
  int any = 0;
  for (int64_t j = 0; j < n; ++j) any |= near_flag(row[j], product_threshold(r, cols[j], tau), tiny);
  return any != 0;
}

// The T of each element of an (M, 1) product (a sum in its terms' units: one row factor an element).
VECTOR_CLONES void column_thresholds(const double* rows, double col, double tau, int64_t m, double* out) {
  for (int64_t i = 0; i < m; ++i) out[i] = product_threshold(rows[i], col, tau);
}

// Whether any element of x (m) lies within its T of an FP32 midpoint.
VECTOR_CLONES bool any_near_each(const double* x, const double* t, int64_t m, int tiny) {
  int any = 0;
  for (int64_t i = 0; i < m; ++i) any |= near_flag(x[i], t[i], tiny);
  return any != 0;
}

bool any_near_product(const at::Tensor& out, const std::vector<double>& rows, const std::vector<double>& cols,
                      double tau, int tiny) {
  const int64_t m = out.size(0), n = out.size(1);
  const double* x = out.data_ptr<double>();
  if (n == 1) {  // one element a row: the rows side by side, in one vector pass
    std::vector<double> t(static_cast<size_t>(m));
    column_thresholds(rows.data(), cols[0], tau, m, t.data());
    return any_near_each(x, t.data(), m, tiny);
  }
  for (int64_t i = 0; i < m; ++i) {
    if (any_near_row(x + i * n, rows[static_cast<size_t>(i)], cols.data(), n, tau, tiny)) return true;
  }
  return false;
}

struct Layout {
  int64_t outer, channels, inner;
};

// kernel._layout with scaled = True: the channel of an output of rank >= 2 is dim 1, else one channel.
Layout channel_layout(const at::Tensor& dense) {
  if (dense.dim() >= 2) {
    const int64_t outer = dense.size(0), channels = dense.size(1);
    return {outer, channels, dense.numel() / (outer * channels)};
  }
  return {1, 1, dense.numel()};
}

// The unit of a matrix product's output (LOGGED_MM): row and column factors.
struct Unit {
  std::vector<double> rows, cols;
};

// rounding.near_midpoint's test for a logged op's dense output: at the element (ELEMENTWISE), at the
// product's unit (LOGGED_MM), or at its channel's scale (channel_layout); flags: Table::near_flags (a
// reduction's negative value that rounds to -0 takes part, rules revision 7; no NaN does, 16).
bool output_near(int route, const at::Tensor& dense, double tau, const Unit& unit, int flags) {
  const double* x = dense.data_ptr<double>();
  if (route == LOGGED) return any_near(x, dense.numel(), tau, flags);
  const int tiny = flags;
  if (route == LOGGED_MM) return any_near_product(dense, unit.rows, unit.cols, tau, tiny);
  const Layout l = channel_layout(dense);
  return any_near_channels(x, l.outer, l.channels, l.inner, tau, tiny);
}

// The kernel's entry buffers, kept per thread and reused: an op's pass starts with room for kFirstRoom
// entries of each kind, and an output with more grows them (as kernel.take_entries_ does).
constexpr Py_ssize_t kFirstRoom = 4096;

struct Found {
  std::vector<int64_t> kept, pinned, short_indices;
  std::vector<uint8_t> up;
  std::vector<float> pinned_values;
  std::vector<uint16_t> short_bits;

  // Room for (k, p, s) more entries after the first (k0, p0, s0), which are kept.
  DetrlEntries after(Py_ssize_t k0, Py_ssize_t p0, Py_ssize_t s0, Py_ssize_t k, Py_ssize_t p, Py_ssize_t s) {
    auto fit = [](auto& v, Py_ssize_t n) {
      if (static_cast<Py_ssize_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    };
    fit(kept, k0 + k), fit(up, k0 + k), fit(pinned, p0 + p), fit(pinned_values, p0 + p);
    fit(short_indices, s0 + s), fit(short_bits, s0 + s);
    return {kept.data() + k0, up.data() + k0, pinned.data() + p0, pinned_values.data() + p0,
            short_indices.data() + s0, short_bits.data() + s0, k, p, s, 0, 0, 0};
  }
};

thread_local Found found;

template <typename T, typename Stored = T>
py::array_t<T> array_of(const Stored* p, Py_ssize_t n) {
  static_assert(sizeof(T) == sizeof(Stored));
  py::array_t<T> a(n);
  if (n) std::memcpy(a.mutable_data(), p, static_cast<size_t>(n) * sizeof(T));
  return a;
}

// A running scan of a plain FP64 tensor for scale.exact_product_elements: its largest magnitude so far and
// the smallest exponent of a least significant set bit so far (scale._quantum: the largest power of two
// dividing every element is 2**lowest). The largest only grows and the quantum only shrinks as it goes.
struct Magnitudes {
  at::Tensor dense;
  const double* x = nullptr;
  int64_t n = 0, next = 0;
  double largest = 0.0;
  int lowest = std::numeric_limits<int>::max();
  bool valid = true;  // false once a value is off the FP32 grid or not finite

  explicit Magnitudes(const at::Tensor& t) {
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    dense = t.contiguous();
    x = dense.data_ptr<double>();
    n = dense.numel();
  }
  bool done() const { return next >= n || !valid; }
  // Scans up to `count` more elements.
  void scan(int64_t count) {
    const int64_t stop = std::min(n, next + count);
    for (; next < stop; ++next) {
      const double v = x[next];
      if (static_cast<double>(static_cast<float>(v)) != v || !std::isfinite(v)) {
        valid = false;
        return;
      }
      const double m = std::fabs(v);
      largest = m > largest ? m : largest;
      if (m == 0.0) continue;
      uint64_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      const int field = static_cast<int>((bits >> 52) & 0x7FF);
      const uint64_t mantissa = (bits & ((uint64_t{1} << 52) - 1)) | (field > 0 ? uint64_t{1} << 52 : 0);
      const int exponent = (field > 0 ? field - 1075 : -1074) + __builtin_ctzll(mantissa);
      lowest = exponent < lowest ? exponent : lowest;
    }
  }
  double quantum() const {
    return lowest == std::numeric_limits<int>::max() ? std::numeric_limits<double>::infinity()
                                                     : std::ldexp(1.0, lowest);
  }
};

// scale.exact_product_elements of an aten.convolution call (args: its 9 arguments): whether every partial
// sum of its products, in every order, is exact in FP64, with the same bound and FP64 operations. The
// scans stop early once the bound fails on what they have read: it fails on the whole tensors then too (a
// larger maximum, a smaller quantum), and most convolutions (24-bit activations) fail in their first block.
bool products_exact(const std::vector<c10::IValue>& args) {
  if (args.size() < 9 || !args[6].isBool() || args[6].toBool() || !args[8].isInt() || args[8].toInt() < 1) return false;
  auto plain = [](const c10::IValue& v) { return v.isTensor() && plain_double(v.toTensor()); };
  if (!plain(args[0]) || !plain(args[1])) return false;
  const at::Tensor& w = args[1].toTensor();
  if (w.dim() < 1 || w.size(0) == 0) return false;
  const bool has_bias = !args[2].isNone() && !(args[2].isTensor() && !args[2].toTensor().defined());
  if (has_bias && !plain(args[2])) return false;
  double terms = 1.0;
  for (int64_t d = 1; d < w.dim(); ++d) terms *= static_cast<double>(w.size(d));
  Magnitudes x(args[0].toTensor()), weight(w);
  std::unique_ptr<Magnitudes> bias;
  if (has_bias) bias = std::make_unique<Magnitudes>(args[2].toTensor());
  auto fails = [&]() {  // the bound on what has been read (monotone: it holds on less if on all)
    double q = x.quantum() * weight.quantum();
    double lb = 0.0;
    if (bias) q = std::min(q, bias->quantum()), lb = bias->largest;
    if (std::isinf(q)) return false;  // no nonzero product and no nonzero bias so far
    return !(terms * x.largest * weight.largest + lb <= 0x1p52 * q);
  };
  constexpr int64_t kBlock = 4096;
  while (!(x.done() && weight.done() && (!bias || bias->done()))) {
    x.scan(kBlock), weight.scan(kBlock);
    if (bias) bias->scan(kBlock);
    if (!x.valid || !weight.valid || (bias && !bias->valid) || fails()) return false;
  }
  return !fails();
}

// RoundingMode._round_logged's recording path for one dense FP64 output, with the kernel's pass as
// kernel.take_entries_ calls it: rounds it in place, and the op takes its position and its entries (if any).
// route: the call's (LOGGED, LOGGED_REDUCTION or LOGGED_MM); thresholds/rows: a matrix product's column and
// row factors (LOGGED_MM), else null.
// exact: where given, a flat 0/1 mask over the output (exact_sum_mask): entries at its elements are left out.
void take_entries(Step* step, const Entry& e, int route, double tau, at::Tensor& dense, const double* thresholds,
                  const double* rows, const uint8_t* exact = nullptr,
                  const std::vector<c10::IValue>* products = nullptr) {
  const DetrlKernelApi* api = step->kernel;
  const Py_ssize_t n = dense.numel();
  double* x = dense.data_ptr<double>();
  // A convolution exact in every order (rules revision 3) logs nothing: rounded without the near pass,
  // whose entries would all be left out (a first layer on pixel data lands on ties often, and its entries
  // cost more than this test, which stops in its first block on a convolution that is not exact).
  if (products != nullptr && products_exact(*products)) {
    round_dense(x, n);
    count_rounded(step, n);
    number_later(step, e.name);
    return;
  }
  Layout l{1, 1, n};
  std::vector<double> per_channel;
  if (route == LOGGED_MM && dense.size(1) == 1) {
    // an (M, 1) product (a sum in its terms' units) as one row of M channels, each element's T given: the
    // same T and entries in the same order, with the kernel's vector search along the row instead of a
    // scalar test per one-element row
    l = {1, dense.size(0), 1};
    per_channel.resize(static_cast<size_t>(n));
    column_thresholds(rows, thresholds[0], tau, n, per_channel.data());
    thresholds = per_channel.data(), rows = nullptr;
  } else if (route == LOGGED_EACH) {  // the same row of one-element channels, their T computed by the caller
    l = {1, n, 1};
  } else if (route == LOGGED_MM) {  // scale.Scale(outer=M, channels=N, inner=1, col, row)
    l = {dense.size(0), dense.size(1), 1};
  } else if (route == LOGGED_ROWS) {  // scale.Scale(outer=N*C, channels=1, inner=the rest, col=1, row)
    const int64_t outer = dense.size(0) * dense.size(1);
    l = {outer, 1, n / outer};
  } else if (route == LOGGED_REDUCTION) {  // at the output's channel scale
    l = channel_layout(dense);
    per_channel.resize(static_cast<size_t>(l.channels));
    if (api->channel_thresholds(x, l.outer, l.channels, l.inner, tau, per_channel.data()) != 0)
      throw std::bad_alloc();
    thresholds = per_channel.data();
  }
  const double c1 = tau * 0x1p-23, lo = tau * 0x1p-149, hi = tau * 0x1p104;
  auto pass = [&](Py_ssize_t start, DetrlEntries* out, DetrlEntries* counts) {
    return api->near_pass(x, l.outer, l.channels, l.inner, thresholds, rows, tau, c1, lo, hi,
                          step->table->near_flags(), start, out, counts);
  };
  const Py_ssize_t room = std::min(n, kFirstRoom);
  DetrlEntries out = found.after(0, 0, 0, room, room, room);
  const Py_ssize_t stop = pass(0, &out, nullptr);
  Py_ssize_t n_kept = out.n_kept, n_pinned = out.n_pinned, n_short = out.n_short;
  if (stop < n) {  // more entries than the first room: count the rest, then take them into grown buffers
    DetrlEntries more;
    pass(stop, nullptr, &more);
    DetrlEntries rest = found.after(n_kept, n_pinned, n_short, more.n_kept, more.n_pinned, more.n_short);
    TORCH_CHECK(pass(stop, &rest, nullptr) == n, "native dispatch: the kernel's second pass stopped early");
    n_kept += rest.n_kept, n_pinned += rest.n_pinned, n_short += rest.n_short;
  }
  if (exact != nullptr) {  // RoundingMode._round_logged's _without: every kind, order kept
    Py_ssize_t k = 0, p = 0, q = 0;
    for (Py_ssize_t i = 0; i < n_kept; ++i) {
      if (exact[found.kept[i]]) continue;
      found.kept[k] = found.kept[i], found.up[k++] = found.up[i];
    }
    for (Py_ssize_t i = 0; i < n_pinned; ++i) {
      if (exact[found.pinned[i]]) continue;
      found.pinned[p] = found.pinned[i], found.pinned_values[p++] = found.pinned_values[i];
    }
    for (Py_ssize_t i = 0; i < n_short; ++i) {
      if (exact[found.short_indices[i]]) continue;
      found.short_indices[q] = found.short_indices[i], found.short_bits[q++] = found.short_bits[i];
    }
    n_kept = k, n_pinned = p, n_short = q;
  }
  count_rounded(step, n);
  if (n_kept == 0 && n_pinned == 0 && n_short == 0) {
    number_later(step, e.name);
    return;
  }
  ++step->entry_ops;
  py::gil_scoped_acquire gil;
  flush_numbers(step);  // the ops before it take their positions first
  step->entries(e.name, array_of<int64_t>(found.kept.data(), n_kept), array_of<bool>(found.up.data(), n_kept),
                array_of<int64_t>(found.pinned.data(), n_pinned),
                array_of<float>(found.pinned_values.data(), n_pinned),
                array_of<int64_t>(found.short_indices.data(), n_short),
                array_of<uint16_t>(found.short_bits.data(), n_short));
}

// A matrix product's unit with the kernel: scale.reduction_scale's row factors of a and column factors of b
// (unit_factors of b's transpose, times 2**-23 terms_factor(K)).
void kernel_product_unit(const DetrlKernelApi* api, const Product& p, Unit& unit) {
  const int64_t m = p.a.size(0), k = p.a.size(1), n = p.b.size(1);
  const double terms = terms_factor(k);
  unit.rows.resize(static_cast<size_t>(m));
  unit.cols.resize(static_cast<size_t>(n));
  if (api->unit_factors(p.a.data_ptr<double>(), m, k, p.a.stride(0), p.a.stride(1), 1.0, unit.rows.data()) != 0 ||
      api->unit_factors(p.b.data_ptr<double>(), n, k, p.b.stride(1), p.b.stride(0), 0x1p-23 * terms,
                        unit.cols.data()) != 0)
    throw std::bad_alloc();
}

void to_python(Step* step, const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (step != nullptr) ++step->python_ops;
  auto local = c10::impl::tls_local_dispatch_key_set();
  c10::impl::ForceDispatchKeyGuard python_again(local.included_,
                                                local.excluded_.remove(c10::DispatchKey::Python).add(kOurs));
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Python) | (keys & kBelowOurs), stack);
}

// A sum of x over the dims reduced[d] marks: x's dims kept, then those summed, into order (a permutation
// that lays the terms of each sum out in a row); returns the terms each sum adds.
int64_t sum_order(const at::Tensor& x, const std::vector<bool>& reduced, std::vector<int64_t>& order) {
  int64_t terms = 1;
  order.clear();
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!reduced[static_cast<size_t>(d)]) order.push_back(d);
  }
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (reduced[static_cast<size_t>(d)]) order.push_back(d), terms *= x.size(d);
  }
  return terms;
}

// A tensor the kernel's passes can read through resolve_neg().contiguous(): a defined, strided FP64 CPU
// tensor that is no lazy conjugate and no zero tensor (which has no memory). A lazy negation may be.
bool kernel_readable(const at::Tensor& x) {
  return x.defined() && x.scalar_type() == c10::ScalarType::Double && x.layout() == c10::kStrided && x.is_cpu() &&
         !x.is_conj() && !x._is_zerotensor();
}

// Whether dims order[begin..end) of x (outer to inner) step through memory as one dim does: each one's
// stride is the next one's times its size (dims of size 1 aside). If so, stride is that dim's step (the
// innermost one's stride; 1 where every dim has size 1).
bool as_one_dim(const at::Tensor& x, const std::vector<int64_t>& order, int64_t begin, int64_t end, int64_t& stride) {
  stride = 1;
  int64_t next = -1;  // the stride the next dim outwards must have, once a dim of size > 1 was seen
  for (int64_t k = end - 1; k >= begin; --k) {
    const int64_t d = order[static_cast<size_t>(k)];
    if (x.size(d) == 1) continue;
    if (next < 0) {
      stride = x.stride(d);
    } else if (x.stride(d) != next) {
      return false;
    }
    next = x.stride(d) * x.size(d);
  }
  return true;
}

// scale.exact_sum_elements of an aten.sum.dim_IntList call (args: its positional arguments) whose output has
// out_elements, with the kernel's pass (exact_sums): 1 where the mask is written (1: an element every order
// computes exactly), 0 where the rule claims no element (no dims, terms off the FP32 grid), -1 where the
// mode decides (not a plain FP64 CPU tensor).
int exact_sum_mask(const DetrlKernelApi* api, const std::vector<c10::IValue>& args, int64_t out_elements,
                   std::vector<uint8_t>& mask) {
  if (args.empty() || !args[0].isTensor()) return -1;
  const at::Tensor& x = args[0].toTensor();
  if (!kernel_readable(x)) return -1;
  if (x.dim() == 0 || args.size() < 2 || !args[1].isIntList() || args[1].toIntList().empty()) return 0;
  const int64_t rank = x.dim();
  std::vector<bool> reduced(static_cast<size_t>(rank), false);
  for (int64_t d : args[1].toIntList()) reduced[static_cast<size_t>(((d % rank) + rank) % rank)] = true;
  std::vector<int64_t> order;
  const int64_t terms = sum_order(x, reduced, order);
  if (x.numel() == 0 || out_elements * terms != x.numel()) return 0;
  mask.resize(static_cast<size_t>(out_elements));
  // Read in place where the kept dims and the summed dims each step through memory as one dim (a matrix's
  // column sums: a bias gradient), else from a copy with the terms of each sum in a row. The rule reads
  // magnitudes only, so a lazy negation's memory gives the same mask.
  const auto kept = static_cast<int64_t>(std::count(reduced.begin(), reduced.end(), false));
  int64_t outer_stride = 1, term_stride = 1;
  if (as_one_dim(x, order, 0, kept, outer_stride) && as_one_dim(x, order, kept, rank, term_stride))
    return api->exact_sums(x.const_data_ptr<double>(), out_elements, terms, outer_stride, term_stride, mask.data());
  at::Tensor rows = x.permute(order).resolve_neg().contiguous();  // the terms of each sum in a row
  return api->exact_sums(rows.data_ptr<double>(), out_elements, terms, terms, 1, mask.data());
}

// scale.exact_sum_elements of an embedding's gradient (args: aten.embedding_dense_backward's grad_output,
// indices, num_weights, padding_idx, scale_grad_by_freq) with out_elements results, with the kernel: 1 with
// the mask written, 0 where the rule claims no element (not a plain sum, a term off the FP32 grid, an index
// outside the table), -1 where the mode decides (not a plain FP64 CPU tensor).
int exact_embedding_mask(const DetrlKernelApi* api, const std::vector<c10::IValue>& args, int64_t out_elements,
                         std::vector<uint8_t>& mask) {
  if (args.size() < 5 || !args[0].isTensor() || !args[1].isTensor()) return -1;
  const at::Tensor& grad = args[0].toTensor();
  const at::Tensor& indices = args[1].toTensor();
  if (!kernel_readable(grad) || !indices.defined() || !indices.is_cpu() || indices.layout() != c10::kStrided)
    return -1;
  if (!args[4].isBool() || args[4].toBool() || !args[2].isInt() || grad.dim() == 0) return 0;  // scaled by frequency
  const int64_t rows = args[2].toInt(), width = grad.size(-1);
  if (rows <= 0 || width == 0 || indices.numel() * width != grad.numel() || rows * width != out_elements) return 0;
  const at::Tensor dense = grad.resolve_neg().contiguous();
  const at::Tensor flat = indices.reshape({-1}).to(c10::ScalarType::Long).contiguous();
  mask.resize(static_cast<size_t>(out_elements));
  const int found = api->exact_embedding_sums(dense.data_ptr<double>(), flat.numel(), width,
                                              flat.data_ptr<int64_t>(), rows, mask.data());
  if (found < 0) throw std::bad_alloc();
  return found;
}

// The T of each element of GELU or an activation backward (rules revision 11, scale._gradient_scale): the
// unit of an (elements, 1) product whose row factor is the power of two at or below |x| there (x's exponent
// bits alone, the sign and mantissa cleared: scale._power_of_two, inf for inf and NaN) and whose column
// factor is scale.GRADIENT_UNIT, in one pass (product_threshold of those factors).
VECTOR_CLONES void first_argument_thresholds(const double* x, int64_t n, double tau, double* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint64_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    bits &= 0x7FF0000000000000ULL;
    double power;
    std::memcpy(&power, &bits, sizeof power);
    out[i] = product_threshold(power, 0x1p-19, tau);  // scale.GRADIENT_UNIT
  }
}

// The first argument of GELU or an activation backward whose result has sizes ``sizes``, where the kernel can
// read it in place; nullptr where it is not a contiguous FP64 CPU tensor of those sizes (the mode decides).
const double* first_argument(const std::vector<c10::IValue>& args, at::IntArrayRef sizes) {
  if (args.empty() || !args[0].isTensor()) return nullptr;
  const at::Tensor& x = args[0].toTensor();
  if (!kernel_readable(x) || x.sizes() != sizes || !x.is_contiguous() || x.is_neg() || x.numel() == 0) return nullptr;
  return x.const_data_ptr<double>();
}

// scale._terms_scale of a sum's or a mean's call (args: its positional arguments: the terms, then the dims
// where it has them) with out_elements results, with the kernel: per result, max(2**floor(log2(m)),
// 2**-149) of the largest |term| m whose FP32 rounding is finite (the kernel's unit_factors over the terms
// of each sum laid out in a row), and the column factor 2**-23 terms_factor(terms), for a mean divided by
// 2**floor(log2(terms)). False where the mode decides (not a plain FP64 CPU tensor).
bool terms_unit(const DetrlKernelApi* api, const std::vector<c10::IValue>& args, int64_t out_elements, bool mean,
                Unit& unit) {
  if (args.empty() || !args[0].isTensor()) return false;
  const at::Tensor& x = args[0].toTensor();
  if (!kernel_readable(x) || x.dim() == 0 || x.numel() == 0) return false;
  const int64_t rank = x.dim();
  std::vector<bool> reduced(static_cast<size_t>(rank), true);  // no dims (None or []): every dim
  if (args.size() >= 2 && args[1].isIntList() && !args[1].toIntList().empty()) {
    reduced.assign(static_cast<size_t>(rank), false);
    for (int64_t d : args[1].toIntList()) reduced[static_cast<size_t>(((d % rank) + rank) % rank)] = true;
  } else if (args.size() >= 2 && !args[1].isNone() && !args[1].isIntList()) {
    return false;
  }
  std::vector<int64_t> order;
  const int64_t terms = sum_order(x, reduced, order);
  if (terms == 0 || out_elements * terms != x.numel()) return false;
  const int log2_terms = 63 - __builtin_clzll(static_cast<unsigned long long>(terms));
  unit.cols.assign(1, std::ldexp(0x1p-23 * terms_factor(terms), mean ? -log2_terms : 0));
  unit.rows.assign(static_cast<size_t>(out_elements), 0.0);
  const bool dense = x.is_contiguous() && !x.is_neg();
  // the summed dims are the last ones (false, ..., true, ...): each sum's terms are a row of the buffer
  const bool trailing = dense && std::is_sorted(reduced.begin(), reduced.end());
  bool channels = dense && rank >= 2 && !reduced[1];  // a batch norm's channel sums: every dim but 1
  for (int64_t d = 0; d < rank; ++d) channels = channels && (d == 1 || reduced[static_cast<size_t>(d)]);
  // the summed dims are the first ones (true, ..., false, ...): the sums side by side, a row of terms each
  // step (a layer norm's weight and bias gradients, summed over the batch and the sequence)
  const bool leading = dense && std::is_sorted(reduced.begin(), reduced.end(), std::greater<bool>());
  const double* p = x.const_data_ptr<double>();
  if (trailing) {  // the kernel's pass over the rows in place
    if (api->unit_factors(p, out_elements, terms, terms, 1, 1.0, unit.rows.data()) != 0) throw std::bad_alloc();
    return true;
  }
  if (leading) {  // the kernel's pass reads the sums side by side, in place
    if (api->unit_factors(p, out_elements, terms, 1, out_elements, 1.0, unit.rows.data()) != 0)
      throw std::bad_alloc();
    return true;
  }
  if (channels) {  // (outer, channels, inner) in place: the kernel's pass over each sample's channel rows
    const int64_t outer = x.size(0), count = x.size(1), inner = x.numel() / (outer * count);
    if (inner == 1) {  // (outer, channels): a channel is a column, the kernel's pass reads them side by side
      // (a linear layer's bias gradient: per sample it was one pass per channel of one element, 65,536 calls
      // and 0.65 ms for a (512, 128) gradient whose sum takes 8 us)
      if (api->unit_factors(p, count, outer, 1, count, 1.0, unit.rows.data()) != 0) throw std::bad_alloc();
      return true;
    }
    std::vector<double> sample(static_cast<size_t>(count));
    for (int64_t o = 0; o < outer; ++o) {
      if (api->unit_factors(p + o * count * inner, count, inner, inner, 1, 1.0, sample.data()) != 0)
        throw std::bad_alloc();
      // a power of two (clamped) is monotone in its argument: the largest over samples is the whole sum's
      for (int64_t c = 0; c < count; ++c) {
        double& r = unit.rows[static_cast<size_t>(c)];
        r = std::max(r, sample[static_cast<size_t>(c)]);
      }
    }
    return true;
  }
  // Elsewhere the largest |term| of each sum from two reductions, without a copy of the terms: max(amax,
  // -amin), as scale.finite_amax takes it where every term is finite in FP32 (its common case).
  std::vector<int64_t> summed(order.end() - std::count(reduced.begin(), reduced.end(), true), order.end());
  const at::Tensor largest = at::maximum(at::amax(x, summed), at::neg(at::amin(x, summed))).contiguous();
  const double* m = largest.const_data_ptr<double>();
  bool finite = true;
  for (int64_t i = 0; i < out_elements && finite; ++i) {
    finite = m[i] < 0x1.ffffffp+127;  // rounds to a finite FP32 value (NaN fails too)
    const double power = power_of_two(m[i]);
    unit.rows[static_cast<size_t>(i)] = power < 0x1p-149 ? 0x1p-149 : power;
  }
  if (!finite) {  // an infinity or a NaN among the terms: the kernel's pass, which leaves them out
    at::Tensor rows = x.permute(order).resolve_neg().contiguous();  // the terms of each sum in a row
    if (api->unit_factors(rows.data_ptr<double>(), out_elements, terms, terms, 1, 1.0, unit.rows.data()) != 0)
      throw std::bad_alloc();
  }
  return true;
}

// A logged op's FP64 outputs (written arguments, else outputs), rounded as logged, each taking an op
// position. With the C kernel: all here, log entries included (device tensors go to the Python mode).
// Without it: here when no element of any is near a midpoint, else by the mode, as are large outputs (the
// mode's torch reference is vectorised) and units with an infinite factor. A LOGGED_SUM (sum_inputs: the
// call's arguments) is rounded as a LOGGED_REDUCTION where no element is near; else its entries leave out
// the elements every order computes exactly (scale.exact_sum_elements): found here for a plain CPU sum
// with the kernel (exact_sum_mask), else by the mode, which gets the terms.
// An input gradient of a convolution_backward call (args: its positional arguments), as
// scale._sample_channel_scale tells one: rank >= 3, the shape of the input and not of the weight.
bool input_gradient(const std::vector<c10::IValue>& args, const at::Tensor& t) {
  if (args.size() < 3 || !args[1].isTensor() || !args[2].isTensor() || t.dim() < 3 || t.numel() == 0) return false;
  return t.sizes() == args[1].toTensor().sizes() && t.sizes() != args[2].toTensor().sizes();
}

// _sample_channel_scale's row factors of a dense (N, C, ...) input gradient: clamp(2**floor(log2(max|row|))
// 2**-23, 2**-149) per sample and channel (infinite for a row with a NaN or an infinity), from the kernel's
// unit_factors (max(that power of two, 2**-149)), which the clamp then gives exactly.
void input_gradient_rows(const DetrlKernelApi* api, const at::Tensor& dense, std::vector<double>& rows) {
  const int64_t outer = dense.size(0) * dense.size(1), inner = dense.numel() / outer;
  rows.resize(static_cast<size_t>(outer));
  if (api->unit_factors(dense.const_data_ptr<double>(), outer, inner, inner, 1, 1.0, rows.data()) != 0)
    throw std::bad_alloc();
  for (double& r : rows) r = r >= 0x1p-126 ? r * 0x1p-23 : 0x1p-149;
}

// scale._channel_spacing: each channel's (dim 1) FP32 spacing at its largest finite magnitude, the kernel's
// channel thresholds at tau 1 (a contiguous FP64 CPU tensor; of rank 1, the whole tensor's, one value).
std::vector<double> channel_spacing(const DetrlKernelApi* api, const at::Tensor& t) {
  if (t.numel() == 0) return std::vector<double>(static_cast<size_t>(t.dim() >= 2 ? t.size(1) : 1), 0x1p-149);
  const Layout l = channel_layout(t);
  std::vector<double> out(static_cast<size_t>(l.channels));
  if (api->channel_thresholds(t.const_data_ptr<double>(), l.outer, l.channels, l.inner, 1.0, out.data()) != 0)
    throw std::bad_alloc();
  return out;
}

// unit_factors of each row of a contiguous FP64 CPU tensor viewed as (rows, the rest), times `times`.
std::vector<double> row_factors(const DetrlKernelApi* api, const at::Tensor& t, int64_t rows, double times) {
  std::vector<double> out(static_cast<size_t>(rows));
  const int64_t cols = t.numel() / rows;
  if (api->unit_factors(t.const_data_ptr<double>(), rows, cols, cols, 1, times, out.data()) != 0)
    throw std::bad_alloc();
  return out;
}

// scale._conv_terms_scale's row factors of one gradient `out` (dense) of a convolution_backward call (args:
// its positional arguments), with the kernel: false where the mode computes them (arguments that are not
// contiguous FP64 CPU tensors, shapes that do not tell the gradients apart). The same products of powers of
// two in the same order, so the same bits.
bool conv_terms_rows(const DetrlKernelApi* api, const std::vector<c10::IValue>& args, const at::Tensor& out,
                     std::vector<double>& rows) {
  if (args.size() < 10 || !args[7].isBool() || !args[9].isInt()) return false;
  for (size_t i = 0; i < 3; ++i) {
    if (!args[i].isTensor()) return false;
    const at::Tensor& t = args[i].toTensor();
    if (!t.defined() || t.scalar_type() != c10::ScalarType::Double || !plain_cpu(t) || !t.is_contiguous())
      return false;
  }
  const at::Tensor& grad = args[0].toTensor();
  const at::Tensor& x = args[1].toTensor();
  const at::Tensor& w = args[2].toTensor();
  const bool transposed = args[7].toBool();
  const int64_t groups = args[9].toInt();
  const int64_t rank = grad.dim();
  if (rank < 3 || x.dim() != rank || w.dim() != rank || out.numel() == 0 || groups < 1) return false;
  int64_t kernel = 1;
  for (int64_t d = 2; d < rank; ++d) kernel *= w.size(d);
  const int64_t c_out = transposed ? w.size(1) * groups : w.size(0);
  if (grad.size(1) != c_out || x.size(1) != (transposed ? w.size(0) : w.size(1) * groups)) return false;
  auto positions = [rank](const at::Tensor& t) {
    int64_t n = 1;
    for (int64_t d = 2; d < rank; ++d) n *= t.size(d);
    return n;
  };
  if (out.sizes() == x.sizes() && out.sizes() != w.sizes()) {  // the input gradient
    std::vector<double> own;
    input_gradient_rows(api, out, own);
    const int64_t n = x.size(0), c_in = x.size(1);
    std::vector<double> per_channel;
    if (transposed) {
      per_channel = row_factors(api, w, w.size(0), 0x1p-23);
    } else {
      const std::vector<double> local = channel_spacing(api, w);
      for (int64_t g = 0; g < groups; ++g) per_channel.insert(per_channel.end(), local.begin(), local.end());
    }
    const std::vector<double> per_sample =
        row_factors(api, grad, n, terms_factor(std::max<int64_t>(c_out / groups * kernel, 1)));
    rows.resize(static_cast<size_t>(n * c_in));
    for (int64_t s = 0; s < n; ++s) {
      for (int64_t i = 0; i < c_in; ++i) {
        const size_t at = static_cast<size_t>(s * c_in + i);
        rows[at] = std::max(per_sample[static_cast<size_t>(s)] * per_channel[static_cast<size_t>(i)], own[at]);
      }
    }
  } else if (out.sizes() == w.sizes() && out.sizes() != x.sizes()) {  // the weight gradient
    const at::Tensor& by_rows = transposed ? x : grad;
    const at::Tensor& by_cols = transposed ? grad : x;
    const int64_t terms = x.size(0) * positions(transposed ? x : grad);
    const int64_t local = w.size(1);
    const std::vector<double> all_cols = channel_spacing(api, by_cols);
    std::vector<double> per_col(all_cols.begin(), all_cols.begin() + local);
    for (int64_t g = 1; g < groups; ++g) {
      for (int64_t j = 0; j < local; ++j)
        per_col[static_cast<size_t>(j)] = std::max(per_col[static_cast<size_t>(j)], all_cols[static_cast<size_t>(g * local + j)]);
    }
    std::vector<double> per_row = channel_spacing(api, by_rows);
    const double times = 0x1p23 * terms_factor(std::max<int64_t>(terms, 1));
    for (double& r : per_row) r *= times;
    const std::vector<double> own = channel_spacing(api, out);
    rows.resize(static_cast<size_t>(w.size(0) * local));
    for (int64_t o = 0; o < w.size(0); ++o) {
      for (int64_t j = 0; j < local; ++j) {
        rows[static_cast<size_t>(o * local + j)] =
            std::max(per_row[static_cast<size_t>(o)] * per_col[static_cast<size_t>(j)], own[static_cast<size_t>(j)]);
      }
    }
  } else if (out.dim() == 1 && out.size(0) == c_out) {  // the bias gradient: grad_output summed per channel
    const int64_t terms = grad.size(0) * positions(grad);
    rows = channel_spacing(api, grad);
    const double times = terms_factor(std::max<int64_t>(terms, 1));
    const std::vector<double> own = channel_spacing(api, out);  // of rank 1: the whole tensor's
    for (double& r : rows) r = std::max(r * times, own[0]);
  } else {
    return false;
  }
  for (double& r : rows) r = std::max(r, 0x1p-149);
  return true;
}

void round_logged(Step* step, const Entry& e, int route, const Taus& taus, std::vector<at::Tensor>& targets,
                  const Product* product, const std::vector<c10::IValue>* sum_inputs,
                  const std::vector<c10::IValue>* products = nullptr) {
  // the k-th rounded output's threshold: its own (rules revision 4), else the call's one
  auto tau_of = [&taus](size_t k) { return taus[std::min(k, taus.size() - 1)]; };
  std::vector<at::Tensor> dense;  // each rounded output, contiguous (itself, or a copy written back)
  Unit unit;
  int64_t total = 0;
  for (const auto& t : targets) total += t.defined() ? t.numel() : 0;
  const bool conv = route == LOGGED_CONV || route == LOGGED_CONV_TERMS;
  bool to_mode = step->kernel == nullptr && (total > kLargeOutput || conv);
  // An elementwise op's one strided output (an in-place op on a view): tested and rounded in place, run by
  // run, where no element is near a midpoint; else through a dense copy, as any output.
  Runs runs;
  if (!to_mode && route == LOGGED && targets.size() == 1 && rounded_output(targets[0]) && plain_cpu(targets[0]) &&
      !targets[0].is_contiguous() && runs_of(targets[0], runs)) {
    const double* p = targets[0].const_data_ptr<double>();
    bool near = false;
    for (const int64_t start : runs.starts)
      near = near || any_near(p + start, runs.run, tau_of(0), step->table->near_flags());
    if (!near) {
      round_runs(targets[0], runs);
      count_rounded(step, targets[0].numel());
      number_later(step, e.name);
      return;
    }
  }
  if (!to_mode) {
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    for (const auto& t : targets) {
      if (!rounded_output(t)) continue;
      if (!plain_cpu(t)) {
        to_mode = true;  // a device tensor: the mode's path
        break;
      }
      dense.push_back(t.contiguous());
    }
  }
  if (!to_mode && product != nullptr) {
    if (step->kernel != nullptr) {
      kernel_product_unit(step->kernel, *product, unit);
    } else {
      to_mode = !product_unit(*product, unit.rows, unit.cols);
    }
  }
  if (route == LOGGED_SUM) route = LOGGED_REDUCTION;  // its unit, here
  // a sum in its terms' units (rules revision 5), or GELU or an activation backward in its first argument's
  // (revision 11): an (elements, 1) product's unit, with the kernel
  const bool by_first = route == LOGGED_BY_FIRST;
  const bool by_terms = route == LOGGED_TERMS || by_first;
  const double* first = nullptr;  // the first argument each element's T comes from (by_first)
  if (by_terms) {
    route = LOGGED_MM;
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);  // its own torch ops are not the step's
    to_mode = to_mode || step->kernel == nullptr || dense.size() != 1;
    if (!to_mode && by_first) first = first_argument(*sum_inputs, dense[0].sizes());
    to_mode = to_mode || (by_first ? first == nullptr
                                   : !terms_unit(step->kernel, *sum_inputs, dense[0].numel(), e.mean, unit));
  }
  // as the product it is measured as: (elements, 1)
  auto as_measured = [by_terms](const at::Tensor& d) {
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);  // a view of ours, not an op of the step
    return by_terms ? d.view({-1, 1}) : d;
  };
  std::vector<uint8_t> exact;  // a sum's exact elements, where the kernel found them (exact_sum_mask)
  bool masked = false;
  // a convolution's gradients in their terms' units (rules revision 6): each output's row factors
  std::vector<std::vector<double>> conv_rows;
  if (!to_mode && route == LOGGED_CONV_TERMS) {
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    for (const auto& d : dense) {
      conv_rows.emplace_back();
      if (!conv_terms_rows(step->kernel, *sum_inputs, d, conv_rows.back())) {
        to_mode = true;  // arguments the kernel cannot read in place: the mode computes the unit
        break;
      }
    }
  }
  // (a sum's near element may be exact in every order, which the mode leaves out where the kernel cannot find
  // it; an op measured in its first argument's units has no such elements: the kernel takes its entries)
  if (!to_mode && !conv && (step->kernel == nullptr || (sum_inputs != nullptr && !by_first))) {
    for (size_t k = 0; k < dense.size(); ++k) {
      if (output_near(route, as_measured(dense[k]), tau_of(k), unit, step->table->near_flags())) {
        to_mode = true;
        break;
      }
    }
    // A near element of a plain sum or an embedding's gradient: its exact elements found here, with the
    // kernel, and their entries left out as the mode leaves them out.
    if (to_mode && step->kernel != nullptr && (e.sum_dims || e.embedding) && dense.size() == 1) {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      const int found_mask = e.embedding ? exact_embedding_mask(step->kernel, *sum_inputs, dense[0].numel(), exact)
                                         : exact_sum_mask(step->kernel, *sum_inputs, dense[0].numel(), exact);
      to_mode = found_mask < 0;
      masked = found_mask > 0;
    }
  }
  if (!to_mode) {
    size_t k = 0;
    for (const auto& t : targets) {
      if (!rounded_output(t)) continue;
      const double tau = tau_of(k);
      at::Tensor& d = dense[k++];
      if (route == LOGGED_CONV_TERMS) {  // row factors over (outer, 1, inner); a bias gradient as (C_out, 1)
        const double col = 1.0;
        at::Tensor rows_view = d;
        if (d.dim() == 1) {
          c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);  // a view of ours, not an op of the step
          rows_view = d.view({-1, 1});
        }
        take_entries(step, e, LOGGED_ROWS, tau, rows_view, &col, conv_rows[k - 1].data());
      } else if (route == LOGGED_CONV) {  // with the kernel (to_mode without it)
        if (input_gradient(*sum_inputs, t)) {
          input_gradient_rows(step->kernel, d, unit.rows);
          const double col = 1.0;
          take_entries(step, e, LOGGED_ROWS, tau, d, &col, unit.rows.data());
        } else {
          take_entries(step, e, LOGGED_REDUCTION, tau, d, nullptr, nullptr);
        }
      } else if (first != nullptr) {  // each T from the first argument, in one pass (no row factors kept)
        std::vector<double> each(static_cast<size_t>(d.numel()));
        first_argument_thresholds(first, d.numel(), tau, each.data());
        take_entries(step, e, LOGGED_EACH, tau, d, each.data(), nullptr);
      } else if (step->kernel != nullptr) {
        at::Tensor measured = as_measured(d);
        const bool factors = product != nullptr || by_terms;
        take_entries(step, e, route, tau, measured, factors ? unit.cols.data() : nullptr,
                     factors ? unit.rows.data() : nullptr, masked ? exact.data() : nullptr, products);
      } else {
        round_dense(d.data_ptr<double>(), d.numel());
        count_rounded(step, t.numel());
        number_later(step, e.name);
      }
      if (!d.is_same(t)) {
        c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
        t.copy_(d);
      }
    }
    return;
  }
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);  // as inside the mode's handler
  py::gil_scoped_acquire gil;
  py::tuple args;  // what the op's unit or its exact elements need
  if (product != nullptr) {
    args = py::make_tuple(product->a, product->b);
  } else if (sum_inputs != nullptr || products != nullptr) {  // a sum's terms; a convolution's arguments
    const auto& inputs = sum_inputs != nullptr ? *sum_inputs : *products;
    args = py::tuple(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) args[i] = torch::jit::toPyObject(inputs[i]);
  }
  size_t k = 0;
  for (const auto& t : targets) {
    if (!rounded_output(t)) continue;
    step->round_logged(e.func, route == LOGGED, t, args, tau_of(k++));
  }
}

// Appends a description of one argument to a call key; false for one it cannot describe (a sparse
// tensor, a complex or symbolic number, an object): then the call is not cached.
bool describe(std::string& key, const c10::IValue& v) {
  auto put = [&key](const void* p, size_t n) { key.append(static_cast<const char*>(p), n); };
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (!t.defined()) return key.push_back('u'), true;
    if (t.layout() != c10::kStrided) return false;
    key.push_back('T');
    const int8_t dtype = static_cast<int8_t>(t.scalar_type());
    const int64_t dim = t.dim();
    put(&dtype, 1);
    put(&dim, 8);
    put(t.sizes().data(), 8 * dim);
    put(t.strides().data(), 8 * dim);
    return true;
  }
  if (v.isNone()) return key.push_back('N'), true;
  if (v.isBool()) return key.push_back(v.toBool() ? 'B' : 'b'), true;
  if (v.isInt()) {
    const int64_t i = v.toInt();
    key.push_back('i');
    put(&i, 8);
    return true;
  }
  if (v.isDouble()) {
    const double d = v.toDouble();
    key.push_back('d');
    put(&d, 8);
    return true;
  }
  if (v.isString()) {
    const auto& str = v.toStringRef();
    const int64_t n = static_cast<int64_t>(str.size());
    key.push_back('s');
    put(&n, 8);
    key.append(str);
    return true;
  }
  if (v.isDevice()) {
    key.push_back('D');
    key.append(v.toDevice().str());
    key.push_back(';');
    return true;
  }
  if (v.isList() || v.isTensorList() || v.isOptionalTensorList() || v.isIntList() || v.isDoubleList() ||
      v.isBoolList()) {
    const auto& items = v.toListRef();
    const int64_t n = static_cast<int64_t>(items.size());
    key.push_back('L');
    put(&n, 8);
    for (const auto& item : items) {
      if (!describe(key, item)) return false;
    }
    return true;
  }
  return false;
}

// The call's key (empty where an argument cannot be described).
std::string call_key(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first, size_t n_args) {
  std::string key;
  const void* id = &op.schema();
  key.append(reinterpret_cast<const char*>(&id), sizeof id);
  for (size_t i = 0; i < n_args; ++i) {
    if (!describe(key, stack[first + i])) return std::string();
  }
  return key;
}

// A calibration step's logged call the calibrator may measure: to the mode, learning whether it declined.
void to_python_learning(Step* step, const std::string& key, const c10::OperatorHandle& op,
                        c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  std::pair<int64_t, int64_t> before;
  if (!key.empty()) {
    py::gil_scoped_acquire gil;
    before = step->tally().cast<std::pair<int64_t, int64_t>>();
  }
  to_python(step, op, keys, stack);
  if (key.empty()) return;
  py::gil_scoped_acquire gil;
  auto after = step->tally().cast<std::pair<int64_t, int64_t>>();
  py::object learned = step->learned();
  // exactly one call counted, and declined: this one
  if (after.first == before.first + 1 && after.second == before.second + 1) {
    Taus taus{std::numeric_limits<double>::quiet_NaN()};
    if (!learned.is_none()) {
      auto r = learned.cast<std::pair<Taus, bool>>();
      if (r.second && !r.first.empty()) taus = r.first;
    }
    step->declined->keys.emplace(key, taus);
  }
}

// A classed op's call whose threshold the table has not learned: to the mode, learning it.
void to_python_classed(Step* step, const std::string& key, const c10::OperatorHandle& op,
                       c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  to_python(step, op, keys, stack);
  py::gil_scoped_acquire gil;
  py::object learned = step->learned();
  if (!learned.is_none()) {
    Taus taus = learned.cast<std::pair<Taus, bool>>().first;
    if (!taus.empty()) step->table->class_taus.emplace(key, std::move(taus));
  }
}

// fused.py's split rules: the step to add to self, from separate correctly rounded IEEE operations.
// Returns false where a factor is not a plain number (the Python mode decides).
bool split_step(int route, const torch::jit::Stack& s, size_t f, at::Tensor& step) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  auto scaled = [](const at::Tensor& t, const c10::IValue& factor, at::Tensor& out) {
    int one = is_one(factor);
    if (one < 0) return false;
    out = one ? t : at::mul(t, factor.toScalar());
    return true;
  };
  switch (route) {
    case SPLIT_ADD:  // self + (alpha * other)
      return scaled(s[f + 1].toTensor(), s[f + 2], step);
    case SPLIT_SUB:  // self + (-(alpha * other))
      if (!scaled(s[f + 1].toTensor(), s[f + 2], step)) return false;
      step = at::neg(step);
      return true;
    case SPLIT_ADDCMUL:  // self + ((t1 * t2) * value)
      return scaled(at::mul(s[f + 1].toTensor(), s[f + 2].toTensor()), s[f + 3], step);
    case SPLIT_ADDCDIV:  // self + ((t1 / t2) * value)
      return scaled(at::div(s[f + 1].toTensor(), s[f + 2].toTensor()), s[f + 3], step);
    case SPLIT_LERP: {  // self + ((end - self) * weight)
      at::Tensor d = at::sub(s[f + 1].toTensor(), s[f].toTensor());
      step = s[f + 2].isTensor() ? at::mul(d, s[f + 2].toTensor()) : at::mul(d, s[f + 2].toScalar());
      return true;
    }
  }
  return false;
}

// A split op in one pass, where its operands allow: dense FP64 CPU tensors of one shape (a tensor weight of
// that shape or 0-dim), numbers that are ints or floats, an operand that shares self's memory only as self
// itself. Each element takes split_step's IEEE steps and self's add, then the rounding to the FP32 grid
// (round_exact), with no contraction into FMA (build flags): the same values as those calls with a dispatch
// each (a CPU list op's loop calls the per-tensor op for each of its tensors: a per-tensor Adam's lerp,
// addcmul and addcdiv). The same bits too, except a NaN's sign and payload, which IEEE leaves to the order
// of the operands (the compiler may write x + -y as x - y): a first pass, which writes nothing, looks for a
// NaN among the results, and an op with one takes the dispatched calls instead (two passes over the
// operands, no scratch memory: GPT-2's token embedding is 39M elements). Returns the written tensor, or an
// undefined one where it did not apply.
struct OnePass {
  const double* a = nullptr;  // the operand(s) of the step
  const double* b = nullptr;
  double number = 1.0;              // alpha, value or the weight
  const double* weights = nullptr;  // lerp's tensor weight, per element
  bool scale = false;  // multiply by number (not a number of exactly 1, as split_step's `scaled`)
};

// One element's unrounded result.
template <int Route>
inline double one_pass_result(const double* self, int64_t i, const OnePass& p) {
  double step;
  if constexpr (Route == SPLIT_ADD || Route == SPLIT_SUB) {
    step = p.a[i] * p.number;  // alpha != 1: alpha one is not split
    if constexpr (Route == SPLIT_SUB) step = -step;
  } else if constexpr (Route == SPLIT_ADDCMUL || Route == SPLIT_ADDCDIV) {
    step = Route == SPLIT_ADDCMUL ? p.a[i] * p.b[i] : p.a[i] / p.b[i];
    if (p.scale) step = step * p.number;
  } else {  // SPLIT_LERP
    step = (p.a[i] - self[i]) * (p.weights ? p.weights[i] : p.number);
  }
  return self[i] + step;
}

// Whether any result is NaN (nothing written: a NaN sends the op to the dispatched calls, self untouched).
template <int Route>
VECTOR_CLONES bool one_pass_nan(const double* self, int64_t n, OnePass p) {
  int nan = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = one_pass_result<Route>(self, i, p);
    nan |= r != r;
  }
  return nan != 0;
}

// The results, rounded to the FP32 grid, into out (self itself, in place).
template <int Route>
VECTOR_CLONES void one_pass_write(const double* self, double* out, int64_t n, OnePass p) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(one_pass_result<Route>(self, i, p)));
}

template <int Route>
bool one_pass(const at::Tensor& self, bool in_place, const OnePass& p, at::Tensor& out) {
  const double* x = self.const_data_ptr<double>();
  const int64_t n = self.numel();
  if (one_pass_nan<Route>(x, n, p)) return false;
  if (in_place) {
    out = self;
  } else {
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    out = at::empty_like(self, at::MemoryFormat::Contiguous);
  }
  one_pass_write<Route>(x, out.data_ptr<double>(), n, p);
  return true;
}

at::Tensor split_in_one_pass(int route, bool in_place, const torch::jit::Stack& s, size_t f) {
  const c10::IValue& first = s[f];
  if (!first.isTensor()) return {};
  const at::Tensor& self = first.toTensor();
  auto dense = [&self](const c10::IValue& v) {
    if (!v.isTensor()) return false;
    const at::Tensor& t = v.toTensor();
    return t.defined() && t.scalar_type() == c10::ScalarType::Double && plain_cpu(t) && t.is_contiguous() &&
           t.layout() == c10::kStrided && !t._is_zerotensor() && t.sizes() == self.sizes() &&
           (!t.is_alias_of(self) || (t.data_ptr() == self.data_ptr() && t.strides() == self.strides()));
  };
  auto number = [](const c10::IValue& v, double& out) {
    if (v.isDouble()) return out = v.toDouble(), true;
    if (v.isInt()) return out = static_cast<double>(v.toInt()), true;
    return false;
  };
  if (!dense(first)) return {};
  OnePass p;
  switch (route) {
    case SPLIT_ADD:
    case SPLIT_SUB:
      if (!dense(s[f + 1]) || !number(s[f + 2], p.number)) return {};
      p.a = s[f + 1].toTensor().const_data_ptr<double>();
      break;
    case SPLIT_ADDCMUL:
    case SPLIT_ADDCDIV:
      if (!dense(s[f + 1]) || !dense(s[f + 2]) || !number(s[f + 3], p.number)) return {};
      p.a = s[f + 1].toTensor().const_data_ptr<double>();
      p.b = s[f + 2].toTensor().const_data_ptr<double>();
      p.scale = is_one(s[f + 3]) != 1;
      break;
    case SPLIT_LERP:
      if (!dense(s[f + 1])) return {};
      p.a = s[f + 1].toTensor().const_data_ptr<double>();
      if (dense(s[f + 2])) {
        p.weights = s[f + 2].toTensor().const_data_ptr<double>();
      } else if (s[f + 2].isTensor()) {
        const at::Tensor& w = s[f + 2].toTensor();  // a 0-dim weight multiplies every element alike
        if (!w.defined() || w.dim() != 0 || w.scalar_type() != c10::ScalarType::Double || !plain_cpu(w))
          return {};
        p.number = *w.const_data_ptr<double>();
      } else if (!number(s[f + 2], p.number)) {
        return {};
      }
      break;
    default:
      return {};
  }
  at::Tensor out;
  bool done;
  switch (route) {
    case SPLIT_ADD: done = one_pass<SPLIT_ADD>(self, in_place, p, out); break;
    case SPLIT_SUB: done = one_pass<SPLIT_SUB>(self, in_place, p, out); break;
    case SPLIT_ADDCMUL: done = one_pass<SPLIT_ADDCMUL>(self, in_place, p, out); break;
    case SPLIT_ADDCDIV: done = one_pass<SPLIT_ADDCDIV>(self, in_place, p, out); break;
    default: done = one_pass<SPLIT_LERP>(self, in_place, p, out); break;
  }
  if (!done) return {};
  return out;
}

// A decomposition written out here: inside it, RoundingMode._nested and this step's depth are one deeper
// (what RoundingMode._nested_op and nest do around each of its steps in the mode).
struct Decomposing {
  Step* step;
  explicit Decomposing(Step* s) : step(s) {
    py::gil_scoped_acquire gil;
    step->nesting(1);
    ++step->nested;
  }
  ~Decomposing() {
    --step->nested;
    try {
      py::gil_scoped_acquire gil;
      step->nesting(-1);
    } catch (...) {  // a destructor must not throw; the mode's depth is reset when its step ends
    }
  }
};

// An optional tensor argument: undefined (None), or a plain FP64 CPU tensor; false for anything else.
bool optional_double(const c10::IValue& v, at::Tensor& out) {
  if (v.isNone()) return true;
  if (!v.isTensor()) return false;
  out = v.toTensor();
  return !out.defined() || plain_double(out);
}

// A Python number in an op's arguments, as torch's Python binding passes it (a wrapped 0-dim tensor): the
// decompositions' `x / n`, `x + eps`, `x * momentum`.
at::Tensor wrapped(double v) {
  at::Tensor t = c10::scalar_to_tensor(v);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}
at::Tensor wrapped(int64_t v) {
  at::Tensor t = c10::scalar_to_tensor(v);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// sqrt of a plain FP64 CPU tensor, correctly rounded: std::sqrt per element (the processor's instruction).
// at::sqrt is not, in MKL builds: a vector library's root, within an ulp but off the nearest double in about
// 1 % of elements; a variance's root reaches every normalised element (decompose.Steps.sqrt, rules revision 10).
at::Tensor ieee_sqrt(const at::Tensor& t) {
  at::Tensor out = t.clone(at::MemoryFormat::Contiguous);  // one copy, dense
  double* p = out.data_ptr<double>();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) p[i] = std::sqrt(p[i]);
  return out;
}

// decompose.channels for x (N, C, *S): the dims a channel sums over, its broadcast shape, its terms.
struct Channels {
  std::vector<int64_t> dims, shape;
  int64_t n;
};
Channels channels(const at::Tensor& x) {
  Channels c{{0}, {1, -1}, x.numel() / x.size(1)};
  for (int64_t d = 2; d < x.dim(); ++d) c.dims.push_back(d), c.shape.push_back(1);
  return c;
}

// decompose.batch_norm: (out, mean, invstd), running statistics updated in place. The sums are ops of the
// step (dispatched: this fallback takes them); the rest is plain FP64 below this key, the same torch ops as
// the Python formula's, in its order. args: native_batch_norm's.
std::vector<at::Tensor> batch_norm(Step* step, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                   const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
                                   double eps) {
  const Channels c = channels(x);
  at::Tensor mean, centred, squares, var, invstd, out;
  {
    Decomposing inside(step);
    at::Tensor total = at::sum(x, c.dims);
    {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      mean = at::div(total, wrapped(c.n));
      centred = at::sub(x, mean.view(c.shape));
      squares = at::mul(centred, centred);
    }
    at::Tensor spread = at::sum(squares, c.dims);
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    var = at::div(spread, wrapped(c.n));
    invstd = at::mul(at::reciprocal(ieee_sqrt(at::add(var, wrapped(eps)))), wrapped(1.0));  // 1.0 / t: __rdiv__
    out = centred.mul_(invstd.view(c.shape));
    if (weight.defined()) out.mul_(weight.view(c.shape));
    if (bias.defined()) out.add_(bias.view(c.shape));
    if (running_mean.defined() && running_var.defined()) {
      running_mean.mul_(wrapped(1 - momentum)).add_(at::mul(mean, wrapped(momentum)));
      const double unbiased = static_cast<double>(c.n) / static_cast<double>(std::max<int64_t>(c.n - 1, 1));
      running_var.mul_(wrapped(1 - momentum)).add_(at::mul(at::mul(var, wrapped(unbiased)), wrapped(momentum)));
    }
  }
  return {out, mean, invstd};
}

// The element passes of a decomposition written out as loops, where its tensors are dense: each element
// takes the same IEEE operations in the same order as the torch ops they replace (no FMA contraction:
// -ffp-contract=off), so the same bits, in one pass over memory instead of one per op and its temporary.

// A dense FP64 CPU tensor of n elements (a per-channel or per-row vector, an activation).
bool dense_double(const at::Tensor& t, int64_t n) { return plain_double(t) && t.is_contiguous() && t.numel() == n; }

// h = (x - m) * s; with wx: a = g * w (g alone without w), wx = a * h, and gw = a where gw is given; with p:
// p = g * h. Batch norm backward's xhat and grad_out * xhat (a channel); layer norm backward's xhat, its
// weighted incoming gradient, their product and grad_out * xhat (a row).
VECTOR_CLONES void centred_terms(const double* __restrict__ x, const double* __restrict__ g,
                                 const double* __restrict__ w, double m, double s, double* __restrict__ h,
                                 double* __restrict__ gw, double* __restrict__ wx, double* __restrict__ p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double hx = (x[i] - m) * s;
    h[i] = hx;
    if (wx != nullptr) {
      const double a = w != nullptr ? g[i] * w[i] : g[i];
      if (gw != nullptr) gw[i] = a;
      wx[i] = a * hx;
    }
    if (p != nullptr) p[i] = g[i] * hx;
  }
}

// out = ((g - a) - h * b) * s (batch norm's and layer norm's backward input gradient, a channel or a row).
VECTOR_CLONES void norm_input_gradient(const double* __restrict__ g, const double* __restrict__ h, double a,
                                       double b, double s, double* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = ((g[i] - a) - h[i] * b) * s;
}

// batch_norm_backward's first pass over dense (N, C, *S) x and grad_out, per-channel mean and invstd:
// (xhat, grad_out * xhat), as at::sub(x, mean).mul_(invstd) and at::mul(grad_out, xhat).
std::pair<at::Tensor, at::Tensor> batch_norm_centred(const at::Tensor& x, const at::Tensor& g, const at::Tensor& mean,
                                                     const at::Tensor& invstd) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const Layout l = channel_layout(x);
  at::Tensor xhat = at::empty_like(x), product = at::empty_like(x);
  const double *px = x.const_data_ptr<double>(), *pg = g.const_data_ptr<double>();
  const double *m = mean.const_data_ptr<double>(), *is = invstd.const_data_ptr<double>();
  double *ph = xhat.data_ptr<double>(), *pp = product.data_ptr<double>();
  for (int64_t o = 0; o < l.outer; ++o) {
    for (int64_t k = 0; k < l.channels; ++k) {
      const int64_t at = (o * l.channels + k) * l.inner;
      centred_terms(px + at, pg + at, nullptr, m[k], is[k], ph + at, nullptr, nullptr, pp + at, l.inner);
    }
  }
  return {xhat, product};
}

// Its last: the input gradient from per-channel a = sum_g / n, b = sum_gx / n and scale s, as
// at::sub(grad_out, a).sub_(xhat.mul_(b)).mul_(s).
at::Tensor batch_norm_grad_input(const at::Tensor& g, const at::Tensor& xhat, const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor& s) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const Layout l = channel_layout(g);
  at::Tensor out = at::empty_like(g);
  const double *pg = g.const_data_ptr<double>(), *ph = xhat.const_data_ptr<double>();
  const double *pa = a.const_data_ptr<double>(), *pb = b.const_data_ptr<double>(), *ps = s.const_data_ptr<double>();
  double* po = out.data_ptr<double>();
  for (int64_t o = 0; o < l.outer; ++o) {
    for (int64_t k = 0; k < l.channels; ++k) {
      const int64_t at = (o * l.channels + k) * l.inner;
      norm_input_gradient(pg + at, ph + at, pa[k], pb[k], ps[k], po + at, l.inner);
    }
  }
  return out;
}

// batch_norm_backward with those passes, over dense (N, C, *S) tensors; false (nothing done) where they are
// not dense.
bool batch_norm_backward_dense(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& save_mean, const at::Tensor& save_invstd,
                               const std::array<bool, 3>& mask, const Channels& c, at::Tensor& sum_g,
                               at::Tensor& sum_gx, at::Tensor& grad_x) {
  const int64_t count = x.size(1);
  if (x.numel() == 0 || !dense_double(x, x.numel()) || !dense_double(grad_out, x.numel()) ||
      grad_out.sizes() != x.sizes() || !dense_double(save_mean, count) || !dense_double(save_invstd, count) ||
      (weight.defined() && !dense_double(weight, count)))
    return false;
  const auto [xhat, product] = batch_norm_centred(x, grad_out, save_mean, save_invstd);
  sum_g = at::sum(grad_out, c.dims);
  sum_gx = at::sum(product, c.dims);
  if (mask[0]) {
    at::Tensor scale, a, b;
    {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      scale = (weight.defined() ? at::mul(save_invstd, weight) : save_invstd).contiguous();
      a = at::div(sum_g, wrapped(c.n)).contiguous(), b = at::div(sum_gx, wrapped(c.n)).contiguous();
    }
    grad_x = batch_norm_grad_input(grad_out, xhat, a, b, scale);
  }
  return true;
}

// decompose.batch_norm_backward: (grad_x, grad_weight, grad_bias), undefined where output_mask says so.
std::vector<at::Tensor> batch_norm_backward(Step* step, const at::Tensor& grad_out, const at::Tensor& x,
                                            const at::Tensor& weight, const at::Tensor& save_mean,
                                            const at::Tensor& save_invstd, const std::array<bool, 3>& mask) {
  const Channels c = channels(x);
  at::Tensor xhat, sum_g, sum_gx, grad_x;
  {
    Decomposing inside(step);
    if (batch_norm_backward_dense(grad_out, x, weight, save_mean, save_invstd, mask, c, sum_g, sum_gx, grad_x))
      return {grad_x, mask[1] ? sum_gx : at::Tensor(), mask[2] ? sum_g : at::Tensor()};
    {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      xhat = at::sub(x, save_mean.view(c.shape)).mul_(save_invstd.view(c.shape));
    }
    sum_g = at::sum(grad_out, c.dims);
    at::Tensor product;
    {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      product = at::mul(grad_out, xhat);
    }
    sum_gx = at::sum(product, c.dims);
    if (mask[0]) {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      at::Tensor scale = weight.defined() ? at::mul(save_invstd, weight) : save_invstd;
      grad_x = at::sub(grad_out, at::div(sum_g, wrapped(c.n)).view(c.shape))
                   .sub_(xhat.mul_(at::div(sum_gx, wrapped(c.n)).view(c.shape)));
      grad_x.mul_(scale.view(c.shape));
    }
  }
  return {grad_x, mask[1] ? sum_gx : at::Tensor(), mask[2] ? sum_g : at::Tensor()};
}

// decompose.log_softmax_backward: grad - exp(output) * sum(grad, dim); the sum and the exp are ops of the step.
at::Tensor log_softmax_backward(Step* step, const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  const int64_t rank = std::max<int64_t>(grad.dim(), 1);
  dim = ((dim % rank) + rank) % rank;  // Python's dim %= rank
  Decomposing inside(step);
  at::Tensor total = at::sum(grad, {dim});
  at::Tensor probabilities = at::exp(output);
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  return at::sub(grad, at::mul(probabilities, total.unsqueeze(dim)));
}

// decompose._rows: x (*B, *S) as rows (*B, n), n = prod(S); (1, n) when B is empty.
at::Tensor rows_of(const at::Tensor& x, size_t normalized_dims, int64_t& n) {
  const int64_t batch_dims = x.dim() - static_cast<int64_t>(normalized_dims);
  n = 1;
  for (int64_t d = batch_dims; d < x.dim(); ++d) n *= x.size(d);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().begin() + batch_dims);
  if (shape.empty()) shape.push_back(1);
  shape.push_back(n);
  return x.reshape(shape);
}

// layer_norm's first pass over dense rows (*B, n) and their exact mask (*B): the rows with the exact ones
// zeroed, as rows.masked_fill(exact, 0), and each exact row's sum (0 elsewhere). An exact row sums to the
// same value in any order, so this loop's is rows.sum(-1)'s there: +0 for a row of -0s too, as torch's
// sum starts from +0. (The passes keep the rows' shape: the logged sums of the step take the same call
// class as the mode's.)
std::pair<at::Tensor, at::Tensor> layer_norm_masked(const at::Tensor& rows, const at::Tensor& exact) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const int64_t n = rows.size(-1), count = n > 0 ? rows.numel() / n : 0;
  at::Tensor masked = at::empty_like(rows), sums = at::zeros(exact.sizes(), rows.options());
  const double* x = rows.const_data_ptr<double>();
  const bool* is_exact = exact.const_data_ptr<bool>();
  double *pm = masked.data_ptr<double>(), *ps = sums.data_ptr<double>();
  for (int64_t r = 0; r < count; ++r) {
    const double* row = x + r * n;
    if (!is_exact[r]) {
      std::memcpy(pm + r * n, row, static_cast<size_t>(n) * sizeof(double));
      continue;
    }
    std::fill(pm + r * n, pm + (r + 1) * n, 0.0);
    double total = 0.0;
    for (int64_t j = 0; j < n; ++j) total += row[j];
    ps[r] = total;
  }
  return {masked, sums};
}

// c = x - m; q = c * c (layer norm's centred rows and their squares, a row's mean m).
VECTOR_CLONES void centred_squares(const double* __restrict__ x, double m, double* __restrict__ c,
                                   double* __restrict__ q, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i] - m;
    c[i] = v;
    q[i] = v * v;
  }
}

// Its second pass: (centred, squares) of dense rows (*B, n) and their means (*B, 1), as at::sub(rows, mean)
// and at::mul(centred, centred).
std::pair<at::Tensor, at::Tensor> layer_norm_centred(const at::Tensor& rows, const at::Tensor& mean) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const int64_t n = rows.size(-1), count = n > 0 ? rows.numel() / n : 0;
  at::Tensor centred = at::empty_like(rows), squares = at::empty_like(rows);
  const double *x = rows.const_data_ptr<double>(), *m = mean.const_data_ptr<double>();
  double *pc = centred.data_ptr<double>(), *pq = squares.data_ptr<double>();
  for (int64_t r = 0; r < count; ++r) centred_squares(x + r * n, m[r], pc + r * n, pq + r * n, n);
  return {centred, squares};
}

// out = (c * s) * w + b, w and b per element of a row (either may be absent: null), in that order.
VECTOR_CLONES void scaled_shifted(const double* __restrict__ c, double s, const double* __restrict__ w,
                                  const double* __restrict__ b, double* __restrict__ out, int64_t n) {
  if (w != nullptr && b != nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = (c[i] * s) * w[i] + b[i];
  } else if (w != nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = (c[i] * s) * w[i];
  } else if (b != nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = c[i] * s + b[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = c[i] * s;
  }
}

// Its last: the output from the centred rows (*B, n), rstd (*B, 1) and an optional weight and bias (n), as
// centred.mul_(rstd), then .mul_(weight), then .add_(bias).
at::Tensor layer_norm_scaled(const at::Tensor& centred, const at::Tensor& rstd, const at::Tensor& weight,
                             const at::Tensor& bias) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const int64_t n = centred.size(-1), count = n > 0 ? centred.numel() / n : 0;
  at::Tensor out = at::empty_like(centred);
  const double *pc = centred.const_data_ptr<double>(), *ps = rstd.const_data_ptr<double>();
  const double* pw = weight.defined() ? weight.const_data_ptr<double>() : nullptr;
  const double* pb = bias.defined() ? bias.const_data_ptr<double>() : nullptr;
  double* po = out.data_ptr<double>();
  for (int64_t r = 0; r < count; ++r) scaled_shifted(pc + r * n, ps[r], pw, pb, po + r * n, n);
  return out;
}

// A per-row tensor (*B) made dense, and an uninitialised (*B, 1) FP64 tensor for what is computed from it.
std::pair<at::Tensor, at::Tensor> dense_and_column(const at::Tensor& per_row) {
  at::Tensor dense = per_row.contiguous();
  std::vector<int64_t> shape(dense.sizes().begin(), dense.sizes().end());
  shape.push_back(1);
  return {dense, at::empty(shape, dense.options())};
}

// A layer norm's per-row statistic from its row sums (*B), dense (*B, 1): sum / n, and where exact is given
// (a bool mask (*B)), exact rows' sums from `sums` instead of `logged`; as
// at::div(at::where(exact, sums, logged), n).unsqueeze(-1), in one loop where torch takes three ops and a copy
// (a correctly rounded division either way: torch's CPU kernel divides by a scalar, it does not multiply).
at::Tensor row_means(const at::Tensor& exact, const at::Tensor& sums, const at::Tensor& logged, int64_t n) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const auto [dense, out] = dense_and_column(logged);
  const double* pl = dense.const_data_ptr<double>();
  const double* ps = exact.defined() ? sums.const_data_ptr<double>() : nullptr;
  const bool* pe = exact.defined() ? exact.const_data_ptr<bool>() : nullptr;
  double* po = out.data_ptr<double>();
  const double d = static_cast<double>(n);
  for (int64_t r = 0, count = dense.numel(); r < count; ++r) po[r] = (pe != nullptr && pe[r] ? ps[r] : pl[r]) / d;
  return out;
}

// A layer norm's rstd from its rows' summed squared deviations (*B), dense (*B, 1):
// (1 / sqrt(spread / n + eps)) * 1, as decompose's at::div, at::add, ieee_sqrt, at::reciprocal and at::mul
// (Steps.inv_sqrt), each correctly rounded in the same order.
at::Tensor inverse_deviations(const at::Tensor& spread, int64_t n, double eps) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const auto [dense, out] = dense_and_column(spread);
  const double* pv = dense.const_data_ptr<double>();
  double* po = out.data_ptr<double>();
  const double d = static_cast<double>(n);
  for (int64_t r = 0, count = dense.numel(); r < count; ++r) po[r] = (1.0 / std::sqrt(pv[r] / d + eps)) * 1.0;
  return out;
}

// decompose.layer_norm: (out, mean, rstd), mean and rstd (*B, 1, ..., 1). Rows every order sums exactly
// (decompose._exact_rows, the C kernel's pass) are summed here and reach the logged row sum as zeros. The
// element passes are the loops above where the weight and bias are dense, else torch's ops.
std::vector<at::Tensor> layer_norm(Step* step, const at::Tensor& x, size_t normalized_dims, const at::Tensor& weight,
                                   const at::Tensor& bias, double eps) {
  int64_t n = 0;
  at::Tensor rows, exact, masked, sums, mean, centred, squares, var, rstd, out;
  {
    Decomposing inside(step);
    bool loops = false;
    {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      rows = rows_of(x, normalized_dims, n);
      at::Tensor dense = rows.contiguous();  // scale.dense_for_kernel (a plain tensor is no negated view)
      exact = at::empty(dense.sizes().slice(0, dense.dim() - 1), dense.options().dtype(at::kBool));
      step->kernel->exact_rows(dense.data_ptr<double>(), exact.numel(), n,
                               reinterpret_cast<uint8_t*>(exact.data_ptr<bool>()));
      // the loops' results are dense; torch's ops give theirs the rows' layout, which later ops may depend on
      // (a transposed sequence of patches: SegFormer), so rows laid out otherwise take torch's ops
      loops = n > 0 && rows.is_contiguous() && (!weight.defined() || dense_double(weight, n)) &&
              (!bias.defined() || dense_double(bias, n));
      if (loops) {
        std::tie(masked, sums) = layer_norm_masked(rows, exact);
      } else {
        masked = rows.masked_fill(exact.unsqueeze(-1), 0.0);
      }
    }
    at::Tensor logged = at::sum(masked, {-1});
    {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      if (loops) {
        mean = row_means(exact, sums, logged, n);
        std::tie(centred, squares) = layer_norm_centred(rows, mean);
      } else {
        mean = at::div(at::where(exact, rows.sum(-1), logged), wrapped(n)).unsqueeze(-1);
        centred = at::sub(rows, mean);
        squares = at::mul(centred, centred);
      }
    }
    at::Tensor spread = at::sum(squares, {-1});
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    if (loops) {
      rstd = inverse_deviations(spread, n, eps);
      out = layer_norm_scaled(centred, rstd, weight, bias);
    } else {
      var = at::div(spread, wrapped(n)).unsqueeze(-1);
      rstd = at::mul(at::reciprocal(ieee_sqrt(at::add(var, wrapped(eps)))), wrapped(1.0));  // Steps.inv_sqrt
      out = centred.mul_(rstd);
      if (weight.defined()) out.mul_(weight.reshape({n}));
      if (bias.defined()) out.add_(bias.reshape({n}));
    }
    std::vector<int64_t> stats(x.sizes().begin(), x.sizes().end() - static_cast<int64_t>(normalized_dims));
    stats.resize(static_cast<size_t>(x.dim()), 1);
    return {out.reshape(x.sizes()), mean.reshape(stats), rstd.reshape(stats)};
  }
}

// layer_norm_backward's first pass over dense rows (*B, n) of x and grad_out, their mean and rstd (*B) and an
// optional dense weight (n): {xhat, gw, gw * xhat, grad_out * xhat} as at::sub(x, mean).mul_(rstd),
// at::mul(g, weight) (g itself without a weight), at::mul(gw, xhat) and at::mul(g, xhat); the second and
// third only with terms, the last only with products (undefined tensors otherwise).
std::vector<at::Tensor> layer_norm_grad_passes(const at::Tensor& x, const at::Tensor& g, const at::Tensor& mean,
                                               const at::Tensor& rstd, const at::Tensor& weight, bool terms,
                                               bool products) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const int64_t n = g.size(-1), count = n > 0 ? g.numel() / n : 0;
  at::Tensor xhat = at::empty_like(g), gw, weighted, product;
  if (terms) {
    weighted = at::empty_like(g);
    gw = weight.defined() ? at::empty_like(g) : g;
  }
  if (products) product = at::empty_like(g);
  const double *px = x.const_data_ptr<double>(), *pg = g.const_data_ptr<double>();
  const double *pm = mean.const_data_ptr<double>(), *ps = rstd.const_data_ptr<double>();
  const double* pw = weight.defined() ? weight.const_data_ptr<double>() : nullptr;
  double* ph = xhat.data_ptr<double>();
  double* pgw = terms && weight.defined() ? gw.data_ptr<double>() : nullptr;
  double* pwx = terms ? weighted.data_ptr<double>() : nullptr;
  double* pp = products ? product.data_ptr<double>() : nullptr;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t o = r * n;
    centred_terms(px + o, pg + o, pw, pm[r], ps[r], ph + o, pgw != nullptr ? pgw + o : nullptr,
                  pwx != nullptr ? pwx + o : nullptr, pp != nullptr ? pp + o : nullptr, n);
  }
  return {xhat, gw, weighted, product};
}

// Its last: the input gradient of dense rows (*B, n) from gw, xhat, the rows' a = sum(gw) / n,
// b = sum(gw * xhat) / n and rstd s (*B), as at::sub(gw, a).sub_(at::mul(xhat, b)).mul_(s).
at::Tensor layer_norm_grad_input(const at::Tensor& gw, const at::Tensor& xhat, const at::Tensor& a,
                                 const at::Tensor& b, const at::Tensor& s) {
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  const int64_t n = gw.size(-1), count = n > 0 ? gw.numel() / n : 0;
  at::Tensor out = at::empty_like(gw);
  const double *pg = gw.const_data_ptr<double>(), *ph = xhat.const_data_ptr<double>();
  const double *pa = a.const_data_ptr<double>(), *pb = b.const_data_ptr<double>(), *ps = s.const_data_ptr<double>();
  double* po = out.data_ptr<double>();
  for (int64_t r = 0; r < count; ++r) norm_input_gradient(pg + r * n, ph + r * n, pa[r], pb[r], ps[r], po + r * n, n);
  return out;
}

// decompose.layer_norm_backward: (grad_x, grad_weight, grad_bias), undefined where the mask says so. Where the
// rows, their statistics and the weight are dense, its element passes are the loops above (two passes instead
// of nine torch ops and their temporaries), else torch's ops; the sums are the step's ops either way.
std::vector<at::Tensor> layer_norm_backward(Step* step, const at::Tensor& grad_out, const at::Tensor& x,
                                            size_t normalized_dims, const at::Tensor& mean, const at::Tensor& rstd_in,
                                            const at::Tensor& weight, const at::Tensor& bias,
                                            const std::array<bool, 3>& mask) {
  int64_t n = 0;
  at::Tensor g, rows, rstd, mean_rows, xhat, gw, weighted, product, grad_x, grad_w, grad_b;
  Decomposing inside(step);
  bool loops = false;
  {
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    g = rows_of(grad_out, normalized_dims, n);
    std::vector<int64_t> stats(g.sizes().begin(), g.sizes().end() - 1);
    stats.push_back(1);
    rstd = rstd_in.reshape(stats);
    mean_rows = mean.reshape(stats);
    rows = rows_of(x, normalized_dims, n);
    const int64_t count = n > 0 ? g.numel() / n : 0;
    loops = n > 0 && rows.sizes() == g.sizes() && dense_double(g, g.numel()) && dense_double(rows, g.numel()) &&
            dense_double(mean_rows, count) && dense_double(rstd, count) &&
            (!weight.defined() || dense_double(weight, n));
    if (loops) {
      std::vector<at::Tensor> passes = layer_norm_grad_passes(rows, g, mean_rows, rstd, weight, mask[0], mask[1]);
      xhat = passes[0];
      gw = passes[1];
      weighted = passes[2];
      product = passes[3];
    } else {
      xhat = at::sub(rows, mean_rows).mul_(rstd);
    }
  }
  if (mask[0]) {
    if (!loops) {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      gw = weight.defined() ? at::mul(g, weight.reshape({n})) : g;
    }
    at::Tensor total_g = at::sum(gw, {-1});
    if (!loops) {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      weighted = at::mul(gw, xhat);
    }
    at::Tensor total_gx = at::sum(weighted, {-1});
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    if (loops) {
      const at::Tensor none;
      grad_x = layer_norm_grad_input(gw, xhat, row_means(none, none, total_g, n), row_means(none, none, total_gx, n),
                                     rstd)
                   .reshape(x.sizes());
    } else {
      const at::Tensor mean_g = at::div(total_g, wrapped(n)).unsqueeze(-1);
      const at::Tensor mean_gx = at::div(total_gx, wrapped(n)).unsqueeze(-1);
      grad_x = at::sub(gw, mean_g).sub_(at::mul(xhat, mean_gx)).mul_(rstd).reshape(x.sizes());
    }
  }
  std::vector<int64_t> batch;
  for (int64_t d = 0; d + 1 < g.dim(); ++d) batch.push_back(d);
  if (mask[1]) {
    if (!loops) {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      product = at::mul(g, xhat);
    }
    grad_w = at::sum(product, batch);
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    grad_w = grad_w.reshape(weight.sizes());
  }
  if (mask[2]) {
    grad_b = at::sum(g, batch);
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    grad_b = grad_b.reshape(bias.sizes());
  }
  return {grad_x, grad_w, grad_b};
}

// decompose.softmax_backward: y * g - y * sum(y * g, dim); the row sum is an op of the step.
at::Tensor softmax_backward(Step* step, const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  const int64_t rank = output.dim();
  dim = ((dim % rank) + rank) % rank;  // Python's dim %= output.dim()
  Decomposing inside(step);
  at::Tensor yg;
  {
    c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
    yg = at::mul(output, grad);
  }
  at::Tensor total = at::sum(yg, {dim});
  c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
  return yg.sub_(at::mul(output, total.unsqueeze(dim)));
}

// decompose._layer_norm_applies: shape the trailing dims of a non-empty x; its length out.
bool layer_norm_applies(const at::Tensor& x, const c10::IValue& shape, size_t& normalized_dims) {
  if (!shape.isIntList()) return false;
  const auto dims = shape.toDimVector();
  if (x.dim() < static_cast<int64_t>(dims.size()) || x.numel() == 0) return false;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (x.size(x.dim() - static_cast<int64_t>(dims.size()) + static_cast<int64_t>(i)) != dims[i]) return false;
  }
  normalized_dims = dims.size();
  return true;
}

// A DECOMPOSED_* call: where decompose.formula_applies holds and every tensor is a plain FP64 CPU tensor,
// the decomposition above, its outputs (and batch norm's running statistics) rounded as exact, as
// RoundingMode.__torch_dispatch__ rounds a decomposed op's; returns false, with nothing done, elsewhere (the
// mode decomposes it, or runs torch's kernel).
bool decomposed(Step* step, int route, const c10::FunctionSchema& schema, torch::jit::Stack* stack, size_t first) {
  const size_t n_args = schema.arguments().size();
  auto arg = [&](size_t i) -> const c10::IValue& { return (*stack)[first + i]; };
  auto tensor = [&](size_t i, at::Tensor& out) {
    if (!arg(i).isTensor()) return false;
    out = arg(i).toTensor();
    return plain_double(out);
  };
  std::vector<at::Tensor> outputs, hidden;
  if (route == DECOMPOSED_BATCH_NORM) {
    at::Tensor x, weight, bias, running_mean, running_var;
    if (n_args != 8 || !tensor(0, x) || !optional_double(arg(1), weight) || !optional_double(arg(2), bias) ||
        !optional_double(arg(3), running_mean) || !optional_double(arg(4), running_var) || !arg(5).isBool() ||
        !arg(5).toBool() || !arg(6).isDouble() || !arg(7).isDouble())
      return false;
    if (x.dim() < 2 || x.size(1) <= 0 || x.numel() <= x.size(1)) return false;
    outputs = batch_norm(step, x, weight, bias, running_mean, running_var, arg(6).toDouble(), arg(7).toDouble());
    for (const at::Tensor& t : {running_mean, running_var}) {
      if (t.defined()) hidden.push_back(t);
    }
  } else if (route == DECOMPOSED_BATCH_NORM_BACKWARD) {
    at::Tensor grad_out, x, weight, running_mean, running_var, save_mean, save_invstd;
    if (n_args != 10 || !tensor(0, grad_out) || !tensor(1, x) || !optional_double(arg(2), weight) ||
        !optional_double(arg(3), running_mean) || !optional_double(arg(4), running_var) || !tensor(5, save_mean) ||
        !tensor(6, save_invstd) || !arg(7).isBool() || !arg(7).toBool() || !arg(9).isBoolList())
      return false;
    if (x.dim() < 2 || x.size(1) <= 0 || x.numel() <= x.size(1)) return false;
    const auto flags = arg(9).toBoolList();
    if (flags.size() != 3) return false;
    outputs = batch_norm_backward(step, grad_out, x, weight, save_mean, save_invstd, {flags[0], flags[1], flags[2]});
  } else if (route == DECOMPOSED_LAYER_NORM) {
    at::Tensor x, weight, bias;
    size_t normalized = 0;
    if (step->kernel == nullptr || n_args != 5 || !tensor(0, x) || !optional_double(arg(2), weight) ||
        !optional_double(arg(3), bias) || !arg(4).isDouble() || !layer_norm_applies(x, arg(1), normalized))
      return false;
    outputs = layer_norm(step, x, normalized, weight, bias, arg(4).toDouble());
  } else if (route == DECOMPOSED_LAYER_NORM_BACKWARD) {
    at::Tensor grad_out, x, mean, rstd, weight, bias;
    size_t normalized = 0;
    if (n_args != 8 || !tensor(0, grad_out) || !tensor(1, x) || !tensor(3, mean) || !tensor(4, rstd) ||
        !optional_double(arg(5), weight) || !optional_double(arg(6), bias) || !arg(7).isBoolList() ||
        !layer_norm_applies(x, arg(2), normalized))
      return false;
    const auto flags = arg(7).toBoolList();
    if (flags.size() != 3 || (flags[1] && !weight.defined()) || (flags[2] && !bias.defined())) return false;
    outputs = layer_norm_backward(step, grad_out, x, normalized, mean, rstd, weight, bias,
                                  {flags[0], flags[1], flags[2]});
  } else {  // DECOMPOSED_LOG_SOFTMAX_BACKWARD, DECOMPOSED_SOFTMAX_BACKWARD: decompose._rows_applies
    at::Tensor grad, output;
    if (n_args != 4 || !tensor(0, grad) || !tensor(1, output) || !arg(2).isInt() || !arg(3).isInt()) return false;
    if (output.dim() == 0 || output.numel() == 0 || arg(3).toScalarType() != output.scalar_type()) return false;
    outputs = {route == DECOMPOSED_LOG_SOFTMAX_BACKWARD ? log_softmax_backward(step, grad, output, arg(2).toInt())
                                                        : softmax_backward(step, grad, output, arg(2).toInt())};
  }
  torch::jit::drop(*stack, n_args);
  for (const at::Tensor& t : outputs) torch::jit::push(*stack, t);
  ++step->native_ops;
  for (const at::Tensor& t : outputs) round_exact(step, t);  // written_tensors: the outputs, hidden writes after
  for (const at::Tensor& t : hidden) round_exact(step, t);
  return true;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  Step* step = current;
  if (c10::impl::TorchDispatchModeTLS::stack_len() == 0) {
    // No mode on the stack: code inside the step set them aside (torch's tensor printing does, with
    // _disable_current_modes), and its ops run as they would under the Python mode alone: natively. (The
    // Python key with no mode and no subclass argument is an internal assert in torch.)
    c10::impl::ExcludeDispatchKeyGuard inside(kOurs);
    return op.redispatchBoxed(keys & kBelowOurs, stack);
  }
  if (step == nullptr) {
    // Our key from a step on another thread (autograd's device threads inherit its dispatch keys, not its
    // table): the mode does it all. Anything else that carries the key is not ours: pass it on.
    if (c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python)) return to_python(step, op, keys, stack);
    c10::impl::ExcludeDispatchKeyGuard inside(kOurs);
    return op.redispatchBoxed(keys & kBelowOurs, stack);
  }
  // Only the rounding mode itself on the mode stack: another mode pushed inside the step sees every op.
  if (c10::impl::TorchDispatchModeTLS::stack_len() != 1) return to_python(step, op, keys, stack);
  const Entry& e = entry_of(step->table, op);
  int route = e.route;
  const auto& schema = op.schema();
  const size_t n_args = schema.arguments().size();
  const size_t first = stack->size() - n_args;
  // a verifiable step's op on complex values: the mode's (a plain step's runs as it is)
  if (route != PYTHON && step->table->refuses && complex_argument(schema, *stack, first)) route = PYTHON;
  if (route != PYTHON && step->table->finite_extremes && fp64_extreme_argument(schema, *stack, first)) route = PYTHON;
  bool rounds = route != KEEP;
  if (route == EXACT_IF_ALPHA_ONE) route = alpha_is_one(schema, *stack, first) ? EXACT : PYTHON;
  if (route == EXACT_IF_SQUARE) route = exponent_is_two(schema, *stack, first) ? EXACT : LOGGED;
  // add and sub with alpha 1 are the plain IEEE op, not split (fused.split_needed)
  if ((route == SPLIT_ADD || route == SPLIT_SUB) && alpha_is_one(schema, *stack, first)) route = EXACT;
  const bool logged = route == LOGGED || route == LOGGED_REDUCTION || route == LOGGED_MM || route == LOGGED_SUM ||
                      route == LOGGED_CONV || route == LOGGED_TERMS || route == LOGGED_CONV_TERMS ||
                      route == LOGGED_BY_FIRST;
  if (logged && !step->logs) route = PYTHON;
  Product product;
  if (route == LOGGED_MM) {  // plain FP64 CPU matrices, or the mode decides (scale.reduction_scale)
    const auto& a = (*stack)[first];
    const auto& b = (*stack)[first + 1];
    auto plain_matrix = [](const c10::IValue& v) {
      if (!v.isTensor()) return false;
      const auto& t = v.toTensor();
      return t.defined() && t.scalar_type() == c10::ScalarType::Double && t.dim() == 2 && plain_cpu(t);
    };
    if (plain_matrix(a) && plain_matrix(b) && a.toTensor().size(1) == b.toTensor().size(0) &&
        a.toTensor().size(1) > 0 && a.toTensor().size(0) > 0 && b.toTensor().size(1) > 0) {
      product.a = a.toTensor();
      product.b = b.toTensor();
    } else {
      route = PYTHON;
    }
  }
  bool island = false;
  if (route != PYTHON && route != KEEP && route != CAST && has_narrow_argument(schema, *stack, first)) {
    // a float32 or half island: the Python mode's FP64 twins, except an op float32 computes as they would
    island = true;
    if (!(route == EXACT && e.float32_exact && float32_island(schema, *stack, first))) route = PYTHON;
  }
  if (route == CAST) {  // a cast from a narrower float is on the FP32 grid already: nothing to round
    const auto& source = (*stack)[first];
    rounds = !(source.isTensor() && narrow(source.toTensor().scalar_type()));
  }
  if (route >= DECOMPOSED_BATCH_NORM && route <= DECOMPOSED_SOFTMAX_BACKWARD) {
    // recording only, and not in a calibration step, whose nested calls the calibrator measures in the mode
    if (step->logs && step->declined == nullptr && !step->nesting.is_none() &&
        decomposed(step, route, schema, stack, first))
      return;
    route = PYTHON;
  }
  at::Tensor split;
  if (is_split(route)) {
    at::Tensor done = split_in_one_pass(route, e.in_place, *stack, first);
    if (done.defined()) {  // computed and rounded
      ++step->native_ops, ++step->one_pass;
      torch::jit::drop(*stack, n_args);  // an in-place op returns self, which `done` is
      torch::jit::push(*stack, done);
      count_rounded(step, done.numel());
      return;
    }
    if (!split_step(route, *stack, first, split)) route = PYTHON;
  }
  if (route == PYTHON) return to_python(step, op, keys, stack);
  Taus class_taus;  // the call's class's (one, or one per rounded output), where it has them; NaN: the op's
  if (logged && step->declined != nullptr) {  // a calibration step: only calls known declined stay here
    std::string key = call_key(op, *stack, first, n_args);
    auto found = key.empty() ? step->declined->keys.end() : step->declined->keys.find(key);
    if (found == step->declined->keys.end()) return to_python_learning(step, key, op, keys, stack);
    class_taus = found->second;
  } else if (logged && e.classed) {  // the threshold is its class's: learned from the mode once per call key
    std::string key = call_key(op, *stack, first, n_args);
    auto found = key.empty() ? step->table->class_taus.end() : step->table->class_taus.find(key);
    if (found == step->table->class_taus.end()) {
      if (key.empty()) return to_python(step, op, keys, stack);
      return to_python_classed(step, key, op, keys, stack);
    }
    class_taus = found->second;
  }
  ++step->native_ops;
  std::vector<at::Tensor> written;
  if (is_split(route)) {
    at::Tensor self = (*stack)[first].toTensor();
    torch::jit::drop(*stack, n_args);
    {
      c10::impl::ExcludeDispatchKeyGuard below(kOursAndAbove);
      written.push_back(e.in_place ? self.add_(split) : at::add(self, split));
    }
    torch::jit::push(*stack, written.back());
    round_exact(step, written.back());
    return;
  }
  // What the op writes: its arguments the schema marks as written, else its outputs.
  bool writes = false;
  if (rounds) {
    const auto& args = schema.arguments();
    for (size_t i = 0; i < n_args; ++i) {
      if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) {
        writes = true;
        collect((*stack)[first + i], written);
      }
    }
  }
  // A LOGGED_SUM's positional arguments (the mode's args; keyword-only ones are its kwargs, which
  // exact_sum_elements does not read): its terms, should an element be near.
  std::vector<c10::IValue> sum_inputs;
  const bool unit_from_inputs = route == LOGGED_SUM || route == LOGGED_TERMS || route == LOGGED_CONV ||
                                route == LOGGED_CONV_TERMS || route == LOGGED_BY_FIRST;
  if (unit_from_inputs || (logged && e.exact_products)) {
    for (size_t i = 0; i < n_args && !schema.arguments()[i].kwarg_only(); ++i) sum_inputs.push_back((*stack)[first + i]);
  }
  {
    c10::impl::ExcludeDispatchKeyGuard inside(kOurs);
    op.redispatchBoxed(keys & kBelowOurs, stack);
  }
  for (size_t i = stack->size() - schema.returns().size(); i < stack->size() && step->table->refuses; ++i) {
    const c10::IValue& v = (*stack)[i];
    // a view of real values as complex ones (view_as_complex) moves them: not refused
    if (v.isTensor() && unroundable(v.toTensor()) && !(route == KEEP && v.toTensor().is_complex())) refuse(e, v.toTensor());
  }
  if (!rounds) return;
  if (!writes) {
    const size_t n_out = schema.returns().size();
    for (size_t i = stack->size() - n_out; i < stack->size(); ++i) collect((*stack)[i], written);
  }
  if (logged) {
    double tau = e.tau;
    if (step->declined != nullptr) {  // calibration moves thresholds as it goes: the live one
      bool produced = false;
      for (const auto& t : written) produced |= t.defined() && t.scalar_type() == c10::ScalarType::Double;
      if (!produced) return;
      py::gil_scoped_acquire gil;
      tau = step->declined_call(e.name).cast<double>();  // counts the call, as the calibrator would
    }
    Taus taus{tau};
    if (!class_taus.empty()) {
      taus = class_taus;
      for (double& t : taus) {
        if (std::isnan(t)) t = tau;
      }
    }
    return round_logged(step, e, route, taus, written, route == LOGGED_MM ? &product : nullptr,
                        unit_from_inputs ? &sum_inputs : nullptr,
                        e.exact_products ? &sum_inputs : nullptr);
  }
  for (const auto& t : written) {
    round_exact(step, t);
    // an island's float32 results: the mode counts its FP64 twins as rounded
    if (island && t.defined() && t.scalar_type() == c10::ScalarType::Float) count_rounded(step, t.numel());
  }
}

// The step scope: our key in, Python out, for this thread; restored in reverse on leave.
struct Scope {
  Step step;
  py::object table_owner, declined_owner;
  std::unique_ptr<c10::impl::IncludeDispatchKeyGuard> include;
  std::unique_ptr<c10::impl::ExcludeDispatchKeyGuard> exclude;
  Step* previous = nullptr;

  // A scope still entered when the process exits (a Ctrl-C between enter and the Python side's try) is
  // destroyed with the thread's locals, after the interpreter is gone: its Python references are left
  // alone then, since releasing them would touch freed memory.
  ~Scope() {
    {  // left without leave() (the thread ended inside a step): no flush may reach it any more
      std::lock_guard<std::mutex> lock(live_mutex);
      auto found = std::find(live_steps.begin(), live_steps.end(), &step);
      if (found != live_steps.end()) live_steps.erase(found);
    }
    if (Py_IsInitialized()) return;
    for (py::object* o : {&table_owner, &declined_owner, &step.tally, &step.declined_call, &step.numbered,
                           &step.round_logged, &step.entries, &step.learned, &step.nesting}) {
      o->release();
    }
  }
};

thread_local std::vector<std::unique_ptr<Scope>> scopes;

void enter(py::object table, bool logs, py::object numbered_fn, py::object round_logged_fn, py::object kernel,
           py::object entries_fn, py::object learned, py::object nesting, py::object declined, py::object tally,
           py::object declined_call) {
  auto scope = std::make_unique<Scope>();
  scope->table_owner = table;
  scope->declined_owner = declined;
  scope->step.table = table.cast<Table*>();
  scope->step.logs = logs;
  if (!declined.is_none()) {
    scope->step.declined = declined.cast<Declined*>();
    scope->step.tally = std::move(tally);
    scope->step.declined_call = std::move(declined_call);
  }
  scope->step.numbered = std::move(numbered_fn);
  scope->step.round_logged = std::move(round_logged_fn);
  scope->step.learned = std::move(learned);
  scope->step.nesting = std::move(nesting);
  if (!kernel.is_none()) {
    auto* api = static_cast<const DetrlKernelApi*>(PyCapsule_GetPointer(kernel.ptr(), DETRL_KERNEL_API_CAPSULE));
    if (api == nullptr) throw py::error_already_set();
    if (api->version == DETRL_KERNEL_API_VERSION) {  // a kernel built with another API: the mode's path
      scope->step.kernel = api;
      scope->step.entries = std::move(entries_fn);
    }
  }
  scope->previous = current;
  scope->include = std::make_unique<c10::impl::IncludeDispatchKeyGuard>(kOurs);
  scope->exclude = std::make_unique<c10::impl::ExcludeDispatchKeyGuard>(c10::DispatchKey::Python);
  current = &scope->step;
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    live_steps.push_back(current);
  }
  scopes.push_back(std::move(scope));
}

// A decomposition's machine-dependent steps (its sums, exp) from inside the mode's handler, where the
// route is off: on again for them (this thread's step, if any), until unnest. Returns whether it was.
thread_local std::vector<std::unique_ptr<c10::impl::ForceDispatchKeyGuard>> nests;

bool nest() {
  if (current == nullptr) return false;
  auto local = c10::impl::tls_local_dispatch_key_set();
  nests.push_back(std::make_unique<c10::impl::ForceDispatchKeyGuard>(
      local.included_.add(kOurs), local.excluded_.remove(kOurs).add(c10::DispatchKey::Python)));
  ++current->nested;
  return true;
}

void unnest() {
  TORCH_CHECK(!nests.empty() && current != nullptr && current->nested > 0, "native dispatch: unnest() without nest()");
  --current->nested;
  nests.pop_back();
}

// Leave the innermost scope; returns (rounded elements, ops handled here, ops handed to the Python mode,
// outputs whose log entries were taken here, split ops computed in one pass).
py::tuple leave() {
  TORCH_CHECK(!scopes.empty(), "native dispatch: leave() without enter()");
  auto scope = std::move(scopes.back());
  scopes.pop_back();
  // a nest an interrupted decomposition left (KeyboardInterrupt between nest and its try): its guard was
  // taken inside this scope's, so it is restored first
  for (; scope->step.nested > 0 && !nests.empty(); --scope->step.nested) nests.pop_back();
  scope->exclude.reset();
  scope->include.reset();
  current = scope->previous;
  Step& s = scope->step;
  flush_numbers(&s);
  return py::make_tuple(s.rounded, s.native_ops, s.python_ops, s.entry_ops, s.one_pass);
}

}  // namespace

TORCH_LIBRARY_IMPL(_, Fake, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

#ifndef DETRL_BUILT_FOR_TORCH
#define DETRL_BUILT_FOR_TORCH ""  // built on first use, against the torch that is running
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("built_for_torch") = DETRL_BUILT_FOR_TORCH;
  py::class_<Table>(m, "Table", "the routes of the operators seen")
      .def(py::init([](py::object resolve, bool negative_zeros, bool refuses) {
             auto t = std::make_unique<Table>();
             t->resolve = std::move(resolve);
             t->negative_zeros = negative_zeros;
             t->refuses = refuses;
             return t;
           }))
      .def_readwrite("finite_extremes", &Table::finite_extremes)
      .def_readwrite("nans_unlogged", &Table::nans_unlogged)
      .def("clear", [](Table& t) { t.entries.clear(); })
      .def("__len__", [](const Table& t) { return t.entries.size(); });
  py::class_<Declined>(m, "Declined", "calls of logged ops calibration has declined to measure again")
      .def(py::init<>())
      .def("__len__", [](const Declined& d) { return d.keys.size(); });
  m.def("enter", &enter, "start a step: ops that need no Python are handled natively on this thread");
  m.def("flush_numbers", &flush_all_numbers,
        "hand the logged ops numbered natively so far over to the Python side (before it numbers one)");
  m.def("nest", &nest, "the route on again inside the mode's handler, for a decomposition's steps; whether it is");
  m.def("unnest", &unnest, "undo the last nest()");
  m.def("leave", &leave,
        "end the innermost step; returns (rounded elements, native ops, Python ops, entry ops, one-pass ops)");
  // the element passes of the decompositions written out, for tests against the torch ops they replace
  // (dense FP64 CPU arguments of matching sizes, which the decompositions check before they call them)
  auto dense_args = [](std::initializer_list<const at::Tensor*> ts) {
    for (const at::Tensor* t : ts) TORCH_CHECK(dense_double(*t, t->numel()), "dense FP64 CPU tensors only");
  };
  m.def("batch_norm_centred", [dense_args](const at::Tensor& x, const at::Tensor& g, const at::Tensor& mean,
                                           const at::Tensor& invstd) {
    dense_args({&x, &g, &mean, &invstd});
    TORCH_CHECK(x.dim() >= 2 && x.numel() > 0 && g.sizes() == x.sizes() && mean.numel() == x.size(1) &&
                invstd.numel() == x.size(1));
    return batch_norm_centred(x, g, mean, invstd);
  });
  m.def("batch_norm_grad_input", [dense_args](const at::Tensor& g, const at::Tensor& xhat, const at::Tensor& a,
                                              const at::Tensor& b, const at::Tensor& s) {
    dense_args({&g, &xhat, &a, &b, &s});
    const int64_t count = g.dim() >= 2 && g.numel() > 0 ? g.size(1) : -1;
    TORCH_CHECK(xhat.sizes() == g.sizes() && a.numel() == count && b.numel() == count && s.numel() == count);
    return batch_norm_grad_input(g, xhat, a, b, s);
  });
  m.def("layer_norm_grad_passes", [dense_args](const at::Tensor& x, const at::Tensor& g, const at::Tensor& mean,
                                               const at::Tensor& rstd, std::optional<at::Tensor> weight, bool terms,
                                               bool products) {
    const at::Tensor w = weight.value_or(at::Tensor());
    dense_args({&x, &g, &mean, &rstd});
    TORCH_CHECK(g.dim() >= 1 && g.numel() > 0 && x.sizes() == g.sizes() && mean.numel() * g.size(-1) == g.numel() &&
                rstd.numel() == mean.numel() && (!w.defined() || dense_double(w, g.size(-1))));
    return layer_norm_grad_passes(x, g, mean, rstd, w, terms, products);
  });
  m.def("layer_norm_grad_input", [dense_args](const at::Tensor& gw, const at::Tensor& xhat, const at::Tensor& a,
                                              const at::Tensor& b, const at::Tensor& s) {
    dense_args({&gw, &xhat, &a, &b, &s});
    const int64_t count = gw.dim() >= 1 && gw.numel() > 0 ? gw.numel() / gw.size(-1) : -1;
    TORCH_CHECK(xhat.sizes() == gw.sizes() && a.numel() == count && b.numel() == count && s.numel() == count);
    return layer_norm_grad_input(gw, xhat, a, b, s);
  });
  m.def("row_means", [dense_args](std::optional<at::Tensor> exact, const at::Tensor& sums, const at::Tensor& logged,
                                  int64_t n) {
    const at::Tensor e = exact.value_or(at::Tensor());
    dense_args({&sums, &logged});
    TORCH_CHECK(sums.sizes() == logged.sizes() && n > 0 &&
                (!e.defined() || (e.scalar_type() == c10::ScalarType::Bool && e.is_contiguous() &&
                                  e.sizes() == logged.sizes())));
    return row_means(e, sums, logged, n);
  });
  m.def("inverse_deviations", [dense_args](const at::Tensor& spread, int64_t n, double eps) {
    dense_args({&spread});
    TORCH_CHECK(n > 0);
    return inverse_deviations(spread, n, eps);
  });
  m.def("layer_norm_masked", [dense_args](const at::Tensor& rows, const at::Tensor& exact) {
    dense_args({&rows});
    TORCH_CHECK(rows.dim() >= 1 && exact.scalar_type() == c10::ScalarType::Bool && exact.is_contiguous() &&
                exact.numel() * rows.size(-1) == rows.numel());
    return layer_norm_masked(rows, exact);
  });
  m.def("layer_norm_centred", [dense_args](const at::Tensor& rows, const at::Tensor& mean) {
    dense_args({&rows, &mean});
    TORCH_CHECK(rows.dim() >= 1 && mean.numel() * rows.size(-1) == rows.numel());
    return layer_norm_centred(rows, mean);
  });
  m.def("layer_norm_scaled", [dense_args](const at::Tensor& centred, const at::Tensor& rstd,
                                          std::optional<at::Tensor> weight, std::optional<at::Tensor> bias) {
    const at::Tensor w = weight.value_or(at::Tensor()), b = bias.value_or(at::Tensor());
    dense_args({&centred, &rstd});
    TORCH_CHECK(centred.dim() >= 1 && rstd.numel() * centred.size(-1) == centred.numel());
    for (const at::Tensor* t : {&w, &b}) TORCH_CHECK(!t->defined() || dense_double(*t, centred.size(-1)));
    return layer_norm_scaled(centred, rstd, w, b);
  });
}
