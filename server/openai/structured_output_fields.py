"""Guided-decoding fields of the request bodies, as vLLM accepts them, and their reduction to
one ``StructuredOutputsParams``.

Three spellings, one meaning:

* OpenAI's ``response_format``: ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (``"text"`` = none);
* vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object`` (plus ``disable_any_whitespace``);
* vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``.

A request may use one of them, once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.gpu.sample.sampling_params import StructuredOutputsParams
from pagedserve.server.errors import OpenAIError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` object."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class StructuredOutputFields(BaseModel):
    """Mixed into the chat and completion bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's constraint and the field it came from (for error ``param``s).

        Raises:
            OpenAIError: several constraints, or an incomplete one.
        """
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise OpenAIError("response_format.json_schema.schema is required for type "
                                  "json_schema", param="response_format")
            found.append(("response_format",
                          StructuredOutputsParams(json=rf.json_schema.json_schema)))
        fields = self.structured_outputs
        if fields is not None:
            spec = StructuredOutputsParams(
                json=fields.json_, regex=fields.regex, choice=fields.choice, grammar=fields.grammar,
                json_object=bool(fields.json_object),
                disable_any_whitespace=fields.disable_any_whitespace)
            if len(spec.kinds()) != 1:
                raise OpenAIError(
                    "structured_outputs must set exactly one of json, regex, choice, grammar, "
                    f"json_object (got {', '.join(spec.kinds()) or 'none'})",
                    param="structured_outputs")
            found.append(("structured_outputs", spec))
        for name, spec in (
            ("guided_json", StructuredOutputsParams(json=self.guided_json)),
            ("guided_regex", StructuredOutputsParams(regex=self.guided_regex)),
            ("guided_choice", StructuredOutputsParams(choice=self.guided_choice)),
            ("guided_grammar", StructuredOutputsParams(grammar=self.guided_grammar)),
        ):
            if spec.kinds():
                found.append((name, spec))
        if len(found) > 1:
            raise OpenAIError(
                "only one structured-output constraint per request; got "
                + ", ".join(name for name, _ in found), param=found[1][0])
        return (found[0][1], found[0][0]) if found else (None, None)
