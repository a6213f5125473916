"""The seeded noise function: the documented recipe, bit for bit, and its statistics."""

import math

import torch

from corelib.noise import (
    STREAM_ACCEPT,
    STREAM_BLOCK,
    STREAM_XTC,
    mix32,
    mix32_,
    row_keys,
    seeded_gumbel,
    seeded_gumbel_into,
    split_seed,
    stream_uniform,
    token_offsets,
    uniform_noise,
)
from corelib.testing import chi_square_p_value

MASK = 0xFFFFFFFF


def py_mix32(x: int) -> int:
    """docs/seeded-draw.md's mix, on unsigned 32-bit Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    x ^= x >> 16
    return x


def py_uniform(seed: int, child: int, position: int, token: int) -> float:
    lo, hi = seed & MASK, seed >> 32
    key = py_mix32(py_mix32(py_mix32(py_mix32(lo ^ 0x243F6A88) ^ hi) ^ child) ^ position)
    h = py_mix32((key + token * 0x9E3779B9) & MASK)
    return ((h >> 9) + 0.5) / 2**23


def as_signed(u: int) -> int:
    return u - 2**32 if u >= 2**31 else u


def test_mix32_matches_the_unsigned_recipe():
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(-2**31, 2**31, (5000,), dtype=torch.int64, generator=gen).to(torch.int32)
    got = mix32(values).tolist()
    want = [as_signed(py_mix32(v & MASK)) for v in values.tolist()]
    assert got == want


def test_uniform_noise_matches_the_documented_recipe():
    seeds = [0, 1, 7, 2**32 + 3, 2**63 - 1, 123456789012345]
    tokens = torch.tensor([0, 1, 2, 1000, 128255, 151935], dtype=torch.int32)
    for seed in seeds:
        for child in (0, 3):
            for position in (0, 1, 999):
                lo, hi = split_seed(seed)
                key = row_keys(*(torch.tensor([v], dtype=torch.int32) for v in (lo, hi, child, position)))
                got = uniform_noise(key[:, None], tokens[None, :])[0].tolist()
                want = [py_uniform(seed, child, position, t) for t in tokens.tolist()]
                assert got == want, (seed, child, position)


def test_uniform_noise_is_inside_the_open_interval_and_uniform():
    keys = row_keys(*(torch.arange(64, dtype=torch.int32) for _ in range(3)), torch.zeros(64, dtype=torch.int32))
    u = uniform_noise(keys[:, None], torch.arange(4096, dtype=torch.int32)[None, :]).flatten()
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u, bins=100, min=0.0, max=1.0)
    p = chi_square_p_value(counts, torch.full((100,), 0.01))
    assert p > 1e-6, f"uniform noise fails chi-square (p={p:.2e})"


def test_neighbouring_seeds_positions_and_children_are_uncorrelated():
    tokens = torch.arange(20000, dtype=torch.int32)[None, :]
    def u(seed, child, pos):
        lo, hi = split_seed(seed)
        key = row_keys(*(torch.tensor([v], dtype=torch.int32) for v in (lo, hi, child, pos)))
        return uniform_noise(key[:, None], tokens)[0].double()
    base = u(1, 0, 0)
    for other in (u(2, 0, 0), u(1, 1, 0), u(1, 0, 1), u(2**32 + 1, 0, 0)):
        corr = torch.corrcoef(torch.stack([base, other]))[0, 1]
        assert abs(float(corr)) < 0.03  # ~4 standard errors for 20000 pairs


def test_gumbel_noise_has_the_gumbel_mean():
    keys = torch.arange(50, dtype=torch.int32)[:, None]
    g = seeded_gumbel(mix32(keys), torch.arange(2000, dtype=torch.int32)[None, :]).double()
    assert abs(float(g.mean()) - 0.5772156649) < 0.02
    assert math.isfinite(float(g.max())) and math.isfinite(float(g.min()))


def test_split_seed_round_trips():
    for seed in (0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1):
        lo, hi = split_seed(seed)
        assert -2**31 <= lo < 2**31 and -2**31 <= hi < 2**31
        assert ((hi & MASK) << 32) | (lo & MASK) == seed


def test_the_all_zero_key_is_not_a_fixed_point():
    zero = torch.zeros(1, dtype=torch.int32)
    assert int(row_keys(zero, zero, zero, zero)[0]) != 0


def test_published_test_vectors():
    """The table in docs/seeded-draw.md, parsed from the page itself."""
    import pathlib
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "seeded-draw.md"
    rows = [cells for cells in table_rows(page) if len(cells) == 8 and cells[3] != "u(0)"]
    assert len(rows) == 6
    tokens = torch.tensor([[0, 1, 2, 1000, 128255]], dtype=torch.int32)
    for cells in rows:
        seed = eval(cells[0].replace("^", "**"), {})
        child, position = int(cells[1]), int(cells[2])
        lo, hi = split_seed(seed)
        key = row_keys(*(torch.tensor([v], dtype=torch.int32) for v in (lo, hi, child, position)))
        got = uniform_noise(key[:, None], tokens)[0].tolist()
        assert [f"{v:.9f}" for v in got] == cells[3:], cells


def table_rows(page) -> list[list[str]]:
    """The cells of every markdown table row of a page (separator rows left out)."""
    rows = []
    for line in page.read_text().splitlines():
        if line.startswith("| ") and not set(line) <= set("|- "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def py_stream_uniform(seed: int, child: int, position: int, salt: int) -> float:
    """The page's stream recipe on unsigned Python ints."""
    lo, hi = seed & MASK, seed >> 32
    key = py_mix32(py_mix32(py_mix32(py_mix32(lo ^ 0x243F6A88) ^ hi) ^ child) ^ position)
    h = py_mix32(py_mix32(key ^ salt))
    return ((h >> 9) + 0.5) / 2**23


def test_stream_uniforms_follow_the_page_and_its_vectors():
    import pathlib
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "seeded-draw.md"
    rows = [cells for cells in table_rows(page) if len(cells) == 6 and cells[0] != "seed"]
    assert len(rows) == 4
    salts = {"acceptance": 0xB7E15162, "XTC": 0x6A09E667, "block": 0xBB67AE85}
    assert (STREAM_ACCEPT & MASK, STREAM_XTC & MASK, STREAM_BLOCK & MASK) == (
        salts["acceptance"], salts["XTC"], salts["block"])
    for cells in rows:
        seed = eval(cells[0].replace("^", "**"), {})
        child, position = int(cells[1]), int(cells[2])
        lo, hi = split_seed(seed)
        key = row_keys(*(torch.tensor([v], dtype=torch.int32) for v in (lo, hi, child, position)))
        for stream, salt, want in ((STREAM_ACCEPT, salts["acceptance"], cells[3]), (STREAM_XTC, salts["XTC"], cells[4]),
                                   (STREAM_BLOCK, salts["block"], cells[5])):
            got = float(stream_uniform(key, stream)[0])
            assert f"{got:.9f}" == want, cells
            assert got == py_stream_uniform(seed, child, position, salt)


def test_stream_uniforms_are_uniform_and_independent_of_the_draw():
    keys = row_keys(*(torch.arange(20000, dtype=torch.int32) for _ in range(3)), torch.zeros(20000, dtype=torch.int32))
    accept, xtc = stream_uniform(keys, STREAM_ACCEPT).double(), stream_uniform(keys, STREAM_XTC).double()
    block = stream_uniform(keys, STREAM_BLOCK).double()
    draw = uniform_noise(keys, torch.zeros_like(keys)).double()
    for u in (accept, xtc, block):
        p = chi_square_p_value(torch.histc(u.float(), bins=50, min=0.0, max=1.0), torch.full((50,), 0.02))
        assert p > 1e-6
    for a, b in ((accept, xtc), (accept, draw), (xtc, draw), (block, accept), (block, xtc), (block, draw)):
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.03   # ~4 standard errors


def test_in_place_forms_give_the_same_bits():
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(-2**31, 2**31, (4, 1000), dtype=torch.int64, generator=gen).to(torch.int32)
    assert torch.equal(mix32_(values.clone(), torch.empty_like(values)), mix32(values))
    keys = row_keys(*(torch.arange(3, dtype=torch.int32) * v for v in (5, 7, 1, 11)))[:, None]
    for tokens in (torch.arange(4096, dtype=torch.int32)[None, :],          # a vocabulary row
                   torch.randint(0, 151936, (3, 64), generator=gen).to(torch.int32)):  # candidates
        shape = torch.broadcast_shapes(keys.shape, tokens.shape)
        scratch = (torch.empty(shape, dtype=torch.int32), torch.empty(shape, dtype=torch.int32))
        got = seeded_gumbel_into(torch.empty(shape), keys, token_offsets(tokens), scratch)
        assert torch.equal(got, seeded_gumbel(keys, tokens))
        logits = torch.randn(shape, generator=gen) * 3
        scores = seeded_gumbel_into(torch.empty(shape), keys, token_offsets(tokens), scratch, logits)
        assert torch.equal(scores, logits + seeded_gumbel(keys, tokens))
