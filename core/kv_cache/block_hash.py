"""The chained block hash of prefix caching: the one definition, for every user.

Each full block's hash covers its parent block's hash, its own token ids and extra keys
(a cache salt on the first block), so equal hashes mean equal prefixes up to hash
collisions; the key is returned with the hash so that a hit can be confirmed by
comparing keys.  The KV-cache manager, the disaggregated prefill/decode hand-off and the
data-parallel router's prefix affinity all hash blocks with :func:`extend_block_hashes`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["BlockHash", "hash_block", "extend_block_hashes", "block_hashes", "extend_content_keys"]

#: (hash value, the key it covers: (parent hash, token ids, extra keys)).
BlockHash = tuple[int, tuple]


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra: tuple = ()) -> BlockHash:
    """(hash value, the key it covers) of one full block."""
    key = (parent_hash, token_ids, extra)
    return hash(key), key


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    cache_salt: str | None = None,
    mm_spans: Sequence[tuple[int, int, str]] = (),
) -> list[BlockHash]:
    """Append to ``hashes`` (the chain of the first ``len(hashes)`` blocks of
    ``token_ids``) the hashes of the following blocks up to ``num_blocks``; returns it.

    Lets a caller keep a request's chain and extend it as its tokens become known.
    ``cache_salt`` is an extra key of the first block only (a different salt, a
    different chain).  ``mm_spans``: (offset, length, content hash) of the prompt's
    images; a block holding any of an image's tokens has that image's hash among its
    extra keys, so the same placeholder tokens with a different image miss.
    """
    bs = block_size
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1][0] if hashes else None
        extra = (cache_salt,) if (i == 0 and cache_salt) else ()
        if mm_spans:
            lo, hi = i * bs, (i + 1) * bs
            extra += tuple(h for off, n, h in mm_spans if off < hi and off + n > lo)
        hashes.append(hash_block(parent, tuple(token_ids[i * bs : (i + 1) * bs]), extra))
    return hashes


def block_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """The chain of the first ``num_blocks`` full blocks of ``token_ids``."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(
            f"{num_blocks} blocks of {block_size} tokens need {num_blocks * block_size} tokens; got {len(token_ids)}"
        )
    return extend_block_hashes([], token_ids, block_size, num_blocks, cache_salt)


def extend_content_keys(
    keys: list[str],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    seed: str,
    cache_salt: str | None = None,
) -> list[str]:
    """:func:`extend_block_hashes`'s chain as SHA-256 hex digests, the same in every
    process (Python's ``hash`` is not: strings and None hash differently per process):
    a KV connector's keys.  Block ``i``'s key covers ``seed`` (the engine's KV layout),
    the cache salt, and every token up to the end of block ``i``."""
    bs = block_size
    while len(keys) < num_blocks:
        i = len(keys)
        h = hashlib.sha256(bytes.fromhex(keys[-1]) if keys else seed.encode())
        if i == 0 and cache_salt:
            h.update(b"salt:" + cache_salt.encode())
        block = token_ids[i * bs : (i + 1) * bs]
        h.update(struct.pack(f"<{len(block)}q", *block))
        keys.append(h.hexdigest())
    return keys
