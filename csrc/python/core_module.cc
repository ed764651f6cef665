// pybind11 front end of the launcher core: type conversion only, no logic.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <optional>

#include "ops/paged_decode.h"
#include "ops/tree_attention_plan.h"
#include "planner/planner.h"
#include "planner/segment_tree.h"
#include "runtime/arch.h"
#include "runtime/context.h"
#include "runtime/driver.h"
#include "runtime/launch_sequence.h"
#include "runtime/launcher.h"

namespace py = pybind11;
namespace fr = flash_reasoning;

namespace {

// CoreError, and its InvalidArgument (also a ValueError: bad input reads as Python's bad
// input); one reference each held for the process lifetime.
PyObject* g_error = nullptr;
PyObject* g_invalid_argument = nullptr;

// Raises CoreError(message), InvalidArgument for bad caller input, with .code = the status code.
[[noreturn]] void raise(const fr::Status& st) {
  PyObject* type = st.code == fr::Code::kInvalidArgument ? g_invalid_argument : g_error;
  py::object exc = py::reinterpret_borrow<py::object>(type)(st.message);
  exc.attr("code") = static_cast<int>(st.code);
  PyErr_SetObject(type, exc.ptr());
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
      raise(invalid("pointer " + std::to_string(i) + " ('" + s.holes()[i] + "') must be an int in [0, 2**64), got " +
                    py::repr(items[i]).cast<std::string>()));
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
    {"lengths", &fr::SegmentTree::lengths},   {"node_start", &fr::SegmentTree::node_start},
    {"node_end", &fr::SegmentTree::node_end}, {"node_parent", &fr::SegmentTree::node_parent},
    {"node_lo", &fr::SegmentTree::node_lo},   {"node_hi", &fr::SegmentTree::node_hi},
    {"order", &fr::SegmentTree::order},       {"end_node", &fr::SegmentTree::end_node},
    {"path_ptr", &fr::SegmentTree::path_ptr}, {"path_nodes", &fr::SegmentTree::path_nodes}};

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

fr::AttentionShape shape_from(const py::dict& shape) {
  fr::AttentionShape s;
  s.num_qo_heads = shape["num_qo_heads"].cast<int64_t>();
  s.num_kv_heads = shape["num_kv_heads"].cast<int64_t>();
  s.head_dim = shape["head_dim"].cast<int64_t>();
  s.dtype = shape["dtype"].cast<std::string>();
  s.block_size = shape["block_size"].cast<int64_t>();
  s.num_blocks = shape["num_blocks"].cast<int64_t>();
  s.sm_scale = shape["sm_scale"].cast<double>();
  return s;
}

// The planner's options by the names of Python's planner.PlanOptions: -1 (or 0 for counts)
// where the cost model chooses.
fr::PlanOptions options_from(const py::dict& options) {
  fr::PlanOptions o;
  auto get = [&](const char* name, auto* field) {
    if (options.contains(name)) *field = options[name].cast<std::remove_pointer_t<decltype(field)>>();
  };
  get("target_chunk", &o.target_chunk);
  get("separate_merge", &o.separate_merge);
  get("flat", &o.flat);
  get("final_lanes", &o.final_lanes);
  get("one_tile", &o.one_tile);
  get("early_final", &o.early_final);
  get("host_nodes", &o.host_nodes);
  get("slot_runs", &o.slot_runs);
  get("query_tiles", &o.query_tiles);
  get("sequence_folds", &o.sequence_folds);
  return o;
}

py::object arg_value(const fr::Arg& a) {
  switch (a.kind) {
    case fr::Arg::Kind::kInt: return py::int_(a.i);
    case fr::Arg::Kind::kUInt: return py::int_(a.u);
    case fr::Arg::Kind::kFloat: return py::float_(a.f);
    default: return py::none();
  }
}

// An op's launches for Python: (kernel name, grid, args, rule key, max tokens, programs), each
// arg (parameter name, source, value, rows, cols) with source "value" (value: the number),
// "call" (value: the per-call pointer's index) or "workspace" (value: the byte offset).
py::list launch_list(const fr::Context& ctx, const std::vector<fr::OpLaunch>& launches) {
  static const char* const kSources[] = {"value", "call", "workspace"};
  py::list out;
  for (const fr::OpLaunch& l : launches) {
    py::list args;
    for (const fr::LaunchArg& a : l.launch.args) {
      py::object value = a.source == fr::LaunchArg::Source::kValue ? arg_value(a.value) : py::int_(a.index);
      args.append(py::make_tuple(a.name, kSources[int(a.source)], value, a.rows, a.cols));
    }
    const int64_t* g = l.launch.grid;
    out.append(py::make_tuple(ctx.kernel(l.launch.kernel).name, py::make_tuple(g[0], g[1], g[2]), args, l.rule_key,
                              l.max_tokens, l.programs));
  }
  return out;
}

py::dict plan_arrays(const fr::TreeAttentionPlan& plan) {
  const fr::Plan& p = plan.plan();
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
  d["query_tiles"] = to_numpy(p.query_tiles).attr("reshape")(-1, int64_t(fr::kQueryTileFields.size()));
  d["num_entries"] = p.num_entries;
  d["separate_merge"] = p.separate_merge;
  d["final_lanes"] = p.final_lanes;
  d["final_block_m"] = plan.plan_shape().final_block_m(p.final_lanes);
  d["as_paged_decode"] = p.as_paged_decode;
  d["early_final"] = p.early_final;
  d["final_heads_first"] = p.final_heads_first;
  std::vector<int64_t> drafts;
  for (const fr::DraftMask& m : plan.drafts()) drafts.insert(drafts.end(), {m.tokens, int64_t(m.allowed)});
  d["draft_masks"] = to_numpy(drafts).attr("reshape")(-1, 2);
  py::dict items, heads_first;
  for (const fr::ItemList& list : p.items) {
    items[py::int_(list.block_m)] =
        to_numpy(list.records).attr("reshape")(list.count(), int64_t(fr::kTreeItemFields.size()));
    heads_first[py::int_(list.block_m)] = list.heads_first;
  }
  d["items"] = items;
  d["heads_first"] = heads_first;
  py::dict stats;
  stats["nodes"] = plan.tree().num_nodes();
  stats["computed_nodes"] = p.computed_nodes;
  stats["chunk_tokens"] = p.chunk_tokens;
  stats["estimated_us"] = p.estimated_us;
  stats["partial_chunks"] = p.chunk_start.size();
  stats["entries"] = p.num_entries;
  py::dict programs;
  for (const fr::ItemList& list : p.items)
    programs[py::int_(list.block_m)] = list.count() * plan.plan_shape().num_kv_heads;
  stats["partial_programs"] = programs;
  d["stats"] = stats;
  return d;
}

using Int32Table = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using Int64Table = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// A plan of `tree` (Python's SegmentTree) whose row i's blocks are tables[i] (None: planning
// only); `context` None plans without kernels (the PyTorch path, planning tools); `draft_masks`
// (None: none) row i's DraftMask as int64 [tokens, allowed bits].
std::unique_ptr<fr::TreeAttentionPlan> make_tree_plan(fr::Context* context, const py::dict& shape,
                                                      const py::object& tree, const std::optional<Int32Table>& tables,
                                                      int64_t extra_blocks, const py::dict& options, int64_t num_sms,
                                                      const std::optional<Int64Table>& draft_masks,
                                                      const std::optional<Int32Table>& row_sequence) {
  fr::SegmentTree t = tree_from_python(tree);
  require(!tables || (tables->ndim() == 2 && tables->shape(0) == t.num_rows()),
          "tables must be [num_branches, columns]");
  require(
      !draft_masks || (draft_masks->ndim() == 2 && draft_masks->shape(0) == t.num_rows() && draft_masks->shape(1) == 2),
      "draft_masks must be int64 [num_branches, 2]");
  require(!row_sequence || (row_sequence->ndim() == 1 && row_sequence->shape(0) == t.num_rows()),
          "row_sequence must be int32 [num_branches]");
  std::unique_ptr<fr::TreeAttentionPlan> plan;
  check(
      fr::TreeAttentionPlan::create(context, shape_from(shape), std::move(t), tables ? tables->data() : nullptr,
                                    tables ? tables->shape(1) : 0, extra_blocks, options_from(options), &plan, num_sms,
                                    draft_masks ? reinterpret_cast<const fr::DraftMask*>(draft_masks->data()) : nullptr,
                                    row_sequence ? row_sequence->data() : nullptr));
  return plan;
}

py::dict regions(const fr::TreeAttentionPlan& plan) {
  static const std::pair<const char*, fr::Region> kNames[] = {{"work", fr::Region::kWork},
                                                              {"tables", fr::Region::kTables},
                                                              {"lengths", fr::Region::kLengths},
                                                              {"draft_masks", fr::Region::kDraftMasks},
                                                              {"partial_out", fr::Region::kPartialOut},
                                                              {"partial_lse", fr::Region::kPartialLse}};
  py::dict d;
  for (const auto& [name, region] : kNames)
    d[name] = py::make_tuple(plan.region(region).offset, plan.region(region).bytes);
  return d;
}

py::array_t<uint8_t> image(const fr::TreeAttentionPlan& plan) { return to_numpy(plan.image()); }

// Pointers as the core takes them: Python ints, converted without a sequence object.
uint64_t address(py::handle h) {
  unsigned long long v = PyLong_AsUnsignedLongLong(h.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

std::vector<uint64_t> addresses(const py::sequence& pointers, size_t count, const char* what) {
  require(pointers.size() == count,
          std::string(what) + " takes " + std::to_string(count) + " pointers, got " + std::to_string(pointers.size()));
  std::vector<uint64_t> out;
  for (py::handle h : pointers) out.push_back(address(h));
  return out;
}

fr::DecodeOptions decode_options(const fr::Context& ctx, int64_t splits, const std::string& kernel) {
  fr::DecodeOptions o;
  o.splits = splits;
  if (!kernel.empty()) check(ctx.find(kernel, &o.kernel));
  return o;
}

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// Row i of `final_start` reads the allocator's table mirror row rows[i] (in place); the run
// splits are written into `records` in place (a view of the plan's work buffer), so it must be a
// writeable C-contiguous int32 array, never a converted copy.
int item_runs(py::array records, const Int32Array& final_start, const Int64Array& tables, const Int64Array& rows,
              int64_t block_size) {
  int64_t fields = int64_t(fr::kTreeItemFields.size());
  require(records.dtype().is(py::dtype::of<int32_t>()) && records.writeable() && (records.flags() & py::array::c_style),
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
      "Every failure raises CoreError (a RuntimeError) with an integer .code; bad caller input\n"
      "(FR_INVALID_ARGUMENT) raises its subclass InvalidArgument, also a ValueError.";

  g_error = PyErr_NewExceptionWithDoc("flash_reasoning._core.CoreError",
                                      "A launcher failure; .code is the status code, the message names the "
                                      "failing step and, for driver failures, the CUDA error name.",
                                      PyExc_RuntimeError, nullptr);
  if (!g_error) throw py::error_already_set();
  m.attr("CoreError") = py::handle(g_error);
  py::tuple invalid_bases = py::make_tuple(py::handle(g_error), py::handle(PyExc_ValueError));
  g_invalid_argument = PyErr_NewExceptionWithDoc("flash_reasoning._core.InvalidArgument",
                                                 "Bad caller input (FR_INVALID_ARGUMENT): a CoreError and a "
                                                 "ValueError; the message names the argument.",
                                                 invalid_bases.ptr(), nullptr);
  if (!g_invalid_argument) throw py::error_already_set();
  m.attr("InvalidArgument") = py::handle(g_invalid_argument);

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
  m.def("item_runs", &item_runs, py::arg("records"), py::arg("final_start"), py::arg("tables"), py::arg("rows"),
        py::arg("block_size"),
        "The runs of consecutive slots one launch's items lie in (1 or 2; 0: the page kernels), writing each "
        "item's run_split when 2 (csrc/planner/planner.h); branch i's block table is tables[rows[i]], read in place.");
  m.attr("MAX_ITEM_RUNS") = fr::kMaxItemRuns;
  m.def("heads_first_order", &fr::heads_first_order, py::arg("planned_lengths"), py::arg("items"),
        py::arg("num_kv_heads"), py::arg("num_sms"),
        "Whether a partial launch of `items` items (of these planned lengths, one per chunk) x `num_kv_heads` "
        "runs each item's KV heads together (csrc/planner/planner.h).");
  m.def("final_heads_first", &fr::final_heads_first, py::arg("final_lanes"), py::arg("has_common"),
        py::arg("final_programs"), py::arg("kv_row_bytes"),
        "Whether a final launch of `final_programs` programs of `final_lanes` branches (reading shared ranges "
        "or not) over token rows of `kv_row_bytes` (a token's K across the KV heads) runs each program's KV "
        "heads together (csrc/planner/planner.h).");
  m.def("final_programs_per_sm", &fr::final_programs_per_sm, py::arg("final_lanes"),
        "Final-kernel programs the cost model counts resident per SM at `final_lanes` lanes "
        "(csrc/planner/planner.h).");
  m.def("step_us", &fr::step_us, py::arg("head_dim"),
        "The cost model's serial step (a program's KV tile) at `head_dim`, in us (csrc/planner/planner.h).");
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
      py::arg("leaf_tokens"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype_bytes"), py::arg("num_sms"),
      "Whether a lone root's leaves take longer to read than the root takes, by the cost model's terms "
      "(csrc/planner/planner.h).");
  m.attr("HEADS_FIRST_LENGTH_RATIO") = fr::kHeadsFirstLengthRatio;
  m.attr("HEADS_FIRST_PROGRAMS_PER_SM") = fr::kHeadsFirstProgramsPerSm;
  m.attr("TREE_ITEM_FIELDS") =
      py::cast(std::vector<std::string>(fr::kTreeItemFields.begin(), fr::kTreeItemFields.end()));
  m.attr("COMMON_FIELDS") = py::cast(std::vector<std::string>(fr::kCommonFields.begin(), fr::kCommonFields.end()));
  m.attr("QUERY_TILE_FIELDS") =
      py::cast(std::vector<std::string>(fr::kQueryTileFields.begin(), fr::kQueryTileFields.end()));
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
      .def_property_readonly(
          "package_version", [](const fr::Launcher& l) { return l.manifest().package_version; },
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

  py::class_<fr::Context>(m, "Context",
                          "The kernels of the arch serving one device (or, host-only, of a named arch): the "
                          "launcher, the dispatch rules and the ops that build launches from them.")
      .def(py::init([](const py::object& artifact_root, int device) {
             std::unique_ptr<fr::Context> c;
             check(fr::Context::open(fspath(artifact_root), device, &c));
             return c;
           }),
           py::arg("artifact_root"), py::arg("device"))
      .def_static(
          "open_host_only",
          [](const py::object& artifact_root, const std::string& arch, int num_sms) {
            std::unique_ptr<fr::Context> c;
            check(fr::Context::open_host_only(fspath(artifact_root), arch, &c, num_sms));
            return c;
          },
          py::arg("artifact_root"), py::arg("arch"), py::arg("num_sms") = int(fr::Context::kHostOnlySms),
          "A context that plans and builds launches for `arch` on `num_sms` SMs without a GPU.")
      .def_property_readonly("arch", &fr::Context::arch)
      .def_property_readonly("num_sms", &fr::Context::num_sms)
      .def_property_readonly("host_only", &fr::Context::host_only)
      .def_property_readonly("package_version", &fr::Context::package_version)
      .def(
          "override_rules", [](fr::Context& c, const std::string& json) { check(c.override_rules(json)); },
          py::arg("json"), "Replace the manifest's rule lists that `json` names (a tuning table chosen at run time).")
      .def(
          "pick",
          [](const fr::Context& c, const std::string& rule, int64_t max_tokens, int64_t programs) {
            int kernel = 0;
            check(c.pick(rule, max_tokens, programs, &kernel));
            return c.kernel(kernel).name;
          },
          py::arg("rule"), py::arg("max_tokens"), py::arg("programs") = -1,
          "The kernel the dispatch rules pick for `rule` and a launch of `programs` programs of at most "
          "`max_tokens` tokens each (-1: unknown).")
      .def(
          "paged_decode_launches",
          [](const fr::Context& c, const py::dict& shape, int64_t num_seqs, int64_t max_blocks, bool may_split,
             int64_t splits, const std::string& kernel) {
            fr::DecodeLaunches d;
            check(fr::paged_decode_launches(c, shape_from(shape), num_seqs, max_blocks, may_split,
                                            decode_options(c, splits, kernel), &d));
            return py::make_tuple(launch_list(c, d.launches), d.splits, d.workspace_bytes);
          },
          py::arg("shape"), py::arg("num_seqs"), py::arg("max_blocks"), py::arg("may_split"), py::arg("splits") = 0,
          py::arg("kernel") = "",
          "(launches, splits, workspace bytes) of a paged decode (launch_list's format; call pointers in "
          "PAGED_DECODE_POINTERS order); `splits` and `kernel` force the split count and the decode kernel (tuning).")
      .def(
          "paged_decode",
          [](fr::Context& c, const py::dict& shape, int64_t num_seqs, int64_t max_blocks, const py::sequence& pointers,
             uint64_t workspace, size_t workspace_bytes, uintptr_t stream) {
            std::vector<uint64_t> p = addresses(pointers, fr::kDecodePointers.size(), "paged_decode");
            check(fr::paged_decode(c, shape_from(shape), num_seqs, max_blocks, p.data(), workspace, workspace_bytes,
                                   fr::DecodeOptions(), reinterpret_cast<fr::CUstream>(stream)));
          },
          py::arg("shape"), py::arg("num_seqs"), py::arg("max_blocks"), py::arg("pointers"), py::arg("workspace"),
          py::arg("workspace_bytes"), py::arg("stream"),
          "Run a paged decode on `stream` (pointers in PAGED_DECODE_POINTERS order; workspace 0: never split).")
      .def(
          "paged_decode_workspace",
          [](const fr::Context& c, const py::dict& shape, int64_t num_seqs, int64_t max_blocks) {
            size_t bytes = 0;
            check(fr::paged_decode_workspace(c, shape_from(shape), num_seqs, max_blocks, &bytes));
            return bytes;
          },
          py::arg("shape"), py::arg("num_seqs"), py::arg("max_blocks"),
          "Bytes of workspace a paged decode splits with (0: it would not split).")
      .def(
          "launch",
          [](fr::Context& c, const std::string& name, const std::array<int64_t, 3>& grid, const py::sequence& args,
             uintptr_t stream) { launch(c.launcher(), name, grid, args, stream); },
          py::arg("name"), py::arg("grid"), py::arg("args"), py::arg("stream"),
          "Launch kernel `name` with positional args (tensor maps spread, as runtime.Launch holds them): the "
          "tuner's candidates. Asynchronous.")
      .def(
          "append_kv_launches",
          [](const fr::Context& c, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim) {
            std::vector<fr::OpLaunch> launches;
            check(fr::append_kv_launch(c, num_tokens, num_kv_heads, head_dim, &launches));
            return launch_list(c, launches);
          },
          py::arg("num_tokens"), py::arg("num_kv_heads"), py::arg("head_dim"))
      .def(
          "append_kv",
          [](fr::Context& c, const py::sequence& pointers, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
             uintptr_t stream) {
            std::vector<uint64_t> p = addresses(pointers, fr::kAppendPointers.size(), "append_kv");
            check(
                fr::append_kv(c, p.data(), num_tokens, num_kv_heads, head_dim, reinterpret_cast<fr::CUstream>(stream)));
          },
          py::arg("pointers"), py::arg("num_tokens"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("stream"),
          "Write K/V rows into pool slots on `stream` (pointers in APPEND_KV_POINTERS order).");
  m.attr("HOST_ONLY_SMS") = int(fr::Context::kHostOnlySms);
  m.attr("MAX_DRAFT_TOKENS") = fr::kMaxDraftTokens;
  m.attr("PLAN_POINTERS") = py::cast(std::vector<std::string>(fr::kPlanPointers.begin(), fr::kPlanPointers.end()));
  m.attr("PAGED_DECODE_POINTERS") =
      py::cast(std::vector<std::string>(fr::kDecodePointers.begin(), fr::kDecodePointers.end()));
  m.attr("APPEND_KV_POINTERS") =
      py::cast(std::vector<std::string>(fr::kAppendPointers.begin(), fr::kAppendPointers.end()));

  py::class_<fr::TreeAttentionPlan>(m, "TreePlan",
                                    "tree_attention's plan as the C++ core builds it for both front ends: the "
                                    "planner's lists, the launches, the workspace layout and its image.")
      .def(py::init(&make_tree_plan), py::arg("context"), py::arg("shape"), py::arg("tree"), py::arg("tables"),
           py::arg("extra_blocks"), py::arg("options"), py::arg("num_sms") = 0, py::arg("draft_masks") = py::none(),
           py::arg("row_sequence") = py::none(), py::keep_alive<1, 2>(),
           "Plan `tree` (a SegmentTree) over `tables` (int32 [num_branches, columns]); `context` None plans "
           "without kernels. `shape`: num_qo_heads, num_kv_heads, head_dim, dtype, block_size, num_blocks, "
           "sm_scale; `options`: planner.PlanOptions' fields as ints; `num_sms` 0: the context's; `draft_masks`: "
           "int64 [num_branches, 2], each row's draft tokens (beyond its tree length) and allowed bits; "
           "`row_sequence`: int32 [num_branches], each row's sequence (rows of one consecutive: query tiles).")
      .def_property_readonly("arrays", &plan_arrays, "The plan's lists (planner.PlanArrays' fields).")
      .def_property_readonly(
          "launches",
          [](const fr::TreeAttentionPlan& p) {
            return p.context() ? launch_list(*p.context(), p.launches()) : py::list();
          },
          "(kernel name, grid, args, rule key, max tokens, programs) of each launch; args as "
          "(name, 'value' | 'call' | 'workspace', value, rows, cols).")
      .def_property_readonly(
          "slot_runs",
          [](const fr::TreeAttentionPlan& p) {
            py::dict d;
            for (size_t i = 0; i < p.plan().items.size(); ++i)
              d[py::int_(p.plan().items[i].block_m)] = p.slot_runs()[i];
            return d;
          },
          "Per row tile: the runs of consecutive slots its partial launch reads each item as (0: the pages).")
      .def_property_readonly("max_blocks", &fr::TreeAttentionPlan::max_blocks)
      .def_property_readonly("workspace_bytes", &fr::TreeAttentionPlan::workspace_bytes)
      .def_property_readonly("regions", &regions, "(byte offset, bytes) of each workspace region by name.")
      .def("image", &image, "The workspace's first bytes as the launches expect them (work lists, tables, lengths).")
      .def(
          "bind", [](fr::TreeAttentionPlan& p, uint64_t workspace) { check(p.bind(workspace)); }, py::arg("workspace"),
          "Prepare the launches against the device workspace (holding image()).")
      .def(
          "run",
          [](const fr::TreeAttentionPlan& p, uint64_t q, uint64_t k_pool, uint64_t v_pool, uint64_t out,
             uintptr_t stream) {
            check(p.run(reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k_pool),
                        reinterpret_cast<const void*>(v_pool), reinterpret_cast<void*>(out),
                        reinterpret_cast<fr::CUstream>(stream)));
          },
          py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("out"), py::arg("stream"),
          "Launch the plan with this call's pointers on `stream`. Asynchronous; allocates nothing.");
}
