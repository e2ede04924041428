"""Seeded permutations of ``[0, n)`` evaluated one index at a time, in constant memory.

A balanced Feistel network over the smallest even number of bits that covers ``n`` is a bijection
of ``[0, 2**bits)``; walking the cycle (encrypting again while the value is ``>= n``) restricts it to
a bijection of ``[0, n)``. The domain is less than four times ``n``, so a lookup takes fewer than
four walks on average. Nothing is materialized: a corpus of a billion windows costs the same
memory as one of a thousand, and the inverse is as cheap as the permutation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

_ROUNDS = 6
_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64's finalizer: a fast 64-bit mixer whose output bits each depend on every input bit."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class FeistelPermutation:
    """A bijection of ``[0, n)`` chosen by ``key`` (any sequence of integers, e.g. ``(seed, epoch)``)."""

    def __init__(self, n: int, key: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got n={n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._half = (bits + 1) // 2
        self._mask = (1 << self._half) - 1
        digest = hashlib.blake2b(repr((n, tuple(int(k) for k in key))).encode(), digest_size=8 * _ROUNDS).digest()
        self._round_keys = [int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(_ROUNDS)]

    def __call__(self, index: int) -> int:
        """The image of ``index``."""
        return self._walk(index, self._encrypt)

    def inverse(self, value: int) -> int:
        """The index whose image is ``value``."""
        return self._walk(value, self._decrypt)

    def _walk(self, start: int, step: Callable[[int], int]) -> int:
        """Apply ``step`` until the value is back inside ``[0, n)`` (the cycle walk)."""
        if not 0 <= start < self.n:
            raise IndexError(f"{start} is outside [0, {self.n})")
        value = step(start)
        while value >= self.n:
            value = step(value)
        return value

    def _encrypt(self, value: int) -> int:
        left, right = value >> self._half, value & self._mask
        for key in self._round_keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._mask)
        return (left << self._half) | right

    def _decrypt(self, value: int) -> int:
        left, right = value >> self._half, value & self._mask
        for key in reversed(self._round_keys):
            left, right = right ^ (_mix64(left ^ key) & self._mask), left
        return (left << self._half) | right
