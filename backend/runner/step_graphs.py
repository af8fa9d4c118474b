"""Which CUDA graphs a runner keeps, and the graphs built over its model and KV cache.

Decode-only steps replay `DecodeGraphs`; steps with prompt tokens up to `cuda_graph_max_tokens`
replay `MixedGraphs`. Both need the GPU and the Triton kernels (they skip padded rows; the torch
reference does not). Rank 0 of a tensor-parallel group runs prompt steps eagerly: its workers
follow eager steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.distributed.tp_workers import GraphStep
from backend.request import Chunk
from backend.runner.decode_graphs import DecodeGraphs
from backend.runner.mixed_graphs import MixedGraphs
from backend.runner.step_inputs import StepInputs
from backend.runner.step_packing import PackedStep

if TYPE_CHECKING:
    from backend.runner.model_runner import ModelRunner


def takes_decode_graphs(runner: ModelRunner) -> bool:
    return bool(
        runner.config.cuda_graphs
        and runner.device.type == "cuda"
        and runner.attention.name == "triton"
    )


def takes_mixed_graphs(runner: ModelRunner) -> bool:
    return bool(
        takes_decode_graphs(runner)
        and runner.config.cuda_graph_max_tokens
        and not runner.tp.enabled
    )


def decode_graphs_over(runner: ModelRunner) -> DecodeGraphs:
    """Decode graphs over the runner's model and KV cache, not captured (until `capture`, a
    replay runs their work eagerly)."""
    return DecodeGraphs(
        runner.model,
        runner.kv_cache,
        runner.config.max_batch_size,
        runner.max_seq_len,
        runner.tokens_per_block,
        max_banned=max(1, len(runner.eos_token_ids)),
        kv_scales=runner.kv_scales,
        num_kv_groups=len(runner.kv_group_blocks),
    )


def mixed_graphs_over(runner: ModelRunner) -> MixedGraphs:
    """Mixed-step graphs over the runner's model and KV cache, not captured."""
    config = runner.config
    return MixedGraphs(
        runner.model,
        runner.kv_cache,
        config.max_batch_size,
        min(config.cuda_graph_max_tokens, config.max_num_tokens),
        runner.max_seq_len,
        runner.tokens_per_block,
        kv_scales=runner.kv_scales,
        num_kv_groups=len(runner.kv_group_blocks),
    )


def eager_warm_up_chunks(tokens_per_block: int, num_kv_blocks: int) -> list[Chunk] | None:
    """A prompt chunk beside a decode, on blocks no request holds yet (None when the pool is too
    small): the eager path's kernels compile on it, not in a served step."""
    n = 2 * tokens_per_block + 3
    per_chunk = -(-n // tokens_per_block)
    if num_kv_blocks < 2 * per_chunk:
        return None
    prompt = Chunk.of_sequence([0] * n, list(range(per_chunk)))
    decode = Chunk.of_sequence([0] * n, list(range(per_chunk, 2 * per_chunk)), start=n - 1)
    return [prompt, decode]


def decode_graph_inputs(runner: ModelRunner, packed: PackedStep, in_flight_ids, banned_ids):
    """A decode step staged straight into the decode graphs' inputs (tensor parallel: and sent to
    the other ranks, who stage it into theirs)."""
    graphs, n, in_flight = runner.decode_graphs, len(packed.seq_lens), packed.in_flight
    # The graphs' own sampled ids are on every rank already; any other ids travel with the step.
    own = in_flight_ids is not None and in_flight_ids.data_ptr() == graphs.sampled_ids.data_ptr()
    step = GraphStep(
        packed.input_ids,
        packed.positions,
        packed.slots,
        packed.seq_lens,
        packed.block_tables,
        in_flight,
        banned_ids,
        ids_sent=in_flight is not None and not own,
    )
    meta = runner.stage_graph_step(step, in_flight_ids)
    if runner.sender is not None:
        runner.sender.send(step, previous_ids=graphs.sampled_ids)
    return StepInputs(
        graphs.input_ids[:n],
        graphs.positions[:n],
        meta,
        graphs.query_start_loc[:n],
        in_graph=True,
    )
