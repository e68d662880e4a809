"""TLS for ``staronnx serve`` (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``): one certificate
and key for every listener (KServe v2 HTTP, gRPC and the metrics endpoint), and, with a client CA,
mutual TLS: a client must present a certificate that CA signed, on every protocol.

Why one setting for the three: they listen on the same host, for the same clients and operators;
a server exposed with TLS on one port and plain text on another would leak what TLS protects
(the metrics name the models and their traffic). With TLS a ``--host`` other machines reach no
longer needs ``--insecure``: the traffic is encrypted, and with a client CA only holders of its
certificates get an answer (without one, anyone who reaches the port can still run the models:
the start line says so).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from staronnx.errors import StaronnxError


@dataclass(frozen=True)
class Tls:
    """The server's certificate chain and key (PEM files), and the CA its clients' certificates
    must chain to (None: clients are not asked for one)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @classmethod
    def load(cls, cert: Path | None, key: Path | None, client_ca: Path | None) -> Tls | None:
        """The files the flags name, checked now (a pair that does not load is one error naming
        the flags, before anything listens); None where no TLS is asked for."""
        if cert is None and key is None:
            if client_ca is not None:
                raise StaronnxError("--tls-client-ca goes with --tls-cert and --tls-key (mutual TLS needs the "
                                    "server's own certificate)")
            return None
        if cert is None or key is None:
            raise StaronnxError("--tls-cert and --tls-key go together: give the certificate (PEM) and its key")
        tls = cls(cert, key, client_ca)
        try:
            tls.ssl_context()
        except OSError as exc:  # ssl.SSLError is an OSError too
            raise StaronnxError(f"--tls-cert {cert}, --tls-key {key}"
                                + (f", --tls-client-ca {client_ca}" if client_ca else "")
                                + f": cannot be loaded as PEM certificates and key: {exc}") from None
        return tls

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def ssl_context(self) -> ssl.SSLContext:
        """The HTTP listeners' context: TLS 1.2 or later, the client's certificate required with a CA."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        if self.client_ca is not None:
            ctx.load_verify_locations(str(self.client_ca))
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def grpc_credentials(self) -> Any:
        """The gRPC listener's credentials (the same pair; the client CA's certificate required)."""
        import grpc

        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca is not None else None,
            require_client_auth=self.mutual)

    def words(self) -> str:
        """What the start line says of it."""
        return (f"TLS with client certificates (mutual TLS): only clients holding a certificate of {self.client_ca} "
                "are answered" if self.mutual else
                "TLS without client certificates: anyone who reaches the ports can run the models")
