// pybind11 front end of the launcher core: type conversion only, no logic.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "arch.h"
#include "driver.h"
#include "launcher.h"

namespace py = pybind11;
namespace fr = flash_reasoning;

namespace {

PyObject* g_error = nullptr;  // LauncherError; one reference held for the process lifetime

// Raises LauncherError(message) with .code = the status code.
[[noreturn]] void raise(const fr::Status& st) {
  py::object exc = py::reinterpret_borrow<py::object>(g_error)(st.message);
  exc.attr("code") = static_cast<int>(st.code);
  PyErr_SetObject(g_error, exc.ptr());
  throw py::error_already_set();
}

void check(const fr::Status& st) {
  if (!st.ok()) raise(st);
}

// A Python float or int (or anything with __index__ / __float__) as an Arg; range checks
// against the param type happen in the core, which can name the param.
fr::Arg to_arg(py::handle h) {
  PyObject* o = h.ptr();
  if (PyFloat_Check(o)) return fr::Arg::Float(PyFloat_AS_DOUBLE(o));
  if (PyIndex_Check(o)) {
    py::object n = py::reinterpret_steal<py::object>(PyNumber_Index(o));
    if (!n) throw py::error_already_set();
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(n.ptr(), &overflow);
    if (!overflow) return fr::Arg::Int(v);
    if (overflow > 0) {
      unsigned long long u = PyLong_AsUnsignedLongLong(n.ptr());
      if (!PyErr_Occurred()) return fr::Arg::UInt(u);
      PyErr_Clear();
    }
    return fr::Arg::Of(fr::Arg::Kind::kTooLarge);
  }
  double f = PyFloat_AsDouble(o);  // __float__, e.g. numpy.float32
  if (f == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return fr::Arg::Of(fr::Arg::Kind::kNotANumber);
  }
  return fr::Arg::Float(f);
}

std::string fspath(const py::object& path) {
  py::object s = py::reinterpret_steal<py::object>(PyOS_FSPath(path.ptr()));
  if (!s) throw py::error_already_set();
  return s.cast<std::string>();
}

void launch(fr::Launcher& l, const std::string& name, const std::array<int64_t, 3>& grid, const py::sequence& args,
            uintptr_t stream) {
  int index = 0;
  check(l.find(name, &index));
  std::vector<fr::Arg> packed;
  packed.reserve(args.size());
  for (py::handle a : args) packed.push_back(to_arg(a));
  check(l.launch(index, grid.data(), packed.data(), packed.size(), reinterpret_cast<fr::CUstream>(stream)));
}

std::vector<std::pair<std::string, std::string>> params(const fr::Launcher& l, const std::string& name) {
  int index = 0;
  check(l.find(name, &index));
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& p : l.manifest().kernels[index].params) out.emplace_back(p.name, p.type);
  return out;
}

}  // namespace

PYBIND11_MODULE(_launcher, m) {
  m.doc() =
      "Launcher for flash-reasoning's ahead-of-time compiled Triton kernels.\n\n"
      "Loads cubins from <artifact_root>/<arch>/ (described by manifest.json) through the CUDA\n"
      "driver, which is opened at run time (libcuda.so.1, or $FLASH_REASONING_LIBCUDA).\n"
      "Takes raw device pointers, scalars and stream handles as Python ints; no torch needed.\n"
      "Every failure raises LauncherError (a RuntimeError) with an integer .code.";

  g_error = PyErr_NewExceptionWithDoc("flash_reasoning._launcher.LauncherError",
                                      "A launcher failure; .code is the status code, the message names the "
                                      "failing step and, for driver failures, the CUDA error name.",
                                      PyExc_RuntimeError, nullptr);
  if (!g_error) throw py::error_already_set();
  m.attr("LauncherError") = py::handle(g_error);

  m.def(
      "select_arch",
      [](int cc, const std::vector<std::string>& available) {
        std::string arch;
        check(fr::select_arch(cc, available, &arch));
        return arch;
      },
      py::arg("compute_capability"), py::arg("available"),
      "Arch folder for a device of compute capability major*10+minor (e.g. 86 -> 'sm80').");

  m.def(
      "device_compute_capability",
      [](int device) {
        int cc = 0;
        check(fr::device_compute_capability(device, &cc));
        return cc;
      },
      py::arg("device"), "major*10+minor of a CUDA device, read through the driver API.");

  py::class_<fr::Launcher>(m, "Launcher", "The kernels of one arch folder (<artifact_root>/<arch>).")
      .def(py::init([](const py::object& arch_dir, int device) {
             std::unique_ptr<fr::Launcher> l;
             check(fr::Launcher::open(fspath(arch_dir), device, &l));
             return l;
           }),
           py::arg("arch_dir"), py::arg("device") = 0)
      .def_property_readonly("arch", [](const fr::Launcher& l) { return l.manifest().arch; })
      .def("kernel_names",
           [](const fr::Launcher& l) {
             std::vector<std::string> names;
             for (const auto& k : l.manifest().kernels) names.push_back(k.name);
             return names;
           })
      .def("params", &params, py::arg("name"), "(name, type) of the caller-supplied params (scratch excluded).")
      .def("launch", &launch, py::arg("name"), py::arg("grid"), py::arg("args"), py::arg("stream"),
           "Launch kernel `name` on `stream` (a CUstream as int; 0 = default stream). Asynchronous.");
}
