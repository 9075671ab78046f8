// opencoti native CPU kernels as typed torch operators: torch.ops.opencoti.<name>.
//
// Each operator checks every tensor it is given (dtype, device, contiguity, shapes consistent with each
// other, and the index values the kernels follow: page ids, slots, query rows) and raises a RuntimeError
// naming the argument, then calls the plain kernels of kernels.cpp (which stays torch-free: the tests
// also build it alone). The thread count is torch's at the call (at::get_num_threads()); the library
// links the OpenMP runtime torch already loaded. Every operator also has a Meta kernel (the same dtype
// and shape checks, no data: what tracing with fake tensors runs). Built and loaded by engine/native/__init__.py; OC_OPS_NS names the operator namespace
// (another build of other flags, e.g. the scalar one the tests load, registers under its own).

#include "kernels.cpp"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#ifndef OC_OPS_NS
#define OC_OPS_NS opencoti
#endif
#define OC_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define OC_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace oc_ops {

using at::Tensor;
using c10::ScalarType;

// torch's Python name of a dtype (float32, int8, ...), for the messages
std::string dtype_name(ScalarType t) {
    switch (t) {
        case ScalarType::Float: return "float32";
        case ScalarType::Double: return "float64";
        case ScalarType::Half: return "float16";
        case ScalarType::BFloat16: return "bfloat16";
        case ScalarType::Char: return "int8";
        case ScalarType::Byte: return "uint8";
        case ScalarType::Short: return "int16";
        case ScalarType::Int: return "int32";
        case ScalarType::Long: return "int64";
        case ScalarType::Bool: return "bool";
        default: return c10::toString(t);
    }
}

// An argument's name in a message: base, then [index] when index >= 0, then suffix. Streamed into the
// message only when a check fails (no strings built per call).
struct Name {
    const char* base;
    int64_t index;
    const char* suffix;
};
std::ostream& operator<<(std::ostream& os, const Name& n) {
    os << n.base;
    if (n.index >= 0) os << "[" << n.index << "]";
    return os << n.suffix;
}

// The engine's tensors live on the CPU; the Meta kernels run the same checks on meta tensors.
template <typename N>
void check_tensor(const Tensor& t, const N& name, ScalarType dtype, bool meta) {
    TORCH_CHECK(t.defined(), name, " is required");
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype_name(dtype), ", got ",
                dtype_name(t.scalar_type()));
    TORCH_CHECK(meta ? t.is_meta() : t.device().is_cpu(), name, " must be on the ", meta ? "meta device" : "CPU",
                ", got ", t.device());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

template <typename N>
void check_dim(const Tensor& t, const N& name, int64_t dim) {
    TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

template <typename N>
void check_size(const Tensor& t, const N& name, int64_t d, int64_t want, const char* what) {
    TORCH_CHECK(t.size(d) == want, name, " dimension ", d, " must be ", what, " (", want, "), got shape ", t.sizes());
}

// Every value of an int64 tensor in [lo, hi).
void check_range(const Tensor& t, const char* name, int64_t lo, int64_t hi, const char* what) {
    const int64_t* v = t.data_ptr<int64_t>();
    for (int64_t i = 0, n = t.numel(); i < n; ++i)
        TORCH_CHECK(v[i] >= lo && v[i] < hi, name, "[", i, "] = ", v[i], " is out of range: ", what, " in [", lo,
                    ", ", hi, ")");
}

int kv_code(ScalarType t) {
    switch (t) {
        case ScalarType::Float: return kKvF32;
        case ScalarType::Half: return kKvF16;
        case ScalarType::BFloat16: return kKvBF16;
        case ScalarType::Char: return kKvQ8;
        default: return -1;
    }
}

// A paged KV cache [pages, page_size, Hkv, D] (q8: int8 [..., D + 4]), or the caches of all layers
// [layers, pages, page_size, Hkv, D] (dims 5), and its partner; returns its element type code and sets
// head_dim (D).
int check_caches(const Tensor& k, const Tensor& v, bool meta, int64_t* head_dim, int64_t dims = 4) {
    const int kv = kv_code(k.scalar_type());
    TORCH_CHECK(kv >= 0, "k_cache must be float32, float16, bfloat16 or int8 (q8 pages), got ",
                dtype_name(k.scalar_type()));
    check_tensor(k, "k_cache", k.scalar_type(), meta);
    check_tensor(v, "v_cache", k.scalar_type(), meta);
    check_dim(k, "k_cache", dims);
    TORCH_CHECK(v.sizes() == k.sizes(), "v_cache must have k_cache's shape ", k.sizes(), ", got ", v.sizes());
    TORCH_CHECK(k.size(-3) > 0 && k.size(-2) > 0, "k_cache's page_size and KV heads must be positive, got shape ",
                k.sizes());
    *head_dim = kv == kKvQ8 ? k.size(-1) - kQ8Scale : k.size(-1);
    TORCH_CHECK(*head_dim > 0, "k_cache's last dimension ", k.size(-1), " holds no values",
                kv == kKvQ8 ? " (q8: head_dim + 4)" : "");
    return kv;
}

// The decode rows' page tables: q_rows [B] rows of q (of q_len), page_idx [B, max_pages], kv_lens [B];
// the pages each row reads are checked against the cache's page count.
void check_tables(const Tensor& q_rows, const Tensor& page_idx, const Tensor& kv_lens, int64_t q_len,
                  int64_t pages, int64_t page_size, bool meta) {
    check_tensor(q_rows, "q_rows", ScalarType::Long, meta);
    check_tensor(page_idx, "page_idx", ScalarType::Long, meta);
    check_tensor(kv_lens, "kv_lens", ScalarType::Long, meta);
    check_dim(q_rows, "q_rows", 1);
    check_dim(page_idx, "page_idx", 2);
    check_dim(kv_lens, "kv_lens", 1);
    const int64_t B = q_rows.size(0), max_pages = page_idx.size(1);
    check_size(page_idx, "page_idx", 0, B, "q_rows' length");
    check_size(kv_lens, "kv_lens", 0, B, "q_rows' length");
    if (meta) return;
    check_range(q_rows, "q_rows", 0, q_len, "a row of q");
    check_range(kv_lens, "kv_lens", 0, max_pages * page_size + 1, "at most page_idx's pages x page_size keys");
    const int64_t* idx = page_idx.data_ptr<int64_t>();
    const int64_t* lens = kv_lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < (lens[b] + page_size - 1) / page_size; ++j) {
            const int64_t p = idx[b * max_pages + j];
            TORCH_CHECK(p >= 0 && p < pages, "page_idx[", b, ", ", j, "] = ", p, " is out of range: a page of the "
                        "cache in [0, ", pages, ")");
        }
}

// Cascade groups as oc_cascade_groups takes them: group g holds pages group_pages[group_page_ptr[g] ..
// group_page_ptr[g + 1]) and query rows group_rows[group_row_ptr[g] .. group_row_ptr[g + 1]).
int64_t check_groups(const Tensor& page_ptr, const Tensor& pages, const Tensor& row_ptr, const Tensor& rows,
                     int64_t q_len, int64_t cache_pages, bool meta) {
    const char* names[4] = {"group_page_ptr", "group_pages", "group_row_ptr", "group_rows"};
    const Tensor* ts[4] = {&page_ptr, &pages, &row_ptr, &rows};
    for (int i = 0; i < 4; ++i) {
        check_tensor(*ts[i], names[i], ScalarType::Long, meta);
        check_dim(*ts[i], names[i], 1);
    }
    TORCH_CHECK(page_ptr.size(0) >= 1, "group_page_ptr must hold at least one offset (0)");
    const int64_t n_groups = page_ptr.size(0) - 1;
    check_size(row_ptr, "group_row_ptr", 0, n_groups + 1, "group_page_ptr's length");
    if (meta) return n_groups;
    for (int i = 0; i < 3; i += 2) {
        const int64_t* p = ts[i]->data_ptr<int64_t>();
        const int64_t total = ts[i + 1]->size(0);
        TORCH_CHECK(p[0] == 0, names[i], "[0] must be 0, got ", p[0]);
        for (int64_t g = 0; g < n_groups; ++g)
            TORCH_CHECK(p[g + 1] >= p[g], names[i], " must not decrease, got ", p[g], " then ", p[g + 1]);
        TORCH_CHECK(p[n_groups] == total, names[i], "[-1] must be the length of ", names[i + 1], " (", total,
                    "), got ", p[n_groups]);
    }
    check_range(pages, "group_pages", 0, cache_pages, "a page of the cache");
    check_range(rows, "group_rows", 0, q_len, "a row of q");
    return n_groups;
}

// q [rows, H, D] fp32, out the same, lse [rows, H] fp32 (optional unless required).
void check_attention_io(const Tensor& q, const Tensor& out, const c10::optional<Tensor>& lse, int64_t head_dim,
                        int64_t num_kv_heads, bool meta) {
    check_tensor(q, "q", ScalarType::Float, meta);
    check_dim(q, "q", 3);
    check_size(q, "q", 2, head_dim, "the cache's head_dim");
    TORCH_CHECK(q.size(1) % num_kv_heads == 0, "q's heads (", q.size(1), ") must be a multiple of the cache's KV heads (",
                num_kv_heads, ")");
    check_tensor(out, "out", ScalarType::Float, meta);
    TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ", out.sizes());
    if (lse.has_value()) {
        check_tensor(*lse, "lse", ScalarType::Float, meta);
        check_dim(*lse, "lse", 2);
        TORCH_CHECK(lse->size(0) == q.size(0) && lse->size(1) == q.size(1), "lse must have shape [", q.size(0), ", ",
                    q.size(1), "] (q's rows and heads), got ", lse->sizes());
    }
}

// ---------------------------------------------------------------------------------------- projections
// GGUF k-quant rows in segments: nseg x {ggml type, rows, k} at s (Q4_K (12) or Q6_K (14), rows >= 1,
// one k for all, a multiple of 256). Sets p's k, n, seg, nseg and seg_bytes (the bytes the rows hold).
template <typename N>
void check_segment_table(const int64_t* s, int64_t nseg, const N& sn, OcProj* p) {
    TORCH_CHECK(nseg >= 1, sn, " must describe at least one segment");
    int64_t n = 0, bytes = 0;
    for (int64_t i = 0; i < nseg; ++i) {
        const int64_t type = s[3 * i], rows = s[3 * i + 1], k = s[3 * i + 2];
        TORCH_CHECK(ggml_kernel_type((int)type), sn, " segment ", i, ": ggml type ", type, " is not one the "
                    "k-quant projections read (12 Q4_K, 14 Q6_K)");
        TORCH_CHECK(rows >= 1, sn, " segment ", i, ": rows must be >= 1, got ", rows);
        TORCH_CHECK(k > 0 && k % 256 == 0 && k == s[2], sn, " segment ", i, ": k must be a positive multiple of "
                    "256, the same in every segment, got ", k);
        n += rows;
        bytes += rows * oc_gguf_row_bytes((int)type, k);
    }
    p->k = s[2];
    p->n = n;
    p->seg = s;
    p->nseg = nseg;
    p->seg_bytes = bytes;
}

// The same table as an int64 tensor [nseg, 3] (a fused layer's ``scales`` entry). A meta tensor holds
// no values: under meta the projection's sizes stay unknown (-1) and the checks that need them run on
// the real call.
void check_segments(const Tensor& segs, const Name& sn, bool meta, OcProj* p) {
    check_tensor(segs, sn, ScalarType::Long, meta);
    check_dim(segs, sn, 2);
    TORCH_CHECK(segs.size(0) >= 1 && segs.size(1) == 3, sn, " must have shape [segments >= 1, 3] (ggml type, rows, "
                "k), got ", segs.sizes());
    if (meta) {
        p->k = p->n = p->seg_bytes = -1;
        return;
    }
    check_segment_table(segs.data_ptr<int64_t>(), segs.size(0), sn, p);
}

// One projection's weights: int4 blocks (uint8 [N, K/32 * 20], no scale) or int8 rows (int8 [N, K] and
// fp32 scale [N]); bias fp32 [N] or none. Returns the OcProj the kernels take.
void check_bias(const c10::optional<Tensor>& bias, const Name& bn, bool meta, OcProj* p);

OcProj check_proj(const Tensor& w, const c10::optional<Tensor>& scale, const c10::optional<Tensor>& bias,
                  const Name& wn, const Name& sn, const Name& bn, bool meta) {
    OcProj p{};
    TORCH_CHECK(w.defined(), wn, " is required");
    if (w.scalar_type() == ScalarType::Byte && w.dim() == 1) {
        check_tensor(w, wn, ScalarType::Byte, meta);
        TORCH_CHECK(scale.has_value(), sn, " is required for GGUF k-quant rows (int64 [segments, 3]: ggml type, "
                    "rows, k)");
        check_segments(*scale, sn, meta, &p);
        if (p.seg_bytes >= 0) check_size(w, wn, 0, p.seg_bytes, "the segments' bytes");
        p.kind = 1;
    } else if (w.scalar_type() == ScalarType::Byte) {
        check_tensor(w, wn, ScalarType::Byte, meta);
        check_dim(w, wn, 2);
        TORCH_CHECK(w.size(1) > 0 && w.size(1) % kQ4Block == 0, wn, " (int4 blocks) must have a multiple of ",
                    kQ4Block, " bytes per row (", kQ4Block, " per 32 weights), got shape ", w.sizes());
        TORCH_CHECK(!scale.has_value(), sn, " must be None for int4 blocks (their scales are inside)");
        p.kind = 4;
        p.k = w.size(1) / kQ4Block * 32;
    } else {
        TORCH_CHECK(w.scalar_type() == ScalarType::Char, wn, " must be uint8 (int4 blocks) or int8, got ",
                    dtype_name(w.scalar_type()));
        check_tensor(w, wn, ScalarType::Char, meta);
        check_dim(w, wn, 2);
        TORCH_CHECK(w.size(1) > 0, wn, " must have at least one input, got shape ", w.sizes());
        TORCH_CHECK(scale.has_value(), sn, " is required for int8 weights (one fp32 scale per output row)");
        check_tensor(*scale, sn, ScalarType::Float, meta);
        check_dim(*scale, sn, 1);
        check_size(*scale, sn, 0, w.size(0), "the weights' rows");
        p.kind = 8;
        p.k = w.size(1);
        p.scale = meta ? nullptr : scale->data_ptr<float>();
    }
    if (p.kind != 1) p.n = w.size(0);
    check_bias(bias, bn, meta, &p);
    p.w = meta ? nullptr : w.data_ptr();
    return p;
}

void check_bias(const c10::optional<Tensor>& bias, const Name& bn, bool meta, OcProj* p) {
    if (bias.has_value()) {
        check_tensor(*bias, bn, ScalarType::Float, meta);
        check_dim(*bias, bn, 1);
        if (p->n >= 0) check_size(*bias, bn, 0, p->n, "the weights' rows");
        p->bias = meta ? nullptr : bias->data_ptr<float>();
    }
}

void check_x(const Tensor& x, int64_t k, bool meta) {
    check_tensor(x, "x", ScalarType::Float, meta);
    check_dim(x, "x", 2);
    check_size(x, "x", 1, k, "the weights' input size");
}

template <bool kMeta>
Tensor q4_matmul(const Tensor& x, const Tensor& blocks, const c10::optional<Tensor>& bias) {
    TORCH_CHECK(blocks.scalar_type() == ScalarType::Byte, "blocks must be uint8 (int4 blocks), got ",
                dtype_name(blocks.scalar_type()));
    const OcProj p = check_proj(blocks, c10::nullopt, bias, {"blocks", -1, ""}, {"scale", -1, ""}, {"bias", -1, ""}, kMeta);
    check_x(x, p.k, kMeta);
    Tensor y = at::empty({x.size(0), p.n}, x.options());
    if (!kMeta && x.size(0) > 0)
        oc_q4_matmul(x.data_ptr<float>(), x.size(0), p.k, (const uint8_t*)p.w, p.n, p.bias, y.data_ptr<float>(),
                     at::get_num_threads());
    return y;
}

// segments: nseg x (ggml type, rows, k), flattened (an int list, so the meta kernel knows the sizes too).
template <bool kMeta>
Tensor ggml_matmul(const Tensor& x, const Tensor& data, at::IntArrayRef segments, const c10::optional<Tensor>& bias) {
    check_tensor(data, "data", ScalarType::Byte, kMeta);
    check_dim(data, "data", 1);
    TORCH_CHECK(segments.size() % 3 == 0, "segments must hold (ggml type, rows, k) per segment, got ",
                segments.size(), " values");
    OcProj p{};
    check_segment_table(segments.data(), (int64_t)segments.size() / 3, "segments", &p);
    check_size(data, "data", 0, p.seg_bytes, "the segments' bytes");
    check_bias(bias, {"bias", -1, ""}, kMeta, &p);
    check_x(x, p.k, kMeta);
    Tensor y = at::empty({x.size(0), p.n}, x.options());
    if (!kMeta && x.size(0) > 0)
        oc_ggml_matmul(x.data_ptr<float>(), x.size(0), p.k, p.seg, p.nseg, data.data_ptr<uint8_t>(), p.n, p.bias,
                       y.data_ptr<float>(), at::get_num_threads());
    return y;
}

template <bool kMeta>
Tensor q8_matmul(const Tensor& x, const Tensor& q, const Tensor& scale, const c10::optional<Tensor>& bias) {
    TORCH_CHECK(q.scalar_type() == ScalarType::Char, "q must be int8, got ", dtype_name(q.scalar_type()));
    const OcProj p = check_proj(q, scale, bias, {"q", -1, ""}, {"scale", -1, ""}, {"bias", -1, ""}, kMeta);
    check_x(x, p.k, kMeta);
    Tensor y = at::empty({x.size(0), p.n}, x.options());
    if (!kMeta && x.size(0) > 0)
        oc_q8_matmul(x.data_ptr<float>(), x.size(0), p.k, (const int8_t*)p.w, p.scale, p.n, p.bias,
                     y.data_ptr<float>(), at::get_num_threads());
    return y;
}

// ---------------------------------------------------------------------------------------- KV pages
template <bool kMeta>
void kv_store(const Tensor& dst, const Tensor& src) {
    check_tensor(src, "src", ScalarType::Float, kMeta);
    TORCH_CHECK(src.dim() >= 1 && src.size(-1) > 0, "src must be [..., D] with D > 0, got shape ", src.sizes());
    const int kv = kv_code(dst.scalar_type());
    TORCH_CHECK(kv >= 0, "dst must be float32, float16, bfloat16 or int8 (q8), got ",
                dtype_name(dst.scalar_type()));
    check_tensor(dst, "dst", dst.scalar_type(), kMeta);
    const int64_t D = src.size(-1), row = kv == kKvQ8 ? D + kQ8Scale : D;
    auto want = src.sizes().vec();
    want.back() = row;
    TORCH_CHECK(dst.sizes() == c10::IntArrayRef(want), "dst must have shape ", c10::IntArrayRef(want),
                " (src's, last dimension ", kv == kKvQ8 ? "D + 4 for q8" : "D", "), got ", dst.sizes());
    if (!kMeta) oc_kv_store(kv, dst.data_ptr(), src.data_ptr<float>(), src.numel() / D, D);
}

template <bool kMeta>
Tensor q8_dequant(const Tensor& src) {
    check_tensor(src, "src", ScalarType::Char, kMeta);
    TORCH_CHECK(src.dim() >= 1 && src.size(-1) > kQ8Scale, "src must be q8 vectors [..., D + 4] with D > 0, got "
                "shape ", src.sizes());
    const int64_t D = src.size(-1) - kQ8Scale;
    auto shape = src.sizes().vec();
    shape.back() = D;
    Tensor out = at::empty(shape, src.options().dtype(ScalarType::Float));
    if (!kMeta && src.numel() > 0)
        oc_q8_dequant(src.data_ptr<int8_t>(), src.numel() / src.size(-1), D, out.data_ptr<float>(),
                      at::get_num_threads());
    return out;
}

// ---------------------------------------------------------------------------------------- attention
template <bool kMeta>
void paged_decode(const Tensor& q, const Tensor& q_rows, const Tensor& k_cache, const Tensor& v_cache,
                  const Tensor& page_idx, const Tensor& kv_lens, double scale, const Tensor& out,
                  const c10::optional<Tensor>& lse) {
    int64_t D;
    const int kv = check_caches(k_cache, v_cache, kMeta, &D);
    check_attention_io(q, out, lse, D, k_cache.size(2), kMeta);
    check_tables(q_rows, page_idx, kv_lens, q.size(0), k_cache.size(0), k_cache.size(1), kMeta);
    if (kMeta || q_rows.size(0) == 0) return;
    oc_paged_decode(q.data_ptr<float>(), q_rows.data_ptr<int64_t>(), q_rows.size(0), q.size(1), k_cache.size(2), D,
                    k_cache.data_ptr(), v_cache.data_ptr(), page_idx.data_ptr<int64_t>(), page_idx.size(1),
                    kv_lens.data_ptr<int64_t>(), k_cache.size(1), (float)scale, out.data_ptr<float>(),
                    lse.has_value() ? lse->data_ptr<float>() : nullptr, kv, at::get_num_threads());
}

template <bool kMeta>
void cascade_groups(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& group_page_ptr,
                    const Tensor& group_pages, const Tensor& group_row_ptr, const Tensor& group_rows, double scale,
                    const Tensor& out, const Tensor& lse) {
    int64_t D;
    const int kv = check_caches(k_cache, v_cache, kMeta, &D);
    check_attention_io(q, out, lse, D, k_cache.size(2), kMeta);
    const int64_t n_groups = check_groups(group_page_ptr, group_pages, group_row_ptr, group_rows, q.size(0),
                                          k_cache.size(0), kMeta);
    if (kMeta || n_groups == 0) return;
    oc_cascade_groups(q.data_ptr<float>(), q.size(1), k_cache.size(2), D, k_cache.data_ptr(), v_cache.data_ptr(),
                      k_cache.size(1), n_groups, group_page_ptr.data_ptr<int64_t>(), group_pages.data_ptr<int64_t>(),
                      group_row_ptr.data_ptr<int64_t>(), group_rows.data_ptr<int64_t>(), (float)scale,
                      out.data_ptr<float>(), lse.data_ptr<float>(), kv, at::get_num_threads());
}

// ---------------------------------------------------------------------------------------- fused layer
using OptList = c10::List<c10::optional<Tensor>>;

// What the decode rows of one step share across layers: the residual stream x [T, hidden], RoPE
// cos / sin_signed [T, D], the slots K/V are written to, the page tables, the caches (one layer's
// [pages, page_size, Hkv, D] or all layers' [layers, ...]). Returns the KV type code.
struct StepDims {
    int64_t T, hidden, H, Hkv, D, pages, page_size;
    int kv;
};

StepDims check_step(const Tensor& x, const Tensor& cos, const Tensor& sin_signed, const Tensor& slots,
                    const Tensor& k_cache, const Tensor& v_cache, const Tensor& q_rows, const Tensor& page_idx,
                    const Tensor& kv_lens, int64_t num_heads, int64_t cache_dims, bool meta) {
    StepDims d{};
    d.kv = check_caches(k_cache, v_cache, meta, &d.D, cache_dims);
    d.Hkv = k_cache.size(-2), d.H = num_heads;
    d.pages = k_cache.size(-4), d.page_size = k_cache.size(-3);
    TORCH_CHECK(d.H > 0 && d.H % d.Hkv == 0, "num_heads (", d.H, ") must be a positive multiple of the cache's KV "
                "heads (", d.Hkv, ")");
    TORCH_CHECK(d.D % 2 == 0, "head_dim (", d.D, ") must be even (RoPE rotates its halves)");
    check_tensor(x, "x", ScalarType::Float, meta);
    check_dim(x, "x", 2);
    d.T = x.size(0), d.hidden = x.size(1);
    for (auto [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin_signed, "sin_signed"}}) {
        check_tensor(*t, name, ScalarType::Float, meta);
        check_dim(*t, name, 2);
        TORCH_CHECK(t->size(0) == d.T && t->size(1) == d.D, name, " must have shape [", d.T, ", ", d.D,
                    "] (x's rows, head_dim), got ", t->sizes());
    }
    check_tensor(slots, "slots", ScalarType::Long, meta);
    check_dim(slots, "slots", 1);
    check_size(slots, "slots", 0, d.T, "x's rows");
    check_tensor(q_rows, "q_rows", ScalarType::Long, meta);
    check_dim(q_rows, "q_rows", 1);
    check_size(q_rows, "q_rows", 0, d.T, "x's rows (one decode row each)");
    check_tables(q_rows, page_idx, kv_lens, d.T, d.pages, d.page_size, meta);
    if (!meta)
        check_range(slots, "slots", 0, d.pages * d.page_size, "a slot of the cache (pages x page_size)");
    return d;
}

// One layer's norms [hidden] and projections (qkv, o, gate_up, down) at ``at`` in the lists, checked
// against each other and the step; writes proj[0..3].
void check_layer(const Tensor& in_norm, const Tensor& post_norm, at::TensorList weights, const OptList& scales,
                 const OptList& biases, size_t at, const StepDims& d, int64_t layer, bool meta,
                 OcProj* proj) {
    static const char* kRoles[4] = {" (qkv)", " (o)", " (gate_up)", " (down)"};
    Name names[4];
    for (int i = 0; i < 4; ++i) {
        const int64_t idx = (int64_t)at + i;
        names[i] = Name{"weights", idx, kRoles[i]};
        proj[i] = check_proj(weights[at + i], scales.get(at + i), biases.get(at + i), names[i], {"scales", idx, ""},
                             {"biases", idx, ""}, meta);
    }
    // one layer's norms: in_norm; layer l of all: in_norms[l]
    for (auto [t, name] : {std::pair{&in_norm, Name{layer < 0 ? "in_norm" : "in_norms", layer, ""}},
                           std::pair{&post_norm, Name{layer < 0 ? "post_norm" : "post_norms", layer, ""}}}) {
        check_tensor(*t, name, ScalarType::Float, meta);
        check_dim(*t, name, 1);
        check_size(*t, name, 0, d.hidden, "x's hidden size");
    }
    auto shape = [&](int i, int64_t n, int64_t k, const char* what) {
        if (proj[i].n < 0) return;  // k-quant segments under meta: sizes unknown (checked on the real call)
        TORCH_CHECK(proj[i].n == n && proj[i].k == k, names[i], " must compute ", what, ": [", n, " outputs, ", k,
                    " inputs], got [", proj[i].n, ", ", proj[i].k, "]");
    };
    shape(0, (d.H + 2 * d.Hkv) * d.D, d.hidden, "(num_heads + 2 x KV heads) x head_dim from hidden");
    shape(1, d.hidden, d.H * d.D, "hidden from num_heads x head_dim");
    TORCH_CHECK(proj[2].n < 0 || (proj[2].n % 2 == 0 && proj[2].k == d.hidden), names[2], " must compute 2 x intermediate from hidden (",
                d.hidden, "), got [", proj[2].n, ", ", proj[2].k, "]");
    if (proj[2].n >= 0) shape(3, d.hidden, proj[2].n / 2, "hidden from the intermediate size");
}

void check_lists(at::TensorList weights, const OptList& scales, const OptList& biases, size_t n) {
    TORCH_CHECK(weights.size() == n, "weights must hold ", n, " projections (qkv, o, gate_up, down per layer), got ",
                weights.size());
    TORCH_CHECK(scales.size() == n, "scales must hold ", n, " entries (one per projection, None for int4), got ",
                scales.size());
    TORCH_CHECK(biases.size() == n, "biases must hold ", n, " entries (one per projection, or None), got ",
                biases.size());
}

void run_layer(const Tensor& x, const StepDims& d, const Tensor& in_norm, const Tensor& post_norm, double eps,
               const OcProj* proj, const Tensor& cos, const Tensor& sin_signed, const Tensor& slots, void* k_cache,
               void* v_cache, const Tensor& q_rows, const Tensor& page_idx, const Tensor& kv_lens, double scale,
               int64_t n_groups, const Tensor* groups) {
    const int64_t* g[4] = {nullptr, nullptr, nullptr, nullptr};
    if (n_groups > 0)
        for (int i = 0; i < 4; ++i) g[i] = groups[i].data_ptr<int64_t>();
    oc_decode_layer_cascade(x.data_ptr<float>(), d.T, d.hidden, in_norm.data_ptr<float>(), post_norm.data_ptr<float>(),
                            (float)eps, proj, cos.data_ptr<float>(), sin_signed.data_ptr<float>(),
                            slots.data_ptr<int64_t>(), k_cache, v_cache, q_rows.data_ptr<int64_t>(),
                            page_idx.data_ptr<int64_t>(), page_idx.size(1), kv_lens.data_ptr<int64_t>(), d.page_size,
                            d.H, d.Hkv, d.D, (float)scale, d.kv, at::get_num_threads(), n_groups, g[0], g[1], g[2],
                            g[3]);
}

template <bool kMeta>
void decode_layer_impl(const Tensor& x, const Tensor& in_norm, const Tensor& post_norm, double eps,
                       at::TensorList weights, const OptList& scales, const OptList& biases, const Tensor& cos,
                       const Tensor& sin_signed, const Tensor& slots, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& q_rows, const Tensor& page_idx, const Tensor& kv_lens, int64_t num_heads,
                       double scale, const Tensor* groups) {
    check_lists(weights, scales, biases, 4);
    const StepDims d = check_step(x, cos, sin_signed, slots, k_cache, v_cache, q_rows, page_idx, kv_lens, num_heads, 4,
                                  kMeta);
    OcProj proj[4];
    check_layer(in_norm, post_norm, weights, scales, biases, 0, d, -1, kMeta, proj);
    int64_t n_groups = 0;
    if (groups != nullptr)
        n_groups = check_groups(groups[0], groups[1], groups[2], groups[3], d.T, d.pages, kMeta);
    if (kMeta || d.T == 0) return;
    run_layer(x, d, in_norm, post_norm, eps, proj, cos, sin_signed, slots, k_cache.data_ptr(), v_cache.data_ptr(),
              q_rows, page_idx, kv_lens, scale, n_groups, groups);
}

template <bool kMeta>
void decode_layer(const Tensor& x, const Tensor& in_norm, const Tensor& post_norm, double eps, at::TensorList weights,
                  const OptList& scales, const OptList& biases, const Tensor& cos, const Tensor& sin_signed,
                  const Tensor& slots, const Tensor& k_cache, const Tensor& v_cache, const Tensor& q_rows,
                  const Tensor& page_idx, const Tensor& kv_lens, int64_t num_heads, double scale) {
    decode_layer_impl<kMeta>(x, in_norm, post_norm, eps, weights, scales, biases, cos, sin_signed, slots, k_cache,
                             v_cache, q_rows, page_idx, kv_lens, num_heads, scale, nullptr);
}

template <bool kMeta>
void decode_layer_cascade(const Tensor& x, const Tensor& in_norm, const Tensor& post_norm, double eps,
                          at::TensorList weights, const OptList& scales, const OptList& biases, const Tensor& cos,
                          const Tensor& sin_signed, const Tensor& slots, const Tensor& k_cache, const Tensor& v_cache,
                          const Tensor& q_rows, const Tensor& page_idx, const Tensor& kv_lens, int64_t num_heads,
                          double scale, const Tensor& group_page_ptr, const Tensor& group_pages,
                          const Tensor& group_row_ptr, const Tensor& group_rows) {
    const Tensor groups[4] = {group_page_ptr, group_pages, group_row_ptr, group_rows};
    decode_layer_impl<kMeta>(x, in_norm, post_norm, eps, weights, scales, biases, cos, sin_signed, slots, k_cache,
                             v_cache, q_rows, page_idx, kv_lens, num_heads, scale, groups);
}

// Every layer of a decode step in one call: the caches of all layers [layers, pages, page_size, Hkv, D],
// per layer its norms and four projections (weights / scales / biases at 4 l .. 4 l + 3). ``groups``
// (decode_layers_cascade): the shared page runs of a cascade plan (as cascade_groups takes them), the
// same for every layer, page_idx / kv_lens then holding each row's private pages. All of it is checked
// before the first layer runs.
template <bool kMeta>
void decode_layers_impl(const Tensor& x, at::TensorList in_norms, at::TensorList post_norms, double eps,
                        at::TensorList weights, const OptList& scales, const OptList& biases, const Tensor& cos,
                        const Tensor& sin_signed, const Tensor& slots, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& q_rows, const Tensor& page_idx, const Tensor& kv_lens, int64_t num_heads,
                        double scale, const Tensor* groups) {
    const StepDims d = check_step(x, cos, sin_signed, slots, k_cache, v_cache, q_rows, page_idx, kv_lens, num_heads, 5,
                                  kMeta);
    const int64_t L = k_cache.size(0);
    TORCH_CHECK((int64_t)in_norms.size() == L && (int64_t)post_norms.size() == L, "in_norms and post_norms must "
                "hold one norm per layer of the caches (", L, "), got ", in_norms.size(), " and ", post_norms.size());
    check_lists(weights, scales, biases, 4 * L);
    std::vector<OcProj> proj(4 * L);
    for (int64_t l = 0; l < L; ++l)
        check_layer(in_norms[l], post_norms[l], weights, scales, biases, 4 * l, d, l, kMeta, proj.data() + 4 * l);
    int64_t n_groups = 0;
    if (groups != nullptr)
        n_groups = check_groups(groups[0], groups[1], groups[2], groups[3], d.T, d.pages, kMeta);
    if (kMeta || d.T == 0) return;
    const int64_t layer_bytes = k_cache.stride(0) * k_cache.element_size();
    for (int64_t l = 0; l < L; ++l)
        run_layer(x, d, in_norms[l], post_norms[l], eps, proj.data() + 4 * l, cos, sin_signed, slots,
                  (char*)k_cache.data_ptr() + l * layer_bytes, (char*)v_cache.data_ptr() + l * layer_bytes, q_rows,
                  page_idx, kv_lens, scale, n_groups, groups);
}

template <bool kMeta>
void decode_layers(const Tensor& x, at::TensorList in_norms, at::TensorList post_norms, double eps,
                   at::TensorList weights, const OptList& scales, const OptList& biases, const Tensor& cos,
                   const Tensor& sin_signed, const Tensor& slots, const Tensor& k_cache, const Tensor& v_cache,
                   const Tensor& q_rows, const Tensor& page_idx, const Tensor& kv_lens, int64_t num_heads,
                   double scale) {
    decode_layers_impl<kMeta>(x, in_norms, post_norms, eps, weights, scales, biases, cos, sin_signed, slots, k_cache,
                              v_cache, q_rows, page_idx, kv_lens, num_heads, scale, nullptr);
}

template <bool kMeta>
void decode_layers_cascade(const Tensor& x, at::TensorList in_norms, at::TensorList post_norms, double eps,
                           at::TensorList weights, const OptList& scales, const OptList& biases, const Tensor& cos,
                           const Tensor& sin_signed, const Tensor& slots, const Tensor& k_cache,
                           const Tensor& v_cache, const Tensor& q_rows, const Tensor& page_idx,
                           const Tensor& kv_lens, int64_t num_heads, double scale, const Tensor& group_page_ptr,
                           const Tensor& group_pages, const Tensor& group_row_ptr, const Tensor& group_rows) {
    const Tensor groups[4] = {group_page_ptr, group_pages, group_row_ptr, group_rows};
    decode_layers_impl<kMeta>(x, in_norms, post_norms, eps, weights, scales, biases, cos, sin_signed, slots, k_cache,
                              v_cache, q_rows, page_idx, kv_lens, num_heads, scale, groups);
}

// ---------------------------------------------------------------------------------------- GGUF rows
// raw: uint8 [n, row bytes], n GGUF rows of ggml type ``type`` of k values each.
void check_gguf_rows(const Tensor& raw, int64_t type, int64_t k, bool meta) {
    int64_t values, bytes;
    TORCH_CHECK(ggml_block((int)type, &values, &bytes), "type ", type, " is not a GGUF type these kernels decode "
                "(ggml ids 0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, 30 BF16)");
    TORCH_CHECK(k > 0 && k % values == 0, "k must be a positive multiple of type ", type, "'s block of ", values,
                " values, got ", k);
    check_tensor(raw, "raw", ScalarType::Byte, meta);
    check_dim(raw, "raw", 2);
    check_size(raw, "raw", 1, k / values * bytes, "the bytes of a row of k values");
}

template <bool kMeta>
Tensor gguf_q4_blocks(const Tensor& raw, int64_t type, int64_t k) {
    TORCH_CHECK(type == kGgmlQ4_0 || type == kGgmlQ4_1 || type == kGgmlQ4_K, "type must be a GGUF type with an "
                "exact int4 form: 2 (Q4_0), 3 (Q4_1) or 12 (Q4_K), got ", type);
    check_gguf_rows(raw, type, k, kMeta);
    Tensor out = at::empty({raw.size(0), k / 32 * kQ4Block}, raw.options());
    if (!kMeta && raw.size(0) > 0) {
        const int64_t bad = oc_gguf_q4_blocks(raw.data_ptr<uint8_t>(), (int)type, raw.size(0), k,
                                              out.data_ptr<uint8_t>(), at::get_num_threads());
        TORCH_CHECK_VALUE(bad == 0, "Q4_K scales out of fp16 range (", bad, " sub-block scales or offsets)");
    }
    return out;
}

template <bool kMeta>
std::tuple<Tensor, Tensor> gguf_to_q8_rows(const Tensor& raw, int64_t type, int64_t k) {
    check_gguf_rows(raw, type, k, kMeta);
    Tensor q = at::empty({raw.size(0), k}, raw.options().dtype(ScalarType::Char));
    Tensor scale = at::empty({raw.size(0)}, raw.options().dtype(ScalarType::Float));
    if (!kMeta && raw.size(0) > 0)
        oc_gguf_to_q8_rows(raw.data_ptr<uint8_t>(), (int)type, raw.size(0), k, q.data_ptr<int8_t>(),
                           scale.data_ptr<float>(), at::get_num_threads());
    return {q, scale};
}

// ---------------------------------------------------------------------------------------- knobs
int64_t abi_version() { return oc_abi_version(); }
int64_t simd() { return oc_simd(); }

std::vector<int64_t> gemm_min_rows(int64_t q4, int64_t q8) {
    int64_t a, b;
    oc_gemm_min_rows(q4, q8, &a, &b);
    return {a, b};
}

std::vector<int64_t> act_rows(int64_t q4, int64_t q8) {
    int64_t a, b;
    oc_act_rows(q4, q8, &a, &b);
    return {a, b};
}

int64_t i16_rows(int64_t rows) {
    int64_t old;
    oc_i16_rows(rows, &old);
    return old;
}

int64_t kquant_i8_rows(int64_t rows) {
    int64_t old;
    oc_kquant_i8_rows(rows, &old);
    return old;
}

}  // namespace oc_ops

using namespace oc_ops;

OC_LIBRARY(OC_OPS_NS, m) {
    m.def("abi_version() -> int", &abi_version);
    m.def("simd() -> int", &simd);
    m.def("gemm_min_rows(int q4, int q8) -> int[]", &gemm_min_rows);
    m.def("act_rows(int q4, int q8) -> int[]", &act_rows);
    m.def("i16_rows(int rows) -> int", &i16_rows);
    m.def("kquant_i8_rows(int rows) -> int", &kquant_i8_rows);
    m.def("q4_matmul(Tensor x, Tensor blocks, Tensor? bias) -> Tensor");
    m.def("q8_matmul(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor");
    m.def("ggml_matmul(Tensor x, Tensor data, int[] segments, Tensor? bias) -> Tensor");
    m.def("kv_store(Tensor(a!) dst, Tensor src) -> ()");
    m.def("q8_dequant(Tensor src) -> Tensor");
    m.def("gguf_q4_blocks(Tensor raw, int type, int k) -> Tensor");
    m.def("gguf_to_q8_rows(Tensor raw, int type, int k) -> (Tensor, Tensor)");
    m.def("paged_decode(Tensor q, Tensor q_rows, Tensor k_cache, Tensor v_cache, Tensor page_idx, Tensor kv_lens, "
          "float scale, Tensor(a!) out, Tensor(b!)? lse) -> ()");
    m.def("cascade_groups(Tensor q, Tensor k_cache, Tensor v_cache, Tensor group_page_ptr, Tensor group_pages, "
          "Tensor group_row_ptr, Tensor group_rows, float scale, Tensor(a!) out, Tensor(b!) lse) -> ()");
    m.def("decode_layer(Tensor(a!) x, Tensor in_norm, Tensor post_norm, float eps, Tensor[] weights, "
          "Tensor?[] scales, Tensor?[] biases, Tensor cos, Tensor sin_signed, Tensor slots, Tensor(b!) k_cache, "
          "Tensor(c!) v_cache, Tensor q_rows, Tensor page_idx, Tensor kv_lens, int num_heads, float scale) -> ()");
    m.def("decode_layer_cascade(Tensor(a!) x, Tensor in_norm, Tensor post_norm, float eps, Tensor[] weights, "
          "Tensor?[] scales, Tensor?[] biases, Tensor cos, Tensor sin_signed, Tensor slots, Tensor(b!) k_cache, "
          "Tensor(c!) v_cache, Tensor q_rows, Tensor page_idx, Tensor kv_lens, int num_heads, float scale, "
          "Tensor group_page_ptr, Tensor group_pages, Tensor group_row_ptr, Tensor group_rows) -> ()");
    m.def("decode_layers(Tensor(a!) x, Tensor[] in_norms, Tensor[] post_norms, float eps, Tensor[] weights, "
          "Tensor?[] scales, Tensor?[] biases, Tensor cos, Tensor sin_signed, Tensor slots, Tensor(b!) k_cache, "
          "Tensor(c!) v_cache, Tensor q_rows, Tensor page_idx, Tensor kv_lens, int num_heads, float scale) -> ()");
    m.def("decode_layers_cascade(Tensor(a!) x, Tensor[] in_norms, Tensor[] post_norms, float eps, Tensor[] weights, "
          "Tensor?[] scales, Tensor?[] biases, Tensor cos, Tensor sin_signed, Tensor slots, Tensor(b!) k_cache, "
          "Tensor(c!) v_cache, Tensor q_rows, Tensor page_idx, Tensor kv_lens, int num_heads, float scale, "
          "Tensor group_page_ptr, Tensor group_pages, Tensor group_row_ptr, Tensor group_rows) -> ()");
}

#define OC_IMPLS(m, meta)                                                \
    m.impl("q4_matmul", &oc_ops::q4_matmul<meta>);                       \
    m.impl("q8_matmul", &oc_ops::q8_matmul<meta>);                       \
    m.impl("ggml_matmul", &oc_ops::ggml_matmul<meta>);                   \
    m.impl("kv_store", &oc_ops::kv_store<meta>);                         \
    m.impl("q8_dequant", &oc_ops::q8_dequant<meta>);                     \
    m.impl("gguf_q4_blocks", &oc_ops::gguf_q4_blocks<meta>);             \
    m.impl("gguf_to_q8_rows", &oc_ops::gguf_to_q8_rows<meta>);           \
    m.impl("paged_decode", &oc_ops::paged_decode<meta>);                 \
    m.impl("cascade_groups", &oc_ops::cascade_groups<meta>);             \
    m.impl("decode_layer", &oc_ops::decode_layer<meta>);                 \
    m.impl("decode_layer_cascade", &oc_ops::decode_layer_cascade<meta>); \
    m.impl("decode_layers", &oc_ops::decode_layers<meta>);               \
    m.impl("decode_layers_cascade", &oc_ops::decode_layers_cascade<meta>);

OC_LIBRARY_IMPL(OC_OPS_NS, CPU, m) { OC_IMPLS(m, false) }
OC_LIBRARY_IMPL(OC_OPS_NS, Meta, m) { OC_IMPLS(m, true) }
