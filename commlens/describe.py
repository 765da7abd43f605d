"""`commlens describe-model MODULE:FACTORY`: a model description written in the user's own environment.

It imports the user's module and builds the model (on the meta device where the factory allows it, so no
weights are allocated or loaded), then records what PyTorch's data parallelism reads: every parameter and
buffer in `named_parameters()` / `named_buffers()` order, the strategy, and the PyTorch version whose bucket
rules apply. commlens never imports user code anywhere else: the description is what travels."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import typer

from commlens.contract.model_description import (
    DEFAULT_FIRST_BUCKET_BYTES,
    MODEL_DESCRIPTION_SCHEMA,
    ModelDescription,
    Strategy,
    TensorSpec,
    WrapUnit,
)
from commlens.vocab import DTYPE_BYTES


class DescribeError(Exception):
    """The target cannot be imported, called or described; the message says which and why."""


def load_factory(target: str) -> Any:
    """The callable named by MODULE:FACTORY (FACTORY may be dotted: pkg.mod:Class.build)."""
    module_name, sep, attr = target.partition(":")
    if not (sep and module_name and attr):
        raise DescribeError(f"{target!r}: expected MODULE:FACTORY, e.g. torchvision.models:resnet50")
    sys.path.insert(0, str(Path.cwd()))  # a user's own module beside them, as `python -c` would see it
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise DescribeError(f"cannot import {module_name!r}: {exc}") from None
    finally:
        sys.path.pop(0)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise DescribeError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise DescribeError(f"{target!r} is not callable")
    return obj


def build(factory: Any, args: object) -> tuple[Any, bool]:
    """(model, on_meta): the factory called with `args` (a JSON object: keyword arguments; a list: positional)
    under the meta device, else, when the factory cannot build there (it loads weights, say), normally."""
    import torch

    def call() -> Any:
        if isinstance(args, dict):
            return factory(**args)
        if isinstance(args, list):
            return factory(*args)
        raise DescribeError(f"--args must be a JSON object or array, not {type(args).__name__}")

    try:
        with torch.device("meta"):
            return call(), True
    except DescribeError:
        raise
    except Exception:  # any failure on the meta device (weights loaded, data-dependent init): build it for real
        pass
    try:
        return call(), False
    except Exception as exc:  # the user's factory: report whatever it raised
        raise DescribeError(f"the factory failed: {type(exc).__name__}: {exc}") from None


def _dtype(name: str, dtype: Any) -> str:
    short = str(dtype).removeprefix("torch.")
    if short not in DTYPE_BYTES:
        raise DescribeError(f"{name}: dtype {short!r} is not one commlens knows ({', '.join(sorted(DTYPE_BYTES))})")
    return short


def first_bucket_bytes(bucket_cap_mb: float | None) -> int:
    """The first DDP bucket's cap as the installed PyTorch computes it: from 2.13's bucket configuration when it
    has one (1 MiB with the default cap, the cap itself when one is given), else the Reducer's 1 MiB constant."""
    import torch.nn.parallel.distributed as ddp

    config = getattr(ddp, "_BucketCapacityConfig", None)
    if config is None:
        return DEFAULT_FIRST_BUCKET_BYTES
    return int(config.create(bucket_cap_mb, None, False).first_bucket_bytes_cap)


def wrap_units(model: Any, classes: Iterable[str]) -> list[WrapUnit]:
    """FSDP-style units: each outermost module whose class is named in `classes` owns its parameters; the root
    owns the rest (auto_wrap_policy=ModuleWrapPolicy of those classes)."""
    wanted = set(classes)
    if not wanted:
        return []
    owner: dict[str, str] = {}
    for mod_name, module in model.named_modules():
        if type(module).__name__ in wanted and not any(mod_name.startswith(u + ".") for u in owner.values()):
            for p_name, _ in module.named_parameters(prefix=mod_name):
                owner.setdefault(p_name, mod_name)
    units: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        units.setdefault(owner.get(name, ""), []).append(name)
    return [WrapUnit(name=k, params=v) for k, v in units.items()]


def dump(desc: ModelDescription) -> str:
    """The description as JSON with one tensor per line (diffable, and readable for a model of thousands)."""
    doc = desc.model_dump(mode="json", by_alias=True)
    parts = []
    for key, value in doc.items():
        if key in ("parameters", "buffers") and value:
            rows = ",\n".join(f"    {json.dumps(t)}" for t in value)
            parts.append(f'  "{key}": [\n{rows}\n  ]')
        else:
            parts.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def describe_module(model: Any, target: str, strategy: Strategy) -> ModelDescription:
    """The description of a built torch.nn.Module."""
    import torch

    params = [
        TensorSpec(name=n, shape=list(p.shape), dtype=_dtype(n, p.dtype), requires_grad=bool(p.requires_grad))
        for n, p in model.named_parameters()
    ]
    buffers = [TensorSpec(name=n, shape=list(b.shape), dtype=_dtype(n, b.dtype)) for n, b in model.named_buffers()]
    return ModelDescription.model_validate(
        {
            "schema": MODEL_DESCRIPTION_SCHEMA,
            "model": target,
            "torch_version": str(torch.__version__),
            "parameters": params,
            "buffers": buffers,
            "strategy": strategy,
        }
    )


def describe(
    target: str,
    args: object,
    kind: str = "ddp",
    dp: int = 1,
    bucket_cap_mb: float | None = None,
    broadcast_buffers: bool = True,
    zero_stage: int | None = None,
    wrap: Iterable[str] = (),
) -> tuple[ModelDescription, bool]:
    """(description, built on meta) of MODULE:FACTORY called with `args`."""
    fields = {
        "kind": kind,
        "dp": dp,
        "bucket_cap_mb": bucket_cap_mb,
        "broadcast_buffers": broadcast_buffers,
        "zero_stage": zero_stage,
    }
    # a wrong option is said before torch and the user's module are imported and the model built
    Strategy.model_validate(fields)
    model, on_meta = build(load_factory(target), args)
    if not hasattr(model, "named_parameters"):
        raise DescribeError(f"{target!r} returned {type(model).__name__}, not a torch.nn.Module")
    fields["first_bucket_bytes"] = first_bucket_bytes(bucket_cap_mb) if kind == "ddp" else None
    strategy = Strategy.model_validate({**fields, "units": wrap_units(model, wrap)})
    return describe_module(model, target, strategy), on_meta


OUT_OPTION = typer.Option(None, "--out", help="Write the description here (default: standard output).")
WRAP_OPTION = typer.Option([], "--wrap", help="FSDP/ZeRO-3 wrapping unit: a module class name (repeatable).")


def describe_model_command(
    target: str = typer.Argument(..., help="MODULE:FACTORY building the model, e.g. torchvision.models:resnet50."),
    args: str = typer.Option("{}", "--args", help="Factory arguments as JSON: an object (keywords) or an array."),
    out: Path | None = OUT_OPTION,
    strategy: str = typer.Option("ddp", "--strategy", help="ddp, fsdp or zero."),
    dp: int = typer.Option(1, "--dp", help="Data-parallel ranks."),
    bucket_cap_mb: float | None = typer.Option(None, "--bucket-cap-mb", help="DDP bucket_cap_mb (default: DDP's)."),
    broadcast_buffers: bool = typer.Option(
        True, "--broadcast-buffers/--no-broadcast-buffers", help="DDP broadcast_buffers."
    ),
    zero_stage: int | None = typer.Option(None, "--zero-stage", help="ZeRO stage with --strategy zero."),
    wrap: list[str] = WRAP_OPTION,
) -> None:
    """Describe a model's parameters, buffers and data-parallel strategy for `commlens config` (runs here, in the
    environment that trains it; builds on the meta device where it can, so no weights are needed)."""
    from pydantic import ValidationError

    try:
        parsed = json.loads(args)
    except json.JSONDecodeError as exc:
        typer.echo(f"error: --args is not JSON: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        desc, on_meta = describe(target, parsed, strategy, dp, bucket_cap_mb, broadcast_buffers, zero_stage, wrap)
    except (DescribeError, ValidationError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    text = dump(desc)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
    where = "on the meta device" if on_meta else "normally (the factory could not build on the meta device)"
    typer.echo(
        f"{target}: {len(desc.parameters)} parameters ({desc.param_count:,} elements), {len(desc.buffers)} buffers, "
        f"built {where}, PyTorch {desc.torch_version}" + (f"; written to {out}" if out else ""),
        err=True,
    )
