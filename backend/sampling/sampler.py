"""Batched token selection with per-request parameters.

Processing order for each row (one request per row):

1. logits processors (`backend.sampling.logits_processors`): embedding bias -> bad words ban ->
   min-tokens end-id ban -> repetition penalty -> presence / frequency penalties
2. greedy requests (temperature 0 or top_k 1): exact argmax of the processed logits, ties to the
   first index like `torch.argmax`, so with no processors it equals argmax of the raw logits.
   Where the step computed each row's argmax skipping the row's min-tokens end ban (a decode
   CUDA graph, given `end_bans()`), a greedy row whose only processor is that ban takes it as is
3. sampled requests: temperature -> top-k -> top-p -> min-p -> draw

top-p and min-p look at the distribution left by the previous steps (top-p renormalises after
top-k; min-p compares against the largest remaining probability), as in Hugging Face.

Draws use the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) selects i with probability
p_i. It turns sampling into noise generation plus an argmax, so every row is drawn in the same
batched operation while each seeded request still fills its noise from its own generator. A
seeded row consumes exactly V exponentials per step from its generator, so its tokens do not
depend on its neighbours or its position in the batch.

Log-probs are those of the chosen tokens under the raw model distribution (log_softmax of the
unprocessed logits), which is what clients compare against other engines; the top-k log-probs
(`num_top_log_probs`) are taken from the same distribution the same way (`backend.logprobs`), only
in steps where some row asks, and for all rows at the largest k asked (each request keeps its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend.logprobs import top_logprobs
from backend.request import Request
from backend.sampling.logits_processors import (
    PromptTokenCache,
    apply_logits_processors,
    has_processors,
    min_tokens_end_ban,
)
from backend.sampling_params import SamplingParams
from backend.staging import to_device

try:  # on GPU, a two-kernel argmax: torch's is slow on a vocabulary-wide row (benchmarks/README.md)
    from backend.kernels.argmax import argmax_rows
except ImportError:
    argmax_rows = None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [B, V], ties to the first index."""
    if x.is_cuda and argmax_rows is not None:
        return argmax_rows(x)
    return x.argmax(dim=-1)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Log-prob of each chosen token under the raw model distribution; None when no request in
    # the batch asked for them (then they are not computed at all).
    logprobs: list[float] | None
    # Per row, the top-k log-probs and ids of the raw distribution at the largest k any row of
    # the batch asked for; None when none asked.
    top_logprobs: list[list[float]] | None = None
    top_ids: list[list[int]] | None = None


def _kind(p: SamplingParams) -> tuple[SamplingParams, bool, bool, bool, int]:
    """What a request's parameters ask of every step, worked out once per request: (params,
    greedy, log-probs, may have logits processors, top-k log-probs). The fourth is a superset
    of `has_processors`, which is only asked for requests where it may be true."""
    maybe_processed = bool(
        p.embedding_bias
        or p.bad_token_ids
        or p.min_tokens
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )
    return p, p.greedy, p.return_log_probs, maybe_processed, p.num_top_log_probs


class PendingSample:
    """Sampled ids (and log-probs) of one step, on their way from the device to the host.

    `token_ids` stays on the device: with overlap scheduling the next step reads its input ids
    from it before the host has seen them. On CUDA the host copy is a non-blocking copy into
    pinned memory followed by an event, so `result()` waits for this step only, not for
    whatever was queued after it. `host_ids`, when given, is already bringing the ids to the
    host (an object whose `result()` returns them as a list: a decode CUDA graph's argmax).
    """

    def __init__(
        self,
        token_ids: torch.Tensor,
        logprobs: torch.Tensor | None,
        host_ids=None,
        top: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.token_ids = token_ids
        self._ids_on_their_way = host_ids
        self._event = None
        if token_ids.is_cuda:
            if host_ids is None:
                token_ids = token_ids.to("cpu", non_blocking=True)  # pinned destination
            if logprobs is not None:
                logprobs = logprobs.to("cpu", non_blocking=True)
            if top is not None:
                top = tuple(t.to("cpu", non_blocking=True) for t in top)
            if host_ids is None or logprobs is not None or top is not None:
                self._event = torch.cuda.Event()
                self._event.record()
        self._host_ids = token_ids
        self._host_logprobs = logprobs
        self._host_top = top

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        on_their_way, logprobs, top = self._ids_on_their_way, self._host_logprobs, self._host_top
        ids = on_their_way.result() if on_their_way is not None else self._host_ids.tolist()
        out = SamplerOutput(ids, None if logprobs is None else logprobs.tolist())
        if top is not None:
            out.top_logprobs, out.top_ids = top[0].tolist(), top[1].tolist()
        return out


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        default_end_ids: list[int],
        device: torch.device | str = "cpu",
        seed: int = 0,
    ):
        self.vocab_size = vocab_size
        self.default_end_ids = list(default_end_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self._prompt_tokens = PromptTokenCache(self.device)
        # request_id -> _kind(params), checked against the params object (a reused id has new ones)
        self._kinds: dict[str, tuple[SamplingParams, bool, bool, bool, int]] = {}

    def forget(self, request_id: str) -> None:
        """Drop per-request state when a request ends (a later request may reuse the id)."""
        self._request_generators.pop(request_id, None)
        self._prompt_tokens.forget(request_id)
        self._kinds.pop(request_id, None)

    def end_bans(self, requests: list[Request]) -> np.ndarray | None:
        """Each row's min-tokens end ban at this step ([B, k] ids, -1 padded), for a step that
        computes its argmax (`argmax_ids`); None when no row has one."""
        ends = self.default_end_ids
        bans = [min_tokens_end_ban(r, ends) if r.sampling.min_tokens else () for r in requests]
        width = max(map(len, bans), default=0)
        if not width:
            return None
        table = np.full((len(requests), width), -1, dtype=np.int64)
        for row, ban in enumerate(bans):
            table[row, : len(ban)] = ban
        return table

    def sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        argmax_ids: torch.Tensor | None = None,
        argmax_host=None,
    ) -> SamplerOutput:
        """Choose one token per row of `logits` [B, V]; row i belongs to requests[i].
        `argmax_ids`: each row's argmax of `logits` skipping the row's `end_bans`, when already
        computed (the decode CUDA graphs do); greedy rows without other logits processors take it
        as it is. `argmax_host`: the same ids on their way to the host (see `PendingSample`)."""
        return self.sample_async(logits, requests, argmax_ids, argmax_host).result()

    def sample_async(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        argmax_ids: torch.Tensor | None = None,
        argmax_host=None,
    ) -> PendingSample:
        """Like `sample`, without waiting for the device: the ids stay on the device (the next
        step can read them there) while a copy to host memory is under way."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [{len(requests)}, V], got {tuple(logits.shape)}")
        logits = logits.float()
        default_end_ids = self.default_end_ids
        greedy, want_logprobs, processed, num_top = True, False, False, 0
        ban_applied = argmax_ids is not None
        kinds = self._kinds
        for r in requests:  # one pass: this runs for every row every step
            kind = kinds.get(r.request_id)
            if kind is None or kind[0] is not r.sampling:
                kind = kinds[r.request_id] = _kind(r.sampling)
            greedy = greedy and kind[1]
            want_logprobs = want_logprobs or kind[2]
            num_top = kind[4] if kind[4] > num_top else num_top
            processed = processed or (kind[3] and has_processors(r, default_end_ids, ban_applied))
        host_ids = None
        if not processed and greedy:  # fast path: nothing to copy or edit
            tokens = argmax_ids if argmax_ids is not None else argmax(logits)
            host_ids = argmax_host if argmax_ids is not None else None
        else:
            work = logits.clone()
            if processed:
                apply_logits_processors(work, requests, default_end_ids, self._prompt_tokens)
            tokens = self._choose(work, requests)

        logprobs = top = None
        if want_logprobs or num_top:
            lse = torch.logsumexp(logits, dim=-1)
            if want_logprobs:
                logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - lse
            if num_top:
                top = top_logprobs(logits, lse, num_top)
        return PendingSample(tokens, logprobs, host_ids, top)

    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Argmax for greedy rows, a filtered draw for the others. `logits` is processed."""
        tokens = argmax(logits)
        sampled = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if not sampled:
            return tokens
        params = [requests[i].sampling for i in sampled]
        # One host-to-device copy for all per-row scalars (top_k < 2**24 is exact in float32).
        table = to_device(
            [[p.temperature, p.top_k, p.top_p, p.min_p] for p in params],
            torch.float32,
            logits.device,
        )
        rows = to_device(sampled, torch.long, logits.device)
        scaled = logits[rows] / table[:, 0:1]
        filtered = filter_logits(
            scaled,
            top_k=table[:, 1].long() if any(p.top_k > 0 for p in params) else None,
            top_p=table[:, 2] if any(p.top_p < 1.0 for p in params) else None,
            min_p=table[:, 3] if any(p.min_p > 0.0 for p in params) else None,
        )
        probs = torch.softmax(filtered, dim=-1)
        noise = self._exponential_noise([requests[i] for i in sampled], probs.shape)
        tokens[rows] = argmax(probs / noise)
        return tokens

    def _exponential_noise(self, requests: list[Request], shape: torch.Size) -> torch.Tensor:
        """Exp(1) noise; seeded rows from their own generator, the rest from the shared one."""
        noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        unseeded = [j for j, r in enumerate(requests) if r.sampling.seed is None]
        if len(unseeded) == len(requests):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            block = torch.empty((len(unseeded), shape[1]), dtype=torch.float32, device=self.device)
            noise[to_device(unseeded, torch.long, self.device)] = block.exponential_(
                generator=self.generator
            )
        for j, r in enumerate(requests):
            if r.sampling.seed is not None:
                noise[j].exponential_(generator=self._generator_for(r))
        # Exp(1) can round to 0; a zero would turn a zero-probability token into 0/0.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _generator_for(self, request: Request) -> torch.Generator:
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request.sampling.seed)
            self._request_generators[request.request_id] = generator
        return generator


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p / min-p support to -inf.

    Per-row parameters are [R] tensors (top_k 0 = off, top_p 1 = off, min_p 0 = off); None
    means off for every row. The most likely token always survives. Top-k and top-p share one
    sort of the row; min-p needs no sort.
    """
    neg_inf = float("-inf")
    if top_k is not None or top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        vocab = logits.shape[1]
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
            position = torch.arange(vocab, device=logits.device)
            sorted_logits.masked_fill_(position[None, :] >= k[:, None], neg_inf)
        if top_p is not None:
            probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # Keep the smallest prefix whose mass reaches p; rows with p = 1 keep everything
            # (float cumsum may reach 1.0 before the tail does).
            drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
            sorted_logits.masked_fill_(drop, neg_inf)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, neg_inf)
    return logits
