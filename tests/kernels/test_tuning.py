"""Launch configs as data: the per-device tables, their lookup, and their entries run in the
kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# Sets TRITON_INTERPRET=1 without a GPU; must come before the kernel modules are imported.
from tests.kernels.triton_cpu import DEVICE, interpretable_triton_language  # noqa: F401

pytest.importorskip("triton")

from backend.attention import kv_dtype  # noqa: E402
from backend.attention.kernels import decode, decode_launch, prefill  # noqa: E402
from backend.kernels import gemv, gemv_config, tuning  # noqa: E402
from backend.kernels.split_partials import SplitPartials  # noqa: E402
from tests.kernels.test_attention_kernels import (  # noqa: E402
    assert_matches_reference,
    make_batch,
    random_query,
)

pytestmark = [
    pytest.mark.usefixtures("interpretable_triton_language"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
MEASURED = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")  # as benchmarks/results/*.json name them
UNKNOWN = "NVIDIA A100-SXM4-80GB"

# kernel -> (its launch config for a key's fields on a named device, its default rule)
KERNELS = {
    "gemv": (
        lambda f, device: gemv_config.launch_config(
            f["n"], f["k"], bool(f["merge"]), device, f.get("weight")
        ),
        lambda f: gemv_config.default_launch_config(
            f["n"], f["k"], bool(f["merge"]), f.get("weight")
        ),
    ),
    "decode_attention": (
        lambda f, device: decode_launch.launch_config(
            f["head_dim"], bool(f["few_programs"]), device, bool(f.get("scaled_cache"))
        ),
        lambda f: decode_launch.default_launch_config(f["head_dim"], bool(f["few_programs"])),
    ),
    "prefill_attention": (
        lambda f, device: prefill.launch_config(
            f["group"], f["head_dim"], f["element_size"], device
        ),
        lambda f: prefill.default_launch_config(f["group"], f["head_dim"], f["element_size"]),
    ),
}


def fields(key: str) -> dict[str, int | str]:
    """A shape key's fields: numbers, and the stored weight format's name (gemv's `weight`)."""
    pairs = (part.split("=") for part in key.split(","))
    return {name: value if name == "weight" else int(value) for name, value in pairs}


def entries(kernel: str, device: str) -> dict[str, dict]:
    return tuning.table(kernel)[device]["configs"]


@pytest.fixture
def on_device(monkeypatch):
    """Make the kernels look their configs up under the given device name."""

    def use(name: str | None):
        monkeypatch.setattr(tuning, "device_name", lambda device: name)

    return use


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("device", MEASURED)
def test_lookup_on_a_measured_device_returns_its_entries(kernel, device):
    lookup, default = KERNELS[kernel]
    assert entries(kernel, device), "no entries"
    assert tuning.table(kernel)[device]["source"]
    for key, entry in entries(kernel, device).items():
        assert tuning.shape_key(**fields(key)) == key  # well-formed key
        # the same launch parameters; a register cap (decode attention) is optional
        assert set(entry) - {"maxnreg"} == set(default(fields(key))), key
        assert dict(lookup(fields(key), device)) == entry


@pytest.mark.parametrize("kernel", KERNELS)
def test_unknown_device_and_cpu_get_the_default_rule(kernel):
    lookup, default = KERNELS[kernel]
    assert tuning.device_name(torch.device("cpu")) is None
    for key in entries(kernel, MEASURED[0]):
        assert dict(lookup(fields(key), UNKNOWN)) == default(fields(key))
        assert dict(lookup(fields(key), None)) == default(fields(key))


def test_a_shape_missing_from_the_table_gets_the_default_rule():
    assert gemv_config.tuning_key(576, 576) not in entries("gemv", MEASURED[0])
    assert gemv_config.launch_config(
        576, 576, device_name=MEASURED[0]
    ) == gemv_config.default_launch_config(576, 576)


def test_the_kernel_call_reuses_one_cached_config_per_shape(on_device):
    on_device(MEASURED[0])
    first = gemv_config.checked_config(2048, 2048, None, device=torch.device(DEVICE))
    assert gemv_config.checked_config(2048, 2048, None, device=torch.device(DEVICE)) is first
    assert dict(first) == entries("gemv", MEASURED[0])["n=2048,k=2048,merge=0"]
    with pytest.raises(TypeError):
        first["BLOCK_N"] = 1  # shared by every call: read-only


def _merged_operand(parts: torch.Tensor, lse: torch.Tensor, dtype) -> torch.Tensor:
    """Split partials [1, H, S, D] with base-2 lse [1, H, S] merged to [1, H * D], as attention's
    output."""
    weight = torch.exp2(lse - lse.amax(-1, keepdim=True))
    merged = (parts * weight[..., None]).sum(2) / weight.sum(-1)[..., None]
    return merged.reshape(1, -1).to(dtype)


@pytest.mark.parametrize("device", MEASURED)
def test_gemv_entries_run_and_match_torch(device):
    """Every entry's tiles, on its K and a few programs' worth of N (masked last tile included)."""
    dtype = torch.float16
    for key, entry in entries("gemv", device).items():
        shape = fields(key)
        n, k = 2 * entry["BLOCK_N"] + 1, shape["k"]
        torch.manual_seed(n + k)
        weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
        if shape["merge"]:
            head_dim = 64
            parts = torch.randn(1, k // head_dim, 2, head_dim, device=DEVICE)
            lse = torch.randn(1, k // head_dim, 2, device=DEVICE)
            got = gemv.gemv(None, weight, partials=SplitPartials(parts, lse), config=entry)
            x = _merged_operand(parts, lse, dtype)
        else:
            x = torch.randn(1, k, device=DEVICE).to(dtype)
            got = gemv.gemv(x, weight, config=entry)
        expected = F.linear(x.float(), weight.float()).to(dtype)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3, msg=key)


@pytest.mark.parametrize("device", MEASURED)
def test_decode_entries_are_used_and_match_the_reference(device, on_device, monkeypatch):
    on_device(device)
    used = []
    lookup = decode_launch.launch_config
    monkeypatch.setattr(
        decode_launch, "launch_config", lambda *a: used.append(lookup(*a)) or used[-1]
    )
    for key, entry in entries("decode_attention", device).items():
        shape = fields(key)
        head_dim = shape["head_dim"]
        sms = decode_launch.num_sms(torch.device(DEVICE))  # 8 nominal ones on CPU
        num_seqs = (
            1 if shape["few_programs"] else sms // decode_launch.FEW_PAIRS_PER_SM + 1
        )  # one kv head each
        k_cache, v_cache, meta = make_batch(
            [1] * num_seqs,
            [300 - 7 * i for i in range(num_seqs)],
            num_kv_heads=1,
            head_dim=head_dim,
            tokens_per_block=32,
            dtype=torch.float16,
            seed=5,
        )
        query = random_query(num_seqs, 4, head_dim, dtype=torch.float16, seed=6)
        scales = {}
        if shape.get("scaled_cache"):  # an fp8 cache's entry: values and per-token scales
            k_cache, v_cache, scales = fp8_cache(k_cache, v_cache)
        out = decode.decode_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_seq_len,
            head_dim**-0.5,
            num_splits=2,
            **scales,
        )
        assert dict(used[-1]) == entry, key
        if scales:
            k_cache = kv_dtype.dequantize(k_cache, scales["k_scales"]).half()
            v_cache = kv_dtype.dequantize(v_cache, scales["v_scales"]).half()
        assert_matches_reference(out, query, k_cache, v_cache, meta, head_dim**-0.5, atol=2e-3)


def fp8_cache(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The caches as e4m3 values with a scale per token and kv head, as an fp8 cache holds them."""
    k_values, k_scales = kv_dtype.quantize(k_cache, torch.float8_e4m3fn)
    v_values, v_scales = kv_dtype.quantize(v_cache, torch.float8_e4m3fn)
    return k_values, v_values, {"k_scales": k_scales, "v_scales": v_scales}


def test_a_quantized_cache_takes_its_own_entry_where_the_table_has_one(
    tmp_path, monkeypatch, on_device
):
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    decode_launch.launch_config.cache_clear()
    sixteen_bit = dict(BLOCK_N=32, num_warps=2, num_stages=1)
    quantized = dict(BLOCK_N=64, num_warps=4, num_stages=1)
    tuning.write(
        "decode_attention",
        "Test GPU",
        {
            decode_launch.tuning_key(32, False): sixteen_bit,
            decode_launch.tuning_key(32, False, scaled_cache=True): quantized,
            decode_launch.tuning_key(64, False): sixteen_bit,
        },
        "test",
    )
    try:
        assert dict(decode_launch.launch_config(32, False, "Test GPU", True)) == quantized
        assert dict(decode_launch.launch_config(32, False, "Test GPU", False)) == sixteen_bit
        # no quantized entry for head_dim 64: the 16-bit cache's
        assert dict(decode_launch.launch_config(64, False, "Test GPU", True)) == sixteen_bit
        assert dict(
            decode_launch.launch_config(128, False, "Test GPU", True)
        ) == decode_launch.default_launch_config(128, False)
    finally:
        tuning.table.cache_clear()
        decode_launch.launch_config.cache_clear()


@pytest.mark.parametrize("device", MEASURED)
def test_prefill_entries_are_used_and_match_the_reference(device, on_device, monkeypatch):
    on_device(device)
    used = []
    lookup = prefill.launch_config
    monkeypatch.setattr(prefill, "launch_config", lambda *a: used.append(lookup(*a)) or used[-1])
    for key, entry in entries("prefill_attention", device).items():
        shape = fields(key)
        assert shape["element_size"] == 2
        head_dim, kv_heads = shape["head_dim"], 2
        k_cache, v_cache, meta = make_batch(
            [70, 1],
            [100, 40],
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            tokens_per_block=16,
            dtype=torch.float16,
            seed=7,
        )
        query = random_query(71, shape["group"] * kv_heads, head_dim, dtype=torch.float16, seed=8)
        out = prefill.prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            head_dim**-0.5,
        )
        assert dict(used[-1]) == entry, key
        assert_matches_reference(out, query, k_cache, v_cache, meta, head_dim**-0.5, atol=2e-3)


def test_write_merges_into_the_table(tmp_path, monkeypatch):
    """A sweep's write keeps other devices' entries and the device's other shapes; None drops
    an entry (a kernel that no longer wins there)."""
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    try:
        tuning.write("k", "GPU A", {"n=1": {"BLOCK_N": 4}, "n=2": {"BLOCK_N": 8}}, "first sweep")
        tuning.write("k", "GPU B", {"n=1": {"BLOCK_N": 16}}, "other device")
        tuning.write("k", "GPU A", {"n=2": {"BLOCK_N": 32}, "n=1": None}, "second sweep")
        assert tuning.lookup("k", "n=1", "GPU A") is None
        assert tuning.lookup("k", "n=2", "GPU A") == {"BLOCK_N": 32}
        assert tuning.lookup("k", "n=1", "GPU B") == {"BLOCK_N": 16}
        assert tuning.lookup("k", "n=3", "GPU A") is None
        assert tuning.lookup("k", "n=1", None) is None
        assert tuning.table("k")["GPU A"]["source"] == "second sweep"
        assert tuning.table("missing") == {}
    finally:
        tuning.table.cache_clear()


def test_attention_sweep_keeps_the_least_total_time_over_complete_runs():
    from benchmarks.attention_kernels import fastest

    timings = {
        "head_dim=64,few_programs=0": {
            '{"BLOCK_N": 64}': {(8, 2048): 10.0, (64, 2048): 30.0},
            '{"BLOCK_N": 128}': {(8, 2048): 8.0, (64, 2048): 35.0},
            '{"BLOCK_N": 32}': {(8, 2048): 1.0},  # failed a case: not eligible
        }
    }
    assert fastest(timings) == {"head_dim=64,few_programs=0": {"BLOCK_N": 64}}


def test_an_entry_unlike_the_rule_is_what_the_kernels_run(tmp_path, monkeypatch, on_device):
    """The measured devices' entries equal today's rule; here a table for another device holds
    other tiles, and the kernels launch with them (and stay correct)."""
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    caches = (
        tuning.table,
        gemv_config._tuned_config,
        decode_launch.launch_config,
        prefill.launch_config,
    )
    for cache in caches:
        cache.cache_clear()
    gemv_tiles = dict(
        BLOCK_N=8, BLOCK_K=64, num_warps=2, num_stages=1, EARLY_LAUNCH=False, PREFETCH_K=128
    )
    decode_tiles = dict(BLOCK_N=32, num_warps=2, num_stages=1)
    prefill_tiles = dict(BLOCK_M=16, BLOCK_N=32, num_warps=2, num_stages=1)
    tuning.write("gemv", "Test GPU", {gemv_config.tuning_key(40, 192): gemv_tiles}, "test")
    tuning.write(
        "decode_attention", "Test GPU", {decode_launch.tuning_key(32, True): decode_tiles}, "test"
    )
    tuning.write(
        "prefill_attention", "Test GPU", {prefill.tuning_key(2, 32, 4): prefill_tiles}, "test"
    )
    on_device("Test GPU")
    used = []
    for module in (decode_launch, prefill):
        lookup = module.launch_config
        monkeypatch.setattr(
            module, "launch_config", lambda *a, lookup=lookup: used.append(lookup(*a)) or used[-1]
        )
    try:
        assert gemv_tiles != gemv_config.default_launch_config(40, 192)
        assert (
            dict(gemv_config.checked_config(40, 192, None, device=torch.device(DEVICE)))
            == gemv_tiles
        )
        x = torch.randn(1, 192, device=DEVICE).half()
        weight = (torch.randn(40, 192, device=DEVICE) / 14).half()
        torch.testing.assert_close(
            gemv.gemv(x, weight), F.linear(x.float(), weight.float()).half(), atol=2e-3, rtol=2e-3
        )

        k_cache, v_cache, meta = make_batch(
            [1], [150], num_kv_heads=1, head_dim=32, tokens_per_block=16, seed=9
        )
        query = random_query(1, 3, 32, seed=10)
        out = decode.decode_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_seq_len,
            0.2,
            num_splits=2,
        )
        assert dict(used[-1]) == decode_tiles
        assert_matches_reference(out, query, k_cache, v_cache, meta, 0.2)

        k_cache, v_cache, meta = make_batch(
            [40, 1], [60, 20], num_kv_heads=2, head_dim=32, tokens_per_block=16, seed=11
        )
        query = random_query(41, 4, 32, seed=12)
        out = prefill.prefill_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2
        )
        assert dict(used[-1]) == prefill_tiles
        assert_matches_reference(out, query, k_cache, v_cache, meta, 0.2)
    finally:
        for cache in caches:
            cache.cache_clear()
