"""All-to-all traffic between ranks: the bytes each sender's all_to_all calls send to each receiver, per
process group, from the calls' split lists (commlens/store/pairs.sql). An uneven all-to-all (MoE token
dispatch, embedding lookups) shows here who sends how much to whom, which the per-call size hides.
"""

from __future__ import annotations

from pydantic import BaseModel

from commlens.vocab import Scheme


class PairMatrix(BaseModel):
    """One group's sender x receiver bytes. `ranks` are the group's global ranks in group order; `bytes[i][j]`
    is what rank `ranks[i]` sent to rank `ranks[j]` (the diagonal: rows a rank keeps, copied locally), None
    where the run has no split-recorded call of sender `ranks[i]` in this group (its trace is missing)."""

    group_key: str
    scheme: Scheme | None  # None: the group is not attributed
    ranks: list[int]
    bytes: list[list[int | None]]
    calls: int  # all_to_all calls (over all senders) that make up the matrix
    total_bytes: int
    # Asked with `bins=N` and wider than N ranks: `bytes` holds blocks of `per_block` consecutive group ranks
    # (their sums; None where no cell of the block is known), `labels` names each block "first-last".
    per_block: int = 1
    labels: list[str] = []


class PairsReport(BaseModel):
    """The matrices of a run, over the whole run or one profiler step. `reason` says why there is none."""

    run: str
    step: int | None  # None: summed over the run
    group: str | None  # the group asked for, None: every group
    matrices: list[PairMatrix]
    steps: list[int]  # profiler steps with split-recorded all_to_all calls (for choosing one)
    calls_with_splits: int  # in the run, every group and step
    calls_without_splits: int  # the run's all_to_all calls whose trace records no split list
    reason: str | None  # set when `matrices` is empty
    notes: list[str]
