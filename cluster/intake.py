"""Intake: a request body becomes an `Admitted` request, or a 4xx naming what is wrong.

Parse and validate the body, check the model name, decode and bound the media, plan the
prompt (placeholders expanded) and check that it and its KV fit. No worker is asked. Decoded
media counts against the ingress's in-flight budget (cluster/media/inflight.py) from its headers
until the request's prefill has its embeddings: images and videos go into Ray's object store
(`store`) right after each decodes, audio once the plan has cut it into windows, and the charge
moves with them to the Admitted request (`StoredMedia`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from actors.engine import kv
from actors.engine.grammar import GrammarError, grammar_of
from actors.types import GrammarSpec, MediaItem, SamplingParams
from cluster.admit_lanes import Deferred, admitting_on_loop, request_ended
from cluster.admitted import AdmissionTimings, Admitted, Endpoint
from cluster.backpressure import Overloaded
from cluster.chat_tools import ToolMode, grammar_for
from cluster.config import ClusterConfig
from cluster.errors import RequestError
from cluster.media.budget import PixelBudget
from cluster.media.decoders import MediaOptions
from cluster.media.errors import MediaError
from cluster.media.identifiers import media_identifier
from cluster.media.image import declared_size, low_detail
from cluster.media.inflight import MB, InFlightBudget, Ledger, MediaBusy, StoredMedia
from cluster.media.load import load_media_item
from cluster.media.video import VideoSampling
from cluster.prompt_plan import PromptError, PromptPlan, PromptPlanner
from cluster.protocol import ChatCompletionRequest, to_template_messages
from cluster.request_body import BodyError, HeldBody, parse_request
from cluster.sampling_fields import ModelBounds, ParamError
from router.types import Modality


class Intake:
    def __init__(
        self,
        config: ClusterConfig,
        planner: PromptPlanner,
        store: Callable[[np.ndarray], Any] | None = None,
    ):
        """`store` puts an array into Ray's object store (ray.put) and returns its ref; None
        (tests without Ray): items keep their arrays, and the budget is held to admission's end."""
        self.config, self.planner, self.store = config, planner, store
        limits = config.limits
        self.media_budget = InFlightBudget(
            limits.max_decoded_media_mb * MB,
            limits.max_waiting_for_decoded_media,
            limits.decoded_media_wait_s,
        )

    def admit(
        self,
        body: bytes | HeldBody,
        request_id: str,
        arrived_s: float,
        endpoint: Endpoint = Endpoint.CHAT,
    ) -> Admitted:
        started_s = time.perf_counter()
        try:
            request = parse_request(body, endpoint.request_model)
        except BodyError as exc:
            raise RequestError(400, exc.message, exc.param) from None
        parse_ms = (time.perf_counter() - started_s) * 1e3
        finish = functools.partial(self._admit_parsed, request, request_id, arrived_s, parse_ms)
        if admitting_on_loop() and not self._brief(request):
            raise Deferred(finish)  # the rest in a lane thread
        return finish()

    def _brief(self, request) -> bool:
        """Whether the rest of `request`'s admission is brief, for the event loop: no tools or
        grammar (a schema compiles) and no media (a text-lane body whose media part types were
        escaped: decoding is for the media lane)."""
        if not isinstance(request, ChatCompletionRequest):
            return True
        free_text = request.response_format is None or request.response_format.type == "text"
        if request.tools or not free_text:
            return False
        try:
            return not to_template_messages(request.messages)[1]
        except RequestError:  # the lane names it, after the checks that come first
            return False

    def _admit_parsed(
        self, request, request_id: str, arrived_s: float, parse_ms: float
    ) -> Admitted:
        parsed_s = decoded_s = time.perf_counter()
        if request.model != self.config.model.served_name:
            raise RequestError(
                404,
                f"model {request.model!r} does not exist; "
                f"this server serves {self.config.model.served_name!r}",
                "model",
                code="model_not_found",
            )
        media = None
        if isinstance(request, ChatCompletionRequest):
            plan, media, decoded_s = self._admit_media(request, range(request.n))
        else:
            plan = self._text_plan(request.prompt)
        try:
            sampling = request.to_sampling_params(len(plan.token_ids), self.bounds)
        except ParamError as exc:
            raise RequestError(400, exc.message, exc.param) from None
        if isinstance(request, ChatCompletionRequest):
            sampling = _constrained(request, sampling)
        self._kv_fits(
            len(plan.token_ids),
            sampling.max_tokens,
            "messages" if isinstance(request, ChatCompletionRequest) else "prompt",
        )
        ms = lambda a, b: (b - a) * 1e3  # noqa: E731
        timings = AdmissionTimings(
            parse_ms=parse_ms,
            media_ms=ms(parsed_s, decoded_s),
            plan_ms=ms(decoded_s, time.perf_counter()),
        )
        return Admitted(
            request_id, request, plan.items, plan, sampling, arrived_s, 0, timings, media
        )

    def _admit_media(
        self, request: ChatCompletionRequest, shares: Iterable[int]
    ) -> tuple[PromptPlan, StoredMedia | None, float]:
        """The request's media decoded and stored and its prompt planned: the plan, what stays
        charged until prefill (held by `shares`, the choices), and when decoding ended."""
        hf_messages, media = to_template_messages(request.messages)
        with Ledger(self.media_budget, request_ended()) as ledger:
            items = tuple(self._decode_media(media, ledger))
            decoded_s = time.perf_counter()
            plan = self._stored(self._plan(hf_messages, items, request))
            if self.store is None or not plan.items:
                return plan, None, decoded_s  # tests without Ray: given back as admission ends
            refs = [item.data_ref for item in plan.items if item.data_ref is not None]
            return plan, ledger.keep(refs, shares), decoded_s

    def reload_media(self, adm: Admitted) -> Admitted:
        """`adm` with its media decoded and stored again, for one choice's attempt after its
        pixels were released (the prefill worker that had their embeddings is gone)."""
        try:
            plan, media, _ = self._admit_media(adm.request, [adm.choice])
        except Overloaded as exc:
            raise RequestError(
                503,
                f"a worker failed under this request and its media could not be decoded again "
                f"for the retry: {exc.message}",
                type="server_error",
                retry_after_s=self.config.limits.retry_after_s,
            ) from None
        return dataclasses.replace(
            adm, items=plan.items, plan=dataclasses.replace(adm.plan, items=plan.items), media=media
        )

    def _kv_fits(self, num_prompt_tokens: int, max_tokens: int, prompt_param: str) -> None:
        """Refuse a request whose KV (prompt plus max_tokens) a decode worker could never hold:
        queued, it would wait for room that never comes."""
        per_token, limit_mb = self.planner.spec.kv_bytes_per_token, self.config.decode.kv_cache_mb
        need = kv.sequence_bytes(
            per_token, num_prompt_tokens, max_tokens, self.config.model.max_model_len
        )
        if need <= limit_mb * 2**20:
            return
        raise RequestError(
            400,
            f"this request's KV cache would take {need / 2**20:.2f} MiB "
            f"({num_prompt_tokens} prompt tokens + max_tokens {max_tokens}, {per_token} bytes "
            f"per token); a decode worker holds at most decode.kv_cache_mb = {limit_mb:g} MiB: "
            "lower max_tokens or shorten the prompt",
            "max_tokens" if per_token * num_prompt_tokens <= limit_mb * 2**20 else prompt_param,
            code="kv_cache_limit_exceeded",
        )

    @property
    def bounds(self) -> ModelBounds:
        return ModelBounds(
            self.config.model.max_model_len,
            len(self.planner.tokenizer),
            self.planner.eos_token_ids,
            self.config.limits.default_max_tokens,
        )

    def _media_options(self) -> MediaOptions:
        """The served model's input shape: its audio rate and the configured video sampling."""
        media = self.config.media
        return MediaOptions(
            audio_sample_rate_hz=self.planner.spec.audio_sample_rate_hz,
            video_sampling=VideoSampling(fps=media.video_fps, max_frames=media.video_max_frames),
        )

    def _decode_media(self, media, ledger: Ledger | None = None) -> list[MediaItem]:
        """The request's items decoded, in order; each is charged to `ledger` before it decodes,
        and an image or video is stored before the next decodes (its charge stays)."""
        limits = self.config.limits
        if len(media) > limits.max_items_per_request:
            raise RequestError(
                400,
                f"request has {len(media)} media items; "
                f"the limit is {limits.max_items_per_request}",
                "messages",
            )
        if ledger is not None and (declared := _declared_bytes(media, limits)):
            try:  # all of it before any item decodes: no decoding thrown away at a refusal
                ledger.reserve(declared, "messages")
            except MediaError as exc:
                raise RequestError(400, exc.message, exc.param) from None
            except MediaBusy as exc:
                raise Overloaded(exc.message) from None
        hold = ledger.hold if ledger is not None else None
        budget = PixelBudget(limits.max_request_pixels, hold)  # shared by the request's items
        items = []
        for part in media:
            if part.modality not in self.planner.spec.modalities:
                raise RequestError(
                    400,
                    f"model {self.config.model.served_name!r} "
                    f"does not take {part.modality.value} input",
                    part.param,
                )
            item = self._load(part, budget)
            # Audio waits for the plan, which cuts it into windows that read its samples.
            if item.modality != Modality.AUDIO:
                item = self._stored_item(item)
            items.append(item)
        return items

    def _load(self, part, budget: PixelBudget) -> MediaItem:
        """One part decoded (low detail applied) and checked against the model's processor."""
        try:
            item = load_media_item(
                part.modality,
                part.payload,
                namespace=self.config.model.served_name,
                limits=self.config.limits,
                param=part.param,
                format=part.format,
                options=self._media_options(),
                budget=budget,
            )
        except MediaError as exc:
            raise RequestError(400, exc.message, exc.param) from None
        except MediaBusy as exc:
            raise Overloaded(exc.message) from None
        if part.detail == "low":
            item = self._low_detail(item)
        try:
            self.planner.check_item(item)
        except PromptError as exc:
            raise RequestError(400, str(exc), part.param) from None
        return item

    def _stored(self, plan: PromptPlan) -> PromptPlan:
        """The plan with every item's data in the object store (audio windows go now), but
        for those small enough to travel inline."""
        if self.store is None or all(item.data_ref is not None for item in plan.items):
            return plan
        return dataclasses.replace(plan, items=tuple(map(self._stored_item, plan.items)))

    def _stored_item(self, item: MediaItem) -> MediaItem:
        """`item` with its data in the object store, unless it is there already or small
        enough to ride inside its encode call (`transport.inline_max_bytes`)."""
        inline = item.data.nbytes <= self.config.transport.inline_bytes
        if self.store is None or item.data_ref is not None or inline:
            return item
        return item.stored(self.store(item.data))

    def _low_detail(self, item: MediaItem) -> MediaItem:
        """image_url.detail "low": the shrunk image, under its own content identifier."""
        pixels = low_detail(item.data)
        if pixels is item.data:
            return item
        namespace = self.config.model.served_name
        identifier = media_identifier(namespace, item.modality, pixels, rate=None)
        return dataclasses.replace(item, data=pixels, identifier=identifier)

    def _plan(
        self, hf_messages: list[dict], items: tuple[MediaItem, ...], request: ChatCompletionRequest
    ) -> PromptPlan:
        tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
        if tools and not self.planner.takes_tools:
            raise RequestError(
                400,
                f"the chat template of model {self.config.model.served_name!r} has no tool "
                "format, so it cannot be given tools (model.chat_template can supply one)",
                "tools",
            )
        try:
            plan = self.planner.plan(
                hf_messages, list(items), tools or None, request.chat_template_kwargs
            )
        except PromptError as exc:
            raise RequestError(400, str(exc), "messages") from None
        except Exception as exc:  # the template itself refused (raise_exception, a bad kwarg)
            raise RequestError(400, f"the chat template failed: {exc}", "messages") from None
        return self._fits(plan, "messages")

    def _text_plan(self, prompt: str | list[int]) -> PromptPlan:
        try:
            return self._fits(self.planner.plan_text(prompt), "prompt")
        except PromptError as exc:
            raise RequestError(400, f"Invalid 'prompt': {exc}", "prompt") from None

    def _fits(self, plan: PromptPlan, param: str) -> PromptPlan:
        limit = self.config.model.max_model_len
        if len(plan.token_ids) >= limit:
            raise RequestError(
                400,
                f"prompt is {len(plan.token_ids)} tokens; this model's context is {limit} tokens",
                param,
                code="context_length_exceeded",
            )
        return plan


def _declared_bytes(media, limits) -> int:
    """RGB bytes the request's inline still images declare in their headers (nothing decoded).
    What breaks a pixel limit is left out: its own check refuses it, naming the item and limit."""
    sizes = [declared_size(part.payload) for part in media if part.modality == Modality.IMAGE]
    pixels = [w * h for w, h in filter(None, sizes) if w * h <= limits.max_image_pixels]
    return 3 * sum(pixels) if sum(pixels) <= limits.max_request_pixels else 0


def _constrained(request: ChatCompletionRequest, sampling: SamplingParams) -> SamplingParams:
    """`sampling` held to the grammar of the request's response_format or tool choice; a
    schema that cannot compile is a 400 naming the problem."""
    spec = grammar_for(
        request.response_format, request.tools, request.tool_choice, request.parallel_tool_calls
    )
    if spec is None:
        return sampling
    param = "response_format" if request.tool_mode == ToolMode.NONE else "tools"
    if (problem := _grammar_problem(spec)) is not None:
        raise RequestError(400, f"Invalid '{param}': {problem}", param)
    if sampling.min_tokens:  # a complete grammar allows only a stop token: none may follow
        raise RequestError(
            400, "min_tokens cannot be combined with structured output", "min_tokens"
        )
    return dataclasses.replace(sampling, grammar=spec)


@functools.lru_cache(maxsize=256)
def _grammar_problem(spec: GrammarSpec) -> str | None:
    """Why `spec` cannot compile (None: it can). Cached: agents send the same schema on every
    call, and parsing it into a grammar is work the workers' compile cache also saves."""
    try:
        grammar_of(spec)
    except GrammarError as exc:
        return str(exc)
    return None
