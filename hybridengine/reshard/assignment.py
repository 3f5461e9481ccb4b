"""The assignment problem: n workers to n jobs, one each, at the largest total value (Kuhn-Munkres).

Pure and exact, O(n^3) with potentials (the shortest-augmenting-path form). The expert plan uses it to
place experts on generation ranks where the ranks already hold the most of them; its matrices are small
(one row per block of interchangeable experts), so Python is fast enough and no solver is needed.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["max_value_assignment"]


def max_value_assignment(values: Sequence[Sequence[float]]) -> list[int]:
    """``job[w]`` for every worker ``w`` of a square ``values[w][j]`` matrix, maximizing sum(values[w][job[w]]).

    The identity (worker w on job w) is returned whenever it is among the best, so a caller's natural order
    stays where nothing is gained by leaving it. Exact for integer values.
    """
    n = len(values)
    if any(len(row) != n for row in values):
        raise ValueError(f"the value matrix must be square; got {n} rows of lengths {sorted({len(r) for r in values})}")
    if n == 0:
        return []
    top = max(max(row) for row in values)
    cost = [[top - v for v in row] for row in values]  # minimize cost = maximize value
    inf = float("inf")
    u, v = [0.0] * (n + 1), [0.0] * (n + 1)  # potentials of workers (1-based) and jobs
    owner = [0] * (n + 1)  # owner[j]: the worker on job j (0: none)
    for w in range(1, n + 1):
        owner[0], j0 = w, 0
        least, way, used = [inf] * (n + 1), [0] * (n + 1), [False] * (n + 1)
        while owner[j0]:
            used[j0] = True
            i0, delta, j1 = owner[j0], inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    reduced = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if reduced < least[j]:
                        least[j], way[j] = reduced, j0
                    if least[j] < delta:
                        delta, j1 = least[j], j
            for j in range(n + 1):
                if used[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    least[j] -= delta
            j0 = j1
        while j0:
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    job = [0] * n
    for j in range(1, n + 1):
        job[owner[j] - 1] = j - 1
    if sum(values[w][w] for w in range(n)) >= sum(values[w][job[w]] for w in range(n)):
        return list(range(n))
    return job
