"""One step on one rank (DESIGN.md §6).

    apply drops and feeds → read the new requests' tensors → ONE agreement
    all_gather (when requests join or leave) → ONE batched decode forward
    for every running request → ONE batched prefill forward for the
    requests that join → sample every row (rank 0) → let go of what the
    reads lent (every rank; `reader.end_step`); rank 0's loop then releases
    the joiners' claims from `Accepted` (`loop.Admission.release`)

The engine holds the batch: one row of the `RowCache` per running request,
in the order the plans made them (joins append in plan order, leaves
swap-remove in plan order), so every rank holds the same rows in the same
order by construction. It holds no policy: which requests join, leave or
stop, and the token each row feeds next, arrive in the plan.

Prompt log probabilities (`prompt_scores`): a joiner that asks keeps its
prefill's hidden states, scored after the forward (chunk by chunk for a
long prompt). Such a prompt never takes cached blocks (`_match`); a
failure to score it fails that request alone (`_unscored`).

Chunked prefill: a prompt longer than `prefill_chunk` tokens (the
`max_prefill_tokens` setting) is prefilled one chunk a step, in a cache of
one row of its own, while the running rows go on decoding each step; its
row joins the batch, and its first token is sampled, with its last chunk.
Long prompts queue for this one at a time, in plan order. Media go with
their placeholders: each chunk gets the rows of the encoder outputs its
placeholders take (the encoder's outputs are computed apart, which every
family does with the encoder cache on); with `encoder_cache_bytes` 0 the
model encodes media inside its forward, and a request with media is
prefilled whole (admission refuses one longer than a chunk).

Isolation: a request's tensors are checked (readable, finite) on every rank
before the agreement, so a bad one is dropped everywhere before any model
collective. What a joiner's prefill needs besides the forward — its encoder
outputs (encoded alone when the step's batched encode raises, and checked
against its placeholder count) and its positions — is made per request and,
under TP, agreed on in one more gather, so a request that fails there (on
any rank) fails alone and every rank drops it before the forward. A prefill
forward that raises is undone and each joiner tried alone; under TP the
ranks agree on each prefill forward, and on each chunk of a long prompt,
first (`Engine._agreed_run`). A decode forward that raises fails the running
rows (typed) and the group goes on; under TP it is agreed on too (over gloo or
NCCL the rank that failed makes the sums the others still make,
`counted_sums`; where it cannot, it ends the group). What
can only fail on rank 0 (sampling, non-finite logits of one row) fails that
request alone: it is reported in `StepOutcome.rejected` and the loop drops
it on every rank in the next plan.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmsplit.errors import E, MmsplitError
from mmsplit_server import families
from mmsplit_server.families import Family
from mmsplit_server.structured import Broken, Constraint, Grammars
from scheduler_svc import media_inputs
from scheduler_svc.agreement import agree_on_failures
from scheduler_svc.collective import Collective
from scheduler_svc.counted_sums import CountedSums
from scheduler_svc.encoder_cache import EncoderCache
from scheduler_svc.head_layout import lay_out
from scheduler_svc.intake import Intake, ItemTensors
from scheduler_svc.kvcache import ForwardInputs, RowCache
from scheduler_svc.lean_decode import lean_decode_body
from scheduler_svc.media_inputs import Joiner, MediaInputs
from scheduler_svc.plan import Failure, NewRequest, Plan, StepOutcome
from scheduler_svc.prefix_cache import BLOCK_TOKENS, NO_MATCH, Match, PrefixCache, Runs, chain, tail_key
from scheduler_svc.prefix_cache import root as prefix_root
from scheduler_svc.prompt_scores import score_prompt
from scheduler_svc.reader import TensorReader
from scheduler_svc.sampler import Bans, LogitAdjust, Logprob, RowSampling, Sampler, make_generator
from scheduler_svc.shm_allreduce import Arena, SumAborted
from scheduler_svc.threads import StepKind, StepRun, StepThreads

log = logging.getLogger(__name__)

# The agreement's cache digest: 31 bits for the encoder cache, 31 for the prefix cache.
_HALF_BITS = 31
_HALF = (1 << _HALF_BITS) - 1
# Right-padding of prompts in a batched prefill; never attended (the mask
# hides it), so any id inside the vocabulary that is not a placeholder works.
PAD_ID = 0


@dataclass
class Row:
    request: NewRequest
    # The token this row feeds next (set from each plan); None until sampled.
    feed: int | None = None
    sampling: RowSampling | None = field(default=None, repr=False)  # rank 0 only
    # M-RoPE families: added to every position after the prompt.
    rope_delta: int = 0
    # The tokens fed after the prompt (each plan's feed), and the prompt's
    # items as the prefix cache keys them: what its blocks are kept under.
    fed: list[int] = field(default_factory=list)
    runs: Runs = field(default_factory=Runs)
    # The first keys of its blocks' chain, as far as made so far (its
    # match, then each keep): a keep goes on from them.
    chain: list[bytes] = field(default_factory=list)


@dataclass
class _Chunked:
    """A long prompt being prefilled a chunk a step, in a cache of its own."""

    joiner: Joiner
    cache: RowCache
    done: int = 0  # prompt tokens prefilled so far
    # prompt_logprobs of its chunks so far (rank 0; None once making them failed).
    scores: list[Logprob] | None = field(default_factory=list)
    # Joiners with the same prompt (`Engine._twins`), of its step or of one
    # while its chunks were under way: each takes a copy of its row and
    # logits once its last chunk is in.
    followers: list[Joiner] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        coll: Collective,
        reader: TensorReader,
        device: torch.device,
        *,
        eos_token_ids: frozenset[int],
        family: Family | None = None,
        token_chunk: int = 256,
        encoder_cache_bytes: int = 0,
        hook: Any = None,
        prefill_chunk: int = 0,
        prefix_cache_bytes: int = 0,
        threads: StepThreads | None = None,
        grammars: Grammars | None = None,
        cudnn_attention: bool = False,
        decode_kv_multiple: int = 1,
        head_layout: str = "auto",
        lean_decode: bool = True,
        share_prefills: bool = True,
    ) -> None:
        self.model = model
        # Identical prompts joining in one step prefilled once (`_prefill`);
        # False (benchmarks' baseline): each in a row of its own.
        self.share_prefills = share_prefills
        # Rank 0's compiler of structured-output constraints (None: requests with a structure fail).
        self._grammars = grammars
        # The adapter builds positions (M-RoPE); by default from the model's own config.
        self.family = family or families.from_config(model.config.to_dict())  # type: ignore[operator,union-attr]
        self.coll = coll
        self.reader = reader
        self.device = device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        # Prefill runs the whole multimodal body (it has images to merge);
        # decode feeds text tokens only, so it skips the wrapper and runs the
        # language model directly where the family has one.
        self._prefill_body: torch.nn.Module = model.model  # type: ignore[assignment]
        # Where nothing could tell, without transformers' module calls around
        # its layers (`lean_decode`: the same operations, checked at start-up).
        text_model: torch.nn.Module = getattr(model.model, "language_model", model.model)  # type: ignore[arg-type]
        layers = int(model.config.get_text_config().num_hidden_layers)  # type: ignore[union-attr,operator]

        def new_cache(layers: int) -> RowCache:
            return RowCache(
                layers, dtype=self.dtype, device=device, token_chunk=token_chunk, decode_kv_multiple=decode_kv_multiple
            )

        self.cache = new_cache(layers)
        self._decode_body: Callable[..., Any] = text_model
        if lean_decode:
            self._decode_body = lean_decode_body(text_model, make_cache=new_cache)
        # On CUDA, torch's attention without cuDNN's kernel unless asked for
        # (`--cudnn-attention`): it plans a graph on the host for each new shape.
        self._kernels = _attention_kernels(device, cudnn=cudnn_attention)
        self.rows: list[Row] = []  # row i of the cache
        self.index: dict[str, int] = {}
        self._active_per_rank = [0] * coll.world_size
        self.sampler = Sampler(eos_token_ids)
        # Encoder outputs of items seen before (families that take them precomputed).
        self.encoder_cache = EncoderCache(encoder_cache_bytes if self.family.caches_encoder_outputs else 0)
        self._hidden = int(model.config.get_text_config().hidden_size)  # type: ignore[union-attr,operator]
        self._media = MediaInputs(
            self.family,
            self._prefill_body,
            self.encoder_cache,
            device=device,
            dtype=self.dtype,
            hidden=self._hidden,
            rank=coll.rank,
            failed_on=self._failed_on,
            hook=hook,
        )
        self._intake = Intake(reader, coll.rank)
        self._keys: dict[str, list[bytes]] = {}  # this step's new requests: each item's cache key
        # Fault injection for tests (the `engine_hook` setting): before_prefill, on_encoded, in_prefill_forward,
        # in_decode_forward, before_keep, before_scoring.
        self._hook = hook
        # A local CPU group's shared-memory TP sums, which a failed forward aborts.
        self._arena: Arena | None = getattr(coll, "arena", None)
        # Else, under TP, the group's own sums, counted: a failed forward drains them.
        self._sums: CountedSums | None = getattr(coll, "sums", None)
        self._ran = torch.zeros(1, dtype=torch.int64)  # summed after each decode forward under TP (`_decode`)
        # Prompts longer than this are prefilled a chunk a step (0: never).
        self.prefill_chunk = prefill_chunk
        self._layers = layers
        self._token_chunk = token_chunk
        self._chunked: list[_Chunked] = []  # in plan order; the first goes on each step
        # Under TP, this rank's rows of the LM head and every rank's count
        # of them: the logits are gathered to rank 0 only (the one that
        # samples), not to every rank as the TP plan's layer would.
        self._head_shard, self._head_widths = self._sharded_head()
        self._head_layout = head_layout
        self._lay_out_head()
        # On CPU: each step on every thread or one fewer, whichever has been faster lately.
        self.threads = threads
        # KV of prompts once prefilled, and of finished requests' outputs, by blocks.
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._matches: dict[str, Match] = {}  # this step's new requests: what they could take
        # This step's new requests whose prompt (its ids, salt and items)
        # an earlier one's equals: the earlier one's id. Its prefill is
        # that one's (`_prefill`).
        self._twins: dict[str, str] = {}
        self.shared_prefills = 0  # joiners that took a copy of an identical prompt's prefill
        # This step's joiners that asked for prompt_logprobs: the hidden
        # states of their prompts' positions (but the last), from `_forward`.
        self._prompt_hidden: dict[str, torch.Tensor] = {}
        self._scores: dict[str, list[Logprob]] = {}  # this step's prompt_logprobs, by request (rank 0)
        self._unscored: dict[str, str] = {}  # this step's joiners whose prompt_logprobs failed (rank 0)
        self._cached: dict[str, int] = {}  # this step's joiners: prompt tokens taken from it
        self._prefilled: list[str] = []  # rows that joined last step: their prompts' blocks go in the store
        self._computed = 0  # prompt tokens this step's forwards ran (for `StepThreads`)
        self._tuning: StepRun | None = None  # the step's thread count under way (with `threads`)
        self._agreed = (True, True)  # whether the ranks' encoder and prefix caches agreed when last used
        if self._sums is not None:
            self._learn_sums()

    def _learn_sums(self) -> None:
        """A one-token prefill and a decode of it, on a cache of their own,
        on every rank as the group starts (each rank builds its engine
        then): the counted sums learn what each kind of forward makes, so
        even the first real forward that fails on one rank can be drained."""
        cache = RowCache(len(self.cache.layers), dtype=self.dtype, device=self.device)
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with torch.inference_mode(), self._kernels():
            self._body(self._prefill_body, ids, cache.begin_prefill([1]), cache)
            self._body(self._decode_body, ids, cache.begin_decode(), cache, decode=True)
            self._sums.settle()  # type: ignore[union-attr]

    @property
    def grammars(self) -> Grammars | None:
        """Rank 0's maker of structured-output matchers (None elsewhere)."""
        return self._grammars

    @property
    def keys_items(self) -> bool:
        """Whether each new request's items are digested (a cache uses the
        digests): only then can two prompts with media be twins, prefilled
        once (`_twins_of`)."""
        return self.encoder_cache.enabled or self.prefix_cache.enabled

    @property
    def prefilling(self) -> bool:
        """Whether a long prompt is on its way in, a chunk a step."""
        return bool(self._chunked)

    @property
    def caches_agreed(self) -> tuple[bool, bool]:
        """Whether the ranks' encoder and prefix caches agreed at the last
        step that took requests (a cache that does not is not used that
        step; a prefix cache whose change failed on one rank never agrees
        again, until the group restarts)."""
        return self._agreed

    def step(self, plan: Plan) -> StepOutcome:
        # The cache's tensors are made in inference mode; every in-place
        # change to them (joins, leaves) must happen in it too.
        with torch.inference_mode(), self._threads(plan) as self._tuning, self._kernels():
            try:
                return self._step(plan)
            finally:
                # The step's borrowed tensors were last used by its prefill.
                self.reader.end_step()
                self._tuning = None

    def _threads(self, plan: Plan) -> contextlib.AbstractContextManager[StepRun | None]:
        if self.threads is None:
            return contextlib.nullcontext()
        # The rows the step's forward runs: those leaving go first. A step
        # that only ends a burst's rows (keeping their prefixes: copies, no
        # forward) once counted as a decode step of all of them.
        running = len(self.rows) - len({rid for rid in plan.drop if rid in self.index})
        tokens = self._prefill_tokens(plan.new)

        def ran() -> tuple[StepKind, int]:
            # The prompt tokens that went through the model: their cached
            # prefixes, and twins' copies, did not.
            return StepKind.of(running, prefill=self._computed), self._computed

        return self.threads.run(StepKind.of(running, prefill=tokens), tokens=tokens, ran=ran)

    def _prefill_tokens(self, new: Sequence[NewRequest], matches: dict[str, Match] | None = None) -> int:
        """About how many prompt tokens the step prefills: its joiners'
        prompts that fit one step, each prompt once (identical ones are
        prefilled once), and one chunk of the first long prompt, under way
        or joining. Without `matches` (as the step starts) their cached
        prefixes count too; with them, what is left past each. This only
        picks the step's thread count (`StepThreads`), which then records
        its time under the tokens the forwards ran."""
        chunk = self.prefill_chunk
        prompts = {r.input_ids: r.request_id for r in new}
        cached = {rid: m.tokens for rid, m in matches.items()} if matches else {}
        tokens = sum(len(ids) - cached.get(rid, 0) for ids, rid in prompts.items() if not chunk or len(ids) <= chunk)
        if self._chunked:
            c = self._chunked[0]
            tokens += min(chunk, len(c.joiner.request.input_ids) - c.done)
        elif chunk and any(len(ids) > chunk for ids in prompts):
            tokens += chunk
        return tokens

    def _step(self, plan: Plan) -> StepOutcome:
        self._computed = 0
        keep = set(plan.keep)
        # Last rows first: a row leaves by swap-remove, and the last row
        # moves nowhere (32 rows ending together copied 31 rows' KV).
        for rid in sorted(plan.drop, key=lambda rid: self.index.get(rid, -1), reverse=True):
            self._remove(rid, keep=rid in keep)
        # The prompts prefilled last step, still running: a request that
        # starts the same way (a shared system prompt, the same image) can
        # take their blocks from this step on, without waiting for them to
        # finish. Kept here rather than as they joined, so their first
        # token did not wait for the copy; before this step's matches.
        kept_prefilled = self._keep_prefilled()
        self._cached = {}
        for rid, token in plan.feed:
            # A missing id here means the ranks diverged: fail loudly, never guess.
            self.rows[self.index[rid]].feed = token

        clock = _Clock()
        self._prompt_hidden, self._scores, self._unscored = {}, {}, {}
        read = self._intake.read(plan.new, keyed=self.keys_items)
        tensors, codes, messages, self._keys = read.tensors, read.codes, read.messages, read.keys
        self._matches = self._match(plan.new)
        self._twins = self._twins_of(plan.new)
        use_encoder = use_prefix = False
        if plan.new or plan.drop:
            digests: list[int] = []
            failed_idx, held = agree_on_failures(
                self.coll, codes, messages, active=len(self.rows), digest=self._cache_digest(plan.new), digests=digests
            )
            # Every rank would hit the same entries of a cache (else that
            # cache is not used this step).
            use_encoder = len({d & _HALF for d in digests}) == 1
            use_prefix = len({d >> _HALF_BITS for d in digests}) == 1
            if not use_prefix:  # their twins are in that half: the ranks might not see the same ones
                self._twins = {}
            if (use_encoder, use_prefix) != self._agreed and plan.new:
                said = ["agree" if ok else "disagree (not used)" for ok in (use_encoder, use_prefix)]
                log.warning("rank %d, step %d: the ranks' encoder caches %s, their prefix caches %s",
                            self.coll.rank, plan.step, *said)  # fmt: skip
                self._agreed = (use_encoder, use_prefix)
            # What each rank holds after this step: the agreed joiners join everywhere.
            self._active_per_rank = [n + len(plan.new) - len(failed_idx) for n in held]
        else:
            # Nothing joins or leaves: nothing to agree on, and every rank
            # holds what it held after the last step. Every rank runs this
            # same plan, so all of them skip the collective together.
            failed_idx = {}
        failed = {plan.new[i].request_id: f for i, f in failed_idx.items()}
        joining = [(req, tensors[i]) for i, req in enumerate(plan.new) if i not in failed_idx]
        if self._tuning is not None and use_prefix and self._matches:
            # The step's thread count, for what is left to prefill past the cached prefixes.
            left = self._prefill_tokens([req for req, _ in joining], self._matches)
            self._tuning.refine(StepKind.of(len(self.rows), prefill=left))

        clock.lap("read")
        logits: list[torch.Tensor] = []
        # Running rows whose decode forward failed: no logits, nothing sampled.
        ended: dict[str, Failure] = {}
        first_sampled = 0  # the rows before it have no logits this step
        if self.rows:
            decoded, failure = self._decode()
            if failure is None:
                logits.append(decoded)  # type: ignore[arg-type]
            else:
                ended = {row.request.request_id: failure for row in self.rows}
                first_sampled = len(self.rows)
            clock.lap("decode")
        if joining:
            ready, lost = self._prepare(joining, use_encoder, use_prefix)
            clock.lap("encode")  # and the cached prefixes taken: the prefill's own cost is apart
            self._queue_all_chunks([j for j in ready if self._chunked_prefill(j)])
            ready = [j for j in ready if not self._chunked_prefill(j)]
            prefill_logits, ready, dropped = self._prefill(ready) if ready else (None, [], {})
            lost |= dropped
            if prefill_logits is not None:
                logits.append(prefill_logits)
            clock.lap("prefill")
            # Every rank drops the same joiners (agreed, or TP=1): their rows never were.
            failed |= lost
            self._active_per_rank = [n - len(lost) for n in self._active_per_rank]
            for j in ready:
                self._join(j)
                hidden = self._prompt_hidden.pop(j.request.request_id, None)
                if hidden is not None:
                    self._keep_scores(j.request.request_id, self._score_prompt(j.request, hidden, 0))
            self._prompt_hidden = {}
        rejected: dict[str, str | MmsplitError] = {}
        if self._chunked:
            chunk_logits = self._next_chunk(ended)
            if chunk_logits is not None:
                logits.append(chunk_logits)
            clock.lap("chunk")

        sampled: dict[str, int] = {}
        logprobs: dict[str, Logprob] = {}
        if self.coll.rank == 0 and logits:
            rows = self.rows[first_sampled:]
            batch = [row.sampling for row in rows]
            # Most steps have one part (decode only): no copy of [rows, vocab] then.
            joined = logits[0] if len(logits) == 1 else torch.cat(logits)
            results, by_row = self.sampler.sample_rows(joined, batch)  # type: ignore[arg-type]
            for i, lp in by_row.items():
                logprobs[rows[i].request.request_id] = lp
            for row, result in zip(rows, results, strict=True):
                if not isinstance(result, int):
                    rejected[row.request.request_id] = result
                else:
                    sampled[row.request.request_id] = result
                    row.sampling.took(result)  # type: ignore[union-attr]
            for rid, why in self._unscored.items():  # they fail alone, as a row whose sampling fails
                rejected[rid] = why
                sampled.pop(rid, None)
                logprobs.pop(rid, None)
            clock.lap("sample")
        changed = plan.keep or self._cached or kept_prefilled
        if self.prefix_cache.enabled and changed and log.isEnabledFor(logging.DEBUG):
            store = self.prefix_cache
            log.debug("rank %d after step %d: prefix cache %d blocks, %d bytes, keys %s", self.coll.rank, plan.step,
                      len(store), store.nbytes, store.fingerprint())  # fmt: skip
        return StepOutcome(
            sampled=sampled,
            failed=failed,
            active_per_rank=list(self._active_per_rank),
            rejected=rejected,
            phases=clock.laps,
            logprobs=logprobs,
            cached=self._cached,
            ended=ended,
            prompt_logprobs={rid: scores for rid, scores in self._scores.items() if rid in sampled},
        )

    # ---- rows ----
    def _join(self, j: Joiner) -> None:
        req = j.request
        self.index[req.request_id] = len(self.rows)
        known = list(self._matches.get(req.request_id, NO_MATCH).keys)  # this step's joiners': their match
        self.rows.append(Row(req, sampling=self._row_sampling(req), rope_delta=j.rope_delta, runs=j.runs, chain=known))
        self._cached[req.request_id] = j.cached
        self._prefilled.append(req.request_id)

    def _remove(self, rid: str, *, keep: bool = False) -> None:
        if self._chunked and self._chunked[0].joiner.request.request_id == rid:
            self.cache.drop_growth()  # the room its first chunk made for its row (only the first has begun)
        for at, c in enumerate(self._chunked):
            c.followers = [f for f in c.followers if f.request.request_id != rid]
            if c.joiner.request.request_id == rid:
                del self._chunked[at]
                if c.followers:  # the next of them goes on in its place, from its own start
                    self._queue_chunks(c.followers[0], at=at, followers=c.followers[1:])
                break
        row = self.index.pop(rid, None)
        if row is None:  # never joined (failed at admission) or already gone
            return
        if keep and self.prefix_cache.enabled:
            self._keep_or_spoil(row, tail=self.cache.lengths[row])
        self.cache.remove(row)
        last = self.rows.pop()
        if row < len(self.rows):
            self.rows[row] = last
            self.index[last.request.request_id] = row

    def _keep_prefilled(self) -> bool:
        """Keep the blocks of the prompts that joined last step and still
        run (every rank: the same rows, in join order); whether any were."""
        joined, self._prefilled = self._prefilled, []
        if not self.prefix_cache.enabled:
            return False
        rows = [self.index[rid] for rid in joined if rid in self.index]
        for row in rows:
            self._keep_or_spoil(row, tail=self.cache.lengths[row] - 1)
        return bool(rows)

    def _keep_or_spoil(self, index: int, *, tail: int = 0) -> None:
        try:
            if self._hook is not None and hasattr(self._hook, "before_keep"):
                self._hook.before_keep(self.coll.rank, self.rows[index].request)
            self._keep(self.rows[index], index, tail=tail)
        except Exception:
            # Out of memory, say: the row goes on (or leaves) all the same.
            # This rank's store may now differ from the others', so its
            # history says so and no rank uses a cached prefix again (the
            # agreement compares histories).
            log.exception("rank %d: keeping the blocks of %s failed; the prefix cache is off from now on",
                          self.coll.rank, self.rows[index].request.request_id)  # fmt: skip
            self.prefix_cache.spoil(self.coll.rank)

    def _keep(self, row: Row, index: int, *, tail: int = 0) -> None:
        """Keep the full blocks of a row's KV in the prefix cache (its
        prompt and the tokens it was fed after it), and the partial block
        that ends at token `tail` (0: none): a leaving row's length, or a
        prompt just prefilled less its last token (what the same prompt
        sent again takes: all it may). Blocks the store holds already (a
        running row's prompt, kept the step after it joined) are touched,
        not copied again."""
        length = self.cache.lengths[index]
        tokens = [*row.request.input_ids, *row.fed][:length]
        salt = row.request.cache_salt
        keys = row.chain = chain(tokens, row.runs, salt, blocks=length // BLOCK_TOKENS, known=row.chain)
        held = self.prefix_cache.held(keys)
        last: tuple[bytes, torch.Tensor] | None = None
        start = tail // BLOCK_TOKENS * BLOCK_TOKENS
        if tail > start:
            parent = keys[start // BLOCK_TOKENS - 1] if start else prefix_root(salt)
            key = tail_key(parent, tokens, start, tail - start, row.runs)
            if not self.prefix_cache.holds(key):  # the same prompt again: it is there already
                got = self.cache.row_blocks(index, start, tail, tail - start)
                last = (key, got[0]) if got else None
        if held == len(keys):
            self.prefix_cache.keep(keys, [], tail=last)
            return
        blocks = self.cache.row_blocks(index, held * BLOCK_TOKENS, len(keys) * BLOCK_TOKENS, BLOCK_TOKENS)
        if blocks is not None:
            self.prefix_cache.keep(keys, blocks, first=held, tail=last)

    def _row_sampling(self, req: NewRequest) -> RowSampling | None:
        if self.coll.rank != 0:
            return None
        seed = req.sampling.seed or zlib.crc32(req.request_id.encode())
        generator = make_generator(req.sampling, seed, self.device)
        adjust = LogitAdjust(req.sampling, req.input_ids) if req.sampling.adjusts_logits else None
        constraint = self._constraint(req) if req.sampling.structure else None
        allowed = req.sampling.allowed_token_ids
        bans = Bans(allowed, req.bad_words) if allowed or req.bad_words else None
        return RowSampling(req.request_id, req.sampling, 0, generator, adjust=adjust, constraint=constraint, bans=bans)

    def _constraint(self, req: NewRequest) -> Constraint | Broken:
        """The request's structured-output matcher, or what fails it at its
        first token (alone, as any row whose sampling raises)."""
        structure = req.sampling.structure
        if self._grammars is None or structure is None:
            return Broken("structured output is not available in this engine")
        try:
            return self._grammars.constraint(structure, req.request_id)
        except Exception as exc:
            log.exception("compiling the structure of %s failed", req.request_id)
            return Broken(f"compiling its structured output failed: {type(exc).__name__}")

    # ---- forwards ----
    def _decode(self) -> tuple[torch.Tensor | None, Failure | None]:
        """One token for every running row: ``[rows, vocab]`` logits. A
        decode forward that raises (out of memory, say) is undone and fails
        the running rows, typed, and the group goes on: the loop drops them
        on the next step. Which row was at fault a batched forward cannot
        say. Under TP with the shared-memory sums a rank that fails
        releases the others from the forward's sums (or from the one sum
        every rank makes after it, `_ran`, which completes only where every
        rank's forward ran) into the same agreement as a prefill forward
        (`_agreed_run`); so a step with no failure costs one 8-byte sum more.
        Over gloo or NCCL likewise, by the group's sums: the rank that
        failed makes the forward's sums the others still make, then the
        8-byte one (`CountedSums.settle`); where it cannot (an error inside
        a sum, a layout it does not know) the error ends the group."""
        feeds = [row.feed for row in self.rows]
        if None in feeds:
            missing = [r.request.request_id for r in self.rows if r.feed is None]
            raise RuntimeError(f"the plan fed no token to running requests {missing}")
        for row in self.rows:
            row.fed.append(row.feed)  # type: ignore[arg-type]
        ids = torch.tensor(feeds, dtype=torch.long, device=self.device)[:, None]
        inputs = self.cache.begin_decode()
        if self.family.uses_mrope:
            # Every row at its own length + its prompt's rope delta (the same
            # on all three M-RoPE axes for generated text).
            deltas = torch.tensor([row.rope_delta for row in self.rows], dtype=torch.long, device=self.device)
            inputs = ForwardInputs(inputs.position_ids + deltas[:, None], inputs.attention_mask)
        alone = self.coll.world_size == 1

        def forward() -> torch.Tensor:
            with self._decode_fault():
                hidden = self._body(self._decode_body, ids, inputs, decode=True)[:, -1]
            if alone:
                return self._head(hidden)
            if self._arena is not None:
                self._arena.all_reduce_(self._ran)  # completes only where every rank's forward ran
            elif self._sums is not None:
                self._sums.settle()  # raises where another rank's forward failed
            return hidden

        def verdict(exc: Exception) -> tuple[int, str]:
            if not alone and self._arena is None and not (self._sums is not None and self._sums.drainable()):
                raise exc  # over gloo/NCCL another rank may be inside the forward's collectives
            rids = [row.request.request_id for row in self.rows]
            log.warning("rank %d: a decode forward of %d requests failed; they fail: %s%s", self.coll.rank, len(rids),
                        rids[:8], " and more" if len(rids) > 8 else "", exc_info=exc)  # fmt: skip
            return _verdict(exc, "a decode step", one_request=False)

        out, failure = self._agreed_run(forward, verdict, "a decode forward", always=False)
        if failure is not None:
            self.cache.undo_decode()
            for row in self.rows:
                row.fed.pop()
            return None, failure
        assert out is not None
        return (out if alone else self._head(out)), None

    def _decode_fault(self) -> contextlib.AbstractContextManager[None]:
        """Tests' fault injection inside a decode forward (the `engine_hook`'s `in_decode_forward`)."""
        inject = getattr(self._hook, "in_decode_forward", None)
        if inject is None:
            return contextlib.nullcontext()
        return inject(self.coll.rank, [row.request for row in self.rows], self.model)  # type: ignore[no-any-return]

    def _prepare(
        self, joining: list[tuple[NewRequest, ItemTensors | None]], use_encoder: bool, use_prefix: bool
    ) -> tuple[list[Joiner], dict[str, Failure]]:
        """What each joiner's prefill needs besides the forward: its encoder
        outputs (families whose outputs are cached) and its positions
        (M-RoPE), made per request, so a request that fails there fails
        alone. Under TP every rank's verdicts are agreed on in one gather,
        so every rank keeps the same joiners. The joiners kept, in order,
        and the failures."""
        joiners = [Joiner(req, tensors, runs=self._runs(req)) for req, tensors in joining]
        codes, messages = [0] * len(joiners), [""] * len(joiners)
        if self.prefix_cache.enabled:
            # In plan order on every rank, for the joiners every rank agreed
            # on: the stores change alike (`take` changes the store before
            # it copies, so a copy that fails on one rank changes nothing
            # else; the request fails on every rank through the agreement).
            for i, j in enumerate(joiners):
                match = self._matches.get(j.request.request_id, NO_MATCH) if use_prefix else NO_MATCH
                try:
                    j.prefix = self.prefix_cache.take(match, len(j.request.input_ids))
                except Exception as exc:
                    codes[i], messages[i] = self._failed_on(j.request, exc, "taking its cached prefix")
        if self.encoder_cache.enabled:
            self._media.encode(joiners, self._keys, use_encoder, codes, messages)
        for i, j in enumerate(joiners):
            if codes[i]:
                continue
            req = j.request
            try:
                if self._hook is not None and hasattr(self._hook, "before_prefill"):
                    self._hook.before_prefill(self.coll.rank, req)
                if self.family.uses_mrope and req.items:
                    j.positions, j.rope_delta = self.family.rope_positions(
                        self.model, list(req.input_ids), list(req.items)
                    )
            except Exception as exc:
                codes[i], messages[i] = self._failed_on(req, exc, "preparing its prefill")
        if self.coll.world_size > 1:
            failed_idx, _ = agree_on_failures(self.coll, codes, messages, active=0)
        else:
            failed_idx = {i: Failure(c, (0,), {0: messages[i]}) for i, c in enumerate(codes) if c}
        lost = {joiners[i].request.request_id: f for i, f in failed_idx.items()}
        return [j for i, j in enumerate(joiners) if i not in failed_idx], lost

    def _prefill(self, joiners: list[Joiner]) -> tuple[torch.Tensor | None, list[Joiner], dict[str, Failure]]:
        """The joiners' prompts in one right-padded forward: each row's logits
        at its last prompt token ``[joiners, vocab]``. A forward that raises
        is undone and each joiner tried alone, so the one at fault fails
        alone (`_agreed_forward`: under TP on every rank alike). The logits
        (None: no joiner left), the joiners prefilled, and the failures.
        A joiner whose twin (`_twins`: the same prompt, items and cached
        prefix) is prefilled too gets a copy of that one's row and logits
        instead of a row of its own in the forward (n choices, or one
        prompt sent at once by many, prefilled once); it comes after the
        others."""
        twinned = self._twinned(joiners)
        followers = {id(j) for j, _ in twinned}
        leaders = [j for j in joiners if id(j) not in followers]
        first = self.cache.rows
        logits, failure = self._agreed_forward(leaders, "a prefill")
        if failure is None:
            if not twinned:
                return logits, joiners, {}
            assert logits is not None
            place = {id(j): i for i, j in enumerate(leaders)}
            rows = [place[id(lead)] for _, lead in twinned]
            _, copying = self._agreed_run(
                lambda: self._copy_rows([first + r for r in rows]),
                lambda exc: (E.ERROR_CODE_OVERLOADED, f"copying a prefilled twin's row failed: {exc!r}"),
                "copying prefilled rows",
            )
            if copying is not None:
                self.cache.truncate(first + len(leaders))
                return logits, leaders, {j.request.request_id: copying for j, _ in twinned}
            self.shared_prefills += len(twinned)
            log.debug("rank %d: %d joiners take the prefill of an identical prompt joining with them",
                      self.coll.rank, len(twinned))  # fmt: skip
            return torch.cat([logits, logits[rows]]), [*leaders, *(j for j, _ in twinned)], {}
        log.warning("rank %d: each of the %d requests is tried alone", self.coll.rank, len(joiners))
        parts: list[torch.Tensor] = []
        kept: list[Joiner] = []
        lost: dict[str, Failure] = {}
        for j in joiners:
            alone, failure = self._agreed_forward([j], "its prefill")
            if failure is None:
                parts.append(alone)  # type: ignore[arg-type]
                kept.append(j)
            else:
                lost[j.request.request_id] = failure
        return (torch.cat(parts) if parts else None), kept, lost

    def _twinned(self, joiners: list[Joiner], under_way: Sequence[Joiner] = ()) -> list[tuple[Joiner, Joiner]]:
        """Of `joiners`, those whose twin (`_twins`, itself none's follower)
        joins too, or is among the long prompts `under_way`, with the same
        cached prefix: each with that twin, in order."""
        by_id = {j.request.request_id: j for j in [*under_way, *joiners]}
        return [
            (j, lead)
            for j in joiners
            if (lead := by_id.get(self._twins.get(j.request.request_id, ""))) is not None
            and lead.cached == j.cached
            and lead.request.request_id not in self._twins
        ]

    def _copy_rows(self, rows: list[int]) -> torch.Tensor:
        self.cache.copy_rows(rows)
        return torch.empty(0)

    def _agreed_forward(self, joiners: list[Joiner], what: str) -> tuple[torch.Tensor | None, Failure | None]:
        """One prefill forward (`_forward`) and its logits, or its rows
        undone and the failure. Under TP the ranks agree on the forward
        before the head's collective: a deterministic error raises alike on
        every rank, and one rank's own (out of memory, say) releases the
        others from the forward's shared-memory sums (`Arena.abort`), so
        all meet in the agreement and undo the same rows. Over gloo or
        NCCL it makes the forward's sums the others still make
        (`CountedSums.drain`; where it cannot, the others wait in the
        collective until its timeout ends the group)."""
        first = self.cache.rows
        alone = self.coll.world_size == 1

        def forward() -> torch.Tensor:
            hidden = self._forward(joiners)
            return self._head(hidden) if alone else hidden  # under TP the head has a collective: after the agreement

        def verdict(exc: Exception) -> tuple[int, str]:
            if len(joiners) == 1:
                return self._failed_on(joiners[0].request, exc, what)
            # each is tried alone next
            log.warning("rank %d: %s of %d requests failed", self.coll.rank, what, len(joiners), exc_info=exc)
            return E.ERROR_CODE_INTERNAL, f"{what} failed"

        out, failure = self._agreed_run(forward, verdict, what)
        if failure is not None:
            self.cache.truncate(first)
            return None, failure
        assert out is not None
        return (out if alone else self._head(out)), None

    def _agreed_run(
        self,
        forward: Callable[[], torch.Tensor],
        verdict: Callable[[Exception], tuple[int, str]],
        what: str,
        *,
        always: bool = True,
    ) -> tuple[torch.Tensor | None, Failure | None]:
        """`forward()`'s result, or the failure of the forward that every
        rank just ran (then every rank undoes the same rows). This rank's
        own is its verdict on its exception (`verdict`); it has none when
        another rank's failure released it from a shared-memory sum. Under
        TP the verdicts are agreed on in one gather, after a failing rank
        has released the others from the forward's sums (`Arena.abort`).
        `always`: agree even where this rank saw no failure (a rank that
        failed after the last sum could not tell it otherwise); False only
        where a forward ends in a sum every rank must make (the decode's
        `_ran`), so a step without a failure gathers nothing."""
        code, message = 0, ""
        aborted = False
        out: torch.Tensor | None = None
        try:
            out = forward()
        except SumAborted:
            aborted = True  # the rank that failed says why
        except Exception as exc:
            code, message = verdict(exc)
        if not (always or code or aborted):
            return out, None
        if code and self._arena is not None:
            self._arena.abort()  # release the ranks waiting for this one in a sum
        elif code and self._sums is not None and self._sums.drain():
            log.info("rank %d: %s failed here; made the sums the other ranks still make", self.coll.rank, what)
        if self.coll.world_size == 1:
            return out, (Failure(code, (0,), {0: message}) if code else None)
        sums: list[int] = []
        seq = self._arena.sums if self._arena is not None else 0
        failed, _ = agree_on_failures(self.coll, [code], [message], active=0, digest=seq, digests=sums)
        if failed:
            if self._arena is not None:
                self._arena.resync(sums)
            return out, failed[0]
        if out is None:
            raise RuntimeError(f"rank {self.coll.rank}: {what} was aborted but no rank failed")
        return out, None

    def _forward(self, joiners: list[Joiner]) -> torch.Tensor:
        """One prefill forward over `joiners` (rows appended to the cache),
        each from the end of its cached prefix: the hidden state of each
        row's last prompt token ``[joiners, hidden]`` (`_head` makes logits)."""
        starts = [j.cached for j in joiners]
        lengths = [len(j.request.input_ids) - start for j, start in zip(joiners, starts, strict=True)]
        ids = torch.full((len(joiners), max(lengths)), PAD_ID, dtype=torch.long)
        for i, j in enumerate(joiners):
            ids[i, : lengths[i]] = torch.tensor(j.request.input_ids[starts[i] :], dtype=torch.long)
        extra: dict[str, Any]
        if self.encoder_cache.enabled:
            features = [f for j in joiners for f in media_inputs.features(j, j.cached, len(j.request.input_ids))]
            extra = self.family.encoded_kwargs(features) if features else {}
        else:
            extra = self._media.joined(joiners)
        prefixes = [j.prefix for j in joiners] if any(starts) else None
        inputs = self.cache.begin_prefill(lengths, prefixes)
        self._computed += sum(lengths)
        if self.family.uses_mrope:
            positions = inputs.position_ids[None].repeat(3, 1, 1)  # padding keeps plain positions (masked)
            for i, j in enumerate(joiners):
                if j.positions is not None:
                    positions[:, i, : lengths[i]] = j.positions[:, starts[i] :].to(positions.device)
            inputs = ForwardInputs(positions, inputs.attention_mask)
        with self._forward_fault(joiners):
            hidden = self._body(self._prefill_body, ids.to(self.device), inputs, **extra)
        for i, j in enumerate(joiners):
            if j.request.sampling.prompt_logprobs is not None:  # never from a cached prefix (`_match`)
                self._prompt_hidden[j.request.request_id] = hidden[i, : lengths[i] - 1]
        last = torch.tensor(lengths, device=self.device) - 1
        return hidden[torch.arange(len(joiners), device=self.device), last]

    def _forward_fault(self, joiners: list[Joiner]) -> contextlib.AbstractContextManager[None]:
        """Tests' fault injection inside a prefill forward (the `engine_hook`'s `in_prefill_forward`)."""
        inject = getattr(self._hook, "in_prefill_forward", None)
        if inject is None:
            return contextlib.nullcontext()
        return inject(self.coll.rank, [j.request for j in joiners], self.model)  # type: ignore[no-any-return]

    def _chunked_prefill(self, j: Joiner) -> bool:
        """Whether `j` is prefilled in chunks: its prompt is longer than a
        chunk, and its media, if any, come as encoder outputs that a chunk
        can take a part of."""
        if not self.prefill_chunk or len(j.request.input_ids) - j.cached <= self.prefill_chunk:
            return False
        return not (j.request.items and not self.encoder_cache.enabled)

    def _queue_all_chunks(self, joiners: list[Joiner]) -> None:
        """Queue the long prompts of the step's joiners, a chunk a step each;
        one whose twin is among them or under way (n choices of a long
        prompt, say, whose requests reach the scheduler a step or two apart)
        waits for that one's prefill instead of making its own."""
        twinned = self._twinned(joiners, [c.joiner for c in self._chunked])
        following = {id(j) for j, _ in twinned}
        for j in joiners:
            if id(j) not in following:
                self._queue_chunks(j)
        by_leader = {id(c.joiner): c for c in self._chunked}
        for j, lead in twinned:
            by_leader[id(lead)].followers.append(j)

    def _queue_chunks(self, j: Joiner, *, at: int | None = None, followers: list[Joiner] | None = None) -> None:
        log.debug("request %s: %d prompt tokens, prefilled in chunks of %d", j.request.request_id,
                  len(j.request.input_ids), self.prefill_chunk)  # fmt: skip
        cache = RowCache(self._layers, dtype=self.dtype, device=self.device, token_chunk=self._token_chunk, row_chunk=1)
        if j.prefix is not None:
            cache.append_row(j.prefix)
        entry = _Chunked(j, cache, done=j.cached, followers=list(followers or ()))
        self._chunked.insert(len(self._chunked) if at is None else at, entry)

    def _next_chunk(self, ended: dict[str, Failure]) -> torch.Tensor | None:
        """The next chunk of the first long prompt; when it was the last, its
        row joins the batch and its logits ``[1, vocab]`` are returned. A
        chunk that raises fails its request alone, typed (in `ended`: the
        loop drops it everywhere), agreed on under TP as a prefill forward
        is (`_agreed_run`)."""
        c = self._chunked[0]
        req = c.joiner.request
        start, end = c.done, min(len(req.input_ids), c.done + self.prefill_chunk)
        if start == c.joiner.cached:  # its first chunk: the batch's rows will need its length
            self.cache.grow_ahead(len(req.input_ids), steps=-(-(len(req.input_ids) - start) // self.prefill_chunk))
        self.cache.advance_growth()
        hidden, failure = self._agreed_run(
            lambda: self._chunk_forward(c, start, end),
            lambda exc: self._failed_on(req, exc, "a chunk of its prefill"),
            "a chunk's forward",
        )
        if failure is not None:
            # As any chunked prompt that leaves: its own cache goes (the
            # batch's never held its row), and the room made for that row.
            self._remove(req.request_id)
            ended[req.request_id] = failure
            return None
        assert hidden is not None
        c.done = end
        if req.sampling.prompt_logprobs is not None:  # its positions but the prompt's last
            more = self._score_prompt(req, hidden[0, : min(end, len(req.input_ids) - 1) - start], start)
            c.scores = None if c.scores is None or more is None else c.scores + more
        if end < len(req.input_ids):
            return None
        self._chunked.pop(0)
        self.cache.adopt(c.cache)
        self._join(c.joiner)
        if req.sampling.prompt_logprobs is not None:
            self._keep_scores(req.request_id, c.scores)
        logits = self._head(hidden[:, -1])
        return self._followed(c, logits, ended) if c.followers else logits

    def _followed(self, c: _Chunked, logits: torch.Tensor, ended: dict[str, Failure]) -> torch.Tensor:
        """`c`'s followers join with copies of its row, just joined, and of
        its logits ``[1, vocab]``; the logits of all ``[1 + followers,
        vocab]``. A copy that fails fails the followers alone (OVERLOADED),
        agreed on under TP as the twins of a prefill are."""
        before, row = self.cache.rows, self.index[c.joiner.request.request_id]
        _, copying = self._agreed_run(
            lambda: self._copy_rows([row] * len(c.followers)),
            lambda exc: (E.ERROR_CODE_OVERLOADED, f"copying a prefilled twin's row failed: {exc!r}"),
            "copying prefilled rows",
        )
        if copying is not None:
            self.cache.truncate(before)
            ended.update({f.request.request_id: copying for f in c.followers})
            return logits
        for f in c.followers:
            self._join(f)
        self.shared_prefills += len(c.followers)
        log.debug("rank %d: %d joiners take the chunked prefill of an identical prompt joining with or before them",
                  self.coll.rank, len(c.followers))  # fmt: skip
        return logits.repeat(1 + len(c.followers), 1)

    def _chunk_forward(self, c: _Chunked, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of `c`'s prompt through the model, over its
        own cache; the hidden states ``[1, end - start, hidden]``."""
        j = c.joiner
        ids = torch.tensor([j.request.input_ids[start:end]], dtype=torch.long, device=self.device)
        inputs = c.cache.begin_extend(end - start) if c.cache.rows else c.cache.begin_prefill([end - start])
        if j.positions is not None:
            inputs = ForwardInputs(j.positions[:, None, start:end].to(self.device), inputs.attention_mask)
        elif self.family.uses_mrope:  # text only: the same position on all three axes
            inputs = ForwardInputs(inputs.position_ids[None].repeat(3, 1, 1), inputs.attention_mask)
        features = media_inputs.features(j, start, end)
        extra = self.family.encoded_kwargs(features) if features else {}
        self._computed += end - start
        with self._forward_fault([j]):
            return self._body(self._prefill_body, ids, inputs, c.cache, **extra)

    def _failed_on(self, req: NewRequest, exc: BaseException, what: str) -> tuple[int, str]:
        """The typed verdict on one request whose `what` raised `exc`."""
        log.warning("rank %d: request %s failed in %s", self.coll.rank, req.request_id, what, exc_info=exc)
        return _verdict(exc, what, one_request=True)

    def _cache_digest(self, new: tuple[NewRequest, ...]) -> int:
        """What this rank would take from its caches for the step's new
        requests (each item's encoder-cache key and whether it would hit;
        each prompt's prefix match and the prefix cache's history), as one
        number for the agreement: 31 bits for each cache; 0 without one."""
        if not self.keys_items:
            return 0
        encoder, prefix = hashlib.blake2b(digest_size=8), hashlib.blake2b(self.prefix_cache.history, digest_size=8)
        for req in new:
            if self.encoder_cache.enabled:
                for key, item in zip(self._keys.get(req.request_id, ()), req.items, strict=False):
                    hit = self.encoder_cache.would_hit(key, item.rows, self._media.width)
                    encoder.update(key + (b"1" if hit else b"0"))
            match = self._matches.get(req.request_id, NO_MATCH)
            taken = match.all_keys
            prefix.update(match.tokens.to_bytes(4, "little") + (taken[-1] if taken else b""))
            prefix.update(self._twins.get(req.request_id, "").encode() + b"|")
        # Two halves of one int64 of the agreement's row: each cache's own.
        low = int.from_bytes(encoder.digest(), "little") & _HALF
        high = int.from_bytes(prefix.digest(), "little") & _HALF
        return low | high << _HALF_BITS

    def _runs(self, req: NewRequest) -> Runs:
        """`req`'s items as the prefix cache keys them (this rank's digests)."""
        return Runs(tuple(self._keys.get(req.request_id, ())), tuple(item.placeholders for item in req.items))

    def _twins_of(self, new: tuple[NewRequest, ...]) -> dict[str, str]:
        """Of `new`, each request whose prompt equals an earlier one's, or a
        long prompt's under way (`twin_key`): that one's id."""
        if not (new and self.share_prefills):
            return {}
        # The long prompts under way first: one sent again while they are
        # prefilled waits for theirs.
        first: dict[tuple[Any, ...], str] = {}
        for c in self._chunked:
            if (key := twin_key(c.joiner.request, c.joiner.runs.digests)) is not None:
                first.setdefault(key, c.joiner.request.request_id)
        twins: dict[str, str] = {}
        for req in new:
            if (key := twin_key(req, tuple(self._keys.get(req.request_id, ())))) is None:
                continue
            leader = first.setdefault(key, req.request_id)
            if leader != req.request_id:
                twins[req.request_id] = leader
        return twins

    def _match(self, new: tuple[NewRequest, ...]) -> dict[str, Match]:
        """What each new request could take from the prefix cache (changes
        nothing: taken after the agreement, by the joiners every rank kept)."""
        if not self.prefix_cache.enabled:
            return {}
        matches = {}
        for req in new:
            runs = self._runs(req)
            if req.sampling.prompt_logprobs is not None:
                continue  # every position's logits are needed: prefilled whole
            if len(runs.digests) == len(req.items):  # else an item was unreadable: it fails
                matches[req.request_id] = self.prefix_cache.match(req.input_ids, runs, req.cache_salt)
        return matches

    def _body(
        self,
        body: Callable[..., Any],
        ids: torch.Tensor,
        inputs: ForwardInputs,
        cache: RowCache | None = None,
        *,
        decode: bool = False,
        **extra: Any,
    ) -> torch.Tensor:
        if self._sums is not None:  # a decode's ranks settle after it (`_decode`): a prefill's agree anyway
            kind = "decode" if decode else "prefill"
            self._sums.begin(kind, (*ids.shape, self._hidden), self.dtype, self.device, settled=decode)
        out = body(
            input_ids=ids,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            past_key_values=self.cache if cache is None else cache,
            use_cache=True,
            **extra,
        )
        hidden: torch.Tensor = out.last_hidden_state
        if self._sums is not None:
            self._sums.end()
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the rows' last positions only (never of whole prompts),
        ``[rows, vocab]`` on rank 0; under TP the other ranks get ``[rows,
        0]`` (only rank 0 samples)."""
        if self._head_shard is None:
            logits: torch.Tensor = self.model.lm_head(hidden)  # type: ignore[operator]
            return logits.float()
        part = torch.nn.functional.linear(hidden, self._head_shard).float()
        gathered = self.coll.gather_columns_to_0(part, self._head_widths)
        return gathered if gathered is not None else part[:, :0]

    def _keep_scores(self, rid: str, scores: list[Logprob] | None) -> None:
        """A joiner's prompt_logprobs for its first token's message, or (rank
        0, when making them failed) its failure at this step's end."""
        if scores is None:
            self._unscored[rid] = "its prompt log probabilities could not be made (logged on rank 0)"
        else:
            self._scores[rid] = scores

    def _score_prompt(self, req: NewRequest, hidden: torch.Tensor, first: int) -> list[Logprob] | None:
        """`prompt_scores.score_prompt` on this engine's head (every rank)."""
        alone = self.coll.world_size == 1
        return score_prompt(self._head, req, hidden, first, rank=self.coll.rank, alone=alone, hook=self._hook)

    def _lay_out_head(self) -> None:
        """The LM head's weight (this rank's rows of it under TP) in the
        memory layout `--lm-head-layout` asks for (by default whichever
        multiplies faster on this host: `head_layout`), in place of the
        stored one: no second copy is kept. Under TP a head whose weight the
        embeddings share stays as it is (replacing it there would untie
        them and keep both)."""
        head = getattr(self.model, "lm_head", None)
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            return
        if self._head_shard is None:
            if self.coll.world_size == 1:
                weight.data = lay_out(weight.data, self._head_layout)
            return
        from torch.distributed.tensor import DTensor

        embeddings = self.model.get_input_embeddings()  # type: ignore[operator]
        if weight is getattr(embeddings, "weight", None) or not isinstance(weight, DTensor):
            return
        laid = lay_out(self._head_shard, self._head_layout)
        if laid is self._head_shard:
            return
        self._head_shard = laid
        stride = (1, weight.shape[0])  # column after column, as `laid` is
        whole = DTensor.from_local(laid, weight.device_mesh, weight.placements, shape=weight.shape, stride=stride)
        head.weight = torch.nn.Parameter(whole, requires_grad=False)  # type: ignore[union-attr]

    def _sharded_head(self) -> tuple[torch.Tensor | None, list[int]]:
        """(this rank's rows of the LM head's weight, each rank's count),
        when the TP plan sharded it by rows of the vocabulary, without a
        bias; else (None, [])."""
        if self.coll.world_size == 1:
            return None, []
        from torch.distributed.tensor import DTensor, Shard

        head = getattr(self.model, "lm_head", None)
        weight = getattr(head, "weight", None)
        sharded = isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),)
        usable = sharded and getattr(head, "bias", None) is None
        # Every rank answers, so every rank takes the same path (and the gather below runs everywhere).
        votes = self.coll.all_gather_row(torch.tensor([int(usable), weight.to_local().shape[0] if usable else 0]))  # type: ignore[union-attr]
        if not bool(votes[:, 0].all()):
            log.info("rank %d: the LM head is not sharded by rows: logits gathered to every rank", self.coll.rank)
            return None, []
        widths = [int(w) for w in votes[:, 1]]
        log.info("rank %d: the LM head's logits go to rank 0 only (%d of its %d rows here)", self.coll.rank,
                 widths[self.coll.rank], sum(widths))  # fmt: skip
        return weight.to_local(), widths  # type: ignore[union-attr]


def _verdict(exc: BaseException, what: str, *, one_request: bool) -> tuple[int, str]:
    """The typed error for `what` raising `exc`, for one request's work or
    a whole batch's: its own when typed, OVERLOADED (retriable) when out of
    memory, else INTERNAL."""
    if isinstance(exc, MmsplitError):
        return exc.error_code, exc.message
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        if one_request:
            return E.ERROR_CODE_OVERLOADED, f"this request ran out of memory in {what}; retry, or send a shorter one"
        return E.ERROR_CODE_OVERLOADED, f"the server ran out of memory in {what}; retry"
    on = " on this request" if one_request else ""
    return E.ERROR_CODE_INTERNAL, f"the model failed{on} in {what} ({type(exc).__name__}, logged)"


def _attention_kernels(device: torch.device, *, cudnn: bool) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """What a step runs under: on CUDA without cuDNN's attention, torch's
    other SDPA kernels as they are (`sdpa_kernel` sets the process's
    flags for the step and puts them back after)."""
    if device.type != "cuda" or cudnn:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return lambda: sdpa_kernel(backends)


def twin_key(req: NewRequest, digests: tuple[bytes, ...]) -> tuple[Any, ...] | None:
    """What two prompts prefilled once have alike: the same ids, cache salt
    and items (by this rank's `digests` of them); None for a request that
    wants prompt log probabilities, or whose items were not all digested
    (no cache keys them, or one was unreadable)."""
    if req.sampling.prompt_logprobs is not None or len(digests) != len(req.items):
        return None
    return (req.input_ids, req.cache_salt, digests)


class _Clock:
    """Seconds spent in each phase of a step, for the loop's statistics. On
    CUDA the forwards run asynchronously: their time shows up in the phase
    that first waits for a result (sampling)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = now - self._last
        self._last = now
