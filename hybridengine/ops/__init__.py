"""Python side of the csrc op library (``torch.ops.hybridflow``).

One module per op family, each with its wrapper, fake (meta) kernels,
autograd registration and the torch reference it falls back to when the
extension is not built (see ``library``):

- ``log_prob``: fused, vocab-parallel log-prob + entropy of target tokens
- ``linear_log_prob``: output layer fused with the above (logits never held)
- ``advantage_scan``: GAE and discounted returns
- ``copy_blocks``: rectangular block copies (the resharding layout transforms)
"""
