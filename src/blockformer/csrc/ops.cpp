/* The decode products of csrc/ (f32_matmul, int8_matmul, int4_matmul, int4_a8_matmul, int8_a8_matmul), and its
 * decode attention (decode_attention), as C++
 * operators of torch's dispatcher, torch.ops.blockformer_c.*: an eager layer or a compiled step reaches the
 * C kernels without a Python function in between (about 6 us a call, 49 calls a GPT-2-small
 * token). Same schemas, arguments and results as the Python functions in generate/packed.py,
 * generate/quantize.py and nn/decode_attention.py. The kernels are the libraries blockformer.native built; their
 * addresses are handed over once by blockformer_c_set_kernels, so this file links against
 * torch alone. Built by blockformer.native with the C++ compiler and torch's headers.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

extern "C" {
typedef void (*f32_fn)(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t);
typedef void (*int8_fn)(const float *, const int8_t *, const float *, const float *, float *, int64_t, int64_t,
                        int64_t, int64_t);
typedef void (*int4_fn)(const float *, const uint8_t *, const float *, const float *, const float *, float *, float *,
                        int64_t, int64_t, int64_t, int64_t, int64_t);
typedef void (*int8_a8_fn)(const float *, const int8_t *, const float *, const float *, float *, float *, int64_t,
                           int64_t, int64_t, int64_t);
typedef void (*attention_fn)(const float *, const void *, const void *, const uint8_t *, const float *, const float *,
                             float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             float);
}

static f32_fn f32_kernel;
static int8_fn int8_kernel;
static int4_fn int4_kernel, int4_a8_kernel;  // the same arguments; int4_a8's scratch holds the rounded rows
static int8_a8_fn int8_a8_kernel;
static attention_fn attention_kernel;

extern "C" void blockformer_c_set_kernels(void *f32, void *int8, void *int4, void *int4_a8, void *int8_a8,
                                          void *attention) {
    f32_kernel = reinterpret_cast<f32_fn>(f32);
    int8_kernel = reinterpret_cast<int8_fn>(int8);
    int4_kernel = reinterpret_cast<int4_fn>(int4);
    int4_a8_kernel = reinterpret_cast<int4_fn>(int4_a8);
    int8_a8_kernel = reinterpret_cast<int8_a8_fn>(int8_a8);
    attention_kernel = reinterpret_cast<attention_fn>(attention);
}

namespace {

/* torch's threads, at most one per output channel (native.pieces) */
int64_t pieces(int64_t n) { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)); }

/* x's shape with its last dimension n */
at::Tensor output(const at::Tensor &x, int64_t n) {
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    return at::empty(sizes, x.options());
}

/* fp32 values the kernel reads (held in `hold` until the call returns), or NULL */
const float *fp32(const std::optional<at::Tensor> &t, at::Tensor &hold) {
    if (!t.has_value()) return nullptr;
    hold = t->to(at::kFloat).contiguous();
    return hold.data_ptr<float>();
}

at::Tensor checked(const at::Tensor &x, const at::Tensor &w, int64_t k, at::ScalarType wtype, const char *op) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, op, ": x must be fp32, got ", x.scalar_type());
    TORCH_CHECK(w.scalar_type() == wtype && w.dim() == 2 && w.is_contiguous() && w.size(1) == k, op,
                ": the weight must be a contiguous (out, ", k, ") tensor of ", wtype, ", got ", w.sizes(), " ",
                w.scalar_type());
    return x.contiguous();
}

at::Tensor f32_matmul(const at::Tensor &x_, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(f32_kernel, "blockformer_c: the kernels were not handed over");
    const int64_t k = x_.size(-1), n = weight.size(0);
    at::Tensor x = checked(x_, weight, k, at::kFloat, "f32_matmul"), b, y = output(x, n);
    f32_kernel(x.data_ptr<float>(), weight.data_ptr<float>(), fp32(bias, b), y.data_ptr<float>(), x.numel() / k, k, n,
               pieces(n));
    return y;
}

at::Tensor int8_matmul(const at::Tensor &x_, const at::Tensor &weight, const at::Tensor &scales,
                       const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(int8_kernel, "blockformer_c: the kernels were not handed over");
    const int64_t k = x_.size(-1), n = weight.size(0);
    at::Tensor x = checked(x_, weight, k, at::kChar, "int8_matmul"), b, y = output(x, n);
    const at::Tensor s = scales.to(at::kFloat).contiguous();
    int8_kernel(x.data_ptr<float>(), weight.data_ptr<int8_t>(), s.data_ptr<float>(), fp32(bias, b), y.data_ptr<float>(),
                x.numel() / k, k, n, pieces(n));
    return y;
}

at::Tensor int4_matmul(const at::Tensor &x_, const at::Tensor &codes, const at::Tensor &scales,
                       const at::Tensor &zeros, int64_t group_size, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(int4_kernel, "blockformer_c: the kernels were not handed over");
    const int64_t k = x_.size(-1), n = codes.size(0), rows = x_.numel() / std::max<int64_t>(k, 1);
    at::Tensor x = checked(x_, codes, k / 2, at::kByte, "int4_matmul"), b, y = output(x, n);
    TORCH_CHECK(group_size > 0 && k % group_size == 0, "int4_matmul: group_size ", group_size, " must divide ", k);
    const at::Tensor s = scales.to(at::kFloat).contiguous(), z = zeros.to(at::kFloat).contiguous();
    at::Tensor sums = at::empty({rows, k / group_size}, x.options());
    int4_kernel(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), s.data_ptr<float>(), z.data_ptr<float>(),
                fp32(bias, b), y.data_ptr<float>(), sums.data_ptr<float>(), rows, k, group_size, n, pieces(n));
    return y;
}

at::Tensor int4_a8_matmul(const at::Tensor &x_, const at::Tensor &codes, const at::Tensor &scales,
                          const at::Tensor &zeros, int64_t group_size, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(int4_a8_kernel, "blockformer_c: the kernels were not handed over");
    const int64_t k = x_.size(-1), n = codes.size(0), rows = x_.numel() / std::max<int64_t>(k, 1);
    at::Tensor x = checked(x_, codes, k / 2, at::kByte, "int4_a8_matmul"), b, y = output(x, n);
    TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0, "int4_a8_matmul: group_size ",
                group_size, " must be a multiple of 32 that divides ", k);
    const at::Tensor s = scales.to(at::kFloat).contiguous(), z = zeros.to(at::kFloat).contiguous();
    at::Tensor scratch = at::empty({rows * (k / 4 + k / 8 + k / 32 + k / group_size)}, x.options());
    int4_a8_kernel(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), s.data_ptr<float>(), z.data_ptr<float>(),
                   fp32(bias, b), y.data_ptr<float>(), scratch.data_ptr<float>(), rows, k, group_size, n, pieces(n));
    return y;
}

at::Tensor int8_a8_matmul(const at::Tensor &x_, const at::Tensor &weight, const at::Tensor &scales,
                          const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(int8_a8_kernel, "blockformer_c: the kernels were not handed over");
    const int64_t k = x_.size(-1), n = weight.size(0), rows = x_.numel() / std::max<int64_t>(k, 1);
    at::Tensor x = checked(x_, weight, k, at::kChar, "int8_a8_matmul"), b, y = output(x, n);
    TORCH_CHECK(k % 32 == 0, "int8_a8_matmul: the inputs (", k, ") must be a multiple of 32");
    const at::Tensor s = scales.to(at::kFloat).contiguous();
    at::Tensor scratch = at::empty({rows * (k / 32 + k / 4)}, x.options());
    int8_a8_kernel(x.data_ptr<float>(), weight.data_ptr<int8_t>(), s.data_ptr<float>(), fp32(bias, b),
                   y.data_ptr<float>(), scratch.data_ptr<float>(), rows, k, n, pieces(n));
    return y;
}

/* one query token per row over the slots of k, v that mask keeps (nn/decode_attention.py says where it is used) */
at::Tensor decode_attention(const at::Tensor &q_, const at::Tensor &k, const at::Tensor &v,
                            const std::optional<at::Tensor> &mask_, double scale,
                            const std::optional<at::Tensor> &k_scale, const std::optional<at::Tensor> &v_scale) {
    TORCH_CHECK(attention_kernel, "blockformer_c: the kernels were not handed over");
    TORCH_CHECK(q_.dim() == 4 && q_.size(2) == 1 && k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == q_.size(0) &&
                    k.size(3) == q_.size(3) && q_.size(1) % k.size(1) == 0,
                "decode_attention: expected q (B, H, 1, D) and k, v (B, H_kv, S, D), got ", q_.sizes(), " ", k.sizes(),
                " ", v.sizes());
    const auto kv = k.scalar_type();
    TORCH_CHECK(q_.scalar_type() == at::kFloat && v.scalar_type() == kv &&
                    (kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf || kv == at::kChar) &&
                    k.stride(3) == 1 && v.stride(3) == 1,
                "decode_attention: expected an fp32 q, and k, v both fp32, bf16, fp16 or int8 with each slot's values "
                "contiguous");
    const bool scaled = k_scale.has_value() && v_scale.has_value();
    TORCH_CHECK((kv == at::kChar) == scaled && (scaled || (!k_scale.has_value() && !v_scale.has_value())),
                "decode_attention: expected k_scale and v_scale both with an int8 cache and neither otherwise");
    for (const auto &sc : {k_scale, v_scale})
        TORCH_CHECK(!scaled || (sc->scalar_type() == at::kFloat && sc->dim() == 3 && sc->size(0) == k.size(0) &&
                                sc->size(1) == k.size(1) && sc->size(2) == k.size(2) && sc->stride(2) == 1),
                    "decode_attention: expected fp32 k_scale and v_scale (B, H_kv, S), each head's slots contiguous");
    const int64_t B = q_.size(0), H = q_.size(1), S = k.size(2), threads = pieces(B * H);
    at::Tensor mask;  // undefined: every slot
    if (mask_.has_value()) {
        const at::Tensor &m = *mask_;
        TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) &&
                        m.size(1) == 1 && m.size(2) == 1 && m.size(3) == S,
                    "decode_attention: expected a bool mask (B or 1, 1, 1, S), got ", m.sizes(), " ", m.scalar_type());
        mask = m.select(2, 0).select(1, 0);
        if (mask.stride(1) != 1) mask = mask.contiguous();
    }
    const at::Tensor q = q_.contiguous();
    at::Tensor out = at::empty_like(q);
    at::Tensor scores = at::empty({threads * S}, q.options());
    const auto *mask_ptr = mask.defined() ? static_cast<const uint8_t *>(mask.data_ptr()) : nullptr;
    const int64_t mb = mask.defined() && mask.size(0) == B ? mask.stride(0) : 0;
    const float *ks_ptr = scaled ? k_scale->data_ptr<float>() : nullptr;
    const float *vs_ptr = scaled ? v_scale->data_ptr<float>() : nullptr;
    attention_kernel(q.data_ptr<float>(), k.data_ptr(), v.data_ptr(), mask_ptr, ks_ptr, vs_ptr, out.data_ptr<float>(),
                     scores.data_ptr<float>(), B, H, k.size(1), S, q.size(3), k.stride(0), k.stride(1), k.stride(2),
                     v.stride(0), v.stride(1), v.stride(2), mb, scaled ? k_scale->stride(0) : 0,
                     scaled ? k_scale->stride(1) : 0, scaled ? v_scale->stride(0) : 0, scaled ? v_scale->stride(1) : 0,
                     threads, kv == at::kFloat ? 0 : kv == at::kBFloat16 ? 1 : kv == at::kHalf ? 2 : 3,
                     static_cast<float>(scale));
    return out;
}

}  // namespace

TORCH_LIBRARY(blockformer_c, m) {
    m.def("f32_matmul(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("int8_matmul(Tensor x, Tensor weight, Tensor scales, Tensor? bias=None) -> Tensor");
    m.def("int4_matmul(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int group_size, "
          "Tensor? bias=None) -> Tensor");
    m.def("int4_a8_matmul(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int group_size, "
          "Tensor? bias=None) -> Tensor");
    m.def("int8_a8_matmul(Tensor x, Tensor weight, Tensor scales, Tensor? bias=None) -> Tensor");
    // A changed schema needs a new name: torch's on-disk inductor cache replayed compiled steps built against
    // an earlier schema of this op, with too few arguments (a crash), after its arguments changed (2026-12-07).
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, Tensor? k_scale, "
          "Tensor? v_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(blockformer_c, CPU, m) {
    m.impl("f32_matmul", &f32_matmul);
    m.impl("int8_matmul", &int8_matmul);
    m.impl("int4_matmul", &int4_matmul);
    m.impl("int4_a8_matmul", &int4_a8_matmul);
    m.impl("int8_a8_matmul", &int8_a8_matmul);
    m.impl("decode_attention", &decode_attention);
}
