"""Several requests over one page pool, their shared prefixes found by a block-hash chain (vLLM) or a radix tree
(SGLang), each request's hits and misses explained: :class:`PrefixPool` (how a request is served: docs/prefix.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..caches.strategies.paged import PagedCache, PagePoolFullError
from ..config.layer_plan import layer_plan
from ..core.settings import positive_int
from ..errors import SettingsError
from ..models.executor import as_executor
from ..runtime.recording import eos_ids
from ..runtime.sampling import SamplingSettings, choose
from .blocks import BlockPool
from .cache import PoolCache
from .engine_events import EngineEvents
from .footprint import memory, sliding_kept
from .frames import PoolFrame
from .index import block_hashes, short
from .page_writer import write_page
from .policies import make_index
from .reasons import Ledger, Served
from .request import RequestInput
from .result import ServeResult
from .sliding import SlidingRetention
from .snapshot import FrameMaker
from .states import StateCheckpoints
from .tiers import GPU, Offload, TierBlock, Tiers, page_data, write_page_data

class PrefixPoolFullError(PagePoolFullError):
    """A request needs more new blocks than the pool has free (cached blocks no request holds count as free: they
    would be evicted); nothing was computed or evicted."""

    def __init__(self, held: int, needed: int, capacity: int, free: int, prompt: int, written: int, kept: int) -> None:
        self.used, self.needed, self.capacity, self.free = held, needed, capacity, free
        hint = f", or let kept requests go (pool.finish(result): {kept} kept)" if kept else ""
        Exception.__init__(
            self, f"prefix pool full: this request writes {written} positions ({prompt} prompt tokens and its "
                  f"answer but the last token), which needs {needed} new block{'s' * (needed != 1)}, and "
                  f"{free} of the {capacity} are free or only cached ({held} held by kept requests); create the "
                  f"pool with a larger num_blocks, or shorten the request or max_new_tokens{hint}")


class PrefixPool:
    """``num_blocks`` pages of ``block_size`` positions (every full-attention layer's keys and values), shared by
    every request :meth:`serve` runs, and a prefix ``policy``: ``"hash"`` (vLLM's automatic prefix caching) or
    ``"radix"`` (SGLang's RadixAttention). ``checkpoint_states`` says where a hybrid model's recurrent states are
    saved (:mod:`kvexplore.prefix.states`); ``retention_interval`` where the hash policy keeps a sliding-window
    layer's blocks cached, as vLLM's ``prefix_cache_retention_interval`` (:mod:`kvexplore.prefix.sliding`);
    ``reuse``: how the hash policy queues the pages a request gives back: ``"uncached-first"`` (the default), as
    vLLM 0.32 does: pages caching nothing to the front, cached ones to the back; or ``"fifo"``, as vLLM did before,
    all to the back in the order they came (a cached block at the front is evicted even while uncached pages wait).
    ``offload``: host and disk tiers (:class:`~kvexplore.prefix.tiers.Offload`) that keep the blocks the pages evict
    and give them back on a hit (hash policy). ``listeners`` are called with each new frame."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, policy: str = "hash",
                 checkpoint_states: str = "ends", dtype: torch.dtype | None = None,
                 retention_interval: int | None = 0, reuse: str | None = None, offload: Offload | None = None) -> None:
        num_blocks, block_size = positive_int(num_blocks, "num_blocks"), positive_int(block_size, "block_size")
        self.index = make_index(policy, block_size)
        reuse = reuse or ("uncached-first" if policy == "hash" else "fifo")
        if reuse not in ("fifo", "uncached-first") or (reuse != "fifo" and policy != "hash"):
            raise SettingsError(f"reuse must be 'fifo' or 'uncached-first' (vLLM 0.32's, for the hash policy), got "
                                f"{reuse!r} with policy {policy!r}")
        self.reuse = reuse
        if offload is not None and (policy != "hash" or not isinstance(offload, Offload)):
            raise SettingsError(f"offload takes kvexplore.prefix.Offload(host_blocks=..., disk_blocks=...) with the "
                                f"hash policy (vLLM's offloading connector keys blocks by their hashes), got "
                                f"{offload!r} with policy {policy!r}")
        self.executor = as_executor(model)
        self.model, self.config, self.policy = model, self.executor.config, policy
        self.tokenizer = self.executor.tokenizer
        plan = layer_plan(self.config)
        if latent := [s.index for s in plan if s.latent]:
            raise SettingsError(
                f"PrefixPool shares attention blocks and recurrent states across requests; layer {latent[0]} of "
                f"this {self.config.architecture} model keeps a compressed latent (MLA), which it does not page yet: "
                f"use a model with full, sliding-window or linear-attention layers")
        self.cache = PoolCache(self.config, dtype=dtype or self.executor.dtype, device=self.executor.device,
                                pool=BlockPool(len(plan), num_blocks, block_size, self.index))
        try:
            self.executor.check_cache(self.cache)
        except SettingsError as e:  # a transformers model runs its own caches, not a kvexplore page pool
            raise SettingsError(f"PrefixPool pages kvexplore's own models (kvexplore.load(...)); this model's "
                                f"executor refuses its pool: {e}") from e
        self.block_size, self.num_blocks = block_size, num_blocks
        self.pool: BlockPool = self.cache.pool
        self.states = StateCheckpoints([s.index for s in self.cache.plan if s.recurrent], checkpoint_states)
        windows = [s.window for s in self.cache.plan if s.window and not s.recurrent] if policy == "hash" else []
        self.sliding = SlidingRetention(windows, block_size, retention_interval)
        self.tiers = None if offload is None else Tiers(offload, self.page_bytes)
        if self.tiers is not None:
            self.pool.spill = self._spill
        self.ledger = Ledger(block_size, self._token_text)
        self.events = EngineEvents(block_size)
        self.results: list[ServeResult] = []
        self.listeners: list[Callable[[PoolFrame], None]] = []
        self._live: dict[int, PagedCache] = {}  # requests served with keep=True, still holding their pages
        self._maker = FrameMaker(self)
        self._frames = [self._maker.frame(None, [], 0)]

    def _token_text(self, token: int) -> str:
        return self.tokenizer.token_text(token) if self.tokenizer is not None else str(token)

    # -- serving -------------------------------------------------------------------------------------------
    def serve(self, request, max_new_tokens: int | None = None, response=None, label: str | None = None,
              chat_template: str | None = None, temperature: float = 0.0, top_k: int | None = None,
              top_p: float | None = None, seed: int = 0, stop_at_eos: bool = True, keep: bool = False,
              keep_logits: bool = False) -> ServeResult:
        """Serve one request: ``request`` is text, token ids, or chat messages (``[{"role", "content"}]``, rendered
        with the model's chat template or ``chat_template``). ``max_new_tokens`` tokens are generated (greedy, or
        sampled with ``temperature``/``top_k``/``top_p`` from ``seed``), or ``response`` (text or ids) is taken as
        the answer, as when replaying a recorded conversation. ``keep``: the request keeps its pages (a request
        still running; :meth:`finish` lets them go). Returns a :class:`~kvexplore.prefix.result.ServeResult`."""
        r = len(self.results)
        ask = RequestInput.parse(self, request, chat_template, response, max_new_tokens)
        ids, bs, n = ask.ids, self.block_size, len(ask.ids)
        hashes = block_hashes(ids, bs, self.reusable_blocks(n))
        matched = self.index.match(ids, hashes)
        found = len(matched) + self._in_tiers(hashes, len(matched))
        windowed = self.sliding.hit(hashes, found)
        usable = self.states.usable(hashes, windowed)
        pages, hit = matched[:usable], usable * bs
        self._check_room(ask, pages)
        label = label or f"request {r}"
        moves_before = len(self.tiers.moves) if self.tiers else 0
        pages, promoted, tiers_hit = self._promote(ids, hashes, pages, usable, r)
        saved_at = [(k + 1) * bs for k in range(windowed) if hashes[k] in self.states.saved]
        sliding = None
        if windowed < len(matched):
            writer = self.ledger.longest(ids)[1]
            sliding = (len(matched) * bs, self.sliding.words(hashes, len(matched), windowed,
                                                              writer.label if writer else None))
        misses = self.ledger.explain(ids, hit, windowed * bs, hashes, ask.chat, saved_at, ask.answers, sliding)
        t0 = time.perf_counter()
        cache = self.cache.sibling()
        cache.adopt(pages, hit)
        restored = self.states.restore(cache, hashes[usable - 1]) if usable and self.states.needed else 0
        try:
            generated, logits, first = self._run(cache, ask, hit, hashes, SamplingSettings(temperature, top_k, top_p),
                                                 seed, stop_at_eos, keep_logits)
        except BaseException:  # the pool as it was, but for the blocks this request evicted (they are gone)
            self._give_back(cache)
            self._settle_evictions(label)
            raise
        written = list(ids) + generated[:-1]
        table = list(cache.table.tables[0])
        all_hashes = block_hashes(written, bs, known=hashes)
        cached = promoted + self.index.insert(written, table[: len(all_hashes)], all_hashes)
        self.sliding.retain(all_hashes, usable, n, sliding[0] if sliding else 0)  # the junction: the full layers' hit
        shared = set(pages)
        for i, page in enumerate(table):
            self.pool.tokens[page] = tuple(written[i * bs: (i + 1) * bs])
            self.pool.last_used[page] = r
            if page in shared and page not in promoted:
                self.pool.hits[page] += 1
            else:
                self.pool.stored_by[page] = r
        evictions = self._settle_evictions(label)
        moves = self.tiers.moves[moves_before:] if self.tiers else []
        self.ledger.add(Served(r, label, tuple(written), n, ask.chat, self._answer_text(generated)))
        if keep:
            self._live[r] = cache
        else:
            self._give_back(cache)
        result = ServeResult(
            r, label, list(ids), generated, hit, n - hit, misses, table, list(pages), cached, len(evictions),
            len(pages) * self.cache.table.page_bytes + restored, ask.text, logits, time.perf_counter() - t0, first,
            tiers_hit, moves)
        self.results.append(result)
        self.events.record(self.index, evictions, cached, self.tiers.take_events() if self.tiers else ())
        frame = self._maker.frame(result, evictions, len(self._frames))
        self._frames.append(frame)
        for listener in list(self.listeners):
            listener(frame)
        return result

    def reusable_blocks(self, n: int) -> int:
        """How many full blocks of an ``n``-token prompt a hit may cover: all but the block holding its last token,
        which is always computed (its logits give the first new token)."""
        return (n - 1) // self.block_size

    @staticmethod
    def serve_each(pools: Sequence["PrefixPool"], request, **options) -> list[ServeResult]:
        """Serve ``request`` (with the same options) to every pool in turn, as when comparing policies side by side
        (``kvexplore.PrefixCompare(pools)``); the results in the pools' order."""
        return [pool.serve(request, **options) for pool in pools]

    def _give_back(self, cache: PagedCache) -> None:
        before = len(self.pool.free)
        cache.table.release(tail_first=True)  # the tail first: the hash policy then evicts a prefix's end first
        cache.table.tables = [[]]
        if self.reuse == "uncached-first":
            free, back = self.pool.free[:before], self.pool.free[before:]
            self.pool.free[:] = ([p for p in back if not self.index.cached(p)] + free
                                 + [p for p in back if self.index.cached(p)])

    def _answer_text(self, generated: list[int]) -> str:
        eos = set(eos_ids(self.executor))
        return self.tokenizer.decode([t for t in generated if t not in eos]) if self.tokenizer is not None else ""

    def _settle_evictions(self, label: str) -> list:
        """The blocks the request ``label``'s pages evicted: their states dropped, the ledger told."""
        evictions, self.index.evictions = list(self.index.evictions), []
        for e in evictions:
            self.states.drop(e.hash)
            if self.tiers is None or self.tiers.medium_of(e.hash) is None:
                self.sliding.drop(e.hash)  # (a block in a tier keeps every layer's bytes)
        self.ledger.note_evictions(evictions, label)
        for h, medium in self.tiers.take_dropped() if self.tiers is not None else ():
            if h not in self.index.table and self.tiers.medium_of(h) is None:  # gone from every tier
                self.sliding.drop(h)
                where = self.ledger.evicted_at.get(h)
                self.ledger.evicted_at[h] = f"{where or 'evicted'}, then dropped from the {medium} tier at {label}"
        return evictions

    # -- offload tiers ---------------------------------------------------------------------------------------
    def _spill(self, e) -> None:
        """A cached block leaves the pages (its page is about to be reused): the tiers take its bytes."""
        self.tiers.spill(TierBlock(e.hash, e.parent, e.tokens, e.start // self.block_size),
                         page_data(self.pool, e.page))

    def _in_tiers(self, hashes: list[bytes], start: int) -> int:
        """How many blocks after the pages' hit continue the prefix in the tiers."""
        n = 0
        while self.tiers is not None and start + n < len(hashes) and self.tiers.medium_of(hashes[start + n]):
            n += 1
        return n

    def _promote(self, ids, hashes: list[bytes], pages: list[int], usable: int,
                 r: int) -> tuple[list[int], list[int], dict[str, int]]:
        """Take the hit's blocks ``len(pages) .. usable - 1`` back from the tiers into pages (cached again), the
        device pages held meanwhile so that the pages taken cannot evict them. Returns every page of the hit, the
        pages promoted, and the hit's blocks per medium."""
        tiers_hit = {GPU: len(pages)} if self.tiers is not None else {}
        if len(pages) >= usable:
            return pages, [], tiers_hit
        for p in pages:
            self.pool.hold(p)
        promoted = []
        for k in range(len(pages), usable):
            data, medium = self.tiers.fetch(hashes[k])
            page = self.pool.take()
            write_page_data(self.pool, page, data)
            self.pool.tokens[page], self.pool.stored_by[page] = tuple(ids[k * self.block_size: (k + 1) *
                                                                            self.block_size]), r
            promoted.append(page)
            tiers_hit[medium] = tiers_hit.get(medium, 0) + 1
        self.index.insert(ids, pages + promoted, hashes[:usable])
        for p in pages + promoted:
            self.pool.release(p)
        return pages + promoted, promoted, tiers_hit

    def _check_room(self, ask: "RequestInput", pages: list[int]) -> None:
        written = len(ask.ids) + max(ask.new_tokens - 1, 0)
        need = -(-written // self.block_size) - len(pages)
        free = len(self.pool.free) - sum(1 for p in pages if self.pool.refcount[p] == 0)
        if need > free:
            raise PrefixPoolFullError(self.num_blocks - len(self.pool.free), need, self.num_blocks, free,
                                      len(ask.ids), written, len(self._live))
        if written > self.config.max_position_embeddings:
            raise SettingsError(f"this request writes {written} positions (prompt {len(ask.ids)} + "
                                f"{ask.new_tokens} new tokens, the last not written), past the model's "
                                f"{self.config.max_position_embeddings}; shorten the prompt or max_new_tokens")

    def _run(self, cache: PagedCache, ask, hit: int, hashes: list[bytes], sampling: SamplingSettings, seed: int,
             stop_at_eos: bool, keep_logits: bool) -> tuple[list[int], torch.Tensor | None, float]:
        """Compute the prompt from ``hit`` on (stopping where a state is to be saved) and generate the answer; the
        tokens, their logits (with ``keep_logits``) and the seconds the prompt took (to the first token's logits).
        ``hashes``: the prompt's chain hashes, extended here as states are saved further on."""
        chain = list(hashes)
        t0 = time.perf_counter()
        ids, bs, n = ask.ids, self.block_size, len(ask.ids)
        written = n + max(ask.new_tokens - 1, 0)
        points = self.states.points(hit, n, written, bs)
        pos, logits = hit, None
        for stop in [p for p in points if p < n] + [n]:
            logits = self.executor(torch.tensor([ids[pos:stop]]), cache, pos, last_only=True)[0, -1]
            pos = stop
            self._save_state(cache, ids, pos, points, chain)
        first = time.perf_counter() - t0
        rng = torch.Generator().manual_seed(seed)
        eos = set(eos_ids(self.executor)) if stop_at_eos else set()
        generated, kept = [], []
        for i in range(ask.new_tokens):
            if keep_logits:
                kept.append(logits.float().cpu())
            token = ask.forced[i] if ask.forced is not None else choose(logits, sampling, rng)
            generated.append(token)
            if i == ask.new_tokens - 1 or (token in eos and ask.forced is None):
                break
            logits = self.executor(torch.tensor([[token]]), cache, pos, last_only=True)[0, -1]
            pos += 1
            self._save_state(cache, list(ids) + generated, pos, points, chain)
        return generated, (torch.stack(kept) if kept else None), first

    def _save_state(self, cache: PagedCache, ids: Sequence[int], pos: int, points: list[int],
                    chain: list[bytes]) -> None:
        """Save the recurrent states if ``pos`` is a checkpoint (keyed by the hash of the block ending there;
        ``chain``, the hashes worked out so far, grows to it)."""
        if pos in points:
            upto = block_hashes(ids, self.block_size, pos // self.block_size, known=chain)
            chain[len(chain):] = upto[len(chain):]
            self.states.save(cache, upto[-1])

    def finish(self, result: ServeResult) -> None:
        """Let a request served with ``keep=True`` give its pages back (they stay cached)."""
        if (cache := self._live.pop(result.index, None)) is None:
            raise SettingsError(f"{result.label} holds no pages (it was not served with keep=True, or has finished)")
        self._give_back(cache)

    # -- reading the pool ----------------------------------------------------------------------------------
    def frames(self) -> list[PoolFrame]:
        """The pool before any request (frame 0) and after each request served."""
        return list(self._frames)

    @property
    def blocks(self):
        """Every page as the pool holds it now (a :class:`~kvexplore.prefix.frames.BlockView` each)."""
        return self._maker.frame(None, [], len(self._frames)).blocks

    @property
    def tree(self):
        """The tree of cached prefixes now (:class:`~kvexplore.prefix.frames.TreeNode` each, parents first)."""
        return self._maker.frame(None, [], len(self._frames)).tree

    @property
    def hashes(self) -> dict[str, int]:
        """Short chain hash of each cached block -> its page."""
        return {short(h): p for p in range(self.num_blocks) if (h := self.index.hash_of(p)) is not None}

    @property
    def taking(self) -> str:
        """Which free page a request takes, in words (the policy's rule, with this pool's queue)."""
        if self.reuse == "uncached-first":
            return ("the front of one free queue, where a request's freed pages that cache nothing go first and its "
                    "cached ones last (vLLM 0.32): a cached block is evicted only when no uncached page is free")
        return self.index.taking

    @property
    def running(self) -> list[PagedCache]:
        """The caches of the requests served with ``keep=True`` that still hold their pages."""
        return list(self._live.values())

    @property
    def refcounts(self) -> list[int]:
        return list(self.pool.refcount)

    @property
    def free_queue(self) -> list[int]:
        """Free pages in the order they came back (the hash policy takes from the front)."""
        return list(self.pool.free)

    @property
    def page_bytes(self) -> int:
        return self.cache.table.page_bytes

    def sliding_kept(self) -> set[int] | None:
        """Pages whose sliding-window layers' share vLLM's hybrid manager would still hold (None: no such layers)."""
        return sliding_kept(self)

    def memory(self) -> dict[str, int]:
        """Bytes held now, by the pages and as vLLM would (:func:`kvexplore.prefix.footprint.memory`)."""
        return memory(self, self.sliding_kept())

    def tier_counts(self) -> dict[str, dict[str, int]]:
        """Per offload tier: blocks held, capacity, bytes (host: its whole buffer; disk: its files)."""
        return {} if self.tiers is None else self.tiers.counts()

    def kv_events(self) -> list[dict]:
        """What happened to the cache, one batch per request, as vLLM publishes its KV cache events (map form:
        ``{"ts", "events": [{"type": "BlockStored" | "BlockRemoved", ...}], "data_parallel_rank": 0}``)."""
        return self.events.batches()

    def save_html(self, path, title: str | None = None):
        """One self-contained HTML page of the pool's history: a slider over the requests redrawing the block pool,
        the tree and the timeline (:func:`kvexplore.replay.save_prefix_html`)."""
        return write_page(self, path, title=title)

    def __repr__(self) -> str:
        cached = sum(1 for p in range(self.num_blocks) if self.index.cached(p))
        return (f"PrefixPool({self.policy}, {self.num_blocks} blocks of {self.block_size}, {cached} cached, "
                f"{len(self.pool.free)} free, {len(self.results)} requests served)")
