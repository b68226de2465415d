// A stack of decoder layers as one native call: the kernels of fused.cpp and the quantized linears, called
// in exactly the order llama.Block's fused path calls them from Python (project, attend, finish), so every
// row gets the same bits. What it saves is the dispatch: ~10 calls through Python and pybind per layer,
// ~0.7 ms of SmolLM2's ~6 ms step on one thread.
#include <torch/extension.h>

#include "ops.h"

#include <tuple>
#include <vector>

namespace {

using Tensor = torch::Tensor;
using OptTensor = c10::optional<Tensor>;

// gguf.QuantWeight: groups of quantized parts side by side, one kernel op per group, then the bias and
// the residual (one group: both inside its kernel call).
struct QuantLinear {
  struct Group {
    std::vector<Tensor> ws;
    std::vector<int64_t> types;
    bool x16;
  };
  std::vector<Group> groups;
  OptTensor bias;

  Tensor run(const Group& g, const Tensor& x, const OptTensor& bias_, const OptTensor& residual) const {
    return g.x16 ? qlinear16(x, g.ws, g.types, bias_, residual) : qlinear(x, g.ws, g.types, bias_, residual);
  }

  Tensor operator()(const Tensor& x, const OptTensor& residual = c10::nullopt) const {
    if (groups.size() == 1) return run(groups[0], x, bias, residual);
    std::vector<Tensor> ys;
    for (const auto& g : groups) ys.push_back(run(g, x, c10::nullopt, c10::nullopt));
    Tensor y = at::cat(ys, -1);
    if (bias) y = y + *bias;
    return residual ? *residual + y : y;
  }
};

using GroupSpec = std::tuple<std::vector<Tensor>, std::vector<int64_t>, bool>;
using LinearSpec = std::tuple<std::vector<GroupSpec>, OptTensor>;

QuantLinear make_linear(const LinearSpec& spec) {
  QuantLinear l;
  for (const auto& [ws, types, x16] : std::get<0>(spec)) l.groups.push_back({ws, types, x16});
  l.bias = std::get<1>(spec);
  return l;
}

struct Layer {
  OptTensor in_norm;
  Tensor post_norm;
  double eps;
  int64_t index, nh, nkv;
  QuantLinear qkv, o, gate_up, down;
};

class Stack {
 public:
  void add(const OptTensor& in_norm, const Tensor& post_norm, double eps, int64_t index, int64_t nh, int64_t nkv,
           const LinearSpec& qkv, const LinearSpec& o, const LinearSpec& gate_up, const LinearSpec& down) {
    layers_.push_back({in_norm, post_norm, eps, index, nh, nkv, make_linear(qkv), make_linear(o),
                       make_linear(gate_up), make_linear(down)});
  }

  // h [n, H] through layers [first, last): K/V written to k[index, 0], v[index, 0] at columns start.., every
  // row attending over exactly its visible columns (mask [n, start + n], or none: each row after all before it).
  Tensor forward(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& k, const Tensor& v, int64_t start,
                 const OptTensor& mask, int64_t first, int64_t last) const {
    TORCH_CHECK(0 <= first && first <= last && last <= static_cast<int64_t>(layers_.size()), "layers out of range");
    for (int64_t i = first; i < last; i++) {
      const Layer& l = layers_[i];
      const Tensor x = l.in_norm ? rms_norm(h, *l.in_norm, l.eps) : h;
      const Tensor kc = k.select(0, l.index).select(0, 0), vc = v.select(0, l.index).select(0, 0);
      const Tensor q = rope_store(l.qkv(x), cos, sin, kc, vc, start, l.nh, l.nkv);
      h = l.o(attend(q, kc, vc, start, mask), h);
      h = l.down(silu_mul(l.gate_up(rms_norm(h, l.post_norm, l.eps))), h);
    }
    return h;
  }

  // Several sequences' rows packed in h [sum(sizes), H] (llama.Block.attend_many's path): the linears and
  // norms once over all rows, RoPE, the cache writes and attention per sequence into its own ks[s], vs[s].
  Tensor forward_many(Tensor h, const Tensor& cos, const Tensor& sin, const std::vector<Tensor>& ks,
                      const std::vector<Tensor>& vs, const std::vector<int64_t>& starts,
                      const std::vector<int64_t>& sizes, const std::vector<OptTensor>& masks, int64_t first,
                      int64_t last) const {
    TORCH_CHECK(0 <= first && first <= last && last <= static_cast<int64_t>(layers_.size()), "layers out of range");
    for (int64_t i = first; i < last; i++) {
      const Layer& l = layers_[i];
      const Tensor x = l.in_norm ? rms_norm(h, *l.in_norm, l.eps) : h;
      const Tensor q = rope_store_many(l.qkv(x), cos, sin, ks, vs, l.index, starts, sizes, l.nh, l.nkv);
      h = l.o(attend_many(q, ks, vs, l.index, starts, sizes, masks), h);
      h = l.down(silu_mul(l.gate_up(rms_norm(h, l.post_norm, l.eps))), h);
    }
    return h;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

void bind_layers(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Stack>(m, "Stack")
      .def(py::init<>())
      .def("add", &Stack::add)
      .def("forward", &Stack::forward, py::call_guard<py::gil_scoped_release>())
      .def("forward_many", &Stack::forward_many, py::call_guard<py::gil_scoped_release>())
      .def("__len__", &Stack::size);
}
