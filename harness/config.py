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
# Mesh dimension order, outermost first: ranks vary fastest along tp, then cp, then dp, then pp (Megatron order).
MESH_ORDER = ("pp", "dp", "ep", "cp", "tp")
CP_STYLES = ("ring", "attention2d")
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


@dataclass(frozen=True)
class Hang:
    """A hang planted on purpose (--hang RANK:STEP): at `step` that rank stops before its next collective and
    never arrives; the others time out (--timeout) and every rank dumps its Flight Recorder entries."""

    rank: int
    step: int

    @classmethod
    def parse(cls, spec: str) -> Hang:
        parts = spec.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            return cls(int(parts[0]), int(parts[1]))
        except ValueError:
            raise ConfigError(f"--hang {spec!r}: expected RANK:STEP with two integers, for example 1:2") from None


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
    # context parallelism: the sequence split over cp ranks; ring attention or ATTENTION2D on an r_Q x r_KV mesh
    cp: int = 1
    cp_style: str = "ring"
    cp_rq: int | None = None  # ATTENTION2D r_Q (None: sqrt(cp)); r_KV = cp / r_Q
    # expert parallelism: every MLP is `experts` top-k routed experts, spread over ep ranks (0: dense MLPs)
    ep: int = 1
    experts: int = 0
    top_k: int = 1
    capacity_factor: float | None = None  # None: no token is dropped
    # host offload of the ZeRO-3 optimizer (CUDA only): "none" or "optimizer"; with a fraction 1/g, every g-th
    # parameter shard is updated on the GPU (Deep Optimizer States), the others on the host
    offload: str = "none"
    offload_gpu_fraction: str | None = None  # "1/g"
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
    hang: Hang | None = None  # a rank that never arrives (--hang)

    def __post_init__(self) -> None:
        # A config read back from JSON holds the delays and the hang as dicts.
        self.delays = [d if isinstance(d, Delay) else Delay(**d) for d in self.delays]
        if isinstance(self.hang, dict):
            self.hang = Hang(**self.hang)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def cp_mesh(self) -> tuple[int, int]:
        """ATTENTION2D (r_Q, r_KV): r_Q ranks share a Q block and its output reduction, r_KV a K/V block."""
        r_q = self.cp_rq if self.cp_rq is not None else math.isqrt(self.cp)
        return r_q, self.cp // max(r_q, 1)

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
        if self.dp * self.cp * self.ep == 1:  # with cp (ep) the dense gradients are reduced over dp x cp (x ep)
            return "none"
        if self.zero:
            return f"zero{self.zero}"
        return "ddp" if self.pp == 1 else "allreduce"

    @property
    def strategy(self) -> str:
        parts = []
        if self.dp_sync != "none":
            parts.append({"ddp": "ddp", "allreduce": "dp-allreduce"}.get(self.dp_sync, self.dp_sync))
        if self.cp > 1:
            parts.append(f"cp-{self.cp_style}")
        if self.experts:
            parts.append(f"moe{self.experts}-top{self.top_k}" + (f"-ep{self.ep}" if self.ep > 1 else ""))
        if self.tp > 1:
            parts.append("tp-sp" if self.sp else "tp")
        if self.pp > 1:
            parts.append(f"pp-{self.schedule}")
        return "+".join(parts) or "single"

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank: rank = (((pp_i * dp + dp_i) * ep + ep_i) * cp + cp_i) * tp + tp_i."""
        inner = self.cp * self.tp
        coords = {
            "pp": rank // (self.dp * self.ep * inner),
            "dp": (rank // (self.ep * inner)) % self.dp,
            "cp": (rank // self.tp) % self.cp,
            "tp": rank % self.tp,
        }
        if self.ep > 1:
            coords["ep"] = (rank // inner) % self.ep
        return coords

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
    positive = (
        "dp",
        "tp",
        "pp",
        "cp",
        "ep",
        "top_k",
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
    errors = [
        f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})"
        for name in positive
        if getattr(cfg, name) < 1
    ]
    if cfg.profile_wait < 0 or cfg.profile_warmup < 0:
        errors.append("--profile-wait and --profile-warmup must be >= 0")
    if errors:
        return errors
    return (
        _layout_errors(cfg)
        + _device_errors(cfg, cuda_devices)
        + _delay_errors(cfg)
        + _hang_errors(cfg)
        + _cp_errors(cfg)
        + _ep_errors(cfg)
        + _offload_errors(cfg)
    )


def _layout_errors(cfg: HarnessConfig) -> list[str]:
    """The parallel layout and the model shape: every degree must divide what it splits."""
    errors = []
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
    return errors


def _device_errors(cfg: HarnessConfig, cuda_devices: int | None) -> list[str]:
    errors = []
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
    return errors


def _cp_errors(cfg: HarnessConfig) -> list[str]:
    """Context parallelism: the sequence must split evenly and the ATTENTION2D mesh must tile cp."""
    errors = []
    if cfg.cp_style not in CP_STYLES:
        errors.append(f"--cp-style must be one of {', '.join(CP_STYLES)} (got {cfg.cp_style!r})")
    if cfg.cp_rq is not None and cfg.cp_style != "attention2d":
        errors.append("--cp-rq is the ATTENTION2D mesh split; it needs --cp-style attention2d")
    if cfg.cp == 1:
        if cfg.cp_style == "attention2d":
            errors.append("--cp-style attention2d splits the context-parallel group; it needs --cp > 1")
        return errors
    if cfg.seq_len % cfg.cp:
        errors.append(
            f"--seq-len {cfg.seq_len} is not divisible by --cp {cfg.cp} (each cp rank holds seq-len/cp tokens)"
        )
    if cfg.cp_style == "attention2d":
        if cfg.cp_rq is None and math.isqrt(cfg.cp) ** 2 != cfg.cp:
            errors.append(f"--cp {cfg.cp} is not a perfect square: give --cp-rq R (a divisor of cp; r_KV = cp / R)")
        elif cfg.cp_rq is not None and (cfg.cp_rq < 1 or cfg.cp % cfg.cp_rq):
            errors.append(
                f"--cp-rq {cfg.cp_rq} does not divide --cp {cfg.cp} (the ATTENTION2D mesh is r_Q x r_KV = cp)"
            )
    if cfg.pp > 1:
        errors.append(
            "--cp with --pp is not supported by the harness (pipeline messages would be split along the sequence)"
        )
    if cfg.sp:
        errors.append("--cp with --sp is not supported by the harness (both split the sequence)")
    if cfg.zero:
        errors.append(
            f"--cp with --zero {cfg.zero} is not supported by the harness: gradients are reduced over dp x cp by DDP"
        )
    return errors


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


def _hang_errors(cfg: HarnessConfig) -> list[str]:
    if cfg.hang is None:
        return []
    spec, errors = f"--hang {cfg.hang.rank}:{cfg.hang.step}", []
    if not 0 <= cfg.hang.rank < cfg.world_size:
        errors.append(f"{spec}: rank {cfg.hang.rank} is not in the job (ranks 0-{cfg.world_size - 1})")
    if not 0 <= cfg.hang.step < cfg.steps:
        errors.append(f"{spec}: step {cfg.hang.step} is not run (steps 0-{cfg.steps - 1})")
    if cfg.world_size < 2:
        errors.append(f"{spec}: a hang needs a peer that waits: world size must be >= 2")
    return errors


def validate(cfg: HarnessConfig, cuda_devices: int | None = None) -> None:
    errors = validation_errors(cfg, cuda_devices)
    if errors:
        raise ConfigError("; ".join(errors))


def _ep_errors(cfg: HarnessConfig) -> list[str]:
    """Expert parallelism: the experts must spread evenly over the ep ranks."""
    errors = []
    if cfg.experts < 0:
        errors.append(f"--experts must be >= 0 (got {cfg.experts})")
    if cfg.ep > 1 and cfg.experts == 0:
        errors.append(f"--ep {cfg.ep} spreads experts over ranks: give --experts N (a multiple of {cfg.ep})")
    if cfg.experts and cfg.experts % cfg.ep:
        errors.append(
            f"--experts {cfg.experts} is not divisible by --ep {cfg.ep} (each ep rank holds experts/ep experts)"
        )
    if cfg.experts and cfg.top_k > cfg.experts:
        errors.append(f"--top-k {cfg.top_k} exceeds --experts {cfg.experts}")
    if cfg.capacity_factor is not None and not (math.isfinite(cfg.capacity_factor) and cfg.capacity_factor > 0):
        errors.append(f"--capacity-factor must be a number > 0 (got {cfg.capacity_factor})")
    if cfg.capacity_factor is not None and not cfg.experts:
        errors.append("--capacity-factor caps tokens per expert: it needs --experts")
    if cfg.top_k != 1 and not cfg.experts:
        errors.append(f"--top-k {cfg.top_k} routes each token to that many experts: it needs --experts")
    others = [f"{f} {getattr(cfg, f)}" for f in ("dp", "tp", "pp", "cp") if getattr(cfg, f) > 1]
    others += [f"zero {cfg.zero}"] if cfg.zero else []
    if cfg.experts and others:
        dp_only = others == [f"dp {cfg.dp}"]
        errors.append(
            f"--experts with {', '.join(others)} is not supported by the harness: the ep ranks are its data-parallel "
            "replicas" + (" (give them as --ep; --nproc without --ep counts them as dp)" if dp_only else "")
        )
    return errors


OFFLOADS = ("none", "optimizer")


def gpu_fraction_gap(spec: str | None) -> int:
    """g of `--offload-gpu-fraction 1/g` (1: no shard updated on the GPU when the option is absent)."""
    if spec is None:
        return 1
    num, _, den = spec.partition("/")
    if num.strip() != "1" or not den.strip().isdigit() or int(den) < 1:
        raise ConfigError(f"--offload-gpu-fraction {spec!r}: expected 1/g with g a positive integer, e.g. 1/4")
    return int(den)


def _offload_errors(cfg: HarnessConfig) -> list[str]:
    """Host offload moves optimizer state between host and GPU memory: it needs CUDA and ZeRO-3."""
    errors = []
    if cfg.offload not in OFFLOADS:
        errors.append(f"--offload must be one of {', '.join(OFFLOADS)} (got {cfg.offload!r})")
    if cfg.offload_gpu_fraction is not None:
        if cfg.offload == "none":
            errors.append("--offload-gpu-fraction splits the offloaded optimizer: it needs --offload optimizer")
        try:
            gpu_fraction_gap(cfg.offload_gpu_fraction)
        except ConfigError as exc:
            errors.append(str(exc))
    if cfg.offload == "none":
        return errors
    if cfg.device != "cuda":
        errors.append(
            "--offload optimizer needs --device cuda: it measures host<->device copies of the optimizer step, and "
            "on CPU there is no device memory to offload from"
        )
    if cfg.zero != 3:
        errors.append(f"--offload optimizer offloads the ZeRO-3 optimizer: add --zero 3 (got --zero {cfg.zero})")
    return errors
