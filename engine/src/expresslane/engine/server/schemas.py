"""Request bodies of the /pd/* contract (TileRT's decode node), validated with pydantic.

Unknown sampling options are refused (400) rather than silently ignored; `null` means "default".
`prompt_token_ids` is an expresslane extension: when given, repetition_penalty also covers the prompt,
exactly like vLLM (the node otherwise never sees prompt ids), and prompt lookup drafts from the prompt too.
`sampling.speculative` (expresslane extension): false opts this request out of speculative decoding; null or
absent = the node's setting. Greedy output is identical either way (the engine's speculation is exact).
`top_logprobs` (0..20; null = none) and `structured_outputs` (vLLM 0.32's StructuredOutputsParams fields:
exactly one of json / regex / choice / grammar / json_object / structural_tag, plus the options
disable_any_whitespace / disable_additional_properties / whitespace_pattern, which vLLM's xgrammar backend
does not use per request; see decode/grammar.py): docs/api.md, "The express node's HTTP API".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from ..decode import SamplingParams
from ..decode.grammar import GrammarError, StructuredOutputSpec
from ..decode.logprobs import MAX_TOP_LOGPROBS
from .errors import BadRequest, InvalidParameter


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    ignore_eos: bool | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = Field(None, ge=0)
    speculative: StrictBool | None = None  # per-request opt-out; None = on where the node has speculation
    min_p: float | None = Field(None, ge=0, le=1)
    logit_bias: dict[str, float] | None = None  # str(token id) -> bias, as vLLM's SamplingParams takes it
    allowed_token_ids: list[int] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
        return v


class StructuredOutputsBody(BaseModel):
    """vLLM's StructuredOutputsParams as JSON (the constraint is checked in `spec`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def spec(self) -> StructuredOutputSpec:
        try:
            return StructuredOutputSpec.from_params(json=self.json_, regex=self.regex, choice=self.choice,
                                                    grammar=self.grammar, json_object=self.json_object,
                                                    structural_tag=self.structural_tag)
        except GrammarError as e:
            raise InvalidParameter(str(e)) from None


class DecodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = Field(min_length=1, max_length=512)
    first_token_id: int = Field(ge=0)
    max_tokens: int = Field(ge=1)
    sampling: SamplingBody = Field(default_factory=SamplingBody)
    stream: bool = False
    timeout_s: float | None = Field(None, gt=0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsBody | None = None

    @field_validator("sampling", mode="before")
    @classmethod
    def _null_sampling(cls, v: Any) -> Any:
        return {} if v is None else v

    def sampling_params(self) -> SamplingParams:
        s = self.sampling
        try:
            return SamplingParams(
                max_tokens=self.max_tokens,
                temperature=1.0 if s.temperature is None else s.temperature,
                top_p=1.0 if s.top_p is None else s.top_p,
                top_k=-1 if s.top_k in (None, 0) else s.top_k,
                seed=s.seed,
                stop_token_ids=tuple(s.stop_token_ids or ()),
                ignore_eos=bool(s.ignore_eos),
                min_tokens=s.min_tokens or 0,
                repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
                presence_penalty=s.presence_penalty or 0.0,
                frequency_penalty=s.frequency_penalty or 0.0,
                prompt_token_ids=tuple(self.prompt_token_ids or ()),
                speculative=True if s.speculative is None else s.speculative,
                logprobs=self.top_logprobs,
                min_p=s.min_p or 0.0,
                logit_bias=tuple((int(k), b) for k, b in (s.logit_bias or {}).items()),
                allowed_token_ids=None if s.allowed_token_ids is None else tuple(s.allowed_token_ids),
            )
        except ValueError as e:
            raise BadRequest(str(e)) from None


class ReserveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = Field(min_length=1, max_length=512)
    ttl_s: float | None = Field(None, gt=0)  # None: the node's cap (reservation_ttl_s)


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str = Field(min_length=1)


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body; any problem becomes a BadRequest naming the field, never a traceback."""
    if not raw:
        raise BadRequest("empty request body; expected a JSON object")
    try:
        obj = model.model_validate_json(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5]
        )
        raise BadRequest(f"invalid {model.__name__}: {problems}") from None
    return obj
