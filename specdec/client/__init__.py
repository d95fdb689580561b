"""The client side: the Python client of the public Generation API, the `specdec` CLI and the local
runner that starts the three services as processes. Needs neither torch nor a model."""

from specdec.client.client import Client, GenerationOutput, build_request, finish_reason_name

__all__ = ["Client", "GenerationOutput", "build_request", "finish_reason_name"]
