"""Multi-host serving: two processes on localhost (jax.distributed over gloo, 2 CPU devices each) spread
the experts over all 4 devices and generate the same tokens as one resident process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import fmoe_jax as fj

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("policy", ["on_demand_lru", "fmoe"])
def test_two_processes_match_resident(policy, hf_dirs):
    prompts = [[5, 6, 7, 8, 9], list(range(10, 30))]
    ref = fj.generate(fj.load_model(hf_dirs["mixtral"]), prompts, max_new_tokens=6, stop_at_eos=False).tokens
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), "2", str(port), str(hf_dirs["mixtral"]), policy],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    for result in results:
        assert (result["devices"], result["local"]) == (4, 2)
        assert result["tokens"] == ref
        assert len(result["per_device"]) == 2  # each process serves the experts of its own two devices
    assert sorted(r["process"] for r in results) == [0, 1]
    loaded = [d["bytes_to_device"] for r in results for d in r["per_device"]]
    assert all(b > 0 for b in loaded)  # every device, in both processes, served experts
