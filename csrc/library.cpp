// The op schemas of the hybridflow namespace, and the Python module that
// loads them (importing hybridengine.ops._C runs every registration).
//
// Conventions: logits / weights are float32, bfloat16 or float16 with fp32
// arithmetic; token ids are int64; `scale` multiplies logits before the
// softmax (1 / sampling temperature); `vocab_start` is the vocabulary id of
// column 0 of a tensor-parallel slice. Statistics rows are
// (max, sum exp(x - max), sum exp(x - max) * (x - max), target logit or 0).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(hybridflow, m) {
  // Fused log-prob / entropy of target tokens from logits.
  m.def("logit_stats(Tensor logits, Tensor target, int vocab_start, float scale) -> Tensor");
  m.def("merge_logit_stats(Tensor stats) -> Tensor");
  m.def("log_prob_entropy(Tensor logits, Tensor target, float scale) -> (Tensor, Tensor)");
  m.def(
      "log_prob_entropy_backward(Tensor grad_log_prob, Tensor grad_entropy, Tensor logits, Tensor target, "
      "Tensor log_z, Tensor entropy, int vocab_start, float scale) -> Tensor");
  // Fused output layer + log-prob / entropy, chunked over rows and vocabulary.
  m.def(
      "linear_logit_stats(Tensor hidden, Tensor weight, Tensor target, int vocab_start, float scale, "
      "int chunk_rows, int chunk_vocab) -> Tensor");
  m.def(
      "linear_log_prob_entropy(Tensor hidden, Tensor weight, Tensor target, float scale, int chunk_rows, "
      "int chunk_vocab) -> (Tensor, Tensor)");
  m.def(
      "linear_log_prob_entropy_backward(Tensor grad_log_prob, Tensor grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor target, Tensor log_z, Tensor entropy, int vocab_start, float scale, int chunk_rows, "
      "int chunk_vocab) -> (Tensor, Tensor)");
  // Advantage scans over [batch, length].
  m.def("gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam) -> (Tensor, Tensor)");
  m.def("discounted_returns(Tensor rewards, Tensor mask, float gamma) -> Tensor");
  // Resharding layout transforms: rectangular block copies into a flat buffer.
  m.def("copy_blocks(Tensor(a!) out, Tensor[] sources, Tensor blocks) -> ()");
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "hybridflow's custom ops (torch.ops.hybridflow)", -1,
                                    nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
