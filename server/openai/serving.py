"""The text edge of the server: OpenAI requests in, engine requests out, and text back.

`OpenAIServing` is what the routes call. It owns the path between a validated request body and
its response: prompts and chat templates to token ids, the engine requests of a generation
(`sampling_params` maps fields to `SamplingParams`), the generation loop that turns each
`StepOutput` into text (`generation.Choice`: detokenization, stop strings, whose match aborts the
request in the engine), per-request metrics and the one log line per request. Bodies, SSE chunks
and disconnects are `server.openai.formats`'; who a request comes from and how many it may have open,
`server.generation.tenancy`'; errors leave through `server.errors`. It talks to the engine only through an
`EngineClient`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from engine import (
    EngineDeadError,
    InvalidRequestError,
    Request,
    SamplingParams,
    StepOutput,
)
from engine.structured import StructuredSpec
from models import Tokenizer
from server.engine_client.interface import EngineClient
from server.engine_client.remote_grammar import grammar_constraints
from server.errors import APIError
from server.generation.metrics import ServerMetrics
from server.generation.tenancy import ClientSlots, client_identity
from server.generation.text import Choice, Generation
from server.grammars.check_worker import CheckBudget
from server.grammars.compiler import StructuredOutputs, structured_spec
from server.openai.chat_output import ParsedChatFormat
from server.openai.echo import prompt_logprobs_wanted
from server.openai.formats import (
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    SSEResponse,
    TokenText,
    Update,
    full_body,
    models_body,
    per_step,
    stream_body,
    until_disconnect,
)
from server.openai.prompt_tokens import PromptTokenizer
from server.openai.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    SamplingFields,
    TokenizeRequest,
)
from server.openai.sampling_params import (
    chat_sampling_params,
    check_token_ids,
    completion_sampling_params,
    context_too_long,
)
from server.tooling.chat_template import ChatTemplate
from server.tooling.plan import ToolPlan, parameter_specs, plan_tools, tool_structured_spec

log = logging.getLogger("server.requests")

# The default of `--response-budget`: entries one response may carry (a logprob: a token's own or
# one of its top alternatives, prompt and generated, over every choice; an embedded input
# token). About 35 MB of JSON logprobs; a request over it is refused before it runs.
DEFAULT_RESPONSE_BUDGET = 512 * 1024


class OpenAIServing:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Tokenizer,
        card: ModelCard,
        metrics: ServerMetrics | None = None,
        *,
        log_prompts: bool = False,
        max_concurrent_per_client: int | None = None,
        stall_timeout: float | None = None,
        chat_template: str | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str | None = None,
        response_budget: int = DEFAULT_RESPONSE_BUDGET,
        grammar_budget: CheckBudget | None = None,
    ) -> None:
        self.client = client
        # issue 25: the chat template (or --chat-template), --tool-call-parser, --reasoning-parser
        self.chat_template = ChatTemplate(tokenizer, chat_template)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        # A streamed response whose client reads nothing for this long is given up (aborted).
        self.stall_timeout = stall_timeout
        # Open generation requests per client identity, against `max_concurrent_per_client`.
        self.client_slots = ClientSlots(max_concurrent_per_client)
        self.tokenizer = tokenizer
        self.card = card
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.vocab_size = tokenizer.vocab_size
        self.defaults = card.default_sampling_params
        self.structured = StructuredOutputs(tokenizer, budget=grammar_budget)
        self.token_text = TokenText(tokenizer)
        # Prompts to ids off the event loop, bounded by the context first (server.openai.prompt_tokens)
        self.prompts = PromptTokenizer(tokenizer, card.max_model_len)
        self.response_budget = response_budget

    def close(self) -> None:
        """Stop the helpers (grammar check worker, tokenizer threads): the app's shutdown."""
        self.structured.close()
        self.prompts.close()

    # -- public entry points -------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return models_body(self.card)

    async def completions(self, req: CompletionRequest, http: HTTPRequest) -> Response:
        arrival = time.monotonic()
        model = self._check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        for p in req.prompts:  # cheap checks of every prompt before any is tokenized
            if isinstance(p, str):
                self.prompts.check_size(p, "prompt")
            else:
                check_token_ids(p, self.vocab_size, "prompt")
        prompts, texts = await self.prompts.run(self._completion_prompts, req)
        if not all(prompts):
            raise APIError(
                400, "prompt must not be empty (it encodes to no tokens)", param="prompt"
            )
        gen_id = self._new_id("cmpl", http, texts)
        if req.max_tokens == 0 and not req.echo:  # the document's cross-field rule
            raise APIError(
                400,
                "max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                param="max_tokens",
            )
        params = completion_sampling_params(req, self.vocab_size, self.defaults)
        if (top_n := prompt_logprobs_wanted(req)) is not None:  # server.openai.echo
            params = [replace(p, prompt_logprobs=top_n) for p in params]
        self._check_lengths(prompts, req.n, params[0].max_tokens)
        # echo's logprobs and vLLM's prompt_logprobs are two renderings of one computation
        shown = (req.prompt_logprobs is not None) + (req.echo and req.logprobs is not None)
        self._check_budget(prompts, params, prompt_renderings=shown)
        gen, requests = await self._generation(
            gen_id, http, arrival, model, prompts, texts, req, params, req.logprobs, req.echo
        )
        fmt = CompletionFormat(gen, self.token_text, req.prompt_logprobs)
        return await self._respond(gen, requests, fmt, req.stream, http)

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest) -> Response:
        gen, requests, plan = await self.chat_requests(req, http)
        fmt: ResponseFormat
        if plan is not None or self.reasoning_parser is not None:  # issue 25 hook
            fmt = ParsedChatFormat(gen, self.token_text, plan, self.reasoning_parser)
        else:
            fmt = ChatFormat(gen, self.token_text)
        return await self._respond(gen, requests, fmt, req.stream, http)

    async def chat_requests(
        self, req: ChatCompletionRequest, http: HTTPRequest, prefix: str = "chatcmpl"
    ) -> tuple[Generation, list[Request], ToolPlan | None]:
        """A chat request's generation and engine requests, not yet submitted, and its tool plan
        (also the path of /v1/responses, server.openai.responses)."""
        arrival = time.monotonic()
        model = self._check_model(req.model)
        plan = plan_tools(req, self.tool_call_parser, self.chat_template.source)
        # The messages alone may be more than the context holds: no template, no tokenizer.
        self.prompts.check_parts([m.text() for m in req.messages], "messages")
        for tool_params in parameter_specs(req):  # whatever tool_choice says
            await self._check_grammar(tool_params, http, code="invalid_tools")
        text, ids = await self.prompts.run(self._chat_prompt, req, plan)
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", param="messages")
        gen_id = self._new_id(prefix, http, [text])
        for name in ("max_tokens", "max_completion_tokens"):
            # Each is bounded by the context on its own (the schema says so), also when the
            # other one is what counts.
            value = getattr(req, name)
            if value is not None and value > self.card.max_model_len:
                raise APIError(
                    400,
                    f"{name} ({value}) is more than the model's context length "
                    f"({self.card.max_model_len} tokens)",
                    param=name,
                    code="context_length_exceeded",
                )
        max_tokens = req.max_output_tokens(context_left=self.card.max_model_len - len(ids))
        if max_tokens < 1:  # no max_tokens given, and the prompt fills the context
            raise context_too_long(self.card.max_model_len, len(ids), 1)
        params = chat_sampling_params(req, self.vocab_size, max_tokens, self.defaults)
        self._check_lengths([ids], req.n, params[0].max_tokens)
        self._check_budget([ids], params)
        spec = tool_structured_spec(plan, req)  # issue 25 hook: the tools' grammar, if any
        gen, requests = await self._generation(
            gen_id,
            http,
            arrival,
            model,
            [ids],
            [text],
            req,
            params,
            req.num_logprobs,
            tool_spec=spec,
        )
        return gen, requests, plan

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        if req.messages is not None:

            def render_and_encode() -> list[int]:
                text = self._render_chat(req.messages, req.add_generation_prompt)
                self.prompts.check_size(text, "messages")
                return self.prompts.encode_now(text, False)

            ids = await self.prompts.run(render_and_encode)
        else:
            ids = await self.prompts.encode(req.prompt or "", req.add_special_tokens, "prompt")
        return {"count": len(ids), "max_model_len": self.card.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        check_token_ids(req.tokens, self.vocab_size, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    # -- request -> engine -------------------------------------------------------------------------------

    def _completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Each prompt's ids and text (tokenizer threads: `server.openai.prompt_tokens`)."""
        prompts: list[list[int]] = []
        texts: list[str] = []
        for p in req.prompts:
            if isinstance(p, str):
                prompts.append(self.prompts.encode_now(p, True))
                texts.append(p)
            else:
                prompts.append(list(p))
                texts.append(self.tokenizer.decode(list(p)) if req.echo else "")
        return prompts, texts

    def _chat_prompt(
        self, req: ChatCompletionRequest, plan: ToolPlan | None
    ) -> tuple[str, list[int]]:
        """The rendered chat prompt and its ids (tokenizer threads: `server.openai.prompt_tokens`)."""
        text = self.chat_template.render(
            req.messages, req.add_generation_prompt, plan, req.chat_template_kwargs
        )
        self.prompts.check_size(text, "messages")
        return text, self.prompts.encode_now(text, False)

    async def _check_grammar(self, spec: StructuredSpec, http: HTTPRequest, code: str) -> None:
        """A spec checked out of harm's way (`server.grammars.compiler`); a 400 with `code` if not."""
        try:
            await self.structured.check(spec, http)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param, code=code) from e

    def _check_budget(
        self,
        prompts: list[list[int]],
        params: Sequence[SamplingParams],
        prompt_renderings: int = 1,
    ) -> None:
        """400 (response_too_large) for a request whose logprobs could exceed the response
        budget: every choice's prompt logprobs (shown `prompt_renderings` times), and its
        generated tokens' logprobs up to max_tokens, each with its top alternatives."""
        prompt = generated = 0
        for ids in prompts:
            for p in params:
                if p.prompt_logprobs is not None:
                    prompt += (p.prompt_logprobs + 1) * len(ids) * prompt_renderings
                if p.logprobs is not None:
                    generated += (p.logprobs + 1) * p.max_tokens
        if prompt + generated > self.response_budget:
            raise APIError(
                400,
                f"this request asks for up to {prompt + generated} logprob entries (prompt "
                "tokens and max_tokens, each with its top alternatives, over every choice), more "
                f"than the server's response budget of {self.response_budget}; ask for fewer "
                "choices, alternatives or tokens",
                param="prompt_logprobs" if prompt > generated else "logprobs",
                code="response_too_large",
            )

    def _check_model(self, name: str | None) -> str:
        if name is not None and name not in self.card.names:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return self.card.name

    def _render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        return self.chat_template.render(messages, add_generation_prompt)  # issue 25 hook

    def _new_id(self, prefix: str, http: HTTPRequest, texts: list[str]) -> str:
        gen_id = f"{prefix}-{uuid.uuid4().hex}"
        http.state.request_id = gen_id  # errors from here on name it (server.errors)
        if self.log_prompts:
            log.info("%s prompt=%r", gen_id, texts if len(texts) > 1 else texts[0])
        return gen_id

    def _check_lengths(self, prompts: list[list[int]], n: int, max_tokens: int) -> None:
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(
                400,
                f"prompts x n may be at most {MAX_CHOICES}, got {len(prompts) * n}",
                param="n",
                code="too_many_choices",
            )
        for ids in prompts:
            if len(ids) + max_tokens > self.card.max_model_len:
                raise context_too_long(self.card.max_model_len, len(ids), max_tokens)

    async def _generation(
        self,
        gen_id: str,
        http: HTTPRequest,
        arrival: float,
        model: str,
        prompts: list[list[int]],
        texts: list[str],
        req: SamplingFields,
        params: Sequence[SamplingParams],
        logprobs: int | None,
        echo: bool = False,
        tool_spec: StructuredSpec | None = None,
    ) -> tuple[Generation, list[Request]]:
        """The generation and its engine requests: one request (and choice) per prompt and
        choice index, with the choice's params and its own grammar state when the request asks
        for structured output."""
        try:
            spec = tool_spec or structured_spec(req)  # issue 25: a tools grammar replaces it
            constraints = (
                # issue 25, item 6: compiled here, or sent as specs to a replica
                await grammar_constraints(
                    self.structured, self.client, spec, len(prompts) * len(params), http
                )
                if spec is not None
                else None
            )
        except InvalidRequestError as e:
            # A grammar, regex or JSON schema that does not parse or compile, or more than one
            # way of asking for structured output: rules the OpenAPI document does not state
            # (server.http.openapi.UNSTATED_RULE_CODES says why), so the 400 names itself.
            raise APIError(400, str(e), param=e.param, code=_grammar_code(e.param)) from e
        eos = () if req.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        stop_ids = frozenset(eos) | frozenset(req.stop_token_ids or ())
        client_id = client_identity(http)
        choices: list[Choice] = []
        requests: list[Request] = []
        for p, ids in enumerate(prompts):
            for j, choice_params in enumerate(params):
                index = p * len(params) + j
                rid = f"{gen_id}-{index}"
                choices.append(
                    Choice(
                        index=index,
                        request_id=rid,
                        prompt_index=p,
                        tokenizer=self.tokenizer,
                        prompt_ids=ids,
                        stops=req.stop_strings,
                        stop_ids=stop_ids,
                    )
                )
                requests.append(
                    Request(
                        list(ids),
                        choice_params,
                        request_id=rid,
                        arrival_time=arrival,
                        cache_salt=req.cache_salt,
                        priority=req.priority,
                        client_id=client_id,
                        constraint=None if constraints is None else constraints[index],
                    )
                )
        gen = Generation(
            id=gen_id,
            model=model,
            created=int(time.time()),
            arrival=arrival,
            prompts=prompts,
            prompt_texts=texts,
            choices=choices,
            client_id=client_id,
            include_usage=req.include_usage,
            echo=echo,
            logprobs=logprobs,
            grammar_param=spec.param if spec is not None else None,
        )
        return gen, requests

    async def _respond(
        self,
        gen: Generation,
        requests: list[Request],
        fmt: ResponseFormat,
        stream: bool,
        http: HTTPRequest,
    ) -> Response:
        if stream:
            await self._submit(gen, requests)
            return SSEResponse(
                per_step(gen, stream_body(fmt, self._updates(gen))),
                lambda: self._finish(gen),
                stall_timeout=self.stall_timeout,
            )
        return await until_disconnect(http, self._full(gen, requests, fmt))

    async def _full(
        self, gen: Generation, requests: list[Request], fmt: ResponseFormat
    ) -> Response:
        await self._submit(gen, requests)
        async for _ in self._updates(gen):
            pass
        return JSONResponse(full_body(fmt))

    async def _submit(self, gen: Generation, requests: list[Request]) -> None:
        # What the client refuses (QueueFullError, InvalidRequestError, EngineDeadError) leaves
        # through server.errors' table.
        self.client_slots.take(gen.client_id)
        gen.counted = True
        try:
            gen.stream = await self.client.submit(requests)
        except BaseException:
            self._release(gen)
            raise
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in requests))

    # -- the generation loop, shared by every response shape -------------------------------------------

    async def _updates(self, gen: Generation) -> AsyncIterator[Update]:
        """(choice, text delta to send, new logprobs, new token count) per engine output, until
        all choices end."""
        assert gen.stream is not None
        try:
            async for out in gen.stream:
                c = gen.by_request[out.request_id]
                if c.finished:
                    continue  # queued before a stop string ended it
                self._observe(gen, c, out)
                if c.update(out):  # a stop string: end it in the engine now
                    self.client.abort(c.request_id)
                if c.finished and self.metrics is not None:
                    self.metrics.finished.labels(c.finish_reason).inc()
                if out.error is not None:  # its grammar could not go on: no normal end
                    gen.status = "grammar_error"
                    raise APIError(
                        400,
                        f"choice {c.index}: {out.error}",
                        param=gen.grammar_param,
                        code=_grammar_code(gen.grammar_param),
                    )
                yield c, c.take_delta(), out.logprobs or [], len(out.token_ids)
        except EngineDeadError:
            gen.status = "engine_error"
            raise
        except BaseException:  # cancelled: the client disconnected, or the server is stopping
            if gen.status == "ok":
                gen.status = "aborted"
            raise
        finally:
            self._finish(gen)

    def _finish(self, gen: Generation) -> None:
        """Abort whatever is still open and log the request. Idempotent."""
        if gen.done:
            return
        gen.done = True
        self._release(gen)
        if gen.stream is not None:
            for rid in gen.stream.open_request_ids:
                self.client.abort(rid)
        for c in gen.choices:
            if not c.finished:
                c.finish_reason = "abort"
                if gen.status == "ok":
                    gen.status = "aborted"
                if self.metrics is not None:
                    self.metrics.finished.labels("abort").inc()
        log.info("%s", gen.summary())

    def _release(self, gen: Generation) -> None:
        """Give back the generation's place in its client's concurrency count. Idempotent."""
        if not gen.counted:
            return
        gen.counted = False
        self.client_slots.give_back(gen.client_id)

    def _observe(self, gen: Generation, c: Choice, out: StepOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        if m is not None:
            m.generation_tokens.inc(len(out.token_ids))
            if c.first_time is None:
                m.ttft.observe(now - gen.arrival)
                m.live.observe_ttft(now - gen.arrival)
            elif c.last_time is not None:
                m.itl.observe(now - c.last_time)
                m.live.observe_itl(now - c.last_time)
            if out.finished:
                m.e2e.observe(now - gen.arrival)
        if c.first_time is None:
            c.first_time = now
        c.last_time = now


def _grammar_code(param: str | None) -> str:
    """The 400 code of a grammar's failure: the tools' grammar, or structured output's."""
    return "invalid_tools" if param and param.startswith("tools") else "invalid_structured_output"
