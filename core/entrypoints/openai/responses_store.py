"""Stored responses of POST /v1/responses (``store: true``): what GET, DELETE,
``/input_items`` and ``previous_response_id`` read back.

One SQLite database holds them: ``:memory:`` by default (lost at exit), or a file
(``--responses-store-path``) so that a restart keeps them.  The store is bounded: past
``max_entries`` the oldest responses are dropped, and a response older than ``max_age_s``
is gone (dropped on the next write, invisible to reads before that).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass

__all__ = ["ResponseStoreConfig", "StoredResponse", "ResponseStore", "add_store_arguments", "store_config_from_args"]


@dataclass(frozen=True)
class ResponseStoreConfig:
    """--responses-store-max-entries, --responses-store-max-age, --responses-store-path."""

    max_entries: int = 1000
    max_age_s: float = 24 * 3600.0
    path: str | None = None  # None: in memory

    def __post_init__(self) -> None:
        if self.max_entries < 0:
            raise ValueError(f"--responses-store-max-entries must be >= 0, got {self.max_entries}")
        if not self.max_age_s > 0:
            raise ValueError(f"--responses-store-max-age must be > 0 seconds, got {self.max_age_s}")
        if self.path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.path))):
            raise ValueError(f"--responses-store-path {self.path!r}: its folder does not exist")


@dataclass
class StoredResponse:
    """A response object and the conversation it answered (input items, inherited ones first)."""

    response: dict
    input_items: list[dict]


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


class ResponseStore:
    """Thread-safe: the server reads it from its event loop, `run-batch` from anywhere."""

    def __init__(self, config: ResponseStoreConfig | None = None, clock=time.time) -> None:
        self.config = config or ResponseStoreConfig()
        self._clock = clock
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.config.path or ":memory:", check_same_thread=False)
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as e:
            raise ValueError(f"--responses-store-path {self.config.path!r}: {e}") from None

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.config.max_entries == 0:
            return
        now = self._clock()
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (response_id, now, json.dumps(stored.response), json.dumps(stored.input_items)),
            )
            self._db.execute("DELETE FROM responses WHERE created < ?", (now - self.config.max_age_s,))
            excess = self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] - self.config.max_entries
            if excess > 0:
                self._db.execute(
                    "DELETE FROM responses WHERE rowid IN "
                    "(SELECT rowid FROM responses ORDER BY created, rowid LIMIT ?)",
                    (excess,),
                )

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT response, input_items FROM responses WHERE id = ? AND created >= ?",
                (response_id, self._clock() - self.config.max_age_s),
            ).fetchone()
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._lock, self._db:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            cutoff = self._clock() - self.config.max_age_s
            return self._db.execute("SELECT COUNT(*) FROM responses WHERE created >= ?", (cutoff,)).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def add_store_arguments(parser) -> None:
    g = parser.add_argument_group("stored responses (/v1/responses with store: true)")
    g.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=ResponseStoreConfig.max_entries,
        help="most stored responses kept; the oldest go first (0: store none)",
    )
    g.add_argument(
        "--responses-store-max-age",
        type=float,
        default=ResponseStoreConfig.max_age_s,
        help="seconds a stored response is kept (default one day)",
    )
    g.add_argument(
        "--responses-store-path",
        default=None,
        help="an SQLite file keeping stored responses across restarts (default: in memory only)",
    )


def store_config_from_args(args) -> ResponseStoreConfig:
    return ResponseStoreConfig(
        max_entries=args.responses_store_max_entries,
        max_age_s=args.responses_store_max_age,
        path=args.responses_store_path,
    )
