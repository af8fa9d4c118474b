"""The decode CUDA graphs' inputs and outputs: the buffer layout, staging into the host ring, the
first kernel's copy and in-flight input fill, the ids written back to the ring, and slot reuse.

Capturing graphs needs a GPU (tests/gpu runs them). Everything a graph does also runs eagerly
(`DecodeGraphs.replay` before `capture`), so it is tested here on CPU tensors, with the kernels
under the Triton interpreter; on a GPU the same tests run with the ring in pinned memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.config import EngineConfig  # noqa: E402
from backend.kernels.argmax import argmax_rows  # noqa: E402
from backend.request import Chunk  # noqa: E402
from backend.runner.decode_graphs import DecodeGraphs  # noqa: E402
from backend.runner.model_runner import ModelRunner  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpretable_triton_language")
FIELDS = (
    "input_ids",
    "in_flight_rows",
    "positions",
    "slot_mapping",
    "seq_lens",
    "banned_ids",
    "block_tables",
)


def empty_graphs(max_batch_size: int, max_seq_len: int = 100) -> DecodeGraphs:
    return DecodeGraphs(
        None, torch.empty(1, device=DEVICE), max_batch_size, max_seq_len, tokens_per_block=16
    )


@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
def test_fields_are_disjoint_aligned_views_of_one_buffer_mirrored_by_each_host_slot(max_batch_size):
    graphs = empty_graphs(max_batch_size)
    spans = []
    for name in FIELDS:
        field = getattr(graphs, name)
        assert field.shape[0] == max_batch_size
        start = field.data_ptr() - graphs.buffer.data_ptr()
        assert start % 16 == 0 and start == graphs.offsets[name]
        spans.append((start, start + field.numel() * field.element_size()))
        for slot in (0, 1):
            host = graphs.host_fields[slot][name]
            assert host.ctypes.data - graphs.host_ring[slot].data_ptr() == start
            assert host.shape == tuple(field.shape)
    assert graphs.block_tables.shape == (max_batch_size, 7)  # ceil(100 / 16) blocks
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= graphs.buffer.numel() == graphs.host_ring.shape[1]
    assert graphs.host_ring.is_pinned() == (DEVICE == "cuda")


def test_first_kernel_copies_the_staged_slot_pads_and_fills_in_flight_inputs():
    graphs = empty_graphs(8)
    wide = np.array([[4, 5, 6], [7, 0, 0], [8, 9, 0]], dtype=np.int64)
    graphs.stage(
        np.array([1, 2, 3]),
        np.array([40, 20, 35]),
        np.array([70, 112, 130]),
        np.array([41, 21, 36]),
        wide,
    )
    graphs.load_inputs(4)
    assert graphs.input_ids[:4].tolist() == [1, 2, 3, 0]
    assert graphs.block_tables[:4, :3].tolist() == [[4, 5, 6], [7, 0, 0], [8, 9, 0], [0, 0, 0]]
    # The replay's argmax writes its ids into the same slot and moves on to the other one.
    logits = torch.zeros(4, 5, device=DEVICE)
    logits[torch.arange(4), torch.tensor([3, 1, 4, 2])] = 1.0
    argmax_rows(
        logits,
        out=graphs.sampled_ids[:4],
        to_host=(graphs.sampled_ring, graphs.slot, graphs.replays),
    )
    assert graphs.sampled_ring[0, :4].tolist() == [3, 1, 4, 2] and graphs.replays.item() == 1
    graphs._replayed += 1  # what `replay` counts on the host
    # The next step of 3 rows goes to slot 1 and is padded to the graph of 4; of the block tables
    # only its own 2 columns travel (the third, past every context, keeps what the previous step
    # left: never read). Rows 0 and 2 are in flight: the ids just sampled, rows 1 and 0.
    graphs.stage(
        np.array([0, 12, 0]),
        np.array([41, 21, 36]),
        np.array([71, 113, 131]),
        np.array([42, 22, 37]),
        np.array([[4, 5], [7, 0], [8, 9]]),
        np.array([1, -1, 0]),
        graphs.sampled_ids[:4],
    )
    assert graphs.host_fields[0]["positions"][:3].tolist() == [40, 20, 35]  # slot 0 untouched
    graphs.load_inputs(4)
    assert graphs.slot.item() == 1
    assert graphs.input_ids[:4].tolist() == [1, 12, 3, 0]  # sampled[1], 12, sampled[0]
    assert graphs.positions[:4].tolist() == [41, 21, 36, 0]
    assert graphs.slot_mapping[:4].tolist() == [71, 113, 131, -1]  # padded row: no KV write
    assert graphs.seq_lens[:4].tolist() == [42, 22, 37, 0]  # padded row: no context
    assert graphs.block_tables[:4, :2].tolist() == [[4, 5], [7, 0], [8, 9], [0, 0]]
    assert graphs.block_tables[:4, 2].tolist() == [6, 0, 0, 0]
    assert graphs.block_tables[:4, 3:].count_nonzero() == 0  # never written


def test_previous_ids_from_elsewhere_are_copied_into_the_graphs_buffer():
    graphs = empty_graphs(2)
    prev = torch.tensor([500, 600], device=DEVICE)
    graphs.stage(
        np.array([0]),
        np.array([5]),
        np.array([6]),
        np.array([6]),
        np.array([[1]]),
        np.array([1]),
        prev,
    )
    assert graphs.sampled_ids.tolist() == [500, 600]
    graphs.load_inputs(1)
    assert graphs.input_ids[:1].tolist() == [600]


def test_only_the_graphs_rows_are_copied():
    graphs = empty_graphs(4)
    graphs.stage(
        np.array([1, 2, 3, 4]), np.arange(4), np.arange(4), np.arange(4) + 1, np.array([[9]] * 4)
    )
    graphs.load_inputs(1)  # the graph of one row: one row of its table
    assert graphs.block_tables[:, 0].tolist() == [9, 0, 0, 0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_eager_replays_alternate_slots_and_match_the_runner(tiny_hf_model, kv_cache_dtype):
    """Decode steps through `replay` (the graph's work, eagerly) give the runner's own greedy
    ids, with in-flight inputs filled on the device and ids read back from the ring; a slot's ids
    are kept when the slot is staged again before they were read. A quantized cache's scales
    reach the graph's forward."""
    _, path = tiny_hf_model("llama")
    runner = ModelRunner(
        EngineConfig(
            model_path=str(path),
            device=DEVICE,
            tokens_per_block=4,
            max_batch_size=2,
            cuda_graphs=False,
            attention_backend="torch",
            kv_cache_dtype=kv_cache_dtype,
        )
    )
    graphs = DecodeGraphs(
        runner.model, runner.kv_cache, 2, runner.max_seq_len, 4, kv_scales=runner.kv_scales
    )
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    blocks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    with torch.inference_mode():
        first = runner.execute([Chunk.of_sequence(p, b) for p, b in zip(prompts, blocks)])
    tokens = [[int(t)] for t in first.logits.argmax(-1)]
    pending, prev = [], first.logits.argmax(-1)
    for step in range(5):  # inputs are in flight: the graph fills them from `prev`
        lens = np.array([len(p) + step + 1 for p in prompts])
        with torch.inference_mode():
            graphs.stage(
                np.array([0, 0]),
                lens - 1,
                np.array([b[(n - 1) // 4] * 4 + (n - 1) % 4 for b, n in zip(blocks, lens)]),
                lens,
                np.array(blocks),
                np.array([0, 1]),
                prev,
            )
            _, prev, ids = graphs.replay(2)
        pending.append(ids)
    for ids in pending:  # read late: all but the last two were kept when restaged
        for row, token in enumerate(ids.result()):
            tokens[row].append(token)
    for row, prompt in enumerate(prompts):  # the runner's own eager decode, token by token
        seq = prompt + tokens[row][:1]
        for step in range(5):
            own_blocks = [10 + row * 4 + i for i in range(4)]
            chunk = Chunk.of_sequence(seq, own_blocks, len(seq) - 1)
            if step == 0:
                with torch.inference_mode():
                    runner.execute([Chunk.of_sequence(seq[:-1], own_blocks, samples=False)])
            with torch.inference_mode():
                seq.append(int(runner.execute([chunk]).logits.argmax(-1)[0]))
        assert tokens[row] == seq[len(prompt) :]


def test_staged_bans_reach_the_graphs_argmax_and_clear_on_the_next_step():
    graphs = DecodeGraphs(
        None, torch.empty(1, device=DEVICE), 4, 100, tokens_per_block=16, max_banned=2
    )
    logits = torch.zeros(3, 6, device=DEVICE)
    logits[:, 5], logits[:, 4], logits[:, 3] = 3.0, 2.0, 1.0  # every row: 5, then 4, then 3
    step = (
        np.array([1, 2, 3]),
        np.array([4, 5, 6]),
        np.array([4, 5, 6]),
        np.array([5, 6, 7]),
        np.array([[1], [2], [3]]),
    )
    graphs.stage(*step, banned_ids=np.array([[5, -1], [5, 4], [-1, -1]]))
    graphs.load_inputs(3)
    assert graphs.banned_ids[:3].tolist() == [[5, -1], [5, 4], [-1, -1]]
    ids = argmax_rows(logits, out=graphs.sampled_ids[:3], banned=graphs.banned_ids[:3])
    assert ids.tolist() == [4, 3, 5]
    graphs._replayed += 1
    graphs.stage(*step)  # no bans this step: the staged slot says so
    graphs.replays.fill_(1)
    graphs.load_inputs(3)
    assert graphs.banned_ids[:3].tolist() == [[-1, -1]] * 3


def test_graph_steps_of_a_model_with_two_kv_cache_groups_match_eager_steps(tmp_path):
    """A Gemma 3 with five local layers (window 8) and one global: decode steps staged into the
    graphs' buffer (each group's slots and block tables, rows g * n ..) and replayed give the
    eager engine's tokens, which are transformers' (the local group's blocks past the window are
    freed meanwhile)."""
    from backend.engine.executor import Executor
    from backend.sampling_params import SamplingParams
    from tests.hf_reference import hf_greedy
    from tests.tiny_models import random_prompts, save_tiny_hf_model

    hf = save_tiny_hf_model(tmp_path, "gemma3_text", sliding_window=8)
    prompts = random_prompts(2, 640, seed=12, low=20, high=30)
    params = SamplingParams(max_tokens=12, ignore_end_id=True)
    results = []
    for graphs in (False, True):
        config = EngineConfig(
            model_path=str(tmp_path),
            device=DEVICE,
            dtype="float32",
            tokens_per_block=4,
            max_batch_size=2,
            cuda_graphs=False,
            attention_backend="torch",
        )
        runner = ModelRunner(config)
        assert len(runner.kv_group_blocks) == 2
        staged = DecodeGraphs(
            runner.model, runner.kv_cache, 2, runner.max_seq_len, 4, num_kv_groups=2
        )
        if graphs:  # not captured: `replay` runs the graph's work eagerly
            runner.decode_graphs = staged
        executor = Executor(config, runner=runner)
        try:
            results.append([r["token_ids"] for r in executor.generate(prompts, params)])
            assert executor.stats().kv.free_blocks == executor.stats().kv.max_blocks
        finally:
            executor.shutdown()
        assert staged._replayed == (11 if graphs else 0)  # every decode step
    assert results[0] == results[1] == [hf_greedy(hf, p, 12)[0] for p in prompts]


class StagedGraphsRunner(ModelRunner):
    """Decode graphs on CPU, not captured: every rank (workers are started with this class)
    stages its decode steps into the graphs' buffer and runs their work eagerly."""

    def _capture_decode_graphs(self) -> DecodeGraphs:
        return self.new_decode_graphs()


@pytest.mark.parametrize(
    "kind, options",
    [("qwen2", {}), ("gemma3_text", {"sliding_window": 8})],  # one KV cache group; two
)
def test_graph_steps_on_two_ranks_give_one_ranks_tokens(kind, options, tmp_path, monkeypatch):
    """Tensor parallel with decode graphs: rank 0 sends each step it replays to the worker, which
    stages and replays the same step (its collectives pair with rank 0's), the in-flight inputs
    taken from the worker's own graphs' argmax while rank 0's are its graphs' (greedy steps, a
    min-tokens ban sent along) and broadcast from rank 0 while a seeded sample is in the batch:
    one rank's tokens. Gemma 3 with local and global layers sends each KV cache group's slots
    and block tables."""
    from backend.engine.executor import Executor
    from backend.sampling_params import SamplingParams
    from tests.tiny_models import random_prompts, save_tiny_hf_model

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned worker's threads
    save_tiny_hf_model(tmp_path, model_type=kind, **options)
    prompts = random_prompts(3, 640, seed=5, low=10, high=40)
    params = [
        SamplingParams(max_tokens=24, ignore_end_id=True),
        SamplingParams(max_tokens=8, ignore_end_id=True, temperature=0.9, top_k=50, seed=11),
        SamplingParams(max_tokens=20, min_tokens=20),
    ]
    results, replays = [], []
    for tp in (1, 2):
        config = EngineConfig(
            model_path=str(tmp_path),
            device=DEVICE,
            dtype="float32",
            tokens_per_block=4,
            max_batch_size=3,
            # the graphs' attention (the torch reference reads the host lengths a graph was
            # built with, not the step's)
            attention_backend="triton",
            tensor_parallel_size=tp,
            overlap_scheduling=True,
        )
        runner = (StagedGraphsRunner if tp > 1 else ModelRunner)(config)
        executor = Executor(config, runner=runner)
        try:
            results.append(executor.generate(prompts, params, timeout=600))
            replays.append(runner.decode_graphs._replayed if runner.decode_graphs else 0)
        finally:
            executor.shutdown()
            runner.release()  # the caller's runner: it stops its worker
    one, two = results
    for a, b in zip(one, two):
        assert b["error"] is None and b["token_ids"] == a["token_ids"]
    assert [len(r["token_ids"]) for r in two] == [24, 8, 20]
    assert replays[1] >= 19  # the decode steps ran in the graphs
