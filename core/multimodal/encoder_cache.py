"""EncoderCache: vision-encoder outputs by image content hash, computed once per image
and kept while a request still has that image's tokens to prefill (a prompt chunked
across steps reads the same output in each chunk; two requests with the same image
share it).  An entry is dropped once no request needs it; a request preempted and
recomputed encodes again if its entry is gone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EncoderCache"]


class EncoderCache:
    def __init__(self) -> None:
        self._outputs: dict[str, Any] = {}
        self._users: dict[str, set[str]] = {}
        #: Images run through the vision encoder, and image uses served from the cache.
        self.encoder_runs = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def get(self, item, request_id: str, encode: Callable[[dict], Any]) -> Any:
        """``item``'s encoder output (``encode(item.data)`` the first time), held for
        ``request_id`` until :meth:`release`."""
        users = self._users.setdefault(item.hash, set())
        out = self._outputs.get(item.hash)
        if out is None:
            out = self._outputs[item.hash] = encode(item.data)
            self.encoder_runs += 1
        elif request_id not in users:
            self.hits += 1
        users.add(request_id)
        return out

    def release(self, item_hash: str, request_id: str) -> None:
        """``request_id`` has prefilled every token of the image: drop its hold."""
        users = self._users.get(item_hash)
        if users is None:
            return
        users.discard(request_id)
        if not users:
            del self._users[item_hash]
            self._outputs.pop(item_hash, None)

    def forget(self, request_id: str) -> None:
        """A finished or aborted request releases everything it held."""
        for h in [h for h, users in self._users.items() if request_id in users]:
            self.release(h, request_id)

    def num_tokens(self) -> int:
        """Image tokens held (rows of the cached outputs)."""
        return sum(int(o.shape[0]) for o in self._outputs.values())
