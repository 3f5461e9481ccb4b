"""The planner: where each model runs and how it is split, from a memory and time model of one RL iteration.

- ``hardware``: accelerators (vendor figures and their sources), clusters, ``parse_cluster``;
- ``workload``: what a step asks of each role, read from the job's config (models from config.json alone);
- ``memory``: model state per device to the byte (megatron's buffers), activations and KV cache;
- ``timing``: seconds per stage from FLOPs, bytes and links, and the framework's host costs;
- ``options``: every layout of one role on n devices that fits, undominated;
- ``search``: placements x device splits x layouts (HybridFlow's auto-mapping), exact pruning;
- ``report``: tables, a plan's config overrides, JSON;
- ``command``: ``hybridflow plan``; ``prelaunch``: the job's own plan and the pre-launch memory check;
- ``device_map``: ``device_map="auto"``'s layouts for a job's placement;
- ``calibrate``: this machine measured; ``fit``: the host costs fitted to measured phase times.

Pure (but ``calibrate``'s measurement): no process starts and nothing is loaded but config files. The
submodules are imported where they are used (``controller.planner.search`` and so on), so ``hybridflow``'s
other commands do not load them.
"""

