"""A model description: the parameter and buffer list of a user's own model and how it is trained.

Written by `commlens describe-model` in the user's environment (it imports their code, commlens does not) and
attached to a run with `commlens config` or `PUT /api/runs/{run}/config`. The predictor derives every gradient
bucket and buffer broadcast from it (docs/model-descriptions.md), so it records exactly what PyTorch's data
parallelism reads: names, shapes and dtypes in `named_parameters()` / `named_buffers()` order."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from commlens.vocab import DTYPE_BYTES

MODEL_DESCRIPTION_SCHEMA = "commlens.model-description/1"
MAX_TENSORS = 1_000_000  # a description is user input: bounded
DEFAULT_BUCKET_CAP_MB = 25.0  # DistributedDataParallel's bucket_cap_mb default
DEFAULT_FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BROADCAST_BUCKET_BYTES = 250 * 2**20  # DistributedDataParallel.broadcast_bucket_size


class TensorSpec(BaseModel):
    """One parameter or buffer as `named_parameters()` / `named_buffers()` list it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=1000)
    shape: list[int] = Field(max_length=64)
    dtype: str
    # parameters only: DDP reduces only those that require gradients (written only when false)
    requires_grad: bool = Field(default=True, exclude_if=lambda v: v)

    @model_validator(mode="after")
    def _check(self) -> TensorSpec:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; one of {', '.join(sorted(DTYPE_BYTES))}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape {self.shape} has a negative dimension")
        return self

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


class WrapUnit(BaseModel):
    """An FSDP / ZeRO-3 wrapping unit: the parameters gathered and reduce-scattered together."""

    model_config = ConfigDict(extra="forbid")

    name: str  # the wrapped module's name ("" for the root)
    params: list[str]  # parameter names it owns, in named_parameters() order


class Strategy(BaseModel):
    """How the model is data-parallel: `ddp` (DistributedDataParallel), `fsdp` or `zero` (ZeRO stage)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["ddp", "fsdp", "zero"] = "ddp"
    dp: int = Field(default=1, ge=1, le=1 << 20)
    # DDP: the bucket cap in MiB; None means DDP's default (25 MiB, with the small first bucket).
    bucket_cap_mb: float | None = Field(default=None, gt=0, le=1 << 20)
    # DDP: the first bucket's cap in bytes as the describing PyTorch computes it (None: the predictor's rule for
    # the recorded version, docs/models.md §6.10).
    first_bucket_bytes: int | None = Field(default=None, ge=1)
    broadcast_buffers: bool = True
    broadcast_bucket_bytes: int = Field(default=DEFAULT_BROADCAST_BUCKET_BYTES, ge=1)
    zero_stage: Literal[1, 2, 3] | None = None  # kind "zero" only
    units: list[WrapUnit] = Field(default_factory=list)  # fsdp / zero-3 wrapping units, when known

    @model_validator(mode="after")
    def _check(self) -> Strategy:
        if self.kind == "zero" and self.zero_stage is None:
            raise ValueError('strategy.kind "zero" needs strategy.zero_stage (1, 2 or 3)')
        if self.kind != "zero" and self.zero_stage is not None:
            raise ValueError(f'strategy.zero_stage is for kind "zero", not {self.kind!r}')
        return self

    @property
    def cap_bytes(self) -> int:
        return int((self.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) * 2**20)


class ModelDescription(BaseModel):
    """Every parameter and buffer of a model and its data-parallel strategy, versioned by `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["commlens.model-description/1"] = Field(alias="schema")
    model: str = ""  # MODULE:FACTORY it was built from
    torch_version: str | None = None  # the PyTorch that described it (bucket rules vary by version)
    parameters: list[TensorSpec] = Field(max_length=MAX_TENSORS)
    buffers: list[TensorSpec] = Field(default_factory=list, max_length=MAX_TENSORS)
    strategy: Strategy = Strategy()

    @model_validator(mode="after")
    def _unique(self) -> ModelDescription:
        for kind, tensors in (("parameters", self.parameters), ("buffers", self.buffers)):
            seen: set[str] = set()
            for i, t in enumerate(tensors):
                if t.name in seen:
                    raise ValueError(f"{kind}[{i}]: name {t.name!r} repeats (named_{kind}() lists each once)")
                seen.add(t.name)
        names = {p.name for p in self.parameters}
        for u, unit in enumerate(self.strategy.units):
            unknown = [n for n in unit.params if n not in names]
            if unknown:
                raise ValueError(f"strategy.units[{u}] names parameters the description lacks: {unknown[:3]}")
        return self

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.parameters)


def is_model_description(doc: object) -> bool:
    """A JSON document claiming to be a model description (its schema says so)."""
    return isinstance(doc, dict) and str(doc.get("schema", "")).startswith("commlens.model-description/")


# ------------------------------------------------------------------------- attaching configuration

ConfigFileKind = Literal[
    "model_description", "run_json", "predict_input", "hf_config", "deepspeed_config", "megatron_args"
]
MAX_CONFIG_FILE_CHARS = 16 * 2**20  # a configuration file is small; anything larger is not one
MAX_CONFIG_FILES = 8


class ParallelOptions(BaseModel):
    """What a file may not say itself: parallel sizes and the like (a Hugging Face config.json names only the
    model). Each given value overrides the files'."""

    model_config = ConfigDict(extra="forbid")

    dp: int | None = Field(default=None, ge=1, le=1 << 20)
    tp: int | None = Field(default=None, ge=1, le=1 << 20)
    pp: int | None = Field(default=None, ge=1, le=1 << 20)
    cp: int | None = Field(default=None, ge=1, le=1 << 20)
    ep: int | None = Field(default=None, ge=1, le=1 << 20)
    zero: Literal[0, 1, 2, 3] | None = None
    sp: bool | None = None
    micro_batches: int | None = Field(default=None, ge=1, le=1 << 20)
    seq_len: int | None = Field(default=None, ge=1, le=1 << 30)
    implementation: Literal["megatron", "deepspeed", "fsdp", "paper"] | None = None


class ConfigFile(BaseModel):
    """One file to attach: its name (for messages) and its text."""

    name: str = Field(min_length=1, max_length=255)
    content: str = Field(max_length=MAX_CONFIG_FILE_CHARS)


class ConfigUpload(BaseModel):
    """`PUT /api/runs/{run}/config`: the files, detected by content, and the options they lack."""

    model_config = ConfigDict(extra="forbid")

    files: list[ConfigFile] = Field(min_length=1, max_length=MAX_CONFIG_FILES)
    options: ParallelOptions = ParallelOptions()


class DetectedFile(BaseModel):
    name: str
    kind: ConfigFileKind


class AttachedConfig(BaseModel):
    """What a run's configuration became: the files as detected, what is stored and what it says."""

    run: str
    files: list[DetectedFile]
    stored: Literal["model_description", "run_config", "predict_input"]
    summary: str  # one line a person reads: the model, its parallel layout, the implementation
    notes: list[str] = []  # what was assumed (defaults a file did not give)
