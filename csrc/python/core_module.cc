// pybind11 front end of the launcher core: type conversion only, no logic.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "runtime/arch.h"
#include "runtime/driver.h"
#include "runtime/launch_sequence.h"
#include "runtime/launcher.h"
#include "ops/paged_decode.h"
#include "planner/planner.h"
#include "planner/segment_tree.h"

namespace py = pybind11;
namespace fr = flash_reasoning;

namespace {

PyObject* g_error = nullptr;  // CoreError; one reference held for the process lifetime

// Raises CoreError(message) with .code = the status code.
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

// In the args given to Launcher.prepare: the slot that each run fills with pointers[index].
struct Hole {
  int index;
};

fr::Status invalid(const std::string& message) { return fr::Status::Error(fr::Code::kInvalidArgument, message); }

std::string type_name(py::handle h) { return Py_TYPE(h.ptr())->tp_name; }

// Launch i of n, as the core takes it; errors say which launch, as the core's do.
fr::SequenceLaunch to_sequence_launch(const fr::Launcher& l, py::handle launch, size_t i, size_t n) {
  std::string where = "prepared launch " + std::to_string(i) + " of " + std::to_string(n) + ": ";
  std::tuple<std::string, std::array<int64_t, 3>, py::sequence> t;
  try {
    t = launch.cast<decltype(t)>();
  } catch (const py::cast_error&) {
    raise(invalid(where + "must be (kernel name, (x, y, z) grid, args), got " + py::repr(launch).cast<std::string>()));
  }
  fr::SequenceLaunch s;
  fr::Status st = l.find(std::get<0>(t), &s.kernel);
  if (!st.ok()) raise({st.code, where + st.message});
  std::copy(std::get<1>(t).begin(), std::get<1>(t).end(), s.grid);
  for (py::handle a : std::get<2>(t))
    s.args.push_back(py::isinstance<Hole>(a) ? fr::SequenceArg::Hole(a.cast<const Hole&>().index)
                                             : fr::SequenceArg::Value(to_arg(a)));
  return s;
}

std::unique_ptr<fr::LaunchSequence> prepare(fr::Launcher& l, const py::sequence& launches,
                                            const std::vector<std::string>& holes) {
  std::vector<fr::SequenceLaunch> converted;
  for (size_t i = 0; i < launches.size(); ++i)
    converted.push_back(to_sequence_launch(l, launches[i], i, launches.size()));
  std::unique_ptr<fr::LaunchSequence> seq;
  check(fr::LaunchSequence::prepare(&l, converted, holes, &seq));
  return seq;
}

// The per-call path: pointers (Python ints) converted on the stack, then the core's run.
void run_sequence(const fr::LaunchSequence& s, py::handle pointers, uintptr_t stream) {
  py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(pointers.ptr(), ""));
  if (!fast) {
    PyErr_Clear();
    raise(invalid("pointers must be a sequence of ints, got " + type_name(pointers)));
  }
  size_t n = size_t(PySequence_Fast_GET_SIZE(fast.ptr()));
  check(s.check_count(n));  // bounds n by kMaxHoles, which prepare enforced
  uint64_t values[fr::kMaxHoles];
  PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
  for (size_t i = 0; i < n; ++i) {
    values[i] = PyLong_AsUnsignedLongLong(items[i]);  // ints only: TypeError for anything else
    if (values[i] == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      raise(invalid("pointer " + std::to_string(i) + " ('" + s.holes()[i] +
                    "') must be an int in [0, 2**64), got " + py::repr(items[i]).cast<std::string>()));
    }
  }
  check(s.run(values, n, reinterpret_cast<fr::CUstream>(stream)));
}

std::vector<std::pair<std::string, std::string>> params(const fr::Launcher& l, const std::string& name) {
  int index = 0;
  check(l.find(name, &index));
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& p : l.manifest().kernels[index].params) out.emplace_back(p.name, p.type);
  return out;
}

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw py::value_error(message);
}

// The SegmentTree's arrays by the names of Python's dataclass fields: both directions use it.
using TreeArray = std::vector<int64_t> fr::SegmentTree::*;
constexpr std::pair<const char*, TreeArray> kTreeArrays[] = {
    {"lengths", &fr::SegmentTree::lengths},       {"node_start", &fr::SegmentTree::node_start},
    {"node_end", &fr::SegmentTree::node_end},     {"node_parent", &fr::SegmentTree::node_parent},
    {"node_lo", &fr::SegmentTree::node_lo},       {"node_hi", &fr::SegmentTree::node_hi},
    {"order", &fr::SegmentTree::order},           {"end_node", &fr::SegmentTree::end_node},
    {"path_ptr", &fr::SegmentTree::path_ptr},     {"path_nodes", &fr::SegmentTree::path_nodes}};

py::dict tree_to_dict(const fr::SegmentTree& t) {
  py::dict d;
  for (const auto& [name, array] : kTreeArrays) d[name] = to_numpy(t.*array);
  return d;
}

py::dict segment_tree(const Int64Array& lengths, const Int64Array& breaks, const Int64Array& keys) {
  int64_t rows = lengths.size(), num_breaks = breaks.size();
  require(lengths.ndim() == 1 && breaks.ndim() == 1, "lengths and breaks must be 1-D");
  require(keys.ndim() == 2 && keys.shape(0) == rows && keys.shape(1) == num_breaks,
          "keys must be [len(lengths), len(breaks)]");
  fr::SegmentTree t;
  check(fr::build_segment_tree(rows, lengths.data(), num_breaks, breaks.data(), keys.data(), &t));
  return tree_to_dict(t);
}

// Checks the tables of `lengths.size()` rows, row i at tables[rows[i]] (no rows: tables[i]),
// for the core, which trusts them; returns the core's rows pointer.
const int64_t* checked_table_rows(const Int64Array& lengths, const Int64Array& tables,
                                  const std::optional<Int64Array>& rows, int64_t block_size) {
  require(lengths.ndim() == 1 && tables.ndim() == 2 && (rows || tables.shape(0) == lengths.size()),
          "tables must be [len(lengths), columns]");
  const int64_t* row_index = rows ? rows->data() : nullptr;
  if (rows) {
    require(rows->ndim() == 1 && rows->size() == lengths.size(), "rows must be [len(lengths)]");
    require(std::all_of(row_index, row_index + rows->size(), [&](int64_t r) { return r >= 0 && r < tables.shape(0); }),
            "rows must index tables' rows");
  }
  int64_t capacity = tables.shape(1) * block_size;
  require(std::all_of(lengths.data(), lengths.data() + lengths.size(), [&](int64_t n) { return n <= capacity; }),
          "a length exceeds its table's capacity");
  return row_index;
}

std::optional<py::dict> segment_tree_from_tables(const Int64Array& lengths, const Int64Array& tables,
                                                 int64_t block_size, const std::optional<Int64Array>& rows,
                                                 std::optional<int64_t> unwritten_block) {
  const int64_t* row_index = checked_table_rows(lengths, tables, rows, block_size);
  fr::SegmentTree t;
  check(fr::segment_tree_from_tables(lengths.size(), lengths.data(), tables.data(), row_index, tables.shape(1),
                                     block_size, &t));
  bool unwritten = unwritten_block &&
                   fr::tree_reads_block(t, tables.data(), row_index, tables.shape(1), block_size, *unwritten_block);
  if (unwritten) return std::nullopt;
  return tree_to_dict(t);
}

// A SegmentTree from Python's dataclass.
fr::SegmentTree tree_from_python(const py::object& tree) {
  fr::SegmentTree t;
  for (const auto& [name, array] : kTreeArrays) {
    Int64Array a = tree.attr(name).cast<Int64Array>();
    (t.*array).assign(a.data(), a.data() + a.size());
  }
  return t;
}

py::dict plan(const py::object& tree, int64_t num_qo_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t dtype_bytes, int64_t num_sms, std::array<int64_t, 2> block_ms, int64_t wide_final_rows,
              int64_t target_chunk,
              double reread_weight, int separate_merge, int flat, int64_t final_lanes, int one_tile,
              int early_final, int host_nodes) {
  fr::PlanShape shape;
  shape.num_qo_heads = num_qo_heads, shape.num_kv_heads = num_kv_heads, shape.head_dim = head_dim;
  shape.dtype_bytes = dtype_bytes, shape.num_sms = num_sms, shape.block_ms = block_ms;
  shape.wide_final_rows = wide_final_rows;
  fr::PlanOptions options;
  options.target_chunk = target_chunk, options.reread_weight = reread_weight;
  options.separate_merge = separate_merge, options.flat = flat, options.final_lanes = final_lanes;
  options.one_tile = one_tile, options.early_final = early_final, options.host_nodes = host_nodes;
  fr::Plan p;
  check(fr::make_plan(tree_from_python(tree), shape, options, &p));
  py::dict d;
  d["order"] = to_numpy(p.order);
  d["chunk_start"] = to_numpy(p.chunk_start);
  d["chunk_end"] = to_numpy(p.chunk_end);
  d["chunk_rows"] = to_numpy(p.chunk_rows);
  d["chunk_row_ptr"] = to_numpy(p.chunk_row_ptr);
  d["chunk_table_row"] = to_numpy(p.chunk_table_row);
  d["chunk_entry0"] = to_numpy(p.chunk_entry0);
  d["chunk_open"] = to_numpy(p.chunk_open).attr("astype")("bool");
  d["final_start"] = to_numpy(p.final_start);
  d["merge_ptr"] = to_numpy(p.merge_ptr);
  d["entry_slot"] = to_numpy(p.entry_slot);
  d["common"] = to_numpy(p.common).attr("reshape")(-1, int64_t(fr::kCommonFields.size()));
  std::vector<int32_t> work;
  std::vector<int64_t> work_offsets;
  fr::pack_work_lists(p, &work, &work_offsets);
  py::array_t<int32_t> work_array = to_numpy(work);
  d["work"] = work_array;
  d["work_offsets"] = to_numpy(work_offsets);
  d["num_entries"] = p.num_entries;
  d["computed_nodes"] = p.computed_nodes;
  d["chunk_tokens"] = p.chunk_tokens;
  d["separate_merge"] = p.separate_merge;
  d["final_lanes"] = p.final_lanes;
  d["final_block_m"] = shape.final_block_m(p.final_lanes);
  d["as_paged_decode"] = p.as_paged_decode;
  d["early_final"] = p.early_final;
  d["final_heads_first"] = p.final_heads_first;
  d["estimated_us"] = p.estimated_us;
  // Views of `work`: item_runs() writes the run splits where they are uploaded from.
  py::dict items;
  for (size_t i = 0; i < p.items.size(); ++i) {
    int64_t at = work_offsets[fr::kFirstItems + i], size = int64_t(p.items[i].records.size());
    items[py::int_(p.items[i].block_m)] = work_array[py::slice(at, at + size, 1)].attr("reshape")(
        p.items[i].count(), static_cast<int64_t>(fr::kTreeItemFields.size()));
  }
  d["items"] = items;
  py::dict heads_first;
  for (const fr::ItemList& list : p.items) heads_first[py::int_(list.block_m)] = list.heads_first;
  d["heads_first"] = heads_first;
  return d;
}

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// Row i of `final_start` reads the allocator's table mirror row rows[i] (in place); the run
// splits are written into `records` in place (a view of the plan's work buffer), so it must be a
// writeable C-contiguous int32 array, never a converted copy.
int item_runs(py::array records, const Int32Array& final_start, const Int64Array& tables, const Int64Array& rows,
              int64_t block_size) {
  int64_t fields = int64_t(fr::kTreeItemFields.size());
  require(records.dtype().is(py::dtype::of<int32_t>()) && records.writeable() &&
              (records.flags() & py::array::c_style),
          "records must be a writeable C-contiguous int32 array");
  require(records.ndim() == 2 && records.shape(1) == fields, "records must be [items, len(TREE_ITEM_FIELDS)]");
  require(final_start.ndim() == 1 && rows.ndim() == 1 && rows.size() == final_start.size(),
          "rows must be [len(final_start)]");
  require(tables.ndim() == 2, "tables must be 2-D");
  require(std::all_of(rows.data(), rows.data() + rows.size(), [&](int64_t r) { return r >= 0 && r < tables.shape(0); }),
          "rows must index tables' rows");
  require(block_size > 0, "block_size must be positive");
  int32_t* data = static_cast<int32_t*>(records.mutable_data());
  fr::ItemList items;
  items.records.assign(data, data + records.size());
  std::vector<int32_t> starts(final_start.data(), final_start.data() + final_start.size());
  int runs = fr::item_runs(&items, starts, tables.data(), rows.data(), tables.shape(1), block_size);
  std::copy(items.records.begin(), items.records.end(), data);
  return runs;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "Launcher for flash-reasoning's ahead-of-time compiled Triton kernels.\n\n"
      "Loads cubins from <artifact_root>/<arch>/ (described by manifest.json) through the CUDA\n"
      "driver, which is opened at run time (libcuda.so.1, or $FLASH_REASONING_LIBCUDA).\n"
      "Takes raw device pointers, scalars and stream handles as Python ints; no torch needed.\n"
      "Every failure raises CoreError (a RuntimeError) with an integer .code.";

  g_error = PyErr_NewExceptionWithDoc("flash_reasoning._core.CoreError",
                                      "A launcher failure; .code is the status code, the message names the "
                                      "failing step and, for driver failures, the CUDA error name.",
                                      PyExc_RuntimeError, nullptr);
  if (!g_error) throw py::error_already_set();
  m.attr("CoreError") = py::handle(g_error);

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

  m.def("segment_tree", &segment_tree, py::arg("lengths"), py::arg("breaks"), py::arg("keys"),
        "The segment tree (a dict of arrays) of rows whose token t is keys[row, c] for "
        "breaks[c] <= t < breaks[c + 1].");
  m.def("segment_tree_from_tables", &segment_tree_from_tables, py::arg("lengths"), py::arg("tables"),
        py::arg("block_size"), py::arg("rows") = py::none(), py::arg("unwritten_block") = py::none(),
        "The segment tree the C ABI reads from block tables (row i's table: tables[rows[i]], default "
        "tables[i]); None when some token lies in unwritten_block.");
  m.def("plan", &plan, py::arg("tree"), py::arg("num_qo_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("dtype_bytes"), py::arg("num_sms"), py::arg("block_ms"), py::arg("wide_final_rows"),
        py::arg("target_chunk") = 0,
        py::arg("reread_weight") = fr::kRereadWeight, py::arg("separate_merge") = -1,
        py::arg("flat") = -1, py::arg("final_lanes") = 0, py::arg("one_tile") = -1,
        py::arg("early_final") = -1, py::arg("host_nodes") = -1,
        "The tree-attention plan of a SegmentTree (a dict of arrays).");
  m.def("item_runs", &item_runs, py::arg("records"), py::arg("final_start"), py::arg("tables"), py::arg("rows"),
        py::arg("block_size"),
        "The runs of consecutive slots one launch's items lie in (1 or 2; 0: the page kernels), writing each "
        "item's run_split when 2 (csrc/core/planner.h); branch i's block table is tables[rows[i]], read in place.");
  m.attr("MAX_ITEM_RUNS") = fr::kMaxItemRuns;
  m.def("heads_first_order", &fr::heads_first_order, py::arg("planned_lengths"), py::arg("items"),
        py::arg("num_kv_heads"), py::arg("num_sms"),
        "Whether a partial launch of `items` items (of these planned lengths, one per chunk) x `num_kv_heads` "
        "runs each item's KV heads together (csrc/core/planner.h).");
  m.def("final_heads_first", &fr::final_heads_first, py::arg("final_lanes"), py::arg("has_common"),
        py::arg("final_programs"), py::arg("kv_row_bytes"),
        "Whether a final launch of `final_programs` programs of `final_lanes` branches (reading shared ranges "
        "or not) over token rows of `kv_row_bytes` (a token's K across the KV heads) runs each program's KV "
        "heads together (csrc/core/planner.h).");
  m.def("final_programs_per_sm", &fr::final_programs_per_sm, py::arg("final_lanes"),
        "Final-kernel programs the cost model counts resident per SM at `final_lanes` lanes "
        "(csrc/core/planner.h).");
  m.def(
      "leaves_outweigh_root",
      [](int64_t root_tokens, int64_t root_tiles, int64_t root_programs, bool wide_tile, int64_t leaf_tokens,
         int64_t num_kv_heads, int64_t head_dim, int64_t dtype_bytes, int64_t num_sms) {
        fr::PlanShape shape;
        shape.num_kv_heads = num_kv_heads, shape.head_dim = head_dim, shape.dtype_bytes = dtype_bytes;
        shape.num_sms = num_sms;
        return fr::leaves_outweigh_root(root_tokens, root_tiles, root_programs, wide_tile, leaf_tokens, shape);
      },
      py::arg("root_tokens"), py::arg("root_tiles"), py::arg("root_programs"), py::arg("wide_tile"),
      py::arg("leaf_tokens"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype_bytes"),
      py::arg("num_sms"),
      "Whether a lone root's leaves take longer to read than the root takes, by the cost model's terms "
      "(csrc/core/planner.h).");
  m.attr("HEADS_FIRST_LENGTH_RATIO") = fr::kHeadsFirstLengthRatio;
  m.attr("HEADS_FIRST_PROGRAMS_PER_SM") = fr::kHeadsFirstProgramsPerSm;
  m.attr("TREE_ITEM_FIELDS") = py::cast(std::vector<std::string>(fr::kTreeItemFields.begin(), fr::kTreeItemFields.end()));
  m.attr("COMMON_FIELDS") = py::cast(std::vector<std::string>(fr::kCommonFields.begin(), fr::kCommonFields.end()));
  m.attr("REREAD_WEIGHT") = fr::kRereadWeight;
  m.attr("SEPARATE_MERGE_STEPS") = fr::kSeparateMergeSteps;
  m.attr("MERGE_SLOTS_PER_STEP") = fr::kMergeSlotsPerStep;

  py::class_<fr::Launcher>(m, "Launcher", "The kernels of one arch folder (<artifact_root>/<arch>).")
      .def(py::init([](const py::object& arch_dir, int device) {
             std::unique_ptr<fr::Launcher> l;
             check(fr::Launcher::open(fspath(arch_dir), device, &l));
             return l;
           }),
           py::arg("arch_dir"), py::arg("device") = 0)
      .def_property_readonly("arch", [](const fr::Launcher& l) { return l.manifest().arch; })
      .def_property_readonly("package_version",
                             [](const fr::Launcher& l) { return l.manifest().package_version; },
                             "The package version that built the manifest ('' when it does not say).")
      .def("kernel_names",
           [](const fr::Launcher& l) {
             std::vector<std::string> names;
             for (const auto& k : l.manifest().kernels) names.push_back(k.name);
             return names;
           })
      .def(
          "pick",
          [](const fr::Launcher& l, const std::string& rule, int64_t max_tokens, int64_t programs, int64_t num_sms) {
            int kernel = 0;
            check(l.manifest().dispatch.pick(rule, max_tokens, programs, num_sms, &kernel));
            return l.manifest().kernels[kernel].name;
          },
          py::arg("rule"), py::arg("max_tokens"), py::arg("programs") = -1, py::arg("num_sms") = -1,
          "The kernel the manifest's dispatch rules pick for `rule` (e.g. 'tree_final/float16/128') and a "
          "launch of `programs` programs on `num_sms` SMs, each of at most max_tokens (-1: unknown), as a C "
          "caller gets it.")
      .def(
          "paged_decode_splits",
          [](const fr::Launcher& l, int64_t num_seqs, int64_t programs_per_seq, int64_t max_seq_len, int64_t num_sms) {
            return fr::paged_decode_splits(l.manifest().dispatch, num_seqs, programs_per_seq, max_seq_len, num_sms);
          },
          py::arg("num_seqs"), py::arg("programs_per_seq"), py::arg("max_seq_len"), py::arg("num_sms"),
          "Splits per sequence of the C ABI's paged decode (Python: dispatch.num_splits).")
      .def("params", &params, py::arg("name"), "(name, type) of the caller-supplied params (scratch excluded).")
      .def("launch", &launch, py::arg("name"), py::arg("grid"), py::arg("args"), py::arg("stream"),
           "Launch kernel `name` on `stream` (a CUstream as int; 0 = default stream). Asynchronous.")
      .def("prepare", &prepare, py::arg("launches"), py::arg("holes"), py::keep_alive<0, 1>(),
           "Check and pack launches, each (name, grid, args), once: a Hole(i) in args stands for the pointer "
           "that each run supplies as pointers[i], named holes[i] in errors. Returns PreparedLaunches.");

  py::class_<Hole>(m, "Hole", "In Launcher.prepare's args: the pointer each run supplies as pointers[index].")
      .def(py::init([](int index) {
             if (index < 0) raise(invalid("hole index must be >= 0, got " + std::to_string(index)));
             return Hole{index};
           }),
           py::arg("index"))
      .def_readonly("index", &Hole::index)
      .def("__repr__", [](const Hole& h) { return "Hole(" + std::to_string(h.index) + ")"; });

  py::class_<fr::LaunchSequence>(m, "PreparedLaunches",
                                 "Launches checked and packed once (Launcher.prepare); run fills the holes.")
      .def("run", &run_sequence, py::arg("pointers"), py::arg("stream"),
           "Check the pointers (one per hole: non-null, 16-byte aligned), then launch each "
           "launch with a non-empty grid on `stream` (a CUstream as int). Asynchronous; allocates nothing.")
      .def_property_readonly("holes", &fr::LaunchSequence::holes)
      .def_property_readonly("num_launches", &fr::LaunchSequence::num_launches,
                             "Launches with work (those with an empty grid are dropped).");
}
