// The ops fused.cpp and quant.cpp define and stream.cpp's module exports: one declaration each, included
// by the file that defines an op (so the compiler checks it) and by the one that binds it.
#pragma once
#include <torch/extension.h>

#include <vector>

// fused.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gu);
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor kc, torch::Tensor vc, int64_t start, int64_t nh, int64_t nkv);
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, int64_t start,
                     const c10::optional<torch::Tensor>& mask);
torch::Tensor rope_store_many(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                              const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs, int64_t layer,
                              const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes, int64_t nh,
                              int64_t nkv);
torch::Tensor attend_many(const torch::Tensor& q, const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                          int64_t layer, const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes,
                          const std::vector<c10::optional<torch::Tensor>>& masks);

// quant.cpp
torch::Tensor qlinear(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                      const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual);
torch::Tensor qdequant(const torch::Tensor& w, int64_t type, int64_t K, const torch::Tensor& ids);

// interleaved.cpp
bool x16_type(int64_t t);
torch::Tensor repack16(const torch::Tensor& w, int64_t type);
torch::Tensor unpack16(const torch::Tensor& w, int64_t type);  // repack16's inverse
torch::Tensor qdequant16(const torch::Tensor& w, int64_t type, int64_t K, const torch::Tensor& ids);
torch::Tensor qlinear16(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                        const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual);

// random.cpp: sampling.uniform64's counter-based float64 uniforms, bit for bit
torch::Tensor uniform64(uint64_t seed, int64_t n);
int64_t race(const torch::Tensor& probs, const torch::Tensor& u);  // sampling.Coupling's draw

// layers.cpp: llama.Block's fused path as one call per stack of layers (class Stack)
void bind_layers(pybind11::module_& m);
