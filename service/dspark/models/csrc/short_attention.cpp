// Attention of decode and verification rows on the CPU: a few queries per request against its
// cache prefix, with grouped-query heads.
//
// One task per (request, KV head). Keys and values stream through a block of W rows converted to
// fp32 (W = the vector width), which every query of the group reads from L1: each key is read
// from the cache once for all its query heads and rows. Scores, softmax and the weighted sum are
// fp32; the output is rounded once. A query's result depends only on its own mask row, never on
// the batch's other rows or its longest context (masked and padding keys weigh exactly zero, and
// every sum runs in the same order), so a token gets the same bits decoded alone or verified in a
// block.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// bf16 is the top half of an fp32: a shift the compiler vectorises, where the scalar cast is not.
template <>
inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < n; ++d) {
    const uint32_t wide = static_cast<uint32_t>(bits[d]) << 16;
    std::memcpy(dst + d, &wide, sizeof(float));
  }
}

// Lane j of the result is the sum of x[j]'s lanes: log2(W) levels of pairwise sums of
// deinterleaved halves, W - 1 shuffles for W dot products instead of W full reductions.
inline Vec lane_sums(Vec* x) {
  for (int64_t width = W; width > 1; width /= 2) {
    for (int64_t j = 0; j < width / 2; ++j) {
      auto halves = at::vec::deinterleave2(x[2 * j], x[2 * j + 1]);
      x[j] = halves.first + halves.second;
    }
  }
  return x[0];
}

// Rows [l0, l0 + W) of a [L, dim] head as fp32; rows past `length` are zero.
template <typename T>
inline void load_block(const T* base, int64_t row_stride, int64_t l0, int64_t length, int64_t dim, float* block) {
  const int64_t rows = std::min<int64_t>(W, length - l0);
  for (int64_t j = 0; j < rows; ++j) to_float(base + (l0 + j) * row_stride, block + j * dim, dim);
  std::fill(block + rows * dim, block + W * dim, 0.f);
}

template <typename T, int C>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, at::Tensor& out,
         double scale) {
  constexpr int64_t dim = C * W;
  const int64_t rows = q.size(0), heads = q.size(1), n = q.size(2);
  const int64_t kv_heads = k.size(1), length = k.size(2), group = heads / kv_heads;
  const int64_t queries = group * n, padded = (length + W - 1) / W * W;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides(), ms = mask.strides(), os = out.strides();
  const float minus_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(queries * dim), block(W * dim), scores(queries * padded), acc(queries * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      // Query i is head h * group + i / n at row i % n, scaled once here.
      for (int64_t i = 0; i < queries; ++i) {
        to_float(qp + r * qs[0] + (h * group + i / n) * qs[1] + (i % n) * qs[2], qf.data() + i * dim, dim);
        for (int64_t c = 0; c < C; ++c) {
          (Vec::loadu(qf.data() + i * dim + c * W) * Vec(static_cast<float>(scale))).store(qf.data() + i * dim + c * W);
        }
      }
      const T* kb = kp + r * ks[0] + h * ks[1];
      const T* vb = vp + r * vs[0] + h * vs[1];
      for (int64_t l0 = 0; l0 < padded; l0 += W) {
        load_block(kb, ks[2], l0, length, dim, block.data());
        for (int64_t i = 0; i < queries; ++i) {
          Vec qi[C];
          for (int64_t c = 0; c < C; ++c) qi[c] = Vec::loadu(qf.data() + i * dim + c * W);
          Vec part[W];
          for (int64_t j = 0; j < W; ++j) {
            const float* key = block.data() + j * dim;
            Vec sum = qi[0] * Vec::loadu(key);
            for (int64_t c = 1; c < C; ++c) sum = at::vec::fmadd(qi[c], Vec::loadu(key + c * W), sum);
            part[j] = sum;
          }
          lane_sums(part).store(scores.data() + i * padded + l0);
        }
      }
      const bool* mb = mp + r * ms[0];
      for (int64_t i = 0; i < queries; ++i) {
        float* s = scores.data() + i * padded;
        const bool* seen = mb + (i % n) * ms[1];
        for (int64_t l = 0; l < length; ++l) {
          if (!seen[l * ms[2]]) s[l] = minus_inf;
        }
        std::fill(s + length, s + padded, minus_inf);
        Vec top(minus_inf);
        for (int64_t l = 0; l < padded; l += W) top = at::vec::maximum(top, Vec::loadu(s + l));
        const Vec shift(at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, top));
        Vec total(0.f);
        for (int64_t l = 0; l < padded; l += W) {
          const Vec x = Vec::loadu(s + l);
          // exp_u20 maps -inf to a tiny positive number: masked keys must weigh exactly zero.
          const Vec e = Vec::blendv((x - shift).exp_u20(), Vec(0.f), x == Vec(minus_inf));
          e.store(s + l);
          total = total + e;
        }
        const Vec norm(1.f / at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total));
        for (int64_t l = 0; l < padded; l += W) (Vec::loadu(s + l) * norm).store(s + l);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l0 = 0; l0 < padded; l0 += W) {
        load_block(vb, vs[2], l0, length, dim, block.data());
        for (int64_t i = 0; i < queries; ++i) {
          const float* p = scores.data() + i * padded + l0;
          float* a = acc.data() + i * dim;
          Vec sum[C];
          for (int64_t c = 0; c < C; ++c) sum[c] = Vec::loadu(a + c * W);
          for (int64_t j = 0; j < W; ++j) {
            const Vec weight(p[j]);
            const float* value = block.data() + j * dim;
            for (int64_t c = 0; c < C; ++c) sum[c] = at::vec::fmadd(weight, Vec::loadu(value + c * W), sum[c]);
          }
          for (int64_t c = 0; c < C; ++c) sum[c].store(a + c * W);
        }
      }
      for (int64_t i = 0; i < queries; ++i) {
        T* dst = op + r * os[0] + (h * group + i / n) * os[1] + (i % n) * os[2];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[i * dim + d]);
      }
    }
  });
}

// Head dims with a compiled instance, in vectors: whole numbers of them, held in registers.
using Chunks = std::integer_sequence<int, 1, 2, 4, 8, 16>;

template <typename T, int... C>
void run_for_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                 at::Tensor& out, double scale, std::integer_sequence<int, C...>) {
  const bool ran = ((q.size(3) == C * W && (run<T, C>(q, k, v, mask, out, scale), true)) || ...);
  TORCH_CHECK(ran, "unsupported head dim ", q.size(3));
}

template <int... C>
std::vector<int64_t> dims_of(std::integer_sequence<int, C...>) {
  return {int64_t{C} * W...};
}

// Checks the kernel's inputs and runs it into `out` ([R, H, n, D], any strides).
void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                 at::Tensor& out, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3, "bad ranks");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "head dim must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(3) == k.size(3), "shapes differ");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == q.size(0) && mask.size(1) == q.size(2) &&
                  mask.size(2) == k.size(2),
              "mask must be bool [R, n, L]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "dtypes differ");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "bad output");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "short_attention",
                                  [&] { run_for_dim<scalar_t>(q, k, v, mask, out, scale, Chunks{}); });
}

}  // namespace

std::vector<int64_t> head_dims() { return dims_of(Chunks{}); }

// cache[slots[t], :, positions[t]] = fresh[t] for every new token t: fresh [T, KVH, D], cache
// [S, KVH, L, D], D contiguous in both. The same writes as index_put_, without its indexing setup.
void write_kv(at::Tensor cache, const at::Tensor& fresh, const at::Tensor& slots, const at::Tensor& positions) {
  TORCH_CHECK(cache.dim() == 4 && fresh.dim() == 3 && cache.size(1) == fresh.size(1) && cache.size(3) == fresh.size(2),
              "fresh keys / values must be [T, KVH, D] for a [S, KVH, L, D] cache");
  TORCH_CHECK(cache.stride(3) == 1 && fresh.stride(2) == 1, "head dim must be contiguous");
  TORCH_CHECK(cache.scalar_type() == fresh.scalar_type(), "dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.is_contiguous() &&
                  positions.is_contiguous() && slots.numel() == fresh.size(0) && positions.numel() == fresh.size(0),
              "slots and positions must be int64 [T]");
  const int64_t tokens = fresh.size(0), heads = fresh.size(1), bytes = fresh.size(2) * fresh.element_size();
  const int64_t item = cache.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(fresh.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {  // all checked before any is written
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cache.size(0) && pp[t] >= 0 && pp[t] < cache.size(2), "slot or position out of range");
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + (sp[t] * cache.stride(0) + h * cache.stride(1) + pp[t] * cache.stride(2)) * item,
                  src + (t * fresh.stride(0) + h * fresh.stride(1)) * item, bytes);
    }
  }
}

// q [R, H, n, D], k / v [R, KVH, L, D] (D contiguous), mask [R, n, L] (True = attend; every row
// attends at least one key). Returns [R, H, n, D] in q's dtype.
at::Tensor short_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                           double scale) {
  auto out = at::empty(q.sizes(), q.options());
  attend_into(q, k, v, mask, out, scale);
  return out;
}

// One layer of a decode step whose R requests own cache slots lo..lo + R - 1 in order, each adding n
// tokens: writes the new k / v [R * n, KVH, D] at (token_slots, positions), then attends q
// [R * n, H, D] over each slot's first `length` keys with mask [R, n, length]. Returns [R * n, H * D]:
// the values of `short_attention` on the same views, in one call instead of a dozen tensor ops.
at::Tensor write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& token_slots, const at::Tensor& positions, int64_t lo,
                            int64_t rows, int64_t length, const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && rows > 0 && q.size(0) % rows == 0, "q must be [R * n, H, D]");
  TORCH_CHECK(lo >= 0 && lo + rows <= k_cache.size(0) && length <= k_cache.size(2), "slots or length out of range");
  write_kv(k_cache, k, token_slots, positions);
  write_kv(v_cache, v, token_slots, positions);
  const int64_t tokens = q.size(0), n = tokens / rows, heads = q.size(1), dim = q.size(2);
  auto queries = q.view({rows, n, heads, dim}).transpose(1, 2);
  auto out = at::empty({rows, n, heads, dim}, q.options());
  auto out_heads_first = out.transpose(1, 2);
  attend_into(queries, k_cache.narrow(0, lo, rows).narrow(2, 0, length),
              v_cache.narrow(0, lo, rows).narrow(2, 0, length), mask, out_heads_first, scale);
  return out.view({tokens, heads * dim});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("short_attention", &short_attention);
  m.def("write_and_attend", &write_and_attend);
  m.def("write_kv", &write_kv);
  m.def("head_dims", &head_dims);
}
