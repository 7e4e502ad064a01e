// The round work of the KV store applied in place on the CPU: block-table updates with the order
// check (ninfer_kv_apply_tables) and page writes -- COW copies between pages and Host restores
// from a payload (ninfer_kv_write_pages).
//
// These are the CPU lowering of ninfer_kv.device.work.apply_work; the jnp form is the reference
// and both give the same bits (tests/store/test_work_ffi.py).  XLA's CPU backend copies a whole
// block table out of a conditional and a whole float plane that a scatter writes; these handlers
// write only the entries and pages the work names, in the operands' own (aliased) buffers.
//
// The order record `sync` is int32 (serial, fault[3], owner) and a work's `stamp` int32 (serial,
// store).  A work applies when the state is healthy (serial >= 0), its serial equals the state's
// and it comes from the state's store (either side 0: unbound).  Otherwise nothing of it is
// written, every table entry becomes the sentinel page -1, serial becomes -1 (POISONED) and the
// first such slip is kept in fault: (serial before it, its serial, its store).
//
// Level-independent (plain loops and memcpy): compiled once, outside the instruction-set levels.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "stream_copy.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ninfer_kv_ffi {
namespace {

constexpr int32_t kPoisoned = -1;
constexpr int32_t kSentinelPage = -1;

using S32Vector = ffi::Buffer<ffi::S32, 1>;
using S32Matrix = ffi::Buffer<ffi::S32, 2>;

std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

ffi::Error CheckOrderOperands(const S32Vector& sync, const S32Vector& stamp) {
  if (sync.dimensions()[0] != 5) {
    return ffi::Error::InvalidArgument("sync must have shape (5,), got " + Dims(sync.dimensions()));
  }
  if (stamp.dimensions()[0] != 2) {
    return ffi::Error::InvalidArgument("stamp must have shape (2,), got " + Dims(stamp.dimensions()));
  }
  return ffi::Error::Success();
}

// Whether the work stamped `stamp` is the next work of a state whose order record is `sync`.
bool InOrder(const int32_t* sync, const int32_t* stamp) {
  const int32_t serial = sync[0], owner = sync[4], work_serial = stamp[0], work_store = stamp[1];
  const bool same_store = owner == work_store || owner == 0 || work_store == 0;
  return serial == work_serial && serial >= 0 && same_store;
}

// An index as JAX's `.at[i].set(..., mode="drop")` reads it: negative values count from the end
// once, and what is still outside [0, n) is dropped (-1 here).
int64_t DropIndex(int64_t i, int64_t n) {
  if (i < 0) i += n;
  return (i >= 0 && i < n) ? i : -1;
}

// operands: sync (5,), stamp (2,), then T tables (C, L) followed by their T update lists (3, U)
// results: sync (5,), then the T tables (aliased to their operands)
ffi::Error ApplyTablesImpl(S32Vector sync, S32Vector stamp, ffi::RemainingArgs rest, ffi::Result<S32Vector> sync_out,
                           ffi::RemainingRets tables_out) {
  if (auto err = CheckOrderOperands(sync, stamp); err.failure()) return err;
  const size_t pools = tables_out.size();
  if (rest.size() != 2 * pools) {
    return ffi::Error::InvalidArgument("apply_tables: " + std::to_string(pools) + " tables need " +
                                       std::to_string(2 * pools) + " operands after the stamp, got " +
                                       std::to_string(rest.size()));
  }
  std::vector<S32Matrix> tables, updates;
  for (size_t i = 0; i < pools; ++i) {
    auto out = tables_out.get<S32Matrix>(i);
    auto in = rest.get<S32Matrix>(i);
    auto upd = rest.get<S32Matrix>(pools + i);
    if (!out.has_value() || !in.has_value() || !upd.has_value()) {
      return ffi::Error::InvalidArgument("apply_tables: tables and updates must be int32 matrices");
    }
    if ((*upd).dimensions()[0] != 3) {
      return ffi::Error::InvalidArgument("apply_tables: updates must have shape (3, U), got " +
                                         Dims((*upd).dimensions()));
    }
    if ((*in).dimensions()[0] != (**out).dimensions()[0] || (*in).dimensions()[1] != (**out).dimensions()[1]) {
      return ffi::Error::InvalidArgument("apply_tables: a table result differs from its operand");
    }
    tables.push_back(**out);
    updates.push_back(*upd);
  }
  const int32_t* record = sync.typed_data();
  const int32_t* work = stamp.typed_data();
  int32_t next[5];
  std::memcpy(next, record, sizeof(next));
  const bool ok = InOrder(record, work);
  if (ok) {
    next[0] = record[0] + 1;
    if (record[4] == 0) next[4] = work[1];
  } else {
    if (record[0] >= 0) {  // the first slip: keep where it happened
      next[1] = record[0];
      next[2] = work[0];
      next[3] = work[1];
    }
    next[0] = kPoisoned;
  }
  // Aliased: the result buffers are the operands' (XLA keeps them in place); write through them.
  for (size_t i = 0; i < pools; ++i) {
    int32_t* table = tables[i].typed_data();
    const int64_t rows = tables[i].dimensions()[0], cols = tables[i].dimensions()[1];
    if (!ok) {
      for (int64_t e = 0; e < rows * cols; ++e) table[e] = kSentinelPage;
      continue;
    }
    const int64_t u = updates[i].dimensions()[1];
    const int32_t* upd = updates[i].typed_data();
    for (int64_t e = 0; e < u; ++e) {
      const int64_t r = DropIndex(upd[e], rows), c = DropIndex(upd[u + e], cols);
      if (r >= 0 && c >= 0) table[r * cols + c] = upd[2 * u + e];
    }
  }
  std::memcpy(sync_out->typed_data(), next, sizeof(next));
  return ffi::Error::Success();
}

// One plane of a pool as the page writes see it: (layers, N, H, P, X) page-major or
// (layers, H, N, P, X) head-major, `row` bytes per token of one head.
struct PlaneGeometry {
  int64_t layers, pages, heads, page_size, row;
  bool head_major;

  // Byte offset of token column 0 of (layer, page, head).
  int64_t Tile(int64_t l, int64_t n, int64_t h) const {
    const int64_t tile = page_size * row;
    return head_major ? ((l * heads + h) * pages + n) * tile : ((l * pages + n) * heads + h) * tile;
  }
};

ffi::Error Geometry(const ffi::AnyBuffer& plane, int64_t page_axis, PlaneGeometry* g) {
  auto d = plane.dimensions();
  if (d.size() != 5) return ffi::Error::InvalidArgument("write_pages: planes must be 5-D, got " + Dims(d));
  if (page_axis != 1 && page_axis != 2) {
    return ffi::Error::InvalidArgument("write_pages: page_axis must be 1 or 2, got " + std::to_string(page_axis));
  }
  g->head_major = page_axis == 2;
  g->layers = d[0];
  g->pages = d[page_axis];
  g->heads = d[g->head_major ? 1 : 2];
  g->page_size = d[3];
  g->row = d[4] * static_cast<int64_t>(ffi::ByteWidth(plane.element_type()));
  return ffi::Error::Success();
}

// operands: sync (5,), stamp (2,), copies (3, K) (src, dst, columns), restores (2, R) (dst,
// columns), then M planes followed by their M payloads (R, layers, H, P, X) of the same element
// width; results: the M planes (aliased).  attribute page_axis: 1 page-major, 2 head-major.
//
// Every source is read before any destination is written (a copy's source may be another entry's
// destination: it reads the page as it was before the work); padding entries (columns 0, or a
// destination outside [0, N)) and a work out of order write nothing.
ffi::Error WritePagesImpl(S32Vector sync, S32Vector stamp, S32Matrix copies, S32Matrix restores, ffi::RemainingArgs rest,
                          ffi::RemainingRets planes_out, int64_t page_axis) {
  if (auto err = CheckOrderOperands(sync, stamp); err.failure()) return err;
  if (copies.dimensions()[0] != 3 || restores.dimensions()[0] != 2) {
    return ffi::Error::InvalidArgument("write_pages: copies must be (3, K) and restores (2, R), got " +
                                       Dims(copies.dimensions()) + " and " + Dims(restores.dimensions()));
  }
  const size_t m = planes_out.size();
  if (rest.size() != 2 * m) {
    return ffi::Error::InvalidArgument("write_pages: " + std::to_string(m) + " planes need " + std::to_string(2 * m) +
                                       " operands after restores, got " + std::to_string(rest.size()));
  }
  const int64_t k = copies.dimensions()[1], r = restores.dimensions()[1];
  std::vector<ffi::AnyBuffer> planes, payloads;
  std::vector<PlaneGeometry> geometry(m);
  for (size_t i = 0; i < m; ++i) {
    auto out = planes_out.get<ffi::AnyBuffer>(i);
    auto payload = rest.get<ffi::AnyBuffer>(m + i);
    if (!out.has_value() || !payload.has_value()) {
      return ffi::Error::InvalidArgument("write_pages: planes and payloads must be buffers");
    }
    planes.push_back(**out);
    payloads.push_back(*payload);
    if (auto err = Geometry(planes[i], page_axis, &geometry[i]); err.failure()) return err;
    const PlaneGeometry& g = geometry[i];
    auto pd = payloads[i].dimensions();
    const int64_t width = ffi::ByteWidth(payloads[i].element_type());
    if (pd.size() != 5 || pd[0] != r || pd[1] != g.layers || pd[2] != g.heads || pd[3] != g.page_size ||
        pd[4] * width != g.row) {
      return ffi::Error::InvalidArgument("write_pages: payload " + std::to_string(i) + " must be (R=" +
                                         std::to_string(r) + ", layers, H, P, X) of the plane's bytes, got " +
                                         Dims(pd));
    }
  }
  if (!InOrder(sync.typed_data(), stamp.typed_data())) return ffi::Error::Success();

  const int32_t* cp = copies.typed_data();
  const int32_t* rs = restores.typed_data();
  for (size_t i = 0; i < m; ++i) {
    const PlaneGeometry& g = geometry[i];
    uint8_t* plane = static_cast<uint8_t*>(planes[i].untyped_data());
    const uint8_t* payload = static_cast<const uint8_t*>(payloads[i].untyped_data());
    const int64_t tile = g.page_size * g.row;
    // Stage the copies' source columns first: every source as it was before the work.
    std::vector<uint8_t> staged;
    std::vector<int64_t> staged_at(k, -1);
    for (int64_t e = 0; e < k; ++e) {
      const int64_t src = cp[e], dst = cp[k + e], cols = cp[2 * k + e];
      if (cols <= 0 || dst < 0 || dst >= g.pages || src < 0 || src >= g.pages) continue;
      const int64_t bytes = std::min<int64_t>(cols, g.page_size) * g.row;
      staged_at[e] = static_cast<int64_t>(staged.size());
      staged.resize(staged.size() + static_cast<size_t>(g.layers * g.heads * bytes));
      uint8_t* to = staged.data() + staged_at[e];
      for (int64_t l = 0; l < g.layers; ++l) {
        for (int64_t h = 0; h < g.heads; ++h, to += bytes) std::memcpy(to, plane + g.Tile(l, src, h), bytes);
      }
    }
    for (int64_t e = 0; e < k; ++e) {
      if (staged_at[e] < 0) continue;
      const int64_t dst = cp[k + e], cols = std::min<int64_t>(cp[2 * k + e], g.page_size);
      const int64_t bytes = cols * g.row;
      const uint8_t* from = staged.data() + staged_at[e];
      for (int64_t l = 0; l < g.layers; ++l) {
        for (int64_t h = 0; h < g.heads; ++h, from += bytes) std::memcpy(plane + g.Tile(l, dst, h), from, bytes);
      }
    }
    // Restores: columns [0, cols) of payload entry e onto page dst, the entries spread over the
    // pool's threads (distinct destinations: no two entries write the same bytes).  In page-major
    // planes a full page of one layer is H contiguous tiles: one copy.
    ParallelFor(r, [&](int64_t e) {
      const int64_t dst = rs[e], cols = std::min<int64_t>(rs[r + e], g.page_size);
      if (cols <= 0 || dst < 0 || dst >= g.pages) return;
      const uint8_t* entry = payload + e * g.layers * g.heads * tile;
      for (int64_t l = 0; l < g.layers; ++l) {
        const uint8_t* from = entry + l * g.heads * tile;
        if (!g.head_major && cols == g.page_size) {
          StreamCopy(plane + g.Tile(l, dst, 0), from, g.heads * tile);
          continue;
        }
        for (int64_t h = 0; h < g.heads; ++h) StreamCopy(plane + g.Tile(l, dst, h), from + h * tile, cols * g.row);
      }
      Fence();
    });
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kApplyTables, ApplyTablesImpl,
                       ffi::Ffi::Bind()
                           .Arg<S32Vector>()  // sync
                           .Arg<S32Vector>()  // stamp
                           .RemainingArgs()   // tables, then updates
                           .Ret<S32Vector>()  // sync
                           .RemainingRets());  // tables

XLA_FFI_DEFINE_HANDLER(kWritePages, WritePagesImpl,
                       ffi::Ffi::Bind()
                           .Arg<S32Vector>()  // sync
                           .Arg<S32Vector>()  // stamp
                           .Arg<S32Matrix>()  // copies
                           .Arg<S32Matrix>()  // restores
                           .RemainingArgs()   // planes, then payloads
                           .RemainingRets()   // planes
                           .Attr<int64_t>("page_axis"));

}  // namespace
}  // namespace ninfer_kv_ffi

extern "C" {
__attribute__((visibility("default"))) XLA_FFI_Error* NinferKvApplyTables(XLA_FFI_CallFrame* f) {
  return (*ninfer_kv_ffi::kApplyTables)(f);
}
__attribute__((visibility("default"))) XLA_FFI_Error* NinferKvWritePages(XLA_FFI_CallFrame* f) {
  return (*ninfer_kv_ffi::kWritePages)(f);
}
}
