"""What the hybrid engine moves: a model's description and the geometry of its shards.

- ``spec``: ``ModelSpec``, the sizes of a model (read from a Hugging Face
  config) and how its layers split into pipeline stages.
- ``catalogue``: one table of every megatron parameter of a pipeline stage:
  its names (megatron, Hugging Face, vLLM), its shard kind and shape.
- ``hf_mapping``, ``tp_layout``, ``vllm_layout``: cutting and joining TP
  shards, from and to Hugging Face tensors, between TP sizes, and into
  vLLM's per-rank layout.
"""
