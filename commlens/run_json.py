"""The run.json model (`RunConfig`): the exact configuration of a harness run. The harness writes it;
ingest validates it with the same model and attaches it to the run; the predictor reads it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RunSchema = Literal["commlens.run/1"]  # the version a run.json declares; a new layout gets a new literal
RUN_SCHEMA: RunSchema = "commlens.run/1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    vocab: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    ffn_hidden: int | None = None  # default 4 * hidden
    tied_embeddings: bool = False
    learned_pos: bool = True
    param_count: int | None = None  # the real count of the built model (all ranks together)
    kv_heads: int | None = Field(None, ge=1)  # grouped-query attention (not the harness's); default heads
    vocab_divisible_by: int | None = Field(None, ge=1)  # Megatron's vocabulary padding multiple (not the harness's)
    experts: int = Field(0, ge=0)  # mixture of experts: routed experts per MLP (0: dense)
    top_k: int = Field(1, ge=1)  # experts each token is routed to
    capacity_factor: float | None = Field(None, gt=0)  # tokens per expert capped at ceil(F·tokens·k/experts)


# the most ranks of a job, as commlens.contract.common's (the two packages import nothing of each other)
MAX_WORLD = 10_000_000


class ParallelConfig(_Strict):
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    zero: Literal[0, 1, 2, 3] = 0
    sp: bool = False
    micro_batches: int = Field(1, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    # how the dp group reduces gradients: ddp | allreduce | zero1 | zero2 | zero3 | none (dp = 1)
    dp_sync: str | None = None
    ddp_no_sync: bool = True  # accumulation micro-steps skip the DDP gradient sync
    # Layouts other frameworks record and the predictor models (the harness has none of them):
    cp: int = Field(1, ge=1)  # context parallelism (the harness's --cp)
    cp_style: Literal["ring", "attention2d"] = "ring"  # ring attention or ATTENTION2D
    cp_rq: int | None = Field(None, ge=1)  # ATTENTION2D r_Q (None: sqrt(cp)); r_KV = cp / r_Q
    ep: int = Field(1, ge=1)  # expert parallelism (the harness's --ep)
    offload: Literal["none", "optimizer"] = "none"  # ZeRO-3 optimizer on the host (the harness's --offload)
    offload_gap: int = Field(1, ge=1)  # --offload-gpu-fraction 1/g: every g-th shard updated on the GPU
    recompute: Literal["none", "selective", "full"] = "none"
    virtual_stages: int = Field(1, ge=1)  # interleaved pipeline chunks per device

    @model_validator(mode="after")
    def _bounded(self) -> ParallelConfig:
        if (world := self.dp * self.tp * self.pp * self.cp * self.ep) > MAX_WORLD:
            raise ValueError(f"dp*tp*pp*cp*ep = {world:,} is more than {MAX_WORLD:,} ranks")
        return self


class GroupConfig(_Strict):
    dim: str  # dp | tp | pp | world | ...: the DeviceMesh dimension (or role) the group serves
    ranks: list[int]
    pg_name: str | None = None  # torch process-group name, as in Kineto "Process Group Name"
    pg_desc: str | None = None
    backend: str | None = None


class DtypeConfig(_Strict):
    param: str = "float32"
    grad: str = "float32"
    act: str = "float32"


class BucketConfig(_Strict):
    ddp_bucket_cap_mb: float | None = 25.0
    ddp_first_bucket_bytes: int | None = None
    zero_bucket_bytes: int | None = None  # None: not bucketed (one flat buffer, or one FSDP2 unit per block)
    megatron_bucket_params: int | None = None  # Megatron DDP bucket (parameters)
    deepspeed_reduce_bucket_elems: int | None = None
    deepspeed_allgather_bucket_elems: int | None = None


class ProfileConfig(_Strict):
    wait: int = 0
    warmup: int = 1
    active: int = 2
    profiled_steps: list[int] = []


class OptimizerConfig(_Strict):
    name: str = "adamw"
    lr: float = 3e-3
    betas: list[float] = [0.9, 0.95]
    eps: float = 1e-8
    weight_decay: float = 0.0


class RankInfo(_Strict):
    """What one rank held and did (the harness records it; predictions can be checked against it)."""

    rank: int
    coords: dict[str, int] = {}  # {"pp": i, "dp": j, "tp": k}
    host: str | None = None
    param_count: int | None = None  # parameters of this rank's stage slice (before ZeRO sharding)
    sync: dict[str, Any] = {}  # dp-sync facts: ddp_bucket_bytes (last step, call order), flat_numel, ...


class Results(_Strict):
    losses: list[float] = []  # per step: mean over dp replicas of the last stage's loss
    step_seconds: list[float] = []  # wall time per step on rank 0


class DelayConfig(_Strict):
    """A delay the harness injected (`--delay`): ground truth for the straggler analysis."""

    rank: int = Field(ge=0)
    ms: float = Field(gt=0)
    phase: Literal["forward", "backward", "optimizer"] = "forward"


class RunConfig(_Strict):
    schema_: RunSchema = Field(RUN_SCHEMA, alias="schema")
    strategy: str
    world_size: int = Field(ge=1, le=MAX_WORLD)
    model: ModelConfig
    parallel: ParallelConfig
    mesh_dims: list[str] = []
    mesh_shape: list[int] = []
    groups: list[GroupConfig] = []
    dtypes: DtypeConfig = DtypeConfig()
    buckets: BucketConfig = BucketConfig()
    profile: ProfileConfig = ProfileConfig()
    steps: int = Field(1, ge=1)
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    backend: str = "gloo"
    torch_version: str | None = None
    nccl_version: str | None = None
    host: str | None = None
    command: list[str] = []
    created_at: str | None = None
    implementation: str = "harness"
    optimizer: OptimizerConfig | None = None
    ranks: list[RankInfo] = []
    results: Results | None = None
    step_wall_ms: dict[int, list[float]] = {}  # per rank: wall time of every step (profiled or not), ms
    delays: list[DelayConfig] = []  # injected delays (harness --delay)
    # MoE routing of the profiled steps: step -> rank -> per all-to-all dispatch (micro-batch, layer order), the
    # (token, expert) rows the rank sent to each ep rank; the prediction of that step is exact from it
    moe_routing: dict[int, dict[int, list[list[int]]]] = {}

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
