"""Security: no pickle on the data path, a least-privilege ACL user, TLS, size limits on
both sides, and the eviction-policy warning. Against real redis-server processes."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from helpers.failure_support import start, wait_for
from helpers.processes import BATCHGATE, RedisServer, free_port
from helpers.support import queue_pattern, snapshot
from redis.exceptions import NoPermissionError

from producer import InvalidRequest, Producer, RequestFailed
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats
from scheduler_core.registry import known_queues

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("scheduler_core", "producer", "consumer", "batchgate")
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle",
                  "jsonpickle", "joblib"}


# -- no pickle --------------------------------------------------------------------------
def test_no_package_module_imports_a_deserialiser_of_code():
    """Static: no module of batchgate imports pickle, marshal, shelve or their kin."""
    offenders = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                              for name in names if name.split(".")[0] in UNSAFE_MODULES]
    assert not offenders


ROUND_TRIP = r"""
import importlib.abc, marshal, sys, threading

BLOCKED = {"pickle", "_pickle", "cPickle", "shelve", "dill", "cloudpickle", "jsonpickle"}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} imported on the data path")

sys.meta_path.insert(0, Blocker())
callers = []
for fn in ("loads", "dumps", "load", "dump"):
    real = getattr(marshal, fn)
    def spy(*a, _real=real, **k):
        callers.append(sys._getframe(1).f_code.co_filename)
        return _real(*a, **k)
    setattr(marshal, fn, spy)

from consumer import Consumer
from producer import Producer
from scheduler_core.ops.stats import queue_stats

url, queue = sys.argv[1], sys.argv[2]
with Consumer(lambda payloads: [{"echo": p} for p in payloads], redis_url=url,
              queue=queue, strategy="fifo"):
    with Producer(url, queue) as p:
        payload = {"nested": [1, 2.5, "three", None, True, {"k": "v"}]}
        assert p.submit(payload).result(timeout=15) == {"echo": payload}
        queue_stats(p._redis, queue)
mine = [c for c in callers if any(f"/{pkg}/" in c for pkg in ("scheduler_core", "producer",
                                                                 "consumer"))]
assert not mine, mine
assert not BLOCKED & set(sys.modules), BLOCKED & set(sys.modules)
print("clean")
"""


def test_round_trip_never_imports_pickle_nor_calls_marshal(shared_redis, queue):
    """Dynamic: a full submit -> consumer -> result round trip in one process, with pickle
    and its kin made unimportable and marshal's functions watched."""
    done = subprocess.run([sys.executable, "-c", ROUND_TRIP, shared_redis.url, queue],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "clean" in done.stdout, done.stdout + done.stderr


# -- least-privilege ACL user -------------------------------------------------------------
# The exact rule documented in docs/guarantees.md: only these commands, only keys of the
# queue hash tags, no pub/sub channels.
ACL_COMMANDS = " ".join([
    "ping time multi exec evalsha eval script|load script|exists",
    "get set del unlink exists incr expire",
    "hget hset hdel hexists hmget hgetall hincrby hlen hkeys hscan object|encoding",
    "zadd zrem zrange zrangebyscore zrangebylex zremrangebyscore zcard zcount zscore zmscore",
    "bzpopmin",
    "rpush lpush ltrim lrange llen blmpop",
    "xadd xread",
]).split(" ")
# redis-py announces itself with CLIENT SETINFO (Redis >= 7.2); refused, it is skipped.
OPTIONAL_COMMANDS = ["client|setinfo"]


def acl_rule(keys: str = "~{bg:*", optional: bool = False) -> list[str]:
    commands = ACL_COMMANDS + (OPTIONAL_COMMANDS if optional else [])
    return ["on", ">s3cret-pw", "resetkeys", keys, "resetchannels", "-@all",
            *(f"+{c}" for c in commands)]


def test_acl_rule_covers_every_command_the_scripts_call():
    used = set()
    for path in (ROOT / "scheduler_core" / "lua").glob("*.lua"):
        used |= {m.lower() for m in re.findall(r"redis\.call\('([A-Z]+)'", path.read_text())}
    missing = used - {c.partition("|")[0] for c in ACL_COMMANDS}
    assert not missing, f"add {sorted(missing)} to the ACL rule (and docs/guarantees.md)"


def test_least_privilege_acl_user(redis_server, queue, start_consumer, tmp_path):
    admin = redis_server.client()
    version = tuple(int(x) for x in admin.info("server")["redis_version"].split(".")[:2])
    optional = version >= (7, 2)
    admin.execute_command("ACL", "SETUSER", "batchgate", "reset", *acl_rule("~{bg:*",
                                                                           optional))
    admin.execute_command("ACL", "SETUSER", "one-queue", "reset",
                          *acl_rule(f"~{{bg:{queue}}}:*", optional))
    url = f"redis://batchgate:s3cret-pw@127.0.0.1:{redis_server.port}/0"
    consumer = start(start_consumer, url, queue, "Echo", "--strategy", "dynamic")
    with Producer(url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(20)], priority="high",
                                store_result=True)
        assert [h.result(timeout=15)["echo"]["i"] for h in handles] == list(range(20))
        assert p.fetch(handles[0].id).ok
        waiting = p.submit({"i": "x"}, deadline_ms=1)  # deadline + cancel paths
        with pytest.raises(RequestFailed):
            waiting.result(timeout=15)
    limited = f"redis://one-queue:s3cret-pw@127.0.0.1:{redis_server.port}/0"
    with Producer(limited, queue) as p:
        assert p.submit({"i": "own queue"}).result(timeout=15)["echo"]["i"] == "own queue"
    with Producer(limited, queue + "-other") as p, pytest.raises(NoPermissionError):
        p.submit({"i": "someone else's queue"})
    # The queue is in the registry (scheduler_core/registry.py), from both users.
    assert known_queues(admin) == [queue]
    user = redis.Redis.from_url(url)
    stats = queue_stats(user, queue)
    assert stats.processed == 21 and stats.consumers_alive == 1  # + 1 expired
    for forbidden in (("GET", "not-batchgate"), ("FLUSHALL",), ("CONFIG", "SET", "save", ""),
                      ("KEYS", "*"), ("SUBSCRIBE", "x")):
        with pytest.raises(NoPermissionError):
            user.execute_command(*forbidden)
    # Without CONFIG GET the consumer cannot check maxmemory-policy: it says so, once.
    assert consumer.output().count("cannot read maxmemory-policy") == 1
    assert consumer.proc.poll() is None


# -- TLS --------------------------------------------------------------------------------
def no_tls(why: str) -> None:
    """Skip, unless BATCHGATE_REQUIRE_TLS=1 (CI, where redis-server is Debian's, built with
    TLS): there a missing piece fails the run instead of hiding the test."""
    if os.environ.get("BATCHGATE_REQUIRE_TLS") == "1":
        pytest.fail(f"BATCHGATE_REQUIRE_TLS=1 but {why}")
    pytest.skip(why)


class TLSRedisServer(RedisServer):
    """redis-server listening on TLS only, with a certificate made for this test."""

    def __init__(self, cert: Path, key: Path):
        self.cert, self.key = cert, key
        self.tls_port = free_port()
        super().__init__("--port", "0", "--tls-port", str(self.tls_port), "--tls-cert-file",
                         str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
                         str(cert), "--tls-auth-clients", "no")

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0?ssl_ca_certs={self.cert}"

    def _launch(self) -> bool:
        args = ["redis-server", "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                "--appendonly", "no", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                return bool(redis.Redis.from_url(self.url).ping())
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    out = self.proc.stdout.read().decode(errors="replace")
                    no_tls(f"this redis-server cannot serve TLS: {out[-300:]}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost, valid one day."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    if shutil.which("openssl"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                        "1", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key),
                        "-out", str(cert)], check=True, capture_output=True, timeout=60)
        return cert, key
    if importlib.util.find_spec("cryptography") is None:
        no_tls("neither openssl nor cryptography can make a certificate")
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(private.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key


@pytest.fixture
def tls_server(tmp_path):
    if not shutil.which("redis-server"):
        no_tls("redis-server is not on PATH")
    server = TLSRedisServer(*make_certificate(tmp_path))
    yield server
    server.close()


def test_tls_end_to_end(tls_server, queue, start_consumer, tmp_path):
    """A consumer and a producer on rediss:// (the server has no plain-text port, so
    whatever works went over TLS); batchgate clients that do not trust the server's
    certificate, or speak plain text to it, fail at once with the reason and write
    nothing."""
    consumer = start(start_consumer, tls_server.url, queue, "Echo", "--strategy", "fifo")
    with Producer(tls_server.url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(10)])
        assert [h.result(timeout=15)["echo"]["i"] for h in handles] == list(range(10))
    client = tls_server.client()
    assert queue_stats(client, queue).processed == 10
    assert client.config_get("port") == {"port": "0"}  # no plain-text port to talk to

    (tmp_path / "other").mkdir()
    other_ca, _ = make_certificate(tmp_path / "other")  # trusts someone else
    port = tls_server.tls_port
    for url, reason in ((f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={other_ca}",
                         "CERTIFICATE_VERIFY_FAILED"),
                        (f"redis://127.0.0.1:{port}/0", "127.0.0.1")):
        with Producer(url, queue) as p, pytest.raises(redis.ConnectionError, match=reason):
            p.submit({"never": "sent"})
        cli = subprocess.run([BATCHGATE, "submit", "--redis-url", url, "--queue", queue, "{}"],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1 and "cannot reach Redis" in cli.stderr, cli.stderr
        assert reason in cli.stderr and "Traceback" not in cli.stderr
    keys = QueueKeys(queue)
    assert client.hlen(keys.jobs) == 0 and sum(client.zcard(k) for k in keys.pending_all) == 0
    untrusting = start(start_consumer, f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={other_ca}",
                       queue, "Echo", ready=False)
    assert untrusting.proc.wait(timeout=60) == 1
    assert "CERTIFICATE_VERIFY_FAILED" in untrusting.output()
    assert consumer.proc.poll() is None


# -- size limits --------------------------------------------------------------------------
def test_payload_and_result_size_limits(shared_redis, queue, start_consumer):
    r = shared_redis.client()
    with Producer(shared_redis.url, queue, max_payload_bytes=1024) as p:
        before = snapshot(r, queue_pattern(queue))
        with pytest.raises(InvalidRequest, match="over the limit of 1024") as info:
            p.submit({"blob": "x" * 2000})
        assert info.value.field == "payload"
        assert snapshot(r, queue_pattern(queue)) == before  # nothing written
        start(start_consumer, shared_redis.url, queue, "Big", "--strategy", "fifo")
        small, huge = p.submit({"size": 10}), p.submit({"size": 9 << 20})  # 8 MiB limit
        assert small.result(timeout=15) == "x" * 10
        with pytest.raises(RequestFailed, match="over the limit") as info:
            huge.result(timeout=30)
        assert info.value.error_type == "InvalidResult"


# -- eviction policy ----------------------------------------------------------------------
@pytest.mark.parametrize("policy,warned", [("allkeys-lru", True), ("noeviction", False)])
def test_eviction_policy_is_checked_at_consumer_start(queue, start_consumer, policy, warned):
    server = RedisServer("--maxmemory", "512mb", "--maxmemory-policy", policy)
    try:
        consumer = start(start_consumer, server.url, queue, "Echo")
        wait_for(lambda: "serving queue" in consumer.output(), 15, "the consumer to run")
        assert ("may EVICT queued requests" in consumer.output()) is warned
    finally:
        server.close()
