"""The numba bodies of the cpu backend's compiled kernels (see ``kernels``, which chooses
between them and torch and wraps each for its caller). Every body gives exactly the bits of
the torch code it replaces; the comments on each say why the bits agree.
"""

from __future__ import annotations

from typing import Optional


def compile_kernels() -> Optional[dict]:
    """The kernels compiled by numba (imported here, on the first step that uses one), by
    name, or None when numba is missing or fails to load."""
    try:
        import numba
        import numba.extending
        from numba.core import cgutils
        import numpy as np
    except Exception:                    # a broken install falls back like a missing one
        return None
    from corelib import noise

    # corelib.noise's constants as unsigned 32-bit values, every one uint64: numba types
    # uint64 mixed with int64 as float64
    mask = np.uint64(0xFFFFFFFF)
    # up to this many values per row, the group search inserts into its output (no pool
    # of the picked groups' values and no sort: nothing allocated); past it, pool and sort
    # (an insertion costs up to W moves)
    INSERT_WIDTH = 64
    mul_1, mul_2, step = (np.uint64(c & 0xFFFFFFFF)
                          for c in (noise._MIX_MUL_1, noise._MIX_MUL_2, noise._TOKEN_STEP))
    s15, s16, top = np.uint64(15), np.uint64(16), np.uint64(32 - noise._UNIFORM_BITS)
    scale = np.float32(noise._UNIFORM_SCALE)
    half = np.float32(noise._UNIFORM_SCALE / 2)

    @numba.njit(inline="always")
    def mix(h):                           # pragma: no cover - runs compiled
        h ^= h >> s16
        h = (h * mul_1) & mask
        h ^= h >> s15
        h = (h * mul_2) & mask
        return h ^ (h >> s16)

    @numba.njit(inline="always")
    def token_hash(key, token):           # pragma: no cover - runs compiled
        # the top bits of the (row key, token) hash that make the token's uniform
        return mix((key + np.uint64(token) * step) & mask) >> top

    @numba.njit(inline="always")
    def hash_uniform(h):                  # pragma: no cover - runs compiled
        return np.float32(h) * scale + half

    @numba.njit(inline="always")
    def uniform(key, token):              # pragma: no cover - runs compiled
        return hash_uniform(token_hash(key, token))

    @numba.njit(inline="always")
    def gumbel64(u):                      # pragma: no cover - runs compiled
        # the Gumbel noise of u in float64
        return -np.log(-np.log(np.float64(u)))

    @numba.njit(cache=True, nogil=True)
    def mixed_keys(prefix, position, out):  # pragma: no cover - runs compiled
        for r in range(out.shape[0]):
            h = mix((np.uint64(prefix[r]) ^ np.uint64(position[r])) & mask)
            out[r] = np.int32(np.int64(h) - np.int64(1 << 32)) if h >= np.uint64(1 << 31) else np.int32(h)

    @numba.extending.intrinsic
    def void_pointer(typingctx, address):  # pragma: no cover - runs while compiling
        # an integer address as a void pointer, for numba.carray
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)
        return numba.types.voidptr(address), codegen

    @numba.njit(inline="always")
    def rows_at(address, n, V):          # pragma: no cover - runs compiled
        # the float32 [n, V] array at ``address`` (a contiguous tensor's data_ptr): the
        # caller passes the logits by address, where a tensor's numpy view costs four
        # operator calls of a step
        return numba.carray(void_pointer(address), (n, V), np.float32)

    key_offset = np.uint64(noise._KEY_OFFSET & 0xFFFFFFFF)

    @numba.njit(cache=True, nogil=True)
    def key_prefixes(seed_lo, seed_hi, child, out):  # pragma: no cover - runs compiled
        # corelib.noise.row_key_prefix: three mixes of 32-bit words, integer arithmetic
        for r in range(out.shape[0]):
            h = mix((np.uint64(seed_lo[r]) ^ key_offset) & mask)
            h = mix((h ^ np.uint64(seed_hi[r])) & mask)
            h = mix((h ^ np.uint64(child[r])) & mask)
            out[r] = np.int32(np.int64(h) - np.int64(1 << 32)) if h >= np.uint64(1 << 31) else np.int32(h)

    @numba.njit(cache=True, nogil=True)
    def whole_rows(keys, out):            # pragma: no cover - runs compiled
        for r in range(out.shape[0]):
            key = np.uint64(keys[r]) & mask
            for j in range(out.shape[1]):
                out[r, j] = uniform(key, j)

    @numba.njit(cache=True, nogil=True)
    def per_row_ids(keys, ids, out):      # pragma: no cover - runs compiled
        for r in range(out.shape[0]):
            key = np.uint64(keys[r]) & mask
            for j in range(out.shape[1]):
                out[r, j] = uniform(key, ids[r, j])

    @numba.njit(cache=True, nogil=True)
    def inverse_cdf(weights, u, ids, ok):  # pragma: no cover - runs compiled
        n, V = weights.shape
        for r in range(n):
            total = 0.0
            for j in range(V):             # torch's float64 cumsum: sequential, same order
                total += np.float64(weights[r, j])
            ok[r] = total > 0.0 and total < np.inf
            target = min(u[r] * total, np.nextafter(total, 0.0))
            running, pick = 0.0, V - 1
            for j in range(V):             # searchsorted(right=True): the first sum > target
                running += np.float64(weights[r, j])
                if running > target:
                    pick = j
                    break
            ids[r] = pick

    @numba.njit(inline="always")
    def top_k_row(values, r, k, t, floor, whole, out):  # pragma: no cover - runs compiled
        # row r of candidate_top_k (floor and t the row's float32 numbers): whether complete
        W = values.shape[1]
        kth = np.float32(values[r, k - 1] / t)
        last = np.float32(values[r, W - 1] / t)
        below = np.float32(floor / t)
        for j in range(W):
            v = np.float32(values[r, j] / t)
            out[r, j] = -np.inf if v < kth else v
        return whole or (last < kth and below < kth) or kth == -np.inf

    @numba.njit(cache=True, nogil=True)
    def candidate_top_k(values, k, temperature, floor, whole, out, complete):  # pragma: no cover
        for r in range(values.shape[0]):
            complete[r] = top_k_row(values, r, k[r], temperature[r], floor[r], whole, out)

    @numba.njit(inline="always")
    def shifted_exp(row, out):            # pragma: no cover - runs compiled
        # float64 exp(row - max) into out, and (max, their sum); a max not finite or a sum
        # not finite and positive (a NaN among the values) tells the caller to leave the row
        high = -np.inf
        for j in range(row.shape[0]):
            high = max(high, np.float64(row[j]))
        total = 0.0
        if -np.inf < high < np.inf:
            for j in range(row.shape[0]):
                out[j] = np.exp(np.float64(row[j]) - high)
                total += out[j]
        return high, total

    @numba.njit(inline="always")
    def top_p_row(values, r, top_p, tolerance, out, p):  # pragma: no cover - runs compiled
        # row r of candidate_top_p (p: float64 scratch of W): whether settled
        W = values.shape[1]
        top = np.float64(top_p)
        out[r, :] = values[r, :]
        if top >= 1.0:
            return True
        high, total = shifted_exp(values[r], p)
        if not (-np.inf < high < np.inf and 0.0 < total < np.inf):
            return False
        running, count, sums_gap = 0.0, 0, np.inf
        for j in range(W):
            p[j] /= total
            if running < top:
                count += 1
            sums_gap = min(sums_gap, abs(running - top))
            running += p[j]
        last = max(count, 1) - 1
        threshold, tied = p[last], values[r, last]
        value_gap = np.inf
        for j in range(W):
            if values[r, j] != tied:
                value_gap = min(value_gap, abs(p[j] - threshold) / max(threshold, 1e-300))
        tiny = 0.0 < threshold < 2.0 ** -100
        for j in range(W):
            if not p[j] >= threshold:
                out[r, j] = -np.inf
        return min(sums_gap, value_gap) > tolerance and not tiny

    @numba.njit(cache=True, nogil=True)
    def candidate_top_p(values, top_p, tolerance, out, settled):  # pragma: no cover
        p = np.empty(values.shape[1])
        for r in range(values.shape[0]):
            settled[r] = top_p_row(values, r, top_p[r], tolerance, out, p)

    @numba.njit(inline="always")
    def positive(bits):                   # pragma: no cover - runs compiled
        # a float32's int32 bits: w > 0 (NaN excluded) exactly when 0 < bits <= those of +inf,
        # an integer test that vectorises where a float comparison does not
        return (bits > np.int32(0)) & (bits <= np.int32(0x7F800000))

    @numba.njit(cache=True, nogil=True)
    def positive_ids(bits, pad, ids, counts):  # pragma: no cover - runs compiled
        n, V = bits.shape
        cap = ids.shape[1]
        whole = V - V % 64
        for r in range(n):
            row = bits[r]
            c = 0
            for start in range(0, whole, 64):   # a vectorised count first: most blocks hold none
                found = np.int32(0)
                for j in range(64):
                    found += np.int32(positive(row[start + j]))
                if found == 0:
                    continue
                if c + found > cap:
                    return False
                for j in range(start, start + 64):
                    if positive(row[j]):
                        ids[r, c] = j
                        c += 1
            for j in range(whole, V):
                if positive(row[j]):
                    if c == cap:
                        return False
                    ids[r, c] = j
                    c += 1
            counts[r] = c
            for j in range(c, cap):
                ids[r, j] = pad
        return True

    @numba.njit(cache=True, nogil=True)
    def smooth(x, top, square, cube):      # pragma: no cover - runs compiled
        # float32 throughout, each product rounded in the reference's order (no fused
        # multiply-add: numba contracts nothing without fastmath)
        n, V = x.shape
        for r in range(n):
            m, a, b = top[r], square[r], cube[r]
            for j in range(V):
                v = x[r, j]
                if v != -np.inf:
                    d = v - m
                    x[r, j] = (m - a * d * d) + b * d * d * d

    @numba.njit(cache=True, nogil=True)
    def adaptive(x, p, aim, width):         # pragma: no cover - runs compiled
        # float32 throughout (the constants too: a float64 literal would widen the products),
        # the reference's operations in its order, none fused
        n, V = x.shape
        five, ten, one = np.float32(5.0), np.float32(10.0), np.float32(1.0)
        for r in range(n):
            a = aim[r]
            for j in range(V):
                if x[r, j] > -np.inf:
                    u = abs(p[r, j] - a) / width
                    x[r, j] = five - ten * u * u / (one + u)

    @numba.njit(cache=True, nogil=True)
    def tfs_second(q, n, out):              # pragma: no cover - runs compiled
        rows, width = out.shape
        for r in range(rows):
            inside = n[r] - 2
            for i in range(width):
                out[r, i] = abs((q[r, i] - 2.0 * q[r, i + 1]) + q[r, i + 2]) if i < inside else 0.0

    @numba.njit(cache=True, nogil=True)
    def tfs_index(second, total, n, tfs, out):  # pragma: no cover - runs compiled
        rows, width = second.shape
        for r in range(rows):
            inside = n[r] - 2
            count, running = 0, 0.0
            spread = total[r] > 1e-6
            for i in range(min(inside, width)):    # torch's cumsum: sequential, same order
                running += second[r, i] / max(total[r], 1e-300) if spread else 1.0 / max(inside, 1)
                if not running <= tfs[r]:          # non-decreasing: no later sum passes
                    break
                count += 1
            out[r] = min(count + 1, max(inside, 1))

    @numba.njit(cache=True, nogil=True)
    def pack_above(x, floor, out):          # pragma: no cover - runs compiled
        # one byte of 8 comparisons at a time (uint8 lanes vectorise; a 32-bit word's
        # variable shifts do not), written where the int32 words' little-endian bytes lie
        n, V = x.shape
        whole = V // 8
        for r in range(n):
            row = x[r]
            o = out[r]
            for k in range(whole):
                b = np.uint8(0)
                for j in range(8):
                    b |= np.uint8(row[k * 8 + j] > floor) << np.uint8(j)
                o[k] = b
            k = whole
            if whole * 8 < V:
                b = np.uint8(0)
                for j in range(V - whole * 8):
                    b |= np.uint8(row[whole * 8 + j] > floor) << np.uint8(j)
                o[k] = b
                k += 1
            for m in range(k, o.shape[0]):
                o[m] = np.uint8(0)

    @numba.njit(inline="always")
    def bucket_of(bits, shift, top):      # pragma: no cover - runs compiled
        b = bits >> shift                 # arithmetic, as torch's on int32
        return 0 if b < 0 else (top if b > top else b)

    @numba.njit(cache=True, nogil=True)
    def bucket_mass(probs, bits, shift, top, mass, count):  # pragma: no cover - runs compiled
        # float64 sums in token order: torch.bincount's order, so its bits
        n, V = probs.shape
        for r in range(n):
            for j in range(V):
                k = bucket_of(bits[r, j], shift, top)
                mass[r, k] += np.float64(probs[r, j])
                count[r, k] += 1

    @numba.njit(cache=True, nogil=True)
    def band_indices(bits, bucket, shift, top, out):  # pragma: no cover - runs compiled
        n, V = bits.shape
        c = 0
        for r in range(n):
            want = bucket[r]
            for j in range(V):
                if bucket_of(bits[r, j], shift, top) == want:
                    out[c] = r * V + j
                    c += 1
        return c

    @numba.njit(cache=True, nogil=True)
    def collect_above(row, maxima, group, threshold, values, ids):  # pragma: no cover
        V, G, cap = row.shape[0], maxima.shape[0], values.shape[0]
        k = 0
        for g in range(G):
            if maxima[g] != maxima[g]:
                return -1
            if maxima[g] < threshold:     # no token of the group reaches it
                continue
            for j in range(g * group, min(g * group + group, V)):
                if row[j] >= threshold:
                    if k == cap:
                        return -1
                    values[k] = row[j]
                    ids[k] = j
                    k += 1
        return k

    @numba.njit(inline="always")
    def min_p_row(values, r, min_p, margin, out):  # pragma: no cover - runs compiled
        # row r of candidate_min_p: whether settled
        top = np.float64(values[r, 0])
        ok = top == top and top != np.inf and top != -np.inf
        level = np.log(np.float64(min_p)) if min_p > 0 else 0.0
        for j in range(values.shape[1]):
            v = values[r, j]
            out[r, j] = v
            if v == -np.inf:
                continue
            distance = np.float64(v) - top - level
            if not abs(distance) > margin:          # NaN too
                ok = False
            if min_p > 0 and distance < 0:
                out[r, j] = -np.inf
        return ok

    @numba.njit(cache=True, nogil=True)
    def min_p_chain(address, n, V, row, maxima, group, threshold, temperature, min_p, margin,
                    values, ids):  # pragma: no cover - runs compiled
        # steps 10-11 of one row made into candidates (the logits at ``address``, rows_at):
        # collect_above's tokens, descending (np.argsort; ties in any order), divided by the
        # temperature in float32, then min_p_row on them: the bits of collect_above, sort,
        # division and candidate_min_p one by one. Returns (count, settled), count -1 where
        # collect_above gives up
        k = collect_above(rows_at(address, n, V)[row], maxima, group, threshold, values[0], ids[0])
        if k <= 0:
            return -1, False
        found, found_ids = values[0, :k].copy(), ids[0, :k].copy()
        order = np.argsort(found)
        for j in range(k):
            at = order[k - 1 - j]
            values[0, j] = np.float32(found[at] / temperature)
            ids[0, j] = found_ids[at]
        kept = values[:, :k]
        return k, min_p_row(kept, 0, min_p, margin, kept)

    @numba.njit(cache=True, nogil=True)
    def candidate_min_p(values, min_p, margin, out, settled):  # pragma: no cover - compiled
        for r in range(values.shape[0]):
            settled[r] = min_p_row(values, r, min_p[r], margin, out)

    @numba.njit(inline="always")
    def wth_largest(m, W, best):          # pragma: no cover - runs compiled
        # the W-th largest of m (no NaN; W <= len(m)), duplicates counted: the value
        # np.partition puts at len(m) - W, found without its copies of m (an allocation and
        # a select over every value, the larger part of a B = 1 chain call). best[:W] holds
        # the W largest so far, ascending; a value enters when above best[0] (an equal one
        # would leave the multiset as it is)
        for i in range(W):                # the first W, by insertion
            v = m[i]
            j = i
            while j > 0 and best[j - 1] > v:
                best[j] = best[j - 1]
                j -= 1
            best[j] = v
        for g in range(W, m.shape[0]):
            v = m[g]
            if v > best[0]:
                j = 0
                while j + 1 < W and best[j + 1] < v:
                    best[j] = best[j + 1]
                    j += 1
                best[j] = v
        return best[0]

    @numba.njit(inline="always")
    def insert_group(x, r, start, stop, fl, values, ids, filled):  # pragma: no cover - compiled
        # the values >= fl of x[r, start:stop] into the row's W largest so far (values[r,
        # :filled], descending; an equal value goes after those it meets, so a full row
        # keeps the earlier): the new count
        W = values.shape[1]
        for j in range(start, stop):
            v = x[r, j]
            if v < fl or (filled == W and not v > values[r, W - 1]):
                continue
            i = filled if filled < W else W - 1
            while i > 0 and values[r, i - 1] < v:
                values[r, i] = values[r, i - 1]
                ids[r, i] = ids[r, i - 1]
                i -= 1
            values[r, i] = v
            ids[r, i] = j
            if filled < W:
                filled += 1
        return filled

    @numba.njit(inline="always")
    def row_top_values(x, r, m, group, values, ids, best):  # pragma: no cover - compiled
        # the W largest values of row r (W = values.shape[1] <= INSERT_WIDTH), descending,
        # and their ids, into values[r] and ids[r], found in the groups whose maximum
        # reaches the W-th largest maximum (groups above it, then ties with it up to W) by
        # insertion: no pool of their values, no sort, nothing allocated. best: scratch of
        # W (any float dtype). Returns the floor (float32); NaN maxima are the caller's
        V, G, W = x.shape[1], m.shape[0], values.shape[1]
        fl = np.float32(wth_largest(m, W, best))
        filled, c = 0, 0
        for g in range(G):
            if m[g] > fl:
                filled = insert_group(x, r, g * group, min(g * group + group, V), fl, values, ids, filled)
                c += 1
        for g in range(G):
            if c == W:
                break
            if m[g] == fl:
                filled = insert_group(x, r, g * group, min(g * group + group, V), fl, values, ids, filled)
                c += 1
        return fl

    @numba.njit(cache=True, nogil=True)
    def top_group_values(x, maxima, group, values, ids, floor):  # pragma: no cover - compiled
        n, V = x.shape
        G, W = maxima.shape[1], values.shape[1]
        for r in range(n):
            m = maxima[r]
            for g in range(G):
                if m[g] != m[g]:          # NaN: torch.topk ranks it first; torch's path
                    return False
        if W <= INSERT_WIDTH:             # few values: insertion, no buffers but one of W
            best = np.empty(W, dtype=np.float32)
            for r in range(n):
                floor[r] = row_top_values(x, r, maxima[r], group, values, ids, best)
            return True
        picked = np.empty(W, dtype=np.int64)
        pool = np.empty(W * group, dtype=np.float32)
        where = np.empty(W * group, dtype=np.int64)
        for r in range(n):
            m = maxima[r]
            # the W-th largest group maximum: every value of the row's W largest reaches it
            fl = wth_largest(m, W, pool)
            c = 0
            for g in range(G):            # groups above it, then ties with it up to W
                if m[g] > fl:
                    picked[c] = g
                    c += 1
            for g in range(G):
                if c == W:
                    break
                if m[g] == fl:
                    picked[c] = g
                    c += 1
            k = 0
            for i in range(W):            # the picked groups' values that reach fl
                start = picked[i] * group
                for j in range(start, min(start + group, V)):
                    if x[r, j] >= fl:
                        pool[k] = x[r, j]
                        where[k] = j
                        k += 1
            order = np.argsort(pool[:k])  # ascending; ties in any order (allowed)
            for i in range(W):
                values[r, i] = pool[order[k - 1 - i]]
                ids[r, i] = where[order[k - 1 - i]]
            floor[r] = fl
        return True

    @numba.njit(cache=True, nogil=True)
    def group_top_k(x, maxima, group, k, temperature, values, ids, complete):  # pragma: no cover
        # the group search, then top-k's tail on its values in place (candidate_top_k reads
        # a row's k-th, last and floor before it writes the row, and each value before its
        # own write): the two kernels' bits, in one call
        floor = np.empty(x.shape[0], dtype=np.float32)
        if not top_group_values(x, maxima, group, values, ids, floor):
            return False
        candidate_top_k(values, k, temperature, floor, False, values, complete)
        return True

    @numba.njit(inline="always")
    def typical_row(values, r, typical_p, mass_margin, score_margin, lowest, out, scratch):  # pragma: no cover
        # row r of candidate_typical (scratch: float64 [3, W], log p, the scores and their
        # order): whether settled. Candidates descending (as top-k leaves them) need no sort:
        # log p + H falls along the row, so the scores ascend from where it changes sign,
        # outwards, a merge of two sorted runs (ties may come in another order than a sort's;
        # the kept set and the settling do not depend on it). Other rows take numpy's argsort
        # (it allocates). Nothing else is allocated, so a cold call reads no fresh memory
        W = values.shape[1]
        out[r, :] = values[r, :]
        tp = np.float64(typical_p)
        if tp >= 1.0:
            return True
        logp, score, order = scratch[0], scratch[1], scratch[2].view(np.int64)
        high, total = shifted_exp(values[r], logp)      # logp is scratch until below
        if not (-np.inf < high < np.inf and 0.0 < total < np.inf):
            return False
        lse = np.log(total)
        entropy, live, descending = 0.0, 0, True
        for j in range(W):
            v = values[r, j]
            logp[j] = np.float64(v) - high - lse
            if v > -np.inf:
                entropy -= np.exp(logp[j]) * logp[j]
                live += 1
            if j > 0 and not v <= values[r, j - 1]:
                descending = False
        split = 0                         # descending: the live tokens with log p + H >= 0
        for j in range(W):
            score[j] = abs(logp[j] + entropy) if values[r, j] > -np.inf else np.inf
            if values[r, j] > -np.inf and logp[j] + entropy >= 0.0:
                split += 1
        if descending:
            a, b = split - 1, split
            for i in range(live):
                if b >= live or (a >= 0 and score[a] <= score[b]):
                    order[i] = a
                    a -= 1
                else:
                    order[i] = b
                    b += 1
        else:
            order[:] = np.argsort(score)   # ascending, -inf values (inf scores) last
        mass, inside, ok = 0.0, 0, True
        for i in range(live):
            if mass < tp:
                inside += 1
            ok = ok and abs(mass - tp) > mass_margin
            mass += np.exp(logp[order[i]])
        ok = ok and abs(mass - tp) > mass_margin
        last = order[max(inside, 1) - 1]
        threshold, tied = score[last], values[r, last]
        for j in range(live):
            k = order[j]
            if score[k] <= threshold and logp[k] < lowest:
                ok = False
            if values[r, k] != tied and abs(score[k] - threshold) <= score_margin * (1.0 + entropy + abs(logp[k])):
                ok = False
        for j in range(W):
            if not score[j] <= threshold:
                out[r, j] = -np.inf
        return ok

    @numba.njit(cache=True, nogil=True)
    def candidate_chain(x, maxima, group, k, temperature, min_p, margin, top_p, tolerance,
                        typical_p, mass_margin, score_margin, lowest,
                        values, ids, scratch):  # pragma: no cover - runs compiled
        # group_top_k, then candidate_min_p (min_p of length 0: off), candidate_top_p
        # (top_p of length 0: off) and candidate_typical (typical_p of length 0: off) on its
        # values in place (each reads a value before it writes it): those kernels' bits in
        # one call, row by row (rows are independent). False as soon as a row is incomplete
        # or unsettled: the caller then takes the kernels one by one, with their fallbacks.
        # scratch: float64 [3, W] the caller lends (the W-th largest maximum's buffer, top-p's
        # probabilities, typical's log p, scores and order, each used after the one before):
        # with W <= INSERT_WIDTH nothing is allocated, so a cold call reads no fresh memory
        n, G, W = x.shape[0], maxima.shape[1], values.shape[1]
        if W > INSERT_WIDTH:               # the search's pool and sort (it allocates)
            floor = np.empty(n, dtype=np.float32)
            if not top_group_values(x, maxima, group, values, ids, floor):
                return False
        for r in range(n):
            if W <= INSERT_WIDTH:
                m = maxima[r]
                for g in range(G):
                    if m[g] != m[g]:      # NaN: the torch path
                        return False
                fl = row_top_values(x, r, m, group, values, ids, scratch[0])
            else:
                fl = floor[r]
            if not top_k_row(values, r, k[r], temperature[r], fl, False, values):
                return False
            if min_p.shape[0] and not min_p_row(values, r, min_p[r], margin, values):
                return False
            if top_p.shape[0] and not top_p_row(values, r, top_p[r], tolerance, values, scratch[1]):
                return False
            if typical_p.shape[0] and not typical_row(values, r, typical_p[r], mass_margin, score_margin,
                                                      lowest, values, scratch):
                return False
        return True

    @numba.njit(cache=True, nogil=True)
    def candidate_chain_by_address(address, n, V, maxima, group, k, temperature, min_p, margin, top_p,
                                   tolerance, typical_p, mass_margin, score_margin, lowest, values, ids,
                                   scratch):  # pragma: no cover - runs compiled
        # candidate_chain on the logits at ``address`` (rows_at)
        return candidate_chain(rows_at(address, n, V), maxima, group, k, temperature, min_p, margin, top_p,
                               tolerance, typical_p, mass_margin, score_margin, lowest, values, ids, scratch)

    @numba.njit(cache=True, nogil=True)
    def seeded_race_winners(values, minus_noise, ids, out_ids, finite):  # pragma: no cover
        # each row's winning candidate, its id and whether its value is finite, of the
        # scores values - minus_noise (the float32 subtraction torch makes; minus_noise is
        # log(-log(u)) of the contract's uniforms, never 0 or 1): the lowest id among those
        # equal to the largest (NaN propagates, and then none is equal: the first column, as
        # torch.where then argmin of the draw's torch path). Returns whether every winner is
        # finite (the caller reads no flag array on the host)
        n, W = values.shape
        every = True
        for r in range(n):
            pos = 0
            best = np.float32(values[r, 0] - minus_noise[r, 0])
            for j in range(1, W):
                v = np.float32(values[r, j] - minus_noise[r, j])
                if v != v or best != best:
                    best = np.float32(np.nan)
                elif v > best:
                    best = v
            if best == best:
                low = -1
                for j in range(W):
                    v = np.float32(values[r, j] - minus_noise[r, j])
                    if v == best and (low < 0 or ids[r, j] < low):
                        low, pos = ids[r, j], j
            out_ids[r] = ids[r, pos]
            w = values[r, pos]
            finite[r] = w == w and w != np.inf and w != -np.inf
            every = every and finite[r]
        return every

    # the unseeded candidate race's noise: splitmix64's finaliser (Steele, Lea and Flood's
    # SplitMix) over a 64-bit key the sampler's generator draws each step, the row and the
    # token id; 52 bits of it give a uniform in (0, 1), exact in float64
    golden = np.uint64(0x9E3779B97F4A7C15)
    row_step = np.uint64(0xD1B54A32D192ED03)
    m64_1, m64_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    s27, s30, s31, s12 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(12)
    ulp52 = 2.0 ** -52

    @numba.njit(inline="always")
    def mix64(z):                         # pragma: no cover - runs compiled
        z = (z ^ (z >> s30)) * m64_1
        z = (z ^ (z >> s27)) * m64_2
        return z ^ (z >> s31)

    @numba.njit(cache=True, nogil=True)
    def unseeded_race_winners(values, ids, key, out_ids, finite):  # pragma: no cover
        # each row's winning candidate by a Gumbel race with noise of its own (float64
        # -log(-log(u)), u from mix64 of key, row and token id): the first largest score, a
        # NaN value first (as torch.argmax over the scores); returns whether every winner's
        # value is finite
        n, W = values.shape
        every = True
        for r in range(n):
            row_key = mix64(np.uint64(key[0]) + np.uint64(r + 1) * row_step)
            pos = 0
            best = -np.inf
            for j in range(W):
                v = np.float64(values[r, j])
                if v != v:
                    pos = j
                    break
                h = mix64(row_key + np.uint64(ids[r, j] + 1) * golden)
                u = (np.float64(h >> s12) + 0.5) * ulp52
                score = v + gumbel64(u)
                if score > best or j == 0:
                    best, pos = score, j
            out_ids[r] = ids[r, pos]
            w = values[r, pos]
            finite[r] = w == w and w != np.inf and w != -np.inf
            every = every and finite[r]
        return every

    # float32 bits as int32: +inf's, and as uint32: -inf's; a NaN's lie above them
    pos_inf_bits, neg_inf_unsigned = np.int32(0x7F800000), np.uint32(0xFF800000)

    @numba.njit(inline="always")
    def bits_range(bits, unsigned):       # pragma: no cover - runs compiled
        # the largest and smallest of float32 bits as int32 (``bits``) and the largest as
        # uint32 (``unsigned``, the same memory): three integer reductions, which vectorise
        # where a float maximum that sees NaN does not, and need no transform of the bits
        hi, lo, unsigned_hi = np.int32(-2147483648), np.int32(2147483647), np.uint32(0)
        for j in range(bits.shape[0]):
            hi = max(hi, bits[j])
            lo = min(lo, bits[j])
            unsigned_hi = max(unsigned_hi, unsigned[j])
        return hi, lo, unsigned_hi

    @numba.njit(cache=True, nogil=True)
    def group_maxima_by_address(address, n, V, group, maxima, top):  # pragma: no cover - runs compiled
        # each group's maximum of the float32 [n, V] logits at ``address`` (V a multiple of
        # group) into maxima, by its float32 bits (NaN-free groups: torch's amax but for the
        # sign of a zero maximum, which only compares), and each row's into top; False at
        # once for a NaN (maxima then partly written), else whether every row's maximum is
        # finite and nonzero. As int32, sign-clear floats order as their values and lie above
        # sign-set ones, which order reversed: a group's maximum is its largest bits when
        # those are sign-clear, else its smallest. A NaN's bits exceed +inf's as int32 (sign
        # clear) or -inf's as uint32 (sign set)
        x = numba.carray(void_pointer(address), (n, V), np.int32)
        xu = numba.carray(void_pointer(address), (n, V), np.uint32)
        out = maxima.view(np.int32)
        every = True
        for r in range(n):
            row, urow = x[r], xu[r]
            m = np.float32(-np.inf)
            for g in range(V // group):
                hi, lo, unsigned = bits_range(row[g * group:(g + 1) * group], urow[g * group:(g + 1) * group])
                if hi > pos_inf_bits or unsigned > neg_inf_unsigned:
                    return False
                out[r, g] = hi if hi >= 0 else lo
                if maxima[r, g] > m:
                    m = maxima[r, g]
            top[r] = m
            every = every and m != 0.0 and m != np.inf and m != -np.inf
        return every

    # the seeded race's scores x - log(-log(u)) estimated in float64 differ from torch's
    # float32 ones (two logarithms within a few ulps each, one rounded subtraction) by less
    # than 2**-17 + 2**-23 |x| for u in (0, 1), where |log(-log(u))| < 17: the slack
    # 2**-14 + 2**-20 |x| is 8 times that, and x + slack rises with x (so a group's largest
    # logit bounds its logits' x + slack)
    score_slack, score_slack_per_logit = 2.0 ** -14, 2.0 ** -20

    @numba.njit(inline="always")
    def slack(v):                         # pragma: no cover - runs compiled
        return score_slack + score_slack_per_logit * abs(v)

    # a group's noise bound from its largest hash: the noise of the largest hash of its
    # bucket of 2**11 (the noise rises with the hash), so no logarithm per group
    bucket_shift = np.int32(11)
    bucket_noise = np.array([-np.log(-np.log(np.float64(np.float32(((b << 11) | 0x7FF)) * scale + half)))
                             for b in range(1 << (noise._UNIFORM_BITS - 11))])

    # at most this many scores estimated per row (two logarithms each), so that rows whose
    # bounds are loose cost a bounded time before the torch race takes them
    scores_per_row = 4096

    @numba.njit(inline="always")
    def open_group(x, r, key, start, stop, noise_bound, low, values, ids, count, budget):  # pragma: no cover
        # the tokens of x[r, start:stop] whose estimated score + slack reaches low, appended
        # to values[r] and ids[r] from count; returns (count, low raised by their scores -
        # slack, budget less the scores estimated), count -1 when the row's room or its
        # budget runs out. noise_bound: the noise of the group's largest uniform
        for j in range(start, stop):
            v = np.float64(x[r, j])
            if v == -np.inf or v + slack(v) + noise_bound < low:
                continue
            if budget == 0:
                return -1, low, budget
            budget -= 1
            score = v + gumbel64(uniform(key, j))
            if score + slack(v) < low:
                continue
            if count == values.shape[1]:
                return -1, low, budget
            values[r, count], ids[r, count] = x[r, j], j
            low = max(low, score - slack(v))
            count += 1
        return count, low, budget

    @numba.njit(cache=True, nogil=True)
    def seeded_race_candidates_by_address(address, n, V, keys, group, values, ids):  # pragma: no cover
        # the tokens that can win each row's seeded race argmax(x + noise) over the float32
        # [n, V] logits at ``address`` (keys int32 [n], the contract's uniforms): a superset of
        # its maximisers, into values float32 [n, cap] and ids int64 [n, cap] (rows padded with
        # -inf and their first id), computing the noise of few tokens. Each token's score
        # estimated in float64 lies within its slack of torch's, so every maximiser has
        # estimate + slack >= L, the largest estimate - slack: those are the candidates. A
        # group's estimates + slack are bounded by its largest logit's plus the noise of its
        # largest hash (its bucket's bound until it is opened): the best group is opened
        # first, for L, then the groups whose bound reaches L, best first. Returns the widest
        # row's count, or 0 (nothing usable: a NaN or +inf logit, a row of -inf only, more
        # than cap candidates or scores_per_row estimates in a row: the caller's torch path)
        x = rows_at(address, n, V)
        bits = numba.carray(void_pointer(address), (n, V), np.int32)
        unsigned = numba.carray(void_pointer(address), (n, V), np.uint32)
        G = (V + group - 1) // group
        largest = np.empty(G, dtype=np.float32)
        largest_bits = largest.view(np.int32)
        top_hash = np.empty(G, dtype=np.int32)
        bound, order = np.empty(G), np.empty(G, dtype=np.int64)
        widest = 0
        for r in range(n):
            key = np.uint64(keys[r]) & mask
            best, first = -np.inf, -1
            for g in range(G):
                start, stop = g * group, min(g * group + group, V)
                hi, lo, un = bits_range(bits[r, start:stop], unsigned[r, start:stop])
                if hi >= pos_inf_bits or un > neg_inf_unsigned:
                    return 0                      # NaN or +inf: the torch path flags it
                h = np.int32(0)
                for j in range(start, stop):
                    h = max(h, np.int32(token_hash(key, j)))
                largest_bits[g] = hi if hi >= 0 else lo
                top_hash[g] = h
                top_logit = np.float64(largest[g])
                bound[g] = (top_logit + slack(top_logit) + bucket_noise[h >> bucket_shift]
                            if top_logit > -np.inf else -np.inf)
                if bound[g] > best:
                    best, first = bound[g], g
            if first < 0:
                return 0                          # every logit -inf
            count, low, budget = open_group(x, r, key, first * group, min(first * group + group, V),
                                            gumbel64(hash_uniform(top_hash[first])), -np.inf,
                                            values, ids, 0, scores_per_row)
            if count < 0:
                return 0
            bound[first] = -np.inf
            reached = 0
            for g in range(G):
                if bound[g] >= low:
                    order[reached] = g
                    reached += 1
            picked = order[:reached][np.argsort(-bound[order[:reached]], kind="mergesort")]
            for g in picked:                  # L rises fastest best first; past a bound below it, done
                if bound[g] < low:
                    break
                noise_bound = gumbel64(hash_uniform(top_hash[g]))
                top_logit = np.float64(largest[g])
                if top_logit + slack(top_logit) + noise_bound < low:
                    continue
                count, low, budget = open_group(x, r, key, g * group, min(g * group + group, V), noise_bound,
                                                low, values, ids, count, budget)
                if count < 0:
                    return 0
            kept = 0
            for c in range(count):            # L has risen since some were taken
                v = np.float64(values[r, c])
                if v + gumbel64(uniform(key, ids[r, c])) + slack(v) >= low:
                    values[r, kept], ids[r, kept] = values[r, c], ids[r, c]
                    kept += 1
            for c in range(kept, values.shape[1]):
                values[r, c], ids[r, c] = -np.inf, ids[r, 0]
            widest = max(widest, kept)
        return widest

    @numba.njit(cache=True, nogil=True)
    def seeded_candidates_settled(values, ids, keys, out_ids, finite):  # pragma: no cover
        # each seeded candidate row's winner where the float64 estimates of its candidates'
        # scores (values float32 [n, W], ids int64 [n, W], keys int32 [n]) settle it: the
        # best estimate less its slack above every other finite candidate's estimate plus
        # its slack, so the best is the only maximiser of torch's float32 scores (the
        # reference's token). False (outputs partly written) as soon as a row is not settled,
        # holds a NaN or +inf, or has no finite value: the caller races with torch's noise
        n, W = values.shape
        for r in range(n):
            key = np.uint64(keys[r]) & mask
            pos, best = -1, -np.inf
            for j in range(W):
                v = np.float64(values[r, j])
                if v != v or v == np.inf:
                    return False
                if v == -np.inf:
                    continue
                score = v + gumbel64(uniform(key, ids[r, j]))
                if pos < 0 or score > best:
                    pos, best = j, score
            if pos < 0:
                return False
            low = best - slack(np.float64(values[r, pos]))
            for j in range(W):
                v = np.float64(values[r, j])
                if j == pos or v == -np.inf:
                    continue
                if v + gumbel64(uniform(key, ids[r, j])) + slack(v) >= low:
                    return False
            out_ids[r] = ids[r, pos]
            finite[r] = True
        return True

    @numba.njit(cache=True, nogil=True)
    def first_max_at(x, maxima, top, group, out):  # pragma: no cover - runs compiled
        # the first group whose maximum is the row's, then the first token of it holding that
        # value: exact comparisons, torch.argmax's lowest index (False: some row lacks it)
        n, V = x.shape
        for r in range(n):
            t = top[r]
            out[r] = -1
            for g in range(maxima.shape[1]):
                if maxima[r, g] == t:
                    for j in range(g * group, min(g * group + group, V)):
                        if x[r, j] == t:
                            out[r] = j
                            break
                    break
            if out[r] < 0:
                return False
        return True

    @numba.njit(cache=True, nogil=True)
    def first_max_at_by_address(address, n, V, maxima, top, group, out):  # pragma: no cover
        # first_max_at on the logits at ``address`` (rows_at)
        return first_max_at(rows_at(address, n, V), maxima, top, group, out)

    @numba.njit(cache=True, nogil=True)
    def candidate_typical(values, typical_p, mass_margin, score_margin, lowest, out, settled):  # pragma: no cover
        # the reference's typical set of each candidate row, in float64 on the candidates:
        # log p, H, the scores |log p + H| ascending, the first whose mass before it reaches
        # typical_p, every score up to it kept. Settled only where the reference's float32
        # sums over the row cannot flip a decision: every mass before (and the total) away
        # from typical_p by mass_margin, every score not tied in logit with the threshold
        # token's away from it by score_margin (relative to 1 + H + |log p|), and no kept
        # token's log p below ``lowest`` (float32's exp underflows there: the reference's p
        # would be 0 and its score inf)
        scratch = np.empty((3, values.shape[1]))
        for r in range(values.shape[0]):
            settled[r] = typical_row(values, r, typical_p[r], mass_margin, score_margin, lowest, out, scratch)

    @numba.njit(cache=True, nogil=True)
    def count_at_least(x, value, out):    # pragma: no cover - runs compiled
        # the reference's (x >= value).sum(): a comparison per entry (NaN never counts),
        # summed in integers, which vectorises without reordering any float arithmetic
        n, V = x.shape
        for r in range(n):
            v = value[r]
            row = x[r]
            c = 0
            for j in range(V):
                c += np.int64(row[j] >= v)
            out[r] = c

    span = 128                            # tokens per group of top_and_rank

    @numba.njit(inline="always")
    def insert_larger(row, start, stop, ids, values, r, filled, floor):  # pragma: no cover
        # row[start:stop] into the W largest kept in values[r, 1:] (value descending, then id
        # ascending: a value displaces only a smaller one and joins behind its equals)
        W = ids.shape[1] - 1
        for j in range(start, stop):
            y = row[j]
            if filled == W and not y > floor:
                continue
            q = 1
            while q <= filled and values[r, q] >= y:
                q += 1
            e = min(filled + 1, W)
            while e > q:
                values[r, e], ids[r, e] = values[r, e - 1], ids[r, e - 1]
                e -= 1
            values[r, q], ids[r, q] = y, j
            filled = min(filled + 1, W)
            if filled == W:
                floor = values[r, W]
        return filled, floor

    @numba.njit(cache=True, nogil=True)
    def top_and_rank(x, tokens, ids, values, ranks):  # pragma: no cover - compiled
        # one pass per row for step 15: the rank count (x >= sampled, as the reference's
        # comparison) and the W largest values (``insert_larger``). Each group of ``span``
        # tokens is counted first (integer sums of comparisons, which vectorise) and read
        # again for the insertions only when a value in it passes the W-th found so far.
        # False (the torch path answers) where a row holds a NaN (the count of x == x falls
        # short) or a sampled id is past V. The groups are whole ``span``s indexed from a
        # counter, then the tail: with a size known only at run time, or a range stepping by
        # it, the counting loop ran 2.5x slower.
        n, V = x.shape
        W = ids.shape[1] - 1
        full = V // span
        for r in range(n):
            row = x[r]
            t = max(tokens[r], 0)
            if t >= V:
                return False
            v = row[t]
            ids[r, 0], values[r, 0] = t, v
            filled, count = 0, 0
            floor = np.float32(-np.inf)
            for g in range(full):
                start = g * span
                at_least, above, numbers = np.int32(0), np.int32(0), np.int32(0)
                for j in range(span):
                    y = row[start + j]
                    at_least += np.int32(y >= v)
                    above += np.int32(y > floor)
                    numbers += np.int32(y == y)
                if numbers < span:
                    return False
                count += at_least
                if W > 0 and (filled < W or above > 0):
                    filled, floor = insert_larger(row, start, start + span, ids, values, r, filled, floor)
            for j in range(full * span, V):
                y = row[j]
                if y != y:
                    return False
                count += np.int64(y >= v)
            if W > 0:
                filled, floor = insert_larger(row, full * span, V, ids, values, r, filled, floor)
            ranks[r] = count
        return True

    return dict(bucket_mass=bucket_mass, band_indices=band_indices, top_group_values=top_group_values,
                key_prefixes=key_prefixes,
                count_at_least=count_at_least, top_and_rank=top_and_rank,
                candidate_typical=candidate_typical,
                first_max_at=first_max_at, first_max_at_by_address=first_max_at_by_address,
                group_maxima_by_address=group_maxima_by_address, candidate_chain_by_address=candidate_chain_by_address,
                min_p_chain=min_p_chain,
                seeded_race_winners=seeded_race_winners, unseeded_race_winners=unseeded_race_winners,
                seeded_race_candidates_by_address=seeded_race_candidates_by_address,
                seeded_candidates_settled=seeded_candidates_settled,
                group_top_k=group_top_k, candidate_chain=candidate_chain,
                candidate_min_p=candidate_min_p, collect_above=collect_above,
                whole_rows=whole_rows, per_row_ids=per_row_ids, inverse_cdf=inverse_cdf,
                mixed_keys=mixed_keys, positive_ids=positive_ids,
                candidate_top_k=candidate_top_k, candidate_top_p=candidate_top_p, smooth=smooth,
                adaptive=adaptive,
                tfs_second=tfs_second, tfs_index=tfs_index, pack_above=pack_above)
