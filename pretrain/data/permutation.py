"""A keyed permutation of [0, n) computed element by element: constant memory whatever n is.

The training stream's order (``pretrain/data/loader.py``) was a numpy permutation of the whole epoch on every rank:
3.7e9 rows (15T tokens of 4,096-token rows) is 14.6 GB per rank and minutes of shuffling at every start, resume and
epoch. This is the alternative the large loaders use (Grain's ``index_shuffle``, the Feistel shuffles of JAX and
TensorFlow's data services): a bijection of [0, n) that maps one position to its row, and one row back to its
position, in O(1) time and memory.

A balanced Feistel network over ``2 x half_bits`` bits (the smallest even width >= n's, so the domain is
``4**half_bits``, less than 4n) is a bijection of that domain for any round function; restricted to [0, n) by
cycle walking (apply it again while the value is >= n: the walk stays on the cycle of the start, which comes back
below n) it is a bijection of [0, n) (Black and Rogaway, "Ciphers with arbitrary finite domains", 2002). Six rounds of
a 64-bit mixer (splitmix64's finaliser) keyed by numpy's ``SeedSequence`` make positions that are close map to rows
that are not (measured in tests/data/test_permutation.py). Every operation is uint64 numpy arithmetic, so a whole
global batch is one vectorised call, and the same on every platform, process and world size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROUNDS = 6
MAX_ROWS = 1 << 62  # 2 x half_bits <= 62: L << half_bits and the mixer stay within uint64
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose output bits each depend on every input bit."""
    z = z ^ (z >> np.uint64(30))
    z = z * _MIX1
    z = z ^ (z >> np.uint64(27))
    z = z * _MIX2
    return z ^ (z >> np.uint64(31))


def derived_keys(keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Round keys [ROUNDS, len(index)] of a family of permutations, one per ``index`` (a step's shuffle): each a
    hash of the family's keys and the index, so a million steps' permutations cost no more than their use."""
    index = np.asarray(index, dtype=np.uint64)
    with np.errstate(over="ignore"):
        salt = mix64(index * _GOLDEN + _GOLDEN)
        return mix64(keys[:, None] ^ salt[None, :])


class KeyedPermutation:
    """Rows [0, n) in the order of the key ``seed`` (a list of ints, as numpy's ``SeedSequence`` takes them):
    ``self(positions)`` is the rows at those positions, ``self.inverse(rows)`` their positions. ``shuffle=False`` is
    the identity. ``keys`` (instead of ``seed``): round keys [ROUNDS] or [ROUNDS, len(positions)] (``derived_keys``:
    one permutation per element)."""

    def __init__(self, n: int, seed: Sequence[int] = (), shuffle: bool = True, keys: np.ndarray | None = None):
        if not 0 < n <= MAX_ROWS:
            raise ValueError(f"a keyed permutation needs 1 <= n <= 2**62 rows, not {n}")
        self.n, self.shuffle = int(n), shuffle
        self.half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self._shift = np.uint64(self.half_bits)
        self._mask = np.uint64((1 << self.half_bits) - 1)
        if keys is None:
            keys = np.random.SeedSequence([int(s) for s in seed]).generate_state(ROUNDS, dtype=np.uint64)
        self.keys = keys if keys.ndim == 2 else keys[:, None]

    def _round(self, half: np.ndarray, key: np.ndarray) -> np.ndarray:
        return mix64(half ^ key) & self._mask

    def _keys_of(self, selected: np.ndarray | None) -> np.ndarray:
        """The round keys of the elements still walking (per-element keys follow their elements)."""
        return self.keys if self.keys.shape[1] == 1 or selected is None else self.keys[:, selected]

    def _feistel(self, x: np.ndarray, keys: np.ndarray, inverse: bool) -> np.ndarray:
        left, right = x >> self._shift, x & self._mask
        with np.errstate(over="ignore"):
            if inverse:
                for key in keys[::-1]:
                    left, right = right ^ self._round(left, key), left
            else:
                for key in keys:
                    left, right = right, left ^ self._round(right, key)
        return (left << self._shift) | right

    def _walk(self, values, inverse: bool) -> np.ndarray:
        x = np.asarray(values, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions of a permutation of {self.n} rows must be in [0, {self.n})")
        if not self.shuffle:
            return x.copy()
        flat = x.astype(np.uint64).reshape(-1)
        out = self._feistel(flat, self._keys_of(None), inverse)
        todo = np.flatnonzero(out >= np.uint64(self.n))
        while todo.size:  # cycle walking: below 4 rounds of the network per element on average (the domain < 4n)
            out[todo] = self._feistel(out[todo], self._keys_of(todo), inverse)
            todo = todo[out[todo] >= np.uint64(self.n)]
        return out.astype(np.int64).reshape(x.shape)

    def __call__(self, positions) -> np.ndarray:
        """The rows at ``positions`` (int64, the shape of ``positions``)."""
        return self._walk(positions, inverse=False)

    def inverse(self, rows) -> np.ndarray:
        """The positions of ``rows``: ``self.inverse(self(p)) == p``."""
        return self._walk(rows, inverse=True)
