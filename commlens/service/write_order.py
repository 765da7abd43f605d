"""The lock that orders writes DuckDB does not see as conflicting.

DuckDB's optimistic transactions take an UPDATE or DELETE of the same row for a conflict, but not a DELETE and a
concurrent INSERT that depends on the deleted row (verified on DuckDB 2.0.1): a reply committed while its parent
was deleted, a review item or an alias committed while its run was deleted, or two promotions of one finding each
checked before the other committed, would all be stored. The store is held by one server process (one writer per
DuckDB file), so a process-wide lock around those writes makes each see the other's committed result.
"""

from __future__ import annotations

import threading

RUN_ROWS = threading.Lock()
