"""The OpenAI-compatible HTTP API (`--http-port`), served by aiohttp on the
tokenizer's event loop, beside its gRPC server: the same `TokenizerService`
runs every request, so an HTTP request is prepared, admitted, cancelled and
released exactly as a gRPC one.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses
(each streaming or not; the Responses API over the chat path,
`openai_responses`), GET /v1/models, GET and DELETE /v1/responses/{id} and
GET /v1/responses/{id}/input_items (the stored responses, `response_store`),
POST /tokenize and /detokenize and GET /tokenizer_info (vLLM's),
GET /health (200 only while a scheduler backend is ready, else 503; vLLM's
GET and POST /ping the same), GET /version (vLLM's: the server's version). With
`--api-key-file`, every /v1 route and the token routes need
``Authorization: Bearer <key>`` with a key of the file (401 otherwise;
compared in constant time; the file is read again when it changes).

Streams are server-sent events: for chat a first chunk with the assistant's
role, then content deltas, a chunk with the finish reason, the usage chunk
when `stream_options.include_usage` asks (``choices: []``), then
``data: [DONE]``. An error after the stream began is one
``data: {"error": ...}`` event, then ``[DONE]``; never a silent close. While
nothing comes (a long fetch, preprocessing or prefill) a comment line
(``: keep-alive``) goes out every KEEPALIVE_S, so proxies keep the
connection (a Responses stream is its typed events instead, each with an
``event:`` line, ending with response.completed). A client that
disconnects cancels its request at once (the
handler is cancelled: aiohttp's handler_cancellation), and everything the
request held is released as for a gRPC cancel.

Errors are the OpenAI body ``{"error": {"message", "type", "param",
"code"}}``, `code` our ErrorCode name, the status from one table
(`openai_api.STATUS`); a body over `--http-max-body-bytes` is 413 in that
shape, malformed JSON 400, and a bug 500 with ``x-should-retry: false``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import hmac
import ipaddress
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from mmsplit import __version__
from mmsplit.errors import InternalError, MmsplitError, Unauthenticated
from mmsplit.tokenizer.v1 import tokenizer_pb2
from mmsplit_server import strict_json
from mmsplit_server.serving import RequestSummary, SecretFile
from mmsplit_server.settings import CONNECTIONS_AT_MOST
from tokenizer_svc import openai_answers, openai_api, openai_responses, reasoning, response_store, tool_calls
from tokenizer_svc.conversation import MAX_REQUEST_ID, valid_request_id
from tokenizer_svc.errors import InvalidRequest, Overloaded
from tokenizer_svc.response_store import ResponseStore
from tokenizer_svc.service import TokenizerService, merged

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0
# --http-request-timeout-s: for a request's headers, then for its body.
REQUEST_TIMEOUT_S = 75.0
# A body this large is parsed off the event loop.
BIG_BODY = 1 << 20
# Connections refused at --max-connections are said in the log at most this often.
REFUSALS_LOG_EVERY_S = 60.0
_T = TypeVar("_T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# Routes beside /v1 that --api-key-file guards too (they do a request's work).
_KEYED = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
# How an answer is shaped: chat or completions objects and chunks, or a Response and its events.
Shaped = openai_answers.Shape | openai_responses.Answer


class HttpApi:
    """The routes, over one `TokenizerService`."""

    def __init__(
        self,
        service: TokenizerService,
        *,
        model: str,
        ready: Callable[[], bool],
        api_keys: SecretFile | None = None,
        max_body_bytes: int,
        body_bytes_in_flight: int = 0,
        metrics: Any = None,
        keepalive_s: float = KEEPALIVE_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        tool_parser: str = "none",
        reasoning_parser: str = "none",
        store: ResponseStore | None = None,
        trusted_proxies: Sequence[IpNetwork] = (),
        cors_origins: Sequence[str] = (),
    ) -> None:
        self.service = service
        # --cors-allow-origins: pages of these origins may call from a browser ("*": any).
        self.cors_origins = frozenset(cors_origins)
        # --forwarded-allow-ips: proxies whose X-Forwarded-For names the client.
        self.trusted_proxies = tuple(trusted_proxies)
        # The Responses API's stored responses (--responses-store-bytes; off without one).
        self.store = store if store is not None else ResponseStore(0)
        self.tool_parser = tool_parser  # --tool-call-parser
        # --reasoning-parser: chat answers' thinking apart from their content.
        parser = reasoning.PARSERS.get(reasoning_parser)
        self.reasoning = parser(service.tokenizer) if parser is not None else None
        self.model = model
        self.ready = ready
        self.api_keys = api_keys  # --api-key-file: any of its keys, as the file is now
        self.max_body_bytes = max_body_bytes
        self.bodies = BodyBudget(body_bytes_in_flight)  # --max-body-bytes-in-flight
        self.metrics = metrics
        self.keepalive_s = keepalive_s
        self.request_timeout_s = request_timeout_s
        self.created = int(time.time())
        # (route, status) -> responses, for the metrics.
        self.responses: dict[tuple[str, int], int] = {}
        # Connections closed unread at --max-connections, and the count when that was last logged.
        self.refused_connections = 0
        self._refusals_said = 0
        # Connections closed unread at --max-connections-per-client.
        self.refused_per_client_connections = 0
        # Each said in the log at most once a minute: a flood of connections is not a flood of lines.
        self._say_refusals, self._say_client_refusals = _Sometimes(), _Sometimes()

    def refuse_client_connection(self, peer: str, limit: int) -> None:
        """Count a connection closed unread because its address had `limit`
        open (said in the log at most once a minute)."""
        self.refused_per_client_connections += 1
        if self._say_client_refusals.due():
            log.warning(
                "HTTP: %s has %d connection(s) open, the limit per client (--max-connections-per-client): its new "
                "ones are closed unread (%d so far, from any address)",
                peer,
                limit,
                self.refused_per_client_connections,
            )

    def is_trusted_proxy(self, address: str) -> bool:
        """Whether `address` is one of --forwarded-allow-ips."""
        return _is_trusted(address, self.trusted_proxies)

    def refuse_connection(self, limit: int) -> None:
        """Count a connection closed unread at the limit (said in the log
        at most once a minute, with how many since)."""
        self.refused_connections += 1
        if self._say_refusals.due():
            log.warning(
                "HTTP: %d connection(s) open, the limit (--max-connections): new ones are closed unread "
                "(%d so far, %d since this was last said)",
                limit,
                self.refused_connections,
                self.refused_connections - self._refusals_said,
            )
            self._refusals_said = self.refused_connections

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._preflight, self._errors])
        app.on_response_prepare.append(self._cors_headers)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses_api)
        app.router.add_get("/v1/responses/{id}", self.stored_response)
        app.router.add_delete("/v1/responses/{id}", self.delete_response)
        app.router.add_get("/v1/responses/{id}/input_items", self.input_items)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model_card)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)  # vLLM's (SageMaker's health check), GET or POST
        app.router.add_post("/ping", self.health)
        app.router.add_get("/version", self.version)
        return app

    # ---- CORS: browsers' pages of --cors-allow-origins ----

    def _allowed_origin(self, request: web.Request) -> str:
        """The Access-Control-Allow-Origin for `request` ("" for none)."""
        origin = request.headers.get("Origin", "")
        if not origin or not self.cors_origins:
            return ""
        if "*" in self.cors_origins:
            return "*"
        return origin if origin in self.cors_origins else ""

    @web.middleware
    async def _preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A browser's preflight (OPTIONS with Access-Control-Request-Method)
        from an allowed origin: answered here, before authentication (a
        preflight carries no credentials); any other goes on as it is."""
        allowed = self._allowed_origin(request)
        if request.method != "OPTIONS" or not allowed or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        headers = {
            "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
            "Access-Control-Max-Age": "600",
        }
        if asked := request.headers.get("Access-Control-Request-Headers"):
            headers["Access-Control-Allow-Headers"] = asked  # Authorization among them: a wildcard would not cover it
        return web.Response(status=204, headers=headers)

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every response to an allowed origin's page, streams included (this
        runs as the headers go out), says so; a response that may differ by
        origin says that too, for caches."""
        if allowed := self._allowed_origin(request):
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Access-Control-Expose-Headers"] = "x-request-id, x-should-retry, retry-after"
            if allowed != "*":
                response.headers.add("Vary", "Origin")

    # ---- middleware: every error in the OpenAI shape, auth, counting ----

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await self._answered(request, handler)
        finally:
            # However it ended (a stream's end, an error, its client gone).
            self.bodies.give_back(request)

    async def _answered(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The handler's response, or the error's in the OpenAI shape."""
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        response: web.StreamResponse
        try:
            if self.api_keys is not None and (request.path.startswith("/v1/") or request.path in _KEYED):
                self._authenticate(request)
            self.bodies.take(request, request.content_length or 0)
            response = await handler(request)
        except BodiesOverBudget as exc:
            # Its body unread: answered, and its connection closed rather than read to its end.
            response = _error_response(exc)
            response.force_close()
        except UnreadableBody as exc:
            # The connection's stream past the bad bytes cannot be read: answer,
            # then close it (left open, aiohttp would try to drain the body
            # after the handler and log the same error as an unhandled one).
            response = _error_response(exc)
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
        except MmsplitError as exc:
            response = _error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            response = _json(
                413,
                openai_api.error_json(
                    f"the request body is over the limit of {self.max_body_bytes} bytes", "invalid_request_error",
                    "MEDIA_TOO_LARGE",
                ),
                {"x-should-retry": "false"},
            )  # fmt: skip
        except web.HTTPException as exc:  # no such route, method not allowed
            status = exc.status
            kind = "not_found_error" if status == 404 else "invalid_request_error"
            code = "NOT_FOUND" if status == 404 else "INVALID_REQUEST"
            message = self._unrouted(request) if status == 404 else f"{exc.reason}: {request.method} {request.path}"
            response = _json(status, openai_api.error_json(message, kind, code), {"x-should-retry": "false"})
        except Exception:
            incident = uuid.uuid4().hex[:12]
            log.exception("HTTP %s %s failed on an unexpected error (incident %s)", request.method, route, incident)
            response = _error_response(InternalError(f"internal error (incident {incident})"))
        key = (route, response.status)
        self.responses[key] = self.responses.get(key, 0) + 1
        return response

    @staticmethod
    def _unrouted(request: web.Request) -> str:
        """A 404's message: the path, and the API's paths that are served
        (a client pointed at an endpoint this server lacks, such as
        /v1/embeddings, learns so, not just "Not Found")."""
        served = set()
        for resource in request.app.router.resources():
            info = resource.get_info()
            path = info.get("path") or info.get("formatter", "")
            if path.startswith("/v1/"):
                served.add(path)
        return f"{request.path} is not served here; the OpenAI-compatible API serves {', '.join(sorted(served))}"

    def _authenticate(self, request: web.Request) -> None:
        assert self.api_keys is not None
        scheme, presented = _bearer(request)
        # Every key compared (no early stop: the time says nothing of which matched).
        matched = [hmac.compare_digest(presented.encode(), key.encode()) for key in self.api_keys.secrets()]
        if scheme.lower() != "bearer" or not any(matched):
            raise Unauthenticated("a valid API key is required (Authorization: Bearer <key>)")

    # ---- routes ----

    async def health(self, request: web.Request) -> web.Response:
        if self.ready():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "not ready"}, status=503, headers={"Retry-After": "1"})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        """The SDK's `models.retrieve(name)`."""
        name = request.match_info["model"]
        if name != self.model:
            return _not_served(name, self.model)
        return web.json_response(self._card())

    def _other_model(self, body: Any) -> web.Response | None:
        """The 404 of a body naming a model this server does not serve."""
        model = body.get("model") if isinstance(body, dict) else None
        return None if model is None or model == self.model else _not_served(model, self.model)

    def _card(self) -> dict[str, Any]:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "mmsplit"}
        if longest := self.service.link.max_context:
            card["max_model_len"] = longest
        return card

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the prompt ids a request would be generated
        from (media preprocessed to count their placeholders), their count
        and the context they must fit (`max_model_len`, when a scheduler
        says)."""
        got = await _body(request, self.request_timeout_s, self.max_body_bytes, self.bodies)
        body = got.value
        if (other := self._other_model(body)) is not None:
            return other
        asked = await got.read(openai_api.parse_tokenize, body)
        if asked.request is not None:
            ids = await self.service.tokenize(asked.request, _request_id(request), self._client(request))
        else:
            ids = await self._tokenize_text(asked.text or "")
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.service.link.max_context, "tokens": ids}
        answer["token_strs"] = self.service.tokenizer.convert_ids_to_tokens(ids) if asked.strs else None
        return web.json_response(answer)

    async def _tokenize_text(self, text: str) -> list[int]:
        """A text's own tokens (no BOS, no template), off the event loop."""
        limit = self.service.settings.max_prompt_chars
        if len(text) > limit:
            raise InvalidRequest(f"prompt has {len(text)} characters, at most {limit}", metadata={"param": "prompt"})
        tokenizer = self.service.tokenizer
        return await asyncio.to_thread(lambda: list(tokenizer(text, add_special_tokens=False)["input_ids"]))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's /tokenizer_info (what lm-evaluation-harness's remote
        tokenizer reads): the tokenizer's special tokens and the chat
        template the server renders conversations with."""
        tokenizer = self.service.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[name] = getattr(tokenizer, name, None)
        info["chat_template"] = self.service.prompts.chat_template
        info["model_max_length"] = self.service.link.max_context
        return web.json_response(info)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of token ids (special tokens included)."""
        got = await _body(request, self.request_timeout_s, self.max_body_bytes, self.bodies)
        body = got.value
        if (other := self._other_model(body)) is not None:
            return other
        tokens = await got.read(openai_api.parse_detokenize, body, self.service.settings.max_prompt_chars)
        vocab = len(self.service.tokenizer)
        if any(t >= vocab for t in tokens):
            raise InvalidRequest(
                f"tokens: {max(tokens)} is outside the vocabulary of {vocab}", metadata={"param": "tokens"}
            )
        text = await asyncio.to_thread(self.service.tokenizer.decode, tokens)
        return web.json_response({"prompt": text})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def responses_api(self, request: web.Request) -> web.StreamResponse:
        """The Responses API: the body as a chat request, the answer as a Response."""
        got = await _body(request, self.request_timeout_s, self.max_body_bytes, self.bodies)
        body = got.value
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        history = None
        if previous is not None:
            entry = self._stored(request, previous, "previous_response_id")
            if isinstance(entry, web.Response):
                return entry
            history = entry.conversation
        chat, places = await got.read(openai_responses.to_chat, body, history)
        try:
            call = await got.read(openai_api.parse_chat, chat, self.tool_parser)
        except MmsplitError as exc:
            raise openai_responses.rename(exc, places) from None
        rid = _request_id(request)
        keep = self._keeper(request, body, chat, places)
        if self.reasoning is not None:  # its prompt's ids say whether the model starts inside its thinking
            call.request.return_prompt_token_ids = True
        # The object echoes the body's settings, not its input (its data:
        # URLs are megabytes: kept only by `keep`, when the answer is stored).
        echoed = {key: value for key, value in body.items() if key != "input"}
        answer = openai_responses.Answer(
            rid, self.model, echoed, call.calls, places, keep, reasoning=self.reasoning,
            constrained=reasoning.structured(call.request.sampling),
        )  # fmt: skip
        if (other := self._other_model(chat)) is not None:
            return other
        del got, body, chat
        return await self._serve(request, call, answer, rid)

    def _keeper(
        self, request: web.Request, body: dict[str, Any], chat: dict[str, Any], places: list[str]
    ) -> Callable[[dict[str, Any]], None] | None:
        """What stores a Responses request's answer (`store`, true unless
        false, and a store): its conversation (but the instructions) and
        its output, under its client's key."""
        store = body.get("store", True)
        if not isinstance(store, bool):
            raise InvalidRequest("store must be true or false", metadata={"param": "store"})
        if not store or not self.store.enabled:
            return None
        conversation = [m for m, place in zip(chat["messages"], places, strict=True) if place != "instructions"]
        owner = self._owner(request)

        def keep(response: dict[str, Any]) -> None:
            # The messages are the request's own, never changed after parsing: kept as they are.
            try:
                self.store.put(response, [*conversation, *response_store.output_messages(response)], owner)
            except Exception:  # the answer stands; only its keeping failed
                log.exception("response %s could not be stored", response.get("id"))

        return keep

    def _client(self, request: web.Request) -> str:
        """Who sent `request`, for --max-inflight-per-client: its API key
        (a digest of it) where keys are required, else its address, as a
        gRPC call's is named (behind a proxy, the proxy's, unless the proxy
        is one --forwarded-allow-ips trusts: then the one X-Forwarded-For names)."""
        if self.api_keys is not None:
            return "key:" + hashlib.sha256(_bearer(request)[1].encode()).hexdigest()[:32]
        forwarded = request.headers.getall("X-Forwarded-For", [])
        return "addr:" + forwarded_client(request.remote or "", forwarded, self.trusted_proxies)

    def _owner(self, request: web.Request) -> bytes:
        """Whose stored responses a request may read: its API key's (none without keys)."""
        return response_store.owner_of(None if self.api_keys is None else _bearer(request)[1])

    def _stored(self, request: web.Request, rid: Any, param: str) -> response_store.Stored | web.Response:
        """The stored response `rid` of this request's client, or the 400 or 404 to answer."""
        if not isinstance(rid, str) or not rid:
            raise InvalidRequest(f"{param} must be a response id", metadata={"param": param})
        if not self.store.enabled:
            raise InvalidRequest(
                f"{param}: this server stores no responses (--responses-store-bytes 0): send the whole "
                "conversation as input",
                metadata={"param": param},
            )
        entry = self.store.get(rid, self._owner(request))
        if entry is not None:
            return entry
        message = (
            f"no response {rid!r} is stored here (responses live in one tokenizer's memory, dropped when it is "
            "full; a replica does not see another's)"
        )
        return _json(
            404, openai_api.error_json(message, "not_found_error", "NOT_FOUND", param), {"x-should-retry": "false"}
        )

    async def stored_response(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}: a stored response of this client."""
        entry = self._stored(request, request.match_info["id"], "id")
        return entry if isinstance(entry, web.Response) else web.json_response(entry.response)

    async def input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}/input_items: the items that made a stored
        response (its input and the turns before it), a page of `limit`
        (1-100, 20) in `order` (desc, the default, or asc) `after` an item."""
        entry = self._stored(request, request.match_info["id"], "id")
        if isinstance(entry, web.Response):
            return entry
        query = request.query
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be asc or desc", metadata={"param": "order"})
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise InvalidRequest("limit must be an integer within [1, 100]", metadata={"param": "limit"})
        items = entry.input_items()
        if order == "desc":
            items.reverse()
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidRequest(f"after: no item {after!r} in this response", metadata={"param": "after"})
            items = items[ids.index(after) + 1 :]
        page = items[: int(limit)]
        first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
        listed = {
            "object": "list",
            "data": page,
            "first_id": first,
            "last_id": last,
            "has_more": len(items) > len(page),
        }
        return web.json_response(listed)

    async def delete_response(self, request: web.Request) -> web.Response:
        """DELETE /v1/responses/{id}: a stored response of this client, let go."""
        rid = request.match_info["id"]
        entry = self._stored(request, rid, "id")
        if isinstance(entry, web.Response):
            return entry
        self.store.delete(rid, self._owner(request))
        return web.json_response({"id": rid, "object": "response", "deleted": True})

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        got = await _body(request, self.request_timeout_s, self.max_body_bytes, self.bodies)
        body = got.value
        if chat:
            call = await got.read(openai_api.parse_chat, body, self.tool_parser)
        else:
            call = await got.read(openai_api.parse_completion, body)
        rid = _request_id(request, body)
        if (other := self._other_model(body)) is not None:
            return other
        # The body is parsed into `call`: not held while the answer streams
        # (its data: URLs are megabytes; the request, which has its own
        # copy, is handed to the service: `Call.hand_over`).
        del got, body
        thinks = self.reasoning if chat else None
        if thinks is not None:  # its prompt's ids say whether the model starts inside its thinking
            call.request.return_prompt_token_ids = True
        shape = openai_answers.Shape.of(
            chat, rid, self.model, call.calls, token_ids=call.token_ids, reasoning=thinks,
            constrained=reasoning.structured(call.request.sampling), shows_reasoning=call.include_reasoning,
        )  # fmt: skip
        return await self._serve(request, call, shape, rid)

    async def _serve(self, request: web.Request, call: openai_api.Call, shape: Shaped, rid: str) -> web.StreamResponse:
        """Run `call` (of a body naming this server's model, or none) and
        answer it in `shape`: whole, or streamed."""
        if isinstance(call.calls, openai_api.Forced):
            await tool_calls.check_schema(call.request.sampling.json_schema)
        client = self._client(request)
        summary = RequestSummary(rid, protocol="http", route=request.path, client=client, choices=call.choices)
        # Its body's bytes count against --max-body-bytes-in-flight until
        # its answer starts: by then its media are prepared and let go
        # (`Call.hand_over`), unless a stored Responses answer keeps its
        # input, or other prompts' requests are still the call's.
        kept = isinstance(shape, openai_responses.Answer) and shape.keep is not None
        started = None if kept or call.others else functools.partial(self.bodies.give_back, request)
        try:
            if call.stream:
                return await self._stream(request, call, shape, rid, summary, client=client, started=started)
            choices = self._tally(call)
            async for i, response in self._choices(call, rid, client, started):
                _count(summary, response)
                _prompted(shape, i, response)
                choices.add(i, response)
            summary.finished("STOP", choices.prompt_tokens, sum(choices.completion_tokens))
            answer = shape.complete(choices, logprobs=call.request.sampling.logprobs)
            return web.json_response(answer, headers={"x-request-id": rid})
        except MmsplitError as exc:
            summary.outcome = exc.reason
            raise shape.rename(exc) from None
        finally:
            summary.log(log, self.metrics)

    def _tally(self, call: openai_api.Call) -> openai_answers.Choices:
        """What `call`'s choices produce, kept for its answer; with the
        prompts' text when they are echoed (a prompt of token ids decoded
        as generated text is)."""
        tokenizer = self.service.tokenizer
        texts: tuple[str, ...] = ()
        if call.echo:
            texts = tuple(
                r.prompt or tokenizer.decode(list(r.prompt_token_ids), skip_special_tokens=True) for r in call.requests
            )
        s = call.request.sampling
        echo = openai_answers.Echo(
            texts, s.top_logprobs if call.echo and s.logprobs else None, call.prompt_logprobs, alone=call.scored_only
        )
        return openai_answers.Choices(
            call.choices, tokenizer, per_prompt=call.n, echo=echo, token_ids=call.token_ids,
            tokens_as_ids=call.tokens_as_ids,
        )  # fmt: skip

    async def _choices(
        self, call: openai_api.Call, rid: str, client: str, started: Callable[[], None] | None = None
    ) -> AsyncIterator[tuple[int, tokenizer_pb2.GenerateResponse]]:
        """Every choice's responses as they come (the service runs the n
        choices of a prompt), with the choice's index; several prompts'
        requests run at once, prompt p's choices numbered from p * n (each
        prompt a request of `client`'s). `started` is called with the
        first response of a call of one prompt."""
        if not call.others:
            # Handed over: its media go once prepared (the call keeps the rest).
            async for response in self.service.generate(call.hand_over(), rid, None, client):
                if started is not None:
                    started()
                    started = None
                yield response.index, response
            return
        sources = [
            _numbered(self.service.generate(r, f"{rid}-{p}", None, client), p * call.n)
            for p, r in enumerate(call.requests)
        ]
        async with contextlib.aclosing(merged(sources)) as items:
            async for item in items:
                yield item

    async def _stream(
        self,
        request: web.Request,
        call: openai_api.Call,
        shape: Shaped,
        rid: str,
        summary: RequestSummary,
        *,
        client: str,
        started: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Server-sent events (`client`: who sent it, as `_client` names
        them). Errors before the first byte are ordinary error responses
        (the middleware); after it, an error event. However the handler ends
        (a client gone while its media were still being fetched included),
        the request's work is closed here."""
        events = _Prefetch(self._choices(call, rid, client, started))
        try:
            first = await events.first(self.keepalive_s)
            if first is not None:  # what the prompt refuses (--reasoning-parser's) is a 400, before the stream
                _prompted(shape, *first)
            return await self._sse(request, events, first, call, shape, rid, summary)
        finally:
            await events.aclose()

    async def _sse(
        self,
        request: web.Request,
        events: _Prefetch,
        first: Any,
        call: openai_api.Call,
        shape: Shaped,
        rid: str,
        summary: RequestSummary,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "x-request-id": rid}
        )
        await response.prepare(request)
        choices = self._tally(call)
        try:
            for event in shape.opening(call.choices):
                await _send(response, shape.sse(event))
            if first is None:  # nothing yet after a keepalive period: say so, then wait on
                await response.write(b": keep-alive\n\n")
            async for item in events.rest(first, self.keepalive_s):
                if item is None:
                    await response.write(b": keep-alive\n\n")
                    continue
                i, event = item
                _count(summary, event)
                _prompted(shape, i, event)
                shown = choices.add(i, event)
                for out in shape.step(i, shown, choices.text[i]) if shown is not None else ():
                    if call.continuous_usage:
                        out["usage"] = choices.usage_so_far()
                    await _send(response, shape.sse(out))
            for out in shape.closing(choices, call.include_usage):
                await _send(response, shape.sse(out))
            summary.finished("STOP", choices.prompt_tokens, sum(choices.completion_tokens))
        except MmsplitError as exc:
            summary.outcome = exc.reason
            log.info("request %s failed: %s", rid, exc)
            _, body, _ = openai_api.error_body(shape.rename(exc))
            await _send(response, shape.sse(shape.failure(body)))
        except ConnectionResetError:
            # The client went away and a write found out before aiohttp
            # cancelled this handler: CANCELLED (the summary's default), as
            # if it had been cancelled; nothing more can be written.
            log.info("request %s: the client went away mid-stream", rid)
            return response
        except Exception:
            summary.outcome = "INTERNAL"
            incident = uuid.uuid4().hex[:12]
            log.exception("request %s failed on an unexpected error (incident %s)", rid, incident)
            body = openai_api.error_json(f"internal error (incident {incident})", "server_error", "INTERNAL")
            await _send(response, shape.sse(shape.failure(body)))
        await response.write(shape.DONE)
        await response.write_eof()
        return response


def _prompted(shape: Shaped, i: int, response: tokenizer_pb2.GenerateResponse) -> None:
    """Tell `shape` choice `i`'s prompt ids when `response` is they."""
    if response.WhichOneof("event") == "prompt_tokens":
        shape.prompted(i, list(response.prompt_tokens.token_ids))


async def _numbered(
    source: AsyncIterator[tokenizer_pb2.GenerateResponse], first: int
) -> AsyncGenerator[tuple[int, tokenizer_pb2.GenerateResponse], None]:
    async for response in source:
        yield first + response.index, response


class _Prefetch:
    """An event source read with a patience: None when nothing came within
    it (the stream then sends a keep-alive), the first event read before
    the response starts, so that an error that comes at once is an
    ordinary error response."""

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source = source
        self._next: asyncio.Task[Any] | None = None
        self._done = False

    async def _get(self, patience_s: float) -> tuple[bool, Any]:
        """(True, event), (True, None) for a timeout, or (False, None) at the end."""
        if self._next is None:
            self._next = asyncio.ensure_future(anext(self._source))
        if not (await asyncio.wait([self._next], timeout=patience_s))[0]:
            return True, None
        task, self._next = self._next, None
        try:
            return True, task.result()
        except StopAsyncIteration:
            self._done = True
            return False, None
        finally:
            # The end, raised here from the task, holds this frame in its
            # traceback: the frame must not hold the task that holds the end
            # (nor `asyncio.wait`'s sets of it): a reference cycle each
            # stream left for the collector.
            del task

    async def first(self, patience_s: float) -> Any:
        ok, event = await self._get(patience_s)
        return event if ok else _END

    async def rest(self, first: Any, patience_s: float) -> AsyncIterator[Any]:
        if first is _END:
            return
        if first is not None:
            yield first
        while not self._done:
            ok, event = await self._get(patience_s)
            if ok:
                yield event

    async def aclose(self) -> None:
        """Cancel the step in flight and wait for it (its cleanup releases
        what the request held), then close the source. `asyncio.wait` does
        not raise the step's own cancellation, and a cancellation of the
        caller while it waits still reaches the caller."""
        if self._next is not None:
            self._next.cancel()
            await asyncio.wait([self._next])
            if not self._next.cancelled():
                self._next.exception()  # read: the request's end, which nobody reports now
        with contextlib.suppress(RuntimeError):  # a generator still running its cancelled step
            await self._source.aclose()  # type: ignore[attr-defined]


_END = object()


def _count(summary: RequestSummary, response: tokenizer_pb2.GenerateResponse) -> None:
    if response.HasField("delta") and response.delta.token_ids:
        summary.token(len(response.delta.token_ids))


@dataclass
class _Body:
    """A request's JSON body, and whether it is big (over BIG_BODY bytes):
    then what reads it runs off the event loop."""

    value: Any
    big: bool

    async def read(self, parse: Callable[..., _T], *args: Any) -> _T:
        """`parse(*args)`, in a thread for a big body: the 16 prompts of
        100,000 token ids each that one completions body may carry took
        0.16 s to check, and JSON parsing 0.1 s."""
        return await asyncio.to_thread(parse, *args) if self.big else parse(*args)


class UnreadableBody(InvalidRequest):
    """The request's body stream broke while it was read (aiohttp's
    RequestPayloadError): its answer is the connection's last."""


async def _body(request: web.Request, timeout_s: float, limit: int, budget: BodyBudget | None = None) -> _Body:
    """The JSON body, at most `limit` bytes, which must arrive within
    `timeout_s`: a client that trickles it (or stops) would hold the
    connection and this handler for ever."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await _read(request, limit, budget)
    except TimeoutError:
        raise openai_api.BodyTimeout(
            f"the request body did not arrive within {timeout_s:g} s (--http-request-timeout-s)"
        ) from None
    except web.RequestPayloadError as exc:  # e.g. a Content-Encoding its bytes are not in
        why = getattr(exc.__cause__, "message", "") or " ".join(str(exc).split())
        raise UnreadableBody(f"the request body could not be read: {why}") from None
    big = len(raw) > BIG_BODY
    try:
        return _Body(await asyncio.to_thread(strict_json.loads, raw) if big else strict_json.loads(raw), big)
    except strict_json.LoneSurrogate as exc:
        param = {"param": exc.param} if exc.param else None
        raise InvalidRequest(f"the request body is not text: {exc}", metadata=param) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # valid JSON nested deeper than the parser goes
        raise InvalidRequest("the request body nests too deeply") from exc


async def _read(request: web.Request, limit: int, budget: BodyBudget | None = None) -> bytes:
    """The request's body, over `limit` bytes a 413 (as aiohttp's
    `client_max_size`, but before a byte is read when its Content-Length
    says so). Not `request.read()`, which keeps the bytes on the request
    for as long as it lives: a streamed answer's whole generation, so every
    stream in flight held its body's megabytes of data: URLs once more
    (bench/stream_hold.py)."""
    if (declared := request.content_length) is not None and declared > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        if budget is not None and size > (declared or 0):  # no Content-Length (chunked), or more than it said
            budget.take(request, size - max(declared or 0, budget.taken(request)))
        chunks.append(chunk)
    return b"".join(chunks)


class BodiesOverBudget(Overloaded):
    """A request refused before its body was read: the bodies held would pass `--max-body-bytes-in-flight`."""


_HELD = web.RequestKey("mmsplit_body_bytes", int)  # what a request holds of its BodyBudget (on the request)


class BodyBudget:
    """The bytes of request bodies this server holds at once
    (--max-body-bytes-in-flight; 0: no limit): each request's, by its
    Content-Length before its body is read (or as a chunked body
    arrives), until its answer starts (its media are prepared and let go
    by then: bench/stream_hold.py), or ends where the answer keeps its
    input (a stored Responses answer) or other prompts' requests. Without it, bodies are bounded
    only by connections x --http-max-body-bytes: a few hundred clients
    uploading 280 MB bodies at once would be gigabytes before any request
    counts against --max-inflight. A request that would pass the limit is
    OVERLOADED (429, Retry-After) before a byte of its body is read; one
    is always let through when nothing is held (--http-max-body-bytes
    bounds it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.refused = 0  # requests refused

    def taken(self, request: web.Request) -> int:
        return int(request.get(_HELD, 0))

    def take(self, request: web.Request, n: int) -> None:
        if n <= 0:
            return
        # Let through when only this request holds any (a chunked body's
        # own earlier chunks): the others' bytes decide.
        if self.limit and self.held > self.taken(request) and self.held + n > self.limit:
            self.refused += 1
            raise BodiesOverBudget(
                f"the request bodies in progress hold {self.held:,} bytes: {n:,} more would pass the limit of "
                f"{self.limit:,} (--max-body-bytes-in-flight); retry shortly"
            )
        self.held += n
        request[_HELD] = self.taken(request) + n

    def give_back(self, request: web.Request) -> None:
        self.held -= self.taken(request)
        request[_HELD] = 0


def forwarded_client(remote: str, forwarded: Sequence[str], trusted: Sequence[IpNetwork]) -> str:
    """The client's address: `remote`, or, where `remote` is a trusted
    proxy, the right-most address of X-Forwarded-For (`forwarded`: its
    headers) that is not one (the left-most when every one is). Entries to
    the left of the first untrusted one are the client's to write, so they
    are never taken."""

    if not trusted or not _is_trusted(remote, trusted):
        return remote
    hops = [hop.strip() for header in forwarded for hop in header.split(",") if hop.strip()]
    for hop in reversed(hops):
        if not _is_trusted(hop, trusted):
            return hop
    return hops[0] if hops else remote


def _is_trusted(address: str, trusted: Sequence[IpNetwork]) -> bool:
    """Whether `address` (an IP address, else never) lies in one of `trusted`."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in trusted)


def _bearer(request: web.Request) -> tuple[str, str]:
    """The Authorization header's scheme and credential."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme, token.strip()


def _request_id(request: web.Request, body: Any = None) -> str:
    """The client's X-Request-Id, else (chat and completions) vLLM's
    `request_id` of the body, as vLLM takes them: 1 to 128 printable
    characters, its logs and ours then name the request alike; it comes
    back in x-request-id and the object's id. Else a new one."""
    given, where, param = request.headers.get("X-Request-Id"), "the X-Request-Id header", "X-Request-Id"
    if given is None and isinstance(body, dict) and body.get("request_id") is not None:
        given, where, param = body["request_id"], "request_id", "request_id"
    if given is None:
        return uuid.uuid4().hex
    if not isinstance(given, str) or not valid_request_id(given):
        raise InvalidRequest(f"{where} must be 1 to {MAX_REQUEST_ID} printable characters", metadata={"param": param})
    return given


async def _send(response: web.StreamResponse, data: bytes) -> None:
    """One event of a stream."""
    await response.write(data)


def _json(status: int, body: dict[str, Any], headers: dict[str, str]) -> web.Response:
    return web.json_response(body, status=status, headers=headers)


def _not_served(model: object, served: str) -> web.Response:
    status, kind = openai_api.NOT_FOUND
    message = f"the model {model!r} does not exist here; this server serves {served!r}"
    return _json(status, openai_api.error_json(message, kind, "NOT_FOUND", "model"), {"x-should-retry": "false"})


def _error_response(exc: MmsplitError) -> web.Response:
    status, body, headers = openai_api.error_body(exc)
    return _json(status, body, headers)


class _Sometimes:
    """`due()` is True at most once every `every_s` seconds (the first call's included)."""

    def __init__(self, every_s: float = REFUSALS_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last = -every_s

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True


class _Refused(asyncio.Protocol):
    """A connection past the limit: closed at once, before a byte is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _PerClient(asyncio.Protocol):
    """aiohttp's handler of one connection, admitted only while its address
    has fewer than --max-connections-per-client open (its address is known
    once the transport is made): else closed at once, unread, and aiohttp
    never sees it. Everything else goes to the handler."""

    def __init__(self, handler: web.RequestHandler, site: _LimitedSite) -> None:
        self._handler = handler
        self._site = site
        self._peer: str | None = None  # once admitted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        if not self._site.admit(peer, self._handler):
            transport.close()
            return
        self._peer = peer
        self._handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is not None:
            self._site.release(self._peer)
            self._handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self) -> None:
        self._handler.eof_received()  # aiohttp's returns None: the transport closes itself

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()


class _LimitedSite(web.TCPSite):
    """aiohttp's TCP site, except that a connection accepted while `limit`
    are open is closed at once, unread, instead of handed to aiohttp: idle
    keep-alive connections and half-sent requests (each may be held for
    --http-request-timeout-s) cannot pile up until the process is out of
    descriptors, which every request, the slab and the scheduler's
    connection need. A client sees its connection closed and retries (the
    OpenAI SDK does, with backoff). aiohttp counts a connection once its
    transport is made, a turn of the event loop after it was accepted (up
    to the listen backlog, 128, are accepted in one turn), so handlers
    handed out and not yet counted by aiohttp are counted here until they
    are (without them, 1,100 connects from one client against a limit of 4
    left 9 open). (aiohttp 3.14's `TCPSite.start`, the protocol factory
    wrapped; aiohttp is pinned, and test_connection_limit holds the
    behaviour.)"""

    # A handler whose transport is not made within this long never will be
    # (the accept failed on the way): it is no longer counted.
    UNMADE_S = 1.0

    def __init__(
        self, runner: web.AppRunner, host: str, port: int, *, limit: int, per_client: int = 0, api: HttpApi
    ) -> None:
        super().__init__(runner, host, port)
        self._limit = limit
        self._per_client = per_client  # 0: no limit per address
        self._api = api
        # Handlers handed out whose connection aiohttp has not counted yet, with when.
        self._unmade: list[tuple[web.RequestHandler, float]] = []
        # Open connections by address (--max-connections-per-client); an entry only while one is open.
        self.by_client: collections.Counter[str] = collections.Counter()

    def admit(self, peer: str, handler: web.RequestHandler) -> bool:
        """Count a connection from `peer`, or refuse it (False) at the
        limit per client; a trusted proxy's are counted, never refused."""
        if self.by_client[peer] >= self._per_client and not self._api.is_trusted_proxy(peer):
            self._unmade = [(h, at) for h, at in self._unmade if h is not handler]
            self._api.refuse_client_connection(peer, self._per_client)
            return False
        self.by_client[peer] += 1
        return True

    def release(self, peer: str) -> None:
        self.by_client[peer] -= 1
        if not self.by_client[peer]:
            del self.by_client[peer]

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        now = time.monotonic()
        self._unmade = [(h, at) for h, at in self._unmade if h.transport is None and now - at < self.UNMADE_S]
        if len(server.connections) + len(self._unmade) >= self._limit:
            self._api.refuse_connection(self._limit)
            return _Refused()
        handler = server()
        self._unmade.append((handler, now))
        return _PerClient(handler, self) if self._per_client else handler

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, self._host, self._port, backlog=self._backlog
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]


class _ClientsMalformedHttp(logging.Filter):
    """aiohttp answers a request it cannot parse (a bad chunk size, a header
    line too long: the client's malformed HTTP) with a plain 400 and logs it
    at ERROR with a traceback, so any scanner of the port would fill the
    logs with tracebacks and set off alerts on errors. Such a record becomes
    one WARNING line that names the client and what was wrong (a request
    that is not HTTP at all aiohttp already logs only at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = f"{record.getMessage()}: {' '.join(str(exc).split())}"
            record.args, record.exc_info, record.exc_text = None, None, None
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def _quiet_malformed_http() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientsMalformedHttp) for f in server_log.filters):
        server_log.addFilter(_ClientsMalformedHttp())


async def start(
    api: HttpApi, host: str, port: int, *, max_connections: int = CONNECTIONS_AT_MOST, max_per_client: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve `api` on host:port (0: a free one), at most `max_connections`
    connections open at once, and `max_per_client` from one address (0: no
    limit); the runner and the port. Handlers are cancelled when their
    client disconnects."""
    # keepalive_timeout also bounds the wait for a request's headers: aiohttp
    # closes a connection with no whole request that long after it opened or
    # after its last answer (its default, an hour, let half-sent requests
    # hold connections).
    _quiet_malformed_http()
    runner = web.AppRunner(
        api.app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=0,
        keepalive_timeout=api.request_timeout_s,
    )
    await runner.setup()
    try:
        await _LimitedSite(runner, host, port, limit=max_connections, per_client=max_per_client, api=api).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]
