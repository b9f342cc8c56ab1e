"""A request-body size limit whose 413 is in OpenAI's error shape.

(Starlette's RequestBodyLimitMiddleware answers its own plain-text 413, even
over an error body the app already wrote.) A Content-Length past the limit is
refused before the body is read; a chunked body is counted as it arrives.
"""
from __future__ import annotations

import json

from gateway.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes)",
                    "invalid_request_error", None, "request_too_large")


class BodyLimit:
    def __init__(self, app, max_body_bytes: int):
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.limit:
                    error = too_large(self.limit) if value.isdigit() else \
                        APIError(400, "invalid Content-Length header", "invalid_request_error")
                    body = json.dumps(error.body()).encode()
                    await send({"type": "http.response.start", "status": error.status,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                    await send({"type": "http.response.body", "body": body})
                    return
                break
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:   # raised inside the route: the APIError handler answers
                    raise too_large(self.limit)
            return message

        await self.app(scope, counted, send)
