"""`trtspec serve --replicas N`: the same OpenAI app on Ray Serve (`pip install 'trtspec[ray]'`).

One application, three deployments:

    Api       the ingress: app.py's FastAPI app (API key, bodies, errors, SSE), whose engine is
              `Replicas`: a request's events come from an Engine replica through a deployment handle
    Engine    N replicas (fixed, or autoscaled on ongoing requests): each loads the engine folder and
              runs a Worker (worker.py: its own scheduler and KV slots) and streams a request's events
    Metrics   one replica: the Engine replicas' Prometheus texts, pushed every second, for Api's /metrics

Ray Serve routes each call to the Engine replica with the shortest queue, holds requests beyond
every replica's `max_ongoing_requests` (their KV slots) in its own queue, restarts a replica that
dies, and drains replicas on scale-down and shutdown. A replica that dies before a request's first
token (queued, or prefilling) costs nothing the client saw: Replicas runs it again elsewhere; one
that dies mid-answer ends that answer with an OpenAI error (503 replica_failed), never a hang.

`build(args)` is the application builder, for the CLI and for a Ray Serve config file alike
(`import_path: trtspec.serve.ray_serve:build`, docs/ray.md). Ray is imported here only.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass

import ray
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException

from ..errors import TrtspecError
from .protocol import ApiError

APP = "trtspec"
ATTEMPTS = 3                 # runs of a request whose replica died before its first token
PUSH_EVERY = 1.0             # seconds between a replica's metrics pushes
INGRESS_ONGOING = 1024      # requests the ingress follows at once (they wait for Engine slots in Ray Serve's queue)
STALE_AFTER = 5.0            # a replica silent this long is gone from /metrics and /health


@dataclass
class Settings:
    """What `trtspec serve` options mean on Ray (the `args` of a config file's application)."""
    engines: str                          # the engine folder: the same path on every node (shared storage)
    model: str | None = None              # the id clients send; default the config's name
    backend: str | None = None
    threads: int = 1                      # per Engine replica (also its Ray num_cpus)
    max_batch: int | None = None          # KV slots per replica; default the config's slots
    max_queue: int = 64                   # requests Ray holds beyond the replicas' slots (then 429)
    prefix_cache: int | None = None
    strategy: str | None = None
    allowed: tuple[str, ...] | None = None
    timeout: float | None = None
    history: str = "shared"
    api_key: str | None = None
    max_body: int = 4 << 20
    body_timeout: float = 30.0
    drain_timeout: float = 30.0
    replicas: int = 1
    min_replicas: int | None = None       # with max_replicas: autoscaled between them
    max_replicas: int | None = None
    target_ongoing: float | None = None   # requests per replica the autoscaler aims at; default its slots


def _loopback_only() -> None:
    """On a loopback node (a local instance: `serve --replicas` without --ray-address), keep this
    replica's inter-deployment gRPC server on 127.0.0.1 too: Ray Serve 2.60 binds it to [::] whatever
    the node's address (serve/_private/replica.py), though every other Ray server here is loopback."""
    import ray._common.network_utils as net
    from ray.serve._private import replica
    if not net.is_localhost(ray.util.get_node_ip_address()) or getattr(replica, "_trtspec_loopback", False):
        return
    bind = replica.add_port_to_grpc_server
    replica.add_port_to_grpc_server = lambda server, address: bind(server, address.replace("[::]", "127.0.0.1"))
    replica._trtspec_loopback = True


def _open(s: Settings):
    from ..assembly.load import open_folder
    from ..runtime.strategies import STRATEGIES
    manifest, cfg, backend = open_folder(s.engines, s.backend)
    allowed = tuple(s.allowed) if s.allowed else tuple(
        n for n in STRATEGIES if cfg.draft is not None or not STRATEGIES[n].needs_draft)
    return manifest, cfg, backend, s.strategy or cfg.strategy, allowed


class Engine:
    """An Engine replica: a Worker over its own copy of the engines, pushing its metrics to the hub."""

    def __init__(self, settings: dict, hub):
        from ..assembly.load import load_generator
        from .worker import Worker
        _loopback_only()
        s = Settings(**settings)
        _, _, backend, strategy, allowed = _open(s)
        self.name = serve.get_replica_context().replica_id.unique_id
        gen = load_generator(s.engines, backend=backend, threads=s.threads, slots=s.max_batch,
                             max_queue=s.max_queue, prefix_cache=s.prefix_cache)
        self.worker = Worker(gen, strategy=strategy, allowed=allowed, timeout=s.timeout, history=s.history,
                             replica=self.name)
        self.worker.warm_up()
        self.hub, self._stop = hub, threading.Event()
        self._pusher = threading.Thread(target=self._push, name="trtspec-metrics-push", daemon=True)
        self._pusher.start()

    def _push(self) -> None:
        while not self._stop.wait(PUSH_EVERY):
            try:
                self.hub.push.remote(self.name, self.worker.metrics.render(), self.worker.load()).result(timeout_s=5)
            except Exception:                        # noqa: BLE001 - the hub restarting: push again next time
                pass

    async def generate(self, body, prompt_ids: list[int]):
        async for event in self.worker.generate(body, prompt_ids):
            yield event

    def check_health(self) -> None:                  # Ray Serve's health check (a raise restarts the replica)
        if self.worker.closed or not self._pusher.is_alive():
            raise RuntimeError(f"replica {self.name} is closed")

    def __del__(self) -> None:                       # after Ray Serve drained it (scale-down, shutdown)
        if hasattr(self, "worker"):
            self._stop.set()
            try:
                self.hub.forget.remote(self.name)
            except Exception:                        # noqa: BLE001 - the application is going away too
                pass
            self.worker.close()


class Metrics:
    """The hub: each Engine replica's latest metrics text and load, forgotten when it goes quiet."""

    def __init__(self):
        _loopback_only()
        self.replicas: dict[str, tuple[float, bytes, dict]] = {}

    def push(self, name: str, text: bytes, health: dict) -> None:
        self.replicas[name] = (time.monotonic(), text, health)

    def forget(self, name: str) -> None:
        self.replicas.pop(name, None)

    def collect(self) -> list[tuple[str, bytes, dict]]:
        now = time.monotonic()
        self.replicas = {k: v for k, v in self.replicas.items() if now - v[0] < STALE_AFTER}
        return sorted((name, text, health) for name, (_, text, health) in self.replicas.items())


class Replicas:
    """Api's engine (app.Service.engine): a request's events from an Engine replica, with retries."""

    def __init__(self, engine, hub, settings: Settings):
        from ..assembly.load import load_tokenizer
        manifest, cfg, backend, self.strategy, self.allowed = _open(settings)
        self.tokenizer = load_tokenizer(settings.engines, manifest)
        self.capacity, self.backend, self.model = cfg.max_seq_len, backend, settings.model or cfg.name
        self.engine, self.hub = engine.options(stream=True), hub
        self.ongoing = 0                             # requests this ingress is following (drain waits for 0)

    async def generate(self, body, prompt_ids: list[int]):
        self.ongoing += 1
        try:
            async for event in self._generate(body, prompt_ids):
                yield event
        finally:
            self.ongoing -= 1

    async def _generate(self, body, prompt_ids: list[int]):
        if len(prompt_ids) >= self.capacity:        # never fits: a 400 now, not a wait in Ray's queue or a 429
            yield ("error", -1, ApiError(400, f"the prompt's {len(prompt_ids)} tokens leave no room in the "
                                         f"{self.capacity}-token context; shorten the prompt",
                                         param="messages" if hasattr(body, "messages") else "prompt",
                                         code="context_length_exceeded").state())
            return           # (one that fits with fewer new tokens is the replica's to refuse, as in one process)
        for attempt in range(1, ATTEMPTS + 1):
            stream = self.engine.generate.remote(body, prompt_ids)
            started, sent = None, False              # "started" held back until the first token: a retry stays unseen
            try:
                async for event in stream:
                    if event[0] == "started":
                        started = event
                        continue
                    if started is not None and not sent:
                        yield started
                    sent = True
                    yield event
                return
            except BackPressureError as e:
                yield ("error", -1, ApiError(429, f"server busy: {e.message}; retry shortly", code="queue_full",
                                             headers={"Retry-After": "1"}).state())
                return
            except (RayActorError, DeploymentUnavailableError) as e:
                if not sent and attempt < ATTEMPTS:  # nothing reached the client: run it elsewhere
                    continue
                why = "mid-answer" if sent else f"before the answer started, {ATTEMPTS} times"
                yield ("error", -1, ApiError(503, f"the replica serving this request died {why} "
                                             f"({type(e).__name__}); send it again", code="replica_failed").state())
                return
            except (RayError, RayServeException) as e:
                yield ("error", -1, ApiError(500, f"generation failed: {type(e).__name__}: {e}",
                                             code="generation_failed").state())
                return
            finally:
                stream.cancel()                      # a client gone: the replica cancels the request

    async def health(self) -> dict:
        loads = [health for _, _, health in await self.hub.collect.remote()]
        return {"replicas": len(loads), **{k: sum(h[k] for h in loads) for k in ("slots", "active", "queued")}}

    async def replica_metrics(self) -> list[tuple[str, bytes]]:
        return [(name, text) for name, text, _ in await self.hub.collect.remote()]

    def close(self) -> None:
        pass                                         # the replicas are Ray Serve's to stop


class Api:
    """The ingress replica: app.py's app over `Replicas`."""

    def __init__(self, engine, hub, settings: dict):
        from .app import Service
        _loopback_only()
        s = Settings(**settings)
        replicas = Replicas(engine, hub, s)
        self.svc = Service(replicas, model=replicas.model, api_key=s.api_key,
                           backend=replicas.backend, max_body=s.max_body, body_timeout=s.body_timeout)

    def drain(self) -> int:
        """Shutdown begins: new requests get 503 (/health: draining); returns the requests still running."""
        self.svc.draining = True
        return self.svc.engine.ongoing

    def __serve_build_asgi_app__(self):
        from .app import make_app
        return make_app(self.svc)


def replica_range(s: Settings) -> tuple[int, int, int]:
    """(min, initial, max) Engine replicas: all three `replicas`, unless autoscaled."""
    if s.min_replicas is None and s.max_replicas is None:
        return s.replicas, s.replicas, s.replicas
    low = s.min_replicas if s.min_replicas is not None else 1
    high = s.max_replicas if s.max_replicas is not None else max(low, s.replicas)
    return low, min(max(s.replicas, low), high), high


def deployment_options(s: Settings, slots: int) -> dict:
    """Engine's Ray Serve options: fixed replicas, or autoscaling on ongoing requests (its slots)."""
    opts = {"ray_actor_options": {"num_cpus": s.threads}, "max_ongoing_requests": slots,
            "max_queued_requests": s.max_queue, "graceful_shutdown_timeout_s": s.drain_timeout,
            "graceful_shutdown_wait_loop_s": 0.5, "health_check_period_s": 5.0,
            "max_constructor_retry_count": 3}            # a replica that cannot load fails the deploy soon
    low, initial, high = replica_range(s)
    if s.min_replicas is None and s.max_replicas is None:
        return opts | {"num_replicas": initial}
    return opts | {"autoscaling_config": {
        "min_replicas": low, "max_replicas": high, "initial_replicas": initial,
        "target_ongoing_requests": s.target_ongoing or slots, "upscale_delay_s": 5.0, "downscale_delay_s": 30.0}}


def build(args: dict):
    """The application builder (`serve run trtspec.serve.ray_serve:build engines=DIR`, or a config
    file's import_path and args): Settings' fields as args."""
    s = Settings(**args)
    s.api_key = s.api_key or os.environ.get("TRTSPEC_API_KEY")    # as `trtspec serve --api-key`'s variable
    _, cfg, _, _, _ = _open(s)
    slots = s.max_batch or cfg.slots
    plain = asdict(s)
    light = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": INGRESS_ONGOING}
    hub = serve.deployment(Metrics, name="Metrics", **light).bind()
    engine = serve.deployment(Engine, name="Engine", **deployment_options(s, slots)).bind(plain, hub)
    api = serve.deployment(serve.ingress()(Api), name="Api", graceful_shutdown_timeout_s=s.drain_timeout,
                           graceful_shutdown_wait_loop_s=0.5, **light)
    return api.bind(engine, hub, plain)


def _fits_here(s: Settings) -> None:
    """A local instance: every replica (at most max_replicas) needs its cores and its memory here;
    one line before Ray starts, rather than replicas Ray cannot place or that fail to load."""
    from ..assembly.load import check_fits
    most = replica_range(s)[2]
    if s.threads * most > (os.cpu_count() or 1):
        raise TrtspecError(f"{most} replicas × --threads {s.threads} need {s.threads * most} CPUs; this machine "
                           f"has {os.cpu_count()}: lower --threads or the replicas")
    manifest, cfg, _, _, _ = _open(s)
    try:
        check_fits(s.engines, manifest, cfg, s.max_batch, s.prefix_cache, copies=most)
    except TrtspecError as e:
        raise TrtspecError(f"{most} replicas share this machine's memory, each a copy of the engines: {e}"
                           if most > 1 else str(e)) from None


def _reachable(address: str) -> None:
    """A HOST:PORT that refuses connections is one line now, not minutes of Ray's retries."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return                                       # `auto`, or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise TrtspecError(f"cannot join the Ray cluster at {address}: {e.strerror or e}; start one there "
                           "(`ray start --head --port PORT`) or check --ray-address") from None


def _start_ray(settings: Settings, ray_address: str | None) -> None:
    """A local instance (loopback, its replicas checked against this machine first), or join a cluster."""
    if ray_address is None:
        _fits_here(settings)
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        return
    _reachable(ray_address)
    try:
        ray.init(address=ray_address, log_to_driver=False, configure_logging=False)
    except Exception as e:                           # noqa: BLE001 - Ray's ConnectionError, AuthenticationError, ...
        chain = [e]
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)
        why = ("it refused this client's authentication" if "InvalidAuthToken" in " ".join(map(str, chain))
               else (str(e).strip().splitlines() or [type(e).__name__])[0][:200])
        raise TrtspecError(f"cannot join the Ray cluster at {ray_address} ({why}); check the address (`ray start "
                           "--head` prints it) and, if the cluster uses token authentication, set RAY_AUTH_MODE=token "
                           "with its token (~/.ray/auth_token or RAY_AUTH_TOKEN)") from None


def run(settings: Settings, host: str, port: int, ray_address: str | None, log) -> None:
    """Start (or join, with `ray_address`) Ray, deploy, serve on host:port until SIGTERM / Ctrl-C,
    then drain (new requests refused, running ones finish, at most drain_timeout: Ray Serve's own
    shutdown would cut them) and stop what we started."""
    stop, local, previous = threading.Event(), ray_address is None, {}
    try:
        _start_ray(settings, ray_address)
        # after ray.init, whose core installs its own SIGTERM handler (a crash report, then abort)
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
        t0 = time.perf_counter()
        try:
            serve.run(build(asdict(settings)), name=APP, route_prefix="/", blocking=False)
        except RuntimeError as e:                    # a replica failed to start: Ray Serve's logs say why
            raise TrtspecError(f"Ray Serve could not start the replicas ({str(e).strip().splitlines()[-1]}); their "
                               "logs: logs/serve in the Ray session folder (/tmp/ray/session_latest here)") from None
        shown = f"[{host}]" if ":" in host else host
        log(f"serving on Ray Serve ({'local instance' if local else ray_address}): replicas ready in "
            f"{time.perf_counter() - t0:.1f}s, on http://{shown}:{port}/v1")
        while not stop.wait(0.5):
            pass
        log("draining")
        api, deadline = serve.get_app_handle(APP), time.monotonic() + settings.drain_timeout
        while api.drain.remote().result(timeout_s=10) and time.monotonic() < deadline:
            time.sleep(0.1)                          # running requests finish (Ray Serve's shutdown would cut them)
    finally:
        try:
            if ray.is_initialized() and not local:   # a local instance goes whole with ray.shutdown()
                serve.delete(APP)
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    log("stopped")
