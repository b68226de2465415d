// A stack of decoder layers as one native call: the kernels of fused.cpp and the quantized linears, called
// in exactly the order llama.Block's (and gemma.GemmaBlock's) fused path calls them from Python (project,
// attend, finish), with the same ATen ops where that path uses torch (Gemma's GeGLU), so every row gets the
// same bits. What it saves is the dispatch: ~10 calls through Python and pybind per layer,
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

// Gemma 3's differences (gemma.GemmaBlock on the fused kernels): q and k normalized per head before RoPE,
// norms on the attention's and the MLP's outputs before their residual adds, GeGLU.
struct GemmaNorms {
  Tensor q, k, attn_out, mlp_out;
};

struct Layer {
  OptTensor in_norm;
  Tensor post_norm;
  double eps;
  int64_t index, nh, nkv, rope, window;  // rope, window: which of forward's RoPE tables and masks it reads
  QuantLinear qkv, o, gate_up, down;
  c10::optional<GemmaNorms> gemma;

  Tensor project(const Tensor& h) const {
    const Tensor x = in_norm ? rms_norm(h, *in_norm, eps) : h;
    Tensor qkv_ = qkv(x);
    if (!gemma) return qkv_;
    const int64_t n = qkv_.size(0), hd = gemma->q.numel();
    const Tensor q = rms_norm(qkv_.narrow(1, 0, nh * hd).reshape({n * nh, hd}), gemma->q, eps).view({n, nh * hd});
    const Tensor k = rms_norm(qkv_.narrow(1, nh * hd, nkv * hd).reshape({n * nkv, hd}), gemma->k, eps)
                         .view({n, nkv * hd});
    return at::cat({q, k, qkv_.narrow(1, (nh + nkv) * hd, qkv_.size(1) - (nh + nkv) * hd)}, -1);
  }

  Tensor finish(const Tensor& a, Tensor h) const {
    if (!gemma) {
      h = o(a, h);
      return down(silu_mul(gate_up(rms_norm(h, post_norm, eps))), h);
    }
    h = h + rms_norm(o(a), gemma->attn_out, eps);
    const auto gu = gate_up(rms_norm(h, post_norm, eps)).chunk(2, -1);
    return h + rms_norm(down(at::gelu(gu[0], "tanh") * gu[1]), gemma->mlp_out, eps);
  }
};

class Stack {
 public:
  void add(const OptTensor& in_norm, const Tensor& post_norm, double eps, int64_t index, int64_t nh, int64_t nkv,
           int64_t rope, int64_t window, const LinearSpec& qkv, const LinearSpec& o, const LinearSpec& gate_up,
           const LinearSpec& down, const c10::optional<std::vector<Tensor>>& gemma) {
    c10::optional<GemmaNorms> g;
    if (gemma) {
      TORCH_CHECK(gemma->size() == 4, "Gemma's norms: q, k, attention output, MLP output");
      g = GemmaNorms{(*gemma)[0], (*gemma)[1], (*gemma)[2], (*gemma)[3]};
    }
    layers_.push_back({in_norm, post_norm, eps, index, nh, nkv, rope, window, make_linear(qkv), make_linear(o),
                       make_linear(gate_up), make_linear(down), g});
  }

  // h [n, H] through layers [first, last): K/V written to k[index, 0], v[index, 0] at columns start.., every
  // row attending over exactly its visible columns (masks[window] [n, start + n], or none: each row after all
  // before it); RoPE from coss[rope], sins[rope] [n, head_dim].
  Tensor forward(Tensor h, const std::vector<Tensor>& coss, const std::vector<Tensor>& sins, const Tensor& k,
                 const Tensor& v, int64_t start, const std::vector<OptTensor>& masks, int64_t first,
                 int64_t last) const {
    check(first, last);
    for (int64_t i = first; i < last; i++) {
      const Layer& l = layers_[i];
      const Tensor kc = k.select(0, l.index).select(0, 0), vc = v.select(0, l.index).select(0, 0);
      const Tensor q = rope_store(l.project(h), coss.at(l.rope), sins.at(l.rope), kc, vc, start, l.nh, l.nkv);
      h = l.finish(attend(q, kc, vc, start, masks.at(l.window)), h);
    }
    return h;
  }

  // Several sequences' rows packed in h [sum(sizes), H] (llama.Block.attend_many's path; one RoPE table): the
  // linears and norms once over all rows, RoPE, the cache writes and attention per sequence into its own
  // ks[s], vs[s], with masks[window][s].
  Tensor forward_many(Tensor h, const Tensor& cos, const Tensor& sin, const std::vector<Tensor>& ks,
                      const std::vector<Tensor>& vs, const std::vector<int64_t>& starts,
                      const std::vector<int64_t>& sizes, const std::vector<std::vector<OptTensor>>& masks,
                      int64_t first, int64_t last) const {
    check(first, last);
    for (int64_t i = first; i < last; i++) {
      const Layer& l = layers_[i];
      const Tensor q = rope_store_many(l.project(h), cos, sin, ks, vs, l.index, starts, sizes, l.nh, l.nkv);
      h = l.finish(attend_many(q, ks, vs, l.index, starts, sizes, masks.at(l.window)), h);
    }
    return h;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  void check(int64_t first, int64_t last) const {
    TORCH_CHECK(0 <= first && first <= last && last <= size(), "layers out of range");
  }

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
