"""A quantizer for tests: float rows -> GGUF blocks of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL
and IQ4_XS,
written from the block formats' definitions (ggml-common.h), with plain round-to-nearest
choices (no search for the best scales, as llama-quantize does: tests need valid blocks,
not the best ones).  ``gguf.quants`` quantizes only some of these types, so tests check
these blocks by dequantizing them with ``gguf.quants`` (an independent implementation).

Each function takes float32 ``[rows, k]`` (k a multiple of the type's block) and returns
uint8 ``[rows, k / block_values * block_bytes]``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["QUANTIZERS", "quantize"]


def _f16(v: np.ndarray) -> np.ndarray:
    """float32 [..., 1] -> its fp16 bytes [..., 2]."""
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8)


def _inv(d: np.ndarray) -> np.ndarray:
    return np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0).astype(np.float32)


def _pack_nibbles_32(q: np.ndarray) -> np.ndarray:
    """[..., 32] values 0..15 -> [..., 16] bytes: element j < 16 low nibble of byte j, j + 16 its high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _bits_le(bits: np.ndarray) -> np.ndarray:
    """[..., 32] of 0/1 -> [..., 4] bytes of the little-endian uint32 with bit j = bits[j]."""
    return np.packbits(bits.astype(np.uint8), axis=-1, bitorder="little")


def _q5_0(x: np.ndarray) -> np.ndarray:
    b = x.reshape(x.shape[0], -1, 32)
    amax_at = np.abs(b).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(b, amax_at, axis=-1)  # signed value of largest magnitude
    d = (mx / -16).astype(np.float32)
    d16 = d.astype(np.float16).astype(np.float32)
    q = np.clip(np.rint(b * _inv(d16)) + 16, 0, 31).astype(np.uint8)
    out = np.concatenate([_f16(d), _bits_le(q >> 4), _pack_nibbles_32(q & 15)], axis=-1)
    return out.reshape(x.shape[0], -1)


def _q5_1(x: np.ndarray) -> np.ndarray:
    b = x.reshape(x.shape[0], -1, 32)
    lo, hi = b.min(axis=-1, keepdims=True), b.max(axis=-1, keepdims=True)
    d = ((hi - lo) / 31).astype(np.float32)
    d16, m16 = d.astype(np.float16).astype(np.float32), lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.rint((b - m16) * _inv(d16)), 0, 31).astype(np.uint8)
    out = np.concatenate([_f16(d), _f16(lo), _bits_le(q >> 4), _pack_nibbles_32(q & 15)], axis=-1)
    return out.reshape(x.shape[0], -1)


def _pack_kscales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and minimums [..., 8] -> the 12 bytes Q4_K / Q5_K store: bytes 0-3 and
    4-7 hold sub-blocks 0-3's scale and minimum in their low 6 bits and the top 2 bits of
    sub-blocks 4-7's; bytes 8-11 the low 4 bits of sub-blocks 4-7's scale (low nibble)
    and minimum (high nibble)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    a = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    b = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    c = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=-1).astype(np.uint8)


def _k_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: per super-block d, dmin (fp16) and per sub-block 6-bit sc, mn, with
    values d*sc*q - dmin*mn, q in 0..levels."""
    b = x.reshape(x.shape[0], -1, 8, 32)
    lo = np.minimum(b.min(axis=-1), 0)  # sub-block minimum, <= 0 so mn >= 0
    scale = (b.max(axis=-1) - lo) / levels
    d = (scale.max(axis=-1, keepdims=True) / 63).astype(np.float32)
    dmin = ((-lo).max(axis=-1, keepdims=True) / 63).astype(np.float32)
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale * _inv(d16)), 0, 63)
    mn = np.clip(np.rint(-lo * _inv(dmin16)), 0, 63)
    step = (d16 * sc)[..., None]
    q = np.clip(np.rint((b + (dmin16 * mn)[..., None]) * _inv(step)), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 8, 32] values 0..15 -> qs [..., 128]: byte l of group i holds sub-block 2i's
    element l (low nibble) and sub-block 2i + 1's (high nibble)."""
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(*q.shape[:-2], 128).astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(x, 15)
    out = np.concatenate([_f16(d), _f16(dmin), _pack_kscales(sc, mn), _k_nibbles(q)], axis=-1)
    return out.reshape(x.shape[0], -1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(x, 31)
    # qh[l] bit j: the fifth bit of element l of sub-block j.
    qh = np.packbits((q >> 4).swapaxes(-1, -2), axis=-1, bitorder="little")[..., 0]
    out = np.concatenate([_f16(d), _f16(dmin), _pack_kscales(sc, mn), qh, _k_nibbles(q & 15)], axis=-1)
    return out.reshape(x.shape[0], -1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    b = x.reshape(x.shape[0], -1, 16, 16)
    amax_at = np.abs(b).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(b, amax_at, axis=-1)[..., 0] / -32  # signed, so q reaches -32
    d = (np.abs(scale).max(axis=-1, keepdims=True) / 127).astype(np.float32)
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale * _inv(d16)), -128, 127)
    step = (d16 * sc)[..., None]
    q = (np.clip(np.rint(b * _inv(step)), -32, 31) + 32).astype(np.uint8).reshape(*b.shape[:2], 2, 4, 32)
    # Per half: element 32c + l in the low (c < 2) or high nibble of ql[l + 32 (c % 2)],
    # its top two bits at bit 2c of qh[l].
    low = q & 15
    ql = (low[:, :, :, 0:2, :] | (low[:, :, :, 2:4, :] << 4)).reshape(*b.shape[:2], 128)
    high = q >> 4
    qh = (high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)).reshape(
        *b.shape[:2], 64
    )
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)], axis=-1)
    return out.astype(np.uint8).reshape(x.shape[0], -1)


def _q2_k(x: np.ndarray) -> np.ndarray:
    """16 sub-blocks of 16 per super-block: 4-bit scale and minimum (over fp16 d, dmin),
    q = 0..3; value d*sc*q - dmin*mn."""
    b = x.reshape(x.shape[0], -1, 16, 16)
    lo = np.minimum(b.min(axis=-1), 0)  # sub-block minimum, <= 0 so mn >= 0
    scale = (b.max(axis=-1) - lo) / 3
    d = (scale.max(axis=-1, keepdims=True) / 15).astype(np.float32)
    dmin = ((-lo).max(axis=-1, keepdims=True) / 15).astype(np.float32)
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale * _inv(d16)), 0, 15).astype(np.uint8)
    mn = np.clip(np.rint(-lo * _inv(dmin16)), 0, 15).astype(np.uint8)
    step = (d16 * sc)[..., None]
    q = np.clip(np.rint((b + (dmin16 * mn)[..., None]) * _inv(step)), 0, 3).astype(np.uint8)
    # Element 32j + l of half h: bits 2j, 2j+1 of qs[32h + l].
    q = q.reshape(*b.shape[:2], 2, 4, 32)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 2) | (q[:, :, :, 2] << 4) | (q[:, :, :, 3] << 6)).reshape(*b.shape[:2], 64)
    out = np.concatenate([sc | (mn << 4), qs, _f16(d), _f16(dmin)], axis=-1)
    return out.astype(np.uint8).reshape(x.shape[0], -1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """hmask[32] | qs[64] | scales[12] | d: value d * (sc - 32) * (q - 4) per 16 values, sc 6
    bits, q 3 bits; element 32j + l of half n keeps its low 2 bits at bits 2j of qs[32n + l]
    and its third at bit 4n + j of hmask[l]."""
    b = x.reshape(x.shape[0], -1, 16, 16)
    amax_at = np.abs(b).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(b, amax_at, axis=-1)[..., 0] / -4  # signed, so q - 4 reaches -4
    big_at = np.abs(scale).argmax(axis=-1)[..., None]
    d = (np.take_along_axis(scale, big_at, axis=-1) / -32).astype(np.float32)  # its sub-block at -32
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale * _inv(d16)), -32, 31)
    step = (d16 * sc)[..., None]
    q = (np.clip(np.rint(b * _inv(step)), -4, 3) + 4).astype(np.uint8).reshape(*b.shape[:2], 2, 4, 32)
    shifts = np.arange(4, dtype=np.uint8).reshape(4, 1) * 2
    qs = ((q & 3) << shifts).sum(axis=-2, dtype=np.uint8).reshape(*b.shape[:2], 64)
    bits = (q >> 2).reshape(*b.shape[:2], 8, 32)  # [4n + j, l]
    hmask = (bits << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(axis=-2, dtype=np.uint8)
    s6 = (sc + 32).astype(np.uint8)  # [..., 16]
    low = (s6[..., :8] & 15) | ((s6[..., 8:] & 15) << 4)
    top = (s6 >> 4).reshape(*b.shape[:2], 4, 4)  # [i // 4, i % 4]
    high = (top << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)).sum(axis=-2, dtype=np.uint8)
    out = np.concatenate([hmask, qs, low, high, _f16(d)], axis=-1)
    return out.astype(np.uint8).reshape(x.shape[0], -1)


#: IQ4_NL's 16 levels (ggml-common.h kvalues_iq4nl), ascending.
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _nearest_level(v: np.ndarray) -> np.ndarray:
    """Index of the level nearest to each of ``v`` (values in level units)."""
    return np.abs(v[..., None] - IQ4_NL_LEVELS).argmin(axis=-1).astype(np.uint8)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """d | qs[16] with value d * level[nibble]: d puts the value of largest magnitude on the
    level -127 (as ggml starts its search), then the least-squares scale for the chosen
    levels, rounded to fp16, and the levels chosen again for it."""
    b = x.reshape(x.shape[0], -1, 32)
    amax_at = np.abs(b).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(b, amax_at, axis=-1)
    q = IQ4_NL_LEVELS[_nearest_level(b * _inv((mx / -127).astype(np.float32)))]
    sq = (q * q).sum(axis=-1, keepdims=True)
    d = np.where(sq > 0, (q * b).sum(axis=-1, keepdims=True) / np.where(sq > 0, sq, 1), 0).astype(np.float32)
    d16 = d.astype(np.float16).astype(np.float32)
    idx = _nearest_level(b * _inv(d16))
    out = np.concatenate([_f16(d), _pack_nibbles_32(idx)], axis=-1)
    return out.reshape(x.shape[0], -1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    """d | u16 scales_h | scales_l[4] | qs[128] with value (d * (ls - 32)) * level[nibble] per
    sub-block of 32: each sub-block's scale as IQ4_NL's (largest magnitude on -127, then least
    squares), d putting the sub-block scale of largest magnitude at ls - 32 = -32 (as ggml), the
    6-bit scales rounded to nearest, and the levels chosen again for the rounded scales."""
    b = x.reshape(x.shape[0], -1, 8, 32)
    amax_at = np.abs(b).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(b, amax_at, axis=-1)
    q = IQ4_NL_LEVELS[_nearest_level(b * _inv((mx / -127).astype(np.float32)))]
    sq = (q * q).sum(axis=-1)
    scale = np.where(sq > 0, (q * b).sum(axis=-1) / np.where(sq > 0, sq, 1), 0).astype(np.float32)  # [..., 8]
    big_at = np.abs(scale).argmax(axis=-1)[..., None]
    d = (np.take_along_axis(scale, big_at, axis=-1) / -32).astype(np.float32)  # [..., 1]
    d16 = d.astype(np.float16).astype(np.float32)
    ls = np.clip(np.rint(scale * _inv(d16)), -32, 31).astype(np.int64) + 32  # 0..63
    step = (d16 * (ls - 32).astype(np.float32))[..., None]
    idx = _nearest_level(b * _inv(step))  # [..., 8, 32]
    low = (ls & 15).astype(np.uint8)
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)  # [..., 4]
    high = ((ls >> 4) << (2 * np.arange(8))).sum(axis=-1).astype("<u2")  # [...]
    scales_h = np.ascontiguousarray(high[..., None]).view(np.uint8)  # little-endian uint16
    qs = _pack_nibbles_32(idx).reshape(*b.shape[:2], 128)
    out = np.concatenate([_f16(d), scales_h, scales_l, qs], axis=-1)
    return out.astype(np.uint8).reshape(x.shape[0], -1)


QUANTIZERS = {
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """float ``[rows, k]`` -> uint8 GGUF blocks of ``type_name`` (the types of QUANTIZERS;
    others through ``gguf.quants.quantize``)."""
    x = np.asarray(x, dtype=np.float32)
    if type_name in QUANTIZERS:
        return QUANTIZERS[type_name](x)
    import gguf

    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[type_name])


def write_tiny_llama_gguf(
    path,
    layer_types,
    embed_type: str,
    *,
    hidden: int = 256,
    inter: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    name: str = "tiny llama",
    seed: int = 0,
):
    """A Llama GGUF of ``len(layer_types)`` layers (hidden 256 by default: every 256-value
    type fits), each layer's projections (attn_q, attn_k, attn_v, attn_output, ffn_gate,
    ffn_up, ffn_down) in the types its dict of ``layer_types`` names, quantized by
    :func:`quantize`; a tied embedding of ``embed_type``; F32 norms; the byte-level test
    tokenizer (261 tokens).  Returns ``path``."""
    import gguf

    from tests.loader.tiny_checkpoints import _byte_vocab

    tokens, types = _byte_vocab()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(len(layer_types))
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    kv = kv_heads * hidden // heads

    def add(tensor: str, rows: int, cols: int | None, qtype: str = "F32", std: float = 0.08) -> None:
        values = rng.standard_normal((rows, cols) if cols else (rows,)).astype(np.float32)
        values = values * std if cols else 1.0 + 0.1 * values
        kind = gguf.GGMLQuantizationType[qtype]
        if qtype in ("F32", "F16"):
            writer.add_tensor(tensor, values.astype(np.float16 if qtype == "F16" else np.float32), raw_dtype=kind)
        else:
            writer.add_tensor(tensor, quantize(values, qtype), raw_dtype=kind)

    add("token_embd.weight", len(tokens), hidden, embed_type, std=0.1)
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    for i, layer in enumerate(layer_types):
        add(f"blk.{i}.attn_norm.weight", hidden, None)
        add(f"blk.{i}.ffn_norm.weight", hidden, None)
        for part, (rows, cols) in shapes.items():
            add(f"blk.{i}.{part}.weight", rows, cols, layer[part])
    add("output_norm.weight", hidden, None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_triton_interpreted(script: str) -> None:
    """Runs ``script`` (which prints "ok" when its checks pass) in a subprocess under the
    Triton interpreter (TRITON_INTERPRET must be set before triton is imported), from this
    folder with tests/ on the path as under pytest; fails with the end of its stderr."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (os.path.dirname(here), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=here, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
