"""TLS, mutual TLS and caller identity for every kvdir gRPC server and client.

Modes (docs/security.md):

- plain (the default, for the local demo): no TLS, no identities; the daemons
  log a loud warning at start.
- secure (``[tls]`` configured): the server speaks TLS only and every call
  must carry an identity, from one or both of
  - a client certificate signed by the cluster CA: identity = its subject CN;
  - a bearer token ``<identity>.<secret>`` (``authorization`` metadata), checked
    against the server's tokens file with a constant-time compare.
  A call presenting both must name one identity in both.

`ServerSecurity.interceptor()` authenticates every call (grpc.health.v1
stays open, for probes) and makes the identity available to handlers through
`current_identity()`; handlers authorise with `authorize_node`. The same
interceptor turns a request that is not a valid protobuf of its method's
type into INVALID_ARGUMENT (gRPC's own answer is INTERNAL), in both modes.

Exception tree::

    SecurityConfigError (ValueError)   unusable settings; the message says which
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ipaddress
import logging
import ssl
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

log = logging.getLogger("kvdir.security")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
"""Probes (kubelet, systemd's wait-ready) need no identity; they reveal only SERVING."""
TOKEN_BYTES_MAX = 4096
RAFT_PASSWORD_CHARS_MIN = 16
"""A Raft password shorter than this is refused: it is the only thing between
the Raft port and `pickle.loads` (docs/security.md)."""
TOKENS_MAX = 100_000
IDENTITY_BYTES_MAX = 253
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED

_IDENTITY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvdir_identity", default=None
)


class SecurityConfigError(ValueError):
    """Security settings that cannot work; the message names the setting."""


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """The ``[tls]`` section: this process's certificate and the cluster CA."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    require_client_cert: bool = True
    """Servers: refuse a TLS handshake without a client certificate from `ca`."""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def check(self) -> None:
        if self.enabled and not (self.cert and self.key and self.ca):
            raise SecurityConfigError("[tls] needs all of cert, key and ca")


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """The ``[auth]`` section: tokens and who may act for every node."""

    token_file: str = ""
    """Clients: a file holding this process's own ``<identity>.<secret>`` token."""
    tokens_file: str = ""
    """Servers: a TOML file of ``identity = "secret"`` lines that tokens are checked against."""
    admins: tuple[str, ...] = ()
    """Identities that may write for any node (an operator's kvdir ctl)."""
    raft_password_file: str = ""
    """Directory only: the shared secret that encrypts Raft traffic."""


def read_secret(path: str, what: str) -> str:
    """The first line of a secret file, stripped; refused when empty or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read(TOKEN_BYTES_MAX + 1).strip()
    except OSError as e:
        raise SecurityConfigError(f"cannot read {what} {path}: {e.strerror}") from e
    if not value or len(value) > TOKEN_BYTES_MAX or "\n" in value:
        raise SecurityConfigError(f"{what} {path} must hold one non-empty line")
    return value


def read_raft_password(path: str) -> str:
    """The Raft password in `path`; refused when shorter than `RAFT_PASSWORD_CHARS_MIN`."""
    value = read_secret(path, "raft password file")
    if len(value) < RAFT_PASSWORD_CHARS_MIN:
        raise SecurityConfigError(
            f"raft password file {path} holds {len(value)} characters, fewer than "
            f"{RAFT_PASSWORD_CHARS_MIN}: use a random secret "
            "(e.g. `head -c 24 /dev/urandom | base64`)"
        )
    return value


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT (or a bare host) names only this machine: 127.0.0.0/8, ::1
    or "localhost". Any other name may resolve to a reachable address."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    host = host.removeprefix("[").split("]")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_tokens(path: str) -> dict[str, str]:
    """identity -> secret from a tokens file (TOML: ``node-a = "secret"``)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise SecurityConfigError(f"cannot read tokens file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise SecurityConfigError(f"tokens file {path} is not valid TOML: {e}") from e
    if len(raw) > TOKENS_MAX:
        raise SecurityConfigError(f"tokens file {path} has over {TOKENS_MAX} entries")
    out: dict[str, str] = {}
    for ident, secret in raw.items():
        if not isinstance(secret, str) or not secret or "." in ident:
            raise SecurityConfigError(
                f"tokens file {path}: {ident!r} needs a non-empty string secret "
                "(identities contain no '.')"
            )
        out[ident] = secret
    return out


def ssl_contexts(tls: TlsConfig) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts of the same certificate, for non-gRPC TLS (the tcp
    data plane). The server requires a client certificate from `ca` when
    `require_client_cert` is set; the client verifies the server's name."""
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(tls.cert, tls.key)
        server.load_verify_locations(tls.ca)
        server.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.load_cert_chain(tls.cert, tls.key)
        client.load_verify_locations(tls.ca)
    except (OSError, ssl.SSLError) as e:
        raise SecurityConfigError(f"cannot load [tls] files for the tcp data plane: {e}") from e
    return server, client


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SecurityConfigError(f"cannot read {what} {path}: {e.strerror}") from e


def check(tls: TlsConfig, auth: AuthConfig) -> None:
    """Refuse combinations that would leave nobody (or everybody) able to call."""
    tls.check()
    if auth.tokens_file and not tls.enabled:
        raise SecurityConfigError("[auth] tokens_file needs [tls]: tokens never travel in clear")
    if auth.token_file and not tls.enabled:
        raise SecurityConfigError("[auth] token_file needs [tls]: tokens never travel in clear")
    if tls.enabled and not tls.require_client_cert and not auth.tokens_file:
        raise SecurityConfigError(
            "[tls] require_client_cert = false needs [auth] tokens_file (else nobody can "
            "authenticate)"
        )


# ------------------------------------------------------------------ identity


def current_identity() -> str | None:
    """The authenticated caller of the RPC being handled (None in plain mode)."""
    return _IDENTITY.get()


def may_act_for(identity: str | None, node_id: str, admins: Iterable[str]) -> bool:
    """A caller acts for its own node and the node's engine holders (``<node>/...``)."""
    if identity is None:
        return True  # plain mode: the interceptor let an anonymous call through
    return identity == node_id or node_id.startswith(identity + "/") or identity in admins


def authorize_node(context: grpc.ServicerContext, node_id: str, admins: Iterable[str]) -> None:
    """PERMISSION_DENIED unless the caller may write for `node_id`."""
    ident = current_identity()
    if not may_act_for(ident, node_id, admins):
        context.abort(
            PERMISSION_DENIED,
            f"caller {ident!r} may not act for node {node_id!r} "
            "(a node writes only its own entries)",
        )


def authorize_admin(context: grpc.ServicerContext, admins: Iterable[str], what: str) -> None:
    """PERMISSION_DENIED unless the caller is an admin (anyone in plain mode).

    Membership changes and backups are cluster-wide: a node's identity, which
    may write only its own entries, must not reach them.
    """
    ident = current_identity()
    if ident is not None and ident not in admins:
        context.abort(
            PERMISSION_DENIED,
            f"caller {ident!r} may not {what} (only the [auth] admins identities may)",
        )


@dataclass(frozen=True, slots=True)
class _Malformed:
    """A request that did not parse; the handler wrapper answers INVALID_ARGUMENT."""

    reason: str


class ServerSecurity:
    """What one gRPC server needs: its port credentials and the interceptor."""

    def __init__(self, tls: TlsConfig, auth: AuthConfig, name: str) -> None:
        check(tls, auth)
        self.tls = tls
        self.auth = auth
        self.name = name
        self.admins = frozenset(auth.admins)
        self.tokens = read_tokens(auth.tokens_file) if auth.tokens_file else {}
        self._creds: grpc.ServerCredentials | None = None
        if tls.enabled:
            self._creds = grpc.ssl_server_credentials(
                [(_read(tls.key, "TLS key"), _read(tls.cert, "TLS certificate"))],
                root_certificates=_read(tls.ca, "CA certificate"),
                require_client_auth=tls.require_client_cert,
            )

    @property
    def enabled(self) -> bool:
        return self._creds is not None

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Listen on `address`: TLS when configured, else plain with a loud warning."""
        if self._creds is not None:
            return server.add_secure_port(address, self._creds)
        log.warning(
            "%s serves gRPC WITHOUT TLS or authentication on %s: anyone who can reach it "
            "can read and write the cache index (set [tls]; docs/security.md)",
            self.name,
            address,
            extra={"address": address, "security": "plain"},
        )
        return server.add_insecure_port(address)

    def interceptor(self) -> grpc.ServerInterceptor[Any, Any]:
        return _Interceptor(self)

    # ------------------------------------------------------------ authenticate

    def authenticate(self, context: grpc.ServicerContext) -> str | None:
        """The caller's identity; aborts UNAUTHENTICATED on bad or missing credentials."""
        if not self.enabled:
            return None
        cert_id = _cert_identity(context)
        bearer = _bearer(context)
        if bearer is not None:
            ident = self._check_token(bearer, context)
            if cert_id is not None and cert_id != ident:
                context.abort(
                    UNAUTHENTICATED,
                    f"the token names {ident!r} but the client certificate names {cert_id!r}",
                )
            return ident
        if cert_id is not None:
            return cert_id
        context.abort(
            UNAUTHENTICATED,
            "no credentials: present a client certificate signed by the cluster CA "
            "or a bearer token",
        )
        raise AssertionError("unreachable")  # context.abort raises

    def _check_token(self, token: str, context: grpc.ServicerContext) -> str:
        ident, dot, secret = token.partition(".")
        expected = self.tokens.get(ident) if dot else None
        # Compare digests of equal length so neither the secret's length nor its
        # first differing byte shows in the timing; unknown identities compare too.
        want = hashlib.sha256((expected or "\x00unknown").encode()).digest()
        got = hashlib.sha256(secret.encode()).digest()
        if not hmac.compare_digest(want, got) or expected is None:
            context.abort(UNAUTHENTICATED, "bearer token rejected (unknown identity or secret)")
        return ident


def _cert_identity(context: grpc.ServicerContext) -> str | None:
    names = context.auth_context().get("x509_common_name")
    if not names or isinstance(names, bytes):
        return None
    cn = names[0].decode("utf-8", "replace")
    return cn or None  # an empty CN names nobody (it would prefix-match every "/..." id)


def _bearer(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key == "authorization":
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token or len(token) > TOKEN_BYTES_MAX:
                context.abort(UNAUTHENTICATED, "authorization metadata is not 'Bearer <token>'")
            return token
    return None


def _tolerant(deserialize: Callable[[bytes], Any] | None, what: str) -> Callable[[bytes], Any]:
    """A request deserializer that reports garbage as a value instead of raising."""

    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except Exception as e:  # protobuf's DecodeError, RecursionError on deep nesting, ...
            return _Malformed(f"request is not a valid {what}: {type(e).__name__}: {e}"[:500])

    return parse


if TYPE_CHECKING:
    _InterceptorBase = grpc.ServerInterceptor[Any, Any]
else:  # grpc's classes are generic only in the stubs
    _InterceptorBase = grpc.ServerInterceptor


class _Interceptor(_InterceptorBase):
    def __init__(self, security: ServerSecurity) -> None:
        self.security = security

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None:
            return None
        method: str = details.method
        open_call = method.startswith(HEALTH_PREFIX)
        return _wrap(handler, self.security, open_call, method.rsplit("/", 1)[-1])


def _with_identity(ident: str | None, call: Callable[[], Any]) -> Any:
    token = _IDENTITY.set(ident)
    try:
        return call()
    finally:
        _IDENTITY.reset(token)


def _stepped(ident: str | None, responses: Iterable[Any]) -> Iterator[Any]:
    """`responses` with the caller's identity set around every step.

    A streaming handler's body runs when gRPC pulls each response, long after
    the handler returned its generator, so the identity must be in place for
    each pull, not just for the call that made the generator.
    """
    it = _with_identity(ident, lambda: iter(responses))
    while True:
        try:
            item = _with_identity(ident, lambda: next(it))
        except StopIteration:
            return
        yield item


def _wrap(
    handler: grpc.RpcMethodHandler[Any, Any], security: ServerSecurity, open_call: bool, what: str
) -> grpc.RpcMethodHandler[Any, Any]:
    def caller(request: Any, context: grpc.ServicerContext) -> str | None:
        ident = None if open_call else security.authenticate(context)
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return ident

    def guard(behavior: Callable[..., Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            ident = caller(request, context)
            return _with_identity(ident, lambda: behavior(request, context))

        return run

    def guard_stream(behavior: Callable[..., Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            ident = caller(request, context)
            return _stepped(ident, _with_identity(ident, lambda: behavior(request, context)))

        return run

    deser = _tolerant(handler.request_deserializer, f"{what} request")
    ser = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(guard(handler.unary_unary), deser, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(guard_stream(handler.unary_stream), deser, ser)

    def streamed(behavior: Callable[..., Any], out_stream: bool) -> Callable[..., Any]:
        def run(requests: Any, context: grpc.ServicerContext) -> Any:
            ident = None if open_call else security.authenticate(context)
            result = _with_identity(ident, lambda: behavior(_checked(requests, context), context))
            return _stepped(ident, result) if out_stream else result

        return run

    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            streamed(handler.stream_unary, False), deser, ser
        )
    assert handler.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(streamed(handler.stream_stream, True), deser, ser)


def _checked(requests: Iterable[Any], context: grpc.ServicerContext) -> Iterable[Any]:
    for r in requests:
        if isinstance(r, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, r.reason)
        yield r


# -------------------------------------------------------------------- client


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """How a client (agent, ctl, tests) reaches kvdir servers.

    Empty: plain channels. `ca` set: TLS, verifying servers against it, with
    `cert`/`key` as the client certificate and `token` as a bearer token.
    """

    ca: str = ""
    cert: str = ""
    key: str = ""
    token: str = ""
    server_name: str = ""
    """Override the name checked against server certificates (tests, IP-only SANs)."""

    def __post_init__(self) -> None:
        if (self.cert or self.key or self.token) and not self.ca:
            raise SecurityConfigError("a client certificate or token needs --ca (TLS)")
        if bool(self.cert) != bool(self.key):
            raise SecurityConfigError("a client certificate needs both cert and key")

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    @classmethod
    def from_config(cls, tls: TlsConfig, auth: AuthConfig) -> ClientSecurity:
        """A daemon's client side: its own certificate (and token) toward its peers."""
        token = read_secret(auth.token_file, "token file") if auth.token_file else ""
        return cls(tls.ca, tls.cert, tls.key, token)

    def _secure(
        self, options: Sequence[tuple[str, Any]]
    ) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
        opts = list(options)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA certificate"),
            private_key=_read(self.key, "TLS key") if self.key else None,
            certificate_chain=_read(self.cert, "TLS certificate") if self.cert else None,
        )
        if self.token:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(self.token)
            )
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return creds, opts

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        if not self.enabled:
            return grpc.insecure_channel(target, options=list(options))
        creds, opts = self._secure(options)
        return grpc.secure_channel(target, creds, options=opts)

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """The same, for asyncio clients (the gateway)."""
        if not self.enabled:
            return grpc.aio.insecure_channel(target, options=list(options))
        creds, opts = self._secure(options)
        return grpc.aio.secure_channel(target, creds, options=opts)


PLAIN = ClientSecurity()
