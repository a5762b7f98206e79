#!/usr/bin/env python3
"""A real S3-compatible server for the storage tests: moto in server mode on
loopback, with IAM signature checking switched on, behind a fault-injecting
HTTP proxy.

    s3env.py run CMD [ARGS...]   start both, export the environment below, run
                                 CMD, stop both, exit with CMD's status (77,
                                 meson's "skipped", when moto is not installed)

Environment given to CMD:
    AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION
                                 the proxy and an IAM user allowed s3:*
    DFLASH_TEST_S3_BUCKET        an empty bucket
    DFLASH_TEST_S3_DIRECT        moto itself, without the proxy
    DFLASH_TEST_S3_DENY_KEY/_SECRET    an IAM user with no permission
    DFLASH_TEST_S3_SESSION_KEY/_SECRET/_TOKEN  temporary (assumed-role) credentials
    DFLASH_TEST_S3_FAULTS        URL of the proxy's control endpoint

Faults: PUT a JSON object to DFLASH_TEST_S3_FAULTS:
    {"script": ["503", "pass", "reset", ...],  # applied to the next requests, in order
     "rate": 0.2, "kinds": ["500", "503"],      # then this fraction of requests, at random
     "seed": 1, "methods": ["PUT"],             # optional: only requests with these methods
     "match": "uploadId",                       # optional: only requests whose target has this
     "delay_s": 0.3, "retry_after": "0"}
The answer holds the counters of the plan replaced (they restart at zero);
GET gives the current ones: {"requests": N, "forwarded": N, "get_bytes": N (the
bodies of the GETs of *.safetensors objects forwarded), "injected": {"503": N, ...}, "pending_script": N, "last_host": "..."}.
Kinds: "500" (InternalError), "503" (SlowDown, with Retry-After), "403"
(AccessDenied), "reset" (read half the body, then reset the connection),
"lost" (forward, then reset instead of answering: the request took effect but
its answer is lost), "delay" (answer after delay_s), "pass".
"""
import http.client
import json
import os
import random
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
import urllib.request

REGION = "us-east-1"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Faults:
    """Thread-safe fault plan and counters."""

    def __init__(self):
        self.lock = threading.Lock()
        self.last_host = ""
        self.set({})

    def set(self, plan):
        """Install a plan; returns the counters of the plan it replaces."""
        with self.lock:
            before = self.stats_locked() if hasattr(self, "requests") else {}
            self.requests = self.forwarded = self.get_bytes = 0
            self.injected = {}
            self.script = list(plan.get("script", []))
            self.rate = float(plan.get("rate", 0))
            self.kinds = list(plan.get("kinds", ["500", "503"]))
            self.rng = random.Random(plan.get("seed", 1))
            self.methods = plan.get("methods")
            self.match = plan.get("match")
            self.delay_s = float(plan.get("delay_s", 0.3))
            self.retry_after = str(plan.get("retry_after", "0"))
            return before

    def choose(self, method, target, host):
        with self.lock:
            self.requests += 1
            self.last_host = host
            if self.methods and method not in self.methods:
                return "pass"
            if self.match and self.match not in target:
                return "pass"
            if self.script:
                kind = self.script.pop(0)
            elif self.rate and self.rng.random() < self.rate:
                kind = self.rng.choice(self.kinds)
            else:
                kind = "pass"
            if kind != "pass":
                self.injected[kind] = self.injected.get(kind, 0) + 1
            return kind

    def stats(self):
        with self.lock:
            return self.stats_locked()

    def stats_locked(self):
        return {"requests": self.requests, "forwarded": self.forwarded,
                "get_bytes": self.get_bytes,
                "injected": dict(self.injected), "pending_script": len(self.script),
                "last_host": self.last_host}


def error_xml(code, message):
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>proxy</RequestId></Error>").encode()


class ProxyHandler(socketserver.StreamRequestHandler):
    """HTTP/1.1 with keep-alive: read a request, inject a fault or forward it
    to moto, answer; repeat until the client closes."""

    def handle(self):
        try:
            while self.one_request():
                pass
        except (ConnectionError, OSError, ValueError):
            pass  # the client gave up (a timeout test) or was reset on purpose

    def read_head(self):
        line = self.rfile.readline(65537)
        if not line:
            return None
        method, target, _ = line.decode("latin-1").split(" ", 2)
        headers = []
        while True:
            h = self.rfile.readline(65537).decode("latin-1")
            if h in ("\r\n", "\n", ""):
                break
            name, value = h.split(":", 1)
            headers.append((name.strip(), value.strip()))
        return method, target, headers

    def send(self, status, reason, headers, body, head_only=False):
        out = [f"HTTP/1.1 {status} {reason}\r\n"]
        out += [f"{k}: {v}\r\n" for k, v in headers]
        out.append("\r\n")
        self.wfile.write("".join(out).encode("latin-1") + (b"" if head_only else body))
        self.wfile.flush()

    def reset(self):
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()

    def one_request(self):
        head = self.read_head()
        if not head:
            return False
        method, target, headers = head
        lower = {k.lower(): v for k, v in headers}
        length = int(lower.get("content-length", "0"))
        if target.startswith("/__faults__"):
            return self.control(method, length)
        kind = self.server.faults.choose(method, target, lower.get("host", ""))
        if kind == "reset":
            if "100-continue" in lower.get("expect", ""):
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.wfile.flush()
            self.rfile.read(length // 2)
            self.reset()
            return False
        if "100-continue" in lower.get("expect", ""):
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        body = self.rfile.read(length) if length else b""
        if kind in ("500", "503", "403"):
            code, reason, s3code = {"500": (500, "Internal Server Error", "InternalError"),
                                    "503": (503, "Slow Down", "SlowDown"),
                                    "403": (403, "Forbidden", "AccessDenied")}[kind]
            xml = error_xml(s3code, "injected by the test proxy")
            extra = [("Retry-After", self.server.faults.retry_after)] if kind == "503" else []
            self.send(code, reason, [("Content-Type", "application/xml"),
                                     ("Content-Length", str(len(xml)))] + extra, xml,
                      head_only=method == "HEAD")
            return True
        if kind == "delay":
            time.sleep(self.server.faults.delay_s)
        status, reason, rheaders, rbody = self.forward(method, target, headers, body)
        with self.server.faults.lock:
            self.server.faults.forwarded += 1
            if method == "GET" and ".safetensors" in target:
                self.server.faults.get_bytes += len(rbody)
        if kind == "lost":
            self.reset()
            return False
        self.send(status, reason, rheaders, rbody, head_only=method == "HEAD")
        return True

    def forward(self, method, target, headers, body):
        conn = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for k, v in headers:
            if k.lower() not in ("expect", "connection"):  # hop-by-hop, and not signed
                conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        rbody = resp.read()
        rheaders = [(k, v) for k, v in resp.getheaders()
                    if k.lower() not in ("transfer-encoding", "connection", "content-length")]
        if method == "HEAD":
            length = resp.getheader("Content-Length")
            if length is not None:
                rheaders.append(("Content-Length", length))
        else:
            rheaders.append(("Content-Length", str(len(rbody))))
        conn.close()
        return resp.status, resp.reason, rheaders, rbody

    def control(self, method, length):
        body = self.rfile.read(length) if length else b""
        if method == "PUT":
            stats = self.server.faults.set(json.loads(body or b"{}"))
        else:
            stats = self.server.faults.stats()
        out = json.dumps(stats).encode()
        self.send(200, "OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(out)))], out)
        return True


class Proxy(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream_port):
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        self.upstream_port = upstream_port
        self.faults = Faults()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def set_faults(self, **plan):
        return self.faults.set(plan)

    def stop(self):
        self.shutdown()
        self.server_close()


def serve_moto(port):
    """moto's server, with one fix to its signature checker: it rebuilds the
    canonical request from the *decoded* URL, so correctly signed requests
    for keys with '+', '=' or non-ASCII bytes, or listings with a '/' in the
    prefix, fail (botocore's own requests included). S3's canonical request
    uses the request target as sent; hand the checker that (RAW_URI)."""
    from moto.core import responses
    from moto.server import main as moto_main

    setup = responses.BaseResponse.setup_class
    check = responses.ActionAuthenticatorMixin._authenticate_and_authorize_action

    def setup_class(self, request, full_url, headers, *args, **kwargs):
        setup(self, request, full_url, headers, *args, **kwargs)
        environ = getattr(request, "environ", None) or {}
        self._dflash_raw_uri = environ.get("RAW_URI")

    def authenticate(self, *args, **kwargs):
        raw = getattr(self, "_dflash_raw_uri", None)
        if not raw:
            return check(self, *args, **kwargs)
        uri, self.uri = self.uri, "http://moto" + raw
        try:
            return check(self, *args, **kwargs)
        finally:
            self.uri = uri

    responses.BaseResponse.setup_class = setup_class
    responses.ActionAuthenticatorMixin._authenticate_and_authorize_action = authenticate
    moto_main(["-H", "127.0.0.1", "-p", str(port)])


def moto_available():
    try:
        import moto.server  # noqa: F401
        import boto3  # noqa: F401
        return True
    except ImportError:
        return False


class S3Env:
    """moto (IAM-checked) + proxy; `env` holds the variables listed above."""

    def __init__(self):
        import boto3
        self.port = free_port()
        self.moto = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "moto", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.direct = f"http://127.0.0.1:{self.port}"
        self.wait_ready()
        admin = dict(endpoint_url=self.direct, region_name=REGION,
                     aws_access_key_id="AKIAADMIN000000000", aws_secret_access_key="admin")
        iam = boto3.client("iam", **admin)
        allow = json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:*", "sts:AssumeRole"], "Resource": "*"}]})
        iam.create_user(UserName="writer")
        iam.put_user_policy(UserName="writer", PolicyName="all", PolicyDocument=allow)
        key = iam.create_access_key(UserName="writer")["AccessKey"]
        iam.create_user(UserName="nobody")
        deny = iam.create_access_key(UserName="nobody")["AccessKey"]
        trust = json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]})
        role = iam.create_role(RoleName="worker", AssumeRolePolicyDocument=trust)["Role"]
        iam.put_role_policy(RoleName="worker", PolicyName="all", PolicyDocument=allow)
        sts = boto3.client("sts", **admin)
        temp = sts.assume_role(RoleArn=role["Arn"], RoleSessionName="test")["Credentials"]
        self.bucket = "dflash-test"
        # From here on every request must be signed by a known key.
        urllib.request.urlopen(urllib.request.Request(
            self.direct + "/moto-api/reset-auth", data=b"0", method="POST",
            headers={"Content-Type": "text/plain"})).read()
        s3 = boto3.client("s3", endpoint_url=self.direct, region_name=REGION,
                          aws_access_key_id=key["AccessKeyId"],
                          aws_secret_access_key=key["SecretAccessKey"])
        s3.create_bucket(Bucket=self.bucket)
        self.proxy = Proxy(self.port)
        self.env = {
            "AWS_ENDPOINT_URL": self.proxy.url,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_REGION": REGION,
            "DFLASH_TEST_S3_BUCKET": self.bucket,
            "DFLASH_TEST_S3_DIRECT": self.direct,
            "DFLASH_TEST_S3_DENY_KEY": deny["AccessKeyId"],
            "DFLASH_TEST_S3_DENY_SECRET": deny["SecretAccessKey"],
            "DFLASH_TEST_S3_SESSION_KEY": temp["AccessKeyId"],
            "DFLASH_TEST_S3_SESSION_SECRET": temp["SecretAccessKey"],
            "DFLASH_TEST_S3_SESSION_TOKEN": temp["SessionToken"],
            "DFLASH_TEST_S3_FAULTS": self.proxy.url + "/__faults__",
        }
        for k in ("AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION",
                  "DFLASH_S3_ADDRESSING", "DFLASH_S3_TRACE"):
            self.env[k] = ""

    def wait_ready(self):
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.moto.poll() is not None:
                raise RuntimeError("moto server exited at start")
            try:
                urllib.request.urlopen(self.direct + "/moto-api/", timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto server did not start within 30 s")

    def close(self):
        self.proxy.stop()
        self.moto.terminate()
        try:
            self.moto.wait(10)
        except subprocess.TimeoutExpired:
            self.moto.kill()


def main(argv):
    if len(argv) == 3 and argv[1] == "moto":
        serve_moto(int(argv[2]))
        return 0
    if len(argv) < 3 or argv[1] != "run":
        print(__doc__, file=sys.stderr)
        return 2
    if not moto_available():
        print("SKIP: moto[server] is not installed (pip install -r scripts/requirements.txt)")
        return 77
    env = S3Env()
    try:
        child = dict(os.environ)
        child.update(env.env)
        return subprocess.call(argv[2:], env=child)
    finally:
        env.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
