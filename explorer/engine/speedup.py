"""Expected tokens per target call and expected speedup of a chain or a tree of draft tokens, from acceptance and
cost (plain arithmetic, no torch): Leviathan et al. 2023, Theorem 3.8, for a chain of gamma draft tokens with i.i.d.
acceptance alpha, ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))`` at cost ratio c (a draft forward over a
target forward); for a tree, the expected tokens of its shape (``widths``: candidates per parent at each level) where
each candidate is accepted with probability alpha independently, as MCSD's analysis treats its k candidates (Yang et
al. 2024). The engine's early-exit chooser weighs exits with them; the classroom's race draws them."""

from __future__ import annotations


def expected_tokens(alpha: float, widths: list[float]) -> float:
    """Expected tokens per target call (accepted draft tokens plus the bonus token) of a draft tree with
    ``widths[l]`` candidates per parent at level ``l + 1`` (floats allowed: a mean shape), each candidate accepted
    with probability ``alpha`` (0..1) independently of the others: ``1 + sum_l prod_{j<=l} (1 - (1 - alpha)^w_j)``.
    A chain (every width 1) gives Leviathan et al.'s ``(1 - alpha^(gamma+1)) / (1 - alpha)``."""
    tokens, reach = 1.0, 1.0
    for width in widths:
        reach *= 1.0 - (1.0 - alpha) ** width
        tokens += reach
    return tokens


def tree_speedup(alpha: float, widths: list[float], c: float) -> float:
    """Expected speedup over plain decoding of a tree with ``widths`` per level (``expected_tokens``) at cost ratio
    ``c`` (a draft forward over a target forward; one draft forward per level, the tree verified in one target
    forward costed as one plain target forward)."""
    return expected_tokens(alpha, widths) / (len(widths) * c + 1)


def chain_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup of a chain of ``gamma`` draft tokens, i.i.d. acceptance ``alpha`` (0..1), cost ratio ``c``
    (a draft forward over a target forward): Leviathan et al. 2023, Theorem 3.8."""
    return tree_speedup(alpha, [1] * gamma, c)


def fitted_alpha(widths: list[float], accepted_per_step: float) -> float:
    """The per-candidate acceptance under which a tree of ``widths`` accepts ``accepted_per_step`` draft tokens per
    step on average (``expected_tokens`` is increasing in alpha: bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, widths) - 1 < accepted_per_step else (lo, mid)
    return (lo + hi) / 2


def interpolate_ms(points: dict, rows: int) -> float:
    """A forward's milliseconds at ``rows`` query rows from measurements ``{rows: ms}`` (non-empty, rows >= 1):
    linear between measured row counts, flat below the smallest (small forwards are latency bound), and past the
    largest the last segment's slope, clamped at >= 0 so that noise never makes a wider forward cheaper."""
    measured = {int(r): float(ms) for r, ms in points.items()}  # keys may be strings (a trace read back from JSON)
    xs = sorted(measured)
    ys = [measured[r] for r in xs]
    if rows <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if rows <= x1:
            return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) if len(xs) > 1 else 0.0
    return ys[-1] + slope * (rows - xs[-1])


__all__ = ["chain_speedup", "expected_tokens", "fitted_alpha", "interpolate_ms", "tree_speedup"]
