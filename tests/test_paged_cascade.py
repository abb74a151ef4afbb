"""Shared-prefix (cascade) decode in the paged kernel: rows whose block tables start with the same
block ids read those keys/values once per group; the result must equal plain per-row attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.cpu.paged_kernel import load, paged_decode

pytestmark = pytest.mark.skipif(load()[0] is None, reason="the C++ kernel cannot be built here")

BS, HD = 4, 16


def _case(seed: int) -> tuple[list[list[int]], list[int]]:
    """Tables and lengths: two groups with random shared prefixes (3 and 5 blocks), ragged suffixes,
    a row sharing only one block (below the minimum), and rows that share with nobody."""
    g = torch.Generator().manual_seed(seed)
    free = iter(torch.randperm(200, generator=g).tolist())
    tables, lens = [], []
    for shared, rows in ((3, 4), (5, 3)):
        prefix = [next(free) for _ in range(shared)]
        for _ in range(rows):
            own = int(torch.randint(1, 4, (1,), generator=g))
            tables.append(prefix + [next(free) for _ in range(own)])
            lens.append(shared * BS + int(torch.randint(1, own * BS + 1, (1,), generator=g)))
    tables.append(tables[0][:1] + [next(free) for _ in range(3)])  # shares one block with group 1
    lens.append(3 * BS + 2)
    for n in (1, 6):  # alone
        tables.append([next(free) for _ in range(-(-n // BS))])
        lens.append(n)
    order = torch.randperm(len(tables), generator=g).tolist()  # groups interleaved in the batch
    return [tables[i] for i in order], [lens[i] for i in order]


def _reference(q, kc, vc, tables, lens, bs=BS):
    """Per row: gather its slots and run SDPA in fp32."""
    out = []
    for i, (t, n) in enumerate(zip(tables, lens)):
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(n)])
        ks, vs = kc[slots].float().transpose(0, 1)[None], vc[slots].float().transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(q[i:i + 1, :, None].float(), ks, vs, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


def _run(q, kc, vc, tables, lens, bs=BS):
    mb = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (mb - len(t)) for t in tables])
    return paged_decode(q, kc, vc, table, torch.tensor(lens), bs)


@pytest.mark.parametrize("dtype,threads", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 2)])
@pytest.mark.parametrize("nh,nkv", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_cascade_equals_per_row_attention(dtype, threads, nh, nkv):
    tables, lens = _case(seed=nh + threads)
    torch.manual_seed(1)
    kc, vc = (torch.randn(200 * BS, nkv, HD).to(dtype) for _ in range(2))
    q = torch.randn(len(tables), nh, HD).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = _run(q, kc, vc, tables, lens)
        # each row alone (no group): the same result up to float rounding
        alone = torch.cat([_run(q[i:i + 1], kc, vc, tables[i:i + 1], lens[i:i + 1]) for i in range(len(tables))])
    finally:
        torch.set_num_threads(before)
    ref = _reference(q, kc, vc, tables, lens)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, **tol)
    torch.testing.assert_close(got.float(), alone.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,hd,blocks", [(4, 16, 8), (16, 64, 8), (16, 64, 7), (4, 64, 9), (16, 24, 8)])
def test_a_whole_batch_shares_one_prefix(bs, hd, blocks, dtype):
    """The prefix-caching burst's shape: every row shares the same leading blocks (block size 16 and
    head size a multiple of 16: the tiled shared-part loops; otherwise the per-key ones; bf16, head size a
    multiple of 32 and 3 query heads a kv head: the shared part on AMX tiles where the host has them, its keys
    padded to a multiple of 32 when the shared run is not)."""
    torch.manual_seed(2)
    prefix = list(range(10, 10 + blocks))
    tables = [prefix + [40 + i] for i in range(9)]
    lens = [blocks * bs + 1 + i % bs for i in range(9)]
    kc, vc = (torch.randn(64 * bs, 3, hd).to(dtype) for _ in range(2))
    q = torch.randn(9, 9, hd).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(_run(q, kc, vc, tables, lens, bs).float(), _reference(q, kc, vc, tables, lens, bs),
                               **tol)


def _prefill_case(seed: int, bs: int):
    """Chunks of a step (first row, length, start, table): a group of four under one cached prefix of 3 blocks
    whose members have cached 0-5 more private tokens; a pair that shares 2 blocks, one of whose members has
    started only inside the second shared block (so its group shares 1 block: below the minimum, no group);
    one continuing chunk alone."""
    g = torch.Generator().manual_seed(seed)
    free = iter(torch.randperm(300, generator=g).tolist())
    chunks, row = [], 0
    prefix = [next(free) for _ in range(3)]
    for extra in (0, 2, 5, 3):
        n = int(torch.randint(1, 7, (1,), generator=g))
        start = 3 * bs + extra
        table = prefix + [next(free) for _ in range(-(-(start + n) // bs) - 3)]
        chunks.append((row, n, start, table))
        row += n
    pair = [next(free) for _ in range(2)]
    for start in (2 * bs + 1, bs + 1):
        table = pair + [next(free) for _ in range(3)]
        chunks.append((row, 4, start, table))
        row += 4
    chunks.append((row, 3, 2 * bs, [next(free) for _ in range(3)]))
    return chunks, row + 3


def _chunks_reference(q, kc, vc, chunks, bs) -> list[torch.Tensor]:
    """Each chunk (first row, queries, start, block table): its queries' causal SDPA over its context, in fp32."""
    ref = []
    for r0, m, start, table in chunks:
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start + m)])
        mask = torch.arange(start + m)[None, :] <= (start + torch.arange(m))[:, None]
        ref.append(F.scaled_dot_product_attention(
            q[r0:r0 + m].float().transpose(0, 1)[None], kc[slots].float().transpose(0, 1)[None],
            vc[slots].float().transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_prefill_cascade_equals_per_sequence_attention(dtype, nh, nkv, monkeypatch):
    """engines/model/prefill_cascade.py: the grouped chunks' attention (shared part in slices of rows, the own
    part padded and masked, merged) equals each chunk's own causal attention over its context; only the group
    with >= MIN_SHARED_BLOCKS shared blocks before every first query is formed."""
    from engines.model import prefill_cascade as pc

    chunks, n = _prefill_case(seed=nh, bs=BS)
    groups, taken = pc.plan_groups(chunks, BS)
    assert taken == {0, 1, 2, 3} and len(groups) == 1 and groups[0].shared_len == 3 * BS
    torch.manual_seed(2)
    kc, vc = (torch.randn(300 * BS, nkv, HD).to(dtype) for _ in range(2))
    q = torch.randn(n, nh, HD).to(dtype)
    got = pc.attend(groups[0], q, kc, vc)
    ref = _chunks_reference(q, kc, vc, chunks[:4], BS)
    assert got.dtype == dtype and torch.equal(groups[0].rows, torch.arange(sum(m for _, m, _, _ in chunks[:4])))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), torch.cat(ref), rtol=tol, atol=tol)


def _bf16_variants() -> list[int]:
    """The products' variants to check here: the fp32 products (0), the panel kernel's bf16 row blocks (1: vdpbf16ps
    in a build for AVX512-BF16, portable arithmetic elsewhere) and AMX's arithmetic in scalar C++ (4) on any host, the
    AMX tiles (3) where the host has them."""
    from engines.cpu import panel_kernel

    try:
        amx = panel_kernel.panel_variant("auto") == "amx"
    except RuntimeError:
        amx = False
    return [0, 1, 4, 3] if amx else [0, 1, 4]


def _avx2() -> bool:
    """Whether this CPU runs causal_prefill's AVX2 row blocks (variant 2: AVX2 and FMA, any x86 host here)."""
    from engines.cpu import panel_kernel

    try:
        return panel_kernel.panel_variant("avx2") == "avx2"
    except (RuntimeError, ValueError):
        return False


@pytest.mark.parametrize("nh,nkv", [(9, 3), (4, 4)], ids=["gqa", "mha"])
def test_prefill_cascade_shared_part_variants(nh, nkv, monkeypatch):
    """The bf16 shared part on AMX's layout (cascade_prefill: panels gathered from the cache, tasks of rows x query
    heads): six chunks of 8-14 questions after 48 shared keys (two 32-key panels of values, several tasks a kv
    head) equal each chunk's causal attention over its context, forced to every variant; the AMX tiles agree with
    their emulation to a bf16 ulp."""
    from engines.model import prefill_cascade as pc

    bs, hd = 16, 32
    g = torch.Generator().manual_seed(nh)
    free = iter(torch.randperm(60, generator=g).tolist())
    prefix = [next(free) for _ in range(3)]
    chunks, row = [], 0
    for extra in (0, 1, 5, 3, 7, 2):
        n = int(torch.randint(8, 15, (1,), generator=g))
        start = 3 * bs + extra
        chunks.append((row, n, start, prefix + [next(free) for _ in range(-(-(start + n) // bs) - 3)]))
        row += n
    (group,), taken = pc.plan_groups(chunks, bs)
    assert taken == set(range(6)) and group.shared_len == 3 * bs and group.tables[:, :3].tolist() == [prefix] * 6
    kc, vc = (torch.randn(60 * bs, nkv, hd, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(row, nh, hd, generator=g).to(torch.bfloat16)
    ref = _chunks_reference(q, kc, vc, chunks, bs)
    got = {}
    for variant in _bf16_variants():
        monkeypatch.setattr(pc, "FORCE_VARIANT", variant)
        assert pc.bf16_prefill(q.dtype, hd, kc.dtype) == variant
        got[variant] = pc.attend(group, q, kc, vc)
        assert got[variant].dtype == torch.bfloat16
        torch.testing.assert_close(got[variant].float(), torch.cat(ref), rtol=1e-2, atol=1e-2)
    if 3 in got:  # the tiles' sums of pairs round as their emulation's up to an ulp of the bf16 output
        torch.testing.assert_close(got[3].float(), got[4].float(), rtol=8e-3, atol=4e-3)


def test_cascade_prefill_refuses_bad_input():
    """The kernel names what it takes: a head size that is a multiple of 32 and bf16 for the tiles, chunks within
    q and their tables, block ids in range, tables that begin with the shared blocks, a known variant."""
    from engines.cpu import kernels

    mod = kernels.load()[0]
    bf = torch.bfloat16
    q, kc = torch.zeros(6, 6, 32, dtype=bf), torch.zeros(64, 2, 32, dtype=bf)
    tables, chunks = torch.tensor([[0, 1, 2], [0, 1, 3]]), torch.tensor([[0, 3, 32], [3, 3, 33]])
    ok = (q, kc, kc, tables, chunks, 32, 16, 4)
    assert mod.cascade_prefill(*ok).shape == (6, 6, 32)
    small = torch.zeros(64, 2, 16, dtype=bf)
    for i, bad, msg in ((0, q.float(), "share a dtype"), (3, torch.tensor([[0, 1, 2], [0, 1, 9]]), "block id 9"),
                        (3, torch.tensor([[0, 1, 2], [0, 2, 3]]), "chunk 1 does not begin"),
                        (4, torch.tensor([[0, 3, 32], [4, 3, 33]]), "chunk 1 .rows 4 \\+ 3"),
                        (4, torch.tensor([[0, 3, 16], [3, 3, 33]]), "chunk 0"), (5, 24, "whole blocks"),
                        (7, 5, "variant"), (1, small, "variant")):
        args = list(ok)
        args[i] = bad
        if i == 1:
            args[2] = small
            args[0] = torch.zeros(6, 6, 16, dtype=bf)
        with pytest.raises(RuntimeError, match=msg):
            mod.cascade_prefill(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nh,nkv", [(9, 3), (4, 4)], ids=["gqa", "mha"])
def test_causal_prefill_equals_per_chunk_attention(dtype, nh, nkv, monkeypatch):
    """attend_causal (causal_prefill: pieces of PIECE_ROWS queries, two products over a piece's context, each query's
    softmax masked to its own slots) equals each chunk's causal SDPA over its context, in fp32: fresh prompts shorter
    than, equal to and longer than a piece, and continuations that start inside a block; every variant of the
    products that applies (2, the AVX2 row blocks, for fp32 and bf16 on any x86 host with AVX2); the rows of the
    step's decode tokens (before the chunks) are left as they were; q's rows apart (read in place)."""
    from engines.model import prefill_cascade as pc

    bs, hd, dec = 16, 32, 3
    g = torch.Generator().manual_seed(nh)
    free = iter(torch.randperm(80, generator=g).tolist())
    chunks, row = [], dec
    for n, start in ((1, 0), (5, 0), (32, 0), (33, 0), (70, 0), (9, 13), (40, 48), (64, 3)):
        chunks.append((row, n, start, [next(free) for _ in range(-(-(start + n) // bs))]))
        row += n
    kc, vc = (torch.randn(80 * bs, nkv, hd, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(row, nh + 2, hd, generator=g).to(dtype)[:, :nh]  # rows apart, as the step's q, k, v split
    ref = _chunks_reference(q, kc, vc, chunks, bs)
    mb = max(len(t) for *_, t in chunks)
    tables = torch.tensor([t + [0] * (mb - len(t)) for *_, t in chunks])
    spec = torch.tensor([c[:3] for c in chunks])
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    variants = (_bf16_variants() if dtype == torch.bfloat16 else [0]) + ([2] if _avx2() else [])
    for variant in variants:
        monkeypatch.setattr(pc, "FORCE_VARIANT", variant)
        assert pc.causal_variant(dtype, hd, kc.dtype) == variant
        out = torch.full((row, nh, hd), 7.0, dtype=dtype)
        pc.attend_causal(tables, spec, q, kc, vc, bs, out)
        assert torch.equal(out[:dec], torch.full((dec, nh, hd), 7.0, dtype=dtype))
        torch.testing.assert_close(out[dec:].float(), torch.cat(ref), rtol=tol, atol=tol)


def test_causal_prefill_refuses_bad_input():
    """Chunks outside q or their tables, block ids out of range, a row in two chunks, an unknown variant: named."""
    mod = load()[0]
    q, kc = torch.randn(6, 4, 32), torch.randn(8 * 4, 2, 32)
    out = torch.empty_like(q)
    ok = (q, kc, kc, torch.tensor([[0, 1]]), torch.tensor([[0, 6, 0]]), 4, 0, 32, out)
    mod.causal_prefill(*ok)
    for i, bad, match in ((4, torch.tensor([[1, 6, 0]]), "outside q or its table"),
                          (3, torch.tensor([[0, 9]]), "block id 9 outside"),
                          (4, torch.tensor([[0, 6, 3]]), "outside q or its table"),
                          (6, 9, "variant 0")):
        args = list(ok)
        args[i] = bad
        with pytest.raises(RuntimeError, match=match):
            mod.causal_prefill(*args)
    q24, kc24 = torch.randn(6, 4, 24), torch.randn(8 * 4, 2, 24)  # the AVX2 row blocks take hd a multiple of 16
    with pytest.raises(RuntimeError, match="2 .avx2 row blocks: hd a multiple of 16"):
        mod.causal_prefill(q24, kc24, kc24, torch.tensor([[0, 1]]), torch.tensor([[0, 6, 0]]), 4, 2, 32,
                           torch.empty_like(q24))
    with pytest.raises(RuntimeError, match="in two chunks"):
        mod.causal_prefill(q, kc, kc, torch.tensor([[0, 1], [0, 1]]), torch.tensor([[0, 4, 0], [3, 3, 0]]), 4, 0,
                           32, out)
