"""The Time page's critical-path card adds up: DLRM's step 10 path begins on rank 7, 7.5 ms after rank 0 began
the step, and its categories summed to 13.3 ms of a 20.8 ms step with nothing saying where the rest went."""

from __future__ import annotations

from commlens.contract.time import CriticalPath, PathSegment
from commlens.frontend.page_time import path_view


def _texts(view: object) -> list[str]:
    found = [getattr(c, "children", None) for c in view._traverse()]  # type: ignore[attr-defined]
    return [t for t in found if isinstance(t, str)]


def _path(first_start: float) -> CriticalPath:
    return CriticalPath(
        step=10,
        start_us=0.0,
        end_us=20_800.0,
        segments=[
            PathSegment(rank=3, start_us=15_000.0, end_us=20_800.0, kind="work", instance_id=None),
            PathSegment(rank=7, start_us=first_start, end_us=15_000.0, kind="collective", instance_id=4),
        ],
        categories={"compute": 1_100.0, "exposed": 212.0, "idle": 20_800.0 - first_start - 1_312.0},
        exposed_share_by_scheme={"unattributed": 0.01},
    )


def test_the_time_before_the_paths_first_rank_began_its_step_is_said() -> None:
    texts = _texts(path_view(_path(7_500.0)))
    assert "before the path" in texts
    assert "7.5 ms: rank 7, where the path begins, started the step that long after the first rank to start it" in (
        texts
    )
    assert "wait + exposed on the path, of the step, per scheme" in texts


def test_a_path_that_covers_its_step_has_nothing_before_it() -> None:
    assert "before the path" not in _texts(path_view(_path(0.0)))
