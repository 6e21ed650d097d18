"""The context-parallel sequence layout (engine/parallel/context_parallel.py): pure index arithmetic."""

from __future__ import annotations

import pytest
import torch

from oumi_megatron.engine.parallel.context_parallel import chunk_attention_bounds, local_positions


@pytest.mark.parametrize("cp", [2, 4])
def test_ranks_hold_load_balanced_chunks_that_cover_the_sequence(cp: int) -> None:
    seq = 8 * cp
    held = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))  # every position exactly once
    chunk = seq // (2 * cp)
    assert held[0].tolist() == [*range(chunk), *range(seq - chunk, seq)]  # chunk 0 and the last chunk
    # each rank's causal work (keys its queries see) is the same: chunk r sees (r+1) chunks, chunk 2cp-1-r sees 2cp-r
    work = [sum(keys for _, keys, _ in chunk_attention_bounds(2 * chunk, cp, r)) for r in range(cp)]
    assert len(set(work)) == 1


def test_query_chunks_see_keys_up_to_their_own_end() -> None:
    bounds = chunk_attention_bounds(local_len=6, size=2, rank=1)  # sequence 12, chunks of 3; rank 1 holds chunks 1 and 2
    assert bounds == [(slice(0, 3), 6, 3), (slice(3, 6), 9, 6)]
    with pytest.raises(ValueError, match="multiple of 2 x CP"):
        local_positions(10, 3, 0)
