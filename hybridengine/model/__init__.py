"""What the hybrid engine moves: a model's description and the geometry of its shards.

- ``spec``: ``ModelSpec``, the sizes of a model (read from a Hugging Face
  config) and how its layers split into pipeline stages.
- ``geometry``: ``ShardGeometry``, how one parameter splits over TP ranks
  (as data), and every cut, join, split and reorder, written once.
- ``catalogue``: one table of every megatron parameter of a pipeline stage:
  its names (megatron, Hugging Face, vLLM), its geometry and shard shape.
- ``hf_mapping``, ``vllm_layout``: the catalogue read for Hugging Face
  checkpoints and for vLLM's per-rank layout.
"""
