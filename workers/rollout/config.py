"""Typed settings of the rollout role: which engine, its layout and limits, and default sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridengine.reshard.baselines import RESHARD_METHODS
from workers.megatron.lora import LoRAConfig
from workers.rollout.agent.config import AgentConfig
from workers.rollout.batch import TRUNCATION_MODES
from workers.rollout.generator import generator_traits, registered_generators
from workers.rollout.sampling import SamplingConfig
from workers.rollout.serving.engine_loop import UPDATE_POLICIES as SERVER_UPDATE_POLICIES

__all__ = ["LORA_SYNC_MODES", "RolloutConfig"]


LORA_SYNC_MODES = ("auto", "merge", "adapter")


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout: which generation engine, its layout and limits, and the default sampling."""

    # "vllm", "megatron" (megatron-core's static inference engine on the resharded weights, zero copy), or an
    # engine registered with workers.rollout.generator.register_generator
    engine: str = "vllm"
    tensor_parallel: int = 1  # generation TP (t_g); must be reachable from the actor's layout
    pipeline_parallel: int = 1  # generation PP (p_g); vLLM runs 1
    # a mixture of experts' routed experts: whole experts per generation TP rank (vLLM's enable_expert_parallel),
    # placed where the training ranks hold them; false: each expert cut across the generation TP ranks
    expert_parallel: bool = False
    # a mixture of experts' completions carry the experts their tokens were routed to (rollout_routed_experts);
    # the trainer sets it from algorithm.router_replay
    return_routed_experts: bool = False
    # A LoRA actor's weights into the rollout: "merge" (the adapters merged into the generation weights, which
    # receive only the adapters' bytes after the first sync), "adapter" (vLLM serves the adapters with its
    # LoRA kernels on the frozen base, loaded once) or "auto" (the planner's choice on the job's devices, by
    # memory then step time: controller.planner.lora_choice). lora_adapter is set by the job from actor.lora.
    lora_sync: str = "auto"
    lora_adapter: LoRAConfig | None = None  # the actor's adapters (rank, alpha, targets); None: no LoRA
    max_prompt_length: int = 64  # prompt tokens at most (longer ones: see truncation)
    truncation: str = "error"  # prompts over max_prompt_length: "error" (default) or "left" (keep the end)
    # the default sampling; a call's meta_info["sampling"] overrides any of its fields
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # how the actor's weights reach the generation layout: "micro_dp" (the 3D-HybridEngine's collective gather),
    # "pieces" (the same bound point to point, the weight plan's one executor: hybridengine.reshard.dense_group)
    # or a baseline the gather is measured against, "full_allgather" or "tp_pp_gather" (hybridengine.reshard.baselines)
    reshard_method: str = "micro_dp"
    release_training: bool = True  # free the actor's training shards while the generation buffer exists
    # weights reach an engine that loads in buckets (vLLM) this many bytes at a time (a larger tensor alone):
    # during a sync the generation side holds one bucket beyond the model, not a second model
    weight_bucket_bytes: int = 256 << 20
    pad_token_id: int | None = None  # None: the tokenizer's
    eos_token_id: int | None = None  # None: the tokenizer's
    # vLLM only
    kv_cache_bytes: int = 64 << 20
    max_num_seqs: int = 256  # sequences in one vLLM engine batch at most (vLLM's max_num_seqs)
    enforce_eager: bool = True  # vLLM runs eagerly: no compilation or CUDA graphs, a faster start
    sleep_between_rollouts: bool = True  # GPU: free KV cache and weights while training
    seed: int = 0  # the vLLM engine's own seed; each request's draws come from sampling.seed
    # Multi-turn, tool-calling rollouts (workers.rollout.agent): None is the single-turn rollout.
    agent: AgentConfig | None = None
    # The rollout behind an OpenAI-compatible endpoint on loopback (controller.serving), served by the replicas'
    # vLLM engines; with agent.entrypoint, the user's agent talks to it as the environment.
    server: bool = False
    server_host: str = "127.0.0.1"  # where the OpenAI-compatible endpoint listens (loopback: this machine only)
    server_port: int = 0  # its port; 0: a free one each time it starts (a taken port is refused before launch)
    # The key every request to the server and its replicas must carry (Authorization: Bearer); None: a random
    # one for each job, never logged (the openai client hybridflow hands an agent carries it)
    server_api_key: str | None = None
    server_max_sessions: int = 256  # sessions open at once at most (the trainer's and others'); more: HTTP 429
    server_max_n: int = 16  # choices a request may ask for (n) at most; more: HTTP 400
    # A weight update while requests are in flight (trainer.mode async): "pause" (they go on under the new
    # weights, each token tagged with its policy version) or "finish" (they end under the old weights first)
    server_update: str = "pause"
    # "auto": the planner picks the fastest generation TP that fits the devices (controller.planner.device_map),
    # unless tensor_parallel or pipeline_parallel is other than 1
    device_map: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sampling, dict):
            object.__setattr__(self, "sampling", SamplingConfig(**self.sampling))
        if isinstance(self.agent, dict):
            object.__setattr__(self, "agent", AgentConfig(**self.agent))
        if isinstance(self.lora_adapter, dict):
            object.__setattr__(self, "lora_adapter", LoRAConfig(**self.lora_adapter))
        problems = []
        if self.device_map not in (None, "auto"):
            problems.append(f"device_map {self.device_map!r} is not one of ('auto', None)")
        if self.engine not in registered_generators():
            problems.append(f"engine {self.engine!r} is not one of {registered_generators()}")
        if self.truncation not in TRUNCATION_MODES:
            problems.append(f"truncation {self.truncation!r} is not one of {TRUNCATION_MODES}")
        if self.lora_sync not in LORA_SYNC_MODES:
            problems.append(f"lora_sync {self.lora_sync!r} is not one of {LORA_SYNC_MODES}")
        traits = generator_traits(self.engine, strict=False)  # an unknown engine: reported above
        if self.lora_sync == "adapter" and self.engine in registered_generators() and not traits.serves_adapters:
            problems.append(f"lora_sync 'adapter' serves LoRA adapters with vLLM's LoRA kernels; the {self.engine!r} "
                            f"engine takes them merged (lora_sync: merge)")
        if self.reshard_method not in RESHARD_METHODS:
            problems.append(f"reshard_method {self.reshard_method!r} is not one of {RESHARD_METHODS}")
        for name in ("tensor_parallel", "pipeline_parallel", "max_prompt_length", "kv_cache_bytes", "max_num_seqs",
                     "weight_bucket_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.engine in registered_generators() and not traits.pipeline_parallel and self.pipeline_parallel != 1:
            problems.append(f"the {self.engine} engine runs pipeline_parallel=1 only, got {self.pipeline_parallel}; "
                            f"use engine='megatron' for pipelined generation")
        if self.agent is not None and self.agent.entrypoint is not None and not self.server:
            problems.append(f"agent.entrypoint {self.agent.entrypoint!r} talks to the rollout server: set "
                            f"server: true")
        if self.server and (self.tensor_parallel, self.pipeline_parallel) != (1, 1):
            problems.append(f"server: true serves one engine per process: tensor_parallel=1, pipeline_parallel=1, got "
                            f"{self.tensor_parallel} x {self.pipeline_parallel}")
        if isinstance(self.server_port, bool) or not isinstance(self.server_port, int) or not 0 <= self.server_port < 65536:
            problems.append(f"server_port must be an integer in [0, 65535] (0: a free port), got {self.server_port!r}")
        if self.server_api_key is not None and (not isinstance(self.server_api_key, str) or len(self.server_api_key) < 16):
            problems.append("server_api_key must be a string of at least 16 characters (None: a random key per job)")
        for name in ("server_max_sessions", "server_max_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if (self.serves_agent and isinstance(self.server_max_sessions, int)
                and self.agent.max_concurrent_sessions > self.server_max_sessions):
            problems.append(f"agent.max_concurrent_sessions {self.agent.max_concurrent_sessions} is over "
                            f"server_max_sessions {self.server_max_sessions}: the server would refuse the job's own "
                            f"agents")
        if self.server_update not in SERVER_UPDATE_POLICIES:
            problems.append(f"server_update {self.server_update!r} is not one of {SERVER_UPDATE_POLICIES}")
        if self.server and self.engine in registered_generators() and not traits.serves_requests:
            problems.append(f"server: true serves requests one by one with vLLM's engine; the {self.engine!r} engine "
                            f"generates batches")
        if self.agent is not None and (self.tensor_parallel, self.pipeline_parallel) != (1, 1):
            problems.append(f"agent (multi-turn) rollouts generate at tensor_parallel=1, pipeline_parallel=1 for now, "
                            f"got {self.tensor_parallel} x {self.pipeline_parallel}: the ranks of a generation group "
                            f"would have to agree on every turn's batch while tools run")
        if problems:
            raise ValueError("invalid rollout config: " + "; ".join(problems))

    @property
    def serves_agent(self) -> bool:
        """The user's agent generates through the server (``agent.entrypoint``): a step's batch may hold more
        rows than prompts x n (sessions that split, padding to whole mini-batches)."""
        return self.server and self.agent is not None and self.agent.entrypoint is not None

    @property
    def max_response_length(self) -> int:
        """Tokens after the prompt: one reply, or a whole multi-turn conversation's (agent.max_response_length)."""
        return self.agent.max_response_length if self.agent is not None else self.sampling.max_new_tokens

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_length + self.max_response_length
