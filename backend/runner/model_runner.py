"""The model runner: loads the model, owns the paged KV cache, runs one packed step.

The engine hands it the chunks scheduled this step (prefill chunks and decodes together); the
runner packs them into one batch (`backend.runner.step_packing`: token ids, positions, cache
slots, block tables), puts it on the device (`backend.runner.step_inputs`), runs the model and
returns logits for the chunks that sample, and the prompt log-probs of the requests that ask for
them (`backend.logprobs`: only then are other rows projected to the vocabulary). An in-flight
token's input id (overlap scheduling, `backend.engine.step`) is taken on the device from the
sampled ids of the step in flight. On GPU, decode-only steps replay CUDA graphs
(`backend.runner.decode_graphs`), and so do steps with prompt tokens of up to
`cuda_graph_max_tokens` (`backend.runner.mixed_graphs`); longer steps, those that compute
prompt log-probs, those with speculative drafts (one logits row per draft) and those with a row
under a LoRA adapter (`backend.lora`: the graphs hold the base model alone) run eagerly.

The KV cache's tensors and their sizing: `backend.runner.kv_cache_memory`; which CUDA graphs the
runner keeps: `backend.runner.step_graphs`.

Tensor parallel (`tensor_parallel_size` > 1, `backend.runner.tensor_parallel_steps`): this runner
is rank 0; it starts the other ranks, each a runner of its own shard that `follow`s the steps
rank 0 sends from `prepare`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from backend.attention import get_attention_backend
from backend.attention.kv_dtype import check_kv_dtype, storage_dtype
from backend.config import EngineConfig
from backend.distributed import tp_workers
from backend.distributed.tensor_parallel import TensorParallel, TensorParallelError, connect
from backend.distributed.tp_workers import EagerStep, GraphStep
from backend.loading.model_loader import LoadSpec, load_model, weight_bytes
from backend.loading.model_paths import kept_gguf, resolve_model
from backend.logprobs import compute_prompt_logprobs, prompt_rows
from backend.lora.manager import LoraManager
from backend.model_config import ModelConfig
from backend.models.lora_targets import lora_targets
from backend.request import Chunk
from backend.runner import compile_watch, tensor_parallel_steps
from backend.runner.decode_graphs import DecodeGraphs, ReplayIds
from backend.runner.device import pick_device, pick_dtype
from backend.runner.kv_cache_memory import KVCacheLayout, pick_group_blocks
from backend.runner.mixed_graphs import MixedGraphs
from backend.runner.step_graphs import (
    decode_graph_inputs,
    decode_graphs_over,
    eager_warm_up_chunks,
    mixed_graphs_over,
    takes_decode_graphs,
    takes_mixed_graphs,
)
from backend.runner.step_inputs import StepInputs, eager_inputs, eager_step
from backend.runner.step_packing import pack_step
from backend.runner.tensor_parallel_steps import StepSender
from backend.staging import StagingTurns
from backend.weight_formats import check_tensor_parallel, pick_quantization

log = logging.getLogger(__name__)


@dataclass
class StepLogits:
    """What one step computed."""

    logits: torch.Tensor  # float32 [sampling chunks, vocab], in chunk order
    # int64 argmax of each row skipping its banned ids, where the step computed it (decode CUDA
    # graphs; valid until the next step runs)
    argmax_ids: torch.Tensor | None
    argmax_host: ReplayIds | None = None  # the same ids on their way to the host (graphs)
    # (PromptLogprobs, log-probs, top-k or None) per request whose prompt rows this step computed
    prompt: list[tuple] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_port: int | None = None):
        """`tp_rank`, `tp_port`: a tensor-parallel worker's rank and its group's port (rank 0,
        the engine's runner, starts the workers and picks the port)."""
        config.validate()
        self.config = config
        self.tp = TensorParallel()
        self.workers: tp_workers.Workers | None = None
        self.sender: StepSender | None = None  # rank 0 of a group: the steps to the workers
        self.model = self.kv_cache = self.kv_scales = None
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.lora: LoraManager | None = None  # the adapters served by name (lora_modules)
        self.device = pick_device(config.device)
        if config.tensor_parallel_size > 1:
            self.device = tp_workers.rank_device(config, tp_rank, self.device)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            elif "OMP_NUM_THREADS" not in os.environ:  # the ranks share this host's cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        try:
            self._load(config, tp_rank, tp_port)
        except BaseException:
            self.release()
            raise

    def _load(self, config: EngineConfig, tp_rank: int, tp_port: int | None) -> None:
        self.dtype = pick_dtype(config.dtype, self.device)
        self.kv_dtype = storage_dtype(config.kv_cache_dtype, self.dtype)
        gguf_file = kept_gguf(config.model_path, config.quantization)
        self.model_dir = resolve_model(config.model_path, config.quantization)
        self.model_config = ModelConfig.from_dir(self.model_dir).with_attention_windows(
            config.attention_windows(), config.sink_token_length
        )
        self.max_seq_len = self.model_config.pick_max_seq_len(config.max_seq_len)
        self.tokens_per_block = config.tokens_per_block or (
            32 if self.device.type == "cuda" else 16
        )
        self.attention = get_attention_backend(config.attention_backend, self.device)
        check_kv_dtype(self.kv_dtype, self.attention.name, self.device)
        size = config.tensor_parallel_size
        if config.lora_modules and size > 1:  # refused before the other ranks start
            raise ValueError("lora_modules needs tensor_parallel_size 1 (LoRA is not split yet)")
        self.num_kv_heads = TensorParallel(tp_rank, size).check_split(self.model_config)
        if size > 1:
            # Refused before the other ranks start (the loader checks it again on each rank).
            weights = (
                "gguf" if gguf_file else pick_quantization(config.quantization, self.model_dir)
            )
            check_tensor_parallel(weights, size)
            if tp_rank == 0:  # the model splits: start the other ranks
                tp_port = tp_workers.free_port()
                self.workers = tp_workers.Workers(config, tp_port, type(self))
            self.tp = connect(tp_rank, size, tp_port, self.device, self.dtype)
            if self.workers is not None:
                self.sender = StepSender(self.tp, self.workers)
        # With overlap scheduling step n+1 is packed while step n's inputs may still wait in
        # pinned memory for their copy: two buffers, used in turn.
        self._staging = StagingTurns(self.device)
        spec = LoadSpec(
            self.model_dir,
            self.device,
            self.dtype,
            self.attention,
            self.max_seq_len,
            self.model_config,
            gguf_file,
            config.quantization,
            config.excluded_modules(),
            config.quantize_lm_head,
            config.fp8_fast_accumulation,
        )
        self.model = load_model(spec, self.tp)
        adapters = config.lora_adapters()
        if adapters:  # before the KV cache is sized: the adapters' slots take device memory
            self.lora = LoraManager(
                adapters,
                lora_targets(self.model),
                config.max_lora_rank,
                config.max_loras,
                self.dtype,
                self.device,
            )
        self.weight_bytes = weight_bytes(self.model)  # resident parameters and buffers
        self.kv_layout = KVCacheLayout(
            self.model_config, self.tokens_per_block, self.num_kv_heads, self.kv_dtype, self.device
        )
        self.kv_group_blocks = pick_group_blocks(  # per KV cache group
            self.kv_layout,
            config,
            self.max_seq_len,
            self._warm_up_for_sizing,
            graph_pool=takes_mixed_graphs(self),
        )
        if self.tp.enabled:  # block ids address every rank's pool: the least of them
            self.kv_group_blocks = self.tp.min_over_ranks(self.kv_group_blocks)
        # The block ids every group's pool has (a bare sequence's: `Chunk.of_sequence`).
        self.num_kv_blocks = min(self.kv_group_blocks)
        self.kv_cache, self.kv_scales = self.kv_layout.allocate(self.kv_group_blocks)
        if self.device.type == "cuda":
            self._warm_up_eager()
        self.decode_graphs = self._capture_decode_graphs()
        self.mixed_graphs = self._capture_mixed_graphs()
        if self.sender is not None:
            self.workers.on_death = lambda message: self.on_fatal(message)
            # From now on the workers follow (a warm-up step ran on every rank by itself).
            self.sender.sending = True
        log.info(
            "model %s on %s (%s): %s KV blocks x %d tokens (%s), max_seq_len %d, attention %s%s",
            self.model_dir,
            self.device,
            self.dtype,
            " + ".join(map(str, self.kv_group_blocks)),
            self.tokens_per_block,
            self.kv_dtype,
            self.max_seq_len,
            self.attention.name,
            f", tensor-parallel rank {self.tp.rank} of {self.tp.size}" if self.tp.enabled else "",
        )
        if self.device.type == "cuda":  # from here on a compile holds up a served step
            compile_watch.watch()

    def explain(self, exc: TensorParallelError) -> TensorParallelError:
        """A failed collective, named after the rank that died when one did."""
        return exc if self.workers is None else self.workers.explain(exc)

    def on_fatal(self, message: str) -> None:
        """Called from the watchdog thread when a tensor-parallel worker dies: the runner cannot
        compute again (the executor sets its own, to fail its requests and stop)."""

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model_config.eos_token_ids

    def release(self) -> None:
        """Drop the model, the KV cache and the decode graphs, and hand their device memory back
        at once, without waiting for the garbage collector to find the engine's reference cycles
        (on an 80 GB GPU a benchmark's transformers baseline needs it). Rank 0 stops its
        tensor-parallel workers. The runner is unusable afterwards."""
        if self.workers is not None:
            self.workers.stop(self.tp if self.tp.enabled else None)
            self.workers = self.sender = None
        self.tp.close()
        self.decode_graphs = self.mixed_graphs = None
        self.model = self.kv_cache = self.kv_scales = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- one step ----------------------------------------------------------------------------
    def execute(
        self,
        chunks: list[Chunk],
        in_flight_ids: torch.Tensor | None = None,
        banned_ids: np.ndarray | None = None,
        prompt_logprobs: bool = False,
    ) -> StepLogits:
        """The logits of the sampling chunks (and their argmax where the step computes it anyway,
        skipping `banned_ids` [rows, k], -1 = none).

        `in_flight_ids`: the sampled ids of the step in flight, on the device, where the input of
        a chunk whose request has an `in_flight_row` is. `prompt_logprobs`: some request may want
        prompt log-probs (else no chunk is looked at for them). Returns once the work is queued.
        """
        rows = None
        if prompt_logprobs:
            rows = prompt_rows(chunks, accumulate((c.num_tokens for c in chunks), initial=0))
        if self.sender is None:
            return self._execute(chunks, in_flight_ids, banned_ids, rows)
        return self.sender.run(lambda: self._execute(chunks, in_flight_ids, banned_ids, rows))

    def _execute(self, chunks, in_flight_ids, banned_ids, rows) -> StepLogits:
        spans = [(r.first_row, len(r.targets)) for r in rows] if self.tp.enabled and rows else []
        # A step with adapter rows runs eagerly: the CUDA graphs hold the base model alone.
        lora_slots = None if self.lora is None else self.lora.token_slots(chunks)
        allow_graph = not rows and lora_slots is None
        inputs = self.prepare(
            chunks, in_flight_ids, banned_ids, allow_graph=allow_graph, prompt_spans=spans
        )
        with torch.inference_mode():
            graphs = self.decode_graphs
            if inputs.in_graph:
                return StepLogits(*graphs.replay(len(chunks)))  # logits, ids, ids to the host
            if inputs.graph_tokens:
                hidden = self.mixed_graphs.replay(inputs.graph_tokens)
            elif lora_slots is not None:
                with self.lora.step(lora_slots):
                    hidden = self.run_model(inputs)
            else:
                hidden = self.run_model(inputs)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            prompt = (
                compute_prompt_logprobs(self.model.compute_logits, hidden, rows) if rows else None
            )
            return StepLogits(logits, None, prompt=prompt)

    def follow(self) -> None:
        """A tensor-parallel worker: run the steps rank 0 sends until it stops."""
        tensor_parallel_steps.follow(self)

    def stage_graph_step(self, step: GraphStep, previous_ids: torch.Tensor | None):
        """Write `step` into the decode graphs' next slot (`DecodeGraphs.stage`)."""
        return self.decode_graphs.stage(
            step.input_ids,
            step.positions,
            step.slots,
            step.seq_lens,
            step.block_tables,
            step.in_flight,
            previous_ids,
            step.banned_ids,
        )

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """The eager forward pass (prefill chunks, mixed batches, CPU)."""
        scales = {} if self.kv_scales is None else {"kv_scales": self.kv_scales}
        return self.model(
            inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_meta, **scales
        )

    def _warm_up_eager(self) -> StepLogits | None:
        chunks = eager_warm_up_chunks(self.tokens_per_block, self.num_kv_blocks)
        return None if chunks is None else self.execute(chunks)

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        if not takes_decode_graphs(self):
            return None
        graphs = self.new_decode_graphs()
        graphs.capture()
        return graphs

    def _capture_mixed_graphs(self) -> MixedGraphs | None:
        if not takes_mixed_graphs(self):
            return None
        graphs = self.new_mixed_graphs()
        graphs.capture()
        return graphs

    def new_decode_graphs(self) -> DecodeGraphs:
        return decode_graphs_over(self)

    def new_mixed_graphs(self) -> MixedGraphs:
        return mixed_graphs_over(self)

    def prepare(
        self,
        chunks: list[Chunk],
        in_flight_ids: torch.Tensor | None = None,
        banned_ids: np.ndarray | None = None,
        allow_graph: bool = True,
        prompt_spans: list[tuple[int, int]] = (),
    ) -> StepInputs:
        """Pack the chunks into one batch (`backend.runner.step_packing`) on the device (tensor
        parallel: and send it to the other ranks, with the prompt rows `prompt_spans` whose
        logits the step computes). A step that a decode CUDA graph will run is staged straight
        into the graph's inputs (`in_graph`)."""
        packed = pack_step(
            chunks, self.tokens_per_block, self.max_seq_len, len(self.kv_group_blocks)
        )
        in_flight, n = packed.in_flight, len(chunks)
        if in_flight is not None and in_flight_ids is None:
            raise ValueError("chunks of in-flight tokens but no in-flight ids were given")
        graphs = self.decode_graphs
        if (
            graphs is not None
            and allow_graph
            and packed.num_tokens == n
            and n <= graphs.max_batch_size
            and packed.samples.all()
        ):
            return decode_graph_inputs(self, packed, in_flight_ids, banned_ids)
        mixed = self.mixed_graphs
        # Steps with drafts run eagerly (their graphs would take several logits rows a chunk).
        graph_ok = mixed is not None and allow_graph and not packed.has_drafts
        size = mixed.size_for(packed.num_tokens, n) if graph_ok else None
        if size:
            meta = mixed.stage(packed, size, in_flight_ids)
            return StepInputs(
                mixed.input_ids[: packed.num_tokens],
                mixed.positions[: packed.num_tokens],
                meta,
                mixed.logits_indices[: packed.logits_indices.size],
                graph_tokens=size,
            )
        step = eager_step(packed)
        if self.sender is not None:
            self.sender.send(step, prompt_spans)
        return self.device_inputs(step, in_flight_ids)

    def device_inputs(
        self, step: EagerStep, in_flight_ids: torch.Tensor | None = None
    ) -> StepInputs:
        """An eager step on the device (`step_inputs.eager_inputs`)."""
        num_groups = len(self.kv_group_blocks)
        return eager_inputs(step, self._staging, num_groups, self.tp, in_flight_ids)

    def kv_block_bytes(self) -> int:
        return self.kv_layout.block_bytes()

    def _warm_up_for_sizing(self, chunks: list[Chunk], group_blocks: list[int]) -> None:
        """`kv_cache_memory.WarmUp`: the largest step on a temporary cache of `group_blocks`, and
        the logits of a full decode batch (with speculation: a row per draft too)."""
        self.kv_group_blocks = group_blocks  # prepare() reads the group count
        self.kv_cache, self.kv_scales = self.kv_layout.allocate(group_blocks)
        self.execute(chunks)
        per_request = 1 + self.config.num_speculative_tokens * bool(self.config.speculative_method)
        rows = min(self.config.max_batch_size * per_request, sum(c.num_tokens for c in chunks))
        with torch.inference_mode():
            hidden = torch.zeros(
                rows, self.model_config.hidden_size, dtype=self.dtype, device=self.device
            )
            self.model.compute_logits(hidden)
        self.kv_cache = self.kv_scales = None
