"""The public gRPC API (specdec.v1.Generation): thin handlers over the Frontend's one generation path."""

from __future__ import annotations

from coordinator.api.frontend import Frontend, deadline_from
from specdec.core.errors import RequestError
from specdec.proto import generate_pb2_grpc
from specdec.serving.server import handle_errors

SERVICE_NAME = "specdec.v1.Generation"


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """The public gRPC API: thin handlers over the Frontend's one generation path."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(self, request, context):
        events = self.frontend.generate(request, deadline=deadline_from(context.time_remaining()), api="grpc")
        try:
            async for event in events:
                yield event
        except RequestError as e:
            await context.abort(e.code, e.message)
        finally:
            await events.aclose()

    @handle_errors
    async def GetInfo(self, request, context):
        return self.frontend.info()
