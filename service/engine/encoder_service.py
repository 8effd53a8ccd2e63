"""What one replica offers its routes: the engines of the models it serves, and the steps every
request takes through them: check the inputs, tokenize within the limits, queue the job for a
batch and wait for it within its deadline. No protocol here (the APIs of service/apis map requests
onto these steps, service/front errors onto statuses), and nothing of Ray Serve (service/deployment.py
builds this).
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from bundle.contract import PACKED_POOLINGS
from bundle.representations import colbert_cut, colbert_ids
from service.config import BatchingSettings, ServiceSettings
from service.engine.engine import Engine, EngineTable
from service.engine.prompts import prompt_for
from service.engine.errors import (BackendError, BadRequest, ClientGone, InvalidRequest, NotReady, ServiceError,
                                   Timeout, TooLarge)
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.tokenization import TokenizedText
from service.observability import tracing
from service.observability.metrics import service_metrics

logger = logging.getLogger("ray.serve")

# Requests up to this many characters are tokenized on the event loop: a hop to a worker thread
# costs more than tokenizing a few sentences does (one sentence: 28 us inline, 196 us of CPU with
# asyncio.to_thread, measured).
INLINE_TOKENIZE_CHARS = 2048


# What each kind of model serves, for the 422 of a route that does not fit a model's task.
ROUTES_BY_TASK = {
    "embedding": "/v1/embeddings, /v1/encode, /v1/similarity, /v1/attention, /v2/models/{name}/infer, /v1/tokenize; "
                 "/v1/rerank on a late-interaction model (ColBERT, BGE-M3)",
    "classification": "/v1/classify, /v1/rerank (one label: a cross-encoder), /v2/models/{name}/infer (text, "
                      "text_pair -> logits, scores), /v1/tokenize",
}


def as_list(inputs: str | list[str]) -> list[str]:
    return [inputs] if isinstance(inputs, str) else list(inputs)


class EncoderService:
    """One replica's engines and request limits; the batching knobs change live (reconfigure)."""

    def __init__(self, settings: ServiceSettings, engines: EngineTable) -> None:
        self.settings = settings
        self.engines = engines
        self.batching = settings.batching
        self.healthy = True
        self.replica: dict = {}  # what the deployment knows of its replica (id, node, GPU), for /info
        self.repository = None  # the replica's ModelRepository (service/engine/repository.py), with models_dir

    async def load_if_needed(self, name: str | None, timeout_s: float) -> None:
        """A model of the repository that a request names, loaded on this replica first (within `timeout_s`);
        a no-op for a loaded model, a served one, or no repository."""
        if name is None or self.repository is None:
            return
        if name in self.engines.by_name or name in self.engines.by_alias:
            self.repository.used(name)  # what decides which idle model makes room: how much each is used lately
            return
        await self.repository.ensure(name, timeout_s)

    # ---- lifecycle ----

    def warm_up(self) -> None:
        for engine in self.engines:
            engine.runner.warm_up()

    def reconfigure(self, batching: BatchingSettings) -> None:
        self.batching = batching
        for engine in self.engines:
            engine.reconfigure(batching)

    def check_health(self) -> None:
        """A tiny real inference per model; readiness follows the last check (a replica that
        recovered must not stay unready while it serves, its pod would flap)."""
        try:
            for engine in self.engines:
                engine.runtime.smoke_test()
        except Exception:
            self.healthy = False
            raise
        self.healthy = True

    def check_ready(self) -> None:
        if not self.healthy:
            raise NotReady("this replica's onnxruntime session failed its health check; it is being replaced",
                           retry_after_s=self.settings.retry_after_s)

    # ---- the steps of a request ----

    def model_for(self, name: str | None, asked_by: str, required: bool = False,
                  task: str | None = "embedding") -> Engine:
        """The model a request names (404 naming the served ones). `task`: what the route `asked_by`
        needs; a model of another task is a 422 that says which routes it serves. Left out, the model is
        the default, or the first served model of the route's task."""
        if name is None and task is not None and self.engines.default.model.task != task:
            name = next((e.name for e in self.engines if e.model.task == task), None)
        engine = self.engines.get(name, required)
        if task is not None and engine.model.task != task:
            raise InvalidRequest(
                f"model {engine.name!r} is a model of task {engine.model.task}: it serves "
                f"{ROUTES_BY_TASK[engine.model.task]}; {asked_by} needs a model of task {task} (served: "
                + ", ".join(f"{e.name!r} ({e.model.task})" for e in self.engines) + ")")
        return engine

    def prompted(self, engine: Engine, texts: list[str], prompt_name: str | None, input_type: str | None,
                 pooled_only: bool = True, chunked: bool = False) -> tuple[list[str], int]:
        """The texts with the request's prompt before each (service/engine/prompts.py), and how many of
        their first tokens pooling leaves out (EncodeJob.pool_skip). `pooled_only`: the request wants
        nothing but pooled outputs (no token encodings, no attention)."""
        prompt = prompt_for(engine.model, engine.name, prompt_name, input_type)
        if prompt is None:
            return texts, 0
        if chunked:
            raise InvalidRequest(f"chunking with a prompt ({prompt.name!r}) is not supported: a prompt goes before a "
                                 "whole text, not before each of its windows")
        if prompt.pool_skip and engine.model.dense_layers:
            # pooled here without the prompt, a Dense projection inside the graph would be skipped: such a
            # text must run on a packed row, which pools by weights before the Dense
            packs = engine.runner.runtime.packed is not None and bool(self.batching.packed_tokens)
            if not (packs and pooled_only):
                raise InvalidRequest(f"prompt {prompt.name!r} on model {engine.name!r} (its pooling leaves the prompt "
                                     "out, then a Dense projection follows) is served for pooled embeddings on packed "
                                     "rows only" + ("" if packs else ": packing is off on this replica"))
        return prompt.apply(texts), prompt.pool_skip


    @staticmethod
    def check_representations(engine: Engine, asked: list[str]) -> None:
        """A representation the model does not give is a 400 that says which it gives."""
        has = engine.model.representations
        if missing := [r for r in asked if r not in has]:
            raise BadRequest(f"model {engine.name!r} gives {', '.join(has) or 'no representation'}, not "
                             f"{', '.join(missing)} (the bundle's manifest says which: GET /info)")

    async def tokenize_for_model(self, engine: Engine, texts: list[str], truncate: bool, route: str, is_query: bool,
                                 protocol: str = "http", from_start: bool = False,
                                 kept: int = 0) -> tuple[list[TokenizedText], list[np.ndarray], list[int] | None]:
        """The texts' tokens and the ids they run with: the tokenizer's, or a ColBERT's (PyLate's tokenize:
        cut to its query or document length, its marker put second, a query padded with expansion tokens),
        with how many leading tokens of each are attended to (None: all)."""
        multivector = engine.model.multivector
        if multivector is None or multivector.kind != "colbert":
            tokenized = await self.tokenize(engine, texts, truncate, route, from_start=from_start, kept=kept,
                                            protocol=protocol)
            return tokenized, [t.ids for t in tokenized], None
        limit = colbert_cut(multivector, is_query) or engine.model.max_tokens
        what = "query" if is_query else "document"
        inline = sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS
        tokenized = await self._tokenizing(engine, route, protocol, inline, engine.tokenizer.encode_within, texts, limit,
                                           truncate, what)
        made = [colbert_ids(t.ids, multivector, is_query) for t in tokenized]
        ids, attended = [m[0] for m in made], [m[1] for m in made]
        self.check_tokens(sum(len(i) for i in ids), "split it into smaller requests")
        return tokenized, ids, attended if any(a < len(i) for a, i in zip(attended, ids, strict=True)) else None

    def texts(self, inputs: str | list[str]) -> list[str]:
        texts = as_list(inputs)
        if len(texts) > self.settings.max_inputs:
            raise TooLarge(f"{len(texts)} inputs; at most {self.settings.max_inputs} per request")
        for i, text in enumerate(texts):
            if len(text) > self.settings.max_text_chars:
                raise TooLarge(f"input {i} has {len(text)} characters; the limit is {self.settings.max_text_chars}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON allows "\ud800"; the tokenizer does not
                raise InvalidRequest(f"input {i} is not valid Unicode: {exc.reason} at character {exc.start}") from None
        return texts

    async def _tokenizing(self, engine: Engine, route: str, protocol: str, inline: bool, encode, *args):
        """One tokenizer call: on the event loop when the request is small (a thread hop costs more),
        else in a worker thread; its time goes to the tokenization stage of the duration metric."""
        started = time.perf_counter()
        with tracing.span("tokenize"):  # the request's span says how many texts
            result = encode(*args) if inline else await asyncio.to_thread(encode, *args)
        service_metrics().duration.observe(time.perf_counter() - started,
                                           tags={"route": route, "stage": "tokenization", "model": engine.name,
                                                 "task": engine.model.task, "protocol": protocol})
        return result

    async def tokenize(self, engine: Engine, texts: list[str], truncate: bool, route: str,
                       limit_tokens: bool = True, from_start: bool = False, kept: int = 0,
                       protocol: str = "http") -> list[TokenizedText]:
        """The whole request in one batch call of the tokenizer; off the event loop when it is large.
        `from_start`: truncation cuts a text's first tokens instead of its last, but not its first `kept`
        characters (the prompt put before every text: TextTokenizer.encode)."""
        inline = sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS
        tokenized = await self._tokenizing(engine, route, protocol, inline, engine.tokenizer.encode, texts, truncate, from_start,
                                           kept)
        if limit_tokens:
            self.check_tokens(sum(t.n_tokens for t in tokenized), "split it into smaller requests")
        return tokenized

    async def tokenize_whole(self, engine: Engine, texts: list[str], add_special_tokens: bool, route: str,
                             max_tokens: int) -> list:
        """Each text's tokens, never truncated (TEI's /tokenize), off the event loop when large; a request
        past `max_tokens` (what its response may hold) is a 413, found without tokenizing the texts after."""
        inline = sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS
        encodings = await self._tokenizing(engine, route, "http", inline, engine.tokenizer.encode_plain, texts,
                                           add_special_tokens, max_tokens)
        total = sum(len(e.ids) for e in encodings)
        if total > max_tokens:
            counted = "" if len(encodings) == len(texts) else f" in its first {len(encodings)} of {len(texts)} texts"
            raise TooLarge(f"request has {total} tokens{counted}; its response can hold at most {max_tokens} (the "
                           f"response limit is {self.settings.max_response_bytes} bytes): send fewer or shorter texts")
        return encodings

    async def cut_to_tokens(self, engine: Engine, texts: list[str], tokens: int, from_start: bool,
                            route: str) -> list[tuple[str, bool]]:
        """TextTokenizer.cut_to_tokens, off the event loop when the texts are large (Cohere's max_tokens)."""
        inline = sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS
        return await self._tokenizing(engine, route, "http", inline, engine.tokenizer.cut_to_tokens, texts, tokens, from_start)

    async def tokenize_pairs(self, engine: Engine, pairs: list[tuple[str, str]], truncate: bool,
                             route: str, from_start: bool = False, protocol: str = "http") -> list[TokenizedText]:
        """Text pairs as the model's tokenizer joins them; the token budget counts every pair."""
        inline = sum(len(a) + len(b) for a, b in pairs) <= INLINE_TOKENIZE_CHARS
        tokenized = await self._tokenizing(engine, route, protocol, inline, engine.tokenizer.encode_pairs, pairs, truncate,
                                           from_start)
        self.check_tokens(sum(t.n_tokens for t in tokenized), "send fewer documents")
        return tokenized

    async def tokenize_chunks(self, engine: Engine, texts: list[str], tokens: int, overlap: int,
                              route: str) -> list[list[TokenizedText]]:
        """Every text as overlapping token windows; the token budget counts every chunk."""
        limit = engine.model.max_tokens
        if tokens > limit:
            raise InvalidRequest(f"chunking.tokens {tokens} is past the model's limit of {limit} tokens")
        if overlap >= tokens - engine.tokenizer.special_tokens:
            raise InvalidRequest(f"chunking.overlap {overlap} leaves no new tokens in a chunk of {tokens} "
                                 f"({engine.tokenizer.special_tokens} of them special): make it smaller")
        # counted first, windowed only within the budget: building the windows of a request past it
        # would cost the memory the budget is there to bound
        counts = await self._tokenizing(engine, route, "http", False, engine.tokenizer.chunk_counts, texts, tokens, overlap,
                                        self.batching.max_batch_tokens)
        counted = "" if len(counts) == len(texts) else f" of its first {len(counts)} of {len(texts)} texts"
        self.check_tokens(sum(n for _, n in counts), "split it into smaller requests",
                          f" in {sum(w for w, _ in counts)} chunks{counted}")
        return await self._tokenizing(engine, route, "http", False, engine.tokenizer.encode_chunks, texts, tokens, overlap)

    def check_tokens(self, total: int, advice: str, counted: str = "") -> None:
        """A request's tokens against the token budget: the live knob (reconfigure) the batch queue uses."""
        limit = self.batching.max_batch_tokens
        if total > limit:
            raise TooLarge(f"request has {total} tokens{counted}; at most {limit} per request ({advice})")

    def check_attention_size(self, engine: Engine, tokenized: list[TokenizedText]) -> None:
        """Attention grows with n^2: refuse before inference what would fill the replica's memory."""
        model = engine.model
        values = sum(model.num_layers * model.num_heads * t.n_tokens**2 for t in tokenized)
        if values > self.settings.max_attention_values:
            raise TooLarge(
                f"the attention of this request is {values} values ({model.num_layers} layers x "
                f"{model.num_heads} heads x tokens^2, summed over {len(tokenized)} texts); the limit is "
                f"{self.settings.max_attention_values} (send fewer or shorter texts)"
            )

    def check_explain(self, words: int) -> None:
        """Occlusion runs the model once per word: refuse before inference what is past the limit."""
        if words > self.settings.max_explain_words:
            raise TooLarge(f"explain: {words} words to occlude, each an inference of its text without it; at most "
                           f"{self.settings.max_explain_words} per request (send fewer or shorter texts)")

    def check_response_size(self, n_bytes: int) -> None:
        if n_bytes > self.settings.max_response_bytes:
            raise TooLarge(
                f"the response would be about {n_bytes} bytes; the limit is {self.settings.max_response_bytes} "
                "(ask for fewer texts, layers or heads, or encoding_format/format base64, float16 for attention)"
            )

    @staticmethod
    def indexes(requested: list[int] | None, count: int, what: str) -> tuple[int, ...]:
        if requested is None:
            return tuple(range(count))
        bad = [i for i in requested if not 0 <= i < count]
        if bad:
            raise InvalidRequest(f"{what}s: unknown {what} index {bad[0]}: the model has {count} {what}s (0..{count - 1})")
        if len(set(requested)) != len(requested):
            raise InvalidRequest(f"{what}s: duplicate {what} indexes in {requested}")
        if not requested:
            raise InvalidRequest(f"{what}s: an empty list selects nothing; leave it out (or null) for all {count}")
        return tuple(requested)

    def check_cost(self, job: EncodeJob) -> None:
        """A job that could never join a batch (its cost past the budget) is refused before it queues."""
        cost = job.cost(self.batching)
        if cost > self.batching.max_batch_tokens:
            raise TooLarge(
                f"this request's {job.n_tokens} tokens and {job.attention_values} attention values count as "
                f"{cost} of one batch's {self.batching.max_batch_tokens} (attention at "
                f"{self.batching.max_batch_attention_values} values per batch): send fewer or shorter texts, or "
                "fewer layers or heads"
            )

    def split_to_budget(self, job: EncodeJob, what: str, advice: str) -> list[EncodeJob]:
        """The job's texts, in order, as jobs that each fit one batch's budget: for work the service
        itself derives from a request (explain's occlusion variants), which the client cannot split.
        The jobs still batch together through the queue. A text that alone cannot fit is a 413 naming
        it (`what` and its index)."""
        budget = self.batching.max_batch_tokens
        parts: list[EncodeJob] = []
        start = 0
        for end in range(1, len(job.ids) + 1):
            piece = job.texts(start, end)
            if piece.cost(self.batching) <= budget:
                continue
            if end - start == 1:
                raise TooLarge(f"{what} {start} alone counts as {piece.cost(self.batching)} of one batch's {budget} "
                               f"(its {piece.n_tokens} tokens and {piece.attention_values} attention values): {advice}")
            parts.append(job.texts(start, end - 1))
            start = end - 1
        parts.append(job.texts(start, len(job.ids)))
        return parts

    async def infer_all(self, engine: Engine, jobs: list[EncodeJob], timeout: float,
                        gone: asyncio.Future | None = None) -> list[EncodeResult]:
        """Several jobs of one request, batched like any others: every cost is checked before any job
        is queued, and the first failure (or the caller leaving) cancels the rest, so a refused
        request computes nothing more."""
        for job in jobs:
            self.check_cost(job)
        tasks = [asyncio.ensure_future(self.infer(engine, job, timeout, gone)) for job in jobs]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the cancelled ones have left their queue
        failed = next((t for t in tasks if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]

    async def infer(self, engine: Engine, job: EncodeJob, timeout: float,
                    gone: asyncio.Future | None = None) -> EncodeResult:
        """One request's job through its engine's batch queue, within `timeout` seconds.

        `gone` completes when the caller has left. A job past its deadline, or whose caller left,
        is cancelled: it leaves the batch queue before a batch forms, so nothing is computed for
        nobody.
        """
        self.check_cost(job)  # it could never join a batch
        job.enqueued = time.perf_counter()
        job.trace = tracing.current()  # the request's trace, for its queue and inference spans
        alone = not self.batching.enabled  # fixed now: the knob may change while this job waits
        if alone:  # every request alone: for comparison
            result = asyncio.ensure_future(engine.batcher.run([job]))
        else:
            result = asyncio.ensure_future(engine.batcher.submit(job))
        watched = {result} | ({gone} if gone is not None else set())
        try:
            done, _ = await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not result.done():
                result.cancel()  # timed out, caller gone, or this handler cancelled
        if result not in done:
            if done:
                raise ClientGone("the client closed the connection before the result was ready")
            raise Timeout(f"inference did not finish within {timeout:g}s", retry_after_s=self.settings.retry_after_s)
        try:
            outcome = result.result()
        except ServiceError:
            raise
        except Exception as exc:  # the batch failed (a broken session): one error for its requests
            logger.warning("batch failed: %s: %s", type(exc).__name__, exc)
            raise BackendError(f"inference failed ({type(exc).__name__}); the request can be retried") from None
        return outcome[0] if alone else outcome

    # ---- what it runs, for /info ----

    def batch_shape(self, engine: Engine) -> str:
        """How this model's texts are batched, and why not packed where they are not: packed rows hold
        every family exactly (each text keeps its own positions, window and causal mask), but not a
        pooling without per-token weights, nor a replica configured without them; a runtime on a device
        (its `sizing`) runs a batch as one padded run instead."""
        if engine.runtime.packed is not None and self.batching.packed_tokens:
            return (f"packed: texts that need only their pooled output run several to a row of up to "
                    f"{self.batching.packed_tokens} tokens, each attending only its own; the rest run padded")
        if engine.runtime.packed is not None:
            return "padded only: batching.packed_tokens is 0"
        if engine.runtime.sizing == "device":  # onnxruntime on CUDA packs nothing: its runs are one per batch
            return (f"padded, sized for a device: a batch's texts run as one padded run of up to "
                    f"{self.batching.device_run_tokens} tokens, its length rounded up to a multiple of "
                    f"{self.batching.device_length_bucket} (texts that want attention weights: sized as on a CPU)")
        if engine.model.pooling not in PACKED_POOLINGS:
            return f"padded only: {engine.model.pooling} pooling has no per-token weights to pool a packed row by"
        return "padded only: the bundle has no packed graph"

    def describe(self, engine: Engine) -> dict:
        """One model's execution state in this replica: provider, precision, graphs, counters."""
        runtime = engine.runtime
        return {
            "runtime": runtime.runtime,
            "provider": runtime.provider,
            "provider_note": runtime.provider_note,
            "intra_op_threads": runtime.threads,
            "precision": runtime.precision,
            "precision_requested": runtime.precision_requested,
            "precision_note": runtime.precision_note,
            "runtime_choice": runtime.choice,  # the row of service/runtimes/choice.py's table that chose it, and the table
            "cuda": runtime.describe_cuda(),
            "graphs": {"attentions": runtime.full.label, "encodings": runtime.fast.label,
                       "packed": runtime.packed.label if runtime.packed is not None else None},
            "batches": self.batch_shape(engine),
            "sizing": runtime.sizing,  # how its padded runs are sized: "cpu" or "device" (service/runtimes' Sizing)
            "graph_providers": {"attentions": runtime.full.provider, "encodings": runtime.fast.provider},
            "ort_runs_by_graph": dict(engine.runner.runs_by_graph),
            "counters": dict(engine.runner.counters),
        }
