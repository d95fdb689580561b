"""The target's work: verify a session's K draft tokens, for every session of a step at once.

One forward scores [uncached committed tokens + d_1..d_K]; then all sessions whose verify completed in
the step are verified together: greedy sessions with verify_greedy_batched (one argmax, each chain walked
in host ints), the others with rejection_sample_batched (specdec.math.rejection) over the batch's
SpecDecodeMetadata (flattened drafts) and its q (the sessions' DraftProbs, one-hot for deterministic
drafts, made dense by the math module), each with its own sampling parameters and seed; a sampled session with a
race seed (a seeded request) by the keyed race instead (specdec.math.race): every row's token is the race winner
over p at its position, keyed by the race seed, and the drafts are accepted while they equal it, so the output
depends on the seed alone, never on the proposals (no q). The target's p at
every row is what the target alone would compute at that position: logit_bias and the penalties (over the
committed tokens plus the drafts before the row: specdec.math.penalties) are applied before the greedy
argmax or the sampling distribution. When asked, the log-probabilities of the committed tokens (the
accepted drafts and the next token) come back too. Under structured output each row's logits outside the
grammar's mask for that position (sent by the coordinator, which advanced the grammar through the drafts
before it) are -inf before anything else, so p is the constrained target's. The session then keeps the
committed prefix plus the accepted drafts: a crop, which is a length change.

A work may carry a token tree instead of a chain (`parents`, specdec.math.tree's layout: the drafts are
its nodes in node order, fed after the uncached committed tokens, each seeing its prefix and its
ancestors). Tree works are verified batched by scheme (specdec.math.tree_verify): greedy sessions walk the
target's argmax; without q, the nodes are deterministic candidates, checked against one draw from p per
level (a uniform keyed by the round's seed and the level); with q, SpecInfer's multi-step speculative sampling
(siblings drawn independently) or recursive rejection sampling (siblings drawn without replacement). The
accepted path's KV entries (stored at committed_len + node index) are then moved to committed_len +
0..n-1 (SlotKVCache.move: a copy inside the slot, no forward) and the session cropped to them. A tree
takes logit_bias, min_p and the rest of the sampling parameters, but not the penalties (their counts
would differ per branch): the servicer refuses that mix.

A work may ask for the outputs of some decoder layers (feature_layers: an EAGLE-3 head's features). Its steps
tap them (Work.taps, specdec.engine.runner.Feed.taps) at every token it feeds, prefill chunks included, and the
result carries the rows of the positions the verdict keeps: the committed tokens it fed, then the accepted
drafts (a tree's accepted path), positions prefix_len .. cached_len - 1.

A work may run on (run_on_seeds): after its verdict (the accepted drafts kept, a tree's path moved into place)
it feeds next_token and is verified again in the next step as the next target-only round would be (its seed,
its penalties and logprobs), up to one token per seed, ending early after an EOS token or at the context's
end; the result carries the later tokens in `run_on`, and its verdict on the drafts is the first round's.
Each of those steps is an ordinary step of the batch, so run-on sessions batch with every other; except that
a greedy session stepping alone (nothing else queued) runs its run-on as one chain on the device
(StepConfig.run_on_chain; specdec.engine.draft_chain with the verdict's own argmax): the same forwards, one host
round trip instead of one a token, the tokens after an EOS dropped. A work asked for parts (`part`) pushes
a partial result (Engine.push) each time `part` more of its tokens are known and more are to come, so its
caller can pass them on while the run-on goes on; such a work steps one token at a time (no chain).

A work may ask for its prompt's logprobs (prompt_logprobs: a full send's, for scoring a text as lm-eval's
loglikelihood does): it wants the logits of every token it feeds (Work.all_rows), prefill chunks included, and
scores each chunk's rows as they come (score_fed), keeping only the scores: the row at position j gives the
log-softmax of the target's raw logits there (the model's own distribution, vLLM's prompt logprobs), at the token
at j + 1 and its top alternatives. The result carries them for the new committed tokens after the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdec.engine.draft_chain import ChainFeed, CheckedArgmax, run_chain
from specdec.engine.draft_probs import DraftProbs
from specdec.engine.longs import longs
from specdec.engine.spec_metadata import SpecDecodeMetadata
from specdec.engine.work import Work
from specdec.math.params import SamplingParams
from specdec.math.keyed_draws import split_seeds
from specdec.math.race import race_draw
from specdec.math.rejection import rejection_sample_batched, round_randomness, verify_greedy_batched, walk_chains
from specdec.math.penalties import TokenCounts
from specdec.math.sampling import adjust_logits_rows, logprobs_rows, make_generator, process_logits_rows, top_logprobs
from specdec.math.seeds import derive_seed
from specdec.math.tree import tree_depth
from specdec.math.tree_verify import (level_uniforms, num_levels, verify_tree_candidates_batched,
                                      verify_tree_greedy_batched, verify_tree_sampled_batched, walk_matching)

MAX_TOP_LOGPROBS = 20  # alternatives per committed token (OpenAI's cap)
MAX_FEATURE_LAYERS = 8  # decoder layers a request may ask the features of (an EAGLE-3 head reads 3)

# Tree schemes (VerifyWork.scheme), as the wire names them
CANDIDATES = "candidates"  # deterministic candidates: no q (suffix / lookup matches, an unsampled draft's top-b)
IID = "iid"  # sampled siblings, each drawn independently from its q row (SpecInfer's MSS)
WITHOUT_REPLACEMENT = "without_replacement"  # siblings drawn without replacement from their parent's q (RSD)
LEVEL_STREAM = 3  # derive_seed stream of the candidates scheme's per-level draws (keyed by the round seed and level)


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int  # a committed token
    logprob: float  # its log-probability under the target's processed distribution at its position
    top_ids: list[int]  # the most likely tokens there, most likely first
    top_logprobs: list[float]  # their log-probabilities
    rank: int = 0  # prompt scores: 1 + the tokens more likely there (0: not computed)


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int  # n: leading drafts accepted
    next_token: int  # the bonus (n == K) or the recovered token (n < K)
    cached_len: int  # tokens the session now caches: committed + n
    compute_ms: float  # steps this request took part in (their forwards, its last one's verification)
    batch_sessions: int  # sessions in the step that verified it
    batch_tokens: int  # tokens in that step
    step_ms: float  # that step's time: the forward and the verification of the batch's rows
    queue_ms: float  # waiting, not computing
    reused: int = 0  # leading tokens of a fresh start taken from the prefix cache, not fed
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per committed token, when asked
    path: tuple[int, ...] = ()  # token trees: the accepted nodes, root-down (a chain: 0..n-1)
    tree: bool = False  # the drafts were a token tree
    # With feature layers: [cached_len - features_start, layers x hidden] bfloat16, the features of the committed
    # tokens the request fed, then of the accepted drafts (a tree's: its accepted path's nodes, root-down)
    features: torch.Tensor | None = None
    features_start: int = 0  # the position of the first of them: the session's cached length before the request
    run_on: tuple[int, ...] = ()  # run-on: the tokens decoded after next_token, each a target-only round's
    step_id: int = 0  # the step batch_sessions, batch_tokens and step_ms describe (Work.step_id)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when asked: the new tokens' after the first


@dataclass(eq=False)
class VerifyWork(Work):
    drafts: list[int] = field(default_factory=list)  # d_1..d_K
    q: DraftProbs | None = None  # q_1..q_K; None = one-hot on each d_i (greedy rounds, deterministic proposers)
    params: SamplingParams = SamplingParams()
    seed: int = 0  # this round's seed (accept/reject draws and the final sample)
    race_seed: int = 0  # nonzero: a sampled session's tokens are the keyed race's at their positions (q unused)
    committed_len: int = 0  # prefix_len + new committed tokens
    prompt_len: int = 0  # the session's prompt tokens: the penalties count the tokens after them as output
    logprobs: int = -1  # -1: none; n >= 0: the committed tokens' logprobs and the top n alternatives
    parents: list[int] | None = None  # a token tree: each draft's parent (-1 = the root); None = a chain
    tree: bool = False  # the drafts were a token tree (parents is cleared once the work runs on)
    scheme: str = ""  # a tree's scheme: CANDIDATES (no q), IID or WITHOUT_REPLACEMENT (with q); greedy ignores it
    allowed: torch.Tensor | None = None  # structured output: [K + 1, V] bool, the tokens allowed at each position
    run_on_seeds: list[int] = field(default_factory=list)  # run-on: the seeds of the target-only rounds still to run
    part: int = 0  # run-on: push a partial result each time this many more of the round's tokens are known (0: none)
    parted: int = 0  # the round's tokens the last partial result held
    verdicts: list[tuple[list[int], int, list[TokenLogprobs]]] = field(default_factory=list)  # run-on: the rounds so far
    prompt_logprobs: int = -1  # -1: none; n >= 0: the new tokens' logprobs after the first, with the top n alternatives
    scored: list[int] = field(default_factory=list)  # with prompt_logprobs: the tokens still to score, in order
    prompt_scores: list[TokenLogprobs] = field(default_factory=list)  # with prompt_logprobs: those scored so far

    kind: ClassVar[str] = "verify"

    @classmethod
    def create(cls, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], drafts: list[int],
               q: DraftProbs | None, params: SamplingParams, seed: int, prompt_len: int = 0,
               logprobs: int = -1, parents: list[int] | None = None, scheme: str = "",
               allowed: torch.Tensor | None = None, feature_layers: list[int] = (),
               run_on_seeds: list[int] = (), run_on_part: int = 0, prompt_logprobs: int = -1,
               race_seed: int = 0) -> "VerifyWork":
        """feature_layers: decoder layers whose outputs (EAGLE-3 features) the result carries at every position
        the request adds to the session (VerifyResult.features); empty: none. run_on_seeds: after its verdict
        (no masks or features) the work decodes up to this many more tokens, one target-only round each, the
        i-th with run_on_seeds[i] as its seed (VerifyResult.run_on). run_on_part: push a partial result each
        time this many more of the round's tokens are known (0: none; needs an on_push). prompt_logprobs: -1 none;
        n >= 0: the logprobs of new_tokens[1:] (each under the raw distribution at the position before it) with the
        top n alternatives (VerifyResult.prompt_logprobs). race_seed: nonzero, a sampled work verifies by the keyed
        race with this key (its run-on rounds too), q None."""
        return cls(session_id=session_id, prefix_len=prefix_len, prefix_hash=prefix_hash,
                   pending=list(new_tokens) + list(drafts), num_logits=len(drafts) + 1, drafts=list(drafts), q=q,
                   params=params, seed=seed, committed_len=prefix_len + len(new_tokens), prompt_len=prompt_len,
                   logprobs=logprobs, parents=list(parents) if parents else None, tree=bool(parents), scheme=scheme,
                   allowed=allowed, taps=tuple(feature_layers) or None, run_on_seeds=list(run_on_seeds),
                   part=run_on_part if run_on_seeds else 0, prompt_logprobs=prompt_logprobs,
                   all_rows=prompt_logprobs >= 0, scored=list(new_tokens[1:]) if prompt_logprobs >= 0 else [],
                   race_seed=race_seed)

    def runs_on(self, next_token: int, kept: int, engine) -> bool:
        """After a verdict (the session holds `kept` tokens: the committed ones and the accepted drafts), whether
        the work runs on: it has a seed left, next_token is no EOS and the context has room. If so it becomes the
        next target-only round: next_token fed, no drafts, its logits scored with the next seed."""
        if not self.run_on_seeds or next_token in engine.eos_token_ids or kept + 1 >= engine.max_context:
            return False
        self.pending, self.num_logits, self.committed_len = [next_token], 1, kept + 1
        self.all_rows = False  # (the prompt was scored)
        self.drafts, self.q, self.parents = [], None, None
        self.seed = self.run_on_seeds.pop(0)
        return True

    def chain_length(self, engine, alone: bool) -> int:
        """After runs_on: the run-on forwards to take as one chain (0: step by step). Only a greedy session
        whose logits nothing adjusts or masks, with no logprobs or taps, that stepped alone with nothing
        queued; as many as its seeds left and the context allow, two at least."""
        if not (alone and engine.config.step.run_on_chain and self.params.greedy and not self.params.adjusts_logits
                and self.allowed is None and self.logprobs < 0 and not self.taps and not self.part):
            return 0
        steps = min(1 + len(self.run_on_seeds), engine.max_context - self.committed_len)
        return steps if steps > 1 else 0  # a chain of one forward saves no round trip

    @classmethod
    def run_chain(cls, works: list["VerifyWork"], engine) -> None:
        """The run-on forwards as one chain: each feeds the token the last one's argmax chose."""
        sampler = CheckedArgmax(len(works), engine.device)
        feeds = [ChainFeed(w.session.slot, len(w.session), w.pending[0]) for w in works]
        out = run_chain(engine.runner, feeds, works[0].chain_steps, sampler)
        if not all(sampler.all_finite()):
            raise RuntimeError("the model produced non-finite logits")
        for w, drawn in zip(works, out.tokens):
            w.verdicts += [([], t, []) for t in drawn]

    @classmethod
    def finish_chain(cls, works: list["VerifyWork"], engine) -> None:
        """After run_chain, with the engine's lock: the rounds up to the first EOS kept, the session holding
        their fed tokens (the last round's token not yet in the cache, as after any verdict)."""
        for w in works:
            rounds = w.verdicts[-w.chain_steps:]
            kept = next((j + 1 for j, (_, t, _) in enumerate(rounds) if t in engine.eos_token_ids), len(rounds))
            del w.verdicts[len(w.verdicts) - len(rounds) + kept:]
            engine.sessions.append(w.session, w.pending + [t for _, t, _ in rounds[: kept - 1]])
            w.pending, w.chain_steps = [], 0
            w.result = w.final_result(len(w.session), None, 0)

    def final_result(self, keep: int, features: torch.Tensor | None, start: int) -> VerifyResult:
        """The answer once the last round's verdict is in `verdicts`: the first round's verdict, the run-on rounds'
        tokens after it; keep: the session's cached length."""
        sessions, tokens, _ = self.last_step
        step_ms, compute_ms, queue_ms = self.finished_step()  # the verification counted in the step
        (path, nxt, reported), *later = self.verdicts
        return VerifyResult(len(path), nxt, keep, compute_ms, sessions, tokens, step_ms, queue_ms, self.reused,
                            reported + [x for _, _, lp in later for x in lp], tuple(path), self.tree,
                            features, start, tuple(t for _, t, _ in later), self.step_id, self.prompt_scores)

    def partial_result(self, cached_len: int) -> VerifyResult:
        """A part of the round ahead of its result: the first round's verdict and the run-on tokens so far (the
        timings and the logprobs are the final result's alone)."""
        self.parted = len(self.verdicts)
        (path, nxt, _), *later = self.verdicts
        return VerifyResult(len(path), nxt, cached_len, 0.0, 0, 0, 0.0, 0.0, self.reused, path=tuple(path),
                            tree=self.tree, run_on=tuple(t for _, t, _ in later))

    def feed_tree(self) -> list[int] | None:
        return self.parents

    def score_fed(self, rows: torch.Tensor, complete: bool) -> torch.Tensor:
        """Prompt logprobs: the rows of the fed tokens before the feed's last num_logits, each (position j) scoring the
        token at j + 1 (_scores); returns the last num_logits rows (the verdict's)."""
        n = len(rows) - (self.num_logits if complete else 0)
        if n > 0:
            tokens, self.scored = self.scored[:n], self.scored[n:]
            self.prompt_scores += _scores(rows[:n], tokens, self.prompt_logprobs)
        return rows[max(n, 0):]

    def committed_features(self, path: list[int], cached_len: int) -> tuple[torch.Tensor, int]:
        """(features, features_start) once the verdict keeps the accepted `path`: the rows of the committed
        tokens it fed (every one: a work with taps takes no cached prefix), then the accepted nodes' rows in
        path order (a chain's path is 0..n-1: the first committed + n rows); exactly prefix_len .. cached_len - 1."""
        fed = torch.cat(self.fed_features)  # [committed tokens fed + K, W], over the work's steps
        committed = len(fed) - len(self.drafts)
        rows = fed[list(range(committed)) + [committed + j for j in path]]
        start = self.committed_len - committed  # the first fed token's position
        if start != self.prefix_len or start + len(rows) != cached_len:
            raise RuntimeError(f"{len(rows)} feature rows from position {start} do not cover prefix_len "
                               f"{self.prefix_len} .. cached_len {cached_len} - 1")
        return rows, start

    def token_counts(self, first_row: int, vocab_size: int, device) -> TokenCounts:
        """The penalties' counts at this work's K + 1 positions, rows first_row.. of the batch: position i
        sees the committed tokens plus d_1..d_i (the session holds them all once the forward ran)."""
        return TokenCounts.at_positions(self.session.tokens, self.prompt_len, self.committed_len, len(self.drafts) + 1,
                                        first_row, vocab_size, device)

    @classmethod
    def finish_step(cls, works: list["VerifyWork"], logits: list[torch.Tensor], engine) -> None:
        logits = [lg if w.allowed is None else lg.masked_fill(~w.allowed.to(lg.device), float("-inf"))
                  for w, lg in zip(works, logits)]  # structured output: outside the grammar p is 0, first of all
        trees = [i for i, w in enumerate(works) if w.parents is not None]
        chains: dict = {}  # greedy (no q), the keyed race, rejection sampling
        for i, w in enumerate(works):
            if w.parents is None:
                greedy = w.params.greedy
                chains.setdefault(_verify_greedy if greedy and w.q is None else _verify_raced if w.race_seed and not greedy
                                  else _verify_sampled, []).append(i)
        outcome: dict[int, tuple[list[int], int]] = {}  # (accepted nodes, next token); a chain's: 0..n-1
        for verify, subset in chains.items():
            n, nxt = verify([works[i] for i in subset], [logits[i] for i in subset], engine.vocab_size)
            outcome.update((i, (list(range(k)), t)) for i, k, t in zip(subset, n, nxt))
        if trees:
            outcome.update(zip(trees, _verify_trees([works[i] for i in trees], [logits[i] for i in trees],
                                                    engine.vocab_size)))
        asked = [i for i, w in enumerate(works) if w.logprobs >= 0]
        reported = _logprobs([works[i] for i in asked], [logits[i] for i in asked], [outcome[i] for i in asked],
                             engine.vocab_size) if asked else []
        logprobs = dict(zip(asked, reported))
        for i, w in enumerate(works):
            path, nxt = outcome[i]
            keep = w.committed_len + len(path)
            if w.parents is None:
                engine.sessions.crop(w.session, keep)  # the committed prefix plus the accepted drafts
            else:  # the accepted path's entries moved into place, then the same crop
                engine.cache.move(w.session.slot, [w.committed_len + j for j in path],
                                  list(range(w.committed_len, keep)))
                engine.sessions.crop(w.session, w.committed_len)
                engine.sessions.append(w.session, [w.drafts[j] for j in path])
            if w.runs_on(nxt, keep, engine):  # the next target-only round, in the next step (or a chain)
                w.verdicts.append((path, nxt, logprobs.get(i, [])))
                w.chain_steps = w.chain_length(engine, alone=w.last_step[0] == 1 and not engine.others_waiting())
                if w.part and len(w.verdicts) - w.parted >= w.part:
                    engine.push(w, [w.partial_result(keep)])
                continue
            features, start = w.committed_features(path, keep) if w.taps else (None, 0)
            w.verdicts.append((path, nxt, logprobs.get(i, [])))
            w.result = w.final_result(keep, features, start)


def _row_params(works, num_draft_tokens) -> list[SamplingParams]:
    """Each of the batch's rows' parameters: a session's K_b + 1 rows (a tree's N_b + 1) share them."""
    return [w.params for w, k in zip(works, num_draft_tokens) for _ in range(k + 1)]


def _row_params_and_counts(works, num_draft_tokens, vocab_size,
                            device) -> tuple[list[SamplingParams], TokenCounts | None]:
    """_row_params, and the token counts of the penalised sessions' rows."""
    row_params = _row_params(works, num_draft_tokens)
    if not any(w.params.penalized for w in works):
        return row_params, None
    starts = [0]  # each session's first row: K_1 + 1, K_1 + K_2 + 2, ... (host ints: no device sync)
    for k in num_draft_tokens:
        starts.append(starts[-1] + k + 1)
    counts = TokenCounts.cat([w.token_counts(start, vocab_size, device)
                              for w, start in zip(works, starts) if w.params.penalized])
    return row_params, counts


def _verify_greedy(works, logits, vocab_size):
    rows = torch.cat(logits) if len(logits) > 1 else logits[0]  # [N + B, V]
    drafts = [w.drafts for w in works]
    if any(w.params.adjusts_logits for w in works):  # the argmax of the biased, penalised logits
        ks = [len(d) for d in drafts]
        rows = adjust_logits_rows(rows, *_row_params_and_counts(works, ks, vocab_size, rows.device))
    return verify_greedy_batched(rows, drafts)


def _verify_sampled(works, logits, vocab_size):
    rows = torch.cat(logits)  # [N + B, V]
    device = rows.device
    meta = SpecDecodeMetadata.build([w.drafts for w in works], device)
    p = process_logits_rows(rows, *_row_params_and_counts(works, meta.num_draft_tokens, vocab_size, device))  # [N+B, V]
    q = DraftProbs.cat([w.q if w.q is not None else DraftProbs.one_hot(w.drafts) for w in works])
    generators = [make_generator(w.seed, device) for w in works]
    uniform, at = round_randomness(generators, meta.num_draft_tokens, device)
    n, nxt = rejection_sample_batched(p, q.dense(vocab_size, device), meta.draft_token_ids, meta.cu_num_draft_tokens,
                                      uniform, at)
    return n.tolist(), nxt.tolist()  # one copy to the host each


def _verify_raced(works, logits, vocab_size):
    rows = torch.cat(logits)  # [N + B, V]
    ks = [len(w.drafts) for w in works]
    p = process_logits_rows(rows, *_row_params_and_counts(works, ks, vocab_size, rows.device))  # [N + B, V]
    x = _race_rows(works, p, [range(k + 1) for k in ks])
    return walk_chains(x.tolist(), [w.drafts for w in works])  # one copy to the host


def _race_rows(works, p, levels) -> torch.Tensor:
    """Each row's race winner: work b's row j draws the token at position committed_len + levels[b][j]."""
    seeds = split_seeds([w.race_seed for w, lv in zip(works, levels) for _ in lv], p.device)
    positions = longs([w.committed_len + d for w, lv in zip(works, levels) for d in lv], p.device)
    return race_draw(p, seeds, positions)


def _logprobs(works, logits, outcomes, vocab_size) -> list[list[TokenLogprobs]]:
    """Per work, its committed tokens' logprobs and top alternatives: the committed token m is scored by
    the row of its parent (row 0 for the first, row j + 1 after node j), so a chain's rows are 0..n and a
    tree's are 0 and its accepted path's nodes + 1."""
    rows = torch.cat([lg[[0] + [j + 1 for j in path]] for lg, (path, _) in zip(logits, outcomes)])  # [sum (n_b + 1), V]
    committed = [[w.drafts[j] for j in path] + [nxt] for w, (path, nxt) in zip(works, outcomes)]
    row_params = [w.params for w, c in zip(works, committed) for _ in c]
    starts = torch.tensor([0] + [len(c) for c in committed]).cumsum(0).tolist()
    counts = TokenCounts.cat([TokenCounts.at_positions(w.session.tokens, w.prompt_len, w.committed_len, len(c), start,
                                                       vocab_size, rows.device)
                              for w, c, start in zip(works, committed, starts) if w.params.penalized])  # chains only
    tokens = torch.tensor([t for c in committed for t in c], device=rows.device)
    top_n = max(w.logprobs for w in works)
    chosen, ids, vals = top_logprobs(logprobs_rows(rows, row_params, counts), tokens, top_n)
    chosen, ids, vals = chosen.tolist(), ids.tolist(), vals.tolist()  # one copy to the host
    out = []
    for w, c, start in zip(works, committed, starts):
        out.append([TokenLogprobs(t, chosen[start + j], ids[start + j][: w.logprobs], vals[start + j][: w.logprobs])
                    for j, t in enumerate(c)])
    return out


def _scores(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprobs]:
    """Each row's token scored under the log-softmax of the raw logits [R, V], with its top_n alternatives and its
    rank (1 + the entries above it). The logits less their log-sum-exp rather than a log-softmax of every entry, and
    the rank counted in numpy on a CPU: 17 against 41 ms for 128 rows of 49,152 on this project's CPU."""
    lse = torch.logsumexp(logits, dim=-1)  # [R]
    picked, ids, vals = top_logprobs(logits, longs(tokens, logits.device), top_n)  # (of the logits: shifted below)
    if logits.device.type == "cpu":
        ranks = ((logits.numpy() > picked.numpy()[:, None]).sum(axis=-1) + 1).tolist()
    else:
        ranks = ((logits > picked[:, None]).sum(dim=-1) + 1).tolist()
    chosen, vals = (picked - lse).tolist(), (vals - lse[:, None]).tolist()  # one copy to the host each
    return [TokenLogprobs(*x) for x in zip(tokens, chosen, ids.tolist(), vals, ranks)]


def _verify_trees(works: list[VerifyWork], logits: list[torch.Tensor], vocab_size: int) -> list[tuple[list[int], int]]:
    """Each tree work's (accepted path, next token), verified batched per scheme."""
    out: list[tuple[list[int], int] | None] = [None] * len(works)
    by_scheme: dict = {}  # greedy, the keyed race, candidates (no q), sampled (q)
    for i, w in enumerate(works):
        by_scheme.setdefault(_tree_greedy if w.params.greedy else _tree_raced if w.race_seed else
                             _tree_candidates if w.q is None else _tree_sampled, []).append(i)
    for verify, subset in by_scheme.items():
        sub = [works[i] for i in subset]
        rows = torch.cat([logits[i] for i in subset])  # [N + B, V]
        meta = SpecDecodeMetadata.build([w.drafts for w in sub], rows.device)
        verdict = verify(sub, rows, meta, longs([p for w in sub for p in w.parents], rows.device), vocab_size)
        paths, counts = verdict.path.tolist(), verdict.num_accepted.tolist()
        for i, path, n, nxt in zip(subset, paths, counts, verdict.next_token.tolist()):
            out[i] = (path[:n], nxt)
    return out


def _tree_greedy(works, rows, meta, parents, vocab_size):
    if any(w.params.adjusts_logits for w in works):  # the argmax of the biased logits (trees take no penalties)
        rows = adjust_logits_rows(rows, _row_params(works, meta.num_draft_tokens))
    return verify_tree_greedy_batched(rows, meta.draft_token_ids, parents, meta.cu_num_draft_tokens)


def _row_probs(works, rows, meta):
    return process_logits_rows(rows, _row_params(works, meta.num_draft_tokens))


def _tree_raced(works, rows, meta, parents, vocab_size):
    """The race winner at every row (the root's at committed_len, node i's at committed_len + its depth + 1),
    followed down the children holding it."""
    p = _row_probs(works, rows, meta)  # [N + B, V]
    depth, levels = tree_depth(parents, meta.cu_num_draft_tokens).tolist(), []
    for start, k in zip(meta.cu_num_draft_tokens.tolist(), meta.num_draft_tokens):
        levels.append([0] + [d + 1 for d in depth[start : start + k]])
    return walk_matching(_race_rows(works, p, levels), meta.draft_token_ids, parents, meta.cu_num_draft_tokens)


def _tree_candidates(works, rows, meta, parents, vocab_size):
    p = _row_probs(works, rows, meta)  # [N + B, V]
    levels = num_levels(parents, meta.cu_num_draft_tokens)
    generators = [[make_generator(derive_seed(w.seed, d, LEVEL_STREAM), rows.device) for d in range(n)]
                  for w, n in zip(works, levels)]
    at = level_uniforms(generators, rows.device)  # [B, L]
    return verify_tree_candidates_batched(p, meta.draft_token_ids, parents, meta.cu_num_draft_tokens, at)


def _tree_sampled(works, rows, meta, parents, vocab_size):
    device = rows.device
    p = _row_probs(works, rows, meta)  # [N + B, V]
    q = DraftProbs.cat([w.q for w in works]).dense(vocab_size, device)  # [N, V]
    generators = [make_generator(w.seed, device) for w in works]
    uniform, at = round_randomness(generators, meta.num_draft_tokens, device)
    without = torch.tensor([w.scheme == WITHOUT_REPLACEMENT for w in works], device=device)
    return verify_tree_sampled_batched(p, q, meta.draft_token_ids, parents, meta.cu_num_draft_tokens, uniform, at,
                                       without)
