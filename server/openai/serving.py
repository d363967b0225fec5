"""The OpenAI surfaces' shared preparation: a validated request body in, one `Submission` out.

`OpenAIServing` is what the routes call. For completions and chat it makes the whole
submission in one pass, each helper called once: the tool plan (`server.tooling.plan`), the one
grammar that constrains the output (`server.openai.constraint`), checked with the tools'
schemas and compiled, or sent as specs to where the engine runs (`server.grammars.compiler`),
prompts and chat templates to token ids (`server.openai.prompt_tokens`, off the event loop),
the sampling parameters of each choice (`server.openai.sampling_params`), stop strings and
ids, and the body renderer (`server.openai.render`); then `server.generation.loop` runs it.
The Responses API (`server.openai.responses`) prepares through `chat_submission` with its own
renderer, embeddings (`server.openai.embeddings`) through the checks here. Errors leave through
`server.errors`. It talks to the engine only through an `EngineClient`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from engine import SamplingParams
from models import Tokenizer
from server.engine_client.interface import EngineClient
from server.errors import APIError
from server.generation.loop import GenerationLoop
from server.generation.metrics import ServerMetrics
from server.generation.submission import Render, Submission
from server.generation.tenancy import ClientSlots, client_identity
from server.grammars.check_worker import CheckBudget
from server.grammars.compiler import StructuredOutputs
from server.openai.constraint import constraint_spec
from server.openai.logprobs import TokenText
from server.openai.prompt_tokens import PromptTokenizer
from server.openai.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    SamplingFields,
    TokenizeRequest,
)
from server.openai.render import ChatRender, CompletionRender, models_body
from server.openai.sampling_params import (
    chat_sampling_params,
    check_token_ids,
    completion_sampling_params,
    context_too_long,
    prompt_logprobs_wanted,
)
from server.tooling.chat_template import ChatTemplate
from server.tooling.formats import implied_reasoning
from server.tooling.output import kept_token_ids
from server.tooling.plan import plan_tools

log = logging.getLogger("server.requests")

# The default of `--response-budget`: entries one response may carry (a logprob: a token's own or
# one of its top alternatives, prompt and generated, over every choice; an embedded input
# token). About 35 MB of JSON logprobs; a request over it is refused before it runs.
DEFAULT_RESPONSE_BUDGET = 512 * 1024

# A chat surface's renderer, made for one run once its tool plan is known: `factory(gen, plan=)`.
ChatRenderFactory = Callable[..., Render]


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
        # The chat template (the model's, or --chat-template) renders tools itself or not; what
        # --tool-call-parser and --reasoning-parser make of a choice's text follows from it.
        self.chat_template = ChatTemplate(tokenizer, chat_template)
        self.tool_call_parser = tool_call_parser
        # A format whose output carries its reasoning (harmony) implies its parser; the special
        # tokens that parser reads stay in a chat choice's text.
        self.reasoning_parser = reasoning_parser or implied_reasoning(
            tool_call_parser, self.chat_template.source
        )
        self.kept_ids = kept_token_ids(self.reasoning_parser, tokenizer)
        self.loop = GenerationLoop(
            client, tokenizer, metrics, ClientSlots(max_concurrent_per_client), stall_timeout
        )
        self.tokenizer = tokenizer
        self.card = card
        self.log_prompts = log_prompts
        self.vocab_size = tokenizer.vocab_size
        self.defaults = card.default_sampling_params
        self.structured = StructuredOutputs(tokenizer, budget=grammar_budget)
        self.token_text = TokenText(tokenizer)
        # Prompts to ids off the event loop, bounded by the context first.
        self.prompts = PromptTokenizer(tokenizer, card.max_model_len)
        self.response_budget = response_budget
        # Where the engine client compiles grammars (server.engine_client.remote_grammar).
        self.grammar_placement = getattr(client, "grammar_placement", "local")

    def close(self) -> None:
        """Stop the helpers (grammar check worker, tokenizer threads): the app's shutdown."""
        self.structured.close()
        self.prompts.close()

    # -- the routes ------------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return models_body(self.card)

    async def respond(self, sub: Submission, http: HTTPRequest) -> Response:
        """Hand a prepared submission to the generation loop."""
        return await self.loop.respond(sub, http)

    async def completions(self, req: CompletionRequest, http: HTTPRequest) -> Response:
        return await self.respond(await self.completion_submission(req, http), http)

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest) -> Response:
        render = partial(ChatRender, tokens=self.token_text, reasoning=self.reasoning_parser)
        return await self.respond(await self.chat_submission(req, http, render), http)

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if req.messages is not None:
            _, ids = await self.prompts.encode_chat(
                self.chat_template, req.messages, req.add_generation_prompt, bound_messages=False
            )
        else:
            ids = await self.prompts.encode(req.prompt or "", req.add_special_tokens, "prompt")
        return {"count": len(ids), "max_model_len": self.card.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        check_token_ids(req.tokens, self.vocab_size, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    # -- preparation -----------------------------------------------------------------------------

    async def completion_submission(self, req: CompletionRequest, http: HTTPRequest) -> Submission:
        arrival = time.monotonic()
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts, texts = await self.prompts.encode_prompts(
            req.prompts, "prompt", self.vocab_size, decode_ids=req.echo
        )
        if not all(prompts):
            raise APIError(
                400, "prompt must not be empty (it encodes to no tokens)", param="prompt"
            )
        gen_id = self.new_id("cmpl", http, texts)
        if req.max_tokens == 0 and not req.echo:  # the document's cross-field rule
            raise APIError(
                400,
                "max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                param="max_tokens",
            )
        params = completion_sampling_params(req, self.vocab_size, self.defaults)
        if (top_n := prompt_logprobs_wanted(req)) is not None:
            params = [replace(p, prompt_logprobs=top_n) for p in params]
        self.check_lengths(prompts, req.n, params[0].max_tokens)
        # echo's logprobs and vLLM's prompt_logprobs are two renderings of one computation
        shown = (req.prompt_logprobs is not None) + (req.echo and req.logprobs is not None)
        self.check_budget(prompts, params, prompt_renderings=shown)
        spec = constraint_spec(req)
        constraints = await self.structured.constraints(
            spec, len(prompts) * len(params), http, placement=self.grammar_placement
        )
        return Submission(
            **self._fields(req, http, gen_id, model, arrival),
            prompts=prompts,
            prompt_texts=texts,
            params=params,
            constraints=constraints,
            grammar_param=spec.param if spec is not None else None,
            render=lambda gen: CompletionRender(gen, self.token_text, req.prompt_logprobs),
            echo=req.echo,
            logprobs=req.logprobs,
        )

    async def chat_submission(
        self,
        req: ChatCompletionRequest,
        http: HTTPRequest,
        render: ChatRenderFactory,
        prefix: str = "chatcmpl",
    ) -> Submission:
        """A chat request, prepared: its tool plan made once and carried to its prompt (the
        template renders the plan's tools), its constraint (the plan's grammar, or structured
        output) and its renderer (`render(gen, plan)`). Also /v1/responses' path."""
        arrival = time.monotonic()
        model = self.check_model(req.model)
        plan, tool_specs = plan_tools(req, self.tool_call_parser, self.chat_template.source)
        spec = constraint_spec(req, plan)
        # The grammars before the prompt: the template renders the tools' schemas, which are
        # checked (whatever tool_choice says) before they go anywhere.
        constraints = await self.structured.constraints(
            spec, req.n, http, placement=self.grammar_placement, checks=tool_specs
        )
        text, ids = await self.prompts.encode_chat(
            self.chat_template,
            req.messages,
            req.add_generation_prompt,
            plan,
            req.chat_template_kwargs,
        )
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", param="messages")
        gen_id = self.new_id(prefix, http, [text])
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
        self.check_lengths([ids], req.n, params[0].max_tokens)
        self.check_budget([ids], params)
        return Submission(
            **self._fields(req, http, gen_id, model, arrival),
            prompts=[ids],
            prompt_texts=[text],
            params=params,
            constraints=constraints,
            grammar_param=spec.param if spec is not None else None,
            # the loop calls the renderer's own module, not back into this one
            render=partial(render, plan=plan),
            logprobs=req.num_logprobs,
            kept_ids=self.kept_ids,
        )

    def _fields(
        self, req: SamplingFields, http: HTTPRequest, gen_id: str, model: str, arrival: float
    ) -> dict[str, Any]:
        """The submission's fields every generation request fills the same way."""
        eos = () if req.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        return {
            "id": gen_id,
            "model": model,
            "arrival": arrival,
            "client_id": client_identity(http),
            "stops": req.stop_strings,
            "stop_ids": frozenset(eos) | frozenset(req.stop_token_ids or ()),
            "cache_salt": req.cache_salt,
            "priority": req.priority,
            "stream": req.stream,
            "include_usage": req.include_usage,
        }

    # -- checks every surface shares -------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        """The served model's name; a 404 for a name it is not served under."""
        if name is not None and name not in self.card.names:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return self.card.name

    def new_id(self, prefix: str, http: HTTPRequest, texts: list[str]) -> str:
        gen_id = f"{prefix}-{uuid.uuid4().hex}"
        http.state.request_id = gen_id  # errors from here on name it (server.errors)
        if self.log_prompts:
            log.info("%s prompt=%r", gen_id, texts if len(texts) > 1 else texts[0])
        return gen_id

    def check_budget(
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

    def check_lengths(self, prompts: list[list[int]], n: int, max_tokens: int) -> None:
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
