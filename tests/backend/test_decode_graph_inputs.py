"""The decode CUDA graphs' input buffer: layout, staging of a step in one copy, padding, fill.

The graphs themselves need a GPU (tests/gpu runs them); the input buffer and its staging are plain
tensor code and run here on CPU tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.cuda_graphs import DecodeGraphs
from backend.staging import StagingBuffer

FIELDS = ("input_ids", "positions", "slot_mapping", "fill_src", "seq_lens", "block_tables")


@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
def test_fields_are_disjoint_aligned_views_of_one_buffer(max_batch_size):
    graphs = DecodeGraphs(None, torch.empty(1), max_batch_size, max_seq_len=100, tokens_per_block=16)
    spans = []
    for name in FIELDS:
        field = getattr(graphs, name)
        assert field.shape[0] == max_batch_size
        start = field.data_ptr() - graphs.buffer.data_ptr()
        assert start % 16 == 0 and start == graphs.offsets[name]
        spans.append((start, start + field.numel() * field.element_size()))
    assert graphs.block_tables.shape == (max_batch_size, 7)            # ceil(100 / 16) blocks
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= graphs.buffer.numel()
    assert (graphs.slot_mapping == -1).all() and (graphs.fill_src == -1).all()


def test_stage_pads_to_the_graph_size_and_fill_takes_previous_ids():
    graphs = DecodeGraphs(None, torch.empty(1), 8, max_seq_len=100, tokens_per_block=16)
    staging = StagingBuffer(torch.device("cpu"))
    wide = np.array([[4, 5, 6], [7, 0, 0], [8, 9, 0]], dtype=np.int64)
    graphs.stage(staging, np.array([1, 2, 3]), np.array([40, 20, 35]), np.array([70, 112, 130]),
                 np.array([41, 21, 36]), wide, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert graphs.fill_src[:4].tolist() == [-1] * 4
    # A later, narrower step of 3 rows: padded to the graph of 4; the old columns are cleared.
    # Rows 0 and 2 take their input ids from the previous step's sampled ids.
    prev = torch.tensor([500, 600])
    ids, positions, meta = graphs.stage(
        staging, np.array([-1, 12, -1]), np.array([41, 21, 36]), np.array([71, 113, 131]),
        np.array([42, 22, 37]), np.array([[4, 5], [7, 0], [8, 9]]), np.array([0, 2]), np.array([1, 0]), prev)
    assert graphs.size_for(3) == 4
    assert ids.tolist() == [-1, 12, -1] and positions.tolist() == [41, 21, 36]
    assert graphs.slot_mapping[:4].tolist() == [71, 113, 131, -1]       # padded row: no KV write
    assert graphs.seq_lens[:4].tolist() == [42, 22, 37, 0]              # padded row: no context
    assert graphs.block_tables[:4, :3].tolist() == [[4, 5, 0], [7, 0, 0], [8, 9, 0], [0, 0, 0]]
    assert meta.seq_lens.tolist() == [42, 22, 37] and meta.max_seq_len == 42
    assert meta.block_tables.tolist() == [[4, 5], [7, 0], [8, 9]]
    # The graph's first kernel fills rows 0 and 2 from the previous ids, copied into its buffer.
    assert graphs.fill_src[:4].tolist() == [1, -1, 0, -1]
    assert graphs.sampled_ids[:2].tolist() == [500, 600]
    # Ids a graph replay left in its buffer are used in place (nothing copied).
    graphs.sampled_ids[:2] = torch.tensor([9, 8])
    graphs.stage(staging, np.array([-1]), np.array([5]), np.array([6]), np.array([6]), np.array([[1]]),
                 np.array([0]), np.array([1]), graphs.sampled_ids[:2])
    assert graphs.fill_src[:1].tolist() == [1] and graphs.sampled_ids[:2].tolist() == [9, 8]
    # A step without placeholders clears the previous step's fill rows.
    graphs.stage(staging, np.array([3, 4]), np.array([5, 6]), np.array([6, 7]), np.array([6, 7]),
                 np.array([[1], [2]]), np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert graphs.fill_src[:2].tolist() == [-1, -1]
