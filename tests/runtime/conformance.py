"""An answer of the server checked against the OpenAPI document it serves: the JSON body of a
documented status, or each server-sent event of a stream (its `data` against the events' models, or
`[DONE]` where the route's streams end with it). The document is generated from
router/response_models.py, so this holds the handlers' builders to those models.

    contract = Contract(document)
    contract.check("POST", "/v1/chat/completions", status, content_type, body_or_event_payloads)

Pure (no I/O): the tests fetch the document and the answers.
"""

from __future__ import annotations

import json
import re

import jsonschema

DONE = "[DONE]"


class Contract:
    def __init__(self, document: dict):
        self.document = document

    def template(self, path: str) -> str:
        """The documented path `path` is an instance of (`/v1/responses/{response_id}` for
        `/v1/responses/resp_1`), or `path` itself."""
        paths = self.document["paths"]
        if path in paths:
            return path
        for documented in paths:
            if re.fullmatch(re.sub(r"\\{\w+\\}", "[^/]+", re.escape(documented)), path):
                return documented
        return path

    def schema(self, method: str, path: str, status: int, media: str) -> dict:
        """The documented schema of the answer (a KeyError names what the document lacks)."""
        responses = self.document["paths"][self.template(path)][method.lower()]["responses"]
        if str(status) not in responses:
            raise KeyError(f"{method} {path} does not document status {status} (only {', '.join(responses)})")
        content = responses[str(status)].get("content", {})
        if media not in content:
            raise KeyError(f"{method} {path} {status} does not document {media} (only {', '.join(content)})")
        return content[media]["schema"]

    def validate(self, schema: dict, instance) -> None:
        """`instance` against `schema`, whose `$ref`s point into the document's components."""
        root = {**schema, "components": self.document["components"]}
        validator = jsonschema.Draft202012Validator(root, format_checker=jsonschema.FormatChecker())
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
        if error is not None:
            raise AssertionError(f"{error.message} (at /{'/'.join(map(str, error.absolute_path))})") from error

    def check(self, method: str, path: str, status: int, content_type: str, body) -> None:
        """A JSON body (parsed), or the payloads of a stream's `data: ...` frames (as text, in order)."""
        media = content_type.split(";")[0].strip()
        schema = self.schema(method, path, status, media)
        if media != "text/event-stream":
            try:
                self.validate(schema, body)
            except AssertionError as e:
                raise AssertionError(f"{method} {path} {status}: {e}") from e
            return
        data = schema["properties"]["data"]
        json_data = next(s for s in data.get("anyOf", [data]) if "contentSchema" in s)
        done_allowed = {"const": DONE} in data.get("anyOf", [])
        for i, payload in enumerate(body):
            self.validate(schema, {"data": payload})
            if payload == DONE and done_allowed:
                assert i == len(body) - 1, f"{path}: {DONE} before the stream's end"
                continue
            try:
                event = json.loads(payload)
            except ValueError as e:
                raise AssertionError(f"{path}: event {i} is not JSON: {payload!r}") from e
            try:
                self.validate(json_data["contentSchema"], event)
            except AssertionError as e:
                raise AssertionError(f"{path}: event {i} {payload!r} breaks the document: {e}") from e
