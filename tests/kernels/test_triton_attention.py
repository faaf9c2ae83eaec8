"""The Triton paged-attention kernels against kernels/reference.py.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below
before triton is imported); with one they run for real on it.  Inputs are fresh
random tensors every run (seed printed on failure, fixed with PAGEDSERVE_TEST_SEED),
outputs are poisoned with NaN first, and block tables point unused entries at a poison
block of huge values so that reading past a sequence's end changes the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import attention  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
POISON = 500.0


@pytest.fixture(scope="module", autouse=True)
def _triton_kernels_interpreted():
    """Fail clearly if the kernels were jitted for a GPU before the env var was set."""
    if not ON_GPU and not isinstance(attention._paged_attention_kernel, triton.runtime.interpreter.InterpretedFunction):
        pytest.fail("pagedserve.kernels.triton was imported before TRITON_INTERPRET=1 was set")


@pytest.fixture
def triton_gen(request) -> torch.Generator:
    """A generator with a fresh seed per test (PAGEDSERVE_TEST_SEED fixes it)."""
    seed = int(os.environ.get("PAGEDSERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_batch(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    *,
    cache_dtype: torch.dtype | None = None,
    table_width: int | None = None,
    extra_tokens: int = 0,
) -> Batch:
    """A random batch; ``seqs`` lists (q_len, seq_len) per sequence.

    Physical blocks are shuffled; block 0 is a poison block (huge values) that every
    unused block-table entry points to.  ``extra_tokens`` appends query rows that
    belong to no sequence.
    """
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    width = table_width or max(blocks_per_seq)
    num_blocks = 1 + sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    key_cache[0] = POISON
    value_cache[0] = POISON
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    q_lens = [q for q, _ in seqs]
    num_tokens = sum(q_lens) + extra_tokens
    query = torch.randn(num_tokens, num_kv_heads * group, head_size, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32)
    to = dict(device=DEVICE)
    return Batch(
        query.to(**to),
        key_cache.to(**to),
        value_cache.to(**to),
        block_tables.to(**to),
        seq_lens.to(**to),
        qsl.to(**to),
        head_size**-0.5,
    )


def check_against_reference(batch: Batch, out: torch.Tensor, dtype: torch.dtype) -> None:
    expected = reference.paged_attention(*batch.args())
    n = int(batch.query_start_loc[-1])
    got = out[:n].float()
    assert not torch.isnan(got).any(), "kernel left rows unwritten (NaN poison survived)"
    torch.testing.assert_close(got, expected[:n].float(), **TOL[dtype])


# (dtype, head_size, block_size, num_kv_heads, group, [(q_len, seq_len), ...])
CASES = [
    (torch.float32, 64, 16, 2, 1, [(1, 17), (5, 5), (3, 20)]),  # decode + prefill + prefix hit
    (torch.bfloat16, 80, 16, 1, 4, [(1, 33), (7, 7), (4, 40)]),
    (torch.float16, 96, 32, 2, 2, [(1, 1), (6, 50), (1, 64)]),
    (torch.bfloat16, 128, 32, 1, 2, [(9, 9), (1, 45), (2, 70)]),
    (torch.float16, 256, 16, 1, 1, [(3, 18), (1, 31)]),
    (torch.float32, 80, 32, 2, 4, [(1, 40), (1, 3), (0, 10), (4, 36)]),  # a sequence with no new token
    (torch.bfloat16, 64, 16, 4, 1, [(1, 20), (1, 47), (1, 5)]),  # decode only
    (torch.float16, 128, 16, 2, 4, [(12, 12), (16, 16)]),  # prefill only (tall tiles)
    (torch.float32, 96, 16, 1, 2, [(20, 60)]),  # long chunk after a prefix hit
    (torch.bfloat16, 256, 32, 2, 2, [(10, 30), (1, 9)]),
    (torch.float32, 64, 16, 2, 3, [(2, 10), (1, 25)]),  # group not a power of two
    (torch.float16, 64, 32, 1, 4, [(1, 64), (5, 33), (1, 32)]),  # contexts ending on a block edge
]


def _case_id(case) -> str:
    dtype, hs, bs, kvh, g, seqs = case
    return f"{str(dtype)[6:]}-d{hs}-bs{bs}-kv{kvh}-g{g}-n{len(seqs)}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_single_pass_matches_reference(case, triton_gen):
    dtype, head_size, block_size, num_kv_heads, group, seqs = case
    batch = make_batch(seqs, num_kv_heads, group, head_size, block_size, dtype, triton_gen)
    out = torch.full_like(batch.query, float("nan"))
    ret = attention.paged_attention_fixed_splits(*batch.args(), num_splits=1, out=out)
    assert ret is out
    check_against_reference(batch, out, dtype)


SPLIT_CASES = [
    (torch.float32, 64, 16, 2, 2, [(1, 150), (1, 37)], 3),
    (torch.bfloat16, 128, 32, 1, 4, [(1, 200)], 4),
    (torch.float16, 80, 16, 2, 1, [(3, 90), (1, 130), (2, 2)], 5),  # mixed, some splits empty
    (torch.float32, 96, 32, 1, 2, [(1, 70), (1, 33)], 7),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: _case_id(c[:6]) + f"-s{c[6]}")
def test_split_kv_matches_reference(case, triton_gen):
    dtype, head_size, block_size, num_kv_heads, group, seqs, num_splits = case
    batch = make_batch(seqs, num_kv_heads, group, head_size, block_size, dtype, triton_gen)
    out = torch.full_like(batch.query, float("nan"))
    attention.paged_attention_fixed_splits(*batch.args(), num_splits=num_splits, out=out)
    check_against_reference(batch, out, dtype)


def test_random_mixed_batches(triton_gen):
    """A few batches drawn at random each run, through both paths."""
    g = triton_gen

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    for _ in range(3):
        dtype = pick([torch.float32, torch.float16, torch.bfloat16])
        head_size, block_size, group = pick([64, 80, 96, 128]), pick([16, 32]), pick([1, 2, 4])
        seqs = []
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            seq_len = int(torch.randint(1, 120, (1,), generator=g))
            q_len = pick([1, 1, seq_len, int(torch.randint(1, seq_len + 1, (1,), generator=g))])
            seqs.append((min(q_len, 12), seq_len))
        batch = make_batch(seqs, pick([1, 2]), group, head_size, block_size, dtype, g)
        for num_splits in (1, pick([2, 3, 4])):
            out = torch.full_like(batch.query, float("nan"))
            attention.paged_attention_fixed_splits(*batch.args(), num_splits=num_splits, out=out)
            check_against_reference(batch, out, dtype)


def test_heuristic_picks_split_path_for_few_long_decodes(triton_gen, monkeypatch):
    # A block table addressing 64 * 16 = 1024 keys, two decodes: the heuristic splits.
    batch = make_batch([(1, 40), (1, 100)], 1, 2, 64, 16, torch.float16, triton_gen, table_width=64)
    chosen = []
    real = attention.paged_attention_fixed_splits

    def spy(*args, **kwargs):
        chosen.append(args[7] if len(args) > 7 else kwargs["num_splits"])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "paged_attention_fixed_splits", spy)
    monkeypatch.setattr(attention, "_num_sms", lambda device: 8)
    out = attention.paged_attention(*batch.args())
    assert chosen and chosen[0] > 1
    check_against_reference(batch, out, torch.float16)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(num_tokens=4, num_seqs=4, num_kv_heads=8, max_context=32768, num_sms=132), 9),
        (dict(num_tokens=1, num_seqs=1, num_kv_heads=8, max_context=2048, num_sms=132), 4),
        (dict(num_tokens=256, num_seqs=256, num_kv_heads=8, max_context=32768, num_sms=132), 1),
        (dict(num_tokens=4, num_seqs=4, num_kv_heads=8, max_context=512, num_sms=132), 1),
        (dict(num_tokens=2048, num_seqs=2, num_kv_heads=8, max_context=32768, num_sms=132), 1),
        (dict(num_tokens=1, num_seqs=1, num_kv_heads=1, max_context=1 << 20, num_sms=132), 64),
    ],
    ids=["few-long", "short-cap", "many-seqs", "short-context", "prefill", "max"],
)
def test_choose_num_splits(kwargs, expected):
    assert attention.choose_num_splits(**kwargs) == expected


@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_outside_query_start_loc_untouched(num_splits, triton_gen):
    batch = make_batch([(1, 40), (2, 9)], 2, 2, 64, 16, torch.float32, triton_gen, extra_tokens=3)
    out = torch.full_like(batch.query, float("nan"))
    attention.paged_attention_fixed_splits(*batch.args(), num_splits=num_splits, out=out)
    check_against_reference(batch, out, torch.float32)
    assert torch.isnan(out[-3:]).all()


def test_mixed_dtypes_and_out_dtype(triton_gen):
    # fp32 queries over an fp16 cache, written into a bf16 out tensor.
    batch = make_batch([(1, 30), (4, 20)], 2, 2, 80, 16, torch.float32, triton_gen, cache_dtype=torch.float16)
    out = torch.full(batch.query.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    attention.paged_attention(*batch.args(), out=out)
    expected = reference.paged_attention(*batch.args(), out=torch.empty_like(out))
    torch.testing.assert_close(out.float(), expected.float(), **TOL[torch.bfloat16])


def test_strided_query_view(triton_gen):
    # The query is usually a view into a fused qkv projection: token stride > H * D.
    batch = make_batch([(1, 21), (3, 3)], 1, 4, 64, 16, torch.float16, triton_gen)
    t, h, d = batch.query.shape
    qkv = torch.randn(t, (h + 2) * d, generator=triton_gen).to(torch.float16).to(DEVICE)
    qkv[:, : h * d] = batch.query.reshape(t, h * d)
    batch.query = qkv[:, : h * d].view(t, h, d)
    assert not batch.query.is_contiguous()
    out = attention.paged_attention(*batch.args())
    check_against_reference(batch, out, torch.float16)


def _bad(**overrides):
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([(1, 5)], 1, 2, 64, 16, torch.float16, gen)
    args = dict(
        query=batch.query,
        key_cache=batch.key_cache,
        value_cache=batch.value_cache,
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        scale=batch.scale,
    )
    for name, fn in overrides.items():
        args[name] = fn(args[name]) if callable(fn) else fn
    return args


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(query=lambda q: q[0]), "query must have 3 dimensions"),
        (dict(query=lambda q: q.to(torch.int32)), "query has dtype int32"),
        (dict(block_tables=lambda b: b.long()), "block_tables has dtype int64"),
        (dict(seq_lens=lambda s: s.long()), "seq_lens has dtype int64"),
        (dict(query_start_loc=lambda s: s[:1]), "query_start_loc has 1 entries"),
        (dict(value_cache=lambda v: v[:, :, :, :32]), "value_cache shape"),
        (dict(key_cache=lambda k: k.float(), value_cache=lambda v: v.float().half()), "key_cache dtype"),
        (
            dict(
                query=lambda q: torch.cat([q, q], dim=1)[:, :3],
                key_cache=lambda k: torch.cat([k, k], dim=2),
                value_cache=lambda v: torch.cat([v, v], dim=2),
            ),
            "num_heads=3 is not a multiple of num_kv_heads=2",
        ),
        (dict(query=lambda q: q.transpose(1, 2).contiguous().transpose(1, 2)), "stride 1 in its last"),
        (dict(scale=float("nan")), "scale must be a finite float"),
        (dict(query=lambda q: torch.randn(1, 2, 320).to(q)), "head_size 320 != cache head_size 64|query head_size 320"),
    ],
)
def test_launcher_rejects_bad_inputs(overrides, match):
    args = _bad(**overrides)
    with pytest.raises(ValueError, match=match):
        attention.paged_attention(**args)


def test_launcher_rejects_bad_out_and_num_splits():
    args = _bad()
    with pytest.raises(ValueError, match="out shape"):
        attention.paged_attention(**args, out=torch.empty(2, 2, 64, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        attention.paged_attention_fixed_splits(**args, num_splits=0)


@pytest.mark.skipif(ON_GPU, reason="CPU tensors are valid input under the interpreter only")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention.paged_attention(**_bad())


def test_import_pagedserve_does_not_import_triton():
    code = textwrap.dedent("""
        import sys
        import pagedserve, pagedserve.kernels, pagedserve.kernels.triton, pagedserve.kernels.cuda
        import pagedserve.kernels.cuda.build, pagedserve.platforms
        assert "triton" not in sys.modules, "triton imported"
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_platform_ops_use_triton(monkeypatch):
    from pagedserve.platforms.cuda.ops import register_cuda_ops
    from pagedserve.platforms.ops import OpRegistry
    from pagedserve.platforms.rocm.ops import register_rocm_ops

    monkeypatch.delenv("PAGEDSERVE_CUDA_KERNELS", raising=False)
    for register in (register_cuda_ops, register_rocm_ops):
        ops = OpRegistry()
        register(ops)
        assert ops.source("paged_attention") == "triton"
        assert ops.source("reshape_and_cache") == "triton"
        assert ops.paged_attention is attention.paged_attention
        assert ops.source("rms_norm") == "reference"
    monkeypatch.setenv("PAGEDSERVE_CUDA_KERNELS", "cudnn")
    with pytest.raises(ValueError, match="PAGEDSERVE_CUDA_KERNELS='cudnn'"):
        register_cuda_ops(OpRegistry())


# Ahead-of-time compilation for real GPU targets: the interpreter accepts code that
# the Triton compiler rejects, so every launch configuration the launcher can pick
# for these shapes is compiled (no GPU needed) in a subprocess without the
# interpreter.
_AOT_SCRIPT = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve.kernels.triton import attention, cache

INT_PTRS = {"block_tables_ptr", "seq_lens_ptr", "qsl_ptr"}

def signature(fn, dtype, int64_ptrs=(), ptr_types=None):
    sig = {}
    for name in fn.arg_names:
        if ptr_types and name in ptr_types:
            sig[name] = ptr_types[name]
        elif name.isupper():
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in INT_PTRS:
                sig[name] = "*i32"
            elif name in int64_ptrs:
                sig[name] = "*i64"
            elif name.startswith("part") or name == "sinks_ptr":
                sig[name] = "*fp32"
            else:
                sig[name] = dtype
        else:
            sig[name] = "fp32" if name in ("qk_scale", "soft_cap") else "i32"
    return sig

targets = {"sm80": GPUTarget("cuda", 80, 32), "sm90": GPUTarget("cuda", 90, 32),
           "gfx942": GPUTarget("hip", "gfx942", 64)}
results = {}
jobs = []
for dtype, tdtype, head, group, decode, splits, windowed in [
    ("*bf16", torch.bfloat16, 128, 8, True, (False, True), False),
    ("*bf16", torch.bfloat16, 128, 1, False, (False,), False),
    ("*fp16", torch.float16, 256, 2, False, (False,), False),
    ("*fp16", torch.float16, 80, 4, True, (True,), False),
    ("*fp32", torch.float32, 256, 1, False, (False,), False),
    ("*bf16", torch.bfloat16, 256, 2, True, (False, True), True),
    ("*bf16", torch.bfloat16, 128, 4, False, (False,), True),
]:
    head_pad = max(16, triton.next_power_of_2(head))
    fp32 = tdtype == torch.float32
    bm, tn, warps = attention._tile_config(decode, group, head_pad, fp32)
    for split in splits:
        consts = dict(GROUP=group, BLOCK_M=bm, BLOCK_Q=bm // group, TILE_N=tn, HEAD_PAD=head_pad,
                      DOT_FP32=fp32, SPLIT=split, WINDOW=windowed, SOFT_CAP=windowed, SINKS=windowed,
                      KV_FMT=0, KV_ROWS=False, KEY_ENDS=False)
        jobs.append((f"attn-{dtype[1:]}-d{head}-g{group}-{'decode' if decode else 'prefill'}"
                     f"{'-split' if split else ''}{'-window-cap-sinks' if windowed else ''}",
                     attention._paged_attention_kernel, dtype, consts, warps, (), None))
# 8-bit caches (KV_FMT 1 int8, 2 e4m3, 3 e5m2): bytes through a uint8 (int8) view, row
# scales through a float32 one; products in fp32.
CACHE_PTRS = ("k_cache_ptr", "v_cache_ptr", "key_cache_ptr", "value_cache_ptr")
SCALE_PTRS = ("k_scale_ptr", "v_scale_ptr")
for fmt, rows, head, group, decode in [(2, True, 128, 4, True), (3, False, 128, 4, False), (2, False, 64, 1, True),
                                       (3, True, 256, 2, False), (1, True, 128, 8, True)]:
    head_pad = max(16, triton.next_power_of_2(head))
    bm, tn, warps = attention._tile_config(decode, group, head_pad, True)
    consts = dict(GROUP=group, BLOCK_M=bm, BLOCK_Q=bm // group, TILE_N=tn, HEAD_PAD=head_pad, DOT_FP32=True,
                  SPLIT=False, WINDOW=False, SOFT_CAP=False, SINKS=False, KV_FMT=fmt, KV_ROWS=rows, KEY_ENDS=False)
    ptrs = {n: "*i8" if fmt == 1 else "*u8" for n in CACHE_PTRS}
    ptrs.update({n: "*fp32" if rows else ptrs["k_cache_ptr"] for n in SCALE_PTRS})
    jobs.append((f"attn-kv{fmt}{'-rows' if rows else ''}-d{head}-g{group}-{'decode' if decode else 'prefill'}",
                 attention._paged_attention_kernel, "*bf16", consts, warps, (), ptrs))
for name, consts in (("reduce-d128", dict(SPLIT_PAD=8, HEAD_PAD=128, SINKS=False)),
                     ("reduce-d64-sinks", dict(SPLIT_PAD=4, HEAD_PAD=64, SINKS=True))):
    jobs.append((name, attention._reduce_splits_kernel, "*bf16", consts, 4, (), None))
jobs.append(("cache-d128", cache._reshape_and_cache_kernel, "*bf16",
             dict(HEADS_PER_PROG=8, HEAD_PAD=128, KV_FMT=0, ROWS_SCALED=False), 4, ("slot_mapping_ptr",), None))
for fmt, rows in [(1, True), (2, True), (3, True), (2, False), (3, False)]:
    ptrs = {n: "*i8" if fmt == 1 else "*u8" for n in CACHE_PTRS}
    ptrs.update({n: "*fp32" if rows else ptrs["key_cache_ptr"] for n in SCALE_PTRS})
    jobs.append((f"cache-kv{fmt}{'-rows' if rows else ''}-d128", cache._reshape_and_cache_kernel, "*bf16",
                 dict(HEADS_PER_PROG=8, HEAD_PAD=128, KV_FMT=fmt, ROWS_SCALED=rows), 4, ("slot_mapping_ptr",), ptrs))
for tname, target in targets.items():
    for name, fn, dtype, consts, warps, i64, ptrs in jobs:
        key = f"{tname}:{name}"
        try:
            compiled = triton.compile(ASTSource(fn, signature(fn, dtype, i64, ptrs), consts), target=target,
                                      options={"num_warps": warps})
            results[key] = "ok" if compiled.asm else "empty"
        except Exception as exc:
            results[key] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def triton_aot_results() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=300, cwd=REPO_ROOT
    )
    if res.returncode != 0:
        pytest.fail(f"AOT compile script failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", ["sm80", "sm90", "gfx942"])
def test_kernels_compile_for_gpu_targets(target, triton_aot_results):
    mine = {k: v for k, v in triton_aot_results.items() if k.startswith(target + ":")}
    assert mine, f"no compile results for {target}"
    if target == "gfx942" and all("backend" in v.lower() for v in mine.values()):
        pytest.skip("this triton build has no AMD backend")
    failed = {k: v for k, v in mine.items() if v != "ok"}
    assert not failed, json.dumps(failed, indent=1)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("extra", [{"sliding_window": 5}, {"soft_cap": 2.0}, {"sliding_window": 11, "soft_cap": 3.0}])
def test_window_and_soft_cap_match_reference(extra, num_splits):
    """Windows shorter than the contexts, over prefill chunks (after a cached prefix) and
    decodes, single pass and split-KV; out poisoned before the call."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, block_size = 4, 2, 32, 8
    batch = [(1, 1), (30, 1), (29, 8), (21, 21)]
    per_seq = [-(-ctx // block_size) for ctx, _ in batch]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(batch), max(per_seq), dtype=torch.int32)
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    kc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    q = torch.randn(sum(n for _, n in batch), heads, d, generator=gen)
    qsl = torch.tensor([0] + torch.tensor([n for _, n in batch]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([ctx for ctx, _ in batch], dtype=torch.int32)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, d**-0.5, **extra)
    _check_fixed_splits(q, kc, vc, tables, seq_lens, qsl, num_splits, extra, want)


def _check_fixed_splits(q, kc, vc, tables, seq_lens, qsl, num_splits, extra, want) -> None:
    """The split-KV Triton kernel on DEVICE, its output poisoned first, against ``want``."""
    dev = DEVICE
    out = torch.full(q.shape, float("nan"), device=dev)
    args = (q, kc, vc, tables, seq_lens, qsl)
    scale = q.shape[-1] ** -0.5
    got = attention.paged_attention_fixed_splits(*(t.to(dev) for t in args), scale, num_splits, out, **extra)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("extra", [{"sliding_window": 6}, {"sliding_window": 17, "soft_cap": 2.5}])
def test_slid_out_blocks_pointing_at_nan_are_never_read(extra, num_splits):
    """Table entries before each sequence's first visible block point at a NaN-filled
    null block (what the KV manager leaves after freeing them): decodes, a prefill chunk
    after a long prefix and a whole prompt longer than the window, with GQA."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, block_size = 6, 2, 32, 4
    batch = [(70, 1), (45, 9), (33, 33), (3, 1)]
    per_seq = [-(-ctx // block_size) for ctx, _ in batch]
    num_blocks = sum(per_seq) + 1
    null = num_blocks - 1
    tables = torch.zeros(len(batch), max(per_seq), dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    kc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    vc = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    q = torch.randn(sum(n for _, n in batch), heads, d, generator=gen)
    qsl = torch.tensor([0] + torch.tensor([n for _, n in batch]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([ctx for ctx, _ in batch], dtype=torch.int32)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, d**-0.5, **extra)
    kc[null] = float("nan")
    vc[null] = float("nan")
    freed = 0
    for i, (ctx, q_len) in enumerate(batch):
        first_block = max(0, ctx - q_len - extra["sliding_window"] + 1) // block_size
        tables[i, :first_block] = null
        freed += first_block
    assert freed >= 10
    _check_fixed_splits(q, kc, vc, tables, seq_lens, qsl, num_splits, extra, want)


def test_window_and_soft_cap_refuse_nonsense():
    q = torch.randn(1, 2, 16)
    kc = torch.randn(2, 4, 1, 16)
    args = (q, kc, kc.clone(), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32))
    args = (*args, torch.tensor([0, 1], dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match="sliding_window"):
        attention.paged_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        attention.paged_attention(*args, soft_cap=-1.0)
