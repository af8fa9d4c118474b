"""How a paged decode-attention launch is shaped (`backend.attention.kernels.decode`): how many
splits each (request, kv head) gets, the key tile, and the warps and stages per device.

`choose_num_splits` adds splits only while (requests x kv heads x splits) is short of the
programs an SM holds at once (`programs_per_sm`: PROGRAMS_PER_SM, or what a register cap allows)
on every SM, and keeps at least MIN_TOKENS_PER_SPLIT context tokens per split; the count is
rounded down to a power of two so only a few kernel variants are compiled.
Grids of few (request, kv head) pairs take their own tile (`few_programs`). `config_for` and
`splits_for` answer both for one launch's tensors. Measurements behind
these choices: benchmarks/README.md, "Paged decode attention".
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch

from backend.attention.kv_dtype import is_scaled
from backend.kernels import tuning

MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4
REGISTERS_PER_SM = 65536  # 32-bit registers of an SM (sm_80 and later)
CPU_NOMINAL_SMS = 8  # interpreter runs: keep the heuristic meaningful
FEW_PAIRS_PER_SM = 8  # grids of at most SMs / 8 (request, kv head) pairs take the few-programs tile


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_NOMINAL_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    sm_count: int,
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> int:
    """Splits per (request, kv head): enough programs to fill the GPU, enough work per split."""
    programs = num_seqs * num_kv_heads
    target = programs_per_sm * sm_count
    if programs >= target:
        return 1
    splits = min(target // programs, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return 1 << (max(1, splits).bit_length() - 1)


def has_few_programs(num_seqs: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether the grid has so few (request, kv head) pairs that it takes the few-programs tile."""
    return FEW_PAIRS_PER_SM * num_seqs * num_kv_heads <= num_sms(device)


def default_launch_config(head_dim: int, few_programs: bool = False) -> dict:
    """Key tile and launch shape for devices without a table entry: 64-token tiles, and 128-token
    tiles with 8 warps for grids of few programs (benchmarks/README.md, "Kernel choices"); wider
    heads take shorter tiles and two stages, so the K and V stages fit in shared memory."""
    block_n = 128 if few_programs else 64
    wide = head_dim > 128
    return dict(
        BLOCK_N=block_n * 128 // head_dim if wide else block_n,
        num_warps=8 if few_programs else 4,
        num_stages=2 if wide else 3,
    )


def tuning_key(head_dim: int, few_programs: bool, scaled_cache: bool = False) -> str:
    """The shape key of `tuning/decode_attention.json`; a quantized cache's entries (fp8 / int8,
    whose tiles convert in registers) carry `scaled_cache=1`."""
    if scaled_cache:
        return tuning.shape_key(head_dim=head_dim, few_programs=few_programs, scaled_cache=1)
    return tuning.shape_key(head_dim=head_dim, few_programs=few_programs)


def programs_per_sm(config: Mapping) -> int:
    """Programs of `config` an SM holds at once: where it caps registers, as many as the register
    file takes (65,536 / (cap x threads): 8 for 128 registers and 2 warps); else PROGRAMS_PER_SM."""
    if not config.get("maxnreg"):
        return PROGRAMS_PER_SM
    return max(1, REGISTERS_PER_SM // (config["maxnreg"] * 32 * config["num_warps"]))


def register_cap(config: Mapping) -> dict:
    """The launch's `maxnreg` where the config caps registers a thread (so more programs fit
    an SM: the kernel is bound by its programs' dependent loads, not by bytes), else nothing."""
    return {"maxnreg": config["maxnreg"]} if config.get("maxnreg") else {}


@functools.lru_cache(maxsize=None)
def launch_config(
    head_dim: int, few_programs: bool, device_name: str | None = None, scaled_cache: bool = False
) -> Mapping:
    """The table's config on the named device (for a quantized cache its own entry where the
    table has one, else the 16-bit cache's), else the default; read-only, cached."""
    keys = [tuning_key(head_dim, few_programs)]
    if scaled_cache:
        keys.insert(0, tuning_key(head_dim, few_programs, scaled_cache=True))
    for key in keys:
        config = tuning.lookup("decode_attention", key, device_name)
        if config is not None:
            return MappingProxyType(config)
    return MappingProxyType(default_launch_config(head_dim, few_programs))


def config_for(query: torch.Tensor, k_cache: torch.Tensor, num_seqs: int) -> Mapping:
    """`launch_config` for this grid on the query's device."""
    return launch_config(
        query.shape[2],
        has_few_programs(num_seqs, k_cache.shape[2], query.device),
        tuning.device_name(query.device),
        is_scaled(k_cache.dtype),
    )


def splits_for(config: Mapping, query, k_cache, num_seqs: int, max_seq_len: int) -> int:
    """`choose_num_splits` for this grid, with as many programs an SM as `config` lets run."""
    return choose_num_splits(
        num_seqs, k_cache.shape[2], max_seq_len, num_sms(query.device), programs_per_sm(config)
    )
