"""Metrics as an operator sees them: one private Ray cluster with a metrics export port, a
2-shard fleet started with ``ucm-ray up``, engine A as vLLM's own OpenAI server (its
``/metrics`` on loopback: ``vllm:ucm_ray_*``) and engine B as a Ray actor whose stat logger is
Ray Serve LLM's (``RayPrometheusStatLogger``: Ray exports ``ray_vllm_ucm_ray_*``). A document
goes cold to A, then warm to B; another cold to B, then warm to A; a third, larger one overflows
the pools. Then, scraped on loopback: each engine's hit tokens are the policy's, loaded bytes
are those blocks' bytes over shared memory, vLLM's own external-hit counter agrees, the shards'
``ray_ucm_ray_shard_*`` (tagged with their node) equal ``ucm-ray status --json``, and every
metric the Grafana dashboard charts is one of those scraped.

Run as a script, this file is the driver of engine B (a process of its own, since the test
session may already be connected to another Ray cluster): JSON commands on stdin, one JSON
answer per line on stdout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # as a script: the tests package and ucm_ray from this checkout

from tests.support.private_cluster import PrivateCluster, cluster_env, free_port  # noqa: E402
from tests.support.prometheus import DASHBOARD, as_ray_name, dashboard_exprs, parse_samples, promql_metric_names  # noqa: E402
from ucm_ray import policy  # noqa: E402
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt  # noqa: E402

pytestmark = pytest.mark.e2e
BLOCK, DOCUMENT, QUESTION, OVERFLOW = 128, 2000, 40, 7000
POOL_MIB = 40
"""Per shard: ~40 blocks of the tiny model (1 MiB each); two documents fit, the overflow does not."""
MAX_NUM_SEQS = 4
"""Each engine keeps up to this many free write slots per pool for decode-time saves: small, so
the small pools hold data rather than slots."""
SHARD_COUNTERS = ("lookups", "hits", "evictions", "commits")


# --- Prometheus text and PromQL ------------------------------------------------------------


# --- engine B: a Ray actor with Ray Serve LLM's stat logger ---------------------------------

class RayLoggedEngine:
    """A vLLM engine (CPU, the connector on) whose metrics go through ``RayPrometheusStatLogger``,
    the stat logger Ray Serve LLM gives its engines: Ray exports them as ``ray_vllm_*``."""

    def __init__(self, model: str, name: str, kv: dict[str, Any]) -> None:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        args = EngineArgs(model=model, served_model_name=name, enforce_eager=True, block_size=BLOCK,
                          dtype="float32", max_model_len=8192, max_num_batched_tokens=8192, seed=0,
                          max_num_seqs=MAX_NUM_SEQS,
                          enable_prefix_caching=True, disable_log_stats=False,
                          kv_transfer_config=KVTransferConfig(**kv))
        self.engine = LLMEngine.from_engine_args(args, stat_loggers=[RayPrometheusStatLogger])
        self.requests = 0

    def generate(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        from vllm import SamplingParams

        self.requests += 1
        self.engine.add_request(f"r{self.requests}", {"prompt_token_ids": prompt},
                                SamplingParams(max_tokens=max_tokens, temperature=0.0))
        tokens: list[int] = []
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)
        core = self.engine.engine_core.engine_core  # type: ignore[attr-defined]
        while core.scheduler.has_requests():  # the step that saves what the last one computed
            self.engine.step()
        core.scheduler.connector.scheduler_part.flush(timeout_s=10.0)  # commits answered
        self.engine.step()  # one more (empty) step: the last interval's stats reach the logger
        return {"tokens": tokens}


def _driver(address: str, model: str, kv: dict[str, Any]) -> None:
    import ray

    from ucm_ray.config import UcmRayConfig
    from ucm_ray.demo import ENGINE_ENV
    from ucm_ray.store.shard.fleet import fleet_status

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    config = UcmRayConfig.from_dict(kv["kv_connector_extra_config"])
    engine = ray.remote(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})(RayLoggedEngine).remote(model, "tiny-b", kv)
    ray.get(engine.__ray_ready__.remote())
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            answer: Any = ray.get(engine.generate.remote(cmd["prompt"]))
        elif cmd["op"] == "status":
            answer = fleet_status(config)
        elif cmd["op"] == "wait_entries":  # until the store holds what another engine saved
            deadline = time.monotonic() + 30
            while True:
                answer = fleet_status(config)
                if sum(s.get("entries", 0) for s in answer["shards"]) >= cmd["entries"] \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        print(json.dumps(answer), flush=True)
    ray.kill(engine)
    ray.shutdown()


class Driver:
    def __init__(self, address: str, model: str, kv: dict[str, Any], log: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, address, model, json.dumps(kv)], cwd=ROOT,
                                     env=cluster_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True, start_new_session=True)
        self.log = log

    def read(self) -> Any:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        assert line, f"engine B's driver ended:\n{self.log.read_text()[-4000:]}"
        return json.loads(line)

    def call(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- the workload ---------------------------------------------------------------------------

def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode() or "null")


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return parse_samples(r.read().decode())


def total(samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def start_server(model: str, port: int, kv: dict[str, Any], log: Path, served_name: str, *flags: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server on loopback with the connector (``kv``), as a user starts it, its
    output in ``log``; ``flags``: more of its command-line flags."""
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
         "--model", model, "--served-model-name", served_name, "--dtype", "float32", "--block-size", str(BLOCK),
         *flags, "--enforce-eager", "--enable-prefix-caching", "--seed", "0", "--kv-transfer-config", json.dumps(kv)],
        cwd=ROOT, env={**cluster_env(), "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}, stdin=subprocess.DEVNULL,
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_server_up(server: subprocess.Popen, log: Path, base: str) -> None:
    """Until ``server`` answers at ``base`` (one line with its log's tail if it exited first)."""
    def server_up():
        assert server.poll() is None, f"api_server exited:\n{log.read_text()[-4000:]}"
        try:
            return True, http_json(f"{base}/v1/models")
        except OSError as e:
            return False, e
    wait_until(server_up, "vLLM's OpenAI server on loopback", timeout_s=180)


def stop_server(server: subprocess.Popen) -> None:
    """Ctrl-C to vLLM's server, then end whatever of its family is left (only PIDs we started)."""
    import psutil

    family = psutil.Process(server.pid).children(recursive=True)
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    for p in family:
        try:
            p.wait(timeout=10)
        except psutil.TimeoutExpired:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucm_ray.cli", *args], capture_output=True, text=True,
                          timeout=120, env=cluster_env(), cwd=ROOT)


def wait_until(check, what: str, timeout_s: float = 30.0):
    """``check()`` returns (done, value); polls until done, or fails naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, value = check()
        if done:
            return value
        assert time.monotonic() < deadline, f"{what}: still {value} after {timeout_s} s"
        time.sleep(1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def test_workload_moves_the_counters_on_both_endpoints(model, tmp_path):
    started = time.monotonic()
    cluster = PrivateCluster([{"num_cpus": 3}])
    ray_port, vllm_port = cluster.info["metrics_ports"][0], free_port()
    namespace = f"met{uuid.uuid4().hex[:6]}"
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(f"num_shards: 2\npool_bytes: {POOL_MIB}MiB\nray_namespace: {namespace}\ntransport: shm\n"
                          "shard_cpus: 0\n")
    tier = {"ray_namespace": namespace, "ray_address": cluster.address, "transport": "shm",
            "lookup_timeout_s": 60, "lease_s": 120}
    kv = {"kv_connector": "UcmRayConnector", "kv_connector_module_path": "ucm_ray.vllm.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": tier}
    server = driver = None
    try:
        up = cli("up", "--address", cluster.address, "--config", str(fleet_file))
        assert up.returncode == 0, up.stderr[-3000:]
        server_log = tmp_path / "api_server.log"
        server = start_server(model, vllm_port, kv, server_log, "tiny-a", "--max-model-len", "8192",
                              "--max-num-batched-tokens", "8192", "--max-num-seqs", str(MAX_NUM_SEQS))
        driver = Driver(cluster.address, model, kv, tmp_path / "driver.log")
        assert driver.read() == {"ready": True}
        wait_server_up(server, server_log, f"http://127.0.0.1:{vllm_port}")
        print(f"metrics: both engines up {time.monotonic() - started:.0f} s after the cluster started", flush=True)

        def on_a(prompt: list[int]) -> None:
            http_json(f"http://127.0.0.1:{vllm_port}/v1/completions",
                      {"model": "tiny-a", "prompt": prompt, "max_tokens": 8, "temperature": 0})

        doc1, doc2, doc3 = (synthetic_prompt(model, n, seed=s) for n, s in ((DOCUMENT, 31), (DOCUMENT, 32),
                                                                             (OVERFLOW, 33)))
        ask = [synthetic_prompt(model, QUESTION, seed=40 + i) for i in range(4)]
        blocks = DOCUMENT // BLOCK  # full blocks of a document (+ question): what its cold engine saves
        hit = policy.dense_external_hit(DOCUMENT + QUESTION, 0, blocks * BLOCK, policy.recompute_tokens(True))
        on_a(doc1 + ask[0])                                    # cold on A: saves doc1
        driver.call(op="wait_entries", entries=blocks)          # A's commits are in
        driver.call(op="generate", prompt=doc1 + ask[1])        # warm on B (it flushes its commits)
        driver.call(op="generate", prompt=doc2 + ask[2])        # cold on B: saves doc2
        on_a(doc2 + ask[3])                                    # warm on A
        on_a(doc3)                                             # cold on A, more than the pools hold: evictions
        saved = {"tiny-a": blocks + OVERFLOW // BLOCK, "tiny-b": blocks}

        # vLLM's /metrics (engine A, prometheus_client): vllm:ucm_ray_*, settled once two scrapes agree
        vllm_url = f"http://127.0.0.1:{vllm_port}/metrics"
        last: dict[str, Any] = {}

        def a_settled():
            s = scrape(vllm_url)
            mine = {(n, tuple(sorted(lab.items()))): v for n, lab, v in s if n.startswith("vllm:ucm_ray")}
            done = total(s, "vllm:ucm_ray_lookups_total") == 3 and mine == last.get("a")
            last["a"] = mine
            return done, s
        a = wait_until(a_settled, "engine A's series on vLLM's /metrics")
        (tmp_path / "vllm_metrics.txt").write_text("\n".join(f"{n} {lab} {v}" for n, lab, v in a))
        entry = total(a, "vllm:ucm_ray_loaded_bytes_total", transport="shm") / blocks  # bytes of one block
        assert entry > 0 and entry == int(entry), entry
        assert total(a, "vllm:ucm_ray_hit_tokens_total", model_name="tiny-a") == hit
        assert total(a, "vllm:external_prefix_cache_hits_total", model_name="tiny-a") == hit  # vLLM's own count
        assert total(a, "vllm:ucm_ray_loaded_blocks_total") == total(a, "vllm:ucm_ray_load_blocks_total") == blocks
        assert total(a, "vllm:ucm_ray_load_failures_total") == 0
        assert total(a, "vllm:ucm_ray_loaded_bytes_total", transport="nixl") == 0
        assert total(a, "vllm:ucm_ray_query_tokens_total") == 2 * (DOCUMENT + QUESTION) + OVERFLOW
        # A save whose slot came late is retried next step (saves_skipped, timing: a busy host's
        # shards answer late); none may be lost.
        assert total(a, "vllm:ucm_ray_saves_dropped_total") == 0
        assert total(a, "vllm:ucm_ray_saved_blocks_total") == saved["tiny-a"]
        assert total(a, "vllm:ucm_ray_saved_bytes_total", transport="shm") == saved["tiny-a"] * entry

        # Ray's metrics export port: engine B's ray_vllm_ucm_ray_*, the shards' ray_ucm_ray_shard_*
        ray_url = f"http://127.0.0.1:{ray_port}/metrics"

        def ray_settled():
            s = scrape(ray_url)
            shards = driver.call(op="status")["shards"]
            figures = {(lab.get("shard"), n): v for n, lab, v in s if n.startswith("ray_ucm_ray_shard_")}
            done = (total(s, "ray_vllm_ucm_ray_lookups_total", model_name="tiny-b") == 2
                    and all(figures.get((sh["shard_id"], f"ray_ucm_ray_shard_{f}_total"), 0) == sh[f]
                            and figures.get((sh["shard_id"], "ray_ucm_ray_shard_entries")) == sh["entries"]
                            for sh in shards for f in SHARD_COUNTERS))
            return done, s
        # A worker's series reach Ray's export port through its node's agent, pushed every ~10 s:
        # on a loaded 2-core host (the whole suite) a 30 s wait once saw none of engine B's.
        b = wait_until(ray_settled, "engine B's and the shards' series on Ray's metrics port", timeout_s=90)
        (tmp_path / "ray_metrics.txt").write_text("\n".join(f"{n} {lab} {v}" for n, lab, v in b))
        assert total(b, "ray_vllm_ucm_ray_hit_tokens_total", model_name="tiny-b") == hit
        assert total(b, "ray_vllm_external_prefix_cache_hits_total", model_name="tiny-b") == hit
        assert total(b, "ray_vllm_ucm_ray_loaded_blocks_total", model_name="tiny-b") == blocks
        assert total(b, "ray_vllm_ucm_ray_loaded_bytes_total", model_name="tiny-b", transport="shm") == blocks * entry
        assert total(b, "ray_vllm_ucm_ray_saved_blocks_total", model_name="tiny-b") == saved["tiny-b"]
        assert total(b, "ray_vllm_ucm_ray_saved_bytes_total", model_name="tiny-b", transport="shm") \
            == saved["tiny-b"] * entry
        assert total(b, "ray_vllm_time_to_first_token_seconds_count", model_name="tiny-b") == 2

        # the shards, as Ray exports them and as `ucm-ray status --json` shows them
        status = cli("status", "--address", cluster.address, "--config", str(fleet_file), "--json")
        assert status.returncode == 0, status.stderr[-3000:]
        shards = json.loads(status.stdout)["shards"]
        node = cluster.info["node_ids"][0]
        assert len(shards) == 2 and all(sh["node_id"] == node for sh in shards)
        for sh in shards:
            tags = {"shard": sh["shard_id"], "node": node}
            for figure in ("capacity_bytes", "used_bytes", "entries"):
                assert total(b, f"ray_ucm_ray_shard_{figure}", **tags) == sh[figure], figure
            for figure in SHARD_COUNTERS:
                assert total(b, f"ray_ucm_ray_shard_{figure}_total", **tags) == sh[figure], figure
        assert sum(sh["capacity_bytes"] for sh in shards) == 2 * POOL_MIB << 20
        # each warm engine's blocks, and the first block once more (a lookup asks for it first, to
        # stop there on a cold prompt); cold ones found none
        assert sum(sh["hits"] for sh in shards) == 2 * (blocks + 1)
        assert sum(sh["commits"] for sh in shards) == sum(saved.values())
        evictions = sum(sh["evictions"] for sh in shards)
        assert evictions > 0, "the pools never overflowed"
        assert sum(sh["entries"] for sh in shards) == sum(saved.values()) - evictions
        assert sum(sh["used_bytes"] for sh in shards) == (sum(saved.values()) - evictions) * entry

        # the dashboard charts only what these scrapes saw
        seen = {n for n, _, _ in b} | {as_ray_name(n) for n, _, _ in a}
        assert as_ray_name("vllm:ucm_ray_hit_tokens_total") in {n for n, _, _ in b}  # the mapping is Ray's
        dashboard = json.loads(DASHBOARD.read_text())
        charted = set().union(*(promql_metric_names(e) for e in dashboard_exprs(dashboard)))
        # this fleet runs no disk tier: its panels' metrics are checked against a shard that does
        # (tests/integration/test_cli.py, the disk tier's up/down test)
        unseen = {n for n in charted - seen if not n.startswith("ray_ucm_ray_shard_disk_")}
        assert charted and not unseen, f"the dashboard charts metrics nobody exports: {sorted(unseen)}"
        print("metrics: scrape excerpt\n  " + "\n  ".join(excerpt(b + a)), flush=True)
        print(f"metrics: done {time.monotonic() - started:.0f} s after the cluster started", flush=True)
    finally:
        if driver is not None:
            driver.close()
        if server is not None:
            stop_server(server)
        cli("down", "--address", cluster.address, "--config", str(fleet_file))
        cluster.close()


def excerpt(samples) -> list[str]:
    shown = ("model_name", "transport", "shard")
    return sorted({f"{n}{{{','.join(f'{k}={x!r}' for k, x in sorted(lab.items()) if k in shown)}}} {v:.0f}"
                   for n, lab, v in samples
                   if n.startswith(("ray_ucm_ray_shard_", "ray_vllm_ucm_ray", "vllm:ucm_ray")) and v
                   and not n.endswith(("_bucket", "_created"))})

if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    _driver(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
