"""One speculative round over static buffers: draft → verify → accept → commit, all on device.

Per row b the engine state holds the pending token (emitted, not yet in the cache), n_out[b] (tokens
emitted so far, the pending one included) and done[b]. A round proposes k drafts, runs the target over
[pending, d1 … dk] once, accepts n[b] drafts plus one target token, truncates at EOS, max_new_tokens or a
finished row, writes the emitted tokens to `out` at their per-row offsets and commits n[b] + 1 block
positions to the cache. Nothing leaves the device, so on CUDA the round is one CUDA graph.
"""

import torch

from ..sampling import filtered_probs, repetition_penalty, seen_through
from .verify import accept_greedy, accept_sampled, emitted_tokens


class Speculator:
    """Runs rounds of `proposer` (k drafts each) against the engine's target; see the module docstring.

    The proposer protocol (see bench.OracleProposer, spec/mtp.py, spec/dflash.py):
      features: what it reads of the target (Forward._features): None, "final" or a tuple of layer ids;
      prefill(engine, first_row, tokens [n, T], feats [n, T, F], start) after each prefill chunk (positions
        start … start+T-1 of rows first_row … first_row+n-1; chunks in order);
      start(engine) once every row is prefilled;
      propose(engine, k, do_sample) -> (drafts [B, k] long, q [B, k, V] draft probabilities, or None when the
        drafts are deterministic);
      observe(engine, tokens [B, k+1], feats [B, k+1, F], start [B], keep [B]) after each commit: the block's
        emitted tokens, the target's features over it, its first position and the number of its positions
        committed (0 for finished rows).
    """

    def __init__(self, engine, proposer, k: int):
        """k: drafts a round, and the most a generate call may ask for (the cache's verify block is k + 1)."""
        self.engine, self.proposer, self.k = engine, proposer, k
        B, dev = engine.max_batch_size, engine.device
        # emitted tokens; the last column takes the writes of positions a row does not emit
        self.out = torch.zeros(B, engine.max_seq_len + k + 2, dtype=torch.long, device=dev)
        self.n_out = torch.zeros(B, dtype=torch.long, device=dev)
        self.max_new = torch.zeros((), dtype=torch.long, device=dev)
        self.rounds = torch.zeros(B, dtype=torch.long, device=dev)  # rounds each row took part in
        for buf in (self.out, self.n_out, self.max_new, self.rounds):
            torch._dynamo.mark_static_address(buf)
        self.greedy_round = engine.compile(lambda: self.round(do_sample=False))
        self.sample_round = engine.compile(lambda: self.round(do_sample=True))
        self._fewer = {}  # (k, do_sample) -> compiled round with fewer drafts than self.k, built on first use

    def step_for(self, k: int, do_sample: bool, penalized: bool = False):
        """The compiled round of k ≤ self.k drafts (a graph per k: shapes are fixed; and one with the repetition
        penalty, penalized)."""
        if k == self.k and not penalized:
            return self.sample_round if do_sample else self.greedy_round
        if (k, do_sample, penalized) not in self._fewer:
            self._fewer[k, do_sample, penalized] = self.engine.compile(
                lambda: self.round(do_sample=do_sample, k=k, penalized=penalized))
        return self._fewer[k, do_sample, penalized]

    def round(self, do_sample: bool, k: int | None = None, penalized: bool = False) -> None:
        e, s, k = self.engine, self.engine.state, self.k if k is None else k
        drafts, q = self.proposer.propose(e, k, do_sample)
        block = torch.cat([s["tokens"][:, None], drafts], dim=1)
        out = e.forward.step(block, verify=True, features=self.proposer.features)  # logits [B, k+1, V]
        logits, feats = out if self.proposer.features is not None else (out, None)
        start = e.cache.lengths.clone()
        j = torch.arange(k + 1, device=logits.device)
        blocked = (self.n_out[:, None] + j < s["min_new"])[..., None] & s["eos_mask"]
        logits = logits.masked_fill(blocked, float("-inf"))
        if penalized:  # position j's sequence: every emitted token (the pending one included), then d1 … dj
            logits = repetition_penalty(logits, seen_through(s["seen"], drafts), s["penalty"][:, None])
        if do_sample:
            rep = lambda t: t.repeat_interleave(k + 1)  # noqa: E731
            p = filtered_probs(logits.flatten(0, 1), rep(s["temperature"]), rep(s["top_k"]), rep(s["top_p"]),
                               rep(s["min_p"])).view(logits.shape)
            n, nxt = accept_sampled(p, drafts, q)
        else:
            n, nxt = accept_greedy(logits, drafts)
        if getattr(self.proposer, "impose", False):  # benchmarks only: bench.OracleProposer(impose=True)
            n, nxt = self.proposer.imposed_acceptance(logits)
        emitted = emitted_tokens(drafts, n, nxt)
        count = n + 1
        is_eos = s["eos_mask"][emitted] & (j < count[:, None])
        count = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, count)
        count = torch.minimum(count, self.max_new - self.n_out)
        count = torch.where(s["done"], 0, count)
        cols = torch.where(j < count[:, None], self.n_out[:, None] + j, self.out.shape[1] - 1)
        self.out.scatter_(1, cols, emitted)
        if penalized:  # (a row emitting none marks its first token: it is done, nothing reads it again)
            s["seen"].scatter_(1, torch.where(j < count[:, None], emitted, emitted[:, :1]), True)
        keep = torch.where(s["done"], 0, n + 1)
        e.forward.commit(keep)
        finished = (is_eos & (j < count[:, None])).any(1) | (self.n_out + count >= self.max_new)
        self.rounds.add_((~s["done"]).long())
        s["done"].logical_or_(finished)
        self.n_out.add_(count)
        s["tokens"].copy_(nxt)
        self.proposer.observe(e, emitted, feats, start, keep)

    def decode(self, first: torch.Tensor, rows: int, max_new: int, do_sample: bool, streamer, watch,
               k: int | None = None, criteria=None, prompt: torch.Tensor | None = None, pad_ended: bool = True):
        """Rounds of k (default self.k) drafts until `watch` (generate.DoneWatch over the first `rows` rows)
        says every row is done; first [B] are the prefill's tokens. criteria (a StoppingCriteriaList, with the
        left-padded prompt [rows, L] they read): checked at every emitted position (stop_at); pad_ended False (no
        EOS: transformers then pads no row) lets the rows they end run on until they have ended every row.
        Returns tokens [rows, n], n ≤ max_new, with each row's tokens after its end set to the engine's pad."""
        s = self.engine.state
        self.out[:, 0] = first
        self.n_out.fill_(1)
        self.rounds.zero_()
        self.max_new.fill_(max_new)
        s["done"][:rows] |= max_new <= 1
        self.proposer.start(self.engine)
        step = self.step_for(self.k if k is None else k, do_sample, self.engine.penalized)
        ended = None if pad_ended else {}
        checked = self.stop_at(criteria, prompt, [0] * rows, ended) if criteria is not None else None
        if streamer is not None:
            streamer.put(first[:rows].cpu())
        shown = 1
        for _ in range(max_new):
            watch.launched()
            if watch.finished():
                break
            step()
            if criteria is not None:
                checked = self.stop_at(criteria, prompt, checked, ended)
            if streamer is not None:
                shown = self.stream(streamer, rows, shown)
        width = int(self.n_out[:rows].max())
        new = self.out[:rows, :width].clone()
        cols = torch.arange(width, device=new.device)
        return torch.where(cols[None, :] < self.n_out[:rows, None], new, s["pad"])

    def stream(self, streamer, rows: int, shown: int) -> int:
        """Put each position from `shown` on that every row has settled (emitted, or done: pad there) as one [rows]
        tensor, as plain decoding streams (transformers' order); returns the positions now shown."""
        n, pad = self.n_out[:rows], self.engine.state["pad"]
        end = int(torch.where(self.engine.state["done"][:rows], n.max(), n).min())
        cols = torch.arange(shown, max(end, shown), device=n.device)
        for column in torch.where(cols < n[:, None], self.out[:rows, cols], pad).cpu().t():
            streamer.put(column)
        return max(end, shown)

    def stop_at(self, criteria, prompt: torch.Tensor, checked: list, ended: dict | None = None) -> list:
        """Run `criteria` at every position p each row emitted after its `checked` count (host ints, one a row), as
        transformers' per-token check runs them, on the prompt [rows, L] and the first p emitted tokens (every row's,
        though only rows that emitted p are read); a row they stop at p ends there: its emitted count becomes p (the
        round's later tokens become pad) and it is done. With `ended` (no EOS, so transformers pads no row: row ->
        the position they stopped it at, filled in here) the row runs on instead, and once every row has ended, all
        end at the last of those positions, as there. Returns the rows' emitted counts, all now checked."""
        rows = len(checked)
        n = self.n_out[:rows].tolist()
        stopped = set()
        for p in range(min(checked) + 1, max(n) + 1):
            live = [b for b in range(rows) if checked[b] < p <= n[b] and (ended is None or b not in ended)]
            if live:
                hit = criteria(torch.cat([prompt, self.out[:rows, :p]], dim=1), None).tolist()
                for b in live:
                    if hit[b] and ended is not None:
                        ended[b] = p
                    elif hit[b]:
                        n[b] = p
                        stopped.add(b)
        if ended is not None and len(ended) == rows:  # the call ends at `end`: rows short of it run on to it
            end = max(ended.values())
            self.max_new.fill_(end)
            self.n_out[:rows].clamp_(max=end)
            self.engine.state["done"][:rows] |= self.n_out[:rows] >= self.max_new
        if stopped:
            at = torch.tensor(sorted(stopped), device=self.n_out.device)
            self.n_out[at] = torch.tensor([n[b] for b in sorted(stopped)], device=self.n_out.device)
            self.engine.state["done"][at] = True
        return n

    def acceptance_length(self, rows: int) -> float:
        """Mean tokens emitted per round (τ) over the last generate's first `rows` rows."""
        return float((self.n_out[:rows] - 1).sum() / self.rounds[:rows].sum().clamp(min=1))
