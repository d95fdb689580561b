"""The coordinator, the client and the shared wire modules hold no model: importing them must not import torch."""

import subprocess
import sys

TORCH_FREE = ["coordinator.service", "coordinator.frontend", "coordinator.openai_api", "coordinator.http_server",
              "coordinator.metrics", "specdec.client", "specdec.client.cli", "specdec.client.bench",
              "specdec.wire.metrics", "specdec.wire.logs", "specdec.wire.server"]


def test_coordinator_and_client_do_not_import_torch():
    code = f"import sys\nfor m in {TORCH_FREE!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
