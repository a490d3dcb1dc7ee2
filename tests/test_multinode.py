"""The same code across nodes: two `torchrun --nnodes 2` agents on this machine, one rank
each, gloo over a localhost rendezvous, running `fp8-reload rebalance` (as two hosts
would run it, see docs/expert-parallel.md). Each node writes its own copy of the
checkpoint. A deadline kills both agents' process groups: this test can fail, never hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from fp8_reload.expert_parallel.group import free_port

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 240


def test_two_torchrun_nodes_forward_and_rebalance(tmp_path):
    port = free_port()
    report = tmp_path / "rebalance.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "fp8_reload", "rebalance", "--backend", "gloo",
               "--mode", "p2p,hybrid", "--exclude-sources", "1", "--tokens", "32",
               "--json", str(report)]
        agents.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True))
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=DEADLINE_S)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for node, (agent, out) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"node {node} exited {agent.returncode}:\n{out[-3000:]}"
    assert "rebalance on 2 ranks (gloo, cpu)" in outputs[0]
    assert "OK: every rank equals a fresh load" in outputs[0]
    rows = json.loads(report.read_text())
    assert sorted((r["mode"], r["rank"]) for r in rows) == [("hybrid", 0), ("hybrid", 1),
                                                            ("p2p", 0), ("p2p", 1)]
    assert all(r["equals_fresh_load"] and r["forward_matches"] for r in rows)
    assert sum(r["experts_disk"] for r in rows if r["mode"] == "hybrid") > 0
