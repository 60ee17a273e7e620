"""servewell's OTLP/HTTP exporter against real HTTP(S) endpoints: it posts what the SDK encoder
would, with the standard variables' headers, compression and certificates; retries what the
specification says to retry; gives up within its timeout; and logs failures without flooding."""

from __future__ import annotations

import gzip
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from otlp_spans import make_spans
from servewell.observability.otlp import OtlpHttpSpanExporter


class Receiver:
    """An OTLP/HTTP endpoint that answers each POST with the next status in `statuses`."""

    def __init__(self, statuses: list[int]) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.bodies.append(raw)
                receiver.headers.append(dict(self.headers))
                status = statuses.pop(0) if statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_exporter_posts_gzip_with_headers_and_retries_what_is_retryable():
    spans = make_spans()
    receiver = Receiver([503, 200, 400])
    exporter = OtlpHttpSpanExporter(receiver.url, 2.0, {"authorization": "Bearer t"}, "gzip")
    try:
        assert exporter.export(spans) == SpanExportResult.SUCCESS  # 503, then 200
        assert len(receiver.bodies) == 2
        decoded = ExportTraceServiceRequest.FromString(gzip.decompress(receiver.bodies[-1]))
        assert decoded == sdk_encode_spans(spans)
        assert receiver.headers[-1]["authorization"] == "Bearer t"
        assert receiver.headers[-1]["Content-Type"] == "application/x-protobuf"
        assert exporter.export(spans) == SpanExportResult.FAILURE  # 400: not retried
        assert len(receiver.bodies) == 3
    finally:
        exporter.shutdown()
        receiver.server.shutdown()


def test_exporter_gives_up_on_an_unreachable_collector_within_its_timeout():
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(1)  # accepts into the backlog, never reads
    exporter = OtlpHttpSpanExporter(f"http://127.0.0.1:{blackhole.getsockname()[1]}/v1/traces", timeout_s=0.5)
    try:
        started = time.monotonic()
        assert exporter.export(make_spans()) == SpanExportResult.FAILURE
        assert time.monotonic() - started < 2.0
    finally:
        exporter.shutdown()
        blackhole.close()


def test_failures_are_logged_once_a_minute_with_what_was_dropped(caplog):
    receiver = Receiver([400, 400, 400])
    exporter = OtlpHttpSpanExporter(receiver.url, 2.0)
    spans = make_spans()
    try:
        with caplog.at_level("WARNING", logger="servewell.tracing"):
            for _ in range(3):
                assert exporter.export(spans) == SpanExportResult.FAILURE
        reports = [r.getMessage() for r in caplog.records if r.name == "servewell.tracing"]
        assert len(reports) == 1 and "HTTP 400" in reports[0] and f"{len(spans)} spans dropped" in reports[0]
    finally:
        exporter.shutdown()
        receiver.server.shutdown()


def self_signed_certificate(directory):
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_https_collector_configured_by_the_standard_variables(tmp_path, monkeypatch):
    cert, key = self_signed_certificate(tmp_path)
    receiver = Receiver([])
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    receiver.server.socket = server_context.wrap_socket(receiver.server.socket, server_side=True)
    url = receiver.url.replace("http:", "https:")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(cert))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-scope-orgid=tenant%201")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3000")
    exporter = OtlpHttpSpanExporter.from_environment(url)
    spans = make_spans()
    try:
        assert exporter.timeout_s == 3.0  # OTEL_EXPORTER_OTLP_TIMEOUT is in milliseconds
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        assert receiver.headers[-1]["x-scope-orgid"] == "tenant 1"
        assert ExportTraceServiceRequest.FromString(gzip.decompress(receiver.bodies[-1])) == sdk_encode_spans(spans)
    finally:
        exporter.shutdown()
        receiver.server.shutdown()


def test_mutual_tls_collector_takes_the_client_certificate(tmp_path, monkeypatch):
    server_cert, server_key = self_signed_certificate(tmp_path)
    (tmp_path / "client").mkdir()
    client_cert, client_key = self_signed_certificate(tmp_path / "client")
    receiver = Receiver([])
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(server_cert, server_key)
    server_context.verify_mode = ssl.CERT_REQUIRED  # only clients with a certificate it trusts
    server_context.load_verify_locations(client_cert)
    receiver.server.socket = server_context.wrap_socket(receiver.server.socket, server_side=True)
    url = receiver.url.replace("http:", "https:")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(server_cert))
    spans = make_spans()
    anonymous = OtlpHttpSpanExporter.from_environment(url, timeout_s=1.0)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", str(client_cert))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", str(client_key))
    identified = OtlpHttpSpanExporter.from_environment(url)
    try:
        assert anonymous.export(spans) == SpanExportResult.FAILURE
        assert receiver.bodies == []
        assert identified.export(spans) == SpanExportResult.SUCCESS
        assert ExportTraceServiceRequest.FromString(receiver.bodies[-1]) == sdk_encode_spans(spans)
    finally:
        anonymous.shutdown()
        identified.shutdown()
        receiver.server.shutdown()
