"""Fuzz `tandem serve` from its own OpenAPI document (schemathesis): whatever the body, never a 5xx, never a crash.

The server runs the tiny real stories260K model (../shared/data) with a chat template and a short max_model_len, so
every generated request finishes fast. (SIGTERM with streams in flight: tests/server/test_drain.py.)
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tandem.bench.serve import free_port, launch_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

STORIES = Path(__file__).resolve().parents[2] / "../shared/data/models/stories260K/stories260K.bin"
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not STORIES.is_file(), reason="shared/data stories260K not present"),
]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    log_path = tmp_path_factory.mktemp("fuzz") / "server.log"
    port = free_port()
    args = ["--dtype", "float32", "--max-model-len", "48", "--max-num-seqs", "32", "--num-kv-blocks", "512",
            "--chat-template", TEMPLATE, "--max-queue", "512", "--log-level", "warning"]
    with open(log_path, "wb") as log:
        try:
            proc = launch_server(str(STORIES), args, port, startup_timeout_s=300, log=log)
        except RuntimeError as e:
            pytest.fail(f"{e}\n{log_path.read_text()[-3000:]}")
        yield f"http://127.0.0.1:{port}", proc, log_path
        proc.send_signal(signal.SIGTERM)  # idle: the drain ends at once
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail("the server did not exit within 60 s of SIGTERM")


MAX_EXAMPLES = {GenerationMode.POSITIVE: 35, GenerationMode.NEGATIVE: 15}  # per endpoint: 50 in all


@pytest.fixture(scope="module")
def fuzzed(fuzz_server: tuple[str, subprocess.Popen[bytes], Path]) -> tuple[str, subprocess.Popen[bytes], Path]:
    """The server after every operation of /openapi.json was fuzzed (once per module, whichever test runs first:
    the tests below must not depend on their order)."""
    url, proc, log = fuzz_server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    for op in operations:
        has_body = op.method.upper() == "POST"  # a GET without parameters has no invalid input
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=MAX_EXAMPLES[mode], deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def fuzz(case: Any) -> None:
                case.call_and_validate(base_url=url, checks=[not_a_server_error], timeout=60)

            fuzz()
            assert proc.poll() is None, log.read_text()[-3000:]
    return fuzz_server


def test_no_server_errors(fuzzed: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    """Every operation of /openapi.json, with valid and invalid bodies: never a 5xx, the server never dies."""
    url, proc, log = fuzzed
    assert proc.poll() is None, log.read_text()[-3000:]


def test_engine_still_healthy_after_fuzzing(fuzzed: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    url, proc, log = fuzzed
    ok = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
          if line.startswith("tandem_requests_total") and 'status="200"' in line and "completions" in line]
    assert sum(float(line.split()[-1]) for line in ok) >= 10  # the fuzzer's valid bodies did reach the engine
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(", there was")
