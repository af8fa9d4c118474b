"""Sampler and logits processors: exact processing on hand-computed cases, support restriction
of the filters, goodness of fit of the drawn distribution, and seed reproducibility."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from backend.request import Request
from backend.sampling.logits_processors import apply_logits_processors, banned_token_ids
from backend.sampling.sampler import Sampler, filter_logits
from backend.sampling_params import SamplingParams

END = 9  # the model's default end id in these tests
V = 10


def req(request_id="r", prompt=(1, 2), output=(), **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(**params), output_ids=list(output))


def sample_counts(
    logits_row: torch.Tensor, n: int, sampler_seed: int = 0, **params
) -> torch.Tensor:
    """Draw n tokens for n identical unseeded rows in one call; return per-token counts."""
    sampler = Sampler(logits_row.numel(), [END], seed=sampler_seed)
    requests = [req(f"r{i}", **params) for i in range(n)]
    out = sampler.sample(logits_row.expand(n, -1).contiguous(), requests)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel())


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ties_break_to_first_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    sampler = Sampler(4, [3])
    out = sampler.sample(logits, [req(f"r{i}") for i in range(3)])
    assert out.token_ids == [1, 0, 0]
    assert out.logprobs is None


def test_greedy_rows_stay_exact_argmax_next_to_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[0, 7] = logits[0, 30] = logits[0].max() + 1.0  # tie in a greedy row
    requests = [
        req("g0"),
        req("s1", temperature=1.0),
        req("g2", temperature=2.0, top_k=1),
        req("s3", temperature=0.8, top_p=0.9),
        req("g4"),
        req("s5", temperature=1.0, seed=4),
    ]
    out = Sampler(50, [END]).sample(logits, requests)
    expected = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == 7
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(-3, 3), min_size=8, max_size=8), min_size=1, max_size=6))
def test_greedy_matches_torch_argmax_on_tie_heavy_logits(rows):
    logits = torch.tensor(rows, dtype=torch.float32)
    out = Sampler(8, [END]).sample(logits, [req(f"r{i}") for i in range(len(rows))])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


# ---------------------------------------------------------------- processors (exact values)


def test_penalties_and_bias_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0]])
    r = req(
        prompt=[0, 1],
        output=[1, 2, 2],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        embedding_bias={0: -2.5, 4: 1.0},
    )
    apply_logits_processors(logits, [r], default_end_ids=[END])
    # token 0: bias 2.0-2.5=-0.5, then repetition (<=0) *2 = -1.0     (bias comes first)
    # token 1: repetition -1*2 = -2, presence -0.5, frequency -0.25*1 -> -2.75
    # token 2: repetition 0.5/2 = 0.25, presence -0.5, frequency -0.25*2 -> -0.75
    # token 3: not seen -> unchanged; token 4: bias only -> 4.0
    assert logits.tolist() == [[-1.0, -2.75, -0.75, -0.5, 4.0]]


def test_repetition_penalty_counts_each_token_once_and_ignores_other_rows():
    logits = torch.tensor([[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]])
    rows = [req(prompt=[0, 0, 0], output=[0, 1], repetition_penalty=2.0), req(prompt=[2])]
    apply_logits_processors(logits, rows, default_end_ids=[END])
    assert logits.tolist() == [[2.0, 2.0, 4.0], [4.0, 4.0, 4.0]]


def test_bad_words_ban_the_last_token_when_the_output_ends_with_the_prefix():
    bad = [[5], [1, 2, 3], [7, 8]]
    assert sorted(banned_token_ids(req(output=[0, 1, 2], bad_token_ids=bad), [END])) == [3, 5]
    assert sorted(banned_token_ids(req(output=[2, 1], bad_token_ids=bad), [END])) == [5]
    assert sorted(banned_token_ids(req(output=[7], bad_token_ids=bad), [END])) == [5, 8]
    assert banned_token_ids(req(output=[], bad_token_ids=[[1, 2]]), [END]) == []


def test_min_tokens_bans_end_ids_until_reached():
    defaults = [8, 9]
    assert sorted(banned_token_ids(req(output=[1], min_tokens=2), defaults)) == [8, 9]
    assert banned_token_ids(req(output=[1], min_tokens=2, end_id=4), defaults) == [4]
    assert banned_token_ids(req(output=[1], min_tokens=2, ignore_end_id=True), defaults) == []
    assert banned_token_ids(req(output=[1, 2], min_tokens=2), defaults) == []


def test_end_bans_list_each_rows_min_tokens_ban():
    sampler = Sampler(V, [END, 8])
    requests = [
        req("a", min_tokens=3, output=[1]),
        req("b", min_tokens=3, output=[1, 2, 3]),
        req("c"),
        req("d", min_tokens=2, end_id=4),
        req("e", min_tokens=5, ignore_end_id=True),
    ]
    assert sampler.end_bans(requests).tolist() == [[END, 8], [-1, -1], [-1, -1], [4, -1], [-1, -1]]
    assert sampler.end_bans(requests[1:3]) is None


def test_a_ban_only_greedy_row_takes_the_argmax_that_skipped_its_ban():
    """A step that computed each row's argmax skipping its end ban (a decode graph) hands it in:
    rows whose only processor is that ban take it as is; other processors still run."""
    logits = torch.zeros(3, V)
    logits[:, END] = 5.0  # the end id would win every row
    logits[:, 2] = 4.0
    requests = [req("a", min_tokens=4), req("b", min_tokens=4), req("c")]
    sampler = Sampler(V, [END])
    assert sampler.sample(logits, requests).token_ids == [2, 2, END]  # processed here
    graph_ids = torch.tensor([6, 6, END])  # what a graph's banned argmax gave
    assert sampler.sample(logits, requests, argmax_ids=graph_ids).token_ids == [6, 6, END]
    penalised = [req("a", min_tokens=4), req("b", min_tokens=4, repetition_penalty=1.5), req("c")]
    assert sampler.sample(logits, penalised, argmax_ids=graph_ids).token_ids == [2, 2, END]


def test_bans_steer_greedy_to_the_next_best_token():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]]).repeat(3, 1)
    requests = [
        req("a", output=[3], min_tokens=5),  # bans END=9 -> 8
        req("b", output=[3], bad_token_ids=[[9], [3, 8], [4, 7]]),  # bans 9 and 8 -> 7
        req("c", output=[3], min_tokens=5, end_id=-1),  # "no end id": nothing -> 9
    ]
    out = Sampler(V, [END]).sample(logits, requests)
    assert out.token_ids == [8, 7, 9]


def test_embedding_bias_shifts_the_choice():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert Sampler(3, [2]).sample(logits, [req(embedding_bias={0: 2.5})]).token_ids == [0]
    assert Sampler(3, [2]).sample(logits, [req(embedding_bias={0: 1.5})]).token_ids == [2]


# ---------------------------------------------------------------- log-probs


def test_logprobs_are_log_softmax_of_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(4, 30) * 3
    requests = [
        req("a", return_log_probs=True, repetition_penalty=1.7, embedding_bias={3: 30.0}),
        req("b", temperature=0.7, top_k=5, seed=11),
        req("c"),
        req("d", temperature=1.2, top_p=0.8, min_p=0.05, bad_token_ids=[[2]]),
    ]
    raw = logits.clone()
    out = Sampler(30, [END]).sample(logits, requests)
    assert torch.equal(logits, raw)  # the caller's logits are not modified
    expected = torch.log_softmax(raw, dim=-1)[torch.arange(4), torch.tensor(out.token_ids)]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    assert out.token_ids[0] == 3  # the bias moved the choice; the log-prob is still raw


# ---------------------------------------------------------------- filters


@pytest.mark.parametrize(
    "probs, params, allowed",
    [
        ([0.05, 0.3, 0.1, 0.4, 0.15], dict(top_k=3), {1, 3, 4}),
        ([0.4, 0.3, 0.2, 0.05, 0.05], dict(top_p=0.75), {0, 1, 2}),
        ([0.4, 0.3, 0.2, 0.05, 0.05], dict(top_p=0.65), {0, 1}),
        ([0.1, 0.4, 0.11, 0.3, 0.09], dict(min_p=0.26), {1, 2, 3}),
        # top-k 2 leaves {0: 0.5, 1: 0.5} after renormalising; top-p 0.5 then keeps one
        ([0.3, 0.3, 0.2, 0.2, 0.0001], dict(top_k=2, top_p=0.5), {0}),
        # top-k 3 leaves ids 3, 0, 4 (0.3, 0.25, 0.2); min-p 0.7 drops below 0.21
        ([0.25, 0.15, 0.1, 0.3, 0.2], dict(top_k=3, min_p=0.7), {0, 3}),
    ],
)
def test_filters_restrict_the_support(probs, params, allowed):
    logits = torch.tensor(probs).log()
    kept = filter_logits(
        logits[None],
        top_k=torch.tensor([params["top_k"]]) if "top_k" in params else None,
        top_p=torch.tensor([params["top_p"]]) if "top_p" in params else None,
        min_p=torch.tensor([params["min_p"]]) if "min_p" in params else None,
    )[0]
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == allowed
    counts = sample_counts(logits, 3000, temperature=1.0, **params)
    assert set(counts.nonzero().flatten().tolist()) == allowed


def test_filters_apply_per_row():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]).log().expand(4, -1)
    kept = filter_logits(
        logits,
        top_k=torch.tensor([0, 1, 2, 0]),
        top_p=torch.tensor([1.0, 1.0, 1.0, 0.5]),
        min_p=None,
    )
    assert torch.isfinite(kept).sum(dim=-1).tolist() == [5, 1, 2, 2]


# ---------------------------------------------------------------- distribution


LOGITS = torch.tensor([1.0, 0.2, -0.5, 1.4, 0.0, -1.0])


@pytest.mark.parametrize("temperature", [0.5, 1.5])
@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(temperature, seeded):
    n = 6000
    if seeded:  # one seeded request per row: the per-request generator path
        requests = [req(f"r{i}", temperature=temperature, seed=1000 + i) for i in range(n)]
        out = Sampler(6, [END]).sample(LOGITS.expand(n, -1).contiguous(), requests)
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=6)
    else:
        counts = sample_counts(LOGITS, n, sampler_seed=123, temperature=temperature)
    expected = torch.softmax(LOGITS.double() / temperature, dim=-1) * n
    assert chisquare(counts.double().numpy(), expected.numpy()).pvalue > 1e-3
    # The test has power: the untempered distribution is rejected.
    untempered = torch.softmax(LOGITS.double(), dim=-1) * n
    assert chisquare(counts.double().numpy(), untempered.numpy()).pvalue < 1e-3


# ---------------------------------------------------------------- seeds


def step_logits(request_id: str, step: int) -> torch.Tensor:
    """Deterministic, fairly flat logits for (request, step), independent of any batch."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{request_id}/{step}".encode()))
    return torch.randn(200, generator=g) * 0.5


def run_batch(sampler: Sampler, requests: list[Request], steps: int) -> None:
    for step in range(steps):
        logits = torch.stack([step_logits(r.request_id, step) for r in requests])
        out = sampler.sample(logits, requests)
        for r, token in zip(requests, out.token_ids):
            r.output_ids.append(token)


def test_seeded_tokens_do_not_depend_on_neighbours_or_position():
    steps = 8
    common = dict(temperature=1.0, top_p=0.95, repetition_penalty=1.1)

    def fresh(rid, seed=None, **extra):
        return req(rid, prompt=[1, 2, 3], **{**common, "seed": seed, **extra})

    a1, b1 = fresh("a", 7), fresh("b", 8)
    run_batch(Sampler(200, [END], seed=0), [a1, fresh("x"), b1, fresh("y", top_k=5)], steps)
    a2, b2 = fresh("a", 7), fresh("b", 8)
    run_batch(Sampler(200, [END], seed=99), [b2, fresh("z", 5), a2], steps)
    a3 = fresh("a", 7)
    run_batch(Sampler(200, [END], seed=5), [a3], steps)
    assert a1.output_ids == a2.output_ids == a3.output_ids
    assert b1.output_ids == b2.output_ids
    # The seed matters: another seed on the same logits gives another sequence.
    other = fresh("a", 70)
    run_batch(Sampler(200, [END]), [other], steps)
    assert other.output_ids != a1.output_ids


def test_forget_restarts_the_request_generator():
    sampler = Sampler(200, [END])
    first = req("a", temperature=1.0, seed=3)
    run_batch(sampler, [first], 5)
    sampler.forget("a")
    again = req("a", temperature=1.0, seed=3)
    run_batch(sampler, [again], 5)
    assert again.output_ids == first.output_ids
    kept = req("a", temperature=1.0, seed=3)  # not forgotten: the generator continues
    run_batch(sampler, [kept], 5)
    assert kept.output_ids != first.output_ids


def test_rejects_mismatched_batch():
    with pytest.raises(ValueError):
        Sampler(V, [END]).sample(torch.zeros(2, V), [req()])


def test_logprob_value_is_finite_when_a_banned_token_would_win():
    logits = torch.tensor([[0.0, 10.0]])
    out = Sampler(2, [1]).sample(logits, [req(min_tokens=1, return_log_probs=True)])
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx(-math.log1p(math.exp(10.0)), abs=1e-5)


def test_repetition_penalty_follows_the_current_prompt_after_forget():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    sampler = Sampler(3, [2])
    first = req("a", prompt=[0], repetition_penalty=2.0)  # 3.0 -> 1.5, so token 1 wins
    assert sampler.sample(logits, [first]).token_ids == [1]
    sampler.forget("a")
    second = req("a", prompt=[1], repetition_penalty=2.0)  # 2.5 -> 1.25, token 0 wins
    assert sampler.sample(logits, [second]).token_ids == [0]
    assert sampler.sample(logits, [second]).token_ids == [0]  # cached prompt, same answer
