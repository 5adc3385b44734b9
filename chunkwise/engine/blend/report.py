"""The `chunk_reuse` report of a blended prefill: per piece, the tokens exact (below c0), recomputed (computed at
every layer) and blended (the rest: placed K/V at some layer)."""
from __future__ import annotations

import numpy as np

from chunkwise.chunks import ChunkReuse, Piece
from chunkwise.engine.blend.planning import BlendJob


def blend_report(job: BlendJob, pieces: tuple[Piece, ...], first_row: int, kept: np.ndarray) -> tuple[ChunkReuse, ...]:
    """ChunkReuse per piece: exact below c0; recomputed = the rows computed at every layer (the job's computed rows,
    from the step's `first_row` on in its layer-0 layout, that are in `kept`, the rows of the last layer); blended =
    the rest; `context`: the piece's variant (chunkwise/chunks.py)."""
    computed = job.rows.computed
    full = computed.copy()
    rows0 = first_row + np.cumsum(computed) - 1        # each computed row's layer-0 row
    marked = np.zeros(max(int(rows0[-1]) + 1 if len(rows0) else 0, int(kept.max(initial=-1)) + 1), bool)
    marked[kept] = True
    full[computed] = marked[rows0[computed]]
    per_piece = np.bincount(job.piece_rows[full], minlength=len(pieces))
    out, first = [], 0
    for j, p in enumerate(pieces):
        exact = max(0, min(first + p.num_tokens, job.start) - first)
        recomputed = int(per_piece[j])
        out.append(ChunkReuse(p.chunk, p.num_tokens, exact, p.num_tokens - exact - recomputed, recomputed,
                              None if p.chunk is None else p.context))
        first += p.num_tokens
    return tuple(out)
