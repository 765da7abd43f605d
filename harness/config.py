"""The harness's own configuration: what the user asked for, validated before any process starts.

No torch import here: the CLI validates and refuses impossible configs without paying for torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEDULES = ("gpipe", "1f1b")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
# Mesh dimension order, outermost first: ranks vary fastest along tp, then dp, then pp (Megatron order).
MESH_ORDER = ("pp", "dp", "tp")
# Where an injected delay (--delay) sleeps: before the step's first forward, its first backward, or the
# end-of-step synchronisation and optimizer update.
DELAY_PHASES = ("forward", "backward", "optimizer")


class ConfigError(ValueError):
    """An impossible configuration; the message says what to change."""


@dataclass(frozen=True)
class Delay:
    """A straggler planted on purpose: `rank` sleeps `ms` before `phase` of every step (ground truth for
    the time analysis, which must name that rank)."""

    rank: int
    ms: float
    phase: str = "forward"

    @classmethod
    def parse(cls, spec: str) -> Delay:
        """`RANK:MS[:PHASE]`, e.g. `1:60` or `3:25.5:backward`; range checks are `validation_errors`'."""
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"--delay {spec!r}: expected RANK:MS[:PHASE], for example 1:60 or 1:60:backward")
        try:
            rank, ms = int(parts[0]), float(parts[1])
        except ValueError:
            raise ConfigError(f"--delay {spec!r}: RANK must be an integer and MS a number of milliseconds") from None
        return cls(rank, ms, parts[2] if len(parts) == 3 else "forward")


def parse_delays(specs: list[str]) -> list[Delay]:
    """Every --delay value, or one ConfigError listing each malformed one."""
    delays, errors = [], []
    for spec in specs:
        try:
            delays.append(Delay.parse(spec))
        except ConfigError as exc:
            errors.append(str(exc))
    if errors:
        raise ConfigError("\n".join(errors))
    return delays


@dataclass
class HarnessConfig:
    # parallel layout
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    micro_batches: int = 1
    schedule: str = "1f1b"
    # model
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq_len: int = 32
    micro_batch_size: int = 2
    # training
    steps: int = 4
    lr: float = 3e-3
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    # profiler schedule (torch.profiler.schedule, repeat=1)
    profile_wait: int = 1
    profile_warmup: int = 1
    profile_active: int = 2
    timeout_s: float = 300.0  # process-group timeout, so a dead peer ends the job instead of hanging it
    delays: list[Delay] = field(default_factory=list)  # injected stragglers (--delay)

    def __post_init__(self) -> None:
        # A config read back from JSON holds the delays as dicts.
        self.delays = [d if isinstance(d, Delay) else Delay(**d) for d in self.delays]

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def mesh_dims(self) -> list[str]:
        """Mesh dimensions that exist (size > 1), outermost first."""
        return [d for d in MESH_ORDER if getattr(self, d) > 1]

    @property
    def mesh_shape(self) -> list[int]:
        return [getattr(self, d) for d in self.mesh_dims]

    @property
    def profiled_steps(self) -> list[int]:
        first = self.profile_wait + self.profile_warmup
        return list(range(first, first + self.profile_active))

    @property
    def dp_sync(self) -> str:
        """How the dp group reduces gradients: ddp | allreduce | zero1 | zero2 | zero3 | none."""
        if self.dp == 1:
            return "none"
        if self.zero:
            return f"zero{self.zero}"
        return "ddp" if self.pp == 1 else "allreduce"

    @property
    def strategy(self) -> str:
        parts = []
        if self.dp > 1:
            parts.append({"ddp": "ddp", "allreduce": "dp-allreduce"}.get(self.dp_sync, self.dp_sync))
        if self.tp > 1:
            parts.append("tp-sp" if self.sp else "tp")
        if self.pp > 1:
            parts.append(f"pp-{self.schedule}")
        return "+".join(parts) or "single"

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank: rank = (pp_i * dp + dp_i) * tp + tp_i."""
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HarnessConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown harness config keys: {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> HarnessConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def resolve_world(dp: int | None, tp: int, pp: int, nproc: int | None) -> int:
    """The dp degree from --dp and/or --nproc: dp = nproc / (tp * pp) when only --nproc is given."""
    if tp < 1 or pp < 1 or (dp is not None and dp < 1) or (nproc is not None and nproc < 1):
        raise ConfigError("--dp, --tp, --pp and --nproc must be positive integers")
    if nproc is None:
        return 1 if dp is None else dp
    if nproc % (tp * pp):
        raise ConfigError(f"world size {nproc} (--nproc) is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
    if dp is not None and dp * tp * pp != nproc:
        raise ConfigError(f"--nproc {nproc} does not equal dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}")
    return nproc // (tp * pp)


def validation_errors(cfg: HarnessConfig, cuda_devices: int | None = None) -> list[str]:
    """Every reason the config cannot run, each one actionable. Empty when it is fine.

    `cuda_devices` is the local GPU count (None: not checked, e.g. for a multi-node dry run)."""
    errors: list[str] = []
    positive = (
        "dp",
        "tp",
        "pp",
        "micro_batches",
        "layers",
        "hidden",
        "heads",
        "vocab",
        "seq_len",
        "micro_batch_size",
        "steps",
        "profile_active",
    )
    for name in positive:
        if getattr(cfg, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.profile_wait < 0 or cfg.profile_warmup < 0:
        errors.append("--profile-wait and --profile-warmup must be >= 0")
    if errors:
        return errors
    if cfg.zero not in (0, 1, 2, 3):
        errors.append(f"--zero must be 0, 1, 2 or 3 (got {cfg.zero})")
    if cfg.zero and cfg.dp == 1:
        errors.append(f"--zero {cfg.zero} shards over the dp group and needs --dp > 1")
    if cfg.schedule not in SCHEDULES:
        errors.append(f"--schedule must be one of {', '.join(SCHEDULES)} (got {cfg.schedule!r})")
    if cfg.layers % cfg.pp:
        errors.append(f"--layers {cfg.layers} is not divisible by --pp {cfg.pp} (each stage holds layers/pp blocks)")
    if cfg.hidden % cfg.heads:
        errors.append(f"--hidden {cfg.hidden} is not divisible by --heads {cfg.heads}")
    if cfg.heads % cfg.tp:
        errors.append(f"--heads {cfg.heads} is not divisible by --tp {cfg.tp} (attention heads are split across tp)")
    if cfg.vocab % cfg.tp:
        errors.append(
            f"--vocab {cfg.vocab} is not divisible by --tp {cfg.tp} (embedding and LM head are vocab-parallel)"
        )
    if cfg.sp and cfg.tp == 1:
        errors.append("--sp (sequence parallelism) needs --tp > 1")
    if cfg.sp and cfg.seq_len % cfg.tp:
        errors.append(f"--sp splits the sequence across tp: --seq-len {cfg.seq_len} is not divisible by --tp {cfg.tp}")
    needed = cfg.profile_wait + cfg.profile_warmup + cfg.profile_active
    if cfg.steps < needed:
        errors.append(
            f"--steps {cfg.steps} is shorter than the profiler schedule wait+warmup+active = "
            f"{cfg.profile_wait}+{cfg.profile_warmup}+{cfg.profile_active} = {needed}"
        )
    if cfg.device not in DEVICES:
        errors.append(f"--device must be cpu or cuda (got {cfg.device!r})")
    if cfg.dtype not in DTYPES:
        errors.append(f"--dtype must be one of {', '.join(DTYPES)} (got {cfg.dtype!r})")
    if cfg.device == "cpu" and cfg.dtype == "float16":
        errors.append("--dtype float16 is not supported by gloo on CPU; use float32 or bfloat16")
    if cfg.device == "cuda" and cuda_devices is not None:
        if cuda_devices == 0:
            errors.append("--device cuda but no CUDA device is visible; use --device cpu")
        elif cfg.world_size > cuda_devices:
            errors.append(
                f"world size {cfg.world_size} needs {cfg.world_size} GPUs on this node but {cuda_devices} are visible; "
                "run multi-node with torchrun (see --help)"
            )
    if cfg.timeout_s <= 0:
        errors.append("--timeout must be > 0 seconds")
    return errors + _delay_errors(cfg)


def _delay_errors(cfg: HarnessConfig) -> list[str]:
    errors = []
    for d in cfg.delays:
        spec = f"--delay {d.rank}:{d.ms:g}:{d.phase}"
        if not 0 <= d.rank < cfg.world_size:
            errors.append(
                f"{spec}: rank {d.rank} is not in the job (world size {cfg.world_size}, ranks 0-{cfg.world_size - 1})"
            )
        if not (math.isfinite(d.ms) and d.ms > 0):
            errors.append(f"{spec}: the delay must be a finite number of milliseconds > 0")
        if d.phase not in DELAY_PHASES:
            errors.append(f"{spec}: phase must be one of {', '.join(DELAY_PHASES)}")
    return errors


def validate(cfg: HarnessConfig, cuda_devices: int | None = None) -> None:
    errors = validation_errors(cfg, cuda_devices)
    if errors:
        raise ConfigError("; ".join(errors))
